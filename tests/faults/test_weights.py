"""Learner side: what the learner publishes is checked finite before any engine loads it.

The probe: an engine accepts a well-formed safetensors file of NaNs (`success: true`) and then
answers with NaN log-probs. The learner must never announce such weights: a publish whose export
holds NaN or Inf raises, naming the tensor and the version, leaves the weight notice as it was
(the engines keep the last good version) and removes the folder. Shown with a stand-in learner
(exact control of which tensor is bad) and with the real Megatron-Core learner, whose parameter
is set to NaN before its real export; and end to end, a `darl-train` run whose learner weights
turn NaN after two steps stops at version 2 naming it and the tensor, with nothing of version 2
published and nothing left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from megatron_darl.channel.ports import free_port
from megatron_darl.channel.weight_notice import read_notice
from megatron_darl.trainer.publication import Publisher
from tests.helpers import repo_env
from tests.helpers.e2e import assert_nothing_left, new_run


class ExportingLearner:
    """Exports an HF-named folder as learner.export_hf does; `poison` names tensors to spoil."""

    is_main = True

    def __init__(self):
        self.poison: dict[str, float] = {}

    def export_hf(self, out: str) -> None:
        torch.manual_seed(0)
        tensors = {"model.embed_tokens.weight": torch.randn(16, 8, dtype=torch.bfloat16),
                   "model.layers.0.mlp.down_proj.weight": torch.randn(8, 8),
                   "model.layers.1.mlp.down_proj.weight": torch.randn(8, 8),
                   "model.norm.weight": torch.ones(8)}
        for name, value in self.poison.items():
            tensors[name].view(-1)[3] = value
        os.makedirs(out, exist_ok=True)
        items = list(tensors.items())
        save_file(dict(items[:2]), os.path.join(out, "model-00001.safetensors"))  # sharded, as the export is
        save_file(dict(items[2:]), os.path.join(out, "model-00002.safetensors"))
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump({"model_type": "qwen3"}, fh)


def publisher(tmp_path, learner) -> Publisher:
    return Publisher(learner, str(tmp_path / "weights"), str(tmp_path / "notice.json"),
                     str(tmp_path / "status.json"), "disk")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"])
def test_non_finite_export_is_not_published_and_names_tensor_and_version(tmp_path, name, bad):
    learner = ExportingLearner()
    pub = publisher(tmp_path, learner)
    pub.publish(1)
    assert read_notice(str(tmp_path / "notice.json")).weights.version == 1
    learner.poison = {name: bad}
    with pytest.raises(RuntimeError) as exc:
        pub.publish(2)
    msg = str(exc.value)
    assert name in msg and "weight version 2" in msg and "not published" in msg, msg
    assert ("1 NaN" if bad != bad else "1 Inf") in msg
    notice = read_notice(str(tmp_path / "notice.json"))
    assert notice.weights.version == 1 and notice.weights.location == pub.folder(1)  # engines keep v1
    assert not os.path.exists(pub.folder(2))  # nothing an engine could load by mistake
    learner.poison = {}
    pub.publish(3)  # a finite export after it publishes again
    assert read_notice(str(tmp_path / "notice.json")).weights.version == 3


class BucketLearner(ExportingLearner):
    """Also gives its tensors as `iter_hf_buckets` does (the distributed path)."""

    def iter_hf_buckets(self):
        out = str(self.folder)
        self.export_hf(out)
        from safetensors.torch import load_file

        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                yield list(load_file(os.path.join(out, f)).items())


class RecordingSender:
    master_address = "127.0.0.1"

    def __init__(self):
        self.staged = []

    def stage(self, version, buckets):
        self.staged.append((version, buckets))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_distributed_stages_only_finite_versions_and_writes_no_file(tmp_path, bad):
    """Checked on the tensors about to be sent (no file is read or written): a poisoned version
    is neither staged for the broadcast nor announced."""
    learner, sender = BucketLearner(), RecordingSender()
    learner.folder = tmp_path / "scratch"
    pub = Publisher(learner, str(tmp_path / "weights"), str(tmp_path / "notice.json"), str(tmp_path / "status.json"),
                    "distributed", sender=sender)
    pub.publish(1)
    notice = read_notice(str(tmp_path / "notice.json"))
    assert notice.weights.weight_sync == "distributed" and notice.weights.version == 1
    assert [v for v, _ in sender.staged] == [1]
    assert os.listdir(tmp_path / "weights") == []  # nothing for an engine to read
    learner.poison = {"model.layers.1.mlp.down_proj.weight": bad}
    with pytest.raises(RuntimeError) as exc:
        pub.publish(2)
    msg = str(exc.value)  # both halves: the tensor and the version, each required
    counts = "1 NaN, 0 Inf" if bad != bad else "0 NaN, 1 Inf"
    assert f"model.layers.1.mlp.down_proj.weight: {counts}" in msg and "weight version 2 " in msg, msg
    assert [v for v, _ in sender.staged] == [1] and read_notice(str(tmp_path / "notice.json")).weights.version == 1
    staged = sender.staged[0][1]
    assert all(torch.isfinite(t.float()).all() for bucket in staged for _, t in bucket)


REAL = r"""
import json, sys
import torch
from megatron_darl.channel.weight_notice import read_notice
from megatron_darl.trainer.publication import Publisher
from tests.helpers.learner_worker import make_learner, tiny_qwen3
work = sys.argv[1]
learner = make_learner(tiny_qwen3(work + "/hf"), 1, 1)
pub = Publisher(learner, work + "/weights", work + "/notice.json", work + "/status.json", "disk")
pub.publish(0)
name, param = [(n, p) for n, p in learner.chunks[0].named_parameters() if "linear_fc2" in n][0]
with torch.no_grad():
    param.view(-1)[5] = float("nan")
