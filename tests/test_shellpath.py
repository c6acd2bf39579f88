"""The shell path inside a worker kernel (``_worker.shellpath``): its receiving thread, and both ways back to the
loop and the comm path. Real kernels, the real transport."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import remote_fns as fns
from test_security import RawShell, _kernel, _peer

import nbremote
from nbremote import rpc
from nbremote.rpc._transport.sockets import connect

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def loop_worker(world: list[str]) -> Iterator[str]:
    """A worker whose shell-channel thread's event loop receives (``NBREMOTE_SHELL_RECEIVER=0``)."""
    rpc.add_worker("loopworker", nbremote.LocalKernel(env={**os.environ, "NBREMOTE_SHELL_RECEIVER": "0"}))
    try:
        yield "loopworker"
    finally:
        rpc.remove_worker("loopworker")


@pytest.fixture(scope="module")
def relay_worker(world: list[str]) -> Iterator[str]:
    """A worker whose receiving thread relays receiving to another one for each call
    (``NBREMOTE_SHELL_RECEIVER=relay``, what platforms without ``EPOLLEXCLUSIVE`` do)."""
    rpc.add_worker("relayworker", nbremote.LocalKernel(env={**os.environ, "NBREMOTE_SHELL_RECEIVER": "relay"}))
    try:
        yield "relayworker"
    finally:
        rpc.remove_worker("relayworker")


