"""The code the driver runs in a kernel to make it a worker: ``bootstrap(...)``, the first ``execute_request``.

It checks the kernel's jupyter_client first, then installs nbremote's handler (``_worker.install``) under the
worker's name and rank, with the driver's ``sys.path`` and the world it joins.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["MIN_JUPYTER_CLIENT", "bootstrap"]

MIN_JUPYTER_CLIENT = (8, 6)  # what nbremote needs in every kernel (pyproject: jupyter_client>=8.6)

# First in the bootstrap: a kernel whose environment has an older jupyter_client (a gateway's stock kernelspec:
# Enterprise Gateway 3 pins jupyter_client < 7) failed with "No module named 'jupyter_client.provisioning'",
# true but not what its user needs to hear (issue 22).
_KERNEL_CHECK = (
    "import jupyter_client as _nbremote_jc\n"
    "if tuple(int(''.join(c for c in p if c.isdigit()) or 0) for p in _nbremote_jc.__version__.split('.')[:2]) "
    f"< {MIN_JUPYTER_CLIENT!r}:\n"
    "    raise ImportError(f\"the kernel's environment has jupyter_client {_nbremote_jc.__version__}; nbremote needs "
    f">= {'.'.join(map(str, MIN_JUPYTER_CLIENT))} in the kernel: run the kernel from an environment with nbremote "
    "installed (pip install nbremote brings it)\")\n"
    "del _nbremote_jc\n")


def bootstrap(name: str, rank: int, timeout: float, world: tuple[str, list[str]], exit_with: str | None = None,
              plan: dict[str, Any] | None = None) -> str:
    """The code that makes a kernel worker ``name``; ``world``: the world's token and its members' names now
    (a kernel that is one of them already refuses a second name); ``exit_with``: the driver whose lease the
    kernel must not outlive, and ``plan`` how it ends then (see ``StartedKernel.after_driver``)."""
    args = f", world={world[0]!r}, members={world[1]!r}"
    if exit_with is not None:
        args += f", exit_with={exit_with!r}, after_driver={plan!r}"
    return (_KERNEL_CHECK +
            f"import nbremote.rpc._worker.install as _nbremote_worker\n"
            f"_nbremote_worker.install({name!r}, {rank}, {sys.path!r}, {timeout!r}{args})\n"
            f"del _nbremote_worker\n")
