"""Distributed autograd bookkeeping in the RPC layer: which context a call belongs to, what crossed.

``nbremote.autograd`` (above this layer) runs the backward pass; this module only records, per
process, what the pass will need, while calls are made and served:

* ``current`` is the autograd context of the running thread (or task). ``with dist_autograd.context()``
  sets it; a call made while it is set carries its id (``ag``), and the process serving the call runs
  it with the same context current, so nested calls (driver -> worker1 -> worker2) stay in it.
* Tensors that require grad and cross in a message of such a call -- arguments or a result -- are a
  *send* on the sending side (``Context.sends``: the very tensors, which keep their local graph alive)
  and arrive as leaves on the other (``Context.recvs``: leaf -> which send of which peer it came from).
  A tensor sent on as it was received names its origin (``agf``), so that its gradient skips the process
  that only passed it on.
  The framework adapters hand those tensors over through a :class:`~nbremote.frameworks.GradTrack`.
* Gradients computed for this process's own leaves accumulate in ``Context.grads``, never in ``.grad``,
  so contexts of concurrent trainers do not mix.
* A backward pass is *hops*: its root (the process where ``backward`` was called) runs a local pass and
  sends what reached received leaves to their senders, each of which runs a hop of its own, and so on.
  A hop reports to the root, not to whoever sent it, with the hops it started: the root's :class:`Pass`
  knows when none is left (the gradients do not travel back down a chain of nested calls), and which
  process holds one that is still out, should that process die. The root's one hop, if it starts only
  one, goes on the waiting thread's own socket (a blocking call's way); if that hop starts none, its
  report comes back there (``report_back``) and that thread receives it itself -- in a parameter server's
  step, or a model with one remote part, the whole pass. Otherwise the last report, wherever it lands,
  wakes that thread (``Future.set_pump``).
* ``Context.peers`` is everyone this process exchanged messages with in the context: releasing a
  context tells them, and they tell theirs. The gradients of a released context are kept as each
  leaf's *last* gradient (``Contexts.last_gradient``, which also looks in live contexts), which is what
  a module panel shows.

``RRef.backward(context_id)`` runs ``nbremote.autograd``'s pass, which registers itself here
(:func:`set_rref_backward`) when it is imported: the RPC layer cannot import the layer above it.

Context ids are unique in the world: the creator's rank in the top 16 bits (as in torch), then a
counter that starts at a random value, so a restarted worker with the same rank does not reuse ids. The
value comes from the OS (``secrets``): nbremote draws from none of the user's seeded streams.
"""

from __future__ import annotations

import contextvars
import itertools
import secrets
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbremote.errors import AutogradError, WorkerLostError
from nbremote.frameworks import own_gradient, tensor_key
from nbremote.rpc._core.future import Future

__all__ = ["Context", "Contexts", "Gradients", "Pass", "Recv", "Send", "current", "report_back", "rref_backward",
           "set_rref_backward"]

#: the distributed autograd context the running thread or task is in, if any
current: contextvars.ContextVar[int | None] = contextvars.ContextVar("nbremote_autograd_context", default=None)
#: while a hop the root sent on its waiting thread's own socket runs: (the root, how to answer on that socket)
report_back: contextvars.ContextVar[tuple[str, Callable[[Any, list[Any]], None]] | None] = contextvars.ContextVar(
    "nbremote_report_back", default=None)

_RANK_SHIFT = 48
_RELEASED_KEPT = 4096  # ids of released contexts remembered, so late messages do not bring them back
_LAST_KEPT = 100_000  # leaves whose last gradient is remembered (parameters, mostly)


_rref_backward: list[Callable[[Any, int, bool], None]] = []  # zero or one: nbremote.autograd's


def set_rref_backward(run: Callable[[Any, int, bool], None]) -> None:
    """``run(rref, context_id, retain_graph)`` is what ``RRef.backward(context_id)`` runs on the owner."""
    _rref_backward[:] = [run]


