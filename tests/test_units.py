"""Pure pieces, tested with plain values: wire envelopes, futures, the owner's reference counts, the pending
calls and the membership table."""

from __future__ import annotations

import contextvars
import hashlib
import threading
import time
from typing import Any

import pytest

from nbremote.errors import ProtocolError, RRefError, RRefLostError, UnknownWorkerError, WorkerLostError
from nbremote.frameworks import tensor_key
from nbremote.rpc._core.calls import Pending, PendingCalls, introspecting, introspection
from nbremote.rpc._core.future import Future
from nbremote.rpc._core.gradctx import Contexts
from nbremote.rpc._core.members import WorkerInfo
from nbremote.rpc._core.owners import OwnerTable, tagged_id
from nbremote.rpc._core.peers import Peer, Peers
from nbremote.rpc._wire import batching, envelope

pytestmark = pytest.mark.timeout(10)


def test_pack_unpack_round_trip_keeps_frames_with_their_envelopes() -> None:
    items = [({"k": "call", "id": 1}, [b"a", b"bb"]), ({"k": "rref", "add": [["r", "t"]]}, []),
             ({"k": "ok", "id": 2}, [memoryview(b"ccc")])]
    data, buffers = envelope.pack(items)  # type: ignore[arg-type]
    assert [e["nf"] for e in data["msgs"]] == [2, 0, 1] and len(buffers) == 3
    out = envelope.unpack(data, buffers)
    assert [(e["k"], [bytes(f) for f in fr]) for e, fr in out] == [("call", [b"a", b"bb"]), ("rref", []),
                                                                  ("ok", [b"ccc"])]


V = envelope.PROTOCOL_VERSION


@pytest.mark.parametrize("data, buffers, message", [
    ([], [], "expected a dict"),
    ({"nbr": 99, "msgs": []}, [], "protocol version 99"),
    ({"nbr": V}, [], "no 'msgs' list"),
    ({"nbr": V, "msgs": [{"k": "launch-missiles"}]}, [], "malformed envelope"),
    ({"nbr": V, "msgs": [{"k": "call", "id": 1, "nf": 2}]}, [b"x"], "claims 2 frames"),
    ({"nbr": V, "msgs": [{"k": "call", "id": 1, "nf": -1}]}, [], "claims -1 frames"),
    ({"nbr": V, "msgs": [{"k": "call", "nf": 0}]}, [], "without an integer id"),
    ({"nbr": V, "msgs": [{"k": "ok", "id": 1, "nf": 0}]}, [b"extra"], "left over"),
    ({"nbr": V, "msgs": [{"k": "call", "id": 0, "nr": True, "fail": "driver"}]}, [], "malformed 'fail' target"),
    ({"nbr": V, "msgs": [{"k": "call", "id": 0, "nr": True, "fail": ["driver", 7, 1]}]}, [], "malformed 'fail'"),
])
def test_unpack_rejects_malformed_messages(data: object, buffers: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        envelope.unpack(data, buffers)


def test_buffer_digests_detect_tampering() -> None:
    mac = envelope.FrameMac(b"the connection key")
    data, buffers = envelope.pack([({"k": "ok", "id": 1}, [b"payload"])], mac=mac)  # type: ignore[list-item]
    assert envelope.unpack(data, buffers, mac=mac)
    with pytest.raises(ProtocolError, match="does not match its signed digest"):
        envelope.unpack(data, [b"PAYLOAD"], mac=mac)
    with pytest.raises(ProtocolError, match="does not match its signed digest"):  # made without the key
        envelope.unpack(data, buffers, mac=envelope.FrameMac(b"another key"))
    plain, bufs = envelope.pack([({"k": "ok", "id": 1}, [b"payload"])])  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="digests missing"):
        envelope.unpack(plain, bufs, mac=mac)


