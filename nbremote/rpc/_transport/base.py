"""The transport seam: the protocols every way of reaching a kernel implements, and their shared sending half.

``Link`` is one way to reach a peer -- a link this process opened to a kernel, or, in a worker, the way
back to a caller (its comm, or the shell path): the agent sends through it. ``Connection`` is a link to
a kernel of our own, which the IO thread (``iothread``) owns: handshake, liveness, the sockets to poll.
``zmqlink.KernelLink`` and ``wslink.ServerLink`` implement it; ``open_link`` (this package's
``__init__``) picks one from a peer's connection info.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from nbremote.errors import WorkerStartError
from nbremote.rpc._transport.shm import SharedMemory
from nbremote.rpc._transport.switches import switched_on
from nbremote.rpc._wire import batching
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["SESSION_CHECK_INTERVAL", "SHELL_PATH_CHECK", "CallerLink", "Connection", "Link", "OnLost", "OnMessage",
           "Pump", "Queued", "bootstrap_failed", "shell_path_wanted"]

OnMessage = Callable[["Connection", list[tuple[Envelope, list[Buffer]]]], None]
OnLost = Callable[["Connection", str], None]
#: what a blocking call's thread runs to receive its own reply (see ``threadsockets``): ``pump(seconds)``
Pump = Callable[[float], None]

SHELL_PATH_CHECK = 2.0  # s to wait for the shell path's pong before settling for the comm path
# s between checks that the kernel is still the process we bootstrapped: a kernel restarted by someone
# else (same ports, new process) answers the heartbeat but knows nothing of nbremote (see heartbeat())
SESSION_CHECK_INTERVAL = 1.0


def shell_path_wanted() -> bool:
    """``NBREMOTE_SHELL_PATH=0`` keeps every link on the comm path (to compare, or to work around)."""
    return switched_on("NBREMOTE_SHELL_PATH")


def bootstrap_failed(name: str, content: dict[str, Any]) -> WorkerStartError:
    """The error for a bootstrap that failed in the kernel (its ``execute_reply`` content): nbremote's own
    refusal as it is (it says why and what to do), anything else with where to look."""
    if content.get("ename") == "WorkerStartError":
        return WorkerStartError(str(content.get("evalue")), name)
    return WorkerStartError(
        f"bootstrapping worker {name!r} failed: {content.get('ename')}: {content.get('evalue')} "
        "(is nbremote installed in that kernel's environment? `pip install nbremote` there)", name)


class Link(Protocol):
    """One way to reach a peer: a link we opened to its kernel, or a comm it opened on ours."""

    name: str
    same_host: bool  # the peer shares our /dev/shm: big frames may go by shared memory (see ``shm``)

    @property
    def closed(self) -> bool: ...

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        """Queue an envelope to go out with (or before) the next send; frames must not change afterwards."""

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        """Queue an envelope and see that it leaves (from this thread at once when ``now``)."""

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> Pump | None:
        """Send a blocking call on this thread's own socket and return the pump that receives its reply;
        None where the link has no such sockets (then ``send`` it)."""


class Connection(Link, Protocol):
    """The transport seam: what the agent, the driver and the IO thread use of a link to one kernel.

    Two transports implement it: ``zmqlink.KernelLink`` (the kernel's zmq channels) and
    ``wslink.ServerLink`` (a Jupyter server's kernel websocket). The IO thread polls the ``sockets()`` a
    link has and hands what is ``readable`` to it; a ``ServerLink`` has none (a reader thread of its own
    receives), so the IO thread only drains and ticks it (``heartbeat``).
    """

    info: dict[str, Any]
    lost: str | None
    fast: bool
    on_message: OnMessage | None
    on_lost: OnLost | None
    wake: Callable[[], None]
    outbox: batching.Outbox  # what is queued to go out (the IO thread drains a non-empty one on its tick)

    def open(self, caller: str, *, bootstrap: str | None, timeout: float, shm: SharedMemory | None = None,
             ) -> dict[str, Any]: ...

    def drain(self) -> None: ...

    def send_close(self) -> None: ...

    def close(self) -> None: ...

    def heartbeat(self, now: float) -> str | None: ...

    def sockets(self) -> tuple[zmq.Socket[Any], ...]:
        """The sockets the IO thread polls for this link (none: the link receives by itself)."""

    def readable(self, sock: zmq.Socket[Any], now: float) -> str | None:
        """One of ``sockets()`` has input: take it (deliver envelopes to ``on_message``); why the kernel is
        gone, or None."""


class Queued:
    """The sending half both transports share: envelopes queue in an ``outbox`` and leave in batches,
    from the caller's thread (``now``) or from the IO thread once ``wake``d; nothing leaves a lost link."""

    outbox: batching.Outbox
    lost: str | None
    wake: Callable[[], None]

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        """Queue an envelope; frames must not change afterwards. Call ``drain`` (or wake the IO thread)."""
        self.outbox.post(env, frames)

    def drain(self) -> None:
        """Send everything queued (thread-safe: the channel is used under the outbox's lock only)."""
        if self.lost is None:
            self.outbox.drain()

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        """Queue an envelope (thread-safe; frames must not change afterwards) and see that it leaves.

        ``now``: send from this thread at once (a blocking call saves the hop to the IO thread);
        otherwise the IO thread sends it, together with whatever else is queued by then.
        """
        self.post(env, frames)
        if now:
            self.drain()
        else:
            self.wake()


class CallerLink:
    """The sending half of a way back to a caller (a worker's comm channel or shell link to its caller):
    what is posted leaves at once -- nobody else drains such a link -- and there are no sockets of a
    calling thread's own (``send_own_reply`` is None)."""

    outbox: batching.Outbox

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        self.send(env, frames)

    def send_own_reply(self, env: Envelope, frames: Sequence[Buffer]) -> Pump | None:
        del env, frames
        return None

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        raise NotImplementedError
