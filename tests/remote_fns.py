"""Functions the tests run on workers (importable there: workers get the driver's sys.path)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from typing import Any

from nbremote import rpc
from nbremote.rpc._core import current_agent
from nbremote.rpc._transport.zmqlink import KernelLink


def echo(x: Any) -> Any:
    return x


def add(a: Any, b: Any) -> Any:
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


def pid() -> int:
    return os.getpid()


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def busy_loop(seconds: float, flag_path: str) -> str:
    """Loops in Python (so it can be cancelled between iterations); touches flag_path when it ends normally."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    with open(flag_path, "w") as f:
        f.write("finished")
    return "finished"


def fail(kind: str, message: str) -> None:
    raise {"value": ValueError, "key": KeyError, "zero": ZeroDivisionError, "runtime": RuntimeError}[kind](message)


class Unpicklable(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()


def raise_unpicklable() -> None:
    raise Unpicklable("has a lock")


def chatty(n: int) -> int:
    for i in range(n):
        print(f"line {i}")
    print("to stderr", file=sys.stderr)
    return n


def call_peer(peer: str, fn: Any, *args: Any) -> Any:
    return rpc.rpc_sync(peer, fn, args=args)


def ping_pong(origin: str, depth: int) -> list[str]:
    """A→B→A→...: each hop calls back the other side."""
    me = rpc.get_worker_info().name
    if depth == 0:
        return [me]
    return [me, *rpc.rpc_sync(origin, ping_pong, args=(me, depth - 1))]


def rref_table_size() -> int:
    gc.collect()
    time.sleep(0.3)  # let reference-count messages that are on their way arrive
    gc.collect()
    return len(current_agent().table)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_list(n: int) -> list[int]:
    return list(range(n))


def rref_to_here(rref: Any) -> Any:
    return rref.to_here()


def rref_owner_name(rref: Any) -> str:
    return rref.owner_name()


def make_rref_here(value: Any) -> Any:
    return rpc.RRef(value)


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value


_KEPT: list[Any] = []


def keep(rref: Any) -> int:
    """Keep ``rref`` here; how many references its owner (this process) counts for it now."""
    _KEPT.append(rref)
    return len(current_agent().table._entries[rref._id].tokens)


def kept_values() -> list[Any]:
    return [r.local_value() for r in _KEPT]


def drop_kept() -> None:
    _KEPT.clear()


def sum_rrefs(rrefs: list[Any]) -> int:
    return sum(r.to_here() for r in rrefs)


@rpc.functions.async_execution
def add_later(peer: str, a: int, b: int) -> Any:
    """Replies when a call it starts on ``peer`` completes; its own thread is free meanwhile."""
    return rpc.rpc_async(peer, add, args=(a, b)).then(lambda f: f.value() * 10)


@rpc.functions.async_execution
def async_fails(peer: str) -> Any:
    return rpc.rpc_async(peer, fail, args=("key", "async missing"))


@rpc.functions.async_execution
def async_wrong_type() -> Any:
    return 42


def executor_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("nbremote-worker"))


def call_peer_with_timeout(peer: str, fn: Any, timeout: float, *args: Any) -> Any:
    return rpc.rpc_sync(peer, fn, args=args, timeout=timeout)


def call_peer_async(peer: str, fn: Any, *args: Any) -> Any:
    return rpc.rpc_async(peer, fn, args=args).wait()


def remote_on_peer(peer: str, fn: Any, *args: Any) -> Any:
    """An RRef to ``fn(*args)`` created on ``peer`` (e.g. the driver) and returned to the caller."""
    return rpc.remote(peer, fn, args=args)


def incr_many(rref: Any, n: int) -> int:
    """``n`` increments of a Counter through its RRef, from this worker; returns the last value seen."""
    last = 0
    for _ in range(n):
        last = rref.rpc_sync().incr()
    return last


def served_where() -> tuple[str, bool, float]:
    """Which thread runs this call, whether it is the main thread, and when (monotonic clock)."""
    return threading.current_thread().name, threading.current_thread() is threading.main_thread(), time.monotonic()


def shout(text: str) -> int:
    print(text)
    return len(text)


def _shell_path() -> Any:
    """This kernel's shell path (``nbremote.rpc._worker.shellpath.ShellPath``), or None."""
    from IPython import get_ipython

    return getattr(getattr(get_ipython(), "kernel", None), "_nbremote_shell_path", None)


