"""nbremote: put parts of a model in other Jupyter kernels and drive them from the notebook."""

from nbremote import errors, rpc
from nbremote.errors import (
    NbRemoteError,
    RPCTimeoutError,
    SerializationError,
    WorkerLostError,
    WorkerStartError,
)
from nbremote.rpc import AttachedKernel, LocalKernel, WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "AttachedKernel",
    "LocalKernel",
    "NbRemoteError",
    "RPCTimeoutError",
    "SerializationError",
    "WorkerInfo",
    "WorkerLostError",
    "WorkerStartError",
    "__version__",
    "errors",
    "rpc",
]