@pytest.mark.parametrize("key", [b"k" * 32, b""])
def test_frame_digests_are_keyed_fresh_and_cover_every_byte(key: bytes) -> None:
    """A keyed digest (GMAC, a fresh nonce each time) checks, in pieces where a frame is longer than one
    piece may be; a digest of the frame with any byte changed, cut short or of another length fails.
    Without a key (an unsigned connection) it is SHA-256."""
    mac = envelope.FrameMac(key, chunk=1000)
    frame = bytes(range(256)) * 10  # 2,560 bytes: three pieces of at most 1,000
    digest = mac.of(frame)
    assert mac.matches(frame, digest) and mac.matches(memoryview(frame), digest)
    if key:
        assert len(bytes.fromhex(digest)) == 3 * (mac.NONCE + mac.TAG)
        assert mac.of(frame) != digest, "each digest has a fresh nonce"
        assert mac.matches(b"", mac.of(b"")) and not mac.matches(b"", digest)
    else:
        assert digest == hashlib.sha256(frame).hexdigest()
    for altered in (frame[:1500] + b"\x00" + frame[1501:], frame[:-1], frame + b"!", frame[1000:] + frame[:1000]):
        assert not mac.matches(altered, digest)
    assert not mac.matches(frame, digest[:-2]) and not mac.matches(frame, "zz" + digest[2:])
    assert not mac.matches(frame, None) and not mac.matches(frame, "")


def test_loopback_detection() -> None:
    assert envelope.is_loopback("127.0.0.1") and envelope.is_loopback("localhost") and envelope.is_loopback("::1")
    assert not envelope.is_loopback("10.0.0.5")


def test_owner_table_frees_only_when_every_token_was_added_and_removed() -> None:
    table = OwnerTable()
    table.create("r", "t0").set_result("value")
    table.add("r", "fork")
    table.remove("r", "t0")
    assert len(table) == 1
    table.remove("r", "late")  # a removal that overtook its add keeps the value alive
    table.remove("r", "fork")
    assert len(table) == 1
    table.add("r", "late")
    assert len(table) == 0
    with pytest.raises(RRefError, match="not held on here any more"):
        table.value("r", "here", 5.0)  # freed: an error at once, no waiting


def test_owner_table_waits_for_a_value_whose_creation_is_on_the_way() -> None:
    table = OwnerTable()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(table.value("r", "here", 5.0)))
    reader.start()  # the use overtook the remote() that creates it
    time.sleep(0.1)
    table.create("r", "t0").set_result("made")
    reader.join(5)
    assert got == ["made"] and len(table) == 1
    with pytest.raises(RRefError, match="never created on here"):
        table.value("other", "here", 0.1)
    assert len(table) == 1, "a value that never came leaves nothing behind"


def test_owner_table_fails_at_once_for_ids_of_an_earlier_incarnation() -> None:
    table = OwnerTable("new")
    mine = table.new_id()
    assert mine.endswith("@new")
    table.create(mine, "t0").set_result("made here")
    assert table.value(mine, "here", 5.0) == "made here"
    old = tagged_id("old")
    table.apply(add=[[old, "fork"]], rm=[[old, "other"]])  # counts about the old kernel's values: dropped
    assert len(table) == 1
    t0 = time.monotonic()
    with pytest.raises(RRefLostError, match="earlier kernel of 'here'") as info:
        table.value(old, "here", 5.0)
    assert time.monotonic() - t0 < 1.0 and info.value.worker == "here"
    table.adopt(old, "restored", [("t1", "driver"), ("t2", "driver")])  # put back under its old id
    assert table.value(old, "here", 5.0) == "restored"
    table.remove(old, "t1")
    table.remove(old, "t2")
    assert len(table) == 1, "freed once every reference counted at adoption was dropped"
    untagged = "0" * 32  # an id made without the owner's incarnation (not known): waited for, as before
    with pytest.raises(RRefError, match="never created"):
        table.value(untagged, "here", 0.1)