def rref_backward() -> Callable[[Any, int, bool], None]:
    if not _rref_backward:
        raise AutogradError("RRef.backward(context_id) runs a distributed backward pass: import nbremote.autograd "
                            "(torch.distributed.autograd's counterpart) in this process first")
    return _rref_backward[0]


@dataclass(eq=False)
class Send:
    """Tensors this process sent in one message; gradients for them come back from ``dest``."""

    dest: str
    tensors: list[Any]
    consumed_by: int | None = None  # the backward pass that used (and, without retain_graph, spent) it


@dataclass(eq=False)
class Recv:
    """A tensor that arrived as a leaf: its gradient goes to ``sender``'s send ``send_id``, slot ``index``."""

    tensor: Any
    sender: str
    send_id: int
    index: int


class Pass:
    """A backward pass as its root sees it: the hops still out (by id, with the process each runs on) and
    its outcome, ``done``. Reports may overtake the report of the hop that started them (they come from
    other processes): a hop reported before it was announced waits in ``early`` to cancel out."""

    def __init__(self, pass_id: int) -> None:
        self.id = pass_id
        self.done: Future[None] = Future()
        self._lock = threading.Lock()
        self._out: dict[str, str] = {}  # hop id -> the process it runs on
        self._early: set[str] = set()
        self._started = False  # the root's own hops are known (see started)

    def started(self, hops: Sequence[tuple[str, str]]) -> None:
        """The root's local pass is over and started ``hops`` ([(hop id, process)])."""
        with self._lock:
            self._started = True
            self._add(hops)
            self._settle()

    def report(self, hop: str, hops: Sequence[tuple[str, str]], error: BaseException | None) -> None:
        """Hop ``hop`` is over (with ``error``, or having started ``hops``)."""
        with self._lock:
            self._add(hops)
            if self._out.pop(hop, None) is None:
                self._early.add(hop)
            if error is not None:
                self.done._fail(error)
            self._settle()

    def lost(self, process: str, why: str) -> None:
        """``process`` died: the pass fails if a hop of it was out there."""
        with self._lock:
            if process in self._out.values():
                self.done._fail(WorkerLostError(
                    f"worker {process!r} was lost during dist_autograd.backward ({why}): the gradients it was to "
                    "compute are gone; restart it (rpc.restart_worker) and run the step again", process))

    def out(self) -> list[str]:
        """The processes holding hops still out (for a message when the pass takes too long)."""
        with self._lock:
            return sorted(set(self._out.values()))

    def _add(self, hops: Sequence[tuple[str, str]]) -> None:
        for hop, process in hops:
            if hop in self._early:
                self._early.discard(hop)
            else:
                self._out[hop] = process

    def _settle(self) -> None:
        if self._started and not self._out and not self._early:
            self.done._complete(None, None)


