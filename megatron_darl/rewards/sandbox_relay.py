"""HumanEval's test in a sandbox of its own, beside the candidate's; the worker only relays lines.

What it is: `run_checked(candidate_source, entry, prompt, test, limits)` starts two sandboxed
programs at once: the candidate (sandbox_calls.SERVER: its code, then a loop serving calls) and
the checker (CHECKER: the problem's prompt and test, and a proxy `candidate` that sends each call
on its channel and decodes the reply). The worker passes length-capped lines between the two with
non-blocking reads and writes under one deadline (the wall limit), never parses what the
candidate sends, and takes pass or fail only from the checker's channel: a line "P" (check
returned) or "F" + the error as JSON text. A hostile or heavy test, a hash flood in a reply or a
blocked pipe spends the sandboxes' limits, not the worker's: the test runs with no more rights
than the candidate, and with the standard library only (its Python starts without site-packages).
What it is not: the sandbox (sandbox.py), nor the value codec of the functional format
(sandbox_calls.py), whose trusted side compares JSON values itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import time

from megatron_darl.rewards.sandbox import (
    MAX_CAPTURE,
    SandboxLimits,
    SandboxResult,
    _exited,
    collect,
    prepared_run,
    start_launcher,
    stop_launcher,
)
from megatron_darl.rewards.sandbox_calls import (
    EXIT_GRACE_S,
    MAX_SAME_HASH,
    printable,
    server_program,
    value_encoder,
)

# The checker: the prompt (helpers such as `encode_cyclic`; a bare signature gets a body) and the
# test, calling a proxy. Its channel is a private copy of stdout; the test's prints go to stderr.
CHECKER = r'''
def _check():
    import json, os, sys
    channel = os.dup(1)
    os.dup2(2, 1)
    replies = sys.stdin.buffer
ENCODER
    def flood(keys):
        counts = {}
        for k in keys:
            h = hash(k)
            counts[h] = counts.get(h, 0) + 1
            if counts[h] > MAX_SAME_HASH:
                raise ValueError("the candidate returned a set whose elements share one hash")
    def decode(v):
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t is list:
            return [decode(x) for x in v]
        if t is not dict or len(v) != 1:
            raise ValueError("the candidate returned no encoded value")
        (tag, x), = v.items()
        if tag == "bytes":
            return bytes.fromhex(x)
        if tag == "complex":
            if len(x) != 2 or not all(type(y) in (int, float) for y in x):
                raise ValueError("complex must be [real, imag]")
            return complex(x[0], x[1])
        if tag == "dict":
            pairs = [(decode(k), decode(y)) for k, y in x]
            flood(k for k, _ in pairs)
            return dict(pairs)
        if tag not in ("tuple", "set", "frozenset") or type(x) is not list:
            raise ValueError("the candidate returned no encoded value")
        items = [decode(y) for y in x]
        if tag != "tuple":
            flood(items)
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    class CandidateError(Exception):
        pass
    def candidate(*args):
        os.write(channel, b"C" + json.dumps(encode(list(args))).encode() + b"\n")
        line = replies.readline()
        if not line:
            raise SystemExit(3)
        reply = json.loads(line)
        if type(reply) is not dict or len(reply) != 1 or not ({"value", "error"} & set(reply)):
            raise CandidateError("the program answered something other than a value or an error")
        if "error" in reply:
            raise CandidateError(f"the function raised {str(reply['error'])[:300]}")
        return decode(reply["value"])
    space = {"__name__": "humaneval_test"}
    prompt = PROMPT
    try:
        compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        prompt = prompt.rstrip() + "\n" + BODY_INDENT + "    pass\n"
    exec(compile(prompt + "\n\n" + TEST, "test.py", "exec"), space)
    if not callable(space.get("check")):
        raise SystemExit("the humaneval test defines no check()")
    space[ENTRY] = candidate
    try:
        space["check"](candidate)
    except CandidateError as e:
        os.write(channel, b"F" + json.dumps(str(e)[:400]).encode() + b"\n")
        return
    except Exception as e:
        os.write(channel, b"F" + json.dumps(f"{type(e).__name__} {e}"[:400]).encode() + b"\n")
        return
    os.write(channel, b"P\n")
_check()
'''


def checker_program(prompt: str, test: str, entry: str) -> str:
    """The checker's source for one problem (values substituted in one pass)."""
    last_def = re.search(r"^([ \t]*)def\s[^\n]*$(?![\s\S]*^[ \t]*def\s)", prompt, re.MULTILINE)
    values = {"PROMPT": repr(prompt), "TEST": repr(test), "ENTRY": repr(entry),
              "MAX_SAME_HASH": repr(MAX_SAME_HASH), "BODY_INDENT": repr(last_def.group(1) if last_def else ""),
              "ENCODER": value_encoder("the test passed")}
    return re.sub(r"\b(PROMPT|TEST|ENTRY|MAX_SAME_HASH|BODY_INDENT|ENCODER)\b", lambda m: values[m.group(1)], CHECKER)


