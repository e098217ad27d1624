"""Ring buffer across real processes (multiprocessing spawn): producers that race, wrap, and die."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from megatron_darl.channel.shm_ring import RingStaleError, ShmRing, segment_path
from tests.helpers import ring_workers as rw

CTX = mp.get_context("spawn")


def _start(target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _drain(ring: ShmRing, sources, until, deadline_s: float = 60.0) -> list[tuple[int, int]]:
    """Read and verify records until `until()` is true and the ring is empty."""
    got, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rec = ring.get(timeout=0.05)
        if rec is None:
            if until():
                return got
            continue
        with rec:
            got.append(rw.check_record(rec.arrays, sources))
    raise AssertionError(f"drain did not finish in {deadline_s} s ({len(got)} records)")


@pytest.mark.parametrize("producers", [2, 4])
def test_producers_wrap_many_times_every_record_once_and_identical(ring_name, producers):
    ring = ShmRing.create(ring_name, 1 << 17)
    count = 120
    procs = [_start(rw.produce, ring_name, p, count, 16, 20_000) for p in range(producers)]
    sources = {p: rw.source_bytes(p) for p in range(producers)}
    got = _drain(ring, sources, until=lambda: not any(p.is_alive() for p in procs))
    assert all(p.exitcode == 0 for p in procs)
    assert sorted(got) == [(p, i) for p in range(producers) for i in range(count)]  # exactly once
    for p in range(producers):  # one producer's records arrive in its own order
        assert [i for q, i in got if q == p] == list(range(count))
    laps = int(ring._hdr[16]) / ring.capacity
    assert laps > 10, laps
    ring.unlink()


def test_producer_killed_mid_write_loses_only_its_record(ring_name):
    ring = ShmRing.create(ring_name, 1 << 18)
    sources = {p: rw.source_bytes(p) for p in range(3)}
    dying = _start(rw.die_mid_write, ring_name, 0, 1.0)
    deadline = time.monotonic() + 20
    while ring.free_bytes() == ring.capacity:  # wait for its reservation
        assert time.monotonic() < deadline
        time.sleep(0.01)
    others = [_start(rw.produce, ring_name, p, 40, 16, 8_000) for p in (1, 2)]
    # while the writer lives, its half-written record blocks the line but is never returned
    assert ring.get(timeout=0.3) is None
    assert dying.is_alive() and ring.skipped_dead == 0
    got = _drain(ring, sources, until=lambda: not any(p.is_alive() for p in others + [dying]))
    assert dying.exitcode == -9
    assert sorted(got) == [(p, i) for p in (1, 2) for i in range(40)]
    assert ring.skipped_dead == 1 and ring.corrupt == 0
    assert ring.free_bytes() == ring.capacity  # the dead record's bytes were reclaimed
    ring.unlink()


def test_producer_killed_holding_the_lock_blocks_nobody(ring_name):
    ring = ShmRing.create(ring_name, 1 << 16)
    dead = _start(rw.die_holding_lock, ring_name)
    dead.join(20)
    assert dead.exitcode == -9
    prod = _start(rw.produce, ring_name, 1, 20, 16, 2_000)
    got = _drain(ring, {1: rw.source_bytes(1)}, until=lambda: not prod.is_alive(), deadline_s=30)
    assert prod.exitcode == 0 and got == [(1, i) for i in range(20)]
    ring.unlink()


def test_fuzz_random_kills_never_expose_a_partial_record(ring_name):
    """Producers are SIGKILLed at random moments; every record the consumer gets is complete,
    and each producer's delivered records are a gap-free prefix of what it wrote (it can lose
    at most the one record it was writing)."""
    ring = ShmRing.create(ring_name, 1 << 21, checksum=False)  # integrity from the commit protocol alone
    rng = np.random.default_rng(7)
    n_kills, survivors = 8, 2
    sources, got = {}, []
    live: dict[int, mp.Process] = {}
    for p in range(survivors):
        sources[p] = rw.source_bytes(p)
        live[p] = _start(rw.produce, ring_name, p, 150, 100_000, 400_000)
    for k in range(n_kills):
        p = survivors + k
        sources[p] = rw.source_bytes(p)
        victim = _start(rw.produce, ring_name, p, 10**6, 100_000, 400_000, 0.002)
        kill_at, deadline = None, time.monotonic() + 30
        while kill_at is None or time.monotonic() < kill_at:
            assert time.monotonic() < deadline, f"victim {p} delivered nothing"
            rec = ring.get(timeout=0.002)
            if rec is not None:
                with rec:
                    got.append(rw.check_record(rec.arrays, sources))
                if kill_at is None and got[-1][0] == p:  # it is in its put loop: kill it soon
                    kill_at = time.monotonic() + float(rng.uniform(0.0, 0.05))
        victim.kill()
        victim.join(10)
    got += _drain(ring, sources, until=lambda: not any(p.is_alive() for p in live.values()))
    assert all(p.exitcode == 0 for p in live.values())
    assert ring.corrupt == 0
    for p in sources:
        mine = [i for q, i in got if q == p]
        assert mine == list(range(len(mine))), f"producer {p}: gap or duplicate in {mine[:20]}"
        if p < survivors:
            assert len(mine) == 150
    # the slow writers spend most of their time between reservation and commit: most kills hit
    # a record mid-write, and each such record was skipped, not returned
    assert n_kills // 2 <= ring.skipped_dead <= n_kills, ring.skipped_dead
    assert ring.free_bytes() == ring.capacity  # nothing left reserved by the dead
    ring.unlink()


def test_stale_segment_of_a_crashed_run_is_detected_and_replaced(ring_name):
    crashed = _start(rw.create_and_crash, ring_name)
    crashed.join(20)
    assert crashed.exitcode == -9 and os.path.exists(segment_path(ring_name))
    with pytest.raises(RingStaleError, match="crashed run"):
        ShmRing.attach(ring_name)
    ring = ShmRing.create(ring_name, 1 << 16)  # replaces it instead of reusing it
    prod = _start(rw.produce, ring_name, 3, 5, 16, 100)
    got = _drain(ring, {3: rw.source_bytes(3)}, until=lambda: not prod.is_alive(), deadline_s=30)
    assert got == [(3, i) for i in range(5)]
    ring.unlink()
