"""What the benchmark measures: the cases, their sample counts (full and quick) and the issue's targets.

Pure data: no I/O, nothing imported that a spawned torch process would not also import cheaply. A
:class:`Case` travels to torch's rank 0 over a pipe, so it is a small frozen dataclass.

Kinds, and what one *sample* is:

- ``call``: one ``rpc_sync(worker, noop)``, seconds;
- ``echo``: one ``rpc_sync(worker, identity, args=(payload,))``, seconds;
- ``burst``: ``inflight`` calls put in flight at once, seconds from the first submit to the last completion;
- ``module``: one blocking ``RemoteModule`` forward of ``Linear(16, 16)`` on a batch of 32, seconds;
- ``train``: one training step of the split model, seconds;
- ``fused``: the same step, nbremote's owners stepping as the backward pass reaches them
  (``DistributedOptimizer.backward_and_step``; torch, which has no such thing, runs its plain step);
- ``train4``: one training step of a 4-stage MLP over four workers, each activation through the driver;
- ``pipe4``: the same step pipelined, four micro-batches in flight (nbremote: ``RemoteSequential``, each
  stage calling the next; torch: its pipeline example's RRefs to shards), seconds;
- ``pipe4rref``: the same, nbremote with torch's pattern (``remote_forward``: RRefs between stages; torch
  runs its example again), seconds;
- ``ps``: a parameter server with two trainers, each running ``PS_STEPS`` steps concurrently, seconds
  (throughput: both trainers' steps over that time);
- ``start``: one world brought up to "ready to call" (then shut down), seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

MB = 1 << 20
KB = 1 << 10

# System names: the keys of results, table rows and JSON.
NBREMOTE = "nbremote"
NBREMOTE_MAIN = "nbremote, __main__ fn"
TORCH = "torch"
TORCH_UV = "torch-uv"
ZMQ = "raw zmq"
IPP = "ipyparallel"
LOCAL = "local"
SYSTEM_ORDER = (NBREMOTE, NBREMOTE_MAIN, TORCH, TORCH_UV, ZMQ, IPP, LOCAL)


@dataclass(frozen=True)
class Target:
    """The issue's aim for nbremote in one case: paired ratio nbremote / ``against`` <= ``limit``.

    ``against`` is a system name, or ``case:<id>`` for nbremote's own figure in another case (4 workers
    vs 1 worker). Ratios are of times, so throughput's "calls/s >= torch's" is "burst time <= 1.0x torch's".
    """

    against: str
    limit: float
    text: str


@dataclass(frozen=True)
class Case:
    id: str  # what --only and the JSON name it by
    group: str  # what --only also accepts: every case of the group
    label: str
    kind: str  # call | echo | burst | module | train | fused | train4 | pipe4 | pipe4rref | ps | start (docstring)
    rounds: int  # every system runs one block per round, systems interleaved
    block: int  # samples per system per round
    warmup: int = 0  # untimed samples before the first round
    workers: int = 1  # burst: round robin over this many workers; start: world of this many workers
    nbytes: int = 0  # echo payload size
    payload: str = ""  # echo: numpy | torch
    inflight: int = 0  # burst size
    targets: tuple[Target, ...] = ()

    @property
    def per_call(self) -> bool:
        """True where a sample is one call among many, so a p90 means something."""
        return self.kind in ("call", "echo", "module", "train", "fused", "train4", "pipe4", "pipe4rref")


# Sample counts per group: (rounds, samples per block, warm-up samples). Many short blocks rather than a few
# long ones: on 2 shared cores the load changes within a second, and only blocks close in time pair well.
FULL = {"small": (40, 30, 100), "burst": (4, 1, 1), "module": (40, 30, 100), "train": (20, 6, 10),
        "train4": (12, 4, 4), "ps": (8, 1, 1), "start": (3, 1, 0)}
FULL_ECHOES = [(MB, 20, 4), (16 * MB, 12, 2), (64 * MB, 10, 1)]  # (size, rounds, samples per block)
FULL_INFLIGHT = 1000
QUICK = {"small": (2, 30, 10), "burst": (1, 1, 0), "module": (1, 20, 5), "train": (1, 3, 1), "train4": (1, 2, 1),
         "ps": (1, 1, 0), "start": (1, 1, 0)}
QUICK_ECHOES = [(256 * KB, 1, 2), (MB, 1, 2), (4 * MB, 1, 1)]
QUICK_INFLIGHT = 200
MICRO_BATCHES = 4  # the pipelined case's micro-batches
PS_STEPS = 10  # steps each trainer runs in one sample of the parameter-server case


def _size(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def _echo_cases(sizes: Sequence[tuple[int, int, int]]) -> list[Case]:
    """Echo cases, numpy and torch per size; the biggest size gets the issue's 64 MB targets."""
    big = max(nbytes for nbytes, _, _ in sizes)
    cases = []
    for nbytes, rounds, block in sizes:
        # Same host, torch's TensorPipe uses shared memory; between hosts nbremote's path is the socket path
        # measured here on loopback, whose floor is raw zmq.
        targets = (Target(TORCH, 1.0, "<=1.0x torch (same host)"),
                   Target(ZMQ, 1.1, "<=1.1x raw zmq (socket path)")) if nbytes == big else ()
        for payload in ("numpy", "torch"):
            cases.append(Case(f"echo-{_size(nbytes).replace(' ', '')}-{payload}", "echo",
                              f"echo {_size(nbytes)} {payload}", "echo", rounds, block, warmup=1 if block == 1 else 2,
                              nbytes=nbytes, payload=payload, targets=targets))
    return cases


