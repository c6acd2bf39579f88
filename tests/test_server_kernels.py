"""ServerKernel: workers hosted by a real `jupyter server` and a real `jupyter kernelgateway`, over their websockets.

Each server runs on loopback with a token (a Jupyter Server a second time forced to the legacy websocket
protocol, the one jupyter_server 1.x and so Enterprise Gateway 3 speak), with its stock settings
(tornado's 10 MiB websocket message limit included: the 64 MB echo goes in pieces). Its kernels inherit
this process's environment, so they import this checkout's nbremote. Errors for a wrong URL, token,
kernel name or kernel id are checked against the same servers.
"""

from __future__ import annotations

import gc
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import remote_fns as fns
from conftest import ROOT, free_port

import nbremote
from nbremote import rpc
from nbremote.errors import ServerError, WorkerLostError
from nbremote.rpc._core import current_agent
from nbremote.rpc._wire import batching, bufpool, envelope

try:  # imported with the module, as the other test modules do (see test_provisioned)
    import torch
except ImportError:
    torch = None

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("jupyter", path=str(Path(sys.executable).parent)) is None,
                       reason="needs jupyter_server and jupyter_kernel_gateway (pip install -e '.[test]')"),
]


@dataclass
class Server:
    kind: str
    url: str
    token: str

    def api(self, method: str, path: str, body: dict[str, object] | None = None) -> object:
        request = urllib.request.Request(self.url + path, method=method, headers={
            "Authorization": f"token {self.token}", "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def kernel_ids(self) -> set[str]:
        kernels = self.api("GET", "api/kernels")
        assert isinstance(kernels, list)
        return {str(k["id"]) for k in kernels}

    def spec(self, **kwargs: Any) -> nbremote.ServerKernel:
        return nbremote.ServerKernel(self.url, token=self.token, **kwargs)

    def session_names(self) -> set[str]:
        sessions = self.api("GET", "api/sessions")
        assert isinstance(sessions, list)
        return {str(s["name"]) for s in sessions}

    def execute(self, kernel_id: str, code: str, timeout: float = 60, interrupt_after: float | None = None,
                ) -> dict[str, object]:
        """Run ``code`` in a kernel of this server as a frontend would (its own websocket, the legacy JSON
        protocol); return the execute_reply's content, calling ``interrupt_after`` seconds in
        ``rpc.interrupt_worker`` on the worker whose kernel it is, if given (see the interrupt test)."""
        import websocket

        ws = websocket.create_connection(f"ws{self.url[4:]}api/kernels/{kernel_id}/channels",
                                         header=[f"Authorization: token {self.token}"], timeout=timeout)
        try:
            msg_id = secrets.token_hex(8)
            ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                                           "session": secrets.token_hex(8), "version": "5.3", "date": ""},
                                "parent_header": {}, "metadata": {}, "channel": "shell",
                                "content": {"code": code, "silent": False, "store_history": False,
                                            "user_expressions": {}, "allow_stdin": False}}))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = json.loads(ws.recv())
                if msg.get("channel") == "shell" and msg["parent_header"].get("msg_id") == msg_id:
                    return dict(msg["content"])
            raise TimeoutError(code)
        finally:
            ws.close()


