"""Benchmark: records through the shared-memory ring buffer between processes vs numpy.copyto.

What it is: for record sizes 4 KiB .. 64 MiB and 1 and 2 producer processes, the bytes per
second that reach the consumer (a separate process writes each record; the consumer takes
the zero-copy views, touches the first and last byte, and releases them), beside the bytes
per second of `numpy.copyto` into a preallocated array of the same size in one process (the
copy every record costs its producer). Prints one line per configuration, then, as the last
line, one JSON object with every figure, `ratio_vs_memcpy_64MiB` (best producer count) and
`records_per_s_4KiB`.
What it is not: a test; numbers depend on the machine and on whatever else runs on it.

    python3 bench/ring_buffer.py [--checksum] [--repeats 2] [--bytes-per-config 268435456]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_darl.channel.shm_ring import ShmRing

KIB = 1024
SIZES = (4 * KIB, 64 * KIB, 1024 * KIB, 16 * 1024 * KIB, 64 * 1024 * KIB)


def _producer(name: str, size: int, count: int, start, ready) -> None:
    ring = ShmRing.attach(name, timeout=10)
    payload = np.full(size, 7, dtype=np.uint8)
    ready.release()
    start.wait()
    for _ in range(count):
        ring.put({"payload": payload})
    ring.close()


def _memcpy_rate(size: int, total_bytes: int) -> float:
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first, as the ring's MAP_POPULATE does
    reps = max(3, total_bytes // size)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return reps * size / (time.perf_counter() - t0)


def _ring_rate(size: int, producers: int, total_bytes: int, min_records: int, checksum: bool) -> tuple[float, float]:
    """(bytes/s, records/s) at the consumer, from the start signal to the last record."""
    name = f"darl-bench-{os.getpid()}"
    per = max(min_records // producers, total_bytes // size // producers, 2)
    ring = ShmRing.create(name, max(256 * 1024 * KIB, 4 * (size + 4 * KIB)), checksum=checksum)
    ctx = mp.get_context("spawn")
    start, ready = ctx.Event(), ctx.Semaphore(0)
    procs = [ctx.Process(target=_producer, args=(name, size, per, start, ready)) for _ in range(producers)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()
        start.set()
        t0 = time.perf_counter()
        n = 0
        while n < per * producers:
            rec = ring.get(timeout=60)
            if rec is None:
                raise RuntimeError("bench: producers stalled for 60 s")
            a = rec.arrays["payload"]
            if a[0] != 7 or a[-1] != 7:
                raise RuntimeError("bench: wrong payload")
            rec.release()
            n += 1
        dt = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(30)
        ring.unlink()
    return n * size / dt, n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes-per-config", type=int, default=256 * 1024 * KIB, help="bytes moved per configuration")
    ap.add_argument("--min-records", type=int, default=10000, help="records per configuration, at least")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best one counts")
    ap.add_argument("--checksum", action="store_true", help="crc32 every record (as on non-x86 CPUs)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, float | bool] = {"checksum": args.checksum}
    for size in SIZES:
        label = f"{size // (1024 * KIB)}MiB" if size >= 1024 * KIB else f"{size // KIB}KiB"
        best, memcpy = 0.0, 0.0
        for producers in (1, 2):
            min_records = args.min_records if size <= 64 * KIB else 0
            rate, rps = 0.0, 0.0
            for _ in range(args.repeats):
                # best of `repeats` for both, copyto measured right before each ring run: on a
                # shared machine the load changes between runs, and the best run is the least disturbed
                memcpy = max(memcpy, _memcpy_rate(size, args.bytes_per_config))
                r, n = _ring_rate(size, producers, args.bytes_per_config, min_records, args.checksum)
                rate, rps = max(rate, r), max(rps, n)
            best = max(best, rate)
            result[f"ring_GBps_{label}_p{producers}"] = round(rate / 1e9, 3)
            result[f"records_per_s_{label}_p{producers}"] = round(rps, 1)
            print(f"{label:>6} producers={producers}: ring {rate / 1e9:7.3f} GB/s ({rps:9.1f} rec/s), "
                  f"copyto {memcpy / 1e9:7.3f} GB/s, ratio {rate / memcpy:5.2f}", flush=True)
        result[f"memcpy_GBps_{label}"] = round(memcpy / 1e9, 3)
        result[f"ratio_vs_memcpy_{label}"] = round(best / memcpy, 3)
    result["records_per_s_4KiB"] = max(result["records_per_s_4KiB_p1"], result["records_per_s_4KiB_p2"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
