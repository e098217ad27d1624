"""Telemetry: JSONL and ledger rows per step, histograms every N steps, rollback on resume."""

import json

import numpy as np

from megatron_darl.trainer.telemetry import Telemetry


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rows_histograms_and_resume_rollback(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Telemetry(str(tmp_path), 6, progress=False, histogram_every=2)
    for step in range(5):
        t.log(step, {"train/loss": 0.5 - step / 10, "replay/staleness_hist": np.arange(3) + step,
                     "algo/nan": float("nan")})
        t.record_trained(step, [10 * step, 10 * step + 1])
    t.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[2]["train/loss"] == 0.3
    assert rows[0]["algo/nan"] == "nan"  # kept, not dropped
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Histograms("replay/staleness_hist")] == [0, 2, 4]
    assert len(acc.Scalars("train/loss")) == 5

    # a run resumed from the checkpoint of step 3 redoes steps 3.. : their rows are rolled back
    t = Telemetry(str(tmp_path), 6, start_step=3, progress=False, tensorboard=False)
    t.record_trained(3, [99])
    t.close()
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [r["prompt_ids"] for r in _rows(tmp_path / "trained_prompts.jsonl")] == [[0, 1], [10, 11], [20, 21], [99]]