def shell_path_state() -> dict[str, Any]:
    """How this kernel serves the shell path: installed, replies shared, received by threads (waiting side by
    side, or relaying)."""
    path = _shell_path()
    if path is None:
        return {"installed": False}
    receivers = path.receivers
    return {"installed": True, "shared": path.shared, "receiving": receivers.receiving,
            "exclusive": receivers.exclusive, "waiting": receivers._free}


def set_receive_poll_ms(ms: int) -> int:
    """Set how often this kernel's receiving threads look at the shell socket without being woken (the
    safety net against a lost edge); returns the old value. A long one makes a lost edge a stall."""
    from nbremote.rpc._worker import receivers

    old, receivers.RECEIVE_POLL_MS = receivers.RECEIVE_POLL_MS, ms
    return old


def hold_shell_socket(seconds: float) -> None:
    """Hold this kernel's shell-socket lock for ``seconds`` from a thread of its own (messages pile up
    unreceived meanwhile); returns at once."""
    path = _shell_path()

    def hold() -> None:
        with path.lock:
            time.sleep(seconds)

    threading.Thread(target=hold, daemon=True).start()


def delay_serving(marker: str | None, seconds: float = 0.0) -> None:
    """Make this kernel's receiving thread pause ``seconds`` after receiving a message whose content holds
    ``marker``, before serving it (widens the window in which another receiving thread could overtake it);
    ``None`` undoes it."""
    path = _shell_path()
    receivers = path.receivers
    if marker is None:
        receivers.__dict__.pop("_serve", None)
        return
    serve, mark = type(receivers)._serve.__get__(receivers), marker.encode()

    def slow_serve(frames: Any) -> Any:
        parts = frames[1] if type(frames) is tuple else frames  # (link, frames) from a Unix-domain connection
        if any(mark in bytes(getattr(f, "bytes", f)) for f in parts[-2:]):
            time.sleep(seconds)
        return serve(frames)

    receivers._serve = slow_serve