def _start(kind: str, tmp: Path, **extra_env: str) -> tuple[subprocess.Popen[bytes], Server]:
    port, token = free_port(), secrets.token_hex(16)
    jupyter = str(Path(sys.executable).parent / "jupyter")
    if kind.startswith("jupyter-server"):
        argv = [jupyter, "server", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
                f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp}"]
        if kind == "jupyter-server-legacy":  # what jupyter_server 1.x (Enterprise Gateway 3) speaks
            argv.append("--ZMQChannelsWebsocketConnection.kernel_ws_protocol=")
    else:
        argv = [jupyter, "kernelgateway", "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={port}",
                f"--KernelGatewayApp.auth_token={token}", "--KernelGatewayApp.port_retries=0",
                "--JupyterWebsocketPersonality.list_kernels=True",  # GET api/kernels, for the tests' checks
                # a start request with env gets PATH and these only: keep this checkout's nbremote
                "--KernelGatewayApp.env_process_whitelist=PYTHONPATH"]
    log = open(tmp / f"{kind}.log", "wb")  # noqa: SIM115 -- closed with the process
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTER_CONFIG_DIR": str(tmp / "config"),
           **extra_env}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp))
    server = Server(kind, f"http://127.0.0.1:{port}/", token)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            server.api("GET", "api/kernelspecs")
            return proc, server
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{kind} did not start: {(tmp / f'{kind}.log').read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Server]]:
    """Servers by kind, each started once, when a test first needs it, and stopped with the module."""
    started: dict[str, tuple[subprocess.Popen[bytes], Server]] = {}

    def get(kind: str) -> Server:
        if kind not in started:
            started[kind] = _start(kind, tmp_path_factory.mktemp(kind))
        return started[kind][1]

    try:
        yield get
    finally:
        for proc, _ in started.values():
            _stop(proc)


@pytest.fixture(scope="module", params=["jupyter-server", "kernel-gateway", "jupyter-server-legacy"])
def server(request: pytest.FixtureRequest, servers: Callable[[str], Server]) -> Server:
    return servers(request.param)


@pytest.fixture(scope="module")
def jupyter_server(servers: Callable[[str], Server]) -> Server:
    return servers("jupyter-server")


@pytest.fixture(scope="module")
def kernel_gateway(servers: Callable[[str], Server]) -> Server:
    return servers("kernel-gateway")


@pytest.fixture(scope="module")
def hosted(world: list[str], server: Server) -> Iterator[str]:
    name = f"srv-{server.kind}"
    rpc.add_worker(name, server.spec(kernel_name="python3"))
    try:
        yield name
    finally:
        if name in [w.name for w in rpc.worker_status()]:
            rpc.remove_worker(name)


def test_calls_on_a_server_hosted_worker(hosted: str, server: Server) -> None:
    assert rpc.rpc_sync(hosted, fns.whoami) == hosted
    assert rpc.rpc_sync(hosted, fns.add, args=(2, 3)) == 5
    futs = [rpc.rpc_async(hosted, fns.add, args=(i, i)) for i in range(200)]
    assert [f.wait() for f in futs] == [2 * i for i in range(200)]
    link = current_agent().peers[hosted].link
    assert link is not None and link.fast, "the shell path should work through the server's websocket"
    assert link.v1 == (server.kind != "jupyter-server-legacy"), "the v1 protocol wherever the server offers it"
    assert link.subshell_id is not None, "the comm should live in a kernel subshell, beside running cells"
    row = next(r for r in rpc.worker_status() if r.name == hosted)
    assert (row.kind, row.host, row.state) == ("server", "127.0.0.1", "idle")
    if server.kind != "kernel-gateway":  # a console session under the worker's name (gateways have no sessions)
        assert hosted in server.session_names()
    assert row.pid == rpc.rpc_sync(hosted, fns.pid)
    # it calls the driver back through the same websocket; other workers reach it through the server too
    assert rpc.rpc_sync(hosted, fns.call_peer, args=("driver", fns.pid)) == os.getpid()
    assert rpc.rpc_sync("worker1", fns.call_peer, args=(hosted, fns.whoami)) == hosted
    assert rpc.rpc_sync(hosted, fns.call_peer, args=("worker2", fns.whoami)) == "worker2"
    with pytest.raises(ZeroDivisionError):
        rpc.rpc_sync(hosted, fns.fail, args=("zero", "boom"))


def test_a_64_mb_echo_goes_through_in_pieces(hosted: str) -> None:
    a = np.arange(16 << 20, dtype=np.float32)  # 64 MB: over tornado's 10 MiB limit per websocket message
    b = rpc.rpc_sync(hosted, fns.echo, args=(a,))
    assert b.dtype == a.dtype and np.array_equal(a, b)
    assert b.flags.writeable, "received buffers should be writable views, not read-only copies"


