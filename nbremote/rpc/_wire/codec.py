"""A lean codec for nbremote's own Jupyter message type, ``nbremote_request``: pure, no I/O.

The hot path sends a batch of envelopes (``_wire.pack``) as a valid, signed Jupyter message on the
kernel's shell channel. ``jupyter_client.Session`` does per-message work that never changes for us:
a header dict built field by field (uuid, ``datetime`` with time zone), JSON of four dicts, a fresh HMAC,
and on receipt ``dateutil`` parsing of every date. Here the header is a byte template where only the
counter and the date change, the parent header and metadata are constant ``{}``, the HMAC object is
keyed once and copied per message, and receiving parses only the content -- no date is parsed at all.

Wire format (Jupyter's): ``[*idents, b"<IDS|MSG>", signature, header, parent_header, metadata, content,
*buffers]``, the signature an HMAC-SHA256 (hex) of header, parent, metadata and content with the kernel's
key. Jupyter does not sign buffers; non-loopback links carry digests of them in the signed content
(``_wire``). Messages this codec encodes are accepted by ``Session.deserialize`` and vice versa (tested).

Replays: as ``Session`` does, a receiver remembers the signatures it has accepted (a bounded window)
and refuses a message whose signature it has seen: a captured message cannot be sent again.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from nbremote.errors import ProtocolError
from nbremote.rpc._wire.batching import Item
from nbremote.rpc._wire.bufpool import MIN_POOLED, POOL
from nbremote.rpc._wire.envelope import Buffer, Envelope, FrameMac, pack, unpack

__all__ = ["DELIM", "MSG_TYPE", "Codec", "Decoded", "ReplayedMessage", "split_idents"]

DELIM = b"<IDS|MSG>"
MSG_TYPE = "nbremote_request"
PROTOCOL_VERSION = "5.3"
_EMPTY = b"{}"
_FRAME = zmq.Frame  # what a socket receives without copying
_REPLAY_WINDOW = 1 << 16  # signatures remembered per receiver (Session's default digest_history_size)
# Made once: ``json.dumps``/``loads`` with arguments build an encoder or decoder on every call.
_dumps = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
_loads = json.JSONDecoder().decode


def _fast_json() -> tuple[Any, Any]:
    """JSON's C encoder and scanner, called directly: ``JSONEncoder.encode`` and ``JSONDecoder.decode`` are
    two Python frames each around them (and the encoder is made anew per call). None where this Python's
    ``json`` has no C speedups; then ``_dumps`` / ``_loads``."""
    from json import decoder, encoder, scanner

    make_encoder, make_scanner = getattr(encoder, "c_make_encoder", None), getattr(scanner, "c_make_scanner", None)
    if make_encoder is None or make_scanner is None:
        return None, None

    def refuse(obj: object) -> None:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    # The arguments JSONEncoder.iterencode passes for separators (",", ":"), ensure_ascii, allow_nan and no
    # circular check; a Python whose C encoder takes others, or writes another text, keeps to _dumps.
    sample = {"k": "call", "id": 7, "to": 0.5, "fn": "f\u00e9\n", "nf": [1, None, True]}
    try:
        encode = make_encoder(None, refuse, encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
        if "".join(encode(sample, 0)) != _dumps(sample):
            return None, None
    except TypeError:
        return None, None
    return encode, make_scanner(decoder.JSONDecoder())


_encode_c, _scan_c = _fast_json()


def _json_text(content: dict[str, Any]) -> bytes:
    if _encode_c is None:
        return _dumps(content).encode()
    return "".join(_encode_c(content, 0)).encode()


def _json_value(text: str) -> Any:
    """The JSON value of ``text``; anything but one compact value (whitespace around it, trailing data, an
    error) takes ``JSONDecoder.decode``, which also words the error."""
    if _scan_c is not None:
        try:
            value, end = _scan_c(text, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(text):
                return value
    return _loads(text)


Decoded = tuple[list[bytes], dict[str, Any], list[Any]]  # idents, content, buffers


def _keyed_hmac(key: bytes) -> Any:
    """An HMAC-SHA256 object keyed once, to be copied per message: OpenSSL's own object where this Python
    has it (``hmac.HMAC`` wraps it in Python-level ``copy`` and ``update`` calls), else ``hmac``'s."""
    try:
        import _hashlib

        return _hashlib.hmac_new(key, digestmod="sha256")
    except (ImportError, AttributeError, ValueError):
        return hmac.new(key, digestmod=hashlib.sha256)


def _bytes(frame: Any) -> bytes:
    """The bytes of a small frame: ``bytes`` as is, a ``zmq.Frame``'s (one copy, made in C)."""
    if type(frame) is bytes:
        return frame
    data = getattr(frame, "bytes", None)
    return data if isinstance(data, bytes) else bytes(frame)


def _all_bytes(frames: Sequence[Any]) -> list[bytes]:
    """``_bytes`` of each frame: received frames (``zmq.Frame``) read inline, without a call per frame."""
    return [f.bytes if type(f) is _FRAME else _bytes(f) for f in frames]


