"""Security: what a kernel nbremote starts exposes, and what its channels refuse.

- kernels bind loopback unless asked otherwise; connection files are 0600 in a 0700 runtime directory
  (and logs 0600); each kernel has its own random HMAC-SHA256 key, a new one after a restart;
- a hand-made zmq socket holding the kernel's connection info proves that a message with a wrong
  signature, a signed message whose content was altered, a replayed message, and (on a link beyond
  loopback, where nbremote signs its buffers) an nbremote call whose pickled buffer was altered or
  whose digests were stripped are all dropped without running anything. "Without running" is proven by
  a side-effect file: each bad message would append to it, and a good message sent right after on the
  same channel (served in order) shows that the bad ones were handled and left no trace, while itself
  proving that the crafted path does run when the message is intact.

The nbremote comm refusing a caller that is not a member of the world is tested in test_leases.py
(``test_the_nbremote_comm_admits_only_members_of_the_world``); the CurveZMQ encryption of links beyond
loopback in test_rpc_failures.py (``test_non_loopback_links_sign_their_buffers``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import remote_fns as fns
import zmq
from faults import fault_fns as ffns
from jupyter_client.session import Session

import nbremote
from nbremote import rpc
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport.sockets import connect
from nbremote.rpc._wire import envelope, serialize

pytestmark = pytest.mark.timeout(90)

QUIET = 1.5  # s to wait for an answer that must not come


def _peer(name: str) -> Any:
    return current_agent().peers[name]


def _kernel(name: str) -> Any:
    """The driver's handle on a worker's kernel (its connection info, its KernelManager)."""
    return current_agent().world.kernel(name)


@pytest.fixture(scope="module")
def wide(world: list[str]) -> Iterator[str]:
    """A kernel started beyond loopback (asked for: ip 0.0.0.0) without CurveZMQ, where nbremote signs its
    buffers (with CurveZMQ on, its authenticator covers them: see test_rpc_failures)."""
    rpc.add_worker("wide", nbremote.LocalKernel(ip="0.0.0.0", encrypt=False))
    try:
        yield "wide"
    finally:
        rpc.remove_worker("wide")


PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_kernels_listen_only_on_this_machine_unless_asked(world: list[str], wide: str) -> None:
    for name in world:  # Unix-domain sockets in the private runtime directory; TCP only on loopback (ipykernel's
        # own pipe for its subprocesses' output)
        conn = _kernel(name).conn
        assert conn["transport"] == "ipc", conn
        for p in PORTS:
            sock = Path(f"{conn['ip']}-{conn[p]}")
            assert sock.is_socket(), f"{name}: no socket {sock}"
            assert sock.parent == Path(_kernel(name).km.connection_file).parent
            assert stat.S_IMODE(sock.parent.stat().st_mode) & 0o077 == 0, f"{sock.parent} is open to others"
        listening = _listening(rpc.rpc_sync(name, fns.pid))
        assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, f"{name} listens on {listening}"
    rpc.add_worker("narrow", nbremote.LocalKernel(transport="tcp"))  # TCP asked for: on loopback only
    try:
        conn = _kernel("narrow").conn
        assert conn["transport"] == "tcp" and conn["ip"] == "127.0.0.1"
        listening = _listening(rpc.rpc_sync("narrow", fns.pid))
        assert {("127.0.0.1", conn[p]) for p in PORTS} <= listening
        assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, f"narrow listens on {listening}"
        assert rpc.rpc_sync("narrow", fns.add, args=(2, 3)) == 5
    finally:
        rpc.remove_worker("narrow")
    conn = _kernel(wide).conn  # asked for: its channels, and only those, on every interface
    open_to_all = {port for ip, port in _listening(rpc.rpc_sync(wide, fns.pid)) if ip not in ("127.0.0.1", "::1")}
    assert open_to_all == {conn[p] for p in PORTS}


def test_connection_files_and_logs_are_private(world: list[str], wide: str) -> None:
    for name in [*world, wide]:
        kernel = _kernel(name)
        conn_file = Path(kernel.km.connection_file)
        assert conn_file.exists(), f"{name}: no connection file"
        assert stat.S_IMODE(conn_file.stat().st_mode) == 0o600, f"{name}: {conn_file} is not 0600"
        runtime = conn_file.parent.stat()
        assert stat.S_IMODE(runtime.st_mode) & 0o077 == 0 and runtime.st_uid == os.getuid(), \
            f"{name}: {conn_file.parent} is open to others"
        log = Path(kernel.log_path)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600, f"{name}: its log {log} is not 0600"
        assert stat.S_IMODE(log.parent.stat().st_mode) & 0o077 == 0


def test_every_kernel_has_its_own_random_hmac_sha256_key(world: list[str], wide: str) -> None:
    keys = []
    for name in [*world, wide]:
        conn = _kernel(name).conn
        assert conn["signature_scheme"] == "hmac-sha256"
        keys.append(bytes(conn["key"]))
    assert all(len(k) >= 32 for k in keys), "keys too short to be 128 random bits"
    assert len(set(keys)) == len(keys), "two kernels share a key"
    rpc.add_worker("rekeyed")
    try:
        before = bytes(_kernel("rekeyed").conn["key"])
        rpc.restart_worker("rekeyed")
        after = bytes(_kernel("rekeyed").conn["key"])
        assert after != before and after not in keys, "a restarted kernel kept its key"
    finally:
        rpc.remove_worker("rekeyed")


def test_connection_files_of_a_killed_driver_are_swept_by_the_next(world: list[str]) -> None:
    """A driver killed by SIGKILL cannot remove its kernels' connection files (they die with it, their
    keys stay on disk); the next driver removes those whose driver pid is dead, and no others."""
    from nbremote.rpc._kernels.paths import runtime_dir, sweep_connection_files

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale = runtime_dir() / f"kernel-nbremote-w-1-{gone.pid}-0123abcd.json"
    stale_socket = runtime_dir() / f"kernel-nbremote-w-1-{gone.pid}-0123abcd.ipc-3"  # its ipc channel's file
    live = runtime_dir() / f"kernel-nbremote-w-1-{os.getpid()}-0123abcd.json"
    live_socket = runtime_dir() / f"kernel-nbremote-w-1-{os.getpid()}-0123abcd.ipc-3"
    other = runtime_dir() / f"kernel-{uuid.uuid4()}.json"  # a notebook server's: not ours to touch
    made = (stale, stale_socket, live, live_socket, other)
    for path in made:
        path.write_text("{}")
    try:
        assert sweep_connection_files() >= 2
        assert not stale.exists() and not stale_socket.exists()
        assert live.exists() and live_socket.exists() and other.exists()
        assert all(Path(_kernel(w).km.connection_file).exists() for w in world)
    finally:
        for path in made:
            path.unlink(missing_ok=True)


# -- a hand-made socket on a kernel's shell channel -------------------------------------------------------------


class RawShell:
    """A DEALER on a kernel's shell port, holding its connection info (CurveZMQ keys included)."""

    def __init__(self, conn: dict[str, Any]) -> None:
        self.conn = conn
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"raw-{uuid.uuid4().hex[:8]}".encode())
        connect(self.sock, conn, "shell_port")
        key = conn["key"]
        self.session = Session(key=key if isinstance(key, bytes) else key.encode(),
                               signature_scheme=conn["signature_scheme"], username="security-test")

    def frames(self, msg_type: str, content: dict[str, Any], *, session: Session | None = None,
               header: dict[str, Any] | None = None, buffers: list[Any] | None = None) -> list[bytes]:
        sess = session or self.session
        msg = sess.msg(msg_type, content)
        msg["header"].update(header or {})
        if buffers:
            msg["buffers"] = buffers
        return [bytes(f) for f in sess.serialize(msg)] + [bytes(b) for b in buffers or []]

    def execute(self, code: str, **kw: Any) -> list[bytes]:
        return self.frames("execute_request", {"code": code, "silent": False, "store_history": False,
                                               "user_expressions": {}, "allow_stdin": False,
                                               "stop_on_error": False}, **kw)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def replies(self, timeout: float) -> list[dict[str, Any]]:
        out = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            _, msg = self.session.feed_identities(self.sock.recv_multipart())
            out.append(self.session.deserialize(msg))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def raw1(world: list[str]) -> Iterator[RawShell]:
    shell = RawShell(dict(_kernel("worker1").conn))
    try:
        yield shell
    finally:
        shell.close()


