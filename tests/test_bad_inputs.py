"""Bad input, tried and reported: each case must raise its typed error with a message a user can act on
(naming the worker or the call, and the fix where there is one), none may crash or wedge a worker, and
the list of what was tried is written to ``tests/artifacts/bad-inputs.md`` (its path is printed at the
end of the run).

A case is ``(input, call, error class, words the message must contain)``. Calls after ``shutdown`` run in
one fresh driver process (the session's world stays up); its errors come back pickled and are judged
here like the others. There is no frame size limit to overstep (a 256 MB echo works; TRANSPORT-NOTES),
so "oversize frames" has no case.
"""

from __future__ import annotations

import base64
import functools
import json
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import remote_fns as fns
import torch
from conftest import ARTIFACTS, report, run_script
from faults import fault_fns as ffns
from ipython_shell import open_shell, run

import nbremote
import nbremote.autograd as dist_autograd
from nbremote import rpc
from nbremote.errors import (
    AutogradError,
    NotInitializedError,
    RemoteDeviceError,
    RRefError,
    SerializationError,
    UnknownWorkerError,
    WorkerError,
    WorkerStartError,
)
from nbremote.nn import RemoteModule
from nbremote.optim import DistributedOptimizer
from nbremote.rpc._core import current_agent

pytestmark = pytest.mark.timeout(60)


@dataclass
class Case:
    input: str
    call: Callable[[], Any]
    error: type[BaseException] | tuple[type[BaseException], ...]
    says: tuple[str, ...] = ()


TRIED: list[tuple[str, str, str]] = []  # (input, error type, message) for the report


# -- helpers the cases use ------------------------------------------------------------------------------------


def _module(device: Any, cls: Any = torch.nn.Linear, args: tuple[Any, ...] = (2, 2)) -> Callable[[], Any]:
    return lambda: RemoteModule(device, cls, args=args)


def _conn_file(tmp: Path, name: str, content: str) -> Path:
    path = tmp / name
    path.write_text(content)
    path.chmod(0o600)
    return path


@functools.cache
def _tmp() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="nbremote-bad-inputs-"))


def _worker1_conn(**change: Any) -> str:
    conn = dict(current_agent().peers["worker1"].conn or {})
    conn.update(change)
    return json.dumps(conn)


def _attach(name: str, content: str | Callable[[], str]) -> Callable[[], Any]:
    def call() -> Any:
        path = _conn_file(_tmp(), f"{name}.json", content if isinstance(content, str) else content())
        return rpc.add_worker(name, nbremote.AttachedKernel(path), start_timeout=3)
    return call


def _kernelspec(language: str, argv: list[str]) -> Callable[[], Any]:
    def call() -> Any:
        spec_dir = _tmp() / "kernels" / f"lang-{language}"
        spec_dir.mkdir(parents=True, exist_ok=True)
        (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": language,
                                                          "language": language}))
        import os

        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = str(_tmp())
        try:
            return rpc.add_worker("foreign", nbremote.LocalKernel(kernel_name=f"lang-{language}"), start_timeout=5)
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH")
            else:
                os.environ["JUPYTER_PATH"] = old
    return call


