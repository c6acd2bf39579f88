"""The kernel websocket's two message formats, as pure functions: no I/O, tested against jupyter_server's own.

* ``v1.kernel.websocket.jupyter.org`` (jupyter_server >= 2): one binary message per Jupyter message: a
  count and offsets as little-endian uint64, the channel name, then header, parent header, metadata,
  content and buffers as they are on the kernel's zmq socket (the server passes them through).
* the legacy format (jupyter_server 1.x, and servers configured for it): the message as JSON text with a
  ``channel`` key, or, with buffers, a count and offsets as big-endian uint32, that JSON, then the buffers.

Decoding gives both the v1 shape, ``(channel, [header, parent_header, metadata, content, *buffers])``:
views of the received bytes for v1 (no copy), re-encoded JSON for legacy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from jupyter_client.jsonutil import json_default

__all__ = ["OP_BINARY", "OP_CLOSE", "OP_CONT", "OP_PING", "OP_PONG", "OP_TEXT", "SUBPROTOCOL", "decode",
           "decode_legacy", "decode_v1", "encode_legacy", "encode_v1"]

SUBPROTOCOL = "v1.kernel.websocket.jupyter.org"
# RFC 6455 opcodes: which frames are text, binary or control (the formats below choose text or binary)
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


def encode_v1(channel: str, parts: Sequence[Any]) -> list[Any]:
    """The parts of one v1 websocket message: the offsets table, the channel, then ``parts`` unchanged."""
    chan = channel.encode()
    count = len(parts) + 2
    offsets = [8 * (1 + count)]
    offsets.append(offsets[-1] + len(chan))
    for part in parts:
        offsets.append(offsets[-1] + memoryview(part).nbytes)
    table = count.to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
    return [table, chan, *parts]


def decode_v1(data: bytearray | bytes | memoryview) -> tuple[str, list[memoryview]]:
    """``(channel, parts)`` of a v1 websocket message; the parts are views of ``data`` (no copy)."""
    view = memoryview(data)
    if len(view) < 8:
        raise ValueError("a v1 websocket message shorter than its offsets table")
    count = int.from_bytes(view[:8], "little")
    if count < 2 or 8 * (1 + count) > len(view):
        raise ValueError(f"a v1 websocket message with a bad offsets table ({count} offsets)")
    offsets = [int.from_bytes(view[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
    if offsets != sorted(offsets) or offsets[-1] > len(view):
        raise ValueError("a v1 websocket message whose offsets run past its end")
    channel = bytes(view[offsets[0] : offsets[1]]).decode()
    return channel, [view[offsets[i] : offsets[i + 1]] for i in range(1, count - 1)]


def encode_legacy(channel: str, msg: dict[str, Any], buffers: Sequence[Any] = ()) -> tuple[list[Any], int]:
    """``(parts, opcode)`` of one legacy websocket message: JSON text, or binary with buffers (jupyter_server's
    ``serialize_binary_message``: a count and offsets as big-endian uint32, the JSON, the buffers)."""
    body = json.dumps({**msg, "channel": channel}, default=json_default).encode()
    if not buffers:
        return [body], OP_TEXT
    sizes = [len(body), *(memoryview(b).nbytes for b in buffers)]
    offsets = [4 * (len(sizes) + 1)]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    return [struct.pack(f"!{len(sizes) + 1}I", len(sizes), *offsets), body, *buffers], OP_BINARY


def decode_legacy(opcode: int, data: bytearray | bytes | memoryview) -> tuple[str, list[memoryview]]:
    """``(channel, parts)`` of a legacy websocket message, in the v1 shape (header, parent header, metadata,
    content as JSON, then the buffers as views of ``data``)."""
    view = memoryview(data)
    buffers: list[memoryview] = []
    if opcode == OP_TEXT:
        msg = json.loads(bytes(view))
    else:
        count = int.from_bytes(view[:4], "big")
        if count < 1 or 4 * (count + 1) > len(view):
            raise ValueError(f"a legacy websocket message with a bad offsets table ({count} parts)")
        offsets = [int.from_bytes(view[4 * (i + 1) : 4 * (i + 2)], "big") for i in range(count)] + [len(view)]
        msg = json.loads(bytes(view[offsets[0] : offsets[1]]))
        buffers = [view[offsets[i] : offsets[i + 1]] for i in range(1, count)]
    if not isinstance(msg, dict):
        raise ValueError("a legacy websocket message that is not a JSON object")
    parts = [memoryview(json.dumps(msg.get(key) or {}, default=json_default).encode())
             for key in ("header", "parent_header", "metadata", "content")]
    return str(msg.get("channel") or "shell"), parts + buffers


def decode(opcode: int, data: bytearray | bytes | memoryview, v1: bool) -> tuple[str, list[memoryview]] | None:
    """A received websocket message as ``(channel, parts)``, in either protocol; None: not a message."""
    if v1:
        return decode_v1(data) if opcode == OP_BINARY else None
    return decode_legacy(opcode, data) if opcode in (OP_BINARY, OP_TEXT) else None
