"""bench/gpu_check.py's CPU side: its arguments, its refusal without a GPU, the parsers of what
its parts print and write, the OOM fallback, the part runner's stop, and the table and JSON built
from given result records. The GPU parts themselves run only on a GPU (docs/development.md,
"Proving a GPU")."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("darl_bench_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_defaults_are_the_three_shapes_and_fit_in_nine_minutes(gc):
    args = gc.parse_args([])
    assert args.shapes == [(8, 1024), (4, 2048), (1, 8192)] and args.parts == ("pytest", "learner", "demo")
    assert args.out == "runs/gpu_check/gpu_check.json" and args.fit_seq == 8192
    # the worst case: every part runs to its limit, then takes the longest stop
    spent = 5.0  # the environment's read before the first part
    for part in args.parts:
        t = gc.part_timeout(part, args, args.budget_s - spent)
        assert t >= gc.MIN_PART_S, part
        spent += t + gc.STOP_S
    assert spent <= 9 * 60, spent
    # with 300 s left, pytest leaves half of the learner's and the demo's limits (120 + 90 s) and a stop
    assert gc.part_timeout("pytest", args, 300.0) == 300 - 120 - 90 - gc.STOP_S
    assert gc.part_timeout("demo", args, 1000.0) == 180  # its own limit, when there is time


def test_arguments_are_read_and_bad_ones_refused(gc):
    args = gc.parse_args(["--parts", "demo,pytest", "--shapes", "2x512, 1X4096", "--demo-steps", "5",
                          "--demo-warmup", "1", "--learner-timeout", "99", "--out", "x/y.json"])
    assert args.parts == ("pytest", "demo")  # run in the check's order, whatever the order given
    assert args.shapes == [(2, 512), (1, 4096)] and args.learner_timeout == 99.0 and args.out == "x/y.json"
    for bad in (["--shapes", "8by1024"], ["--shapes", "0x1024"], ["--parts", "gpu"], ["--parts", ""],
                ["--demo-steps", "3", "--demo-warmup", "3"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            gc.parse_args(bad)
        assert exc.value.code == 2, bad


def test_without_a_gpu_it_refuses_at_once_in_one_line(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, even on a machine with one
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=str(tmp_path))
    assert time.monotonic() - t0 < 60  # no part started: each takes minutes
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU found"), done.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_gpu_test_reads_device_nodes_then_torch(gc, tmp_path, monkeypatch):
    assert "no /dev/nvidia* device" in gc.no_gpu_reason((str(tmp_path / "nvidia[0-9]*"),))
    (tmp_path / "nvidia0").touch()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = gc.no_gpu_reason((str(tmp_path / "nvidia[0-9]*"),))
    assert why.startswith("no CUDA GPU found (torch ") and torch.__version__ in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gc.no_gpu_reason((str(tmp_path / "nvidia[0-9]*"),)) is None


def test_one_gpu_is_picked_from_what_is_visible(gc):
    assert gc.pick_gpu(0, {}) == "0" and gc.pick_gpu(2, {}) == "2"
    assert gc.pick_gpu(1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == "5"
    assert gc.pick_gpu(0, {"CUDA_VISIBLE_DEVICES": ""}) == ""  # none visible stays none
    with pytest.raises(SystemExit, match="names 1 GPUs"):
        gc.pick_gpu(1, {"CUDA_VISIBLE_DEVICES": "3"})


PYTEST_OUT = """\
....s.sF
SKIPPED [1] tests/unit/learner/test_gpu.py:71: needs transformer_engine
SKIPPED [2] tests/unit/learner/test_gpu.py:90: needs 2 GPUs (NCCL forbids two ranks on one GPU)
FAILED tests/unit/algo/test_gpu.py::test_cuda_matches_cpu[kw0] - AssertionError: 0.1 > 1e-05
============ 1 failed, 4 passed, 3 skipped, 1290 deselected, 2 warnings in 84.31s (0:01:24) ============
"""


def test_pytest_counts_and_reasons_are_read_from_its_output(gc):
    got = gc.pytest_counts(PYTEST_OUT)
    assert {k: got[k] for k in ("passed", "failed", "skipped", "errors", "deselected")} == \
        {"passed": 4, "failed": 1, "skipped": 3, "errors": 0, "deselected": 1290}
    assert got["skips"] == ["[1] tests/unit/learner/test_gpu.py:71: needs transformer_engine",
                            "[2] tests/unit/learner/test_gpu.py:90: needs 2 GPUs (NCCL forbids two ranks on one GPU)"]
    assert got["failures"] == [PYTEST_OUT.splitlines()[3]] and got["summary_found"]
    quiet = gc.pytest_counts("..\n2 passed, 1 error in 3.10s\n")
    assert (quiet["passed"], quiet["errors"], quiet["summary_found"]) == (2, 1, True)
    cut = gc.pytest_counts("....s.s\n")  # stopped at its timeout: no closing line
    assert not cut["summary_found"] and cut["passed"] == 0


def test_the_micro_batch_halves_until_it_fits(gc):
    tried = []

    def try_rows(rows):
        tried.append(rows)
        if rows > 2:
            raise gc.OutOfMemory(str(rows))
        return {"rows": rows}

    assert gc.fit_down(8, try_rows) == (2, {"rows": 2}) and tried == [8, 4, 2]
    tried.clear()
    assert gc.fit_down(4, lambda rows: tried.append(rows) or (_ for _ in ()).throw(gc.OutOfMemory())) == (0, None)
    assert tried == [4, 2, 1]


def _bench_line(shapes: dict, fit_seq=None) -> str:
    rows = {k: {"megatron_tokens_per_s": v, "transformers_tokens_per_s": v / 2, "ratio_megatron_vs_transformers": 2.0,
                "megatron_peak_gib": 1.0, "transformers_peak_gib": 2.0} for k, v in shapes.items()}
    return json.dumps({"device": "fake", "shapes": rows, "fit_seq": fit_seq,
                       "fit_rows": {"megatron": None, "transformers": None}})


def test_after_an_oom_each_shape_runs_alone_with_fewer_rows(gc, tmp_path, monkeypatch):
    """The first run (every shape) stops on OOM; then 8x1024 fits at 4 rows, 1x8192 at none."""
    calls = []

    def fake_run(cmd, log, timeout_s, env=None):
        shapes = cmd[cmd.index("--shapes") + 1]
        calls.append((shapes, cmd[cmd.index("--fit-seq") + 1]))
        rows, seq = (int(x) for x in shapes.split(",")[0].split("x"))
        oom = "," in shapes or rows * seq > 4096
        out = "torch.OutOfMemoryError: CUDA out of memory" if oom else _bench_line({shapes: 1000.0 * rows})
        return {"rc": 1 if oom else 0, "timed_out": False, "wall_s": 1.0, "log": str(log), "output": out}

    monkeypatch.setattr(gc, "run_part", fake_run)
    args = gc.parse_args(["--shapes", "8x1024,1x8192"])
    part = gc.learner_part(args, 100, tmp_path)
    assert calls == [("8x1024,1x8192", "8192"), ("8x1024", "0"), ("4x1024", "0"), ("1x8192", "0")]
    assert part["status"] == "ok" and part["wall_s"] == 4.0 and len(part["runs"]) == 4
    assert part["shapes"]["8x1024"]["rows"] == 4 and part["shapes"]["8x1024"]["megatron_tokens_per_s"] == 4000.0
    assert part["shapes"]["1x8192"] == {"rows": 0, "seq": 8192}
    lines = dict((a, c) for a, _, c in gc.learner_lines(part))
    assert lines["learner 8x1024"].endswith("; ran at 4x1024, the most rows that fit")
    assert lines["learner 1x8192"] == "one row of 8192 tokens does not fit"


def test_a_bench_that_fails_otherwise_is_reported_failed(gc, tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "run_part", lambda cmd, log, t, env=None: {
        "rc": 1, "timed_out": False, "wall_s": 2.0, "log": str(log), "output": "ImportError: megatron"})
    part = gc.learner_part(gc.parse_args([]), 100, tmp_path)
    assert part["status"] == "failed" and "see" in part["error"] and part["shapes"] == {}


def test_the_demo_figures_are_medians_after_the_warmup(gc, tmp_path):
    step_s = [9.0, 5.0, 0.5, 0.7, 0.6, 0.9, 0.8]
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for i, s in enumerate(step_s):
            row = {"step": i, "perf/step_s": s, "perf/train_step_s": s / 2, "perf/wait_data_s": "nan"}
            fh.write(json.dumps(row) + "\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "engine0.log").write_text(
        "darl-engine: Qwen3ForCausalLM from /r/demo on weights/v3 on cuda, serving http://127.0.0.1:1\n")
    got = gc.demo_figures(tmp_path, warmup=2)
    assert got["steps"] == 7 and got["timed_steps"] == 5
    assert got["step_s"] == statistics.median(step_s[2:]) == 0.7 and got["train_step_s"] == 0.35
    assert got["wait_data_s"] is None and got["mfu"] is None and got["engine_device"] == "cuda"
    assert gc.demo_figures(tmp_path / "none", warmup=2)["step_s"] is None


def test_the_demo_overrides_are_ones_darl_train_reads(gc, tmp_path):
    from megatron_darl.config import load_config

    args = gc.parse_args(["--demo-steps", "12"])
    cmd = gc.demo_cmd(args, tmp_path / "demo")
    assert cmd[1:5] == ["-m", "megatron_darl", "train", "--config"]
    cfg = load_config(str(ROOT / cmd[5]), cmd[6:])
    assert (cfg.train.steps, cfg.train.run_dir, cfg.checkpoint.every_steps) == (12, str(tmp_path / "demo"), 0)


def test_the_bench_flags_are_learner_steps_own(gc):
    declared = set(re.findall(r'add_argument\("(--[\w-]+)"', (ROOT / "bench" / "learner_step.py").read_text()))
    cmd = gc.learner_cmd(gc.parse_args([]), [(8, 1024)], 0)
    used = {w for w in cmd if w.startswith("--")}
    assert used == {"--shapes", "--steps", "--fit-seq", "--max-rows"} and used <= declared


def test_a_part_past_its_time_is_stopped_with_its_children(gc, tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "GRACE_S", 1)  # SIGTERM is ignored below: SIGKILL follows after 1 s
    marker = tmp_path / "grandchild.pid"
    code = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    run = gc.run_part([sys.executable, "-c", code], tmp_path / "part.log", 4.0)  # time to start on a busy machine
    assert run["timed_out"] and run["rc"] == -9 and time.monotonic() - t0 < 15
    assert "started" in run["output"] and (tmp_path / "part.log").read_text() == run["output"]
    pid = int(marker.read_text())
    for _ in range(50):  # the grandchild was in the part's group: killed with it
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} still running")
    quick = gc.run_part([sys.executable, "-c", "print('hi')"], tmp_path / "q.log", 30)
    assert (quick["rc"], quick["timed_out"], quick["output"]) == (0, False, "hi\n")


RESULT = {
    "started": "2026-11-29T03:00:00Z", "budget_s": 525, "wall_s": 431.6, "ok": False,
    "environment": {"device": "NVIDIA H200", "memory_gib": 139.8, "torch": "2.13.0+cu128", "cuda": "12.8",
                    "transformer_engine": False, "sglang": False, "commit": "abc1234"},
    "parts": {
        "pytest": {"status": "ok", "passed": 5, "failed": 0, "skipped": 9, "errors": 0, "wall_s": 84.3},
        "learner": {"status": "ok", "wall_s": 190.0, "fit_seq": 8192, "fit_rows": {"megatron": 16, "transformers": 8},
                    "shapes": {"8x1024": {
                        "rows": 8, "seq": 1024, "megatron_tokens_per_s": 41234.0, "transformers_tokens_per_s": 28700.0,
                        "ratio_megatron_vs_transformers": 1.4367, "megatron_mfu": 0.3124, "transformers_mfu": 0.2175,
                        "megatron_peak_gib": 30.12, "transformers_peak_gib": 25.2}}},
        "demo": {"status": "timeout", "steps": 20, "timed_steps": 17, "step_s": 0.8412, "train_step_s": 0.311,
                 "wait_data_s": None, "engine_device": "cuda", "wall_s": 150.0},
    },
}


def test_the_table_has_a_row_per_figure(gc):
    lines = gc.table(RESULT).splitlines()
    assert lines[0] == ("NVIDIA H200 (139.8 GiB), torch 2.13.0+cu128, CUDA 12.8, Transformer Engine no, "
                        "SGLang no, commit abc1234")
    rows = {re.split(r"\s{2,}", ln)[0]: re.split(r"\s{2,}", ln)[1:] for ln in lines[1:]}
    assert rows["part"] == ["status", "result"]
    assert rows["pytest -m gpu"] == ["ok", "5 passed, 0 failed, 9 skipped (84 s)"]
    assert rows["learner 8x1024"] == ["ok", "Megatron 41.2k tokens/s vs transformers 28.7k: 1.44x; MFU 0.31 vs 0.22; "
                                            "peak 30.1 vs 25.2 GiB"]
    assert rows["learner fit 8192"] == ["ok", "largest micro-batch of 8192-token rows: Megatron 16, transformers 8"]
    assert rows["demo step"] == ["timeout", "0.84 s a step (median of 17 after 3; learner train 0.31 s, "
                                            "waiting for data - s); engine on cuda"]
    assert rows["total"] == ["failed", "432 s of 525"] and len(lines) == 7
    assert len({ln.index(re.split(r"\s{2,}", ln)[1]) for ln in lines[1:]}) == 1  # one status column


def test_a_part_not_run_says_why(gc):
    result = {**RESULT, "parts": {"demo": {"status": "not run", "why": "12 s left in --budget-s"}}}
    assert gc.table(result).splitlines()[2].split() == ["demo", "not", "run", "12", "s", "left", "in", "--budget-s"]


def test_the_json_holds_the_records_as_given(gc, tmp_path):
    path = tmp_path / "deep" / "check.json"
    gc.write_json(RESULT, path)
    assert json.loads(path.read_text()) == RESULT and [p.name for p in path.parent.iterdir()] == ["check.json"]


def test_main_runs_the_parts_asked_writes_the_json_and_prints_the_table(gc, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,3")
    monkeypatch.setattr(gc, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(gc, "environment",
                        lambda: {**RESULT["environment"], "seen": os.environ["CUDA_VISIBLE_DEVICES"]})
    asked = []

    def fake(name):
        def run(args, timeout_s, work):
            asked.append((name, timeout_s, work))
            return RESULT["parts"][name]
        return run

    monkeypatch.setattr(gc, "RUNNERS", {p: fake(p) for p in gc.PARTS})
    out = tmp_path / "o" / "check.json"
    assert gc.main(["--out", str(out), "--parts", "demo,pytest", "--gpu", "1"]) == 1  # the demo timed out
    assert [(n, w) for n, _, w in asked] == [("pytest", out.parent), ("demo", out.parent)]
    assert asked[0][1] == 170 and 180 >= asked[1][1] > 180 - 5  # each its own limit: the fakes took no time
    written = json.loads(out.read_text())
    assert written["environment"]["seen"] == "3" and list(written["parts"]) == ["pytest", "demo"]
    assert written["parts"]["demo"] == RESULT["parts"]["demo"] and written["ok"] is False
    printed = capsys.readouterr().out
    assert gc.table(written) in printed and printed.rstrip().endswith(str(out))


def test_the_pytest_part_runs_the_gpu_marker_without_cis_skip_list(gc, tmp_path, monkeypatch):
    monkeypatch.setenv("DARL_EXPECTED_SKIPS", "tests/expected_skips/full.txt")
    seen = []

    def fake_run(cmd, log, timeout_s, env=None):
        seen.append((cmd, env))
        out = PYTEST_OUT.replace("1 failed, ", "") if len(seen) == 1 else "no tests ran in 2.0s\n"
        return {"rc": 0 if len(seen) == 1 else 5, "timed_out": False, "wall_s": 9.0, "log": str(log), "output": out}

    monkeypatch.setattr(gc, "run_part", fake_run)
    part = gc.pytest_part(gc.parse_args([]), 100, tmp_path)
    cmd, env = seen[0]
    assert cmd[1:5] == ["-m", "pytest", "-m", "gpu"] and "DARL_EXPECTED_SKIPS" not in env
    assert (part["status"], part["passed"], part["skipped"]) == ("ok", 4, 3) and "tail" not in part
    assert gc.pytest_part(gc.parse_args([]), 100, tmp_path)["status"] == "failed"  # none ran: no proof


def test_the_demo_starts_afresh_but_keeps_its_warm_start(gc, tmp_path, monkeypatch):
    run_dir = tmp_path / "demo"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "warmstart.json").write_text("{}")
    (run_dir / "logs").mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "perf/step_s": 99.0}) + "\n")  # an old run's

    def fake_run(cmd, log, timeout_s, env=None):
        assert sorted(p.name for p in run_dir.iterdir()) == ["model"]
        with open(run_dir / "metrics.jsonl", "w") as fh:
            fh.writelines(json.dumps({"step": i, "perf/step_s": 0.5}) + "\n" for i in range(5))
        return {"rc": 0, "timed_out": False, "wall_s": 60.0, "log": str(log), "output": ""}

    monkeypatch.setattr(gc, "run_part", fake_run)
    part = gc.demo_part(gc.parse_args(["--demo-steps", "5", "--demo-warmup", "2"]), 100, tmp_path)
    assert (part["status"], part["steps"], part["timed_steps"], part["step_s"]) == ("ok", 5, 3, 0.5)
    assert (run_dir / "model" / "warmstart.json").is_file()
    short = gc.demo_part(gc.parse_args(["--demo-steps", "6", "--demo-warmup", "2"]), 100, tmp_path)
    assert short["status"] == "failed"  # fewer steps than asked
