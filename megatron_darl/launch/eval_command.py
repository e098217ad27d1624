"""`darl-eval`: held-out accuracy (avg@k, pass@k, 95% interval) of a Hugging Face model folder.

What it is: a command that serves `--model` with an embedded `darl-engine` (or uses running
engines given with `--engine-url`, e.g. SGLang servers), draws problems from a data spec
(`reasoning_gym:chain_sum`, `jsonl:/data/gsm8k_test.jsonl`, `parquet:...`, `humaneval`), samples
k responses each, grades them in the reward pool (math-verify, procedural verifiers, the code
sandbox) and prints one JSON object with the result.
What it is not: training-time evaluation (`session.py` calls `eval/heldout.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="darl-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--data", required=True,
                   help="data spec: reasoning_gym:<task> | jsonl:<path> | parquet:<path> | humaneval")
    p.add_argument("--config", help="YAML recipe whose data/reward/rollout sections to use (prompt format, graders)")
    p.add_argument("--tokenizer", help="tokenizer folder or builtin:qwen3|builtin:demo (default: the model folder)")
    p.add_argument("--num-problems", type=int, default=500)
    p.add_argument("--k", type=int, default=1, help="samples per problem (avg@k, pass@k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--engine-url", action="append", default=[], help="use running engines instead of starting one")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (data.prompt_template=...)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from megatron_darl.config import ConfigError, load_config
    from megatron_darl.config.data import SourceSpec

    try:
        SourceSpec.parse(args.data)
        spec = "eval_source" if not args.data.startswith("reasoning_gym:") else "source"
        cfg = load_config(args.config, [f"model.hf_dir={args.model}", f"data.{spec}={args.data}",
                                        f"eval.num_problems={args.num_problems}",
                                        f"data.eval_size={args.num_problems}", f"eval.samples_per_problem={args.k}",
                                        f"eval.temperature={args.temperature}", "rollout.num_engines=1",
                                        *([f"model.tokenizer={args.tokenizer}"] if args.tokenizer else []),
                                        *([f"eval.max_new_tokens={args.max_new_tokens}"]
                                          if args.max_new_tokens else []),
                                        *args.overrides])
    except (ConfigError, ValueError) as exc:
        print(f"darl-eval: {exc}", file=sys.stderr)
        return 1
    result = evaluate(cfg, list(args.engine_url))
    print(json.dumps(asdict(result)))
    return 0


def evaluate(cfg, urls: list[str]):
    """Start an embedded engine on `cfg.model.hf_dir` unless `urls` are given; score; stop it."""
    import os
    import tempfile

    from megatron_darl.eval.heldout import evaluate_with_engines
    from megatron_darl.launch.local import start_local_engines
    from megatron_darl.launch.supervisor import Supervisor

    with tempfile.TemporaryDirectory(prefix="darl-eval-") as logs, Supervisor(logs, echo=None) as sup:
        if not urls:
            urls = start_local_engines(cfg, sup)  # health-checked embedded engine(s) on the model folder
        scores, line = evaluate_with_engines(cfg, urls, f"of {os.path.basename(cfg.model.hf_dir.rstrip('/'))}")
        print(line, file=sys.stderr)
        if scores is None:  # cannot happen for --data, which always names the evaluated split
            raise ValueError(line)
        return scores.result(cfg.data.eval_source or cfg.data.source)


if __name__ == "__main__":
    raise SystemExit(main())
