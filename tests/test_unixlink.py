"""Same-host links by Unix-domain connections (``_transport.unixlink``): taken where they should be, both ways,
by the link and by a blocking caller's thread, worker to worker too; given up without losing a reply; refused
to a forged introduction; switched off by ``NBREMOTE_UNIX=0``. Real kernels, the real transport."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import remote_fns as fns
from conftest import own_worker, run_script
from test_security import _peer

from nbremote import rpc
from nbremote.errors import WorkerLostError
from nbremote.rpc._transport.shm import SHM_DIR, SOCKET_NAME
from nbremote.rpc._transport.unixlink import UnixChannel
from nbremote.rpc._wire.codec import Codec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def spare() -> Iterator[str]:
    """A worker of this test's own (its connections are broken or it is killed), removed afterwards."""
    yield from own_worker("unixspare")


def _driver_channels(worker: str) -> tuple[Any, Any]:
    """The driver's link's own connection to ``worker`` and this thread's (after one blocking call)."""
    assert rpc.rpc_sync(worker, fns.add, args=(1, 2)) == 3
    link = _peer(worker).link
    mine = link.threads._mine()
    return link.unix, None if mine is None else mine.unix


def _received_from_driver(worker: str) -> dict[bool, int]:
    """Messages ``worker`` read from the driver: on its threads' connections (True, summed: earlier tests' threads
    have theirs) and on its link's (False)."""
    got = {True: 0, False: 0}
    for c in rpc.rpc_sync(worker, fns.unix_channels):
        if c["caller"] == "driver":
            got[c["thread"]] += c["got"]
    return got


def test_a_local_link_and_a_blocking_callers_thread_each_take_a_unix_connection(world: list[str]) -> None:
    main, mine = _driver_channels("worker1")
    assert main is not None and not main.broken, "the link kept to zmq"
    assert mine is not None and not mine.broken, "this thread's own way is not a Unix-domain connection"
    there = _received_from_driver("worker1")
    before = (main.sent, main.got, mine.sent, mine.got)
    assert [rpc.rpc_sync("worker1", fns.add, args=(i, 1)) for i in range(30)] == list(range(1, 31))
    assert [f.wait(10) for f in [rpc.rpc_async("worker1", fns.add, args=(i, 2)) for i in range(30)]] == \
        list(range(2, 32))
    # a blocking call goes and comes back on the thread's own connection, one message each way
    assert (mine.sent - before[2], mine.got - before[3]) == (30, 30)
    # rpc_async goes on the link's (several may leave together), and so do their replies
    assert main.sent > before[0] and main.got > before[1]
    after = _received_from_driver("worker1")
    assert after[True] - there[True] >= 31 and after[False] > there[False]  # counted on the worker's side too


def test_a_worker_calls_a_worker_on_this_machine_by_its_unix_connection(world: list[str]) -> None:
    counts = rpc.rpc_sync("worker1", fns.unix_counts_calling, args=("worker2", 20))
    assert counts["results"] == list(range(20))
    assert counts["moved"] is not None and counts["moved"][0] >= 20 and counts["moved"][1] >= 20, counts


def test_a_worker_that_closes_its_connections_loses_no_reply(spare: str) -> None:
    """The kernel shuts every connection while it serves a call: that call's reply, and every call after it,
    blocking or not, comes back by the shell socket."""
    main, mine = _driver_channels(spare)
    assert main is not None and mine is not None
    assert rpc.rpc_sync(spare, fns.shut_unix_channels_then, args=(42,)) == 42
    pending = [rpc.rpc_async(spare, fns.add, args=(i, 1)) for i in range(50)]
    assert [f.wait(10) for f in pending] == list(range(1, 51))
    assert [rpc.rpc_sync(spare, fns.add, args=(i, 1)) for i in range(20)] == list(range(1, 21))
    assert main.broken and mine.broken
    assert rpc.rpc_sync(spare, fns.unix_channels) == []


def test_the_driver_giving_its_connections_up_loses_nothing(spare: str) -> None:
    main, mine = _driver_channels(spare)
    assert main is not None and mine is not None
    pending = rpc.rpc_async(spare, fns.sleep, args=(0.5,))
    main.shut()  # as a send that failed does: the link goes back to its shell socket
    mine.shut()
    assert pending.wait(10) == 0.5
    assert [rpc.rpc_sync(spare, fns.add, args=(i, 1)) for i in range(20)] == list(range(1, 21))
    assert [f.wait(10) for f in [rpc.rpc_async(spare, fns.add, args=(i, 2)) for i in range(20)]] == \
        list(range(2, 22))
    deadline = time.monotonic() + 5
    while rpc.rpc_sync(spare, fns.unix_channels) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rpc.rpc_sync(spare, fns.unix_channels) == [], "the kernel kept reading connections its caller closed"


