"""Envelopes on their way: batches of bounded size, the outbox that coalesces them, messages in pieces.

Many small envelopes queued for one channel leave as few messages as the batch limits allow
(:class:`Outbox`, flat combining): the kernel and the receiver pay per message, not per envelope. A
message whose buffers are too big for its channel (a Jupyter server's websocket refuses messages above
``websocket_max_message_size``) travels as ``part`` envelopes (:func:`split_parts`), put together again
by :class:`Parts` into memory reused from ``bufpool.POOL`` (fresh memory faults on every page: 88-104
ms per 64 MB, against 6.7 ms into memory used before). Nothing here does I/O but the ``send`` an outbox is given.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nbremote.errors import ProtocolError
from nbremote.rpc._wire.bufpool import POOL
from nbremote.rpc._wire.envelope import Buffer, Envelope, pack

MAX_BATCH_BYTES = 1 << 20  # coalesce envelopes up to this much buffer data per comm message
MAX_BATCH_ITEMS = 256

Item = tuple[Envelope, Sequence[Buffer]]


def batches(
    items: Sequence[Item], max_bytes: int = MAX_BATCH_BYTES, max_items: int = MAX_BATCH_ITEMS
) -> Iterator[list[Item]]:
    """Split queued envelopes, in order, into batches of bounded size (a big envelope goes alone)."""
    if len(items) == 1:  # one envelope is one batch, however big: no need to measure it (one reply, mostly)
        yield list(items)
        return
    batch: list[Item] = []
    size = 0
    for env, frames in items:
        n = sum(memoryview(f).nbytes for f in frames)
        if batch and (size + n > max_bytes or len(batch) >= max_items):
            yield batch
            batch, size = [], 0
        batch.append((env, frames))
        size += n
    if batch:
        yield batch


class Outbox:
    """Envelopes waiting to go out on one channel, in order.

    Anyone may ``post``; whoever ``drain``s takes the lock and sends *everything* queued so far, in as
    few comm messages as the batch limits allow (flat combining). So a lone blocking call leaves at once
    from its own thread, while many concurrent calls or replies coalesce into a few messages: the kernel
    and the receiver pay per message, not per envelope. Nothing I/O happens here but ``send``.
    """

    def __init__(self, send: Callable[[list[Item]], None]) -> None:
        self._send = send
        self._items: deque[Item] = deque()
        self._lock = threading.Lock()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def post(self, env: Envelope, frames: Sequence[Buffer] = ()) -> None:
        self._items.append((env, frames))

    def drain(self) -> None:
        while self._items:
            with self._lock:
                if self.closed:
                    return
                items = []
                while self._items:
                    items.append(self._items.popleft())
                if len(items) == 1:  # one reply, mostly: one message, without batches' generator
                    self._send(items)
                    continue
                for batch in batches(items):
                    self._send(batch)

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Stop sending (what is queued is dropped); ``then`` runs under the lock, after any send in flight."""
        with self._lock:
            self.closed = True
            self._items.clear()
            if then is not None:
                then()

    def locked(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` between sends (unless closed)."""
        with self._lock:
            if not self.closed:
                fn()


def split_parts(data: dict[str, Any], buffers: Sequence[Buffer], limit: int, pid: str,
                ) -> list[tuple[dict[str, Any], list[Buffer]]]:
    """A packed message whose buffers exceed ``limit`` bytes, as messages of at most ``limit`` bytes of
    buffers each (``part`` envelopes; views of ``buffers``, no copy)."""
    views = [memoryview(b).cast("B") for b in buffers]
    sizes = [v.nbytes for v in views]
    total = sum(sizes)
    pieces: list[list[Buffer]] = [[]]
    room = limit
    for view in views:
        while view.nbytes:
            if room == 0:
                pieces.append([])
                room = limit
            take = min(room, view.nbytes)
            pieces[-1].append(view[:take])
            view, room = view[take:], room - take
    out = []
    for i, frames in enumerate(pieces):
        env: Envelope = {"k": "part", "pid": pid, "total": total}
        if i == len(pieces) - 1:
            env["data"], env["sizes"] = data, sizes
        out.append(pack([(env, frames)]))
    return [(dict(d), b) for d, b in out]


class Parts:
    """Pieces of messages being reassembled, per sender (``part`` envelopes, see ``split_parts``)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], tuple[memoryview, int]] = {}
        self._lock = threading.Lock()

    def add(self, sender: str, env: Envelope, frames: Sequence[Buffer]) -> tuple[dict[str, Any], list[Buffer]] | None:
        """Take one piece; the whole message ``(data, buffers)`` once its last piece is in, else None."""
        key = (sender, str(env.get("pid")))
        total = env.get("total")
        if not isinstance(total, int) or total < 0:
            raise ProtocolError("a 'part' envelope without its message's total size")
        with self._lock:
            buf, filled = self._open.pop(key, (None, 0))
            if buf is None:
                buf = POOL.take(total)  # the message's buffers will be views of it: back once none is left
            for frame in frames:
                piece = memoryview(frame).cast("B")
                n = piece.nbytes
                if filled + n > total:
                    raise ProtocolError("the pieces of a message add up to more than its size")
                buf[filled : filled + n] = piece
                filled += n
            if "data" not in env:
                self._open[key] = (buf, filled)
                return None
        sizes = env.get("sizes")
        if filled != total or not isinstance(sizes, list) or sum(sizes) != total:
            raise ProtocolError("a message's last piece arrived before the rest, or its sizes do not add up")
        view, pos = buf, 0
        out: list[Buffer] = []
        for size in sizes:
            out.append(view[pos : pos + size])
            pos += size
        data = env["data"]
        if not isinstance(data, dict):
            raise ProtocolError("a message's last piece carries no batch")
        return data, out

    def forget(self, sender: str) -> None:
        with self._lock:
            for key in [k for k in self._open if k[0] == sender]:
                del self._open[key]
