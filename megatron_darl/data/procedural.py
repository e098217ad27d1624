"""Procedural prompt sources from `reasoning-gym` (chain_sum, basic_arithmetic, gsm_symbolic and
any other registered dataset), seeded, with the dataset's own `score_answer` as the verifier.

What it is: `ProceduralSource` (entries generated on demand: a 100k-prompt epoch costs nothing
up front) and `ProceduralVerifier`, which re-creates an entry from the JSON answer payload
`{"dataset", "config", "index", "entry"}` in any process and scores an answer string with it.
What it is not: answer extraction from a model response (`<answer>` tags, last number): the
reward function passes the extracted answer string.

Scores are the dataset's own: 1.0 for a correct answer; chain_sum and basic_arithmetic give 0.0
to a wrong one, gsm_symbolic gives 0.01 to a wrong number (format credit) and 0.0 to text
without a number. A binary reward is `score >= 1.0`.
"""

from __future__ import annotations

from typing import Any

from megatron_darl.data.api import DataReport, PromptRecord, json_safe

EVAL_SEED_OFFSET = 1_000_003  # eval split: same task, seed + this offset (another stream of entries)


def _plain(value: Any) -> Any:
    """dataset_kwargs as plain Python (OmegaConf containers -> dict/list); lists stay lists."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def _create(dataset: str, config: dict[str, Any]):
    import reasoning_gym  # heavy import (100+ datasets register), only when a procedural source is used

    from megatron_darl.data.word_problems import register

    register()  # the project's own dataset, in every process that creates or grades one
    try:
        return reasoning_gym.create_dataset(dataset, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning_gym:{dataset} rejected data.dataset_kwargs {config}: {e}") from e


class ProceduralSource:
    """`size` entries of one reasoning-gym dataset, generated from `seed`; entry i is the same
    in every process (reasoning-gym seeds each entry from seed + i)."""

    task = "procedural"
    lazy = True  # entries are generated when drawn: the loader checks them then, not all at start

    def __init__(self, dataset: str, *, size: int, seed: int, dataset_kwargs: dict[str, Any] | None = None):
        kwargs = _plain(dict(dataset_kwargs or {}))
        for reserved in ("seed", "size"):
            if reserved in kwargs:
                raise ValueError(f"data.dataset_kwargs.{reserved}: set data.{reserved} instead")
        self.dataset = dataset
        self.config = json_safe({**kwargs, "seed": seed, "size": size})
        self._ds = _create(dataset, self.config)
        self.name = f"reasoning_gym:{dataset}[seed={seed},size={size}]"
        self.report = DataReport(source=self.name, rows=size)

    def __len__(self) -> int:
        return self.config["size"]

    def record(self, index: int) -> PromptRecord:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: index {index} out of range")
        entry = self._ds[index]
        # lossy: metadata may hold Fractions; graders re-create the entry, the payload copy is informative
        safe_entry = json_safe({k: entry[k] for k in ("question", "answer", "metadata")}, lossy=True)
        answer = {"dataset": self.dataset, "config": self.config, "index": index, "entry": safe_entry}
        metadata = {k: v for k, v in safe_entry["metadata"].items() if isinstance(v, (str, int, float))}
        metadata["source"] = self.name
        return PromptRecord(
            question=entry["question"],
            task=self.task,
            answer=answer,
            metadata=metadata,
            where=f"{self.name}[{index}]",
        )


class ProceduralVerifier:
    """Scores answers to procedural prompts from their JSON payload alone, in any process.

    The entry is re-generated from (dataset, config, index) rather than trusted from the payload:
    reasoning-gym graders may read metadata in its original Python types (tuples), and a changed
    reasoning-gym version that generates a different entry is caught (ValueError) instead of
    grading against the wrong question. Datasets are cached per (dataset, config) in the instance.
    """

    def __init__(self) -> None:
        self._datasets: dict[str, Any] = {}

    def _dataset(self, dataset: str, config: dict[str, Any]):
        key = f"{dataset}:{sorted(config.items())}"
        if key not in self._datasets:
            self._datasets[key] = _create(dataset, dict(config))
        return self._datasets[key]

    def entry(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            dataset, config, index = payload["dataset"], payload["config"], int(payload["index"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"procedural answer payload lacks {e}; keys: {sorted(payload)}") from e
        entry = self._dataset(dataset, config)[index]
        expected = payload.get("entry", {}).get("question")
        if expected is not None and entry["question"] != expected:
            raise ValueError(
                f"reasoning_gym:{dataset}[{index}] re-created a different question than the payload "
                f"({entry['question']!r} != {expected!r}); is reasoning-gym the same version everywhere?"
            )
        return entry

    def score(self, payload: dict[str, Any], answer: str | None) -> float:
        """The dataset's `score_answer(answer, entry)`: 1.0 correct, lower otherwise."""
        entry = self.entry(payload)
        return float(self._dataset(payload["dataset"], payload["config"]).score_answer(answer, entry))