class _Side:
    """One sandboxed program of the pair: its launcher, pipes made non-blocking, line buffers."""

    def __init__(self, paths: dict) -> None:
        self.paths = paths
        self.proc = start_launcher(paths, subprocess.PIPE, subprocess.PIPE)
        self.out, self.inp = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        os.set_blocking(self.out, False)
        os.set_blocking(self.inp, False)
        self.read_buf = b""
        self.write_buf = b""
        self.eof = False
        self.result: SandboxResult | None = None

    def pump(self, readable: list, writable: list) -> list[bytes]:
        """Move what can move without blocking; the complete lines read (each capped)."""
        if self.inp in writable and self.write_buf:
            try:
                self.write_buf = self.write_buf[os.write(self.inp, self.write_buf):]
            except BlockingIOError:
                pass
            except OSError:
                self.write_buf = b""  # it exited: its end shows as EOF on its output
        if self.out in readable:
            try:
                chunk = os.read(self.out, 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                self.eof = True
            elif chunk:
                self.read_buf += chunk
        lines = []
        while b"\n" in self.read_buf:
            line, _, self.read_buf = self.read_buf.partition(b"\n")
            lines.append(line)
        if len(self.read_buf) > MAX_CAPTURE:
            raise _Overflow()
        return lines

    def finish(self, timed_out: bool, deadline: float, start: float) -> SandboxResult:
        if self.result is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            if not timed_out and not _exited(self.proc, min(EXIT_GRACE_S, max(0.0, deadline - time.monotonic()))):
                timed_out = time.monotonic() >= deadline
            stop_launcher(self.proc)
            self.proc.stdout.close()
            self.result = collect(self.paths, self.proc.returncode, timed_out, time.monotonic() - start)
        return self.result


class _Overflow(Exception):
    pass


def run_checked(source: str, entry: str, prompt: str, test: str, limits: SandboxLimits) -> tuple[float, str]:
    """(score, detail) of HumanEval's `check` (run in the checker's sandbox) against `entry` of
    `source` (in the candidate's); SandboxRefused where the sandbox cannot run."""
    with contextlib.ExitStack() as stack:
        cand_paths = stack.enter_context(prepared_run(server_program(source, entry), "", limits, True))
        # the checker's Python skips site-packages: a HumanEval prompt and test need the standard
        # library only, and the second sandbox of an item costs 20 ms less to start
        check_paths = stack.enter_context(
            prepared_run(checker_program(prompt, test, entry), "", limits, True, site=False))
        start = time.monotonic()
        deadline = start + limits.wall_s
        cand = _Side(cand_paths)
        try:
            checker = _Side(check_paths)
        except BaseException:
            cand.finish(True, deadline, start)
            raise
        try:
            return _relay(cand, checker, deadline, start)
        finally:
            for side in (checker, cand):
                side.finish(True, deadline, start)


def _relay(cand: _Side, checker: _Side, deadline: float, start: float) -> tuple[float, str]:
    """Pass lines between the two until the checker's verdict, an end, or the deadline."""
    pending = 0  # calls sent to the candidate and not answered yet
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0, _ended("tests", cand.finish(True, deadline, start), "timeout")
        # read a side only while what it sent the other waits below the cap: a program that
        # writes without end fills its own pipe, not the worker's memory
        reads = [s.out for s, to in ((cand, checker), (checker, cand))
                 if not s.eof and len(to.write_buf) < MAX_CAPTURE]
        writes = [s.inp for s in (cand, checker) if s.write_buf]
        readable, writable, _ = select.select(reads, writes, [], left)
        try:
            for line in checker.pump(readable, writable):
                tag, body = line[:1], line[1:]
                if tag == b"C":
                    cand.write_buf += body + b"\n"
                    pending += 1
                elif tag == b"P":
                    return 1.0, "passed"
                elif tag == b"F":
                    return 0.0, f"tests: {_text(body)}"
                else:
                    return 0.0, "tests: the checker broke its protocol"
            for line in cand.pump(readable, writable):
                checker.write_buf += line + b"\n"
                pending -= 1
        except _Overflow:
            return 0.0, f"tests: a line passed {MAX_CAPTURE} bytes"
        if checker.eof:
            result = checker.finish(False, deadline, start)
            if cand.eof or pending > 0:  # the candidate's end took the checker's with it
                return 0.0, _ended("tests", cand.finish(False, deadline, start), "the program exited during the call")
            return 0.0, _ended("checker", result, "the test ended without a verdict")
        if cand.eof and pending > 0:
            return 0.0, _ended("tests", cand.finish(False, deadline, start), "the program exited during the call")


def _text(body: bytes) -> str:
    try:
        return str(json.loads(body))[:300]
    except (ValueError, RecursionError):
        return "(unreadable)"


def _ended(what: str, result: SandboxResult, why: str) -> str:
    if result.status != "ok":
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        return printable(f"{what}: {result.status} (exit {result.returncode}) {tail[0][:200]}")
    return printable(f"{what}: {why}")
