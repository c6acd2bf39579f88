"""Per-call capture of what remote code prints, so it can be replayed in the calling cell.

Calls run on executor threads; ``sys.stdout``/``sys.stderr`` are wrapped once by a proxy that sends a
write to the capture of the call running on the current thread (a context variable), and to the
original stream otherwise. Text is sent line-buffered as ``out`` envelopes ahead of the call's reply,
on the same ordered channel, so it appears before the result, in order.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from nbremote.rpc._wire.envelope import Envelope

Reply = Callable[[Envelope, list[Any]], None]

current: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("nbremote_capture", default=None)
FLUSH_BYTES = 8192


class Capture:
    """What one call printed, not yet sent."""

    def __init__(self, reply: Reply, call_id: int) -> None:
        self._reply = reply
        self._id = call_id
        self._lock = threading.Lock()
        self._parts: list[tuple[str, str]] = []
        self._size = 0

    def write(self, stream: str, text: str) -> None:
        with self._lock:
            if self._parts and self._parts[-1][0] == stream:
                self._parts[-1] = (stream, self._parts[-1][1] + text)
            else:
                self._parts.append((stream, text))
            self._size += len(text)
            ready = "\n" in text or self._size >= FLUSH_BYTES
        if ready:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            parts, self._parts, self._size = self._parts, [], 0
            for stream, text in parts:
                self._reply({"k": "out", "id": self._id, "stream": stream, "text": text}, [])


class _Proxy:
    """Stands in for sys.stdout / sys.stderr; everything but ``write`` goes to the wrapped stream."""

    def __init__(self, wrapped: TextIO, name: str) -> None:
        self._nbremote_wrapped = wrapped
        self._nbremote_name = name
        self._nbremote_dirty = True

    def write(self, text: str) -> int:
        cap = current.get()
        if cap is None:
            self._nbremote_dirty = True
            return self._nbremote_wrapped.write(text)
        cap.write(self._nbremote_name, text)
        return len(text)

    def flush(self) -> None:
        # ipykernel flushes both streams after every shell message, and an OutStream flush from a
        # non-IO thread waits for two round trips to the IOPub thread: skip it when nothing was written.
        if current.get() is None and self._nbremote_dirty:
            self._nbremote_dirty = False
            self._nbremote_wrapped.flush()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._nbremote_wrapped, attr)


def install() -> None:
    """Wrap sys.stdout / sys.stderr (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _Proxy):
            setattr(sys, name, _Proxy(stream, name))


def uninstall() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Proxy):
            setattr(sys, name, stream._nbremote_wrapped)


def emit(label: str, stream: str, text: str, at_line_start: bool) -> bool:
    """Write a worker's output on this process's stream, each line labelled; returns the new line state."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    pieces = []
    for line in text.splitlines(keepends=True):
        if at_line_start:
            pieces.append(f"[{label}] ")
        pieces.append(line)
        at_line_start = line.endswith("\n")
    out.write("".join(pieces))
    return at_line_start
