"""Call a function that runs in the sandbox, from trusted code outside it, with data only.

What it is: `SandboxedFunction(source, name, limits)` starts one sandboxed program that runs
`source` (the candidate's code, nothing else) and then serves calls of its function `name`
(or `Solution().name`) over its stdin and stdout; calling the object here sends the arguments
and returns the value the function returned. Both cross as JSON of exactly builtin values
(`encode`, `decode`: None, bool, int, float, str, list, and tagged tuple, dict, set, frozenset,
bytes, complex, recursively), decoded here by `decode`, which builds fresh builtin objects from
parsed JSON: nothing the program defines (a class with an `__eq__` that always agrees, a
subclass of int or str, a generator) can cross, only a value. The tests that call it (HumanEval's
`check`, LiveCodeBench's expected outputs) stay here, out of the program's reach; the program
holds no test, no expected value and no secret. One program serves every call of a grading.
What the program sends back costs this side at most the wall limit: requests are written without
blocking past it (`_send`), a reply is capped at MAX_CAPTURE bytes, and `decode` refuses a set or
dict whose elements share one hash more than MAX_SAME_HASH times (a hash flood) before building it.
What it is not: the sandbox (sandbox.py) nor the grader (code_grader.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from typing import Any

from megatron_darl.rewards.sandbox import (
    MAX_CAPTURE,
    SandboxLimits,
    SandboxRefused,
    SandboxResult,
    _exited,
    collect,
    prepared_run,
    start_launcher,
    stop_launcher,
)

EXIT_GRACE_S = 1.0  # after the last call, how long the program gets to exit by itself
# elements of one decoded set (or keys of one dict) allowed to share a hash: CPython's ints,
# floats and tuples hash alike on purpose-built values, and a set of n of them costs n^2/2 probes
# to build (40,000 in a 1 MB reply: 7 s here); an honest value has next to none
MAX_SAME_HASH = 32
_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex")

# The in-sandbox encoder, one copy for every program that answers over a channel (SERVER here,
# the checker of sandbox_relay.py): builtin values to JSON-able data, tagged as `decode` reads
# them. `WHAT` opens its refusal of any other type (`value_encoder`).
_ENCODER = r'''
    def encode(v, depth=0):
        if depth > 100:
            raise ValueError("value nested too deep")
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t is list:
            return [encode(x, depth + 1) for x in v]
        if t in (tuple, set, frozenset):
            return {t.__name__: [encode(x, depth + 1) for x in v]}
        if t is dict:
            return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
        if t is bytes:
            return {"bytes": v.hex()}
        if t is complex:
            return {"complex": [v.real, v.imag]}
        raise TypeError(f"WHAT a {t.__name__}, not a builtin value")
'''


def value_encoder(what: str) -> str:
    """The in-sandbox `encode`, at one indent, refusing a non-builtin value as "`what` a <type>"."""
    return _ENCODER.strip("\n").replace("WHAT", what)


# The program the sandbox runs: the candidate's code, then a loop that serves calls. Its channel
# is a private copy of stdout; what the candidate prints goes to stderr. Whatever it writes on the
# channel is only data to the trusted side, which decodes it into builtin values.
SERVER = r'''
def _serve():
    import json, os, sys
    channel = os.dup(1)
    os.dup2(2, 1)
    requests = sys.stdin.buffer
ENCODER
    def decode(v):
        if type(v) is list:
            return [decode(x) for x in v]
        if type(v) is dict:
            (tag, x), = v.items()
            if tag == "dict":
                return {decode(k): decode(y) for k, y in x}
            if tag == "bytes":
                return bytes.fromhex(x)
            if tag == "complex":
                return complex(*x)
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(y) for y in x)
        return v
    space = {"__name__": "solution"}
    exec(compile(SOURCE, "solution.py", "exec"), space)
    if "Solution" in space and (CLASS_FIRST or NAME not in space):
        fn = getattr(space["Solution"](), NAME)
    else:
        fn = space[NAME]
    for line in requests:
        args = decode(json.loads(line))
        try:
            reply = {"value": encode(fn(*args))}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        os.write(channel, (json.dumps(reply) + "\n").encode())
_serve()
'''


def printable(text: str) -> str:
    """`text` safe to log and to encode: lone surrogates and control characters escaped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class CandidateError(Exception):
    """The sandboxed function raised, returned something that is not a builtin value, or its
    program ended or ran out of time; `result` is how the program ended, when it did."""

    def __init__(self, message: str, result: SandboxResult | None = None) -> None:
        super().__init__(message)
        self.result = result