def test_a_kernel_on_this_machine_shares_memory_through_its_server(hosted: str) -> None:
    """Proof, not address: the kernel found our shared-memory probe and we found its, so big buffers skip
    the server (only the message goes through its websocket) and no direct channel is needed."""
    link = current_agent().peers[hosted].link
    assert link is not None and link.same_host and link.direct is None
    a = np.random.default_rng(3).standard_normal(2 << 20)  # 16 MB
    mine = len(current_agent().shm._own)
    assert np.array_equal(rpc.rpc_sync(hosted, fns.echo, args=(a,)), a)
    assert len(current_agent().shm._own) >= max(mine, 1), "the request should have gone by a segment of ours"


def test_without_shared_memory_big_buffers_take_the_kernels_own_port(world: list[str], tmp_path: Path) -> None:
    """A server whose kernels have shared memory off (as a server on another machine would be): the kernel's
    shell port is reachable here, so 64 MB go by the direct data channel, signed with its key, both ways."""
    proc, server = _start("jupyter-server", tmp_path, NBREMOTE_SHM="0")
    try:
        rpc.add_worker("srv-direct", server.spec(kernel_name="python3"))
        try:
            link = current_agent().peers["srv-direct"].link
            assert link is not None and not link.same_host and link.direct is not None
            assert rpc.rpc_sync("srv-direct", fns.bulk_channels) == 1, "the kernel should know the channel too"
            a = np.random.default_rng(4).standard_normal(8 << 20)  # 64 MB
            b = rpc.rpc_sync("srv-direct", fns.echo, args=(a,))
            assert np.array_equal(a, b) and b.flags.writeable
            assert rpc.rpc_sync("srv-direct", fns.add, args=(2, 3)) == 5  # small calls keep to the websocket
        finally:
            rpc.remove_worker("srv-direct")
    finally:
        _stop(proc)


