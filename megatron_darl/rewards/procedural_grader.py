"""Procedural tasks (reasoning-gym) scored by their own dataset's verifier.

What it is: `grade_procedural(response, payload)` extracts the response's `<answer>...</answer>`
(reasoning-gym's convention; the whole response when there is no tag) and scores it with the
dataset's own verifier, from the JSON payload alone, in any process. Two payload forms:
  {"dataset", "config", "index", "entry"}  what the data role's ProceduralSource emits: the entry
      is re-created from (dataset, config, index) by data.procedural.ProceduralVerifier, exact
      even where metadata held types JSON loses (Fractions)
  {"dataset", "entry"}  an entry given whole (`procedural_payload`): the dataset's
      `score_answer`, looked up by name, reads the JSON copy
What it is not: a prompt source (the data role builds the prompts) or a math grader: the score
is whatever the dataset's verifier says, partial credit included (0.0 .. 1.0).
"""

from __future__ import annotations

import json
from typing import Any

ANSWER_TAG = "answer"


def to_jsonable(value: Any) -> Any:
    """JSON round trip: tuples become lists, as they will after crossing into a worker."""
    return json.loads(json.dumps(value))


def procedural_payload(dataset: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The RewardInput.answer payload for one reasoning-gym entry of `dataset`."""
    missing = [k for k in ("question", "answer", "metadata") if k not in entry]
    if missing:
        raise ValueError(f"procedural_payload({dataset!r}): entry lacks keys {missing}")
    return {"dataset": dataset, "entry": to_jsonable(dict(entry))}


def extract_answer(response: str) -> str:
    """The last <answer>...</answer> of the response, else the stripped response."""
    from reasoning_gym.utils import extract_answer as rg_extract

    found = rg_extract(response, tag_name=ANSWER_TAG)
    return found if found is not None else response.strip()


def grade_procedural(response: str, payload: dict[str, Any], verifier: Any = None) -> float:
    """Score `response` with the verifier of payload["dataset"]. `verifier` is a
    data.procedural.ProceduralVerifier to reuse (it caches the re-created datasets)."""
    answer = extract_answer(response)
    if "config" in payload and "index" in payload:
        from megatron_darl.data.procedural import ProceduralVerifier

        score = float((verifier or ProceduralVerifier()).score(payload, answer))
    else:
        from reasoning_gym.factory import get_score_answer_fn

        for key in ("dataset", "entry"):
            if key not in payload:
                raise ValueError(f"grade_procedural: answer payload lacks {key!r}")
        score_fn = get_score_answer_fn(payload["dataset"])  # ValueError names an unknown dataset
        score = float(score_fn(answer, payload["entry"]))
    if not 0.0 <= score <= 1.0:
        raise ValueError(
            f"grade_procedural: {payload['dataset']} verifier returned {score}, outside [0, 1]"
        )
    return score
