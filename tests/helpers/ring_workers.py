"""Child-process bodies for the ring-buffer tests (importable by multiprocessing spawn).

What it is: producers that write self-verifying records, and producers that die on purpose
at chosen points of the write protocol. What it is not: a test module (no test_ prefix).
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
import zlib

import numpy as np

from megatron_darl.channel.shm_ring import ShmRing, _layout


def source_bytes(producer: int, n: int = 1 << 22) -> np.ndarray:
    """The byte pool producer `producer` slices its records from (the consumer rebuilds it)."""
    return np.random.default_rng(1000 + producer).integers(0, 256, size=n, dtype=np.uint8)


def record(producer: int, index: int, src: np.ndarray, min_len: int, max_len: int) -> dict[str, np.ndarray]:
    """Record `index` of `producer`: a slice of its pool plus (producer, index, offset, crc)."""
    rng = np.random.default_rng(producer * 1_000_003 + index)
    n = int(rng.integers(min_len, max_len + 1))
    off = int(rng.integers(0, len(src) - n))
    data = src[off : off + n]
    meta = np.array([producer, index, off, n, zlib.crc32(data)], dtype=np.int64)
    tail = np.arange(index % 7, dtype=np.float32) * producer  # a second, variable-length field
    return {"meta": meta, "data": data, "tail": tail}


def check_record(arrays: dict[str, np.ndarray], sources: dict[int, np.ndarray]) -> tuple[int, int]:
    """Assert a received record is byte-identical to what its producer wrote; (producer, index)."""
    p, i, off, n, crc = (int(x) for x in arrays["meta"])
    data = arrays["data"]
    assert len(data) == n and zlib.crc32(data) == crc, f"torn or wrong record {p}/{i}"
    assert np.array_equal(data, sources[p][off : off + n]), f"record {p}/{i} differs from its source"
    assert np.array_equal(arrays["tail"], np.arange(i % 7, dtype=np.float32) * p)
    return p, i


def produce(name: str, producer: int, count: int, min_len: int, max_len: int, slow_write: float = 0.0) -> None:
    """Put records 0 .. count-1 of `producer`, blocking when the ring is full. With
    `slow_write` > 0 each record is written in pieces with pauses of that many seconds between
    them (the same reserve / write / commit steps as `put`), so that a kill at a random moment
    lands mid-write most of the time."""
    ring = ShmRing.attach(name, timeout=10)
    src = source_bytes(producer)
    for i in range(count):
        arrays = record(producer, i, src, min_len, max_len)
        if slow_write <= 0:
            ring.put(arrays, timeout=60)
            continue
        desc, parts, total = _layout(arrays)
        pos, seq = ring._reserve(total, len(desc), timeout=60)
        ring._write_payload(pos, desc, [], total)
        for off, arr in parts:
            for piece in np.array_split(np.arange(arr.size), 4):
                if piece.size:
                    time.sleep(slow_write)
                    sub = arr[piece[0] : piece[-1] + 1]
                    ring._write_payload(pos, b"", [(off + piece[0] * arr.itemsize, sub)], total)
        ring._commit(pos, seq, total)
    ring.close()


def die_mid_write(name: str, producer: int, linger: float) -> None:
    """Reserve a record, write half of it, wait `linger` s, then SIGKILL ourselves."""
    ring = ShmRing.attach(name, timeout=10)
    arrays = record(producer, 0, source_bytes(producer), 60_000, 60_000)
    desc, parts, total = _layout(arrays)
    pos, _ = ring._reserve(total, len(desc), timeout=10)
    ring._write_payload(pos, desc, parts[:1], total)  # descriptor and first array only
    time.sleep(linger)
    os.kill(os.getpid(), signal.SIGKILL)


def die_holding_lock(name: str) -> None:
    """Take the reservation lock and SIGKILL ourselves while holding it."""
    ring = ShmRing.attach(name, timeout=10)
    fcntl.flock(ring._fd, fcntl.LOCK_EX)
    os.kill(os.getpid(), signal.SIGKILL)


def create_and_crash(name: str) -> None:
    """Create a ring (as a learner would) and die without unlinking it."""
    ShmRing.create(name, 1 << 16)
    os.kill(os.getpid(), signal.SIGKILL)