def test_64_mb_through_the_websocket_alone_into_reused_memory(world: list[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No shared memory, no direct channel: every byte crosses the server's websocket in pieces, both ways,
    received into pooled memory (``_wire.bufpool``). A result kept, here and on the worker (an RRef's
    value is the array received there), stays unchanged while later messages reuse memory."""
    proc, server = _start("jupyter-server", tmp_path, NBREMOTE_SHM="0")
    monkeypatch.setenv("NBREMOTE_SHELL_PATH", "0")  # the comm path: no direct data channel either
    try:
        rpc.add_worker("srv-ws", server.spec(kernel_name="python3"))
        try:
            link = current_agent().peers["srv-ws"].link
            assert link is not None and not link.same_host and link.direct is None
            rng = np.random.default_rng(5)
            a, c = rng.standard_normal(8 << 20), rng.standard_normal(8 << 20)  # 64 MB each
            first = rpc.rpc_sync("srv-ws", fns.echo, args=(a,))
            kept_there = rpc.remote("srv-ws", fns.echo, args=(a,))  # the worker keeps what it received
            assert np.array_equal(first, a) and first.flags.writeable
            for _ in range(2):  # the second time, memory the first let go of is reused
                assert np.array_equal(rpc.rpc_sync("srv-ws", fns.echo, args=(c,)), c)
                gc.collect()
            assert np.array_equal(first, a), "a result kept here must be unchanged by later messages"
            assert np.array_equal(kept_there.to_here(), a), "a value kept on the worker must be unchanged"
            assert bufpool.POOL.free_bytes > 0, "memory of the messages no longer viewed should be back in the pool"
        finally:
            rpc.remove_worker("srv-ws")
    finally:
        _stop(proc)


@pytest.mark.skipif(torch is None, reason="needs torch (pip install torch==2.13.0)")
def test_a_remote_module_forward_on_a_server_hosted_worker(hosted: str) -> None:
    from nbremote.nn import RemoteModule

    net = RemoteModule(f"{hosted}/cpu", torch.nn.Linear, args=(4, 2))
    x = torch.randn(3, 4)
    expected = torch.nn.functional.linear(x, *[p.to_here() for p in net.remote_parameters()])
    assert torch.allclose(net(x), expected)


def test_remove_deletes_the_kernel_and_attach_leaves_it(world: list[str], server: Server) -> None:
    before = server.kernel_ids()
    rpc.add_worker("srv-owned", server.spec(kernel_name="python3"))
    (kernel_id,) = server.kernel_ids() - before
    rpc.remove_worker("srv-owned")
    assert kernel_id not in server.kernel_ids(), "remove_worker must delete a kernel nbremote started"

    model = server.api("POST", "api/kernels", {"name": "python3"})
    assert isinstance(model, dict)
    try:
        rpc.add_worker("srv-attached", server.spec(kernel_id=str(model["id"])))
        assert rpc.rpc_sync("srv-attached", fns.whoami) == "srv-attached"
        rpc.remove_worker("srv-attached")
        assert str(model["id"]) in server.kernel_ids(), "remove_worker must not stop an attached kernel"
    finally:
        server.api("DELETE", f"api/kernels/{model['id']}")


def test_cells_run_on_a_server_hosted_worker(hosted: str) -> None:
    seen: list[tuple[str, str, dict[str, object]]] = []
    run = rpc.run_cell(hosted, "x = 6 * 7\nprint('x is', x)\nx", on_output=lambda *m: seen.append(m))
    assert run.outcomes[hosted].status == "ok"
    assert (hosted, "stream", "x is 42\n") in [(w, t, c.get("text")) for w, t, c in seen]
    assert any(t == "execute_result" for _, t, _ in seen)
    assert rpc.rpc_sync(hosted, fns.add, args=(1, 1)) == 2
    with pytest.raises(rpc.RemoteCellError, match="ZeroDivisionError"):
        rpc.run_cell(hosted, "1 / 0", on_output=lambda *m: None)
    run = rpc.run_cell(hosted, "import time\nfor _ in range(600): time.sleep(0.1)", background=True,
                       on_output=lambda *m: None)
    time.sleep(0.5)
    run.interrupt()  # through the server's REST API
    with pytest.raises(rpc.RemoteCellError, match="KeyboardInterrupt"):
        run.wait(10)


def test_interrupt_goes_through_the_server(world: list[str], server: Server) -> None:
    before = server.kernel_ids()
    rpc.add_worker("srv-int", server.spec(kernel_name="python3"))
    try:
        (kernel_id,) = server.kernel_ids() - before
        timer = threading.Timer(1.0, rpc.interrupt_worker, args=("srv-int",))
        timer.start()
        t0 = time.monotonic()
        reply = server.execute(kernel_id, "import time\nfor _ in range(600): time.sleep(0.1)")
        timer.join()
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t0 < 10
        assert rpc.rpc_sync("srv-int", fns.add, args=(1, 1)) == 2, "RPCs go on after the interrupt"
    finally:
        rpc.remove_worker("srv-int")


def test_a_notebook_starts_workers_in_its_own_server(jupyter_server: Server) -> None:
    server = jupyter_server
    model = server.api("POST", "api/kernels", {"name": "python3"})  # the notebook's kernel: the driver
    assert isinstance(model, dict)
    try:
        reply = server.execute(str(model["id"]), textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(ROOT / "tests")!r})
            import nbremote, remote_fns as fns
            from nbremote import rpc
            rpc.init_rpc("nb", workers={{"own1": nbremote.ServerKernel.from_env(kernel_name="python3")}})
            assert rpc.rpc_sync("own1", fns.whoami) == "own1"
            import urllib.request, json
        """))
        assert reply["status"] == "ok", reply
        assert "own1" in server.session_names(), "the worker should be listed under its name"
        reply = server.execute(str(model["id"]), "rpc.shutdown()")
        assert reply["status"] == "ok", reply
        assert "own1" not in server.session_names()
    finally:
        server.api("DELETE", f"api/kernels/{model['id']}")


