"""Where snapshots are kept: the driver's memory (the default, bounded), a directory, or an fsspec URL.

A store keeps a module's snapshots by step and gives back the latest or a given one. Memory keeps the
last ``keep`` (2 by default: the one being replaced is still there while the next is taken). A directory
or URL holds one module's snapshots, a file per step (``step-00000042.nbsnap``, a pickle of the
:class:`~nbremote.nn.Snapshot`); it outlives the driver, so a new world loads it with
``net.load_snapshot(path)``. A local file is written beside its final name and renamed into place, so a
driver killed while writing leaves the previous snapshot readable; object stores write a file at once.
``keep`` bounds a directory too (``None`` there by default: every snapshot is kept). URLs with a scheme
(``s3://``, ``memory://``...) need fsspec (``pip install fsspec`` and the scheme's package).
"""

from __future__ import annotations

import os
import pickle
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nbremote.errors import SnapshotError
from nbremote.nn._snapshot import Snapshot

__all__ = ["DirectoryStore", "MemoryStore", "SnapshotStore", "store_for"]

_NAME = re.compile(r"^step-(\d+)\.nbsnap$")


@runtime_checkable
class SnapshotStore(Protocol):
    """What a place for snapshots offers (implement it to keep them elsewhere)."""

    def put(self, snapshot: Snapshot) -> None: ...

    def get(self, step: int | None = None) -> Snapshot: ...

    def steps(self) -> list[int]: ...


class MemoryStore:
    """The last ``keep`` snapshots, in the driver's memory."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"a memory store keeps at least one snapshot, not keep={keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._by_step: OrderedDict[int, Snapshot] = OrderedDict()

    def put(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._by_step.pop(snapshot.step, None)
            self._by_step[snapshot.step] = snapshot
            while len(self._by_step) > self.keep:
                self._by_step.popitem(last=False)

    def get(self, step: int | None = None) -> Snapshot:
        with self._lock:
            if not self._by_step:
                raise SnapshotError("no snapshot was taken yet (net.snapshot(), or snapshot_every=N)")
            if step is None:
                return next(reversed(self._by_step.values()))
            if step not in self._by_step:
                raise SnapshotError(f"no snapshot of step {step} in memory (kept: steps {list(self._by_step)}; "
                                    f"the last {self.keep} are kept)")
            return self._by_step[step]

    def steps(self) -> list[int]:
        with self._lock:
            return list(self._by_step)

    def __repr__(self) -> str:
        return f"MemoryStore(keep={self.keep}, steps={self.steps()})"


class DirectoryStore:
    """A module's snapshots as files in a directory, local or an fsspec URL."""

    def __init__(self, where: str | os.PathLike[str], keep: int | None = None) -> None:
        self.where = os.fspath(where)
        self.keep = keep
        if "://" in self.where:
            try:
                import fsspec
            except ImportError:
                raise SnapshotError(f"snapshots to {self.where!r} need fsspec: pip install fsspec (and the "
                                    "package of that scheme)") from None
            self._fs, self._root = fsspec.core.url_to_fs(self.where)
        else:
            self._fs, self._root = None, str(Path(self.where).expanduser())
        self._makedirs()

    def _makedirs(self) -> None:
        if self._fs is None:
            Path(self._root).mkdir(parents=True, exist_ok=True)
        else:
            self._fs.makedirs(self._root, exist_ok=True)

    def _path(self, step: int) -> str:
        return f"{self._root.rstrip('/')}/step-{step:08d}.nbsnap"

    def put(self, snapshot: Snapshot) -> None:
        data = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
        path = self._path(snapshot.step)
        if self._fs is None:
            partial = f"{path}.partial"
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)
        else:
            with self._fs.open(path, "wb") as f:
                f.write(data)
        if self.keep is not None:
            for old in self.steps()[:-self.keep]:
                self._remove(self._path(old))

    def _remove(self, path: str) -> None:
        if self._fs is None:
            os.unlink(path)
        else:
            self._fs.rm(path)

    def steps(self) -> list[int]:
        if self._fs is None:
            names = os.listdir(self._root) if os.path.isdir(self._root) else []
        else:
            names = [str(p).rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
        return sorted(int(m.group(1)) for m in map(_NAME.match, names) if m)

    def get(self, step: int | None = None) -> Snapshot:
        steps = self.steps()
        if not steps:
            raise SnapshotError(f"no snapshot in {self.where!r}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise SnapshotError(f"no snapshot of step {step} in {self.where!r} (it has steps {steps})")
        path = self._path(step)
        try:
            if self._fs is None:
                with open(path, "rb") as f:
                    snapshot = pickle.load(f)
            else:
                with self._fs.open(path, "rb") as f:
                    snapshot = pickle.load(f)
        except Exception as exc:
            raise SnapshotError(f"cannot read the snapshot {path!r}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(snapshot, Snapshot):
            raise SnapshotError(f"{path!r} holds a {type(snapshot).__name__}, not an nbremote snapshot")
        return snapshot

    def __repr__(self) -> str:
        return f"DirectoryStore({self.where!r}, steps={self.steps()})"


def store_for(to: Any, keep: int | None = None) -> SnapshotStore:
    """``None`` -> memory; a path or URL -> a directory store; a store -> itself."""
    if to is None:
        return MemoryStore(2 if keep is None else keep)
    if isinstance(to, (str, os.PathLike)):
        return DirectoryStore(to, keep)
    if isinstance(to, SnapshotStore):
        return to
    raise TypeError(f"snapshots go to None (the driver's memory), a directory, an fsspec URL or a store; "
                    f"got {type(to).__name__}")