def split_idents(frames: Sequence[Any]) -> tuple[list[bytes], int]:
    """``(idents, index of the delimiter)`` of a received multipart message."""
    heads = _all_bytes(frames[:2])  # a DEALER gets the delimiter first, a ROUTER after one identity
    if heads and heads[0] == DELIM:
        return [], 0
    if len(heads) == 2 and heads[1] == DELIM:
        return heads[:1], 1
    for i, frame in enumerate(frames[2:], start=2):
        if _bytes(frame) == DELIM:
            return [_bytes(f) for f in frames[:i]], i
    raise ProtocolError("not a Jupyter message: no <IDS|MSG> delimiter")


class ReplayedMessage(ProtocolError):
    """A message whose signature was seen already: a replay, or a message sent again by another way after the
    connection it first went by closed before its receipt was known (``unixlink``) -- dropped either way."""


class Codec:
    """Builds and checks ``nbremote_request`` messages for one key (one kernel's connection)."""

    def __init__(self, key: bytes, *, signature_scheme: str = "hmac-sha256", username: str = "nbremote",
                 session: str | None = None) -> None:
        if key and signature_scheme != "hmac-sha256":
            raise ProtocolError(f"unsupported signature scheme {signature_scheme!r} (nbremote speaks hmac-sha256)")
        self._auth = _keyed_hmac(key) if key else None
        self.mac = FrameMac(key)  # the frames' digests on links that carry them (``envelope.FrameMac``)
        self.session = session or os.urandom(16).hex()
        self._counter = itertools.count()
        prefix = json.dumps({"msg_type": MSG_TYPE, "username": username, "session": self.session,
                             "version": PROTOCOL_VERSION}, separators=(",", ":"))
        self._head = (prefix[:-1] + ',"msg_id":"' + self.session + "_").encode()
        self._date_second = -1
        self._date_prefix = b""
        self._seen: set[bytes] = set()
        self._seen_order: deque[bytes] = deque()

    # -- sending -------------------------------------------------------------------------------------
    def _date(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self._date_second:  # strftime once a second; the microseconds are formatted each time
            self._date_second = second
            self._date_prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)).encode()
        return self._date_prefix + b".%06dZ" % int((now - second) * 1_000_000)

    def sign(self, parts: Sequence[bytes]) -> bytes:
        if self._auth is None:
            return b""
        h = self._auth.copy()
        h.update(b"".join(parts))  # one update of the joined parts: the same digest, fewer calls
        return h.hexdigest().encode()

    def encode(self, content: dict[str, Any], buffers: Sequence[Buffer] = ()) -> list[Any]:
        """The frames of one message (no routing identity: DEALERs need none, ROUTERs prepend one)."""
        header = b'%s%d","date":"%s"}' % (self._head, next(self._counter), self._date())
        body = _json_text(content)
        return [DELIM, self.sign((header, _EMPTY, _EMPTY, body)), header, _EMPTY, _EMPTY, body, *buffers]

    def encode_items(self, items: Sequence[Item], *, digests: bool = False, pieces: bool = False) -> list[Any]:
        """``encode`` of a batch of envelopes (``_wire.pack``): the hot path's one call per message.

        ``pieces``: the receiver reads zmq frames and puts pieces together again (``unpack_items``), so
        frames over ``PIECE`` bytes travel as several (see :func:`in_pieces`).
        """
        data, buffers = pack(items, mac=self.frame_mac(digests))
        if pieces:
            buffers = in_pieces(data, buffers)  # type: ignore[arg-type]
        return self.encode(data, buffers)  # type: ignore[arg-type]

    def unpack_items(self, content: dict[str, Any], buffers: Sequence[Any], *, digests: bool,
                     ) -> list[tuple[Envelope, list[Buffer]]]:
        """The envelopes of a ``decode``d message and their frames (``buffers``: its zmq frames, or views a
        Unix-domain link read), frames sent in pieces put together again; ``digests``: the link requires them
        (``envelope.unpack``)."""
        views = [f.buffer if type(f) is _FRAME else getattr(f, "buffer", f) for f in buffers]
        return unpack(content, joined(content, views), mac=self.frame_mac(digests))

    def frame_mac(self, digests: bool) -> FrameMac | None:
        """What ``envelope.pack`` / ``unpack`` take as ``mac`` on a link that does (or does not) digest frames."""
        return self.mac if digests else None

    # -- receiving -------------------------------------------------------------------------------------
    def decode(self, frames: Sequence[Any], *, at: int | None = None) -> Decoded:
        """Verify and unpack a received message: ``(idents, content, buffers)``.

        ``at``: the index of the delimiter, where the caller found it already (see :func:`split_idents`;
        the shell path also checked the message type there, with :func:`is_ours`).
        Raises :class:`ProtocolError` for anything malformed, unsigned, wrongly signed or replayed --
        before the content is parsed, so nothing a forger sends is ever run.
        """
        i = split_idents(frames)[1] if at is None else at
        if len(frames) < i + 6:
            raise ProtocolError("malformed Jupyter message: fewer than 5 frames after the delimiter")
        *idents, _, signature, header, parent, metadata, body = _all_bytes(frames[: i + 6])  # in one go
        if self._auth is not None:
            if not hmac.compare_digest(signature, self.sign((header, parent, metadata, body))):
                raise ProtocolError("invalid message signature: not signed with this kernel's key")
            if signature in self._seen:
                raise ReplayedMessage("duplicate message signature: a replayed message was refused")
            self._remember(signature)
        try:
            content = _json_value(body.decode())
        except ValueError as exc:  # also UnicodeDecodeError
            raise ProtocolError(f"nbremote_request content is not JSON: {exc}") from None
        if not isinstance(content, dict):
            raise ProtocolError("nbremote_request content is not a JSON object")
        return idents, content, list(frames[i + 6 :])

    def _remember(self, signature: bytes) -> None:
        self._seen.add(signature)
        self._seen_order.append(signature)
        if len(self._seen_order) > _REPLAY_WINDOW:
            self._seen.discard(self._seen_order.popleft())


