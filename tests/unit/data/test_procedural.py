"""Procedural sources are seeded and deterministic; their verifier (the dataset's own
score_answer) works from the JSON payload alone, also in another process."""

import json
import subprocess
import sys

import pytest

from megatron_darl.data.procedural import ProceduralSource, ProceduralVerifier

DATASETS = ("chain_sum", "basic_arithmetic", "gsm_symbolic")


@pytest.mark.parametrize("name", DATASETS)
def test_seeded_and_deterministic(name):
    a, b = ProceduralSource(name, size=20, seed=7), ProceduralSource(name, size=20, seed=7)
    c = ProceduralSource(name, size=20, seed=8)
    qa = [a.record(i).question for i in range(20)]
    assert qa == [b.record(i).question for i in range(20)]
    assert qa != [c.record(i).question for i in range(20)]
    r = a.record(3)
    assert r.task == "procedural" and r.where == f"{a.name}[3]" and json.loads(json.dumps(r.answer)) == r.answer


@pytest.mark.parametrize("name", DATASETS)
def test_verifier_scores_right_and_wrong(name):
    src, v = ProceduralSource(name, size=10, seed=1), ProceduralVerifier()
    for i in range(10):
        payload = src.record(i).answer
        truth = payload["entry"]["answer"]
        assert v.score(payload, truth) == 1.0
        wrong = str(int(float(truth)) + 1)
        # gsm_symbolic gives 0.01 format credit to a wrong number; the others give 0
        assert v.score(payload, wrong) == (0.01 if name == "gsm_symbolic" else 0.0)
        assert v.score(payload, "no idea") == 0.0 and v.score(payload, None) == 0.0


def test_dataset_kwargs_shape_the_task():
    kwargs = {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}
    src = ProceduralSource("chain_sum", size=50, seed=0, dataset_kwargs=kwargs)
    for i in range(50):
        expr = src.record(i).metadata["expression"]
        terms = expr.replace("-", "+").split("+")
        assert len(terms) == 3 and all(len(t.strip()) == 2 for t in terms), expr
    with pytest.raises(ValueError, match="data.seed"):
        ProceduralSource("chain_sum", size=5, seed=0, dataset_kwargs={"seed": 3})
    with pytest.raises(ValueError, match="reasoning_gym:chain_sum rejected data.dataset_kwargs"):
        ProceduralSource("chain_sum", size=5, seed=0, dataset_kwargs={"no_such_arg": 1})


def test_verifier_catches_a_payload_that_does_not_match():
    payload = ProceduralSource("chain_sum", size=5, seed=0).record(2).answer
    tampered = {**payload, "index": 3}
    with pytest.raises(ValueError, match="different question"):
        ProceduralVerifier().score(tampered, "1")
    with pytest.raises(ValueError, match="lacks"):
        ProceduralVerifier().score({"dataset": "chain_sum"}, "1")


def test_verifier_in_another_process():
    """The payload alone (as JSON) is enough for a grader in a fresh process."""
    src = ProceduralSource("basic_arithmetic", size=5, seed=11, dataset_kwargs={"max_terms": 3})
    payloads = [src.record(i).answer for i in range(5)]
    answers = [p["entry"]["answer"] for p in payloads[:3]] + ["0.5", "nope"]
    code = (
        "import json,sys\nfrom megatron_darl.data.procedural import ProceduralVerifier\n"
        "d=json.load(sys.stdin); v=ProceduralVerifier()\n"
        "print(json.dumps([v.score(p,a) for p,a in zip(d['p'],d['a'])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps({"p": payloads, "a": answers}),
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1.0, 1.0, 1.0, 0.0, 0.0]
