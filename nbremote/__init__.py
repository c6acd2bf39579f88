"""nbremote: put parts of a model in other Jupyter kernels and drive them from the notebook.

``%load_ext nbremote`` in a notebook loads the notebook layer (:mod:`nbremote.jupyter`): magics, the
RemoteModule panel, the worker dashboard. ``import nbremote`` alone imports no widget library.
"""

from nbremote import errors, rpc
from nbremote.errors import (
    NbRemoteError,
    RPCTimeoutError,
    SerializationError,
    ServerError,
    WorkerLostError,
    WorkerStartError,
)
from nbremote.rpc import AttachedKernel, LocalKernel, ServerKernel, SlurmKernel, WorkerInfo

__version__ = "0.1.0"


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