def test_the_magic_starts_workers_in_a_server(world: list[str], jupyter_server: Server) -> None:
    server = jupyter_server  # the magic is a thin adapter over ServerKernel: one server is enough
    from ipython_shell import open_shell, run

    with open_shell() as shell:
        ran = run(shell, f"%remote_workers start mg1 mg2 --server {server.url} --token {server.token} --kernel python3")
        assert ran.error is None, f"{ran.error!r} {ran.err}"
        assert ran.out.strip() == f"nbremote: started mg1, mg2 (in the Jupyter server at {server.url})"
        assert {"mg1", "mg2"} <= server.session_names()
        assert rpc.rpc_sync("mg2", fns.whoami) == "mg2"
        assert run(shell, "%remote_workers stop mg1 mg2").error is None
    assert not {"mg1", "mg2"} & server.session_names()


def env_var(name: str) -> str | None:
    return os.environ.get(name)  # the worker's (os.environ.get itself would travel with the driver's environ)


def test_a_gateway_passes_kernel_variables(world: list[str], kernel_gateway: Server) -> None:
    server = kernel_gateway  # KERNEL_* variables in the start request are a gateway's (Kernel/Enterprise Gateway)
    rpc.add_worker("srv-env", server.spec(kernel_name="python3", env={"KERNEL_NBREMOTE_TEST": "from-the-driver"}))
    try:
        assert rpc.rpc_sync("srv-env", env_var, args=("KERNEL_NBREMOTE_TEST",)) == "from-the-driver"
    finally:
        rpc.remove_worker("srv-env")


def test_restart_gives_a_fresh_kernel(world: list[str], server: Server) -> None:
    rpc.add_worker("srv-restart", server.spec(kernel_name="python3"))
    try:
        old = rpc.rpc_sync("srv-restart", fns.pid)
        rpc.restart_worker("srv-restart")
        assert rpc.rpc_sync("srv-restart", fns.pid) != old
    finally:
        rpc.remove_worker("srv-restart")


def test_a_kernel_restarted_through_its_server_comes_back_with_its_module_and_adam(world: list[str],
                                                                                    jupyter_server: Server) -> None:
    if torch is None:
        pytest.skip("needs torch (pip install -e '.[torch]')")
    import nbremote.autograd as dist_autograd
    from nbremote.nn import RemoteModule, last_report
    from nbremote.optim import DistributedOptimizer

    server = jupyter_server  # one server: the restart is the server's, the recovery nbremote's
    before = server.kernel_ids()
    rpc.add_worker("srv-recover", server.spec(kernel_name="python3"))
    try:
        (kernel_id,) = server.kernel_ids() - before
        net = RemoteModule("srv-recover/cpu", torch.nn.Linear, args=(4, 2), snapshot_every=1)
        opt = DistributedOptimizer(torch.optim.Adam, net.remote_parameters(), lr=0.01)
        for _ in range(2):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [net(torch.ones(3, 4)).sum()])
                opt.step(ctx)
        snap = net.snapshots.get()
        server.api("POST", f"api/kernels/{kernel_id}/restart")  # what JupyterLab's "Restart Kernel" does
        deadline = time.monotonic() + 30
        while True:
            try:
                net(torch.ones(1, 4))
            except WorkerLostError:
                break
            assert time.monotonic() < deadline, "the restart through the server was never noticed"
            time.sleep(0.1)
        rpc.restart_worker("srv-recover")
        report = last_report("srv-recover")
        assert report is not None and not report.lost and len(report.restored) == 2, str(report)
        state = net.remote_state_dict()
        assert all(torch.equal(state[k], snap.state[k]) for k in snap.state) and snap.step == 2
        (local,) = opt.remote_optimizers
        live = rpc.rpc_sync("srv-recover", fns.optimizer_state, args=(local._id,))
        (part,) = snap.optimizers.values()
        assert all(torch.equal(live[p][k], part.state[p][k]) for p in part.state for k in part.state[p])
        with dist_autograd.context() as ctx:  # and training goes on through the same handles
            dist_autograd.backward(ctx, [net(torch.ones(3, 4)).sum()])
            opt.step(ctx)
        assert net.snapshots.get().step == 3
    finally:
        rpc.remove_worker("srv-recover")