def _introduce(path: str, key: bytes, env: dict[str, Any], raw: bytes | None = None) -> bytes:
    """Connect to a kernel's socket, send an introduction (signed with ``key``, or ``raw`` bytes) and return
    what came back before the kernel closed the connection, or within 3 s if it keeps it open (b"": nothing)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(3)
    sock.connect(path)
    try:
        if raw is not None:
            sock.sendall(raw)
        else:
            UnixChannel(sock).send(Codec(key).encode_items([(env, ())]))
            sock.settimeout(3)  # (a channel makes its socket blocking)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):  # (reset: closed with our bytes unread)
            while chunk := sock.recv(65536):
                data += chunk
        return data
    finally:
        sock.close()


def test_a_forged_or_malformed_introduction_is_refused(world: list[str]) -> None:
    path = rpc.rpc_sync("worker1", fns.unix_socket_path)
    assert path is not None
    assert stat.S_ISSOCK(os.stat(path).st_mode) and os.stat(path).st_mode & 0o777 == 0o600
    assert SOCKET_NAME.match(os.path.basename(path)) and os.path.dirname(path) == str(SHM_DIR)
    link = _peer("worker1").link
    key = link.session.key
    ping = {"k": "ping", "link": link.identity.hex(), "unix": "thread"}
    assert _introduce(path, b"not-the-kernels-key", ping) == b"", "a ping signed with another key was answered"
    assert _introduce(path, key, {**ping, "link": "00" * 8}) == b"", "a ping naming no link was answered"
    assert _introduce(path, key, {**ping, "unix": "sideways"}) == b""
    assert _introduce(path, key, {}, raw=struct.pack("<IQQ", 1 << 30, 1 << 50, 0)) == b""  # an absurd head
    # a plausible head asking for 64 GB: refused (the worker log says "1 frames, 68719476736 bytes"), kernel unharmed
    assert _introduce(path, key, {}, raw=struct.pack("<IQQ", 1, 1 << 36, 0) + struct.pack("<Q", (1 << 36) - 8)) == b""
    assert _introduce(path, key, {}, raw=b"GET / HTTP/1.1\r\n\r\n") == b""
    answered = _introduce(path, key, ping)  # the real key: answered, a control that the refusals mean something
    assert b"pong" in answered
    assert rpc.rpc_sync("worker1", fns.add, args=(2, 3)) == 5  # the kernel is unharmed


def test_a_call_pending_on_a_killed_workers_connection_fails_promptly(spare: str) -> None:
    main, mine = _driver_channels(spare)
    assert main is not None and mine is not None
    pid = rpc.rpc_sync(spare, fns.pid)
    path = rpc.rpc_sync(spare, fns.unix_socket_path)
    assert path is not None and os.path.exists(path)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            rpc.rpc_sync(spare, fns.sleep, args=(30,))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    pending = rpc.rpc_async(spare, fns.sleep, args=(30,))
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerLostError, match=spare):
        pending.wait(10)
    thread.join(10)
    assert time.monotonic() - t0 < 3.0
    assert len(errors) == 1 and isinstance(errors[0], WorkerLostError), errors
    rpc.remove_worker(spare)
    assert not os.path.exists(path), "a killed kernel's socket was left behind (the driver sweeps them)"


def test_nbremote_unix_0_keeps_links_on_zmq() -> None:
    proc = run_script("""
        import json, os
        os.environ["NBREMOTE_UNIX"] = "0"
        from nbremote import rpc
        from nbremote.rpc._core import current_agent
        rpc.init_rpc("driver", workers=["w1"])
        out = {"sum": rpc.rpc_sync("w1", sum, args=([1, 2],))}
        link = current_agent().peers["w1"].link
        out["unix"] = link.unix is not None
        out["fast"] = link.fast
        rpc.shutdown()
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"sum": 3, "unix": False, "fast": True}


def test_two_ends_sending_to_each_other_at_once_never_wait_on_each_other() -> None:
    """The write-write deadlock of issue 38, on a bare pair: each end sends 64 MB before it reads anything.
    Blocking writes wedge both (a 5 s timeout used to break it by giving the connection up); here every send
    returns at once, the rest is written as the other end reads, and both read everything whole."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ends = [UnixChannel(a), UnixChannel(b)]
    messages = [[bytes([i]) * 100, bytes([i]) * (4 << 20)] for i in range(16)]
    got: dict[int, list[list[bytes]]] = {0: [], 1: []}

    def talk(i: int) -> None:
        me = ends[i]
        for m in messages:
            me.send(m)
        poller = select.poll()
        poller.register(me.fd, select.POLLIN)
        deadline = time.monotonic() + 30
        while len(got[i]) < len(messages) and time.monotonic() < deadline:
            poller.poll(100)
            frames = me.take()
            assert frames is not None, me.failure
            if frames:
                got[i].append([bytes(f) for f in frames])

    threads = [threading.Thread(target=talk, args=(i,)) for i in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert got[0] == messages and got[1] == messages
    assert time.monotonic() - t0 < 5, "a send waited for the peer"
    assert not any(e.broken for e in ends)
    for e in ends:
        e.close()


def test_a_connection_that_ends_mid_message_hands_back_what_the_peer_did_not_read() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, reader = UnixChannel(a), UnixChannel(b)
    messages = [[b"%d" % i, bytes(300_000)] for i in range(20)]
    for m in messages:
        sender.send(m)
    read: list[bytes] = []
    while len(read) < 5:
        frames = reader.take()
        if frames:
            read.append(bytes(frames[0]))
    reader.close()  # it read 5 whole, maybe part of a 6th: the rest is lost with the connection
    deadline = time.monotonic() + 5
    while sender.take() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.broken
    again = sender.leftovers()
    assert again is not None and sender.leftovers() is None  # handed back once
    resent = [bytes(m[0]) for m in again]
    assert resent == [b"%d" % i for i in range(20 - len(resent), 20)], "not the tail, in order"
    assert len(resent) >= 15, "a message the peer never read whole was not handed back"
