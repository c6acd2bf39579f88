"""A jupyter_client ``Session`` that draws from none of the user's random streams (issue 40).

A ``Session`` remembers the signature of every message it accepted, against replays. Past
``digest_history_size`` signatures (65,536) it forgets a random tenth of them with ``random.sample`` --
on the *global* stream, the one a user seeds. Every kernel and client session that carries nbremote's
traffic gets there: a worker kernel's session sees each RPC of the comm path and the driver's session check
(one ``kernel_info_request`` a second), the driver's sessions see their replies. After that, each further
~6,500 messages would move the user's seeded ``random`` once, on a schedule no one can reproduce.

:func:`own_rng` gives one session a generator of its own for that choice (seeded by the OS), with the
rest of the culling unchanged: the same signatures kept and forgotten, in the same proportions.

tornado draws too: a ``PeriodicCallback`` with ``jitter`` picks each delay with ``random.random()``.
gateway_provisioners' response manager runs one every 0.1 ms with a jitter, in the driver, on the loop
that runs provisioners (``_kernels.provisioned``): once an SSH or container provisioner has started a
kernel, the user's seeded stream moved ~10,000 times a second (found by ``test_rng_untouched``'s tracer
late in the suite). :func:`own_tornado_jitter` gives tornado's ioloop module a generator of its own.
"""

from __future__ import annotations

import random
from typing import Any, TypeVar

__all__ = ["own_rng", "own_tornado_jitter"]

S = TypeVar("S")


def own_rng(session: S) -> S:
    """Make ``session`` (a ``jupyter_client.session.Session``) cull its digest history with a private
    generator instead of the global ``random``; returns it. Idempotent."""
    target: Any = session
    if getattr(target, "_nbremote_rng", None) is not None:
        return session
    rng = random.Random()  # seeded from os.urandom, and nobody else's

    def _cull_digest_history() -> None:  # jupyter_client's own, with ``rng`` for ``random``
        current = len(target.digest_history)
        n_to_cull = max(int(current // 10), current - target.digest_history_size)
        if n_to_cull >= current:
            target.digest_history = set()
            return
        target.digest_history.difference_update(rng.sample(tuple(sorted(target.digest_history)), n_to_cull))

    target._nbremote_rng = rng
    target._cull_digest_history = _cull_digest_history
    return session


def own_tornado_jitter() -> None:
    """Make tornado's ``PeriodicCallback`` jitter draw from a private generator instead of the global
    ``random`` (every loop of this process: the jitter stays random, the user's stream is left alone).
    Idempotent."""
    import tornado.ioloop  # jupyter_client's dependency: always there

    if tornado.ioloop.random is random:
        tornado.ioloop.random = random.Random()  # type: ignore[assignment]  # has .random(), as the module has
