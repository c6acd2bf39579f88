"""torch's backend options and backend type, as the start-up line of a ported program spells them.

``rpc.init_rpc("worker0", backend=rpc.BackendType.TENSORPIPE, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
rpc_timeout=20))`` runs unchanged. nbremote has one transport, the kernels' own channels, so of the options
only ``rpc_timeout`` acts: ``init_rpc`` makes it the world's default timeout (seconds, 0 = none). The others
are checked as torch checks them and kept, so that a program reads back what it set:

* ``num_worker_threads``: nbremote's executor grows with the calls it serves (``_core.pool``), so a handler
  that blocks on a nested call cannot starve the others the way a fixed pool of 16 can.
* ``init_method``: there is no rendezvous; the driver starts or attaches its workers (README, "Start-up").
* ``device_maps`` / ``devices`` (``set_device_map``, ``set_devices``): a CUDA tensor travels through the CPU
  and is rebuilt on the same device where the receiver has it (``frameworks._torch``); the maps are kept by
  device name (``0`` and ``"cuda:0"`` are both ``"cuda:0"``), with torch's one-to-one check.

Nothing here imports torch: the options are plain values, and torch's own option objects are accepted by
``init_rpc`` too.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions"]

DEFAULT_RPC_TIMEOUT_SEC = 60.0  # torch's rpc.constants
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16

Device = int | str | Any  # an index (a CUDA device), a name, or a torch.device


class BackendType(enum.Enum):
    """torch's ``rpc.BackendType``: the one backend a program may name. nbremote's transport is the kernels'
    channels whichever is named."""

    TENSORPIPE = "TENSORPIPE"

    def __repr__(self) -> str:
        return f"BackendType.{self.name}"  # torch's spelling


class RpcBackendOptions:
    """torch's base class of backend options: the default timeout of calls and the rendezvous URL."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD) -> None:
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
            raise _refused(self, f"rpc_timeout is a number of seconds, not {type(rpc_timeout).__name__}")
        if not isinstance(init_method, str):
            raise _refused(self, f"init_method is a URL string, not {type(init_method).__name__}")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's ``rpc.TensorPipeRpcBackendOptions``, same signature; only ``rpc_timeout`` acts (module docstring)."""

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: Mapping[str, Mapping[Device, Device]] | None = None,
        devices: Sequence[Device] | None = None,
        _transports: list[Any] | None = None,
        _channels: list[Any] | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        if isinstance(num_worker_threads, bool) or not isinstance(num_worker_threads, int):
            raise _refused(self, f"num_worker_threads is an int, not {type(num_worker_threads).__name__}")
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[str, str]] = {
            str(to): _device_map(device_map) for to, device_map in (device_maps or {}).items()}
        self.devices: list[str] = [] if devices is None else _cuda_devices(devices)
        self._transports, self._channels = _transports, _channels  # TensorPipe's own; kept, unused

    def set_device_map(self, to: str, device_map: Mapping[Device, Device]) -> None:
        """Add ``device_map`` (this worker's device -> ``to``'s) to the maps for callee ``to``; as torch, a
        device already mapped to another one is refused (``ValueError``)."""
        full = _device_map(device_map)
        current = self.device_maps.setdefault(str(to), {})
        for k, v in full.items():
            if k in current and current[k] != v:
                raise ValueError(f"`set_device_map` only supports 1-to-1 mapping, trying to map {k} to {v} and "
                                 f"{current[k]}")
        current.update(full)

    def set_devices(self, devices: Sequence[Device]) -> None:
        """The local CUDA devices a torch agent would synchronize (kept)."""
        self.devices = _cuda_devices(devices)


def _refused(options: RpcBackendOptions, why: str) -> TypeError:
    """A wrong type, in the words of torch's (pybind11) constructor, which a program may match."""
    return TypeError(f"{type(options).__name__}.__init__(): incompatible constructor arguments: {why}")


def _device_name(device: Device) -> str:
    """``0`` -> ``"cuda:0"`` (an index names a CUDA device, as ``torch.device(0)``); a ``torch.device`` or a
    name -> its name."""
    if isinstance(device, bool):
        raise TypeError(f"a device is an index, a name or a torch.device, not {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"a device index is >= 0, not {device}")
        return f"cuda:{device}"
    name = str(device)
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"not a device name: {device!r}")
    return name


def _device_map(device_map: Mapping[Device, Device]) -> dict[str, str]:
    full: dict[str, str] = {}
    reverse: dict[str, str] = {}
    for k, v in device_map.items():
        src, dst = _device_name(k), _device_name(v)
        if dst in reverse:
            raise ValueError(f"`device_map` only supports 1-to-1 mapping, trying to map {src} and {reverse[dst]} "
                             f"to {dst}")
        full[src], reverse[dst] = dst, src
    return full


def _cuda_devices(devices: Sequence[Device]) -> list[str]:
    names = [_device_name(d) for d in devices]
    for name in names:
        if name.partition(":")[0] != "cuda":
            raise ValueError(f"`set_devices` expect a list of CUDA devices, but got device type "
                             f"{name.partition(':')[0]}.")
    return names


def timeout_of(options: object) -> float | None:
    """The ``rpc_timeout`` of backend options (nbremote's or torch's), or None; refuses anything else as
    torch's ``init_rpc`` does (``TypeError``)."""
    if options is None:
        return None
    if not any(c.__name__ == "RpcBackendOptions" for c in type(options).__mro__):
        raise TypeError(f"Argument rpc_backend_options must be an instance of RpcBackendOptions "
                        f"(rpc.TensorPipeRpcBackendOptions, or torch's), not {type(options).__name__}")
    timeout = getattr(options, "rpc_timeout", None)
    return float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None


def check_backend(backend: object) -> None:
    """``backend`` is None or a member of a ``BackendType`` (nbremote's or torch's), else ``TypeError`` as in
    torch; which one is named does not matter (one transport)."""
    if backend is None or (isinstance(backend, enum.Enum) and type(backend).__name__ == "BackendType"):
        return
    raise TypeError(f"Argument backend must be a member of BackendType (rpc.BackendType.TENSORPIPE), "
                    f"not {backend!r}")
