"""Calls into a sandboxed function: values cross as builtin data, nothing the program defines does.

The codec is checked in-process (every builtin value round-trips with its exact type; anything
else is refused). Then a real sandboxed program, along the root path and the user path ("userns":
natively as a user, as root in test_sandbox_user.py): one program serves many calls, a subclass
of int or an object fails the call, the program's prints do not corrupt the channel, a forged
answer it writes on the channel itself is refused, and a call that hangs ends at the wall limit.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from megatron_darl.rewards.sandbox import SandboxLimits
from megatron_darl.rewards.sandbox_calls import CandidateError, SandboxedFunction, decode, encode
from tests.helpers.sandbox import SandboxMode

LIMITS = SandboxLimits(cpu_s=4, wall_s=10, memory_mb=512, max_procs=8, max_file_mb=4)
VALUE = [None, True, 0, -(10**30), 1.5, "é\n", (1, (2, "x")), {1: [2], "k": (3,), (4, 5): None},
         {1, 2}, frozenset({"a"}), b"\x00\xff", complex(1, -2), [[], ()]]


def _crossed(value):
    return decode(json.loads(json.dumps(encode(value))))


def _typed(value):
    """The value with the exact type of every part, for comparisons that `==` would blur (1 == True)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value).__name__, sorted((_typed(x) for x in value), key=repr)
    if isinstance(value, dict):
        return "dict", sorted(((_typed(k), _typed(v)) for k, v in value.items()), key=repr)
    return type(value).__name__, value


def test_builtin_values_cross_with_their_exact_types():
    assert _typed(_crossed(VALUE)) == _typed(VALUE)
    assert math.isnan(_crossed(float("nan"))) and _crossed(float("-inf")) == float("-inf")


@pytest.mark.parametrize("data", [
    {"tuple": [1], "set": [2]},  # two tags
    {"object": []},  # no such tag
    {"dict": [[1]]},  # a pair without its value
    {"dict": [[[1], 2]]},  # a list as a key: unhashable
    {"complex": ["1", 2]},
    {"bytes": 12},
    {"tuple": {"a": 1}},
])
def test_decode_refuses_what_is_not_an_encoded_value(data):
    with pytest.raises((ValueError, TypeError)):
        decode(data)


def test_decode_refuses_a_hash_flood_before_building_it():
    same = [i * (2**61 - 1) for i in range(1, 34)]  # 33 integers, one hash (the naive reference: hash())
    assert len({hash(x) for x in same}) == 1
    assert decode({"set": same[:32]}) == set(same[:32])  # 32 share a hash: still a value
    for data in ({"set": same}, {"frozenset": same}, {"dict": [[x, 0] for x in same]}):
        with pytest.raises(ValueError, match="share one hash"):
            decode(data)
    assert decode({"set": list(range(10000))}) == set(range(10000))
    assert decode({"tuple": same}) == tuple(same)  # a tuple hashes nothing


def test_encode_refuses_objects_and_subclasses():
    for value in (type("I", (int,), {})(3), object(), [type("S", (str,), {})("x")], iter(())):
        with pytest.raises(TypeError):
            encode(value)


@pytest.fixture(params=["namespaces", "userns"])
def sandbox(request) -> SandboxMode:
    mode = SandboxMode(request.param)
    mode.check()
    return mode


SOURCE = '''
import os, sys
class Agree(int):
    def __eq__(self, other):
        return True
def f(kind, x=None):
    print("noise on stdout", flush=True)
    if kind == "pid":
        return os.getpid()
    if kind == "echo":
        return x
    if kind == "subclass":
        return Agree(1)
    if kind == "object":
        return object()
    if kind == "raise":
        raise KeyError("missing")
    if kind == "forge":  # a reply of its own on every descriptor, then a hang
        for fd in range(1, 10):
            try:
                os.write(fd, b'{"value": {"object": 1}}\\n')
            except OSError:
                pass
        import time
        time.sleep(60)
    if kind == "hang":
        while True:
            pass
'''


def test_one_program_serves_every_call_and_only_values_cross(sandbox):
    with SandboxedFunction(SOURCE, "f", LIMITS) as f:
        pids = {f("pid") for _ in range(20)}
        assert len(pids) == 1  # one program for every call
        assert _typed(f("echo", VALUE)) == _typed(VALUE)
        for kind, message in (("subclass", "returned a Agree, not a builtin value"),
                              ("object", "returned a object"), ("raise", "raised KeyError")):
            with pytest.raises(CandidateError, match=message):
                f(kind)
        assert f("echo", 7) == 7  # the program still serves after a failed call
    assert f.result.status == "ok" and "noise on stdout" in f.result.stderr


def test_a_forged_answer_on_the_channel_is_refused(sandbox):
    with SandboxedFunction(SOURCE, "f", LIMITS) as f:
        with pytest.raises(CandidateError, match="not an encoded value|no builtin value"):
            f("forge")


def test_a_call_that_hangs_ends_at_the_wall_limit(sandbox):
    limits = SandboxLimits(cpu_s=30, wall_s=2, memory_mb=512, max_procs=8, max_file_mb=4)
    start = time.monotonic()
    with SandboxedFunction(SOURCE, "f", limits) as f:
        with pytest.raises(CandidateError, match="timeout"):
            f("hang")
    assert f.result.status == "timeout"
    assert time.monotonic() - start < limits.wall_s + 4
    assert sandbox.processes(limits) == []