def _in_context(body: Callable[[int], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with dist_autograd.context() as ctx:
            return body(ctx)
    return call


def _magic(line: str) -> Callable[[], Any]:
    def call() -> Any:
        with open_shell() as shell:
            ran = run(shell, line)
        if ran.error is not None:
            raise ran.error
        return ran
    return call


AFTER_SHUTDOWN = {
    "rpc_sync after shutdown": "rpc.rpc_sync('worker1', os.getpid)",
    "rpc_async after shutdown": "rpc.rpc_async('worker1', os.getpid)",
    "remote after shutdown": "rpc.remote('worker1', os.getpid)",
    "get_worker_info after shutdown": "rpc.get_worker_info()",
    "workers() after shutdown": "rpc.workers()",
    "get_rpc_timeout after shutdown": "rpc.get_rpc_timeout()",
    "add_worker after shutdown": "rpc.add_worker('late')",
    "remove_worker after shutdown": "rpc.remove_worker('worker1')",
    "restart_worker after shutdown": "rpc.restart_worker('worker1')",
    "worker_status after shutdown": "rpc.worker_status()",
    "run_cell after shutdown": "rpc.run_cell('worker1', 'print(1)')",
    "shutdown twice": "rpc.shutdown()",
    "RemoteModule after shutdown": "RemoteModule('worker1/cpu', torch.nn.Linear, args=(2, 2))",
    "dist_autograd.context after shutdown": "dist_autograd.context().__enter__()",
    "RRef.to_here after shutdown": "kept.to_here()",
}


@functools.cache
def _after_shutdown() -> dict[str, BaseException | str]:
    """Run every after-shutdown case in one fresh driver; its errors come back pickled."""
    cases = json.dumps(AFTER_SHUTDOWN)
    proc = run_script(f"""
        import base64, json, os, pickle, sys
        import torch
        import nbremote.autograd as dist_autograd
        from nbremote import rpc
        from nbremote.nn import RemoteModule
        rpc.init_rpc("driver", workers=["worker1"])
        kept = rpc.remote("worker1", os.getpid)
        kept.to_here()
        rpc.shutdown()
        out = {{}}
        for name, code in json.loads({cases!r}).items():
            try:
                eval(code)
                out[name] = "no error"
            except BaseException as exc:
                out[name] = base64.b64encode(pickle.dumps(exc)).decode()
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v if v == "no error" else pickle.loads(base64.b64decode(v)) for k, v in raw.items()}


def _shut(name: str) -> Callable[[], Any]:
    def call() -> Any:
        outcome = _after_shutdown()[name]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return call


# -- the cases -------------------------------------------------------------------------------------------------

IN = "init_rpc"
CASES: list[Case] = [
    # malformed remote_device strings
    *[Case(f"RemoteModule({dev!r}, Linear)", _module(dev), ValueError, ("malformed remote_device", why))
      for dev, why in [("", "worker name is empty"), ("/cpu", "worker name is empty"),
                       ("worker1/", "device after '/' is empty"), ("worker1/gpu", "unknown device 'gpu'"),
                       ("worker1/cuda:x", "unknown device 'cuda:x'"), ("worker1/cpu/0", "more than one '/'"),
                       ("rank:x/cpu", "not 'rank:<non-negative integer>'"), ("rank:-1/cpu", "rank:<non-negative"),
                       ("work er/cpu", "no whitespace"), ("worker1/cpu2", "unknown device 'cpu2'")]],
    Case("RemoteModule(42, Linear)", _module(42), TypeError, ("remote_device must be a str", "int")),
    Case("RemoteModule(None, Linear)", _module(None), TypeError, ("remote_device must be a str",)),
    # unknown workers and ranks
    Case("RemoteModule('nobody/cpu', Linear)", _module("nobody/cpu"), UnknownWorkerError,
         ("'nobody'", "known: driver, worker1", "add_worker")),
    Case("RemoteModule('rank:99/cpu', Linear)", _module("rank:99/cpu"), UnknownWorkerError, ("99", "known:")),
    Case("RemoteModule('worker1/cuda:0', Linear) without CUDA", _module("worker1/cuda:0"), RemoteDeviceError,
         ("worker1", "cuda", "cpu")),
    Case("rpc_sync('nobody', f)", lambda: rpc.rpc_sync("nobody", fns.pid), UnknownWorkerError,
         ("'nobody'", "known: driver", "add_worker")),
    Case("rpc_sync(99, f) (no rank 99)", lambda: rpc.rpc_sync(99, fns.pid), UnknownWorkerError, ("99", "known:")),
    Case("rpc_sync(-1, f)", lambda: rpc.rpc_sync(-1, fns.pid), UnknownWorkerError, ("-1", "known:")),
    Case("rpc_async('nobody', f)", lambda: rpc.rpc_async("nobody", fns.pid), UnknownWorkerError, ("'nobody'",)),
    Case("remote('nobody', f)", lambda: rpc.remote("nobody", fns.pid), UnknownWorkerError, ("'nobody'",)),
    Case("get_worker_info('nobody')", lambda: rpc.get_worker_info("nobody"), UnknownWorkerError, ("'nobody'",)),
    Case("get_worker_info(42)", lambda: rpc.get_worker_info(42), UnknownWorkerError, ("42",)),
    Case("remove_worker('nobody')", lambda: rpc.remove_worker("nobody"), UnknownWorkerError,
         ("no worker 'nobody' to remove", "known:")),
    Case("restart_worker('nobody')", lambda: rpc.restart_worker("nobody"), UnknownWorkerError,
         ("no worker 'nobody' to restart",)),
    Case("interrupt_worker('nobody')", lambda: rpc.interrupt_worker("nobody"), UnknownWorkerError, ("'nobody'",)),
    Case("worker_resources('nobody')", lambda: rpc.worker_resources("nobody"), UnknownWorkerError, ("'nobody'",)),
    Case("run_cell('nobody', code)", lambda: rpc.run_cell("nobody", "x = 1"), UnknownWorkerError, ("'nobody'",)),
    # wrong types to the public functions
    Case("rpc_sync(3.5, f)", lambda: rpc.rpc_sync(3.5, fns.pid), ValueError, ("worker name, rank or WorkerInfo",
                                                                              "float")),  # torch's type
    Case("rpc_sync(True, f)", lambda: rpc.rpc_sync(True, fns.pid), TypeError, ("worker name, rank", "bool")),
    Case("rpc_sync('worker1', 'not callable')", lambda: rpc.rpc_sync("worker1", "print"), TypeError,
         ("callable", "str")),
    Case("rpc_sync('worker1', f, args=5)", lambda: rpc.rpc_sync("worker1", fns.add, args=5), TypeError,
         ("args", "int")),
    Case("rpc_sync('worker1', f, kwargs=[1])", lambda: rpc.rpc_sync("worker1", fns.add, kwargs=[1]), TypeError,
         ("kwargs", "list")),
    Case("rpc_sync('worker1', f, timeout='soon')", lambda: rpc.rpc_sync("worker1", fns.pid, timeout="soon"),
         TypeError, ("timeout", "seconds")),
    Case("rpc_sync('worker1', f, timeout=nan)", lambda: rpc.rpc_sync("worker1", fns.pid, timeout=float("nan")),
         TypeError, ("timeout", "seconds")),
    Case("rpc_async('worker1', 42)", lambda: rpc.rpc_async("worker1", 42), TypeError, ("callable", "int")),
    Case("remote('worker1', None)", lambda: rpc.remote("worker1", None), TypeError, ("callable", "NoneType")),
    Case("get_worker_info(3.5)", lambda: rpc.get_worker_info(3.5), ValueError, ("float",)),
    Case("add_worker(123)", lambda: rpc.add_worker(123), (TypeError, ValueError), ("worker name",)),
    Case("add_worker('ok', spec='python3')", lambda: rpc.add_worker("ok", "python3"), TypeError,
         ("LocalKernel", "AttachedKernel")),
    Case("add_workers(5.5)", lambda: rpc.add_workers(5.5), TypeError, ("workers",)),
    Case("add_workers(['twin', 'twin'])", lambda: rpc.add_workers(["twin", "twin"]), ValueError, ("'twin'",)),
    Case("add_worker('bad name')", lambda: rpc.add_worker("bad name"), ValueError, ("invalid worker name",)),
    Case("add_worker('driver') (the driver's name)", lambda: rpc.add_worker("driver"), ValueError, ("driver",)),
    Case("add_worker('worker1') twice", lambda: rpc.add_worker("worker1"), ValueError, ("already in the world",)),
    Case("init_rpc while running", lambda: rpc.init_rpc("driver", workers=[]), RuntimeError,
         ("already initialized", "shutdown")),
    Case("init_rpc(rpc_timeout=-1)", lambda: rpc.init_rpc("other", workers=[], rpc_timeout=-1), ValueError,
         ("rpc_timeout", ">= 0")),
    Case("init_rpc('bad name')", lambda: rpc.init_rpc("bad name"), ValueError, ("invalid worker name",)),
    Case("remove_worker('driver')", lambda: rpc.remove_worker("driver"), (ValueError, UnknownWorkerError),
         ("driver",)),
    Case("restart_worker('driver')", lambda: rpc.restart_worker("driver"), (ValueError, WorkerError),
         ("driver",)),
    Case("run_cell([], code)", lambda: rpc.run_cell([], "x = 1"), ValueError, ("at least one worker",)),
    Case("run_cell('driver', code)", lambda: rpc.run_cell("driver", "x = 1"), ValueError, ("driver itself",)),
    Case("run_cell(['worker1', 'worker1'], code)", lambda: rpc.run_cell(["worker1", "worker1"], "x = 1"),
         ValueError, ("twice",)),
    Case("run_cell('worker1', 42)", lambda: rpc.run_cell("worker1", 42), TypeError, ("code", "str")),
    Case("LocalKernel(kernel_name=5)", lambda: rpc.add_worker("lk", nbremote.LocalKernel(kernel_name=5)),
         (TypeError, WorkerStartError), ("kernel_name",)),
    Case("AttachedKernel(123)", lambda: rpc.add_worker("ak", nbremote.AttachedKernel(123)),
         (TypeError, WorkerStartError), ("connection file",)),
    # module classes that are not Modules
    Case("RemoteModule('worker1/cpu', 42)", _module("worker1/cpu", 42), TypeError, ("module_cls", "int")),
    Case("RemoteModule('worker1/cpu', int)", _module("worker1/cpu", int, ()), ValueError,
         ("worker1", "int", "returns an instance of <class nn.Module>")),
    Case("RemoteModule('worker1/cpu', dict)", _module("worker1/cpu", dict, ()), ValueError,
         ("worker1", "dict", "returns an instance of <class nn.Module>")),
    Case("RemoteModule('worker1/cpu', Linear, args=('a', 'b'))", _module("worker1/cpu", torch.nn.Linear, ("a", "b")),
         TypeError, ("worker1", "must be tuple of ints")),
    # unpicklable arguments and results, results that fail to unpickle
    Case("rpc_sync(w, echo, args=(Lock(),))", lambda: rpc.rpc_sync("worker1", fns.echo, args=(threading.Lock(),)),
         SerializationError, ("args[0]", "echo", "worker1", "lock", "hint")),
    Case("rpc_async(w, echo, args=(generator,))",
         lambda: rpc.rpc_async("worker1", fns.echo, args=((i for i in range(3)),)).wait(), SerializationError,
         ("echo", "generator")),
    Case("a result that cannot be pickled (Lock)", lambda: rpc.rpc_sync("worker1", ffns.make_lock),
         SerializationError, ("worker1", "make_lock", "lock")),
    Case("a result that fails to unpickle on the driver", lambda: rpc.rpc_sync("worker1", ffns.make_only_here),
         SerializationError, ("worker1", "make_only_here", "can only be rebuilt")),
    Case("an argument that fails to unpickle on the worker",
         lambda: rpc.rpc_sync("worker1", ffns.type_of, args=(ffns.OnlyHere(),)), SerializationError,
         ("worker1", "type_of", "can only be rebuilt")),
    Case("remote() of an unpicklable value, then to_here",
         lambda: rpc.remote("worker1", ffns.make_lock).to_here(), SerializationError, ("worker1", "lock")),
    Case("an exception that cannot be pickled", lambda: rpc.rpc_sync("worker1", fns.raise_unpicklable),
         Exception, ("has a lock",)),
    # RRefs, autograd, the optimizer
    Case("RRef.local_value() on a non-owner", lambda: rpc.remote("worker1", fns.make_list, args=(2,)).local_value(),
         RRefError, ("worker1", "to_here")),
    Case("dist_autograd.backward('x', [loss])", lambda: dist_autograd.backward("x", [torch.ones(())]), TypeError,
         ("context_id",)),
    Case("dist_autograd.backward(unknown id, [loss])", lambda: dist_autograd.backward(987654321, [torch.ones(())]),
         AutogradError, ("987654321",)),
    Case("dist_autograd.backward(ctx, [])", _in_context(lambda ctx: dist_autograd.backward(ctx, [])), AutogradError,
         ("No tensors provided",)),
    Case("dist_autograd.backward(ctx, {'loss': t}) (not a list)",
         _in_context(lambda ctx: dist_autograd.backward(ctx, {"loss": torch.ones((), requires_grad=True)})),
         TypeError, ("roots", "dict")),
    Case("dist_autograd.backward(ctx, ['loss'])", _in_context(lambda ctx: dist_autograd.backward(ctx, ["loss"])),
         TypeError, ("roots[0]", "str")),
    Case("dist_autograd.get_gradients(unknown id)", lambda: dist_autograd.get_gradients(987654321), AutogradError,
         ("987654321",)),
    Case("DistributedOptimizer(42, params)", lambda: DistributedOptimizer(42, [], lr=0.1), TypeError,
         ("optimizer_class",)),
    Case("DistributedOptimizer(SGD, [tensor])",
         lambda: DistributedOptimizer(torch.optim.SGD, [torch.ones(2)], lr=0.1), TypeError, ("params_rref[0]",
                                                                                                 "RRef")),
    # bad or foreign connection files, a kernel of another language
    Case("AttachedKernel(missing file)", lambda: rpc.add_worker("att", nbremote.AttachedKernel(_tmp() / "no.json")),
         WorkerStartError, ("'att'", "unreadable")),
    Case("AttachedKernel(file that is not JSON)", _attach("notjson", "this is not json"), WorkerStartError,
         ("'notjson'", "connection file")),
    Case("AttachedKernel(JSON without ports)", _attach("noports", '{"hello": "world"}'), WorkerStartError,
         ("'noports'", "connection file")),
    Case("AttachedKernel(worker1's ports, wrong key)", _attach("wrongkey", lambda: _worker1_conn(key="0" * 64)),
         WorkerStartError, ("'wrongkey'", "key")),
    # TCP ports 1-5 (on ipc, worker1's own sockets are numbered 1-5: they would answer)
    Case("AttachedKernel(ports nobody listens on)", _attach("deaf", lambda: _worker1_conn(
        transport="tcp", ip="127.0.0.1", shell_port=1, iopub_port=2, stdin_port=3, control_port=4, hb_port=5)),
         WorkerStartError, ("'deaf'",)),
    Case("AttachedKernel(a member's own kernel, by another name)", _attach("twin", lambda: _worker1_conn()),
         WorkerStartError, ("'twin'", "already worker 'worker1'", "remove_worker('worker1')")),
    Case("kernelspec of another language (R)", _kernelspec("R", ["/bin/sh", "-c", "sleep 30", "{connection_file}"]),
         WorkerStartError, ("runs R", "Python kernels")),
    # magics
    Case("%remote_workers restart nobody", _magic("%remote_workers restart nobody"), UnknownWorkerError,
         ("'nobody'",)),
    Case("%%remote nobody", _magic("%%remote nobody\nx = 1"), UnknownWorkerError, ("'nobody'",)),
    Case("%remote_module worker1/cpu 42", _magic("%remote_module worker1/cpu 42"), Exception,
         ("not a Module class",)),
    # calls after shutdown
    *[Case(name, _shut(name), NotInitializedError, (IN,)) for name in AFTER_SHUTDOWN],
]


@pytest.fixture(scope="module", autouse=True)
def written_report() -> Iterator[None]:
    yield
    if _tmp.cache_info().currsize:  # the connection files and kernelspecs the cases made
        shutil.rmtree(_tmp(), ignore_errors=True)
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "bad-inputs.md"
    lines = ["# Bad inputs tried (generated by tests/test_bad_inputs.py)", "",
             f"{len(TRIED)} inputs; each raised the error shown, and the workers answered afterwards.", "",
             "| input | error | message |", "|---|---|---|"]
    for text, kind, message in TRIED:
        one_line = " ".join(message.split()).replace("|", "\\|")
        lines.append(f"| `{text}` | {kind} | {one_line[:300]} |")
    path.write_text("\n".join(lines) + "\n")
    report("bad inputs", f"{len(TRIED)} bad inputs tried; the list: {path}")


def test_there_are_at_least_60_cases() -> None:
    assert len(CASES) >= 60 and len({c.input for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.input for c in CASES])
def test_a_bad_input_gets_a_typed_actionable_error(world: list[str], case: Case) -> None:
    t0 = time.monotonic()
    with pytest.raises(case.error) as info:
        case.call()
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])  # a remote error's note names
    for words in case.says:
        assert words.lower() in message.lower(), f"{case.input}: {type(info.value).__name__}: {message!r}"
    assert time.monotonic() - t0 < 20, "a bad input must fail fast, not by a timeout"
    TRIED.append((case.input, type(info.value).__name__, message))
    assert sorted(w.name for w in rpc.workers()) == ["driver", *world], "a bad input left a worker behind"


def test_the_workers_still_answer_after_every_bad_input(world: list[str]) -> None:
    assert [rpc.rpc_sync(w, fns.whoami) for w in world] == world
    assert rpc.rpc_sync("worker1", fns.call_peer, args=("worker2", fns.add, 2, 3)) == 5
    assert RemoteModule("worker3/cpu", torch.nn.Linear, args=(2, 1))(torch.ones(1, 2)).shape == (1, 1)

