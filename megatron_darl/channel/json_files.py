"""Small JSON files that two processes share: written whole, renamed into place, read by polling.

What it is: `write_json_atomic(path, obj)` (a temporary file in the same folder, fsync, then
`os.replace`, which is atomic on POSIX, so a reader sees the old content or the new, never a torn
write) and `read_json(path)` (None while the file does not exist). Every file of the channel that
is not the ring buffer (weight notice and status, transfer requests, engine announcements, run
info, markers) goes through them.
What it is not: a lock or a queue; the last writer wins.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_json_atomic(path: str, obj: Any) -> None:
    """Write `obj` as JSON to `path` via temp file + fsync + rename (readers never see a torn file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, separators=(",", ":"), sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: str) -> Any | None:
    """The JSON content of `path`, or None when the file does not exist (yet)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # cannot be a torn write (we rename whole files): someone else wrote this file
        raise ValueError(f"{path}: not a valid JSON notice ({exc})") from None