def test_a_kernel_deleted_behind_our_back_fails_its_calls(world: list[str], server: Server) -> None:
    before = server.kernel_ids()
    rpc.add_worker("srv-doomed", server.spec(kernel_name="python3"))
    try:
        (kernel_id,) = server.kernel_ids() - before
        fut = rpc.rpc_async("srv-doomed", fns.sleep, args=(60,))
        time.sleep(0.3)
        server.api("DELETE", f"api/kernels/{kernel_id}")
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError, match="srv-doomed"):
            fut.wait(20)
        assert time.monotonic() - t0 < 8, "the server's word should end the calls, not a 10 s silence"
    finally:
        rpc.remove_worker("srv-doomed")


def test_errors_name_the_fix(world: list[str], server: Server) -> None:
    with pytest.raises(ServerError, match="token") as info:
        rpc.add_worker("bad", nbremote.ServerKernel(server.url, token="wrong", kernel_name="python3"))
    assert info.value.status in (401, 403)
    with pytest.raises(ServerError, match=r"no kernelspec 'nope' \(it offers: .*python3"):
        rpc.add_worker("bad", server.spec(kernel_name="nope"))
    with pytest.raises(ServerError, match="no kernel 'f00' on"):
        rpc.add_worker("bad", server.spec(kernel_id="f00"))
    with pytest.raises(ServerError, match="cannot reach the Jupyter server"):
        rpc.add_worker("bad", nbremote.ServerKernel(f"http://127.0.0.1:{free_port()}/", token="x",
                                                    kernel_name="python3"))
    with pytest.raises(ServerError, match="not a Jupyter server URL"):
        rpc.add_worker("bad", nbremote.ServerKernel("localhost:8888", kernel_name="python3"))
    assert "bad" not in [w.name for w in rpc.worker_status()]


def test_a_dead_drivers_state_is_freed_by_its_lease(world: list[str], tmp_path: Path) -> None:
    """A driver killed without a goodbye: after its lease, an attached worker frees the driver's values,
    and a worker the driver started asks its server to delete it (so no orphan lingers in JupyterLab)."""
    lease = 2.0
    proc, server = _start("jupyter-server", tmp_path, NBREMOTE_LEASE_SECONDS=str(lease))
    try:
        model = server.api("POST", "api/kernels", {"name": "python3"})
        assert isinstance(model, dict)
        code = f"""
            import os, sys
            sys.path.insert(0, {str(ROOT / "tests")!r})
            import nbremote, remote_fns as fns
            from nbremote import rpc
            spec = nbremote.ServerKernel({server.url!r}, token={server.token!r}, kernel_id={model["id"]!r})
            own = nbremote.ServerKernel({server.url!r}, token={server.token!r}, kernel_name="python3")
            rpc.init_rpc("doomed-driver", workers={{"att": spec, "orphan": own}})
            kept = [rpc.remote("att", fns.make_list, args=(1000,)) for _ in range(20)]
            print(rpc.rpc_sync("att", fns.rref_table_size), flush=True)
            os.kill(os.getpid(), 9)
        """
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=60, cwd=str(ROOT))
        assert done.returncode == -9, done.stderr
        assert int(done.stdout.split()[0]) >= 20
        assert "orphan" in server.session_names()
        deadline = time.monotonic() + lease + 10
        while "orphan" in server.session_names() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "orphan" not in server.session_names(), "a worker the dead driver started outlived its lease"
        assert server.kernel_ids() == {str(model["id"])}
        rpc.add_worker("att", server.spec(kernel_id=str(model["id"])))  # a new driver attaches
        try:
            deadline = time.monotonic() + lease + 8
            while rpc.rpc_sync("att", fns.rref_table_size) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert rpc.rpc_sync("att", fns.rref_table_size) == 0, "the dead driver's values outlived its lease"
        finally:
            rpc.remove_worker("att")
    finally:
        _stop(proc)


