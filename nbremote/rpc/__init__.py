"""``nbremote.rpc``: torch.distributed.rpc's API over Jupyter kernels.

::

    from nbremote import rpc
    rpc.init_rpc("driver", workers=["worker1", "worker2"])
    rpc.rpc_sync("worker1", torch.add, args=(t, 1))
    rref = rpc.remote("worker2", MyModel); rref.rpc_sync().forward(x)
    rpc.shutdown()

The free functions delegate to this process's one current agent (see ``_core.current``). Timeouts are in
seconds as in torch: ``-1`` (default) uses the world's ``rpc_timeout``, ``0`` means no timeout.

Beyond torch, the driver manages its workers as Jupyter kernels: ``add_worker`` / ``remove_worker`` /
``restart_worker`` / ``interrupt_worker``, ``worker_status()`` (the driver's view: kind, host, pid,
state, calls), ``worker_resources(name)`` (the worker's devices and owned RRefs) and
``worker_activity(name)`` (its CPU time, memory and task stream, for the live dashboard), and
``run_cell(workers, code)`` runs notebook code in the workers' own namespaces (``%%remote``).

Inside, the private packages stand on floors, each importing only those below it (``lint-imports``
checks it): ``_driver`` (the notebook's process only) | ``_worker`` (a worker kernel only) over ``_core``
(what every member runs: the agent, calls, peers, RRefs, serving) | ``_kernels`` (how kernels are
started, attached, hosted) over ``_transport`` (the only code that moves bytes on kernel channels) over
``_wire`` (values and bytes, no I/O).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from nbremote.errors import CallCancelledError
from nbremote.rpc import functions
from nbremote.rpc._core import current as _current
from nbremote.rpc._core import joining as _joining
from nbremote.rpc._core import resources as _resources
from nbremote.rpc._core.agent import DEFAULT_TIMEOUT
from nbremote.rpc._core.agent import Agent as _Agent
from nbremote.rpc._core.agent import current_agent as _current_agent
from nbremote.rpc._core.calls import introspection as _introspection
from nbremote.rpc._core.future import Future, WaitHook, set_wait_hook, wait_all
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.members import check_name as _check_name
from nbremote.rpc._core.resources import DeviceInfo, WorkerActivity, WorkerResources
from nbremote.rpc._core.rref import RRef
from nbremote.rpc._core.tasks import LEASE as _TASK_LEASE
from nbremote.rpc._core.tasks import Task
from nbremote.rpc._driver import cells
from nbremote.rpc._driver.cell_output import CellOutput as _CellOutput
from nbremote.rpc._driver.cells import CellOutcome, CellRun, OutputHandler, RemoteCellError
from nbremote.rpc._driver.pgroup import destroy_process_group, init_process_group
from nbremote.rpc._driver.specs import Spec as _Spec
from nbremote.rpc._driver.specs import WorkersArg
from nbremote.rpc._driver.specs import normalize_workers as _normalize_workers
from nbremote.rpc._driver.status import WorkerStatus
from nbremote.rpc._driver.world import START_TIMEOUT
from nbremote.rpc._driver.world import World as _World
from nbremote.rpc._kernels.attached import AttachedKernel
from nbremote.rpc._kernels.hosted import ServerKernel
from nbremote.rpc._kernels.local import LocalKernel
from nbremote.rpc._kernels.slurm import SlurmKernel
from nbremote.rpc._wire.serialize import sending_to as _sending_to
from nbremote.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions
from nbremote.rpc.options import check_backend as _check_backend
from nbremote.rpc.options import timeout_of as _timeout_of

__all__ = [
    "AttachedKernel",
    "BackendType",
    "CallCancelledError",
    "CellOutcome",
    "CellRun",
    "DeviceInfo",
    "Future",
    "LocalKernel",
    "OutputHandler",
    "RRef",
    "RemoteCellError",
    "RpcBackendOptions",
    "ServerKernel",
    "SlurmKernel",
    "Task",
    "TensorPipeRpcBackendOptions",
    "WaitHook",
    "WorkerActivity",
    "WorkerInfo",
    "WorkerResources",
    "WorkerStatus",
    "add_worker",
    "add_workers",
    "destroy_process_group",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_process_group",
    "init_rpc",
    "interrupt_worker",
    "is_available",
    "is_initialized",
    "is_rpc_pickling",
    "on_worker_restart",
    "remote",
    "remove_worker",
    "restart_worker",
    "rpc_async",
    "rpc_sync",
    "run_cell",
    "set_wait_hook",
    "shutdown",
    "task",
    "wait_all",
    "worker_activity",
    "worker_resources",
    "worker_status",
    "workers",
]

def _driver_world(what: str = "changes the world's membership") -> _World:
    agent = _current_agent()
    world = agent.world
    if not isinstance(world, _World):
        raise RuntimeError(f"{agent.name!r} is a worker: only the driver {what}")
    return world


def init_rpc(name: str = "driver", workers: WorkersArg = None, *, rpc_timeout: float | None = None,
             start_timeout: float = START_TIMEOUT, backend: object = None, rank: int | None = None,
             world_size: int | None = None, rpc_backend_options: object = None) -> None:
    """Start the world: this process is ``name`` (the driver) and ``workers`` are started in parallel.

    ``workers`` is a list of names (local kernels running this interpreter), a dict of name ->
    ``LocalKernel(...)`` / ``AttachedKernel(...)`` / ``ServerKernel(...)``, or a count (``worker1``..``workerN``).

    torch's keywords are taken as a ported program's start-up line. ``rank``: the driver's (default 0; it may
    take any, as torch's master does: ``init_rpc("master", rank=2, world_size=4, workers=[...])``), the workers
    taking the others in order; ``world_size`` without ``workers`` starts ``world_size - 1`` local kernels named
    as torch's tests name ranks (``worker<rank>``), with ``workers`` it must count them too;
    ``rpc_backend_options`` (:class:`TensorPipeRpcBackendOptions`, or torch's) gives its ``rpc_timeout``
    (unless ``rpc_timeout`` is given); ``backend`` must be ``BackendType.TENSORPIPE`` (or None) and changes
    nothing (one transport).

    In a process that is a member already (a worker kernel, or the driver after its start), the same call
    *joins* the running world, as torch's ``run_worker(rank, world_size)`` does at its start: name, rank and
    world size must be this member's (``RuntimeError`` naming what differs, otherwise), the options' timeout
    becomes the default; with a ``world_size`` it returns once the program's other ranks (the driver excepted)
    have joined, as torch's rendezvous does; and its ``rpc.shutdown()`` waits for the world's other members
    without ending the world (``_core.joining``; README, "Start-up").
    """
    given = _start_up_options(backend, rpc_backend_options)
    _check_name(name)
    if rank is not None and (type(rank) is not int or rank < -1):
        raise TypeError(f"init_rpc: rank is this process's rank, an int >= 0, not {rank!r}")
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise TypeError(f"init_rpc: world_size is the number of processes, an int >= 1, not {world_size!r}")
    if rpc_timeout is None:
        rpc_timeout = given
    if rpc_timeout is not None and rpc_timeout < 0:
        raise ValueError("rpc_timeout is in seconds and must be >= 0 (0 means no timeout)")
    existing = _current.current_or_none()
    if existing is not None and existing.running and workers is None:
        agent = _current_agent()
        # In the driver, a program's line names its rank or size; init_rpc("driver") run again is refused below.
        if agent.world is None or rank is not None or world_size is not None:
            _joining.check(agent, name, None if rank == -1 else rank, world_size)
            _joining.join(agent, world_size, rpc_timeout)
            return
    rank = 0 if rank in (None, -1) else rank
    if world_size is not None and workers is None:
        workers = [f"worker{r}" for r in range(world_size) if r != rank]
    specs = _normalize_workers(workers)
    if world_size is not None and world_size != len(specs) + 1:
        raise ValueError(f"init_rpc: world_size={world_size}, but the world is the driver and {len(specs)} "
                         f"workers ({len(specs) + 1}); leave world_size out, or give as many workers")
    if rank > len(specs):
        raise ValueError(f"init_rpc(name={name!r}, rank={rank}): the world is the driver and {len(specs)} workers, "
                         f"ranks 0 to {len(specs)}; give a rank in that range (the workers take the others in order)")
    if any(n == name for n, _ in specs):
        raise ValueError(f"a worker cannot have the driver's name {name!r}")
    if existing is not None and existing.running:
        raise RuntimeError(f"nbremote RPC is already initialized as {existing.name!r}; call rpc.shutdown() first "
                           "(without workers=, init_rpc joins the running world as a torch program's rank)")
    agent = _Agent(name, rank, "driver", DEFAULT_TIMEOUT if rpc_timeout is None else rpc_timeout)
    agent.world = world = _World(agent)
    _current.set_current(agent)
    try:
        world.start(specs, start_timeout)
    except BaseException:
        world.stop_all()
        raise


def _start_up_options(backend: object, options: object) -> float | None:
    """``backend`` and ``rpc_backend_options`` checked as torch's ``init_rpc`` checks them (its ``TypeError``s);
    the options' ``rpc_timeout``, or None. nbremote has one transport, the kernels' channels, whichever is
    named; options that are no ``TensorPipeRpcBackendOptions`` name no backend there is."""
    _check_backend(backend)
    timeout = _timeout_of(options)
    if options is None or any(c.__name__ == "TensorPipeRpcBackendOptions" for c in type(options).__mro__):
        return timeout
    if backend is None:
        raise TypeError(f"Could not infer backend for options {options}: give rpc.TensorPipeRpcBackendOptions(...)")
    raise TypeError(f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {options}")


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """End this process's RPC as torch's ``shutdown`` does, in nbremote's world.

    In the driver: wait (``graceful``) for the members that joined with ``init_rpc`` to reach their own
    ``shutdown`` (if any did), then for pending calls, stop the kernels nbremote started, and end the world.
    In a process whose program joined the running world (``init_rpc`` in a worker, or a second one in the
    driver): torch's graceful shutdown without the ending -- wait for this program's calls, then for the
    other members at the driver's barrier; ``graceful=False`` returns at once. ``timeout`` (seconds) bounds the
    waits; by default the barrier waits as torch's does, without a limit (a member that dies releases it).
    """
    agent = _current_agent()
    if agent.joined is not None:
        _joining.leave(agent, graceful, timeout)
        return
    world = agent.world
    if not isinstance(world, _World):
        raise RuntimeError(
            f"{agent.name!r} is a worker: only the driver shuts the world down (a worker's RPC ends with its kernel). "
            f"torch's shutdown in a worker is the end of a program that joined with rpc.init_rpc({agent.name!r}, "
            f"rank={agent.rank}, world_size=...): call that first")
    try:
        if graceful and world.gathering.open():
            _joining.gather(agent, timeout)  # its error is raised once the world has ended all the same
    finally:
        if graceful:
            agent.calls.wait_idle(timeout)
        world.stop_all()


def is_available() -> bool:
    """True: nbremote's RPC needs nothing torch's build may lack (torch's ``rpc.is_available``)."""
    return True


def is_initialized() -> bool:
    agent = _current.current_or_none()
    return agent is not None and agent.running


def rpc_sync(to: str | int | WorkerInfo, func: Callable[..., Any], args: Sequence[Any] | None = None,
             kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result (its error is raised here)."""
    return _current_agent().call(to, func, args or (), kwargs, timeout, snapshot=False).wait()


def rpc_async(to: str | int | WorkerInfo, func: Callable[..., Any], args: Sequence[Any] | None = None,
              kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> Future[Any]:
    """Start ``func(*args, **kwargs)`` on ``to``; returns a Future at once."""
    return _current_agent().call(to, func, args or (), kwargs, timeout)


def remote(to: str | int | WorkerInfo, func: Callable[..., Any], args: Sequence[Any] | None = None,
           kwargs: dict[str, Any] | None = None, timeout: float = -1.0) -> RRef[Any]:
    """Create ``func(*args, **kwargs)`` on ``to`` and return an RRef to it at once.

    Creation errors surface when the RRef is first used (``to_here``, proxies).
    """
    return _current_agent().remote(to, func, args or (), kwargs, timeout)


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """This process's WorkerInfo, or the one of ``worker_name``."""
    agent = _current_agent()
    return agent.info if worker_name is None else agent.peers.resolve(worker_name)


def workers() -> list[WorkerInfo]:
    """Every member of the world, by rank (the driver first)."""
    agent = _current_agent()
    return sorted([agent.info, *(p.info for p in list(agent.peers.values()))], key=lambda w: w.id)


def is_rpc_pickling() -> bool:
    """True while nbremote's RPC pickles a message (an argument or result crossing processes).

    For ``__reduce__`` methods of handles that may travel by RPC but not by plain ``pickle``.
    """
    return _sending_to.get() is not None


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds (0 = none)."""
    return _current_agent().default_timeout


def add_worker(name: str, spec: _Spec | None = None, *,
               start_timeout: float = START_TIMEOUT) -> WorkerInfo:
    """Start (or attach) one more worker; it gets the next rank."""
    world = _driver_world()
    world.start(_normalize_workers({name: spec}), start_timeout)
    return world.agent.peers.resolve(name)


def add_workers(workers: WorkersArg, *, start_timeout: float = START_TIMEOUT) -> list[WorkerInfo]:
    """Start (or attach) several workers at once, in parallel; ``workers`` as for :func:`init_rpc`."""
    world = _driver_world()
    specs = _normalize_workers(workers)
    world.start(specs, start_timeout)
    return [world.agent.peers.resolve(name) for name, _ in specs]


def remove_worker(name: str) -> None:
    """Take a worker out of the world; its pending calls fail, a kernel nbremote started is stopped."""
    _driver_world().remove(name)



def restart_worker(name: str, *, start_timeout: float = START_TIMEOUT) -> WorkerInfo:
    """Restart a worker kernel nbremote started: a fresh kernel with the same name, rank and spec.

    Its pending calls fail with ``WorkerLostError`` (on every member), and what lived in the old kernel
    (variables, modules, RRefs it owned) is gone -- except what the :func:`on_worker_restart` hooks put back:
    RemoteModules with a snapshot (and their optimizer state) are restored in place, their handles working
    again (``nbremote.nn.last_report(name)`` says what came back); RRefs to anything else raise
    ``RRefLostError`` at once. Attached kernels cannot be restarted from here.
    """
    world = _driver_world("restarts workers")
    peer = world.agent.peers.get(name)
    replaced = None if peer is None else peer.incarnation
    world.restart(name, start_timeout)
    errors = []
    for hook in list(_restart_hooks):  # all of them, even after one failed: each restores its own part
        try:
            hook(name, replaced)
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return world.agent.peers.resolve(name)


_restart_hooks: list[Callable[[str, str | None], None]] = []


def on_worker_restart(hook: Callable[[str, str | None], None]) -> None:
    """Run ``hook(name, replaced)`` in the driver each time :func:`restart_worker` (or the dashboard's restart
    button) has brought up a fresh kernel for worker ``name``: to put back there what the old kernel held
    (``nbremote.nn`` restores RemoteModules from their snapshots this way). ``replaced`` is the old kernel's
    incarnation, the tag its RRefs' ids carry (``rpc.RRef`` ids are ``<uuid>@<incarnation>``), which tells
    its values from those of an earlier worker of that name. The worker is a member again when hooks run;
    an error of one is raised by ``restart_worker`` once every hook has run. Added once."""
    if hook not in _restart_hooks:
        _restart_hooks.append(hook)


def interrupt_worker(name: str) -> None:
    """Interrupt the cell running on a worker's main shell (KeyboardInterrupt there); RPCs go on."""
    _driver_world("interrupts workers").interrupt(name)


def worker_status() -> list[WorkerStatus]:
    """The driver's view of every worker, by rank (kind, host, pid, state, calls); asks no worker."""
    return _driver_world("keeps the workers' status").status()


def worker_resources(name: str, timeout: float = 5.0) -> WorkerResources:
    """Ask worker ``name`` for its devices (cpu, cuda:N with memory in use) and how many RRefs it owns."""
    with _introspection():
        result: WorkerResources = rpc_sync(name, _resources.resources, timeout=timeout)
    return result


def worker_activity(name: str, since: float = 0.0, lease: float = _TASK_LEASE, timeout: float = 5.0, *,
                    reader: str = "") -> WorkerActivity:
    """Ask worker ``name`` for its CPU time, memory, devices and the tasks it ran that ended after ``since``
    (wall clock): the live dashboard's read. Its task stream is recorded for ``lease`` seconds from now
    (``reader``'s lease: each read renews it, 0 ends it; others' leases stand): a worker nobody reads
    records nothing."""
    with _introspection():
        result: WorkerActivity = rpc_sync(name, _resources.dashboard_activity, args=(since, lease, reader),
                                          timeout=timeout)
    return result


def task(what: str) -> contextlib.AbstractContextManager[None]:
    """``with rpc.task("device"):`` shows what runs inside as a task of its own in the dashboard's task stream
    (while one reads this process's stream; otherwise it does nothing): part of a call, such as a device's
    busy time apart from the wait for it, or work outside calls."""
    agent = _current.current_or_none()
    return contextlib.nullcontext() if agent is None else agent.server.tasks.span(what)


def run_cell(workers: str | Sequence[str], code: str, *, background: bool = False,
             on_output: OutputHandler | None = None) -> CellRun:
    """Run ``code`` as a notebook cell in each worker's own namespace (not as an RPC function).

    Output (stdout, stderr, rich displays, errors) appears in the calling cell as it arrives, labelled
    with the worker's name, unless ``on_output(worker, msg_type, content)`` takes it. Blocking by
    default: returns the finished :class:`CellRun`, raises :class:`RemoteCellError` if the cell failed on
    any worker, and the notebook's interrupt button interrupts the remote cells. With
    ``background=True`` it returns the running :class:`CellRun` at once (``wait()``, ``interrupt()``).
    """
    if not isinstance(code, str):
        raise TypeError(f"run_cell runs a cell's source code, a str; got {type(code).__name__}")
    names = [workers] if isinstance(workers, str) else list(workers)
    if not names:
        raise ValueError("run_cell needs at least one worker name")
    world = _driver_world("runs cells on workers")
    for name in names:
        if world.agent.peers.resolve(name).name == world.agent.name:
            raise ValueError(f"{name!r} is the driver itself; run_cell runs code on workers")
    names = [world.agent.peers.resolve(n).name for n in names]
    if len(set(names)) != len(names):
        raise ValueError(f"run_cell got a worker twice: {names}")
    return cells.run(world, names, code, on_output or _CellOutput(tuple(names)), background)
