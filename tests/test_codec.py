"""The lean codec (``_wire.codec``) against jupyter_client's ``Session``: each accepts what the other signs."""

from __future__ import annotations

import json
import os

import pytest
from jupyter_client.session import Session

from nbremote.errors import ProtocolError
from nbremote.rpc._wire import batching, codec, envelope
from nbremote.rpc._wire.codec import MSG_TYPE, Codec, is_ours, split_idents

pytestmark = pytest.mark.timeout(10)

KEY = os.urandom(32)
ITEMS: list[batching.Item] = [({"k": "call", "id": 7, "fn": "f", "caller": "driver", "to": 60.0}, [b"pickle"]),
                           ({"k": "cancel", "id": 3}, [])]


def test_session_accepts_what_the_codec_signs() -> None:
    frames = Codec(KEY).encode_items(ITEMS)
    session = Session(key=KEY, signature_scheme="hmac-sha256")
    idents, msg_list = session.feed_identities([bytes(f) for f in frames])
    msg = session.deserialize(msg_list, content=True)
    assert idents == [] and msg["header"]["msg_type"] == MSG_TYPE
    assert [env["k"] for env, _ in envelope.unpack(msg["content"], msg["buffers"])] == ["call", "cancel"]
    assert bytes(msg["buffers"][0]) == b"pickle"


def test_codec_accepts_what_session_signs_with_its_own_spacing() -> None:
    session = Session(key=KEY, signature_scheme="hmac-sha256")
    data, buffers = envelope.pack(ITEMS)
    msg = session.msg(MSG_TYPE, dict(data))
    frames = [b"caller-id", *session.serialize(msg), *buffers]
    idents, at = split_idents(frames)
    assert idents == [b"caller-id"] and is_ours(frames[at + 2], exact=True)
    _, content, got = Codec(KEY).decode(frames, at=at)
    assert [env["id"] for env, _ in envelope.unpack(content, got)] == [7, 3]


def test_only_the_message_type_itself_makes_a_message_ours() -> None:
    assert not is_ours(json.dumps({"msg_type": "execute_request"}).encode(), exact=True)
    mention = json.dumps({"msg_type": "execute_request", "username": f'x","msg_type":"{MSG_TYPE}'}).encode()
    assert is_ours(mention) and not is_ours(mention, exact=True)  # a quote inside a string is escaped
    spaced = json.dumps({"msg_type": MSG_TYPE}, indent=1).encode()  # neither compact nor default spacing
    assert is_ours(spaced, exact=True)


def test_wrong_key_replay_and_bad_content_are_refused() -> None:
    frames = Codec(KEY).encode_items(ITEMS)
    with pytest.raises(ProtocolError, match="signature"):
        Codec(os.urandom(32)).decode(frames)
    receiver = Codec(KEY)
    receiver.decode(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode(frames)
    unsigned = Codec(b"")
    bad = unsigned.encode({"nbr": 1})
    bad[5] = b"[1, 2"
    with pytest.raises(ProtocolError, match="not JSON"):
        unsigned.decode(bad)
    bad[5] = b"[1, 2]"
    with pytest.raises(ProtocolError, match="not a JSON object"):
        unsigned.decode(bad)


def test_the_direct_json_paths_write_and_read_what_json_does() -> None:

    if codec._encode_c is None:
        pytest.skip("this Python's json has no C speedups: the codec uses JSONEncoder / JSONDecoder themselves")
    contents = [{"nbr": 1, "msgs": [{"k": "err", "id": 2**40, "msg": "caf\u00e9 \u2603 \"quoted\"\n\t\\",
                                      "to": 1e-7, "peers": [{"lost": None, "ok": True}, {"x": -0.0}]}]},
                {"nbr": 1, "msgs": []}, {"empty": {}, "nested": [[[]]], "big": 1.5e300}]
    for content in contents:
        text = codec._json_text(content)
        assert text == json.dumps(content, separators=(",", ":")).encode()
        assert codec._json_value(text.decode()) == content == json.loads(text)
    assert codec._json_value(' {"a": [1, 2]}\n') == {"a": [1, 2]}  # Session's spacing, whitespace around
    for bad in ('{"a": 1} {"b": 2}', '{"a": ', "", "[1, 2"):
        with pytest.raises(ValueError):
            codec._json_value(bad)
    with pytest.raises(TypeError, match="not JSON serializable"):
        codec._json_text({"a": object()})


def test_decode_reads_bytes_frames_and_zmq_frames_alike() -> None:
    import zmq

    frames = Codec(KEY).encode_items(ITEMS)
    as_zmq = [zmq.Frame(bytes(f)) for f in frames]
    mixed = [*as_zmq[:3], *[bytes(f) for f in frames[3:]]]
    for each in (frames, as_zmq, mixed):
        idents, content, buffers = Codec(KEY).decode(each)
        assert idents == [] and [env["id"] for env, _ in envelope.unpack(content, buffers)] == [7, 3]


def test_big_frames_travel_in_pieces_and_come_back_whole() -> None:
    """Frames over ``PIECE`` bytes leave as slices of it (libzmq is several times faster with 1 MiB frames
    than with one of 64 MB) and are put together again on receipt, in place and in order, signed."""
    piece = codec.PIECE
    big = os.urandom(2 * piece + 5)  # three pieces, the last of 5 bytes
    exact = os.urandom(piece)  # not cut: not over
    items = [({"k": "call", "id": 1}, [b"small", big]), ({"k": "ok", "id": 2}, [exact, memoryview(big)[7:]])]
    c = Codec(b"key")
    frames = c.encode_items(items, digests=True, pieces=True)  # type: ignore[arg-type]
    _, content, buffers = c.decode(frames)
    assert content["sp"] == [[1, 3], [3, 2]] and len(buffers) == 1 + 3 + 1 + 2
    assert all(len(memoryview(f)) <= piece for f in frames[6:])
    out = c.unpack_items(content, [_Frame(f) for f in buffers], digests=True)
    assert [[bytes(f) for f in fr] for _, fr in out] == [[b"small", big], [exact, big[7:]]]
    assert "sp" not in c.decode(c.encode_items(items, pieces=False))[1]  # type: ignore[arg-type]


@pytest.mark.parametrize("table, message", [
    ("nope", "not a list"),
    ([[0]], "malformed piece table entry"),
    ([[0, "2"]], "malformed piece table entry"),
    ([[0, 1]], "does not fit"),  # one piece is no cut
    ([[0, 9]], "does not fit"),  # more pieces than buffers
    ([[1, 2], [0, 2]], "does not fit"),  # out of order
])
def test_a_malformed_piece_table_is_refused(table: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        codec.joined({"sp": table}, [b"a", b"b", b"c"])


class _Frame:
    """What ``recv_frames`` yields, as far as ``unpack_items`` looks: a ``.buffer``."""

    def __init__(self, data: object) -> None:
        self.buffer = memoryview(data)  # type: ignore[arg-type]
