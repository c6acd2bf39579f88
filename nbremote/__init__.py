"""nbremote: put parts of a model in other Jupyter kernels and drive them from the notebook.

``%load_ext nbremote`` in a notebook loads the notebook layer (:mod:`nbremote.jupyter`): magics, the
RemoteModule panel, the worker dashboard. ``import nbremote`` alone imports no widget library.
"""

from typing import TYPE_CHECKING, Any

from nbremote import errors
from nbremote.errors import (
    NbRemoteError,
    RPCTimeoutError,
    SerializationError,
    ServerError,
    WorkerLostError,
    WorkerStartError,
)

if TYPE_CHECKING:
    from nbremote import rpc
    from nbremote.rpc import AttachedKernel, LocalKernel, ServerKernel, SlurmKernel, WorkerInfo

__version__ = "0.1.0"

# The RPC layer is imported when first named (``nbremote.rpc``, ``nbremote.LocalKernel``), not by ``import
# nbremote``: ``nbremote worker`` (the command a Slurm job or a remote host runs before its kernel starts) needs
# none of it, and importing it cost that command 0.3 s of a worker's start.
_FROM_RPC = ("AttachedKernel", "LocalKernel", "ServerKernel", "SlurmKernel", "WorkerInfo")


def __getattr__(name: str) -> Any:
    if name == "rpc" or name in _FROM_RPC:
        import nbremote.rpc

        return nbremote.rpc if name == "rpc" else getattr(nbremote.rpc, name)
    raise AttributeError(f"module 'nbremote' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "rpc", *_FROM_RPC})


def load_ipython_extension(shell: object) -> None:
    """``%load_ext nbremote``: register nbremote's magics, panel display and wait status."""
    from nbremote import jupyter

    jupyter.load_ipython_extension(shell)


def unload_ipython_extension(shell: object) -> None:
    """``%unload_ext nbremote``."""
    from nbremote import jupyter

    jupyter.unload_ipython_extension(shell)

__all__ = [
    "AttachedKernel",
    "LocalKernel",
    "NbRemoteError",
    "RPCTimeoutError",
    "SerializationError",
    "ServerError",
    "ServerKernel",
    "SlurmKernel",
    "WorkerInfo",
    "WorkerLostError",
    "WorkerStartError",
    "__version__",
    "errors",
    "load_ipython_extension",
    "rpc",
    "unload_ipython_extension",
]