_TYPE_KEYS = (b'"msg_type":"' + MSG_TYPE.encode() + b'"', b'"msg_type": "' + MSG_TYPE.encode() + b'"')


def is_ours(header: bytes, *, exact: bool = False) -> bool:
    """Whether a shell message's header frame is an ``nbremote_request``'s.

    Without ``exact``: a cheap first look (the type's name appears somewhere). With it: the header's
    ``msg_type`` is ours -- read from the bytes where the header is laid out as JSON encoders write it
    (compact, or with ``json.dumps``' default separators: inside a JSON string a quote is escaped, so
    these bytes can only be the key and its value), else by parsing it.
    """
    if MSG_TYPE.encode() not in header:
        return False
    if not exact or _TYPE_KEYS[0] in header or _TYPE_KEYS[1] in header:
        return True
    try:
        parsed = json.loads(header)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("msg_type") == MSG_TYPE


# -- big frames in pieces ----------------------------------------------------------------------------------
# libzmq is slow with big frames: a 64 MB echo between two processes took 147-160 ms as one frame and 40 ms
# as 1 MiB frames over TCP, 370-385 ms and 100 ms with CurveZMQ (whose IO threads then encrypt one piece
# while the other end decrypts the one before, where one frame was encrypted whole, sent, decrypted
# whole). Pieces are slices of the frame (no copy); the receiver copies them into one buffer of the
# message-memory pool (``bufpool``: reused, so no page faults on fresh memory), ~7 ms per 64 MB.

PIECE = 1 << 20


def in_pieces(data: dict[str, Any], buffers: list[Buffer]) -> list[Buffer]:
    """``buffers`` with each one over ``PIECE`` bytes cut into slices of at most ``PIECE``; ``data["sp"]``
    (inside the signed content) lists ``[index, pieces]`` for each buffer cut, in order."""
    if all(memoryview(b).nbytes <= PIECE for b in buffers):
        return buffers
    out: list[Buffer] = []
    cut: list[list[int]] = []
    for i, b in enumerate(buffers):
        view = memoryview(b)
        if view.nbytes <= PIECE:
            out.append(b)
            continue
        view = view.cast("B")
        n = -(-view.nbytes // PIECE)
        cut.append([i, n])
        out.extend(view[k * PIECE : (k + 1) * PIECE] for k in range(n))
    data["sp"] = cut
    return out


def joined(content: dict[str, Any], buffers: list[Buffer]) -> list[Buffer]:
    """The buffers of a received message with the pieces that ``in_pieces`` cut put together again."""
    cut = content.get("sp")
    if cut is None:
        return buffers
    if not isinstance(cut, list):
        raise ProtocolError("malformed piece table: not a list")
    out: list[Buffer] = []
    pos = 0
    for entry in cut:
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry)):
            raise ProtocolError(f"malformed piece table entry {entry!r:.100}")
        index, n = entry
        before = index - len(out)  # whole buffers between the last cut one and this one
        if before < 0 or n < 2 or pos + before + n > len(buffers):
            raise ProtocolError(f"piece table entry {entry!r} does not fit the message's {len(buffers)} buffers")
        out.extend(buffers[pos : pos + before])
        pos += before
        out.append(_put_together(buffers[pos : pos + n]))
        pos += n
    out.extend(buffers[pos:])
    return out


def _put_together(pieces: Sequence[Buffer]) -> memoryview:
    views = [memoryview(p).cast("B") for p in pieces]
    total = sum(v.nbytes for v in views)
    whole = POOL.take(total) if total >= MIN_POOLED else memoryview(bytearray(total))
    at = 0
    for v in views:
        whole[at : at + v.nbytes] = v
        at += v.nbytes
    return whole