def _appender(path: Path, word: str) -> str:
    return f"open({str(path)!r}, 'a').write({word + chr(10)!r})"


def test_a_wrong_signature_is_dropped_without_running(raw1: RawShell, tmp_path: Path) -> None:
    effect = tmp_path / "effect"
    forged = Session(key=os.urandom(32), signature_scheme="hmac-sha256")
    raw1.send(raw1.execute(_appender(effect, "forged"), session=forged))
    unsigned = Session(key=b"", signature_scheme="hmac-sha256")  # no signature at all
    raw1.send(raw1.execute(_appender(effect, "unsigned"), session=unsigned))
    assert raw1.replies(QUIET) == [], "the kernel answered a message it could not have verified"
    raw1.send(raw1.execute(_appender(effect, "good")))  # the control: same channel, right key
    assert [r["header"]["msg_type"] for r in raw1.replies(10)] == ["execute_reply"]
    assert effect.read_text() == "good\n", "a message with a wrong signature ran"


def test_a_signed_message_altered_in_transit_is_dropped(raw1: RawShell, tmp_path: Path) -> None:
    effect = tmp_path / "effect"
    frames = raw1.execute(_appender(effect, "meant"))
    content = frames[-1]  # [<IDS|MSG>, signature, header, parent, metadata, content]
    assert b"meant" in content
    frames[-1] = content.replace(b"meant", b"evil!")
    raw1.send(frames)
    assert raw1.replies(QUIET) == []
    raw1.send(raw1.execute(_appender(effect, "good")))
    assert [r["header"]["msg_type"] for r in raw1.replies(10)] == ["execute_reply"]
    assert effect.read_text() == "good\n", "an altered message ran"