def test_owner_table_counts_a_lent_reference_unless_the_value_is_gone() -> None:
    table = OwnerTable()
    table.create("r", "caller").set_result("value")
    assert table.lend("r", "lent", "here")  # the caller's reference holds it: counted
    table.remove("r", "caller")
    assert table.value("r", "here", 5.0) == "value", "the lent copy keeps the value"
    table.remove("r", "lent")
    assert len(table) == 0
    assert not table.lend("r", "late", "here"), "the caller stopped waiting and the value went: nothing counted"
    assert len(table) == 0
    assert table.lend("new", "lent", "here") and len(table) == 1  # its remote() is on the way: waited for


def test_owner_table_apply_batches() -> None:
    table = OwnerTable()
    table.apply(add=[["a", "1"], ["b", "1"]], rm=[["a", "1"]])
    assert len(table) == 1


def test_future_set_once_and_callbacks_after_completion() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="Future can only be marked completed once"):  # as torch's
        fut.set_result(2)
    with pytest.raises(RuntimeError, match="Future can only be marked completed once"):
        fut.set_exception(ValueError())
    assert fut._complete(3, None) is False  # how nbremote completes calls' futures: a late reply is dropped
    assert fut.wait() == 1 and fut.value() == 1 and fut.exception() is None
    seen = threading.Event()
    fut.add_done_callback(lambda f: seen.set())
    assert seen.wait(2)
    assert fut.then(lambda f: f.value() + 1).wait(2) == 2


def test_future_wait_timeout() -> None:
    fut: Future[int] = Future()
    with pytest.raises(TimeoutError, match=r"not done after 0\.05 s"):
        fut.wait(0.05)