def catalogue(quick: bool) -> list[Case]:
    """Every case, in the order they run (world start last: it needs the kept worlds closed)."""
    plan, echoes, inflight = (QUICK, QUICK_ECHOES, QUICK_INFLIGHT) if quick else (FULL, FULL_ECHOES, FULL_INFLIGHT)

    def case(case_id: str, group: str, label: str, kind: str, **kwargs: Any) -> Case:
        rounds, block, warmup = plan[group]
        return Case(case_id, group, label, kind, rounds, block, warmup, **kwargs)

    return [
        case("small", "small", "small call", "call", targets=(Target(TORCH, 1.2, "p50 <=1.2x torch"),)),
        *_echo_cases(echoes),
        *(case(f"burst-{n}", "burst", f"{inflight:,} in flight, {n} worker{'s' * (n > 1)}", "burst", workers=n,
               inflight=inflight, targets=(Target(TORCH, 1.0, "calls/s >= torch"),)) for n in (1, 3)),
        case("module", "module", "RemoteModule fwd Linear(16,16) b32", "module",
             targets=(Target(TORCH, 1.0, "<=1.0x torch RemoteModule"),)),
        case("train", "train", "training step, split model", "train", targets=(Target(TORCH, 1.0, "<=1.0x torch"),)),
        case("fused", "train", "same, backward_and_step", "fused", targets=(Target(TORCH, 1.0, "<=1.0x torch"),)),
        case("train4", "train4", "training step, 4-stage MLP b64", "train4",
             targets=(Target(TORCH, 1.0, "<=1.0x torch"),)),
        case("pipe4", "train4", f"same, pipelined x{MICRO_BATCHES}", "pipe4",
             targets=(Target(TORCH, 0.9, "<=0.9x torch's pipeline"),)),
        case("pipe4rref", "train4", f"same, pipelined x{MICRO_BATCHES}, RRefs", "pipe4rref"),
        case("ps", "ps", "param. server, 2 trainers", "ps", targets=(Target(TORCH, 1.0, "steps/s >= torch"),)),
        case("start-1", "start", "world start, 1 worker", "start", workers=1),
        case("start-4", "start", "world start, 4 workers", "start", workers=4,
             targets=(Target("case:start-1", 1.3, "<=1.3x 1 worker"),)),
    ]


def select(cases: Sequence[Case], only: str | None, rounds: int | None) -> list[Case]:
    """The cases ``--only`` names (ids or groups, comma-separated), with ``--rounds`` applied."""
    chosen = list(cases)
    if only:
        names = {n.strip() for n in only.split(",") if n.strip()}
        known = {c.id for c in cases} | {c.group for c in cases}
        unknown = names - known
        if unknown:
            raise ValueError(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        chosen = [c for c in cases if c.id in names or c.group in names]
    if rounds is not None:
        if rounds < 1:
            raise ValueError("--rounds must be at least 1")
        chosen = [replace(c, rounds=rounds) for c in chosen]
    return chosen
