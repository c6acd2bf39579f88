"""The receive-memory pool (``_wire.bufpool``): memory comes back only once nothing views it, within bounds.

The real-server test (``test_server_kernels.py``, 64 MB both ways through the websocket alone, the first
result kept and checked unchanged) shows the same through real kernels.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from nbremote.rpc._wire import batching, envelope
from nbremote.rpc._wire.bufpool import MIN_POOLED, BufferPool

MB = 1 << 20


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def test_memory_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = BufferPool(cap=64 * MB)
    first = pool.take(4 * MB)
    first[:] = b"\x01" * (4 * MB)
    piece = first[MB : 2 * MB]  # a slice: views the same memory
    array = np.frombuffer(piece, dtype=np.uint8)  # an array over the slice: the same again
    del first, piece
    gc.collect()
    assert pool.free_bytes == 0, "memory an array still views must not be back in the pool"
    second = pool.take(4 * MB)
    second[:] = b"\x02" * (4 * MB)
    assert (array == 1).all(), "taking again must not overwrite memory still in use"
    address = _address(second)
    del second
    gc.collect()
    assert pool.free_bytes >= 4 * MB
    third = pool.take(4 * MB)
    assert _address(third) == address, "memory no longer viewed should be reused"
    assert pool.free_bytes == 0
    del array
    gc.collect()
    assert pool.free_bytes >= 4 * MB, "the first buffer comes back once its last array is gone"


def test_the_pool_is_bounded_and_lets_idle_memory_go() -> None:
    pool = BufferPool(cap=8 * MB, idle=3600)
    held = [pool.take(3 * MB) for _ in range(4)]
    del held
    gc.collect()
    assert 0 < pool.free_bytes <= 8 * MB, "free memory held stays within the cap"
    idle = BufferPool(cap=64 * MB, idle=0.0)
    view = idle.take(2 * MB)
    del view
    gc.collect()
    idle.trim()
    assert idle.free_bytes == 0, "memory unused past the idle time is let go"


def test_small_and_mismatched_sizes_take_fresh_memory() -> None:
    pool = BufferPool(cap=64 * MB)
    small = pool.take(MIN_POOLED - 1)
    assert small.nbytes == MIN_POOLED - 1 and not small.readonly
    del small
    big = pool.take(16 * MB)
    address = _address(big)
    del big
    gc.collect()
    other = pool.take(2 * MB)  # a 16 MB buffer would waste most of itself on 2 MB: a fresh one
    assert _address(other) != address and pool.free_bytes >= 16 * MB


def test_reassembled_messages_reuse_memory_only_after_release() -> None:
    def send(buffers: list[bytes], pid: str) -> list[memoryview]:
        data, bufs = envelope.pack([({"k": "call", "id": 1, "fn": "f", "caller": "d"}, buffers)])
        whole = None
        for content, frames in batching.split_parts(dict(data), bufs, MB, pid):
            ((env, frames_in),) = envelope.unpack(content, frames)
            whole = parts.add("driver", env, frames_in)
        assert whole is not None
        ((_, frames_out),) = envelope.unpack(*whole)
        return frames_out

    parts = batching.Parts()
    a = np.random.default_rng(1).integers(0, 255, 3 * MB + 17, dtype=np.uint8)
    first = np.frombuffer(send([a.tobytes()], "p1")[0], dtype=np.uint8)  # kept, as a user keeps a result
    second = send([(255 - a).tobytes()], "p2")
    assert np.array_equal(first, a), "a kept message must be unchanged by the next one"
    assert np.array_equal(np.frombuffer(second[0], dtype=np.uint8), 255 - a)


@pytest.mark.parametrize("size", [MIN_POOLED, 5 * MB + 3])
def test_taken_memory_is_writable_and_exactly_sized(size: int) -> None:
    view = BufferPool().take(size)
    assert view.nbytes == size and view.format == "B" and not view.readonly