def _calls_and_cells(worker: str, tmp_path: Path) -> None:
    """Calls from three threads while a raw client sends 40 execute_requests without waiting, the first
    ones while the shell socket is held (they pile up, and the receiving threads all wake for them): every
    call answers right, and the cells run in the order they were sent (the receiving threads hand them to
    ipykernel in order)."""
    out = tmp_path / f"order-{worker}"
    raw = RawShell(dict(_kernel(worker).conn))
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller(k: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                assert rpc.rpc_sync(worker, fns.add, args=(k, i)) == k + i
                assert rpc.rpc_async(worker, fns.echo, args=(b"x" * 70_000,)).wait() == b"x" * 70_000
                i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        rpc.rpc_sync(worker, fns.hold_shell_socket, args=(0.3,))  # the first cells pile up, then race
        for n in range(40):
            raw.send(raw.execute(f"open({str(out)!r}, 'a').write('{n}\\n')"))
        replies = []
        deadline = time.monotonic() + 60
        while len(replies) < 40 and time.monotonic() < deadline:
            replies += [m for m in raw.replies(1.0) if m["msg_type"] == "execute_reply"]
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        raw.close()
    assert not errors, errors
    assert [m["content"]["status"] for m in replies] == ["ok"] * 40
    assert out.read_text().split() == [str(n) for n in range(40)]


def test_every_kind_of_worker_is_reached_by_the_shell_path(world: list[str], relay_worker: str,
                                                           loop_worker: str) -> None:
    """The link answered its ping on the shell path (else it silently keeps to the comm path, and every other
    test here still passes), and a blocking call's thread got its own socket, whose ping was answered too."""
    for name in [*world, relay_worker, loop_worker]:
        assert rpc.rpc_sync(name, fns.add, args=(1, 2)) == 3
        link = _peer(name).link
        assert link is not None and link.fast, f"{name} fell back to the comm path"
        assert link.threads._mine() is not None, f"{name} refused this thread's own socket"


def test_threads_receive_and_keep_cells_in_order(world: list[str], tmp_path: Path) -> None:
    state = rpc.rpc_sync("worker1", fns.shell_path_state)
    assert {k: state[k] for k in ("installed", "shared", "receiving")} == {"installed": True, "shared": True,
                                                                           "receiving": True}
    assert state["exclusive"] is (sys.platform == "linux")  # Linux has EPOLLEXCLUSIVE
    _calls_and_cells("worker1", tmp_path)
    # still receiving on its threads: it never fell back to the loop on the way
    assert rpc.rpc_sync("worker1", fns.shell_path_state)["receiving"] is True


def test_relaying_threads_receive_and_keep_cells_in_order(relay_worker: str, tmp_path: Path) -> None:
    assert rpc.rpc_sync(relay_worker, fns.shell_path_state) == {"installed": True, "shared": True,
                                                                 "receiving": True, "exclusive": False,
                                                                 "waiting": 1}  # its one receiving thread
    _calls_and_cells(relay_worker, tmp_path)


def test_a_message_being_served_is_not_overtaken(world: list[str], tmp_path: Path) -> None:
    """Receiving threads serve one message at a time: a cell whose serving is slowed stays ahead of the cells
    sent after it, although another thread wakes for them meanwhile."""
    out = tmp_path / "overtake"
    raw = RawShell(dict(_kernel("worker1").conn))
    rpc.rpc_sync("worker1", fns.delay_serving, args=("SLOW-CELL", 0.3))
    try:
        for _ in range(3):
            rpc.rpc_sync("worker1", fns.add, args=(1, 2))  # two receiving threads wait, as in normal use
        raw.send(raw.execute(f"open({str(out)!r}, 'a').write('0\\n')  # SLOW-CELL"))
        time.sleep(0.1)
        for n in range(1, 6):
            raw.send(raw.execute(f"open({str(out)!r}, 'a').write('{n}\\n')"))
        replies: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while len(replies) < 6 and time.monotonic() < deadline:
            replies += [m for m in raw.replies(1.0) if m["msg_type"] == "execute_reply"]
    finally:
        rpc.rpc_sync("worker1", fns.delay_serving, args=(None,))
        raw.close()
    assert out.read_text().split() == [str(n) for n in range(6)]


@pytest.mark.parametrize("worker", ["worker2", "relayworker"])
def test_calls_that_block_do_not_block_receiving(worker: str, relay_worker: str) -> None:
    from nbremote.rpc._worker.receivers import SPARE_RECEIVERS

    # the first claim the threads that received them; with both busy, the rest go to the executor
    release = [rpc.rpc_async(worker, time.sleep, args=(3,)) for _ in range(SPARE_RECEIVERS + 2)]
    t0 = time.monotonic()
    assert [rpc.rpc_sync(worker, fns.add, args=(i, 1)) for i in range(50)] == list(range(1, 51))
    assert time.monotonic() - t0 < 2.5, "calls waited for a blocked one"
    for f in release:
        f.wait()
    # the threads that ran them went back to the executor but for the spare ones (one answers this call)
    time.sleep(0.2)
    exclusive = worker == "worker2" and sys.platform == "linux"
    assert rpc.rpc_sync(worker, fns.shell_path_state)["waiting"] == (SPARE_RECEIVERS - 1 if exclusive else 1)


@pytest.mark.parametrize("worker", ["worker2", "relayworker"])
def test_bursts_do_not_grow_the_workers_threads(worker: str, relay_worker: str) -> None:
    """When every receiving thread is busy with a call, the next calls go to the executor and receiving goes on
    in the thread that received them: no thread is started per message. (It once was, whenever all were busy:
    a worker grew by a few threads a burst, to hundreds, every one a GIL contender.)"""
    import operator

    before = rpc.rpc_sync(worker, threading.active_count)
    for _ in range(5):
        calls = [rpc.rpc_async(worker, operator.add, args=(n, 1)) for n in range(1000)]
        assert [f.wait(60) for f in calls] == list(range(1, 1001))
    after = rpc.rpc_sync(worker, threading.active_count)
    # the executor may start threads up to its core (fewer than that wait now), and one more for a stall
    assert after <= before + 4, f"{before} threads before five bursts, {after} after"


def test_replies_of_a_burst_leave_together(world: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """While calls wait for a thread, a finished call's reply waits (``DEFER_S`` at most) for theirs: a burst's
    replies reach the driver in far fewer messages than calls. Counted where the driver decodes messages."""
    import operator

    from nbremote.rpc._wire import codec

    decoded: list[int] = []
    decode = codec.Codec.decode

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        decoded.append(1)
        return decode(self, *args, **kwargs)

    rpc.rpc_sync("worker3", fns.add, args=(1, 2))
    monkeypatch.setattr(codec.Codec, "decode", counting)
    calls = [rpc.rpc_async("worker3", operator.add, args=(n, 1)) for n in range(1000)]
    assert [f.wait(60) for f in calls] == list(range(1, 1001))
    monkeypatch.undo()
    assert len(decoded) < 400, f"1,000 replies came in {len(decoded)} messages"


def test_a_reply_is_not_held_back_by_a_long_call_queued_behind_it(world: list[str]) -> None:
    """A reply that waits for those of queued calls leaves after ``DEFER_S`` anyway: here every call queued
    behind the short one sleeps for seconds, and none of them finishes before the short one's reply is due."""
    short = rpc.rpc_async("worker3", time.sleep, args=(0.05,))
    long = [rpc.rpc_async("worker3", time.sleep, args=(3,)) for _ in range(6)]  # more than the free threads
    t0 = time.monotonic()
    short.wait(10)
    assert time.monotonic() - t0 < 1.0, "the short call's reply waited for the long ones"
    assert not any(f.done() for f in long)
    for f in long:
        f.wait(20)


@pytest.mark.parametrize("worker", ["worker1", "relayworker"])
def test_no_message_waits_for_the_safety_net(worker: str, relay_worker: str, tmp_path: Path) -> None:
    """With the receiving threads' periodic look at the socket pushed to 30 s, every message must still be
    received because an edge or a wake-up said so -- also one that was already waiting behind a call when
    that call was received (its edge was consumed with the call's)."""
    old = rpc.rpc_sync(worker, fns.set_receive_poll_ms, args=(30_000,))
    try:
        time.sleep(0.3)  # the waits begun with the old value have ended
        for _ in range(2):
            rpc.rpc_sync(worker, fns.hold_shell_socket, args=(0.5,))
            time.sleep(0.1)  # the socket is held: what comes now piles up
            blocked = rpc.rpc_async(worker, time.sleep, args=(2.0,))
            time.sleep(0.05)  # a message of its own, behind the blocking call's on the same connection
            small = rpc.rpc_async(worker, fns.add, args=(1, 2))
            t0 = time.monotonic()
            assert small.wait(20) == 3
            assert time.monotonic() - t0 < 1.0, "a call waited behind a blocked one for the safety net"
            blocked.wait(20)
        _calls_and_cells(worker, tmp_path)
    finally:
        rpc.rpc_sync(worker, fns.set_receive_poll_ms, args=(old,))


def test_the_loop_receives_where_the_thread_is_switched_off(loop_worker: str, tmp_path: Path) -> None:
    assert rpc.rpc_sync(loop_worker, fns.shell_path_state) == {"installed": True, "shared": True,
                                                                "receiving": False, "exclusive": False,
                                                                "waiting": 0}
    _calls_and_cells(loop_worker, tmp_path)


def test_the_comm_path_serves_where_the_shell_path_is_switched_off() -> None:
    script = textwrap.dedent("""
        import json, os, time
        from nbremote import rpc
        from nbremote.rpc._core import current_agent
        import remote_fns as fns
        rpc.init_rpc("driver", workers=["w1"])
        link = current_agent().peers["w1"].link
        t0 = time.monotonic()
        results = [rpc.rpc_sync("w1", fns.add, args=(i, 1)) for i in range(200)]
        async_results = [f.wait() for f in [rpc.rpc_async("w1", fns.echo, args=(i,)) for i in range(200)]]
        # Bursts both ways at once, past IOPub's default high-water mark (1,000 messages), which dropped some
        rpc.add_workers(["w2", "w3"])
        bursts = [rpc.rpc_async(w, fns.burst_to, args=("driver", 2000)) for w in ("w1", "w2", "w3")]
        mine = [rpc.rpc_async(("w1", "w2", "w3")[i % 3], fns.add, args=(i, 1)) for i in range(2000)]
        bursts = [f.wait() for f in bursts] + [sum(f.wait(30) == i + 1 for i, f in enumerate(mine))]
        print(json.dumps({"fast": link.fast, "ok": results == list(range(1, 201)) and async_results == list(range(200)),
                          "bursts": bursts, "ms": (time.monotonic() - t0) * 1000}))
        rpc.shutdown()
    """)
    env = {**os.environ, "NBREMOTE_SHELL_PATH": "0", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["fast"] is False and seen["ok"] is True
    assert seen["bursts"] == [2000] * 4


def test_a_link_opens_while_another_subscriber_holds_the_kernels_iopub(world: list[str]) -> None:
    """A kernel's XPUB reports a subscription (and ipykernel sends its iopub_welcome) only when no other
    subscriber has that topic yet: a second link opening at the same time must still see IOPub, through
    the busy/idle of its own kernel_info_request (once suppressed for nbremote's username)."""
    import zmq

    rpc.add_worker("subpeer")
    conn = dict(_kernel("subpeer").conn)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    connect(sub, conn, "iopub_port")  # tcp or ipc, as the kernel was started
    sub.setsockopt(zmq.SUBSCRIBE, b"")  # held for the whole test, like a link still opening
    try:
        time.sleep(0.5)  # the subscription reaches the kernel before worker2's does
        t0 = time.monotonic()
        assert rpc.rpc_sync("worker2", fns.call_peer_with_timeout, args=("subpeer", fns.add, 20.0, 2, 3),
                            timeout=25) == 5
        assert time.monotonic() - t0 < 10, "the link's IOPub handshake waited for traffic that never came"
    finally:
        sub.close()
        rpc.remove_worker("subpeer")
