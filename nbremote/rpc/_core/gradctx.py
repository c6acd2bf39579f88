"""Distributed autograd bookkeeping in the RPC layer: which context a call belongs to, what crossed.

``nbremote.autograd`` (above this layer) runs the backward pass; this module only records, per
process, what the pass will need, while calls are made and served:

* ``current`` is the autograd context of the running thread (or task). ``with dist_autograd.context()``
  sets it; a call made while it is set carries its id (``ag``), and the process serving the call runs
  it with the same context current, so nested calls (driver -> worker1 -> worker2) stay in it.
* Tensors that require grad and cross in a message of such a call -- arguments or a result -- are a
  *send* on the sending side (``Context.sends``: the very tensors, which keep their local graph alive)
  and arrive as leaves on the other (``Context.recvs``: leaf -> which send of which peer it came from).
  The framework adapters hand those tensors over through a :class:`~nbremote.frameworks.GradTrack`.
* Gradients computed for this process's own leaves accumulate in ``Context.grads``, never in ``.grad``,
  so contexts of concurrent trainers do not mix.
* ``Context.peers`` is everyone this process exchanged messages with in the context: releasing a
  context tells them, and they tell theirs. The gradients of a released context are kept as each
  leaf's *last* gradient (``Contexts.last_gradient``, which also looks in live contexts), which is what
  a module panel shows.

``RRef.backward(context_id)`` runs ``nbremote.autograd``'s pass, which registers itself here
(:func:`set_rref_backward`) when it is imported: the RPC layer cannot import the layer above it.

Context ids are unique in the world: the creator's rank in the top 16 bits (as in torch), then a
counter that starts at a random value, so a restarted worker with the same rank does not reuse ids.
"""

from __future__ import annotations

import contextvars
import itertools
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbremote.errors import AutogradError
from nbremote.frameworks import own_gradient, tensor_key

__all__ = ["Context", "Contexts", "Gradients", "Recv", "Send", "current", "rref_backward", "set_rref_backward"]

#: the distributed autograd context the running thread or task is in, if any
current: contextvars.ContextVar[int | None] = contextvars.ContextVar("nbremote_autograd_context", default=None)

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


@dataclass(eq=False)
class Context:
    """One distributed autograd context, as this process knows it."""

    id: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    sends: dict[int, Send] = field(default_factory=dict)
    recvs: dict[int, Recv] = field(default_factory=dict)  # tensor_key(tensor) -> Recv
    grads: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # tensor_key(leaf) -> (leaf, gradient)
    peers: set[str] = field(default_factory=set)

    def touch(self, peer: str) -> None:
        with self.lock:
            self.peers.add(peer)

    def record_recv(self, sender: str, send_id: int, tensors: Mapping[int, Any]) -> None:
        with self.lock:
            self.peers.add(sender)
            for index, tensor in tensors.items():
                self.recvs[tensor_key(tensor)] = Recv(tensor, sender, send_id, index)

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
        self._last: OrderedDict[int, Any] = OrderedDict()  # tensor_key(leaf) -> (leaf ref, its last gradient)
        self._rank = rank
        self._ids = itertools.count(random.getrandbits(40))
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
                for key, (_, grad) in ctx.grads.items():
                    self._last[key] = grad
                    self._last.move_to_end(key)
                while len(self._last) > _LAST_KEPT:
                    self._last.popitem(last=False)
        return ctx

    def last_gradient(self, leaf: Any) -> Any:
        """The gradient ``leaf`` got in the newest context that gave it one (None if none): a live one
        here first, else the last released one.

        Live contexts count because a context's release reaches its peers asynchronously: right after a
        step the caller's context is gone while ours may still be here, holding that step's gradients.
        Keyed by tensor identity: after a leaf is freed, a new tensor may in rare cases inherit its key
        (and show its last gradient until it gets one of its own) -- fine for a display, which is its use.
        """
        key = tensor_key(leaf)
        with self._lock:
            live = list(self._contexts.values())
            last = self._last.get(key)
        for ctx in reversed(live):  # newest first
            with ctx.lock:
                known = ctx.grads.get(key)
            if known is not None:
                return known[1]
        return last

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