def encode(value: Any, depth: int = 0) -> Any:
    """A builtin value as JSON-able data (the arguments of a call)."""
    if depth > 100:
        raise ValueError("encode: value nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(x, depth + 1) for x in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(x, depth + 1) for x in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"encode: a {kind.__name__} is not a builtin value")


def decode(data: Any) -> Any:
    """The value `data` (parsed JSON: exact builtin types) stands for, built here from scratch;
    ValueError for anything else."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(x) for x in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"decode: not an encoded value: {str(data)[:100]}")
    (tag, inner), = data.items()
    if tag not in _TAGS:
        raise ValueError(f"decode: unknown tag {tag[:50]!r}")
    if tag == "bytes":
        if type(inner) is not str:
            raise ValueError("decode: bytes must be hex text")
        return bytes.fromhex(inner)
    if type(inner) is not list:
        raise ValueError(f"decode: {tag} must hold a list")
    if tag == "complex":
        if len(inner) != 2 or not all(type(x) in (int, float) for x in inner):
            raise ValueError("decode: complex must be [real, imag]")
        return complex(inner[0], inner[1])
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in inner):
            raise ValueError("decode: dict must be a list of [key, value] pairs")
        pairs = [(decode(k), decode(v)) for k, v in inner]
        _refuse_hash_flood(k for k, _ in pairs)
        return dict(pairs)
    items = [decode(x) for x in inner]
    if tag != "tuple":
        _refuse_hash_flood(items)
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)


def _refuse_hash_flood(keys) -> None:
    """ValueError where more than MAX_SAME_HASH of the keys share one hash: building the set or
    dict would cost time quadratic in their number (a hash flood); counting costs linear time."""
    counts: dict[int, int] = {}
    for key in keys:
        try:
            h = hash(key)
        except TypeError:
            continue  # unhashable: building the set raises TypeError, a failed call
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise ValueError(f"decode: more than {MAX_SAME_HASH} elements share one hash (a hash flood)")


def server_program(source: str, name: str, class_first: bool = False) -> str:
    """The sandboxed program: `source`, then the loop that serves calls of `name`: the method of
    a `Solution()` where the source defines that class and (unless `class_first`) no `name`."""
    values = {"SOURCE": repr(source), "NAME": repr(name), "CLASS_FIRST": repr(bool(class_first)),
              "ENCODER": value_encoder("the function returned")}
    return re.sub(r"\b(SOURCE|NAME|CLASS_FIRST|ENCODER)\b", lambda m: values[m.group(1)], SERVER)  # one pass


class SandboxedFunction:
    """Function `name` of `source`, run in one sandboxed program for the life of this object
    (a context manager); calls cross as data. Raises SandboxRefused where the sandbox cannot run."""

    def __init__(self, source: str, name: str, limits: SandboxLimits, class_first: bool = False) -> None:
        self.limits = limits
        self._program = server_program(source, name, class_first)
        self._run = None
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.calls = 0
        self.result: SandboxResult | None = None

    def __enter__(self) -> "SandboxedFunction":
        self._run = prepared_run(self._program, "", self.limits, True)
        paths = self._run.__enter__()
        self._paths = paths
        self._start = time.monotonic()
        self._deadline = self._start + self.limits.wall_s
        try:
            self._proc = start_launcher(paths, subprocess.PIPE, subprocess.PIPE)
            os.set_blocking(self._proc.stdin.fileno(), False)  # writes wait in `_send`, under the deadline
        except BaseException:
            self._run.__exit__(None, None, None)
            raise
        return self

    def __call__(self, *args: Any) -> Any:
        if self.result is not None:
            raise CandidateError(f"the program had ended: {self.result.status}", self.result)
        self.calls += 1
        self._send((json.dumps(encode(list(args))) + "\n").encode())
        reply = self._reply()
        if type(reply) is not dict or len(reply) != 1 or not ({"value", "error"} & set(reply)):
            raise CandidateError("the program answered something other than a value or an error")
        if "error" in reply:
            raise CandidateError(f"the function raised {printable(str(reply['error'])[:300])}")
        try:
            return decode(reply["value"])
        except (ValueError, TypeError, RecursionError) as e:
            raise CandidateError(f"the function returned no builtin value: {e}") from None

    def _send(self, request: bytes) -> None:
        """Write the request without blocking past the wall limit: a program that stops reading,
        shrinks its stdin pipe or fills it itself (/proc/self/fd/0) holds us until then, no more."""
        fd = self._proc.stdin.fileno()
        view = memoryview(request)
        while view:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                self._ended("timeout", timed_out=True)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError:  # EPIPE: it exited
                self._ended("the program exited before the call")

    def _reply(self) -> Any:
        """The next line the program wrote on its channel, parsed; CandidateError past the wall
        limit, at the end of the program, or past MAX_CAPTURE bytes."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._ended("timeout", timed_out=True)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._ended("the program exited during the call")
            self._buf += chunk
            if len(self._buf) > MAX_CAPTURE:
                raise CandidateError(f"the program's answer passed {MAX_CAPTURE} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            raise CandidateError("the program answered something that is not JSON") from None

    def _ended(self, why: str, timed_out: bool = False) -> None:
        """Collect how the program ended (SandboxRefused where it never ran); always raises."""
        self._finish(timed_out)
        raise CandidateError(f"{why}: {self.result.status} (exit {self.result.returncode})", self.result)

    def _finish(self, timed_out: bool = False) -> SandboxResult:
        """End the program (its stdin closed: the serving loop ends; past a short grace, or at
        once after a timeout, the launcher is stopped) and collect how it ended."""
        if self.result is not None:
            return self.result
        proc = self._proc
        try:
            proc.stdin.close()
        except OSError:
            pass
        if not timed_out and not _exited(proc, min(EXIT_GRACE_S, max(0.0, self._deadline - time.monotonic()))):
            timed_out = time.monotonic() >= self._deadline
        stop_launcher(proc)
        proc.stdout.close()
        self.result = collect(self._paths, proc.returncode, timed_out, time.monotonic() - self._start)
        return self.result

    def __exit__(self, *exc) -> None:
        try:
            if self._proc is not None:
                self._finish()
        except SandboxRefused:
            if exc[0] is None:
                raise
        finally:
            self._run.__exit__(None, None, None)
