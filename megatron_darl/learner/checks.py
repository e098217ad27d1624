"""Learner checks that run before anything starts: model shapes against the parallel layout.

What it is: over the model's shapes (`model_shapes`, from `megatron_darl/model_facts.py`),
`layout_errors` checks that tensor parallelism divides the attention heads, KV heads and FFN
width, that pipeline stages divide the layers, and that the learner world size
(`launch.learner_procs_per_node` x trainer nodes) is a multiple of tp x pp, naming the keys and
the values that would work; `learner_checks(cfg)` runs them with the sequence-parallel and
memory-plan checks, for the run's `launch/preflight.py`; `plan_command`, `darl-train --plan`.
What it is not: the model's shapes and context themselves (`model_facts.py`, which every process
may import), config validation of single keys (each dataclass's `check()`), or the learner's
runtime checks (Megatron repeats them, 20 s into a run).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from megatron_darl.learner.memory_plan import learner_world, plan_run
from megatron_darl.model_facts import model_shapes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_errors(hf: dict[str, Any], par, world: int, world_src: str) -> list[str]:
    """Divisibility of the model by parallel.tp / parallel.pp and of the world by tp x pp.
    (The vocabulary never fails: Megatron pads it to a multiple of make_vocab_size_divisible_by x tp.)"""
    heads = int(hf["num_attention_heads"])
    dims = {"num_attention_heads": heads, "num_key_value_heads": int(hf.get("num_key_value_heads") or heads),
            "intermediate_size (FFN)": int(hf["intermediate_size"])}
    errors = []
    bad = [f"{k}={v}" for k, v in dims.items() if v % par.tp]
    if bad:
        ok = _divisors(math.gcd(*dims.values()))
        errors.append(f"parallel.tp={par.tp} must divide {', '.join(bad)} (tensor parallelism splits heads, "
                      f"KV heads and the FFN); allowed tp for this model: {', '.join(map(str, ok))}")
    layers, stages = int(hf["num_hidden_layers"]), par.pp * (par.vpp or 1)
    if layers % stages:
        what = f"parallel.pp={par.pp}" + (f" x parallel.vpp={par.vpp}" if par.vpp else "")
        ok = [p for p in _divisors(layers) if layers % (p * (par.vpp or 1)) == 0]
        errors.append(f"{what} must divide num_hidden_layers={layers} (even pipeline stages); "
                      f"allowed pp for this model: {', '.join(map(str, ok))}")
    if world % (par.tp * par.pp):
        ok = [f"tp={t} pp={p}" for t in _divisors(world) for p in _divisors(world // t)
              if heads % t == 0 and dims["num_key_value_heads"] % t == 0 and layers % p == 0][:8]
        errors.append(f"the learner world size {world} ({world_src}) is not a multiple of parallel.tp x "
                      f"parallel.pp = {par.tp * par.pp}; layouts that fit {world} ranks: {', '.join(ok)}")
    return errors


def spec_errors(cfg) -> list[str]:
    """Sequence parallel needs the Transformer Engine spec, which needs a GPU run."""
    if not cfg.parallel.sequence_parallel:
        return []
    if cfg.model.spec == "local" or (cfg.model.spec == "auto" and cfg.launch.trainer.gpus_per_node == 0):
        return ["parallel.sequence_parallel=true needs the Transformer Engine spec (model.spec=te, or auto on "
                "GPUs: launch.trainer.gpus_per_node > 0); megatron-core's local spec refuses sequence parallel"]
    return []


def learner_checks(cfg) -> list[str]:
    """Everything the learner can check before a run starts; [] when it may start."""
    from checkpoint_tools.adapters import get_adapter

    hf, source = model_shapes(cfg)
    errors = spec_errors(cfg)
    if hf is None:
        return errors  # launch/preflight.py already names the missing config.json
    try:
        get_adapter(hf)  # an architecture the converter and the learner map, with its fields
        world, src = learner_world(cfg)
        errors += layout_errors(hf, cfg.parallel, world, src)
    except (KeyError, ValueError, TypeError) as exc:
        return errors + [f"model.hf_dir: {source}: {exc}"]
    if errors:
        return errors
    plan = plan_run(cfg, hf)
    if not plan.fits:
        errors.append(plan.refusal())
    return errors


def plan_command(cfg) -> int:
    """`darl-train --plan`: print the plan; 0 when the recipe may start, 1 when it is refused."""
    hf, source = model_shapes(cfg)
    if hf is None:
        print(f"darl-train --plan: model.hf_dir: {source}; the plan needs the model's shapes", file=sys.stderr)
        return 1
    print(f"model shapes: {source}")
    world, src = learner_world(cfg)
    errors = spec_errors(cfg) + layout_errors(hf, cfg.parallel, world, src)
    if errors:
        print("darl-train --plan: the layout does not fit the model:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    plan = plan_run(cfg, hf)
    print(plan.format())
    if not plan.fits:
        print(f"darl-train: refused: {plan.refusal()}", file=sys.stderr)
        return 1
    return 0


def check_resolved_spec(cfg, on_gpu: bool, te: bool) -> None:
    """On the learner's node: `model.spec=auto` without Transformer Engine falls back to the
    local spec, which the plan made at submit did not assume (its SwiGLU keeps one more
    activation, and with `model.attention=dot_product` its attention ~6 B per score, not flash
    attention's 4 B per row): refuse, with the local spec's plan, a recipe that then does not
    fit, before any GPU memory is taken."""
    if not on_gpu or te or cfg.model.spec != "auto":
        return
    hf, source = model_shapes(cfg)
    if hf is None:
        return
    plan = plan_run(cfg, hf, spec="local")
    if not plan.fits:
        raise RuntimeError("transformer_engine is not importable on this node, so model.spec=auto fell back to "
                           f"megatron-core's local spec: {plan.refusal()}; install megatron-darl[gpu] on the "
                           "trainer nodes (Transformer Engine) or set model.spec=local with a plan that fits")
