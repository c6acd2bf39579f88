"""The magics: ``%remote_workers``, ``%remote_module``, ``%%remote``. Each parses its line and calls the API.

A line that does not parse is an IPython ``UsageError`` (one line: what was wrong, then the right form).
An error from the API while a magic runs is shown short as well: the worker's traceback when the error
happened on a worker (that part is the user's code), then one ``Type: message`` line, and no frames of
nbremote or IPython. Exceptions of other kinds (bugs) keep their full traceback.

Starting the first worker starts the world, as the driver named "driver"; ``%remote_module`` starts a
worker it names that does not exist yet (a local kernel) and says so in one line.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import display

import nbremote
from nbremote import rpc
from nbremote.errors import NbRemoteError, RemoteTraceback
from nbremote.jupyter._dashboard import WorkerDashboard
from nbremote.jupyter._parse import MagicUsageError, ReloadCommand, parse_cell, parse_module, parse_workers
from nbremote.jupyter._start_status import start_status
from nbremote.nn import RemoteModule

DRIVER = "driver"


def short_traceback(exc: BaseException) -> list[str]:
    """The lines IPython shows for ``exc`` raised by a magic: remote traceback, if any, then one line."""
    lines: list[str] = []
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        lines += [f"Traceback on worker {cause.worker!r}:", *cause.text.rstrip().splitlines()]
    lines.append(f"{type(exc).__name__}: {exc}")
    lines += list(getattr(exc, "__notes__", []))
    return lines


@contextlib.contextmanager
def short_errors() -> Iterator[None]:
    """Show nbremote's errors, and errors raised on workers, without the local traceback."""
    try:
        yield
    except (NbRemoteError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        if isinstance(exc, NbRemoteError) or isinstance(exc.__cause__, RemoteTraceback) or _raised_by_nbremote(exc):
            lines = short_traceback(exc)
            with contextlib.suppress(AttributeError):  # IPython renders these lines instead of the frames
                exc._render_traceback_ = lambda: lines  # type: ignore[union-attr]
        raise


def _raised_by_nbremote(exc: BaseException) -> bool:
    """An argument check of nbremote's own (the innermost frame is nbremote code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("nbremote.")


def _usage(exc: MagicUsageError) -> UsageError:
    return UsageError(str(exc))


def ensure_worker(name: str, spec: nbremote.LocalKernel | nbremote.AttachedKernel | None = None) -> bool:
    """Start worker ``name`` (the world too, as "driver", if needed) unless it exists; True if started."""
    if not rpc.is_initialized():
        rpc.init_rpc(DRIVER, workers={name: spec})
        return True
    if name in {w.name for w in rpc.workers()}:
        return False
    rpc.add_worker(name, spec)
    return True


@magics_class
class RemoteMagics(Magics):
    """nbremote's magics; ``%load_ext nbremote`` registers them."""

    dashboard: WorkerDashboard | None = None

    # -- %remote_workers ---------------------------------------------------------------------------------
    @line_magic
    def remote_workers(self, line: str) -> None:
        """Show the worker dashboard, or start / stop / restart / interrupt workers.

        ``%remote_workers start NAME [NAME ...] [--kernel KERNELSPEC] [--server URL|here [--token TOKEN] |
        --attach CONNECTION_FILE [--ssh HOST] | --slurm "SBATCH OPTIONS" [--packed]]`` (``--server here``: the Jupyter
        server this notebook runs under; ``--slurm``: a Slurm job per worker, or, ``--packed``, one job for them all);
        ``%remote_workers group NAME [NAME ...] [--backend gloo|nccl]`` forms a c10d process group among them
        (``rpc.init_process_group``: rank = position), ``%remote_workers ungroup [NAME ...]`` destroys it.
        """
        try:
            cmd = parse_workers(line)
        except MagicUsageError as exc:
            raise _usage(exc) from None
        with short_errors():
            if cmd.action == "show":
                if self.dashboard is None or self.dashboard.comm is None:
                    self.dashboard = WorkerDashboard()
                else:
                    self.dashboard.refresh(resources=True)
                display(self.dashboard)
            elif cmd.action == "start":
                self._start(cmd.names, cmd.kernel, cmd.attach, cmd.ssh, cmd.server, cmd.token, cmd.slurm, cmd.packed)
            elif cmd.action == "group":
                rpc.init_process_group(list(cmd.names), cmd.backend)
                ranks = ", ".join(f"{name} (rank {rank})" for rank, name in enumerate(cmd.names))
                print(f"nbremote: formed a process group of {len(cmd.names)}: {ranks}")
            elif cmd.action == "ungroup":
                rpc.destroy_process_group(list(cmd.names) or None)
                print(f"nbremote: destroyed the process group of {', '.join(cmd.names) or 'every worker'}")
            else:
                actions: dict[str, Callable[[str], object]] = {
                    "stop": rpc.remove_worker, "restart": rpc.restart_worker, "interrupt": rpc.interrupt_worker}
                for name in cmd.names:
                    actions[cmd.action](name)
                past = {"stop": "stopped", "restart": "restarted", "interrupt": "interrupted"}[cmd.action]
                print(f"nbremote: {past} {', '.join(cmd.names)}")

    def _start(self, names: tuple[str, ...], kernel: str | None, attach: str | None, ssh: str | None,
               server: str | None = None, token: str | None = None, slurm: str | None = None,
               packed: bool = False) -> None:
        spec: nbremote.LocalKernel | nbremote.AttachedKernel | nbremote.ServerKernel | nbremote.SlurmKernel
        if slurm is not None:  # a job per worker, submitted in parallel (or one, packed); the cell says where they wait
            spec = nbremote.SlurmKernel(slurm, packed=packed)
        elif server == "here":
            spec = nbremote.ServerKernel.from_env(kernel_name=kernel)
        elif server:
            spec = nbremote.ServerKernel(server, token=token, kernel_name=kernel)
        elif attach:
            spec = nbremote.AttachedKernel(attach, ssh=ssh)
        else:
            spec = nbremote.LocalKernel(kernel_name=kernel)
        existing = {w.name for w in rpc.workers()} if rpc.is_initialized() else set()
        taken = [n for n in names if n in existing]
        if taken:
            raise UsageError(f"{', '.join(taken)} already in the world; %remote_workers restart {taken[0]} "
                             "gives it a fresh kernel")
        with start_status(names) if slurm is not None else contextlib.nullcontext():
            if not rpc.is_initialized():
                rpc.init_rpc(DRIVER, workers=dict.fromkeys(names, spec))  # in parallel
            else:
                rpc.add_workers(dict.fromkeys(names, spec))  # in parallel too
        what = (f"in the Jupyter server at {getattr(spec, 'url', server)}" if server else f"attached to {attach}"
                if attach else (f"kernelspec {kernel!r}" if kernel else "local kernels"))
        if slurm is not None:
            jobs = {r.name: r.detail.split(" (")[0] for r in rpc.worker_status()}
            what = f"Slurm {', '.join(jobs.get(n, '?') for n in names)}; sbatch {slurm!r}{', packed' if packed else ''}"
        print(f"nbremote: started {', '.join(names)} ({what})")

    # -- %remote_module -----------------------------------------------------------------------------------
    @line_magic
    def remote_module(self, line: str) -> Any:
        """Build a RemoteModule: ``net = %remote_module worker1/cpu MyNet(10, hidden=32)``.

        ``%remote_module --reload net`` rebuilds ``net`` from the current definition of its class,
        keeping its weights.
        """
        try:
            cmd = parse_module(line)
        except MagicUsageError as exc:
            raise _usage(exc) from None
        ns = self.shell.user_ns if self.shell is not None else {}
        if isinstance(cmd, ReloadCommand):
            return self._reload(cmd.name, ns)
        factory, args, kwargs = self._evaluate(cmd.factory, cmd.args, cmd.keywords, ns)
        with short_errors():
            worker = cmd.place.worker
            if isinstance(worker, str) and ensure_worker(worker):
                print(f"nbremote: started worker {worker!r} (a local kernel running this Python)")
            return RemoteModule(str(cmd.place), factory, args=args, kwargs=kwargs)

    def _evaluate(self, factory: ast.expr, args: tuple[ast.expr, ...], keywords: tuple[ast.keyword, ...],
                  ns: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """Evaluate the class expression and its arguments in the notebook's namespace."""
        def value(node: ast.expr) -> Any:
            text = ast.unparse(node)
            try:
                return eval(compile(ast.Expression(node), "<%remote_module>", "eval"), ns)
            except NameError as exc:
                raise UsageError(f"{exc.name or text!r} is not defined in this notebook: define or import it "
                                 f"first (%remote_module evaluates {text!r} here)") from None
            except Exception as exc:
                raise UsageError(f"evaluating {text!r} failed: {type(exc).__name__}: {exc}") from None

        built = value(factory)
        if not callable(built):
            raise UsageError(f"{ast.unparse(factory)!r} is a {type(built).__name__}, not a Module class or factory")
        positional: list[Any] = []
        for node in args:
            if isinstance(node, ast.Starred):
                positional.extend(value(node.value))
            else:
                positional.append(value(node))
        named: dict[str, Any] = {}
        for kw in keywords:
            if kw.arg is None:
                named.update(value(kw.value))
            else:
                named[kw.arg] = value(kw.value)
        return built, tuple(positional), named

    def _reload(self, name: str, ns: dict[str, Any]) -> None:
        module = ns.get(name)
        if not isinstance(module, RemoteModule):
            found = "nothing" if name not in ns else f"a {type(module).__name__}"
            raise UsageError(f"{name!r} holds {found}, not a RemoteModule; usage: %remote_module --reload NET")
        with short_errors():
            print(f"nbremote: {module.reload()}")

    # -- %%remote -----------------------------------------------------------------------------------------
    @cell_magic
    def remote(self, line: str, cell: str) -> rpc.CellRun | None:
        """Run the cell in the workers' kernels: ``%%remote worker1 worker2``; ``--bg`` returns a handle."""
        try:
            cmd = parse_cell(line)
        except MagicUsageError as exc:
            raise _usage(exc) from None
        with short_errors():
            run = rpc.run_cell(cmd.workers, cell, background=cmd.background)
        return run if cmd.background else None