@dataclass(eq=False)
class Context:
    """One distributed autograd context, as this process knows it."""

    id: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    sends: dict[int, Send] = field(default_factory=dict)
    recvs: dict[int, Recv] = field(default_factory=dict)  # tensor_key(tensor) -> Recv
    grads: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # tensor_key(leaf) -> (leaf, gradient)
    peers: set[str] = field(default_factory=set)
    passes: dict[int, Pass] = field(default_factory=dict)  # backward passes this process is the root of
    stepped: set[int] = field(default_factory=set)  # passes that stepped optimizers here as they went

    def touch(self, peer: str) -> None:
        with self.lock:
            self.peers.add(peer)

    def record_recv(self, sender: str, send_id: int, tensors: Mapping[int, Any],
                    forwarded: Sequence[Sequence[Any]] = ()) -> None:
        """Tensors that arrived as leaves: slot ``index`` of ``sender``'s send ``send_id`` -- or, for the slots
        in ``forwarded`` (``[index, origin, origin's send, its slot]``, see :meth:`forwarded`), of the send
        the sender had received the very tensor from: its gradient goes there directly."""
        origins = {int(f[0]): (str(f[1]), int(f[2]), int(f[3])) for f in forwarded if len(f) == 4}
        with self.lock:
            self.peers.add(sender)
            for index, tensor in tensors.items():
                origin = origins.get(index)
                if origin is None:
                    self.recvs[tensor_key(tensor)] = Recv(tensor, sender, send_id, index)
                else:
                    self.peers.add(origin[0])
                    self.recvs[tensor_key(tensor)] = Recv(tensor, *origin)

    def forwarded(self, tensors: Sequence[Any]) -> list[list[Any]]:
        """The slots of a send that hold tensors received here as they are (passed through, not computed on):
        ``[index, origin, origin's send, its slot]``. Their receiver sends their gradients to the origin
        directly: a backward pass need not come back through a process that only passed a tensor on (the
        driver between two stages, in a split model)."""
        out = []
        with self.lock:
            for index, tensor in enumerate(tensors):
                recv = self.recvs.get(tensor_key(tensor))
                if recv is not None:
                    out.append([index, recv.sender, recv.send_id, recv.index])
        return out

    def recv_of(self, tensor: Any) -> Recv | None:
        with self.lock:
            return self.recvs.get(tensor_key(tensor))

    def send(self, send_id: int) -> Send | None:
        with self.lock:
            return self.sends.get(send_id)

    def accumulate(self, leaf: Any, grad: Any, shared: bool = False) -> None:
        """Add ``grad`` to ``leaf``'s gradient; the first one is kept as torch's AccumulateGrad keeps it
        (``frameworks.own_gradient``: a copy if ``shared`` -- another leaf got the same tensor -- or strided
        unlike the leaf), so that two leaves never hold one buffer."""
        key = tensor_key(leaf)
        with self.lock:
            known = self.grads.get(key)
            self.grads[key] = (leaf, own_gradient(leaf, grad, shared) if known is None else known[1] + grad)

    def gradients(self) -> Gradients:
        """This process's gradients in the context: leaf tensor -> gradient."""
        with self.lock:
            return Gradients(self.grads)

    def gradient_of(self, leaf: Any) -> Any:
        with self.lock:
            known = self.grads.get(tensor_key(leaf))
        return None if known is None else known[1]