def backward_storm(target: str, threads: int) -> int:
    """``threads`` concurrent distributed backward passes from here through ``target`` (torch's
    ``_workload_thread``); how many gave the gradients plain autograd gives for the same computation."""
    import torch

    import nbremote.autograd as dist_autograd

    def one() -> bool:
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            t3 = rpc.rpc_sync(target, torch.add, args=(t1, t2))
            t4 = rpc.rpc_sync(target, torch.mul, args=(t2, t3))
            t5 = rpc.rpc_sync(target, torch.matmul, args=(t3, t4))
            t6 = rpc.rpc_sync(target, torch.add, args=(t4, t5))
            dist_autograd.backward(context_id, [t6.sum()])
            grads = dist_autograd.get_gradients(context_id)
            l3 = t1 + t2
            l4 = t2 * l3
            expected = torch.autograd.grad([(l4 + l3 @ l4).sum()], [t1, t2])
            return all(torch.allclose(grads[t], g) for t, g in zip((t1, t2), expected, strict=True))

    results: list[bool] = []
    workers = [threading.Thread(target=lambda: results.append(one())) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(results)


def wait_on_torch_future(peer: str) -> int:
    """A handler that waits on a torch future completed by an RPC's callback."""
    import torch

    done: torch.futures.Future[int] = torch.futures.Future()
    rpc.rpc_async(peer, add, args=(40, 2)).then(lambda f: done.set_result(f.wait()))
    return done.wait()


class AsyncAdder:
    """An RRef's value with ``@async_execution`` methods (torch's AsyncExecutionClass, shortened)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    @rpc.functions.async_execution
    def add_later(self, a: int, b: int) -> Any:
        return rpc.rpc_async(self.peer, add, args=(a, b)).then(lambda f: f.value() * 10)

    @staticmethod
    @rpc.functions.async_execution
    def with_torch_future(x: int) -> Any:
        """Returns a ``torch.futures.Future`` it completes itself, as torch users write."""
        import torch

        fut: torch.futures.Future[int] = torch.futures.Future()
        fut.set_result(x + 1)
        return fut


def attributes_of(obj: Any) -> dict[str, Any]:
    return dict(vars(obj))


def bulk_channels() -> int:
    """How many callers reach this worker by a direct data channel (see nbremote.rpc._transport.direct)."""
    from IPython import get_ipython

    path = getattr(get_ipython().kernel, "_nbremote_shell_path", None)
    return 0 if path is None else len({id(link.bulk) for link in path._links.values() if link.bulk is not None})


def optimizer_state(optimizer_id: str) -> dict[int, dict[str, Any]]:
    """The state a DistributedOptimizer's local optimizer keeps here, by parameter position (copies)."""
    from nbremote.rpc._core import owned_value

    local = owned_value(optimizer_id)
    return {pos: {k: v.clone() for k, v in local.optim.state[p].items()}
            for pos, p in enumerate(local.params) if p in local.optim.state}


def burst_to(peer: str, n: int) -> int:
    """``n`` calls to ``peer`` at once; how many came back (right) within 20 s."""
    import contextlib
    import operator

    futs = [rpc.rpc_async(peer, operator.add, args=(i, 1)) for i in range(n)]
    deadline = time.monotonic() + 20
    back = 0
    for i, fut in enumerate(futs):
        with contextlib.suppress(TimeoutError):
            back += fut.wait(max(0.01, deadline - time.monotonic())) == i + 1
    return back


def live_state() -> dict[str, int]:
    """What a training step may leave behind in this process: autograd contexts, backward passes, pending
    calls, owned RRef values and Future objects."""
    agent = current_agent()
    gc.collect()  # what is garbage already is not kept
    passes = 0
    for ctx_id in agent.grad:
        ctx = agent.grad.get(ctx_id)
        passes += 0 if ctx is None else len(ctx.passes)
    return {"contexts": len(agent.grad), "passes": passes, "pending": len(agent.calls), "rrefs": len(agent.table),
            "futures": sum(1 for o in gc.get_objects() if type(o) is rpc.Future)}


def settled_live_states(workers: list[str], timeout: float = 5.0) -> dict[str, dict[str, int]]:
    """``live_state`` of the driver (here) and of ``workers``, once every one has let its autograd contexts go
    (releases are fire and forget: let them arrive), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        states = {"driver": live_state(), **{w: rpc.rpc_sync(w, live_state) for w in workers}}
        if all(s["contexts"] == 0 for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def grown(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """What grew between two ``settled_live_states``, by (process, count). A thing kept per step would be there
    hundreds of times over; a few come and go (the futures of the very calls that count, a release on its way)."""
    return {(p, k): after[p][k] - before[p][k] for p in before for k in before[p] if after[p][k] > before[p][k] + 2}


def unix_channels() -> list[dict[str, Any]]:
    """The Unix-domain connections this kernel's receiving threads read (``_transport.unixlink``): whose link
    each is, whether it is a thread's own, and the messages it carried each way."""
    path = _shell_path()
    if path is None:
        return []
    return [{"caller": link.name, "thread": link.alias, "got": channel.got, "sent": channel.sent,
             "broken": channel.broken} for channel, link in list(path.receivers._channels.values())]


def shut_unix_channels_then(value: Any) -> Any:
    """Close every Unix-domain connection to this kernel from its side, then return ``value`` -- whose reply
    has to find another way back."""
    path = _shell_path()
    for channel, _ in list(path.receivers._channels.values()):
        channel.shut()
    return value


def unix_socket_path() -> str | None:
    return _shell_path().local.where


def unix_counts_calling(peer: str, n: int) -> dict[str, Any]:
    """``n`` blocking calls from this worker to ``peer``, and the messages its link's Unix-domain connections
    carried meanwhile, each way: the link's own and its threads', summed (a thread gets a connection of its own
    while the link has fewer than its cap; past it, it sends by the link's). None: the link has none."""
    rpc.rpc_sync(peer, int)  # the link to a peer opens at the first call
    link = current_agent().peers[peer].link
    assert isinstance(link, KernelLink), f"the link to {peer!r} is a {type(link).__name__}, not a kernel's"

    def counted() -> list[int] | None:
        if link.unix is None or link.unix.broken:
            return None
        channels = [link.unix, *(ts.unix for ts in link.threads._all if ts.unix is not None)]
        return [sum(c.sent for c in channels), sum(c.got for c in channels)]

    before = counted()
    results = [rpc.rpc_sync(peer, int, args=(i,)) for i in range(n)]
    after = counted()
    return {"results": results,
            "moved": None if before is None or after is None else [after[0] - before[0], after[1] - before[1]]}
