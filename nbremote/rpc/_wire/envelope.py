"""The envelopes nbremote peers exchange, as plain values: no I/O, testable with dicts.

One Jupyter ``comm_msg`` carries a *batch*: ``data = {"nbr": 2, "msgs": [envelope, ...]}`` and the
message's binary ``buffers`` are the concatenation of each envelope's frames, in order (``nf`` says how
many belong to each envelope). Batching many small calls into one comm message is what lifts
throughput: the kernel spends ~1 ms per comm message, whatever it holds.

Envelope kinds (``k``):

* requests: ``call`` (run a function; frames = pickled ``{"fn", "args", "kwargs"}``; with ``nr`` a
  notification that gets no reply, its failure told to ``fail`` where it names someone), ``cancel``
  (stop call ``id``), ``rref`` (reference-count deltas), ``world`` (who the peers are; from the driver
  only), ``ctx`` (the distributed autograd context ``ctx`` was released: forget it, and tell the others
  it touched), ``hop`` (to the root of backward pass ``run``: hop ``hop`` is over, having started
  ``hops``, or failed with the error in ``type``/``msg``/``tb`` and its frames; on the root's thread's
  own socket when the hop came that way, ``rb``, and started none).
* replies: ``ok`` (frames = pickled result), ``err`` (frames = pickled exception, or none when it could
  not be pickled; ``type``/``msg``/``tb`` always set), ``out`` (captured stdout/stderr text of call ``id``).
* ``ack``: the worker's answer to ``comm_open`` (the comm is open; facts about the worker).
* ``ping`` / ``pong``: the caller checks that the shell path (``_worker.shellpath``) reaches it both ways; a
  ping with ``bulk`` (``{"rx", "digests"}``) from a server-hosted kernel's caller opens its direct data
  channel (``_transport.direct``).
* ``lease``: the caller is still there (see ``_wire.lease``); nothing to answer.
* ``part``: one piece of a message too big for its channel (a Jupyter server's websocket refuses messages
  above ``websocket_max_message_size``): ``pid`` names the message, ``total`` its buffers' size; the
  frames of the pieces, in order, are the message's buffers laid end to end, and the last piece carries
  the message's own ``data`` and its buffers' ``sizes`` (see ``batching.split_parts`` and ``Parts``).
* ``shm``: shared-memory bookkeeping between processes of one machine (``_transport.shm``): ``free`` (segments of
  the receiver we are done with), ``drop`` (segments of ours we unlinked). Any envelope may carry
  ``shm``: descriptors of frames that travel in shared memory instead of the message.

A comm is a two-way channel: the process that opened it (a caller) sends requests on the kernel's
shell channel and gets replies on IOPub, and the kernel may call its caller back the other way round
(requests on IOPub, replies on shell). That is how workers call the driver, which is not a kernel.

Calls made inside a distributed autograd context carry ``ag`` (the context id); a call or reply whose
frames hold tensors that require grad also carries ``ags`` (the id of that *send* in the sender's
context), so the receiver can route gradients back to it (see ``_core.gradctx``).

On links that are not loopback (and not CurveZMQ) each envelope also carries ``dg``, digests of its frames
keyed by the connection's key (:class:`FrameMac`): Jupyter signs the JSON content but not the binary
buffers, and our buffers are pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, cast

from nbremote._netaddr import is_loopback as is_loopback  # the RPC layer's modules take it from the wire floor
from nbremote.errors import ProtocolError

PROTOCOL_VERSION = 2  # 2: keyed frame digests (FrameMac), where 1 had SHA-256
COMM_TARGET = "nbremote"

Kind = Literal["call", "cancel", "rref", "world", "ctx", "hop", "ack", "ok", "err", "out", "ping", "pong", "shm",
               "lease", "part"]
KINDS: frozenset[str] = frozenset({"call", "cancel", "rref", "world", "ctx", "hop", "ack", "ok", "err", "out", "ping",
                                   "pong", "shm", "lease", "part"})
REQUESTS: frozenset[str] = frozenset({"call", "cancel", "rref", "world", "ctx", "hop"})
REPLIES: frozenset[str] = frozenset({"ok", "err", "out"})
Buffer = bytes | memoryview


class Envelope(TypedDict, total=False):
    k: Kind
    id: int  # request id, unique per caller
    nf: int  # number of frames this envelope owns in the message's buffers
    dg: list[str]  # optional SHA-256 digests of those frames
    fn: str  # call: a readable name of the function, for error messages
    caller: str  # call: the caller's name
    to: float  # call: timeout in seconds (0 = none), so the worker can tell
    rref: list[str]  # call that creates an RRef: [rref_id, token]
    stream: str  # out: "stdout" | "stderr"
    text: str  # out: the text
    type: str  # err: qualified type name of the exception
    msg: str  # err: str(exception)
    tb: str  # err: formatted remote traceback
    add: list[list[str]]  # rref: [[rref_id, token], ...] forks to count
    rm: list[list[str]]  # rref: [[rref_id, token], ...] references dropped
    peers: list[dict[str, Any]]  # world: [{"name", "rank", "conn", "inc", "lost"?}...] ("inc": its incarnation)
    info: dict[str, Any]  # ack: facts about the worker (name, pid, host, python, subshell)
    ag: int  # call: the distributed autograd context the call was made in
    ags: int  # call / ok: id of the send (in the sender's autograd context) whose tensors the frames carry
    agf: list[list[Any]]  # call / ok: slots of that send passed on as received: [slot, origin, its send, its slot]
    nr: bool  # call: a notification -- no reply wanted, no pending call on the caller (its id is 0)
    rb: bool  # call (nr): a root's backward hop from a thread's own socket: its last ``hop`` report goes back there
    fail: list[Any]  # call (nr): [process, key, token] told if it cannot be loaded or raises (``_core.oneway``)
    ctx: int  # ctx, hop: a distributed autograd context
    run: int  # hop: the backward pass (see gradctx.Pass)
    hop: str  # hop: the hop that is over
    hops: list[list[str]]  # hop: the hops it started, [[hop id, process], ...]
    link: str  # ping from a thread's own socket: the sending identity (hex) of the link it joins (or its token)
    bulk: dict[str, Any]  # ping opening a direct data channel: {"rx": receiving identity (hex), "digests": bool}
    unix: str  # ping opening a Unix-domain connection (``_transport.unixlink``): "main" (the link's) or "thread"
    shm: list[list[Any]]  # [[frame index, segment, offset, size], ...] frames that travel in shared memory
    free: list[str]  # shm: segments of the receiver the sender is done with
    drop: list[str]  # shm: segments of the sender that were unlinked
    pid: str  # part: the message this is a piece of
    total: int  # part: the size of that message's buffers, together
    data: dict[str, Any]  # part (the last): the message's own batch
    sizes: list[int]  # part (the last): the sizes of the message's buffers


class Batch(TypedDict):
    nbr: int
    msgs: list[Envelope]


class FrameMac:
    """The digests that bind a message's frames to its signed content, for one connection's key.

    With a key: for each frame, a fresh random 96-bit nonce and the AES-256-GCM tag of the frame as
    associated data (GMAC) under a key derived from the connection's, hex: ``nonce + tag`` per GiB of the
    frame. Only holders of the key can make a tag, and a frame altered in transit fails it. GMAC runs at
    ~23 GB/s with AES-NI where SHA-256 gave 2 GB/s: a 64 MB echo beyond loopback spent 130 ms of its
    250 ms hashing (issue 22). A nonce is never reused with one key (random, 2^-32 odds of a repeat after
    2^32 frames). Without a key (an unsigned connection, which protects nothing anyway) plain SHA-256.
    """

    NONCE = 12
    TAG = 16
    CHUNK = 1 << 30  # AES-GCM takes at most 2^31 - 1 bytes of associated data per tag

    def __init__(self, key: bytes, *, chunk: int = CHUNK) -> None:
        self._key = hmac.new(key, b"nbremote frame digests", hashlib.sha256).digest() if key else b""
        self._chunk = chunk
        self._gcm: Any = None  # made at first use: links without digests never import the cipher

    def _cipher(self) -> Any:
        if self._gcm is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._gcm = AESGCM(self._key)
        return self._gcm

    def _pieces(self, frame: Buffer) -> list[memoryview]:
        view = memoryview(frame).cast("B")
        return [view[i : i + self._chunk] for i in range(0, max(len(view), 1), self._chunk)]

    def of(self, frame: Buffer) -> str:
        if not self._key:
            return hashlib.sha256(frame).hexdigest()
        gcm, out = self._cipher(), []
        for piece in self._pieces(frame):
            nonce = os.urandom(self.NONCE)
            out.append(nonce + gcm.encrypt(nonce, b"", piece))
        return b"".join(out).hex()

    def matches(self, frame: Buffer, digest: object) -> bool:
        if not isinstance(digest, str):
            return False
        if not self._key:
            return hmac.compare_digest(hashlib.sha256(frame).hexdigest(), digest)
        from cryptography.exceptions import InvalidTag

        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            return False
        pieces, step = self._pieces(frame), self.NONCE + self.TAG
        if len(raw) != step * len(pieces):
            return False
        gcm = self._cipher()
        for i, piece in enumerate(pieces):
            nonce, tag = raw[i * step : i * step + self.NONCE], raw[i * step + self.NONCE : (i + 1) * step]
            try:
                gcm.decrypt(nonce, tag, piece)
            except InvalidTag:
                return False
        return True


def pack(items: Sequence[tuple[Envelope, Sequence[Buffer]]], *, mac: FrameMac | None = None,
         ) -> tuple[Batch, list[Buffer]]:
    """Join envelopes and their frames into one comm message's data and buffers; ``mac``: digest the frames."""
    msgs: list[Envelope] = []
    buffers: list[Buffer] = []
    for env, frames in items:
        env = env.copy()
        env["nf"] = len(frames)
        if mac is not None:
            env["dg"] = [mac.of(f) for f in frames]
        msgs.append(env)
        buffers.extend(frames)
    return {"nbr": PROTOCOL_VERSION, "msgs": msgs}, buffers