def test_a_replayed_message_is_dropped(raw1: RawShell, tmp_path: Path) -> None:
    effect = tmp_path / "effect"
    frames = raw1.execute(_appender(effect, "once"))
    raw1.send(frames)
    assert [r["header"]["msg_type"] for r in raw1.replies(10)] == ["execute_reply"]
    raw1.send(frames)  # the same bytes, same signature, again
    assert raw1.replies(QUIET) == [], "the kernel answered a replayed message"
    raw1.send(raw1.execute(_appender(effect, "next")))
    assert [r["header"]["msg_type"] for r in raw1.replies(10)] == ["execute_reply"]
    assert effect.read_text() == "once\nnext\n", "a replayed message ran twice"
    assert rpc.rpc_sync("worker1", fns.whoami) == "worker1"


# -- nbremote's own buffers, on a link beyond loopback ------------------------------------------------------------


def _call(path: Path, call_id: int) -> tuple[envelope.Envelope, list[bytes]]:
    env: envelope.Envelope = {"k": "call", "id": call_id, "fn": "touch", "caller": "driver", "to": 0.0}
    frames = serialize.dumps({"fn": ffns.touch, "args": (str(path),), "kwargs": {}})
    return env, [bytes(f) for f in frames]


def test_an_altered_or_unsigned_buffer_is_dropped_without_running(wide: str, tmp_path: Path) -> None:
    """The pickles nbremote sends travel as Jupyter buffers, which Jupyter does not sign. Beyond loopback
    nbremote puts a digest of each buffer, keyed by the connection's key, in the signed content and the
    worker requires it: a buffer swapped in transit, or digests left out, must not be unpickled -- nor
    digests of another kind (SHA-256, as protocol 1 had) or under another key."""
    link = _peer(wide).link
    assert link.digests, "a link beyond loopback must sign its buffers"
    raw = RawShell(dict(_kernel(wide).conn))
    header = {"subshell_id": link.subshell_id} if link.subshell_id else {}
    base = 10**12 + int.from_bytes(os.urandom(3))  # ids the driver never issued: their replies are dropped

    def comm_msg(data: Any, buffers: list[bytes]) -> list[bytes]:
        return raw.frames("comm_msg", {"comm_id": link.comm_id, "data": data}, header=header, buffers=buffers)

    try:
        meant, swapped, plain, good = (tmp_path / n for n in ("meant", "swapped", "plain", "good"))
        key = raw.conn["key"]
        mac = envelope.FrameMac(key.encode() if isinstance(key, str) else key)
        env, frames = _call(meant, base)
        data, buffers = envelope.pack([(env, frames)], mac=mac)
        _, evil = _call(swapped, base)
        raw.send(comm_msg(data, [bytes(b) for b in evil]))  # signed digests of one pickle, another pickle
        env, frames = _call(plain, base + 1)
        data, buffers = envelope.pack([(env, frames)])
        raw.send(comm_msg(data, [bytes(b) for b in buffers]))  # no digests at all
        for n, forger in enumerate((envelope.FrameMac(b""), envelope.FrameMac(b"not the key"))):
            env, frames = _call(plain, base + 3 + n)
            data, buffers = envelope.pack([(env, frames)], mac=forger)
            raw.send(comm_msg(data, [bytes(b) for b in buffers]))  # digests not under this link's key
        env, frames = _call(good, base + 2)
        data, buffers = envelope.pack([(env, frames)], mac=mac)
        raw.send(comm_msg(data, [bytes(b) for b in buffers]))  # the control: intact, so it runs
        deadline = time.monotonic() + 15
        while not good.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert good.exists(), "the intact crafted call did not run: this test would prove nothing"
        time.sleep(0.3)
        assert not swapped.exists() and not meant.exists(), "a buffer swapped in transit was unpickled and run"
        assert not plain.exists(), "a call without keyed buffer digests was run on a link that requires them"
    finally:
        raw.close()
    assert rpc.rpc_sync(wide, fns.whoami) == wide and rpc.rpc_sync("worker1", fns.whoami) == "worker1"
