"""Whether the ring buffer fits in this node's shared memory, checked before a run starts.

What it is: `shm_space_problem(ring_bytes)`: None when `ring.size_bytes` (plus the ring's
header) fits in the free space of the folder the ring is created in (/dev/shm), else a message
naming the two settings that fix it: the container's shared memory (`docker run --shm-size`,
64 MB by Docker's default) or a smaller `ring.size_bytes` that fits.
What it is not: the ring (shm_ring.py), which reserves its pages when it is created: this check
only turns that later "No space left on device" into a message that says what to change.
"""

from __future__ import annotations

import os

from megatron_darl.channel.shm_ring import HEADER_BYTES, segment_path

MIB = 1 << 20
MIN_RING_BYTES = 1 << 16  # RingConfig's own lower bound


def shm_space_problem(ring_bytes: int, directory: str | None = None) -> str | None:
    """Why a ring of `ring_bytes` cannot be created in `directory` (default: where the ring goes)."""
    directory = directory or os.path.dirname(segment_path("ring"))
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if ring_bytes + HEADER_BYTES <= free:
        return None
    smaller = MIN_RING_BYTES
    while smaller * 2 + HEADER_BYTES <= free // 2:  # half the free space: room for the weights
        smaller *= 2
    fix = (f"set a smaller ring.size_bytes (e.g. ring.size_bytes={smaller})" if smaller + HEADER_BYTES <= free
           else f"free some of {directory}")
    need_mb = -(-(ring_bytes + HEADER_BYTES) * 2 // MIB)  # the ring and as much again for the rest
    return (f"ring.size_bytes={ring_bytes} ({ring_bytes / MIB:.0f} MiB) does not fit in {directory}: "
            f"{free / MIB:.0f} MiB free of {total / MIB:.0f} MiB. Give this machine more shared memory "
            f"(in a container: docker run --shm-size={need_mb}m ...) or {fix}")
