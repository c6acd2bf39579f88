"""Remote modules: ``nbremote.nn`` mirrors ``torch.distributed.nn`` (and the tensorplay seed).

:class:`RemoteModule` places a ``torch.nn.Module`` or ``tensorplay.nn.Module`` on a worker kernel and
drives it from the notebook; :func:`interface` gives it an exact ``forward`` signature.
:class:`RemoteDeviceError` is raised when the requested device does not exist on the worker;
:func:`parse_remote_device` reads the ``"worker/device"`` grammar into a :class:`RemoteDevice`.
``RemoteModule.remote_summary()`` returns a :class:`ModuleSummary` (:class:`ParameterInfo` rows),
``forward_stats`` a :class:`ForwardStats` and ``reload()`` a :class:`ReloadReport` (strict reloads
that would lose keys raise :class:`ReloadMismatchError`).

Private modules, one idea each: ``_device`` (the ``remote_device`` grammar), ``_interface`` (signatures
and the forward closures), ``_frameworks`` (torch / tensorplay specifics, imported lazily), ``_owner``
(functions that run on the worker owning the module), ``_unsupported`` (the refused ``nn.Module``
methods and their hints), ``_remote_module`` (the handle), ``_sequential`` (:class:`RemoteSequential`,
RemoteModules in a chain whose activations go from stage to stage), ``_summary`` / ``_inspect`` (what the
module looks like, read on its owner), ``_watched`` (its training history and metric streams, recorded on
its owner by :mod:`nbremote.history`), ``_reload`` (rebuilding it from an edited class), ``_snapshot``
(snapshots taken and loaded on the owner), ``_stores`` (where they are kept), ``_recovery`` (when they are
taken, and the restore of a restarted worker) and ``_resume`` (:class:`ResumableLoop`, a training loop that
survives a lost worker). ``net.snapshot()`` returns a :class:`Snapshot`; ``rpc.restart_worker`` restores
modules that have one in place, and :func:`last_report` says what came back (a :class:`RecoveryReport`). This package
uses only the public ``nbremote.rpc`` API and imports no framework until a framework's module appears.
"""

from nbremote.nn._device import RemoteDevice, RemoteDeviceError, parse_remote_device
from nbremote.nn._interface import interface
from nbremote.nn._meter import ForwardStats
from nbremote.nn._recovery import RecoveryReport, last_report
from nbremote.nn._reload import ReloadMismatchError, ReloadReport
from nbremote.nn._remote_module import RemoteModule
from nbremote.nn._resume import ResumableLoop
from nbremote.nn._sequential import RemoteSequential
from nbremote.nn._snapshot import Snapshot
from nbremote.nn._stores import DirectoryStore, MemoryStore, SnapshotStore
from nbremote.nn._summary import ModuleSummary, ParameterInfo

__all__ = [
    "DirectoryStore",
    "ForwardStats",
    "MemoryStore",
    "ModuleSummary",
    "ParameterInfo",
    "RecoveryReport",
    "ReloadMismatchError",
    "ReloadReport",
    "RemoteDevice",
    "RemoteDeviceError",
    "RemoteModule",
    "RemoteSequential",
    "ResumableLoop",
    "Snapshot",
    "SnapshotStore",
    "interface",
    "last_report",
    "parse_remote_device",
]
