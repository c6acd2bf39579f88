"""Remote modules: ``nbremote.nn`` mirrors ``torch.distributed.nn`` (and the tensorplay seed).

:class:`RemoteModule` places a ``torch.nn.Module`` or ``tensorplay.nn.Module`` on a worker kernel and
drives it from the notebook; :func:`interface` gives it an exact ``forward`` signature.
:class:`RemoteDeviceError` is raised when the requested device does not exist on the worker.

Private modules, one idea each: ``_device`` (the ``remote_device`` grammar), ``_interface`` (signatures
and the forward closures), ``_frameworks`` (torch / tensorplay specifics, imported lazily), ``_owner``
(functions that run on the worker owning the module), ``_unsupported`` (the refused ``nn.Module``
methods and their hints) and ``_remote_module`` (the handle). This package
uses only the public ``nbremote.rpc`` API and imports no framework until a framework's module appears.
"""

from nbremote.nn._device import RemoteDeviceError
from nbremote.nn._interface import interface
from nbremote.nn._remote_module import RemoteModule

__all__ = ["RemoteDeviceError", "RemoteModule", "interface"]