class Gradients(Mapping[Any, Any]):
    """``{tensor: gradient}``, looked up by tensor identity (``tensor_key``), not by ``==`` or ``hash``.

    A plain dict would do for torch, whose tensors hash by identity; a tensorplay parameter and the
    wrapper its autograd graph hands out are different objects for one tensor, and either must find it.
    """

    def __init__(self, entries: Mapping[int, tuple[Any, Any]]) -> None:
        self._entries = dict(entries)

    def __getitem__(self, tensor: Any) -> Any:
        return self._entries[tensor_key(tensor)][1]

    def __contains__(self, tensor: object) -> bool:
        return tensor_key(tensor) in self._entries

    def __iter__(self) -> Iterator[Any]:
        return (leaf for leaf, _ in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Gradients({len(self)} tensors)"


class Contexts:
    """The contexts this process takes part in (thread-safe); one per agent."""

    def __init__(self, rank: int) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[int, Context] = {}
        self._released: deque[int] = deque(maxlen=_RELEASED_KEPT)
        self._released_set: set[int] = set()
        self._last: OrderedDict[int, tuple[Callable[[], Any] | None, Any]] = OrderedDict()  # key -> (leaf ref, grad)
        self._rank = rank
        self._ids = itertools.count(secrets.randbits(40))  # not ``random``'s: that stream is the user's
        self._send_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._contexts)

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._contexts))

    def new(self) -> Context:
        """A new context created here, with a world-unique id."""
        ctx_id = (self._rank << _RANK_SHIFT) | (next(self._ids) & ((1 << _RANK_SHIFT) - 1))
        ctx = Context(ctx_id)
        with self._lock:
            self._contexts[ctx_id] = ctx
        return ctx

    def get(self, ctx_id: int) -> Context | None:
        with self._lock:
            return self._contexts.get(ctx_id)

    def released(self, ctx_id: int) -> bool:
        """Whether the context was released here (one of the last ``_RELEASED_KEPT``): its gradients are gone."""
        with self._lock:
            return ctx_id in self._released_set

    def join(self, ctx_id: int, peer: str) -> Context | None:
        """The context a message from ``peer`` was made in, created here on first contact.

        ``None`` once it was released here: a late message must not bring a released context back.
        """
        with self._lock:
            ctx = self._contexts.get(ctx_id)
            if ctx is None:
                if ctx_id in self._released_set:
                    return None
                ctx = self._contexts[ctx_id] = Context(ctx_id)
        ctx.touch(peer)
        return ctx

    def record_send(self, ctx: Context, dest: str, tensors: Sequence[Any]) -> int:
        send_id = next(self._send_ids)
        with ctx.lock:
            ctx.peers.add(dest)
            ctx.sends[send_id] = Send(dest, list(tensors))
        return send_id

    def release(self, ctx_id: int) -> Context | None:
        """Forget a context (its tensors go with it, its gradients become the leaves' last ones)."""
        with self._lock:
            ctx = self._contexts.pop(ctx_id, None)
            if ctx_id not in self._released_set:
                if len(self._released) == self._released.maxlen:
                    self._released_set.discard(self._released[0])
                self._released.append(ctx_id)
                self._released_set.add(ctx_id)
            if ctx is not None:
                for key, (leaf, grad) in ctx.grads.items():
                    self._last[key] = (_ref(leaf) if key == id(leaf) else None, grad)  # (see last_gradient)
                    self._last.move_to_end(key)
                while len(self._last) > _LAST_KEPT:
                    self._last.popitem(last=False)
        return ctx

    def last_gradient(self, leaf: Any) -> Any:
        """The gradient ``leaf`` got in the newest context that gave it one (None if none): a live one
        here first, else the last released one.

        Live contexts count because a context's release reaches its peers asynchronously: right after a
        step the caller's context is gone while ours may still be here, holding that step's gradients.
        Keyed by tensor identity, checked through a weak reference where the key is the object's ``id``
        (torch): a new tensor at a freed leaf's address (a module built again) has no last gradient, not the
        old leaf's. tensorplay's wrappers come and go (``tensor_key``): there the key alone decides.
        """
        key = tensor_key(leaf)
        with self._lock:
            live = list(self._contexts.values())
            last = self._last.get(key)
        for ctx in reversed(live):  # newest first (a live context holds its leaves: their keys are theirs)
            with ctx.lock:
                known = ctx.grads.get(key)
            if known is not None:
                return known[1]
        if last is None or (last[0] is not None and last[0]() is not leaf):
            return None
        return last[1]

    def peer_lost(self, peer: str, why: str) -> None:
        """``peer`` died: every backward pass rooted here that waits for a hop of it fails now."""
        with self._lock:
            contexts = list(self._contexts.values())
        for ctx in contexts:
            with ctx.lock:
                passes = list(ctx.passes.values())
            for run in passes:
                run.lost(peer, why)

    def release_touched_by(self, peer: str) -> int:
        """Release every context ``peer`` took part in (it is gone, so none can finish); returns how many."""
        with self._lock:
            contexts = list(self._contexts.values())
        ids = [ctx.id for ctx in contexts if peer in ctx.peers]
        for ctx_id in ids:
            self.release(ctx_id)
        return len(ids)

    def clear(self) -> None:
        with self._lock:
            self._contexts.clear()
            self._last.clear()


def _ref(leaf: Any) -> Callable[[], Any] | None:
    """A weak reference to ``leaf``; None for a tensor type that has none (then its key goes unchecked)."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return None