def unpack(
    data: object, buffers: Sequence[Buffer], *, mac: FrameMac | None = None
) -> list[tuple[Envelope, list[Buffer]]]:
    """Split a received comm message into (envelope, frames) pairs, validating everything a peer sent;
    ``mac``: every envelope's frames must carry digests, and match them."""
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a dict as comm data, got {type(data).__name__}")
    if data.get("nbr") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {data.get('nbr')!r} is not {PROTOCOL_VERSION}: "
            "install the same nbremote version in the driver and the workers"
        )
    msgs = data.get("msgs")
    if not isinstance(msgs, list):
        raise ProtocolError("comm data has no 'msgs' list")
    out: list[tuple[Envelope, list[Buffer]]] = []
    pos = 0
    for env in msgs:
        if not isinstance(env, dict) or env.get("k") not in KINDS:
            raise ProtocolError(f"malformed envelope {env!r:.200}")
        nf = env.get("nf", 0)
        if not isinstance(nf, int) or nf < 0 or pos + nf > len(buffers):
            raise ProtocolError(f"envelope claims {nf!r} frames but the message has {len(buffers) - pos} left")
        frames = list(buffers[pos : pos + nf])
        pos += nf
        if mac is not None:
            dg = env.get("dg")
            if not isinstance(dg, list) or len(dg) != nf:
                raise ProtocolError("buffer digests missing or of the wrong length")
            for f, d in zip(frames, dg, strict=True):
                if not mac.matches(f, d):
                    raise ProtocolError("a buffer does not match its signed digest: message altered in transit")
        if env["k"] in ("call", "cancel", "ok", "err", "out") and not isinstance(env.get("id"), int):
            raise ProtocolError(f"{env['k']!r} envelope without an integer id")
        if env["k"] in ("ctx", "hop") and not isinstance(env.get("ctx"), int):
            raise ProtocolError(f"{env['k']!r} envelope without an integer context id")
        if env["k"] == "hop" and not (isinstance(env.get("run"), int) and isinstance(env.get("hop"), str)
                                      and isinstance(env.get("hops"), list)):
            raise ProtocolError("malformed 'hop' envelope")
        fail = env.get("fail")
        if fail is not None and not (isinstance(fail, list) and len(fail) == 3 and isinstance(fail[0], str)
                                     and isinstance(fail[1], str)):
            raise ProtocolError(f"malformed 'fail' target {fail!r:.100}: [process, key, token] expected")
        out.append((cast(Envelope, env), frames))
    if pos != len(buffers):
        raise ProtocolError(f"{len(buffers) - pos} buffers left over after the last envelope")
    return out


