"""Ring buffer in one process: record round trip, ordering, wrap-around, backpressure, lifecycle."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from megatron_darl.channel.shm_ring import (
    HEADER_BYTES,
    RingClosedError,
    RingError,
    RingFullError,
    RingInUseError,
    RingStaleError,
    ShmRing,
    process_alive,
    segment_path,
)
from megatron_darl.types import Trajectory


def _traj(i: int, n: int = 5) -> Trajectory:
    return Trajectory(
        prompt_ids=np.arange(3) + i,
        response_ids=np.arange(n) * 3 + i,
        behav_logprobs=-np.linspace(0.1, 1.0, n),
        behav_versions=np.full(n, i % 4),
        reward=0.5 * i,
        prompt_id=100 + i,
        group_id=i // 2,
        finish_reason="length" if i % 3 else "stop",
        metadata={"i": i, "tag": "x" * (i % 5)},
    )


@pytest.mark.parametrize("checksum", [False, True])
def test_arrays_round_trip_byte_identical_and_zero_copy(ring_name, checksum):
    ring = ShmRing.create(ring_name, 1 << 16, checksum=checksum)
    prod = ShmRing.attach(ring_name)
    arrays = {
        "i8": np.array([-1, 2, 3], dtype=np.int8),
        "f64": np.linspace(0, 1, 17),
        "be": np.arange(5, dtype=">u4"),  # non-native byte order survives
        "empty": np.zeros(0, dtype=np.float32),
        "strided": np.arange(20, dtype=np.int64)[::3],  # non-contiguous input
    }
    seq = prod.put(arrays)
    rec = ring.get()
    assert rec.seq == seq and rec.pid == os.getpid()
    for k, v in arrays.items():
        assert rec.arrays[k].dtype == v.dtype and np.array_equal(rec.arrays[k], v), k
        assert not rec.arrays[k].flags.writeable
    # zero copy: the view's memory lies inside the mapped segment
    assert np.shares_memory(rec.arrays["f64"], ring._buf)
    rec.release()
    assert ring.get() is None
    prod.close()
    ring.unlink()


def test_trajectory_helpers_round_trip(ring_name):
    with ShmRing.create(ring_name, 1 << 16) as ring:
        for i in range(6):
            ring.put_trajectory(_traj(i))
        for i in range(6):
            got, want = ring.get_trajectory(), _traj(i)
            for name in ("prompt_ids", "response_ids", "behav_logprobs", "behav_versions"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert (got.prompt_id, got.group_id, got.finish_reason, got.metadata) == (
                want.prompt_id, want.group_id, want.finish_reason, want.metadata)
            assert got.reward == np.float32(want.reward)
            assert not np.shares_memory(got.response_ids, ring._buf)  # copied out, slot released
        assert ring.free_bytes() == ring.capacity


def test_wraps_many_times_in_order(ring_name):
    ring = ShmRing.create(ring_name, 16384)
    rng = np.random.default_rng(0)
    total = 0
    for i in range(500):
        a = rng.integers(0, 1 << 30, size=int(rng.integers(0, 600)), dtype=np.int64)
        ring.put({"a": a, "i": np.array([i])})
        total += a.nbytes
        rec = ring.get()
        assert int(rec.arrays["i"][0]) == i and np.array_equal(rec.arrays["a"], a)
        rec.release()
    assert total > 50 * ring.capacity  # many laps
    ring.unlink()


def test_full_ring_blocks_then_raises_and_never_overwrites(ring_name):
    ring = ShmRing.create(ring_name, 4096)
    payload = np.full(900, 7, dtype=np.uint8)
    held = []
    while True:
        try:
            ring.put({"p": payload}, timeout=0.05)
        except RingFullError as e:
            assert "not keeping up" in str(e)
            break
        held.append(ring.get())  # read but not released: producers must not reuse the bytes
        assert len(held) < 10
    assert all(np.all(r.arrays["p"] == 7) for r in held)
    held[0].release()
    ring.put({"p": np.full(900, 9, dtype=np.uint8)}, timeout=1)  # space came back
    assert all(np.all(r.arrays["p"] == 7) for r in held[1:])
    ring.unlink()


def test_out_of_order_release_frees_only_the_released_prefix(ring_name):
    ring = ShmRing.create(ring_name, 1 << 14)
    for i in range(3):
        ring.put({"i": np.array([i])})
    a, b, c = ring.get(), ring.get(), ring.get()
    used = ring.capacity - ring.free_bytes()
    b.release()
    assert ring.capacity - ring.free_bytes() == used  # a still holds the front
    a.release()
    assert ring.capacity - ring.free_bytes() == c.nbytes
    c.release()
    c.release()  # idempotent
    assert ring.free_bytes() == ring.capacity
    ring.unlink()


def test_bad_input_is_named(ring_name):
    ring = ShmRing.create(ring_name, 4096)
    with pytest.raises(ValueError, match="'m'"):
        ring.put({"m": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="object"):
        ring.put({"o": np.array([object()])})
    with pytest.raises(ValueError, match="half its capacity"):
        ring.put({"big": np.zeros(2048, dtype=np.uint8)})
    with pytest.raises(ValueError, match="without '/'"):
        ShmRing.create("a/b", 4096)
    prod = ShmRing.attach(ring_name)
    with pytest.raises(RingError, match="only the process that created"):
        prod.get()
    prod.close()
    ring.unlink()


def test_live_segment_is_not_replaced_and_unlink_closes_producers(ring_name):
    ring = ShmRing.create(ring_name, 4096)
    with pytest.raises(RingInUseError):
        ShmRing.create(ring_name, 4096)
    prod = ShmRing.attach(ring_name)
    ring.unlink()
    assert not os.path.exists(segment_path(ring_name))
    with pytest.raises(RingClosedError):
        prod.put({"x": np.zeros(3)})
    prod.close()
    with pytest.raises(FileNotFoundError, match="not found"):
        ShmRing.attach(ring_name, timeout=0.1)


def test_garbage_segment_is_replaced_and_refused_by_attach(ring_name):
    with open(segment_path(ring_name), "wb") as f:
        f.write(b"\x01" * (HEADER_BYTES + 4096))  # not our magic, "creator pid" is not alive
    with pytest.raises(RingStaleError):
        ShmRing.attach(ring_name)
    ring = ShmRing.create(ring_name, 4096)
    ring.put({"x": np.arange(3)})
    assert np.array_equal(ring.get().arrays["x"], np.arange(3))
    ring.unlink()


def test_process_alive():
    assert process_alive(os.getpid())
    assert not process_alive(os.getpid(), start_time=1)  # same pid, other start time: a reuse
    assert not process_alive(2**22 + 12345)


def test_unreaped_dead_child_counts_as_dead():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while process_alive(pid):  # a zombie until reaped: os.kill(pid, 0) would still succeed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(pid, 0)
    os.waitpid(pid, 0)


def test_checksum_mismatch_is_retried_then_skipped(ring_name):
    ring = ShmRing.create(ring_name, 1 << 14, checksum=True)
    ring.put({"a": np.arange(100, dtype=np.int32)})
    ring.put({"b": np.arange(5, dtype=np.int32)})
    ring._buf[HEADER_BYTES + 64 + 200] ^= 0xFF  # a byte of the first record's payload
    assert ring.get(timeout=0.1) is None  # not returned while it may still become visible
    rec = ring.get(timeout=3)
    assert list(rec.arrays) == ["b"] and ring.corrupt == 1
    rec.release()
    assert ring.free_bytes() == ring.capacity
    ring.unlink()
