"""What ``init_rpc(workers=...)`` / ``add_workers`` accept, made into ``(name, spec)`` pairs with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nbremote.rpc._core.members import check_name
from nbremote.rpc._kernels.attached import AttachedKernel
from nbremote.rpc._kernels.hosted import ServerKernel
from nbremote.rpc._kernels.local import LocalKernel
from nbremote.rpc._kernels.slurm import SlurmKernel

__all__ = ["Spec", "WorkersArg", "normalize_workers"]

Spec = LocalKernel | AttachedKernel | ServerKernel | SlurmKernel
WorkersArg = Sequence[str] | Mapping[str, Spec | None] | int | None


def normalize_workers(workers: WorkersArg) -> list[tuple[str, Spec]]:
    if workers is None:
        return []
    if isinstance(workers, int) and not isinstance(workers, bool):
        return [(f"worker{i}", LocalKernel()) for i in range(1, workers + 1)]
    if isinstance(workers, Mapping):
        items = [(check_name(n), spec or LocalKernel()) for n, spec in workers.items()]
    elif isinstance(workers, (list, tuple)):
        items = [(check_name(n), LocalKernel()) for n in workers]
    else:
        raise TypeError(
            "workers= is a list of names, a dict of name -> LocalKernel/AttachedKernel/ServerKernel/SlurmKernel, or a "
            "count")
    for name, spec in items:
        if not isinstance(spec, (LocalKernel, AttachedKernel, ServerKernel, SlurmKernel)):
            raise TypeError(f"worker {name!r}: expected LocalKernel, AttachedKernel, ServerKernel or SlurmKernel, "
                            f"got {type(spec).__name__}")
    names = [n for n, _ in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"worker names must be unique; repeated: {dupes}")
    return items
