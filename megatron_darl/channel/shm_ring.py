"""On-node shared-memory ring buffer: many producers (rollout managers), one consumer (learner).

What it is: a byte ring in one file under /dev/shm, mapped by every process on the node.
Records are dicts of named 1-D numpy arrays (`put`), read back as read-only zero-copy views
(`get`) that stay valid until the consumer releases the record; `put_trajectory` /
`get_trajectory` wrap `Trajectory.to_arrays` / `from_arrays`.
What it is not: a cross-node transport, a queue with several consumers, or a store (the
learner copies what it keeps into `ReplayStore`).

A plain /dev/shm file + mmap, not `multiprocessing.shared_memory`: its `fcntl.flock` dies with
its holder (even by SIGKILL), and no resource tracker unlinks the ring under the learner (bpo-39959).

Protocol (positions are monotonically increasing byte offsets; slot = offset % capacity):
- Reserve (under flock, a few microseconds): check free space against the consumer's `tail`,
  pad to the end of the ring if the record does not fit before it (records are at most half
  the ring, so one always fits an empty ring after the pad), write the record header
  (seq, length, producer pid and start time, commit word 0), then advance `head`. Waiting
  for space happens outside the lock, so a full ring never blocks the lock.
- Write (no lock): copy the arrays, then the optional crc32, then the commit word = seq + 1
  last. On x86-64 (total store order) a reader that sees the commit word sees every byte
  before it; on weakly ordered CPUs turn the checksum on (`ring.checksum`).
- Read (consumer only, in reservation order): a record is returned only once committed (and
  its crc matches). An uncommitted slot whose producer is dead (no /proc entry, zombie, or a
  different start time: pid reuse) is skipped; its bytes are never read.
- Release: `tail` advances over the released prefix; until then producers cannot overwrite
  the bytes (backpressure: `put(timeout=...)` waits, then raises `RingFullError`).
A segment whose creator is dead (or whose header is invalid) is a leftover of a crashed run:
`create` replaces it; `attach` refuses it. `unlink` marks the ring closed, so producers of a
finished run fail with `RingClosedError` instead of writing into a segment nobody reads.
One ShmRing object per thread: flock belongs to an open file, so threads sharing one object
would not exclude each other (one asyncio loop per process is fine).
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Mapping

import numpy as np

from megatron_darl.types import Trajectory

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"DARLRING", "little")
LAYOUT = 1
HEADER_BYTES = 4096  # segment header; data starts on a page boundary
ALIGN = 64  # records and arrays start on cache-line boundaries
REC_HDR = 64

# segment header, u64 word indices (head and tail on separate cache lines: different writers)
_MAGIC, _LAYOUT, _CAP, _CPID, _CSTART, _GEN, _CHECKSUM, _CLOSED = range(8)
_HEAD, _NEXT_SEQ = 16, 17
_TAIL = 32
# record header, u64 word indices
_R_COMMIT, _R_SEQ, _R_TOTAL, _R_PID, _R_START, _R_KIND, _R_DESC, _R_CRC = range(8)
_KIND_DATA, _KIND_PAD = 1, 2


class RingError(RuntimeError):
    """Base class of ring-buffer errors."""


class RingFullError(RingError):
    """`put` waited `timeout` seconds and the consumer did not free enough space."""


class RingClosedError(RingError):
    """The ring was unlinked, replaced, or its consumer died: re-attach to the new run's ring."""


class RingInUseError(RingError, FileExistsError):
    """`create` found a live ring of the same name (its creator process is alive)."""