def test_the_server_benchmark_runs() -> None:
    """A smoke run of benchmarks/bench_server.py: both transports measured, nothing about speed."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick"],
                          capture_output=True, text=True, timeout=110, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the table's rows: a case, two timings and a ratio (the header may end in "x" too: a temp dir's name)
    rows = [re.match(r"^(small call|echo \d+ MB) +[\d.]+ +[\d.]+ +[\d.]+x$", line.strip())
            for line in proc.stdout.splitlines()]
    assert sorted(m.group(1).split()[0] for m in rows if m) == ["echo", "small"], proc.stdout


def test_the_websocket_formats_are_jupyter_servers() -> None:
    from jupyter_server.services.kernels.connection.base import (
        deserialize_binary_message,
        serialize_binary_message,
        serialize_msg_to_ws_v1,
    )

    from nbremote.rpc._wire.wsproto import OP_BINARY, OP_TEXT, decode_legacy, decode_v1, encode_legacy, encode_v1

    parts = [b'{"msg_id":"1","msg_type":"x"}', b"{}", b"{}", b'{"a":1}', bytes(range(10)), b"buf2"]
    ours = b"".join(bytes(p) for p in encode_v1("shell", parts))
    assert ours == serialize_msg_to_ws_v1(parts, "shell")
    channel, got = decode_v1(bytearray(ours))
    assert channel == "shell" and [bytes(g) for g in got] == parts
    msg = {"header": {"msg_id": "1", "msg_type": "x"}, "parent_header": {}, "metadata": {}, "content": {"a": 1}}
    frames, opcode = encode_legacy("iopub", msg, [b"xyz", b"12"])
    theirs = deserialize_binary_message(b"".join(bytes(f) for f in frames))
    assert opcode == OP_BINARY and theirs["channel"] == "iopub" and theirs["buffers"] == [b"xyz", b"12"]
    assert theirs["content"] == {"a": 1} and theirs["header"]["msg_id"] == "1"
    channel, got = decode_legacy(OP_BINARY, bytearray(serialize_binary_message({**msg, "channel": "control",
                                                                                  "buffers": [b"xyz"]})))
    assert channel == "control" and json.loads(bytes(got[3])) == {"a": 1} and bytes(got[4]) == b"xyz"
    frames, opcode = encode_legacy("shell", msg)
    assert opcode == OP_TEXT and json.loads(frames[0])["channel"] == "shell"
    with pytest.raises(ValueError, match="offsets"):
        decode_v1(bytearray(ours[:40]))


def test_pieces_reassemble_exactly() -> None:
    buffers = [bytes(range(256)) * 40, b"", b"x" * 1000, bytes(7)]
    data, bufs = envelope.pack([({"k": "call", "id": 1, "fn": "f", "caller": "d"}, buffers)])
    parts = batching.Parts()
    messages = batching.split_parts(dict(data), bufs, 4096, "p1")
    assert len(messages) == 3  # 11,247 bytes
    whole = None
    for content, frames in messages:
        assert sum(memoryview(f).nbytes for f in frames) <= 4096
        ((env, frames_in),) = envelope.unpack(content, frames)
        whole = parts.add("driver", env, frames_in)
    assert whole is not None
    ((env, frames_out),) = envelope.unpack(*whole)
    assert env["k"] == "call" and [bytes(f) for f in frames_out] == buffers