try:
    pub.publish(1)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
out = {"error": error, "notice_version": read_notice(work + "/notice.json").weights.version}
learner.close()
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.timeout(300)
def test_real_learner_with_a_nan_parameter_does_not_publish(tmp_path):
    script, result = tmp_path / "real.py", tmp_path / "result.json"
    script.write_text(REAL)
    port = free_port()
    env = repo_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(result)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["error"] is not None, "NaN weights were published"
    # the exported (Hugging Face) name of layer 0's MLP output projection, and the version
    assert "model.layers.0.mlp.down_proj.weight: 1 NaN" in out["error"] and "weight version 1" in out["error"]
    assert out["notice_version"] == 0


# Loaded by every Python process of the run through PYTHONPATH; acts only in the trainer rank: a
# NaN lands in one weight after DARL_TEST_NAN_AT train steps, as a diverging update would put it.
NAN_INJECTION = r"""
import os, sys
if "megatron_darl.trainer" in sys.orig_argv and os.environ.get("DARL_TEST_NAN_AT"):
    import torch
    from megatron_darl.trainer import publication

    at, original = int(os.environ["DARL_TEST_NAN_AT"]), publication.Publisher.publish

    def publish(self, version, *args, **kwargs):
        if version == at:
            name, param = [(n, p) for n, p in self.learner.chunks[0].named_parameters() if "linear_fc2" in n][0]
            with torch.no_grad():
                param.view(-1)[5] = float("nan")
        return original(self, version, *args, **kwargs)

    publication.Publisher.publish = publish
"""


@pytest.mark.timeout(300)
def test_a_run_whose_weights_turn_nan_stops_at_that_version_naming_it(tmp_path, warm_model):
    """A real `darl-train` run (launcher, engine, rollout manager, Megatron-Core learner) whose
    weights hold a NaN after its second step: version 2 is not published, the run stops naming
    the version and the tensor, the engines keep version 1 and nothing is left running."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(NAN_INJECTION)
    env = dict(os.environ, DARL_TEST_NAN_AT="2",
               PYTHONPATH=os.pathsep.join([str(inject), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # weights on disk in the run folder, so that what was (not) published can be read after the run
    run = new_run(tmp_path, warm_model, "nan", train={"steps": 6}, rollout={"weight_sync": "disk"})
    run.env = env
    try:
        run.start()
        code = run.wait(240)
        out = run.output()
        info = run.run_info()
        assert code != 0, out[-4000:]
        assert "weight version 2 (the policy after 2 train steps) has non-finite values in 1 tensor(s): " \
               "model.layers.0.mlp.down_proj.weight: 1 NaN, 0 Inf" in out, out[-4000:]
        assert "It was not published" in out, out[-4000:]
        assert read_notice(info["notice"]).weights.version == 1  # the engines kept version 1
        assert os.path.isdir(os.path.join(info["weights_root"], "v1"))
        assert not os.path.isdir(os.path.join(info["weights_root"], "v2"))
        assert [row["step"] for row in run.ledger()] == [0, 1]  # nothing trained after it
        assert_nothing_left(run, info["run_id"])
    finally:
        run.kill()