def test_future_interrupt_hook_runs_on_keyboard_interrupt() -> None:
    import os
    import signal

    fut: Future[int] = Future()
    called = []
    fut.on_interrupt = lambda: called.append(True)
    timer = threading.Timer(0.1, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        fut.wait(5)
    assert called == [True]


def test_batches_bound_size_and_count_and_keep_order() -> None:
    items = [({"k": "ok", "id": i}, [b"x" * 400]) for i in range(10)]
    out = list(batching.batches(items, max_bytes=1000, max_items=3))  # type: ignore[arg-type]
    assert [[e["id"] for e, _ in b] for b in out] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    big = [({"k": "ok", "id": 0}, [b"x" * 5000]), ({"k": "ok", "id": 1}, [])]
    assert [len(b) for b in batching.batches(big, max_bytes=1000)] == [1, 1]  # type: ignore[arg-type]


def test_outbox_sends_everything_in_order_from_many_threads() -> None:
    sent: list[list[int]] = []
    outbox = batching.Outbox(lambda batch: sent.append([e["id"] for e, _ in batch]))

    def worker(base: int) -> None:
        for i in range(500):
            outbox.post({"k": "ok", "id": base + i})
            outbox.drain()

    threads = [threading.Thread(target=worker, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [i for b in sent for i in b]
    assert sorted(flat) == sorted(n * 1000 + i for n in range(4) for i in range(500))
    for n in range(4):  # each thread's envelopes stay in the order it posted them
        mine = [i for i in flat if n * 1000 <= i < (n + 1) * 1000]
        assert mine == sorted(mine)
    assert len(sent) <= len(flat)


def test_outbox_close_drops_queued_and_stops_sending() -> None:
    sent: list[object] = []
    outbox = batching.Outbox(sent.append)
    outbox.post({"k": "ok", "id": 1})
    ran: list[bool] = []
    outbox.close(then=lambda: ran.append(True))
    outbox.post({"k": "ok", "id": 2})
    outbox.drain()
    outbox.locked(lambda: ran.append(False))
    assert sent == [] and ran == [True] and outbox.closed


def test_pool_grows_only_when_its_threads_are_stuck() -> None:
    from nbremote.rpc._core.pool import GROW_AFTER, Pool

    pool = Pool("unit", core=2, max_threads=8)
    try:
        done: list[int] = []
        for i in range(2000):  # a burst of quick calls: the core threads keep up
            pool.submit(done.append, i)
        deadline = time.monotonic() + 10
        while len(done) < 2000 and time.monotonic() < deadline:
            pool.check(time.monotonic())
            time.sleep(0.001)
        # threads start on demand: one that keeps up is enough; never more than the core
        assert sorted(done) == list(range(2000)) and 1 <= pool.threads <= 2
        release = threading.Event()
        started: list[int] = []
        for i in range(3):  # three calls that block: each one left waiting gets a thread added for it
            pool.submit(lambda i=i: (started.append(i), release.wait(10)))
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(GROW_AFTER)
            pool.check(time.monotonic())  # the IO thread's tick does this every 50 ms
        assert sorted(started) == [0, 1, 2] and pool.threads == 3, "one thread per blocked call, no more"
        release.set()
    finally:
        pool.shutdown()


def test_wait_all_returns_values_in_order_and_fails_at_the_first_error() -> None:
    from nbremote.rpc import wait_all

    futs = [Future[int]() for _ in range(3)]
    threading.Timer(0.05, futs[2].set_result, args=(3,)).start()
    threading.Timer(0.10, futs[0].set_result, args=(1,)).start()
    threading.Timer(0.15, futs[1].set_result, args=(2,)).start()
    assert wait_all(futs) == [1, 2, 3]
    slow, failing = Future[int](), Future[int]()
    threading.Timer(0.05, failing.set_exception, args=(KeyError("first error"),)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="first error"):
        wait_all([slow, failing])  # slow never completes: the error must not wait for it
    assert time.monotonic() - t0 < 2
    assert wait_all([]) == []


def test_settle_all_waits_for_every_future_and_returns_their_errors_in_order() -> None:
    from nbremote.rpc._core import settle_all

    futs: list[Future[int]] = [Future() for _ in range(3)]
    later = threading.Timer(0.1, futs[2].set_exception, args=(KeyError("late"),))
    later.start()
    futs[0].set_exception(ValueError("first"))  # an early error: settle_all still waits for the others
    threading.Timer(0.05, futs[1].set_result, args=(2,)).start()
    start = time.monotonic()
    errors = settle_all(futs)
    assert time.monotonic() - start >= 0.09 and all(f.done() for f in futs)
    assert [type(e) for e in errors] == [ValueError, KeyError]
    assert settle_all([]) == []
    slow, lost = Future(), Future()
    threading.Timer(0.05, lost.set_exception, args=(ConnectionError("gone"),)).start()
    start = time.monotonic()
    errors = settle_all([slow, lost], unless=(ConnectionError,))  # ends the wait at once, first in the list
    assert [type(e) for e in errors] == [ConnectionError] and time.monotonic() - start < 2 and not slow.done()


def test_pool_shutdown_ends_its_threads_and_refuses_work() -> None:
    from nbremote.rpc._core.pool import Pool

    pool = Pool("unit-shutdown", core=3)
    release = threading.Event()
    ran: list[int] = []
    pool.submit(release.wait, 10)
    for i in range(2):
        pool.submit(ran.append, i)
    deadline = time.monotonic() + 5
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ran) == [0, 1] and pool.threads >= 2
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(ran.append, 3)
    release.set()  # the running call finishes on its own; then every thread leaves
    deadline = time.monotonic() + 5
    while pool.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.threads == 0 and sorted(ran) == [0, 1]


def _pending(peer: str, deadline: float | None = None, counted: bool = True) -> Pending:
    return Pending(Future(), peer, "f", 1.0, deadline, contextvars.copy_context(), counted=counted)


def test_pending_calls_give_ids_and_give_each_call_back_once() -> None:
    calls = PendingCalls()
    a, b = _pending("w1"), _pending("w2")
    ids = [calls.add(a), calls.add(b)]
    assert ids[0] != ids[1] and len(calls) == 2
    assert calls.get(ids[0]) is a and len(calls) == 2, "output peeks: the call stays pending"
    assert calls.take(ids[0]) is a and calls.take(ids[0]) is None, "a reply takes it once; a late one finds none"
    assert calls.for_peer("w2") == [b] and len(calls) == 0


def test_pending_calls_expire_by_deadline_only() -> None:
    calls = PendingCalls()
    soon, later, never = _pending("w1", 10.0), _pending("w1", 20.0), _pending("w1", None)
    ids = [calls.add(p) for p in (soon, later, never)]
    assert calls.expired(5.0) == []
    assert calls.expired(15.0) == [(ids[0], soon)]
    assert calls.expired(1e9) == [(ids[1], later)] and len(calls) == 1, "no deadline: never expires"
    assert calls.clear() == [never] and len(calls) == 0


def test_pending_calls_for_one_peer_and_one_call() -> None:
    calls = PendingCalls()
    p1, p2, q = _pending("w1"), _pending("w1"), _pending("w2")
    _, i2, _ = (calls.add(p) for p in (p1, p2, q))
    assert calls.for_peer("w1", only=i2) == [p2]
    assert calls.for_peer("w1") == [p1] and calls.for_peer("w1") == [] and len(calls) == 1


def test_pending_calls_count_what_is_made_and_in_flight_but_not_introspection() -> None:
    calls = PendingCalls()
    first = calls.add(_pending("w1"))
    calls.add(_pending("w1", counted=False))  # a status display's own call
    calls.add(_pending("w2"))
    assert calls.counts("w1") == (1, 1) and calls.counts("w2") == (1, 1) and calls.counts("w3") == (0, 0)
    calls.take(first)
    assert calls.counts("w1") == (0, 1), "made stays counted once the call is done"
    assert not introspecting.get()
    with introspection():
        assert introspecting.get()
    assert not introspecting.get()


def test_pending_calls_wait_idle_waits_for_calls_and_their_followers() -> None:
    calls = PendingCalls()
    first = _pending("w1")
    calls.add(first)

    def finish() -> None:
        follower = _pending("w1")
        calls.add(follower)  # made while the first was pending: waited for too
        calls.take(1)
        first.fut.set_exception(ValueError("failures belong to the caller"))
        time.sleep(0.05)
        calls.take(2)
        follower.fut.set_result(None)

    start = time.monotonic()  # before the timer starts: its thread may begin its wait before we go on
    threading.Timer(0.05, finish).start()
    calls.wait_idle(5)
    assert len(calls) == 0 and time.monotonic() - start >= 0.09  # the follower's end, not the first's (0.05)
    calls.add(_pending("w1"))
    start = time.monotonic()
    calls.wait_idle(0.1)  # a call that never ends: gives up at the timeout
    assert 0.1 <= time.monotonic() - start < 2


class _IO:
    """What Peers uses of the IO thread: links handed to it, dropped or lost."""

    def __init__(self) -> None:
        self.dropped: list[Any] = []
        self.lost: list[tuple[Any, str]] = []

    def drop(self, link: Any) -> None:
        self.dropped.append(link)

    def lose(self, link: Any, why: str) -> None:
        self.lost.append((link, why))


def _peers(starting: tuple[str, ...] = ()) -> tuple[Peers, _IO, list[Any]]:
    io, adopted = _IO(), []
    peers = Peers(WorkerInfo("w1", 1), io, None, adopted.append)  # type: ignore[arg-type]
    peers.starting = lambda name: name in starting
    return peers, io, adopted


def test_peers_resolve_names_ranks_and_infos_with_errors_that_list_who_exists() -> None:
    peers, _, _ = _peers(starting=("w9",))
    peers.add(Peer(WorkerInfo("driver", 0)))
    peers.add(Peer(WorkerInfo("w2", 2), conn={"ip": "127.0.0.1"}))
    assert peers.resolve("w2") == WorkerInfo("w2", 2) == peers.resolve(2) == peers.resolve(WorkerInfo("w2", 7))
    assert peers.resolve(1) is peers.me and peers.resolve("w1") is peers.me
    assert peers.known() == ["w1", "driver", "w2"]
    unknown = r"could not find destination 'w5': no such worker in this world \(known: w1, driver, w2\)"
    with pytest.raises(UnknownWorkerError, match=unknown):
        peers.resolve("w5")
    with pytest.raises(WorkerLostError, match="'w9' is being \\(re\\)started"):
        peers.resolve("w9")
    with pytest.raises(TypeError, match="name, rank or WorkerInfo, not bool"):
        peers.resolve(True)


def test_peers_learn_the_world_from_the_driver() -> None:
    peers, io, _ = _peers()
    assert peers.admits("anyone"), "until the driver said who is in the world, the first caller bootstraps us"
    left = peers.update([{"name": "driver", "rank": 0, "conn": None}, {"name": "w1", "rank": 1, "conn": None},
                         {"name": "w2", "rank": 2, "conn": {"ip": "127.0.0.1"}}])
    assert left == [] and sorted(peers) == ["driver", "w2"] and "w1" not in peers, "we are not our own peer"
    assert peers.admits("w2") and not peers.admits("stranger")
    peers["w2"].link = link = object()  # type: ignore[assignment]
    left = peers.update([{"name": "driver", "rank": 0, "conn": None}, {"name": "w1", "rank": 1, "conn": None},
                         {"name": "w2", "rank": 2, "conn": {}, "lost": "killed"}])
    assert left == [] and io.lost == [(link, "the driver saw it go: killed")]
    assert peers.update([{"name": "driver", "rank": 0, "conn": None}]) == ["w2"], "w2 left: the agent removes it"
    removed = peers.remove("w2", "it left the world")
    assert removed is not None and removed.lost == "it left the world", "its link's loss is the IO thread's to mark"
    assert io.dropped == [link] and peers.remove("w2", "again") is None


def test_peers_route_back_through_a_callers_comm() -> None:
    peers, _, _ = _peers()
    driver = Peer(WorkerInfo("driver", 0))
    peers.add(driver)
    peers.driver = "driver"  # as the world broadcast says (the driver need not be rank 0)
    with pytest.raises(WorkerLostError, match="its comm to this worker is closed"):
        peers.link(driver)

    class Channel:
        name, same_host, closed = "driver", False, False

    channel = Channel()
    peers.attach_caller(channel)  # type: ignore[arg-type]
    assert peers.link(driver) is channel and peers.route("driver") is channel
    assert not peers.detach_caller(Channel())  # type: ignore[arg-type]  # not its route: nothing stranded
    assert peers.detach_caller(channel), "the driver has no other route: its pending calls are stranded"  # type: ignore[arg-type]
    assert peers.route("driver") is None and peers.route("nobody") is None


def test_a_last_gradient_is_its_leafs_not_a_newcomers_at_the_same_address() -> None:
    torch = pytest.importorskip("torch")
    contexts = Contexts(0)
    leaf = torch.zeros(3, requires_grad=True)
    ctx = contexts.join(1, "w1")
    assert ctx is not None
    ctx.grads[tensor_key(leaf)] = (leaf, torch.ones(3))
    del ctx
    contexts.release(1)
    assert torch.equal(contexts.last_gradient(leaf), torch.ones(3))
    old = id(leaf)
    del leaf
    newcomers = [torch.zeros(3, requires_grad=True) for _ in range(100)]  # one takes the freed address
    same = [t for t in newcomers if id(t) == old]
    assert same, "no new tensor reused the address: the check below would prove nothing"
    assert contexts.last_gradient(same[0]) is None, "a module built again showed the old one's gradients"