class RingStaleError(RingError):
    """`attach` found a segment left by a crashed run (dead creator or invalid header)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the comm field may contain spaces
    if fields[0] in (b"Z", b"X"):  # a SIGKILLed child that nobody reaped yet is dead to us
        return None
    return int(fields[19])  # field 22 of proc(5), counted after the comm field


def process_alive(pid: int, start_time: int = 0) -> bool:
    """True while `pid` runs and (when `start_time` is known) is the same process, not a reuse."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        st = _start_time(pid)
        return st is not None and (start_time == 0 or st == start_time)
    try:  # no procfs: existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segment_path(name: str, directory: str | None = None) -> str:
    """Where the ring `name` lives: /dev/shm where it exists, the temp directory otherwise."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"ring name {name!r}: must be a non-empty file name without '/'")
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(directory, name)


class RingRecord:
    """One committed record: read-only zero-copy `arrays`, valid until `release()`.

    Copy what you keep (`copy_arrays()`); after release the bytes may be overwritten.
    """

    __slots__ = ("seq", "pid", "arrays", "nbytes", "_ring", "_entry")

    def __init__(self, ring: "ShmRing", seq: int, pid: int, arrays: dict[str, np.ndarray], nbytes: int, entry: list):
        self.seq, self.pid, self.arrays, self.nbytes = seq, pid, arrays, nbytes
        self._ring, self._entry = ring, entry

    def copy_arrays(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.arrays.items()}

    def to_trajectory(self) -> Trajectory:
        """A Trajectory over the views (zero copy): use it before `release()`."""
        return Trajectory.from_arrays(self.arrays)

    def release(self) -> None:
        self._ring._release(self._entry)

    def __enter__(self) -> "RingRecord":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ShmRing:
    """A mapped ring segment. `create` (consumer side) or `attach` (producer side), never the
    constructor. Producers may be many processes; `get`/`release` belong to the creator."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, consumer: bool):
        self.path, self._fd, self._mm, self.consumer = path, fd, mm, consumer
        self._buf = np.frombuffer(mm, dtype=np.uint8)  # one buffer export; every view derives from it
        self._hdr = self._buf[:HEADER_BYTES].view(np.uint64)
        self.capacity = int(self._hdr[_CAP])
        self.checksum = bool(self._hdr[_CHECKSUM])
        self.generation = int(self._hdr[_GEN])
        self._pid = os.getpid()
        self._start = _start_time(self._pid) or 0
        self._read = int(self._hdr[_TAIL])  # consumer: next offset to read
        self._outstanding: deque[list] = deque()  # consumer: [total_bytes, released] per read record
        self._dead_check: tuple[int, float] = (-1, 0.0)
        self._crc_wait: dict[int, float] = {}  # offset -> first crc mismatch time
        self.records_read = 0
        self.skipped_dead = 0
        self.corrupt = 0

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls, name: str, capacity: int, *, checksum: bool = False, directory: str | None = None) -> "ShmRing":
        """Create the ring `name` with `capacity` data bytes, replacing a crashed run's segment."""
        path = segment_path(name, directory)
        cap = capacity // ALIGN * ALIGN
        if cap < 4 * ALIGN:
            raise ValueError(f"ShmRing.create({name!r}): capacity {capacity} bytes is too small (>= 256)")
        if os.path.exists(path):
            _remove_if_stale(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve tmpfs pages now: a full /dev/shm fails here with ENOSPC, not with SIGBUS later
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, HEADER_BYTES + cap)
            else:
                os.ftruncate(fd, HEADER_BYTES + cap)
            mm = _map(fd, HEADER_BYTES + cap)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        hdr = np.frombuffer(mm, dtype=np.uint64, count=HEADER_BYTES // 8)
        hdr[_CPID], hdr[_CSTART] = os.getpid(), _start_time(os.getpid()) or 0
        hdr[_LAYOUT], hdr[_CAP], hdr[_CHECKSUM] = LAYOUT, cap, int(checksum)
        hdr[_GEN] = int.from_bytes(os.urandom(8), "little")
        hdr[_MAGIC] = MAGIC  # last: a half-created segment has no magic
        del hdr
        return cls(path, fd, mm, consumer=True)

    @classmethod
    def attach(cls, name: str, *, timeout: float = 0.0, directory: str | None = None) -> "ShmRing":
        """Attach as a producer, waiting up to `timeout` s for the learner to create the ring."""
        path = segment_path(name, directory)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls._attach_once(path)
            except (FileNotFoundError, _NotReady) as e:
                if time.monotonic() >= deadline:
                    raise FileNotFoundError(
                        f"ring {name!r} not found or not initialised at {path} after {timeout:.1f} s ({e})"
                    ) from None
                time.sleep(0.05)

    @classmethod
    def _attach_once(cls, path: str) -> "ShmRing":
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise _NotReady(f"segment is {size} bytes")
            hdr = _read_header(fd)
            if hdr[_MAGIC] != MAGIC:
                # pid 0: the creator has the file but has not written its header yet
                if int(hdr[_CPID]) == 0 or process_alive(int(hdr[_CPID]), int(hdr[_CSTART])):
                    raise _NotReady("creator is still initialising it")
                raise RingStaleError(f"ring at {path}: invalid header and no live creator (stale segment)")
            if hdr[_LAYOUT] != LAYOUT or size != HEADER_BYTES + int(hdr[_CAP]):
                raise RingStaleError(f"ring at {path}: layout {hdr[_LAYOUT]} / size {size} do not match this code")
            if hdr[_CLOSED] or not process_alive(int(hdr[_CPID]), int(hdr[_CSTART])):
                raise RingStaleError(
                    f"ring at {path}: creator pid {int(hdr[_CPID])} is gone or closed it (segment of a crashed run)"
                )
            return cls(path, fd, _map(fd, size), consumer=False)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Unmap (when no record views remain) and close; the segment stays for others."""
        if self._fd < 0:
            return
        del self._hdr
        self._buf = None
        try:
            self._mm.close()
        except BufferError:  # views handed out are still alive: the mapping goes with the last one
            pass
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        """Creator: mark the ring closed (producers then raise RingClosedError), remove it, close."""
        if self._fd >= 0:
            self._hdr[_CLOSED] = 1
        try:
            if self._fd < 0 or os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # only our own segment, never a newer run's of the same name
        except FileNotFoundError:
            pass
        self.close()

    def __enter__(self) -> "ShmRing":
        return self

    def __exit__(self, *exc) -> None:
        self.unlink() if self.consumer else self.close()

    # ---------------------------------------------------------------- producer
    def put(self, arrays: Mapping[str, np.ndarray], *, timeout: float | None = None) -> int:
        """Append one record (a dict of 1-D arrays); returns its sequence number.

        Blocks while the ring is full, up to `timeout` seconds (None: as long as the consumer
        lives), then raises RingFullError. Raises RingClosedError if the ring was closed.
        """
        desc, parts, total = _layout(arrays)
        if total > self.max_record_bytes:
            raise ValueError(
                f"ShmRing.put: record of {total} bytes exceeds the largest record of this ring, "
                f"{self.max_record_bytes} bytes (half its capacity); raise ring.size_bytes"
            )
        pos, seq = self._reserve(total, len(desc), timeout)
        self._write_payload(pos, desc, parts, total)
        self._commit(pos, seq, total)
        return seq

    def put_trajectory(self, traj: Trajectory, *, timeout: float | None = None) -> int:
        return self.put(traj.to_arrays(), timeout=timeout)

    @property
    def max_record_bytes(self) -> int:
        """Half the ring: such a record always fits an empty ring, even after the pad to its end."""
        return self.capacity // 2

    def free_bytes(self) -> int:
        return self.capacity - (int(self._hdr[_HEAD]) - int(self._hdr[_TAIL]))

    def _reserve(self, total: int, desc_len: int, timeout: float | None) -> tuple[int, int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 2e-5
        while True:
            if self._hdr[_CLOSED]:
                raise RingClosedError(f"ring at {self.path} was closed by its consumer")
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                got = self._try_reserve_locked(total, desc_len)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if got is not None:
                return got
            if deadline is not None and time.monotonic() >= deadline:
                raise RingFullError(
                    f"ring at {self.path}: a {total}-byte record found {self.free_bytes()} of "
                    f"{self.capacity} bytes free for {timeout} s; the consumer is not keeping up"
                )
            if delay >= 1e-3:  # waited a while: is anyone still reading?
                self._check_consumer()
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _try_reserve_locked(self, total: int, desc_len: int) -> tuple[int, int] | None:
        hdr, cap = self._hdr, self.capacity
        head, tail = int(hdr[_HEAD]), int(hdr[_TAIL])
        pos = head % cap
        if total > cap - pos:  # no wrapping records: pad to the end of the ring first
            pad = cap - pos
            if cap - (head - tail) < pad:
                return None
            self._write_header(pos, seq=0, total=pad, kind=_KIND_PAD, desc_len=0)
            head += pad
            hdr[_HEAD] = head
            pos = 0
        if cap - (head - tail) < total:
            return None
        seq = int(hdr[_NEXT_SEQ])
        self._write_header(pos, seq=seq, total=total, kind=_KIND_DATA, desc_len=desc_len)
        hdr[_NEXT_SEQ] = seq + 1
        hdr[_HEAD] = head + total  # last: the reservation becomes visible complete
        return pos, seq

    def _write_header(self, pos: int, *, seq: int, total: int, kind: int, desc_len: int) -> None:
        """Write a record header at slot `pos`, commit word 0 first, stamped with this producer's pid.

        Args:
            pos: the record's byte offset within the ring's data area (`head % capacity`).
            seq: the record's sequence number (the commit word becomes `seq + 1`); 0 for a pad.
            total: the record's length in bytes, header included, a multiple of `ALIGN`.
            kind: `_KIND_DATA` (a record) or `_KIND_PAD` (filler to the end of the ring, skipped by `get`).
            desc_len: the JSON descriptor's length in bytes at the payload's start; 0 for a pad.
        """
        h = self._rec_header(pos)
        h[_R_COMMIT] = 0  # first: whatever an earlier lap left here must not read as committed
        h[_R_SEQ], h[_R_TOTAL], h[_R_PID], h[_R_START] = seq, total, self._pid, self._start
        h[_R_DESC], h[_R_CRC] = desc_len, 0
        h[_R_KIND] = kind

    def _write_payload(self, pos: int, desc: bytes, parts: list[tuple[int, np.ndarray]], total: int) -> None:
        base = HEADER_BYTES + pos + REC_HDR
        self._buf[base : base + len(desc)] = np.frombuffer(desc, dtype=np.uint8)
        for off, arr in parts:
            raw = arr.view(np.uint8)
            self._buf[base + off : base + off + raw.size] = raw

    def _commit(self, pos: int, seq: int, total: int) -> None:
        h = self._rec_header(pos)
        if self.checksum:
            start = HEADER_BYTES + pos + REC_HDR
            h[_R_CRC] = zlib.crc32(self._buf[start : HEADER_BYTES + pos + total])
        h[_R_COMMIT] = seq + 1  # last store of the record

    def _check_consumer(self) -> None:
        if self._hdr[_CLOSED]:
            raise RingClosedError(f"ring at {self.path} was closed by its consumer")
        if not process_alive(int(self._hdr[_CPID]), int(self._hdr[_CSTART])):
            raise RingClosedError(f"ring at {self.path}: consumer pid {int(self._hdr[_CPID])} died")
        try:
            replaced = os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:
            raise RingClosedError(f"ring at {self.path} was removed or replaced by a new run; re-attach")

    # ---------------------------------------------------------------- consumer
    def get(self, timeout: float | None = 0.0) -> RingRecord | None:
        """Next committed record in reservation order, or None after `timeout` s (None: wait)."""
        if not self.consumer:
            raise RingError("ShmRing.get: only the process that created the ring consumes it")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while True:
            rec = self._poll()
            if rec is not None:
                return rec
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def get_trajectory(self, timeout: float | None = 0.0) -> Trajectory | None:
        """Next record as a Trajectory that owns its arrays (copied out; the slot is released)."""
        rec = self.get(timeout)
        if rec is None:
            return None
        with rec:
            return Trajectory.from_arrays(rec.copy_arrays())

    def _poll(self) -> RingRecord | None:
        while True:
            if self._read == int(self._hdr[_HEAD]):
                return None
            pos = self._read % self.capacity
            h = self._rec_header(pos)
            kind, total = int(h[_R_KIND]), int(h[_R_TOTAL])
            if kind not in (_KIND_DATA, _KIND_PAD) or total < REC_HDR or total % ALIGN or pos + total > self.capacity:
                raise RingError(f"ring at {self.path}: bad record header at offset {self._read} (protocol violation)")
            if kind == _KIND_PAD:
                self._skip(total)
                continue
            seq = int(h[_R_SEQ])
            if int(h[_R_COMMIT]) == seq + 1:
                if self.checksum and not self._crc_ok(pos, h, seq, total):
                    if self._read in self._crc_wait:
                        return None  # bytes not visible yet on a weakly ordered CPU: look again
                    continue
                return self._read_record(pos, h, seq, total)
            if not self._writer_dead(pos, h):
                return None
            log.warning(
                "ring %s: producer pid %d died before committing record %d; skipped", self.path, int(h[_R_PID]), seq
            )
            self.skipped_dead += 1
            self._skip(total)

    def _crc_ok(self, pos: int, h: np.ndarray, seq: int, total: int) -> bool:
        """crc32 check; a mismatch is retried for 0.5 s (late-visible stores), then skipped."""
        start = HEADER_BYTES + pos + REC_HDR
        if zlib.crc32(self._buf[start : HEADER_BYTES + pos + total]) == int(h[_R_CRC]):
            self._crc_wait.pop(self._read, None)
            return True
        first = self._crc_wait.setdefault(self._read, time.monotonic())
        if time.monotonic() - first < 0.5:
            return False
        del self._crc_wait[self._read]
        log.error("ring %s: record %d failed its crc32 for 0.5 s; skipped", self.path, seq)
        self.corrupt += 1
        self._skip(total)
        return False

    def _read_record(self, pos: int, h: np.ndarray, seq: int, total: int) -> RingRecord:
        start = HEADER_BYTES + pos + REC_HDR
        desc_len = int(h[_R_DESC])
        desc = json.loads(bytes(self._buf[start : start + desc_len]))
        arrays: dict[str, np.ndarray] = {}
        for name, dtype, count, off in desc:
            dt = np.dtype(dtype)
            view = self._buf[start + off : start + off + count * dt.itemsize].view(dt)
            view.flags.writeable = False
            arrays[name] = view
        entry = [total, False]
        self._outstanding.append(entry)
        self._read += total
        self.records_read += 1
        return RingRecord(self, seq, int(h[_R_PID]), arrays, total, entry)

    def _writer_dead(self, pos: int, h: np.ndarray) -> bool:
        """Liveness of the reserving producer, checked at most every 5 ms per slot (it reads /proc)."""
        now = time.monotonic()
        if self._dead_check[0] == self._read and now - self._dead_check[1] < 5e-3:
            return False
        self._dead_check = (self._read, now)
        return not process_alive(int(h[_R_PID]), int(h[_R_START]))

    def _skip(self, total: int) -> None:
        self._read += total
        self._outstanding.append([total, True])
        self._advance_tail()

    def _release(self, entry: list) -> None:
        entry[1] = True
        self._advance_tail()

    def _advance_tail(self) -> None:
        freed = 0
        while self._outstanding and self._outstanding[0][1]:
            freed += self._outstanding.popleft()[0]
        if freed:
            self._hdr[_TAIL] = int(self._hdr[_TAIL]) + freed

    def stats(self) -> dict[str, float]:
        """Consumer-side metrics (namespaced for the run's logger)."""
        used = int(self._hdr[_HEAD]) - int(self._hdr[_TAIL])
        return {
            "replay/ring_used_frac": used / self.capacity,
            "replay/ring_records_read": float(self.records_read),
            "replay/ring_skipped_dead": float(self.skipped_dead),
            "replay/ring_corrupt": float(self.corrupt),
        }

    def _rec_header(self, pos: int) -> np.ndarray:
        return self._buf[HEADER_BYTES + pos : HEADER_BYTES + pos + REC_HDR].view(np.uint64)


class _NotReady(Exception):
    """The segment exists but its creator has not finished initialising it."""


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: fault every page in now, not on the first lap of 64 MiB records
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _read_header(fd: int) -> np.ndarray:
    return np.frombuffer(os.pread(fd, HEADER_BYTES, 0), dtype=np.uint64)


def remove_if_stale(path: str) -> bool:
    """Unlink `path` if it is a ring segment of a dead run; False (and untouched) if it is live."""
    try:
        _remove_if_stale(path)
    except RingInUseError:
        return False
    return not os.path.exists(path)


def _remove_if_stale(path: str) -> None:
    """Unlink a leftover segment of a crashed run; refuse a live one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        hdr = _read_header(fd) if os.fstat(fd).st_size >= HEADER_BYTES else None
    finally:
        os.close(fd)
    if hdr is not None and not hdr[_CLOSED] and process_alive(int(hdr[_CPID]), int(hdr[_CSTART])):
        raise RingInUseError(f"ring at {path} is in use by live process {int(hdr[_CPID])}; pick another ring_name")
    why = "invalid header" if hdr is None or hdr[_MAGIC] != MAGIC else f"creator pid {int(hdr[_CPID])} is gone"
    log.warning("replacing stale ring segment %s (%s)", path, why)
    os.unlink(path)


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[tuple[int, np.ndarray]], int]:
    """Descriptor (JSON: name, dtype, count, offset from payload start), arrays and total bytes."""
    if not arrays:
        raise ValueError("ShmRing.put: a record needs at least one array")
    items = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if not isinstance(name, str) or a.ndim != 1 or a.dtype.hasobject:
            raise ValueError(
                f"ShmRing.put: field {name!r} must be a str-named 1-D array of a fixed dtype, "
                f"got {a.dtype} ndim={a.ndim}"
            )
        items.append((name, a))
    # the descriptor's length shifts the offsets: bound it (ints <= 20 digits, separators)
    off = _align(2 + sum(len(json.dumps(n)) + len(a.dtype.str) + 50 for n, a in items))
    desc_rows, parts = [], []
    for name, a in items:
        desc_rows.append([name, a.dtype.str, int(a.size), off])
        parts.append((off, a))
        off = _align(off + a.nbytes)
    desc = json.dumps(desc_rows).encode("utf-8")
    assert len(desc) <= parts[0][0], "descriptor bound"
    return desc, parts, REC_HDR + off
