"""One command that proves a GPU: the GPU tests, the learner against plain transformers, the demo's step time.

What it is: for a machine with one CUDA GPU and the project's wheels installed (neither Transformer
Engine nor SGLang needed; scripts/gpu_wheels.sh gathers the wheels for a machine with no package
index), three parts, each a subprocess with its own timeout, so that the whole stays within
`--budget-s` (525 s: under 9 minutes):
- `pytest -m gpu`: passed, failed and skipped counts, each skip with its reason (a skip is a result);
- `bench/learner_step.py` at 8x1024, 4x2048 and 1x8192 (micro-batch rows x tokens): the Megatron
  learner's train step against the plain transformers loop. A run that runs out of GPU memory is
  retried shape by shape with half the rows, down to one, so that each shape reports the largest
  micro-batch that fits (the same rows for both systems); with the bench's own search for the most
  8192-token rows one step fits;
- the CPU demo's recipe (configs/cpu_demo_darl.yaml) on the GPU: the learner and the embedded engine
  take CUDA whenever it is visible (the recipe has no device key), so the recipe runs as it is, for
  `--demo-steps` steps without checkpoints; its time per step is the median `perf/step_s` of its
  metrics.jsonl after the first `--demo-warmup` steps.
It prints one table and writes one JSON file (`--out`): the environment (device, torch, CUDA, whether
TE and SGLang import, commit) and, per part, its status (ok, failed, timeout, not run), figures, wall
time and log file (beside the JSON). Exit code 0 when every part it ran is ok. Without a CUDA GPU it
refuses at once, in one line (exit 2), before it starts anything.
What it is not: a pass/fail against target figures, or a tuned benchmark: the figures go into
docs/measurements.md by hand.

    python bench/gpu_check.py [--out runs/gpu_check/gpu_check.json] [--parts pytest,learner,demo]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("pytest", "learner", "demo")
# seconds each part may take; a later part keeps at least half of its own (see `part_timeout`)
CAPS = {"pytest": 170, "learner": 240, "demo": 180}
BUDGET_S = 525
GRACE_S = 10  # SIGTERM, then this long before SIGKILL: darl-train's learners stop cleanly on SIGTERM
STOP_S = GRACE_S + 5  # the longest a part's stop takes
MIN_PART_S = 30  # less left than this: the part is not started
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg")  # a CUDA device (WSL2: /dev/dxg); none: no import of torch
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 2:
            raise argparse.ArgumentTypeError(f"{item!r}: a shape is ROWSxTOKENS, e.g. 8x1024")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def _parts(text: str) -> tuple[str, ...]:
    asked = [p.strip() for p in text.split(",") if p.strip()]
    if not asked or set(asked) - set(PARTS):
        raise argparse.ArgumentTypeError(f"{text!r}: parts are a comma-separated subset of {','.join(PARTS)}")
    return tuple(p for p in PARTS if p in asked)  # always in this order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu_check/gpu_check.json",
                   help="the JSON file; the logs and the demo's run folder go beside it")
    p.add_argument("--parts", type=_parts, default=PARTS, help="comma-separated subset of pytest,learner,demo")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's wall-clock limit")
    for part in PARTS:
        p.add_argument(f"--{part}-timeout", type=float, default=CAPS[part], help=f"the {part} part's limit (s)")
    p.add_argument("--gpu", type=int, default=0, help="which visible GPU to use (the check uses one)")
    p.add_argument("--shapes", type=_shapes, default=_shapes("8x1024,4x2048,1x8192"),
                   help="learner: micro-batch rows x tokens, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="learner: timed steps per shape (after one warm-up)")
    p.add_argument("--fit-seq", type=int, default=8192, help="learner: tokens a row in the fit search (0: none)")
    p.add_argument("--max-rows", type=int, default=64, help="learner: the fit search's cap")
    p.add_argument("--demo-config", default="configs/cpu_demo_darl.yaml", help="demo: the recipe (from the repository)")
    p.add_argument("--demo-steps", type=int, default=30)
    p.add_argument("--demo-warmup", type=int, default=3, help="demo: first steps left out of the median")
    args = p.parse_args(argv)
    if args.steps < 1 or args.demo_steps <= args.demo_warmup or args.demo_warmup < 0:
        p.error("--steps must be >= 1 and --demo-steps > --demo-warmup >= 0")
    return args


def no_gpu_reason(nodes: tuple[str, ...] = GPU_NODES) -> str | None:
    """Why this machine has no usable CUDA GPU, or None. Without a device node torch is not
    even imported (seconds saved on a laptop); with one, torch decides."""
    if not any(glob.glob(n) for n in nodes):
        return "no CUDA GPU found (no /dev/nvidia* device); nothing was run"
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA GPU found (torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); nothing was run")
    return None


def pick_gpu(index: int, environ: dict) -> str:
    """The CUDA_VISIBLE_DEVICES that shows every part visible GPU `index` alone (set before torch
    starts CUDA, which reads it once); an empty one, which shows none, stays empty."""
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return str(index)
    visible = [v.strip() for v in environ["CUDA_VISIBLE_DEVICES"].split(",") if v.strip()]
    if visible and index >= len(visible):
        raise SystemExit(f"gpu_check: --gpu {index}, but CUDA_VISIBLE_DEVICES names {len(visible)} GPUs")
    return visible[index] if visible else ""


def environment() -> dict:
    """What the figures depend on: device, torch and CUDA, TE and SGLang present, commit."""
    import torch

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(0),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
            "sglang": importlib.util.find_spec("sglang") is not None, "commit": commit or None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the part's process group, SIGKILL it GRACE_S later (grandchildren that started
    groups of their own, darl-train's roles, die with their parent: PR_SET_PDEATHSIG)."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, STOP_S - GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> dict:
    """Run `cmd` from the repository in a session of its own, its output into `log`; past
    `timeout_s` its process group is stopped. Returns rc, timed_out, wall_s and the output."""
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # a timeout, or Ctrl-C here (the part is in another session: it did not get it)
            if proc.poll() is None:
                _stop_group(proc)
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 1),
            "log": str(log), "output": log.read_text(encoding="utf-8", errors="replace")}


def pytest_counts(output: str) -> dict:
    """pytest's closing counts (passed, failed, skipped, errors, deselected), its skip reasons
    and failures (the -r lines), from its terminal output."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    closing = [ln for ln in output.splitlines() if re.search(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b", ln)
               and re.search(r" in [\d.]+s\b", ln)]
    for n, kind in re.findall(r"\b(\d+) (passed|failed|skipped|errors?|deselected)\b", closing[-1] if closing else ""):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    counts["skips"] = [ln[len("SKIPPED "):] for ln in output.splitlines() if ln.startswith("SKIPPED [")]
    counts["failures"] = [ln for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    counts["summary_found"] = bool(closing)
    return counts


def pytest_part(args: argparse.Namespace, timeout_s: float, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DARL_EXPECTED_SKIPS"}  # CI's list is for CPU passes
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs", "tests"]
    run = run_part(cmd, work / "pytest.log", timeout_s, env)
    counts = pytest_counts(run["output"])
    ran = counts["passed"] + counts["failed"] + counts["skipped"] + counts["errors"]
    ok = run["rc"] == 0 and counts["summary_found"] and ran > 0 and not (counts["failed"] or counts["errors"])
    status = "timeout" if run["timed_out"] else "ok" if ok else "failed"
    return _part(status, run, cmd, counts)


def _part(status: str, run: dict, cmd: list[str], figures: dict) -> dict:
    out = {"status": status, "command": " ".join(cmd), "wall_s": run["wall_s"], "log": run["log"], **figures}
    if status != "ok":
        out["tail"] = run["output"][-2000:]
    return out


class OutOfMemory(RuntimeError):
    """A learner bench run that stopped on a CUDA out-of-memory error."""


def fit_down(rows: int, try_rows) -> tuple[int, dict | None]:
    """Run `try_rows(rows)`, then with half as many rows after each OutOfMemory, down to one:
    (the rows that ran, their result), or (0, None) when even one row does not fit."""
    while rows >= 1:
        try:
            return rows, try_rows(rows)
        except OutOfMemory:
            rows //= 2
    return 0, None


def learner_cmd(args: argparse.Namespace, shapes: list[tuple[int, int]], fit_seq: int) -> list[str]:
    return [sys.executable, str(REPO / "bench" / "learner_step.py"), "--shapes",
            ",".join(f"{r}x{s}" for r, s in shapes), "--steps", str(args.steps), "--fit-seq", str(fit_seq),
            "--max-rows", str(args.max_rows)]


def _bench_json(output: str) -> dict:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("bench/learner_step.py printed no JSON line")


def learner_part(args: argparse.Namespace, timeout_s: float, work: Path) -> dict:
    """All shapes and the fit search in one bench run; after an out-of-memory stop, each shape
    alone, from its own rows down (`fit_down`), in what is left of the part's time, without
    the fit search (whose rows the shapes' own then bound)."""
    deadline = time.monotonic() + timeout_s
    runs: list[dict] = []

    def bench(shapes, fit_seq) -> dict:
        cmd = learner_cmd(args, shapes, fit_seq)
        run = run_part(cmd, work / f"learner_step{len(runs) or ''}.log", deadline - time.monotonic())
        runs.append({"command": " ".join(cmd), **{k: run[k] for k in ("rc", "timed_out", "wall_s", "log")}})
        if run["rc"] == 0:
            return _bench_json(run["output"])
        if not run["timed_out"] and OOM.search(run["output"]):
            raise OutOfMemory(run["log"])
        raise RuntimeError(f"{'timed out' if run['timed_out'] else 'failed'}: see {run['log']}")

    out: dict = {"status": "ok", "runs": runs, "shapes": {}}
    try:
        try:
            first = bench(args.shapes, args.fit_seq)
            for r, s in args.shapes:
                out["shapes"][f"{r}x{s}"] = {"rows": r, "seq": s, **first["shapes"][f"{r}x{s}"]}
        except OutOfMemory:  # which shape did not fit is not known: each from its own rows down
            first = None
            for r, s in args.shapes:
                got, result = fit_down(r, lambda rows, s=s: bench([(rows, s)], 0))
                row = result["shapes"][f"{got}x{s}"] if result else {}
                out["shapes"][f"{r}x{s}"] = {"rows": got, "seq": s, **row}
                first = first or result
        out.update({k: v for k, v in (first or {}).items() if k != "shapes"})
    except (RuntimeError, ValueError) as exc:  # ValueError: no JSON line
        out.update(status="timeout" if "timed out" in str(exc) else "failed", error=str(exc))
    out["wall_s"] = round(sum(r["wall_s"] for r in runs), 1)
    return out


def demo_cmd(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_darl", "train", "--config", args.demo_config, f"train.run_dir={run_dir}",
            f"train.steps={args.demo_steps}", "checkpoint.every_steps=0"]


def demo_figures(run_dir: Path, warmup: int) -> dict:
    """From a demo run's metrics.jsonl: steps logged and the medians, after `warmup` steps, of
    the step's time and its parts; from its logs, the device the engine said it runs on."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    steady = rows[warmup:]

    def median(key: str) -> float | None:
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    out = {"steps": len(rows), "timed_steps": len(steady)}
    for key in ("step_s", "train_step_s", "wait_data_s", "recompute_s", "publish_s", "tokens_per_s", "mfu"):
        out[key] = median(f"perf/{key}")
    devices = {m for log in sorted((run_dir / "logs").glob("*.log"))
               for m in re.findall(r"darl-engine: .* on (\w+), serving", log.read_text(errors="replace"))}
    out["engine_device"] = ",".join(sorted(devices)) or None
    return out


def demo_part(args: argparse.Namespace, timeout_s: float, work: Path) -> dict:
    run_dir = work / "demo"
    if run_dir.is_dir():  # a fresh run each time; the warm start's cache (model/) is kept and reused
        for child in run_dir.iterdir():
            if child.name != "model":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    cmd = demo_cmd(args, run_dir)
    run = run_part(cmd, work / "demo.log", timeout_s)
    figures = demo_figures(run_dir, args.demo_warmup)
    ok = run["rc"] == 0 and figures["steps"] >= args.demo_steps and figures["step_s"] is not None
    return _part("timeout" if run["timed_out"] else "ok" if ok else "failed", run, cmd, figures)


def part_timeout(part: str, args: argparse.Namespace, left_s: float) -> float:
    """The part's own limit, less what keeps half of each later part's limit within the budget."""
    later = sum(getattr(args, f"{p}_timeout") / 2 for p in args.parts[args.parts.index(part) + 1:])
    return min(getattr(args, f"{part}_timeout"), left_s - later - STOP_S)


def _k(x: float | None) -> str:
    return "-" if x is None else f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pytest_line(p: dict) -> list[tuple[str, str, str]]:
    text = f"{p['passed']} passed, {p['failed']} failed, {p['skipped']} skipped"
    text += f", {p['errors']} errors" if p["errors"] else ""
    return [("pytest -m gpu", p["status"], f"{text} ({p['wall_s']:.0f} s)")]


def learner_lines(p: dict) -> list[tuple[str, str, str]]:
    out = []
    for shape, row in p["shapes"].items():
        if not row.get("megatron_tokens_per_s"):
            out.append((f"learner {shape}", "no fit", f"one row of {row['seq']} tokens does not fit"))
            continue
        ran = f"{row['rows']}x{row['seq']}"
        rows = "" if ran == shape else f"; ran at {ran}, the most rows that fit"
        mfu = (f"; MFU {_f(row.get('megatron_mfu'), '.2f')} vs {_f(row.get('transformers_mfu'), '.2f')}"
               if "megatron_mfu" in row else "")
        out.append((f"learner {shape}", "ok",
                    f"Megatron {_k(row['megatron_tokens_per_s'])} tokens/s vs transformers "
                    f"{_k(row['transformers_tokens_per_s'])}: {row['ratio_megatron_vs_transformers']:.2f}x{mfu}; "
                    f"peak {row['megatron_peak_gib']:.1f} vs {row['transformers_peak_gib']:.1f} GiB{rows}"))
    fit = p.get("fit_rows") or {}
    if p.get("fit_seq") and any(v is not None for v in fit.values()):
        out.append((f"learner fit {p['fit_seq']}", "ok", f"largest micro-batch of {p['fit_seq']}-token rows: "
                    f"Megatron {fit.get('megatron')}, transformers {fit.get('transformers')}"))
    if p["status"] != "ok":
        out.append(("learner", p["status"], p.get("error", "")))
    return out


def demo_line(p: dict) -> list[tuple[str, str, str]]:
    text = (f"{_f(p['step_s'], '.2f')} s a step (median of {p['timed_steps']} after {p['steps'] - p['timed_steps']}"
            f"; learner train {_f(p['train_step_s'], '.2f')} s, waiting for data {_f(p['wait_data_s'], '.2f')} s)"
            f"; engine on {p['engine_device'] or '?'}")
    return [("demo step", p["status"], text)]


def table(result: dict) -> str:
    """The check as one table: a header line of the environment, then a row per figure."""
    env = result["environment"]
    head = (f"{env['device']} ({env['memory_gib']} GiB), torch {env['torch']}, CUDA {env['cuda']}, "
            f"Transformer Engine {'yes' if env['transformer_engine'] else 'no'}, "
            f"SGLang {'yes' if env['sglang'] else 'no'}, commit {env['commit'] or '?'}")
    rows: list[tuple[str, str, str]] = []
    for name, lines in (("pytest", pytest_line), ("learner", learner_lines), ("demo", demo_line)):
        part = result["parts"].get(name)
        if part is None:
            continue
        rows += lines(part) if part["status"] != "not run" else [(name, "not run", part.get("why", ""))]
    rows.append(("total", "ok" if result["ok"] else "failed", f"{result['wall_s']:.0f} s of {result['budget_s']:.0f}"))
    width = max(len(r[0]) for r in rows) + 2
    body = [f"{'part':<{width}}{'status':<9}result"] + [f"{a:<{width}}{b:<9}{c}" for a, b, c in rows]
    return "\n".join([head, *body])


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


RUNNERS = {"pytest": pytest_part, "learner": learner_part, "demo": demo_part}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0, started = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.environ["CUDA_VISIBLE_DEVICES"] = pick_gpu(args.gpu, os.environ)  # this process and every part: one GPU
    why = no_gpu_reason()
    if why:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"started": started, "command": [sys.executable, *sys.argv], "budget_s": args.budget_s,
              "environment": environment(), "parts": {}}
    for part in args.parts:
        timeout = part_timeout(part, args, args.budget_s - (time.monotonic() - t0))
        if timeout < MIN_PART_S:
            result["parts"][part] = {"status": "not run", "why": f"{timeout:.0f} s left in --budget-s"}
            continue
        print(f"gpu_check: {part} (at most {timeout:.0f} s; logs in {out.parent})", flush=True)
        result["parts"][part] = RUNNERS[part](args, timeout, out.parent)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["ok"] = all(p["status"] == "ok" for p in result["parts"].values())
    write_json(result, out)
    print(table(result))
    print(f"gpu_check: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
