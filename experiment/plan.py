"""Which runs the experiment makes: sizes, the learning-rate tuning phase and the main grid.

What it is: `Size` (methods, etas, seeds, steps, the learning-rate grid, the tuning eta and
seeds, and the run settings every run shares), seven sizes: `SIZES["bf16"]` and `SIZES["fp8"]`
(budget2 with the engine in that precision: `mismatch_prereg`), `SIZES["budget2"]` (the
preregistered two-phase experiment on the budget size's testbed: `PREREG`, experiment/prereg.py),
`SIZES["budget"]` (the
sample budget as the stop, two regimes (`Regime`), a disjoint test split, the baseline, three
replay cells and D-ARL's two ablations, 5 seeds; `budget_steps` estimates its steps),
`SIZES["seeds"]` (the comparison in the seeds' regime, the script's default: eta = 1, K = 4,
several minibatches, 3-term sums, 60 steps, 4 seeds, two rates as a factor, the higher one from
a short pilot: `pilot_specs`, `pilot_choice`; its time budget: `estimate_s`), `SIZES["etas"]`
(every method tuned, at eta = 1, 2, 4, 8, and D-ARL's ablations: the earlier comparison) and
`SIZES["quick"]` (CI: decoupled PPO and D-ARL at eta = 1, 2 seeds, 4 steps: the real runs
behind the outputs and D-ARL's paired tests; the tables of four methods are checked on
synthetic runs); `tuning_specs` / `best_settings` / `main_specs`, and `estimate_s`, the time
budget of a plan from per-step timings.

The tuning protocol (the same for every method): each main method runs once per setting of the
grid (learning rates x, optionally, `algo.ppo_n_minibatches` values) at the tuning eta with the
tuning seeds; the setting with the highest mean AUC (mean held-out accuracy over the samples
budget) wins, ties going to the smaller rate. The main grid then runs every method at its own
best setting, at every eta, with every seed; a tuning run with the same settings as a main run
is that run (done once). The ablations of D-ARL use D-ARL's setting and run at the tuning eta
only (the replay-depth ablation equal to D-ARL's own depth is D-ARL's runs, not run twice).
What it is not: the run driver (`runs.py`) or the statistics (`analysis.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from experiment.analysis import auc
from experiment.api import ABLATIONS, DARL_VARIANTS, MAIN_METHODS, METHODS, REPLAY_DEPTH, RunResult, RunSpec, Setting
from experiment.prereg import Prereg


@dataclass(frozen=True)
class Regime:
    """A regime of the budget size: its staleness bound and the overrides its runs add."""

    name: str
    eta: int
    settings: tuple[str, ...]
    label: str = ""


@dataclass(frozen=True)
class Size:
    name: str
    methods: tuple[str, ...]
    ablations: tuple[str, ...]
    etas: tuple[int, ...]
    seeds: tuple[int, ...]
    lr_grid: tuple[float, ...]
    tune_eta: int
    tune_seeds: tuple[int, ...]
    steps: int
    every: int  # eval.every_steps
    settings: tuple[str, ...] = field(default=())  # overrides every run of this size shares
    mb_grid: tuple[int, ...] = ()  # algo.ppo_n_minibatches values tuned with the rate; (): the recipe's
    tune: bool = True  # False: no tuning; every method runs at every setting of the grid (a factor)
    pilot_lrs: tuple[float, ...] = ()  # candidates for a higher rate, tried in a short pilot (see pilot_choice)
    pilot_steps: int = 0
    pilot_method: str = "decoupled_areal"
    pilot_clip: float = 0.03  # the pilot's rate: the smallest on which the PPO clip acts on this share of tokens
    warm_range: tuple[float, float] | None = None  # the warm start's accuracy must lie in it (else stop)
    # the budget size: runs stop at `budget` generated samples (steps is only a cap),
    # evaluated every `every_samples`; every method runs in every regime (its eta replaces etas),
    # the ablations in `ablation_regimes`; `accuracy_eval` is the curve the figures read
    budget: int = 0
    every_samples: int = 0
    regimes: tuple[Regime, ...] = ()
    ablation_regimes: tuple[str, ...] = ()
    baseline: str = "decoupled_areal"
    accuracy_eval: str = "greedy"  # greedy | sampled (avg@eval.sampled_k at temperature 1)
    gain_gate: float = 0.0  # the baseline runs first; below this mean gain in any regime, stop before the rest
    prereg: Prereg | None = None  # a preregistered two-phase budget experiment: its phases (`seeds` are phase A's)

    def grid(self) -> list[Setting]:
        return [Setting(lr, mb) for lr in sorted(self.lr_grid) for mb in (sorted(self.mb_grid) or (None,))]

    def check(self) -> list[str]:
        errs = [f"unknown method {m!r} (known: {', '.join(METHODS)})" for m in (*self.methods, *self.ablations)
                if m not in METHODS]
        if not self.methods:
            errs.append("no method to run")
        if any(e < 1 for e in self.etas):
            errs.append(f"etas {self.etas}: each must be >= 1 (sync is the eta = 0 method)")
        if self.tune_eta not in self.etas:
            errs.append(f"tuning eta {self.tune_eta} is not one of the etas {self.etas}")
        if not set(self.tune_seeds) <= set(self.seeds):
            errs.append(f"tuning seeds {self.tune_seeds} must be among the seeds {self.seeds}")
        if self.budget:
            errs += self._check_budget()
        elif self.steps < 1 or self.every < 1 or self.steps % self.every:
            errs.append(f"steps={self.steps} must be a positive multiple of the evaluation interval {self.every}")
        if not self.lr_grid:
            errs.append("empty learning-rate grid")
        if any(mb < 1 for mb in self.mb_grid):
            errs.append(f"minibatch grid {self.mb_grid}: each must be >= 1")
        if self.pilot_lrs and (self.pilot_steps < 1 or self.pilot_method not in METHODS or self.tune):
            errs.append("a pilot needs pilot_steps >= 1, a known pilot_method and an untuned grid (tune=False)")
        return errs

    def _check_budget(self) -> list[str]:
        errs = []
        if self.every_samples < 1 or self.budget % self.every_samples:
            errs.append(f"budget={self.budget} must be a positive multiple of every_samples={self.every_samples}")
        if not self.regimes or any(r.name not in {x.name for x in self.regimes} for r in self.regimes):
            errs.append("a budget size needs regimes")
        unknown = [r for r in self.ablation_regimes if r not in {x.name for x in self.regimes}]
        if unknown:
            errs.append(f"ablation_regimes {unknown} are not among the regimes {[r.name for r in self.regimes]}")
        if self.baseline not in self.methods:
            errs.append(f"the figures need the baseline {self.baseline!r} among the methods "
                        "(its accuracy is the target)")
        if self.accuracy_eval not in ("greedy", "sampled"):
            errs.append(f"accuracy_eval={self.accuracy_eval!r}: greedy or sampled")
        if self.prereg is not None:
            from experiment.prereg import check

            errs += check(self)
        return errs


# The demo recipe (configs/cpu_demo_darl.yaml) with half its batch, so that a run is short and
# its curve has many points per generated sample, and a paced learner: every step lasts at least
# `demo.min_step_s` (the learner sleeps the rest). Without pacing, generation is the slower side on
# a small shared CPU machine and trained data stays about 1-2 versions old whatever eta allows (measured:
# decoupled at eta = 4 and 8 averaged 1.9 and 2.1); a learner slower than generation lets the
# engines run eta versions ahead, as a learner on its own (busy) hardware would.
_SETTINGS = ("train.batch_prompts=32", "eval.num_problems=500", "data.eval_size=500", "demo.min_step_s=1.0")

# The seeds' regime (docs/ALGORITHM.md, "The comparison suite"): one-step-off (eta = 1) with
# D-ARL's window K = 4 (3 replay versions) for D-ARL and the two replay baselines, several
# minibatch updates per step so that the PPO clip can act, a task whose curve keeps rising past
# 25 steps (3-term chain_sum from a warm start of 10-35%), and two learning rates as a factor:
# 1e-4 (the demo recipe's, configs/cpu_demo_darl.yaml) and the smallest of `pilot_lrs` on which
# the clip acts on >= 3% of tokens in a short pilot. No tuning: every cell runs at both rates, and
# the tests pair seeds. The warm start on 3-term sums (constant LR after warmup, the demo's):
# held-out greedy accuracy wanders between about 2% and 11% from step 300 on, so it stops at the
# first check reaching 12%, inside the 10-35% the regime asks for. That check reads the problems
# the curves are scored on, so step 0 is a high point of the warm start (results.md says how high).
_SEEDS_REGIME = (*_SETTINGS, "algo.ppo_n_minibatches=4", "data.dataset_kwargs.min_terms=3",
                 "data.dataset_kwargs.max_terms=3", "demo.sft_steps=1200", "demo.sft_target=0.12")

# The sample-budget comparison: the demo's 2-term chain_sum (the task on which RL gains
# +13 to +20 points), questions split by hash into disjoint train / validation / test sets, a
# warm start of a fixed 450 steps (nothing selected: a probe that stopped it at 25% on the
# validation split started RL from 24.8% on the test split against 21.8% (SD 2.7) for its last
# ten test checks: validation and test rise and fall together with the model, so a validation
# stop also picks a high point), every curve scored on 1000 distinct TEST questions,
# greedy and avg@4 at temperature 1, every BUDGET_EVERY generated samples; runs stop at BUDGET
# generated samples (train.steps = 2000 is only a cap), so a cell that replays runs more steps on
# the same samples. Every replay cell: no warmup (the code's warmup applies only with selection,
# so 0 is the value every cell can share) and the reused groups offered freshest first (the order
# the feed offers D-ARL's candidates).
BUDGET, BUDGET_EVERY = 32768, 4096
_BUDGET_SETTINGS = ("train.batch_prompts=32", "train.steps=2000", "eval.num_problems=1000", "data.eval_size=1000",
                    "data.partition=hash", "data.val_size=500", "demo.sft_steps=450", "demo.sft_target=0",
                    f"train.max_generated_samples={BUDGET}", f"eval.every_samples={BUDGET_EVERY}",
                    "eval.sampled_k=4", "eval.sampled_temperature=1.0", "algo.warmup=0", "algo.reuse_order=freshest")
# (a) generation-bound: the learner unpaced (demo.min_step_s=0, formerly "train.min_step_s"),
# the regime replay is for; (b) staleness-bound: a learner paced to >= 1 s a step at eta = 4, so
# generation runs eta versions ahead and the behavior-policy mismatch bites
REGIMES = (Regime("gen", 1, ("demo.min_step_s=0",), "generation-bound: unpaced learner, eta = 1"),
           Regime("stale", 4, ("demo.min_step_s=1.0",), "staleness-bound: learner paced to >= 1 s a step, eta = 4"))

# The preregistered two-phase experiment (experiment/prereg.py): the same testbed as `budget`, whose
# published runs stay reproducible under their own size. Phase A (exploration, seeds 0-4, both
# regimes) reruns the published cells (the learner's optimizer and D-ARL's selection changed in the
# same release, so their published runs are not this code's), adds naive async and decoupled PPO
# at the larger rate without replay, and the five D-ARL variants; phase B (confirmation) runs the
# variant phase A chose against each regime's best baseline on fresh seeds from 5, as many as the
# power rule asks; a second task (3-digit chain_sum) is a secondary family, gated on the
# baseline's gain there.
PREREG = Prereg(candidates=DARL_VARIANTS,
                baselines=("decoupled_areal", "naive", "decoupled_hi_lr", "naive_replay", "decoupled_replay"),
                references=("darl",),
                secondary_task=("data.dataset_kwargs.min_digits=3", "data.dataset_kwargs.max_digits=3"),
                secondary_label="chain_sum, two 3-digit terms")

# Every cell of the preregistered experiment recomputes the proximal log-probs: the naive cells'
# loss does not read them (its maths is unchanged) but their ESS, KL and clip diagnostics do, so
# that every cell logs the same figures and pays the same forward pass per step.
_PREREG_SETTINGS = (*_BUDGET_SETTINGS, "algo.recompute_proximal=true")

# The preregistered experiment under engine-learner mismatch: budget2's testbed, regimes, budget,
# rules and seeds, with the embedded engine in a lower precision than the fp32 learner
# (`rollout.engine_dtype`), so behavior log-probs are not the learner's even at the same version,
# as in every run at scale. Baselines: naive async, AReaL's decoupled PPO, PPO with verl's token IS
# truncated at 2 and masked outside [1/2, 2] (IcePop-like). Candidates: budget2's two best D-ARL
# variants by worst-regime margin (darl_behav_tokens -1.38, darl_mixture -1.42 points). References,
# for the contrasts only: the published D-ARL (proximal anchor, published selection), darl_behav
# (behavior anchor, new-first selection) and darl_behav_oldsel (behavior anchor, published
# selection), which separate budget2's two confounded changes. Not registered or run: on this
# testbed neither dtype puts more than 0.13% of tokens past the clip at lr 0 (docs/results/README.md).
MISMATCH_QUESTION = ("With the embedded engine in {dtype} and the learner in fp32, which recipe has the best "
                     "worst-regime AUC over the sample budget: naive async PPO, AReaL's decoupled PPO, PPO with verl's "
                     "token IS (truncate or mask), or the two best D-ARL variants of budget2?")
MISMATCH_DEFAULT_RULE = (
    "The recommended async recipe is the chosen D-ARL variant when phase B's paired test rejects in every regime "
    "with the variant ahead (Holm); otherwise it is the baseline with the highest worst-regime phase-A mean AUC "
    "(ties: the earlier in the baselines). The README recommends it. Where it is a D-ARL form, the _darl recipes "
    "take its overrides as their algo defaults; otherwise the _darl recipes keep D-ARL (algo.trust_anchor=behavior) "
    "and the README points at the recommended recipe's overrides.")


def mismatch_prereg(dtype: str) -> Prereg:
    """The mismatch experiment's preregistration for an engine in `dtype`."""
    return Prereg(candidates=("darl_behav_tokens", "darl_mixture"),
                  baselines=("naive", "decoupled_areal", "decoupled_verl", "ppo_tis_mask"),
                  references=("darl", "darl_behav", "darl_behav_oldsel"),
                  secondary_task=PREREG.secondary_task, secondary_label=PREREG.secondary_label,
                  default_rule=MISMATCH_DEFAULT_RULE, question=MISMATCH_QUESTION.format(dtype=dtype),
                  cells_note="Every cell runs anew: budget2's runs had an fp32 engine, exact behavior log-probs.")


def _mismatch_size(name: str, dtype: str) -> Size:
    pre = mismatch_prereg(dtype)
    return Size(name=name, methods=(*pre.baselines, *pre.references, *pre.candidates), ablations=(),
                etas=tuple(sorted({r.eta for r in REGIMES})), seeds=(0, 1, 2, 3, 4), lr_grid=(1e-4,), tune_eta=1,
                tune_seeds=(0,), steps=2000, every=0, settings=(*_PREREG_SETTINGS, f"rollout.engine_dtype={dtype}"),
                tune=False, budget=BUDGET, every_samples=BUDGET_EVERY, regimes=REGIMES, gain_gate=0.08,
                baseline="naive", prereg=pre)


SIZES: dict[str, Size] = {
    "quick": Size(
        name="quick", methods=("decoupled_areal", "darl"), ablations=(), etas=(1,),
        seeds=(0, 1), lr_grid=(5e-5,), tune_eta=1, tune_seeds=(0,), steps=4, every=2,
        settings=("demo.sft_steps=60", "train.batch_prompts=8", "rollout.group_size=4", "eval.num_problems=40",
                  "data.eval_size=40", "algo.warmup=0", "logging.tensorboard=true", "demo.min_step_s=0.5")),
    "etas": Size(
        name="etas", methods=tuple(MAIN_METHODS), ablations=tuple(ABLATIONS), etas=(1, 2, 4, 8),
        seeds=(0, 1, 2), lr_grid=(2.5e-5, 5e-5, 1e-4), tune_eta=4, tune_seeds=(0,), steps=25, every=5,
        settings=_SETTINGS),
    "seeds": Size(
        name="seeds", methods=("decoupled_areal", "naive_replay", "decoupled_replay", "darl"), ablations=(),
        etas=(1,), seeds=(0, 1, 2, 3), lr_grid=(1e-4,), tune_eta=1, tune_seeds=(0,), steps=60, every=10,
        settings=_SEEDS_REGIME, tune=False, pilot_lrs=(2e-4, 4e-4, 8e-4), pilot_steps=12,
        warm_range=(0.10, 0.35)),
    "budget": Size(
        name="budget", methods=("decoupled_areal", "naive_replay", "decoupled_replay", "darl"),
        ablations=("darl_nosel", "darl_nopmis"), etas=tuple(sorted({r.eta for r in REGIMES})), seeds=(0, 1, 2, 3, 4),
        lr_grid=(1e-4,), tune_eta=1, tune_seeds=(0,), steps=2000, every=0, settings=_BUDGET_SETTINGS, tune=False,
        budget=BUDGET, every_samples=BUDGET_EVERY, regimes=REGIMES, ablation_regimes=("gen",), gain_gate=0.08),
    "budget2": Size(
        name="budget2", methods=(*PREREG.baselines, *PREREG.references, *PREREG.candidates), ablations=(),
        etas=tuple(sorted({r.eta for r in REGIMES})), seeds=(0, 1, 2, 3, 4), lr_grid=(1e-4,), tune_eta=1,
        tune_seeds=(0,), steps=2000, every=0, settings=_PREREG_SETTINGS, tune=False, budget=BUDGET,
        every_samples=BUDGET_EVERY, regimes=REGIMES, gain_gate=0.08, prereg=PREREG),
    "bf16": _mismatch_size("bf16", "bfloat16"),
    "fp8": _mismatch_size("fp8", "fp8_e4m3"),
}


def run_overrides(spec: RunSpec, size: Size, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every override of one run: its method's, the size's settings, its regime's, then `extra`."""
    regime = next((r.settings for r in size.regimes if r.name == spec.regime), ())
    return [*spec.overrides(size.steps, size.every), *size.settings, *regime, *extra]


def with_overrides(size: Size, **changes) -> Size:
    """`size` with the command line's changes (None values leave a field as it is)."""
    return replace(size, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in changes.items() if v is not None})


def _eta_of(method: str, eta: int) -> int:
    return 0 if METHODS[method].eta_free else eta


def pilot_specs(size: Size) -> list[RunSpec]:
    """The pilot: `pilot_method` for `pilot_steps` steps at each of `pilot_lrs`, first eta, first seed."""
    return [RunSpec(size.pilot_method, size.etas[0], lr, size.seeds[0], pilot_steps=size.pilot_steps)
            for lr in sorted(size.pilot_lrs)]


def pilot_choice(size: Size, pilots: list[RunResult]) -> tuple[float | None, dict[str, float | None]]:
    """The smallest pilot rate whose mean clip fraction reaches `pilot_clip` (None if none does),
    and every pilot rate's clip fraction."""
    clip = {f"{r.spec.lr:g}": r.clip_frac for r in sorted(pilots, key=lambda r: r.spec.lr)}
    ok = [r.spec.lr for r in pilots if r.clip_frac is not None and r.clip_frac >= size.pilot_clip]
    return (min(ok) if ok else None), clip


def tuning_specs(size: Size) -> list[RunSpec]:
    """One run per (main method, grid setting, tuning seed) at the tuning eta; none when the grid
    holds one setting (nothing to choose) or the size is not tuned."""
    grid = size.grid()
    if len(grid) < 2 or not size.tune:
        return []
    return [RunSpec(m, _eta_of(m, size.tune_eta), g.lr, s, g.minibatches) for m in size.methods for g in grid
            for s in size.tune_seeds]


def best_settings(size: Size, tuning: list[RunResult]) -> tuple[dict[str, Setting], dict[str, dict[str, float]]]:
    """Per main method, the grid setting with the highest mean AUC over its tuning seeds (ties:
    the earlier in the grid, i.e. the smaller rate), and the mean AUC of every setting tried. A
    method none of whose tuning runs finished gets no setting (the caller reports it)."""
    grid = size.grid()
    best: dict[str, Setting] = {}
    scores: dict[str, dict[str, float]] = {}
    for m in size.methods:
        mine = [r for r in tuning if r.spec.method == m]
        if len(grid) == 1:
            best[m] = grid[0]
            continue
        if not mine:
            continue
        x_common = min(r.curve.samples[-1] for r in mine)
        per = {}
        for g in grid:
            vals = [auc(r.curve.samples, r.curve.accuracy, x_common) for r in mine if r.spec.setting == g]
            if vals:
                per[g] = sum(vals) / len(vals)
        scores[m] = {g.label: v for g, v in per.items()}
        best[m] = max(per, key=lambda g: per[g])  # max keeps the first of equal scores
    return best, scores


def untuned(size: Size, best: dict[str, Setting]) -> list[str]:
    """The methods a tuning size could not tune (no tuning run finished), as failures to report.
    A size without tuning (`tune=False`) runs every method at every rate: nothing to miss."""
    if not size.tune:
        return []
    return [f"{m}: no tuning run finished, so it has no learning rate and was not run"
            for m in size.methods if m not in best]


def main_specs(size: Size, best: dict[str, Setting]) -> list[RunSpec]:
    """Every main method at its best setting, every eta and seed; ablations at the tuning eta
    with the setting of the method they vary."""
    specs: list[RunSpec] = []
    if size.budget:  # every method in every regime, the ablations in theirs
        g = size.grid()[0]
        return [RunSpec(m, r.eta, METHODS[m].lr or g.lr, s, g.minibatches, regime=r.name) for r in size.regimes
                for m in (*size.methods, *(size.ablations if r.name in size.ablation_regimes else ()))
                for s in size.seeds]
    if not size.tune:  # every method at every setting: the rate is a factor of the design
        return [RunSpec(m, e, g.lr, s, g.minibatches) for g in size.grid() for m in size.methods
                for e in ([0] if METHODS[m].eta_free else size.etas) for s in size.seeds]
    for m in [m for m in size.methods if m in best]:
        etas = [0] if METHODS[m].eta_free else list(size.etas)
        specs += [RunSpec(m, eta, best[m].lr, s, best[m].minibatches) for eta in etas for s in size.seeds]
    for a in size.ablations:
        if a == f"darl_d{REPLAY_DEPTH}":  # D-ARL itself: its runs stand for it
            continue
        g = best.get(METHODS[a].tune_as or a, size.grid()[0] if len(size.grid()) == 1 else None)
        if g is None:  # the method it varies could not be tuned
            continue
        specs += [RunSpec(a, size.tune_eta, g.lr, s, g.minibatches) for s in size.seeds]
    return specs


def estimate_s(specs: list[RunSpec], size: Size, step_s: dict[str, float], eval_s: float, overhead_s: float) -> float:
    """Seconds for `specs` from per-step times by method (`step_s`, "*" as the fallback), the
    time of one in-loop evaluation and a fixed per-run overhead (start-up, evaluation before and
    after, export, teardown). A budget size's runs take `budget_run_s` instead."""
    total = 0.0
    for s in specs:
        if size.budget:
            total += budget_run_s(size, s)
            continue
        steps, every = s.length(size.steps, size.every)
        total += overhead_s + steps // every * eval_s + steps * step_s.get(s.method, step_s["*"])
    return total


# A budget run on a quiet 2-core machine, from `budget2`'s phase A runs (runs/<name>/
# experiment_cost.json and metrics.jsonl): wall minus the training loop's span
# (start-up, export, teardown) 18-21 s; one in-loop evaluation of 1000 problems, greedy and 4
# sampled, 2.5-2.8 s; an unpaced step 0.32-0.41 s; a paced regime's step takes its demo.min_step_s.
BUDGET_OVERHEAD_S, BUDGET_EVAL_S, BUDGET_STEP_S = 20.0, 2.7, 0.4
REPLAY_SHARE = 0.5  # share of a replay cell's batch that is reused groups (0.42-0.68 in the `seeds` runs)
GEN_PER_TRAINED = 1.35  # generated samples per trained one without replay (83-97 steps of 256 at 32768)


def budget_run_s(size: Size, spec: RunSpec) -> float:
    """Expected wall seconds of one budget run: overhead, the evaluations at every mark from 0 to
    the budget, and `budget_steps` steps at the unpaced step time or the regime's pace."""
    evals = size.budget // size.every_samples + 1
    per_eval = BUDGET_EVAL_S * (1 + _setting(size, "eval.sampled_k", 0)) / 5 * _setting(
        size, "eval.num_problems", 1000) / 1000
    regime = next((r for r in size.regimes if r.name == spec.regime), None)
    pace = _setting(regime, "demo.min_step_s", 0.0) if regime is not None else 0.0
    return BUDGET_OVERHEAD_S + evals * per_eval + budget_steps(size, spec.method) * max(BUDGET_STEP_S, pace)


def budget_steps(size: Size, method: str) -> int:
    """Expected steps of a budget run: the budget over the samples a step generates (a replay cell
    generates only the share of its batch it does not replay; groups that age out or are filtered
    count against the budget too)."""
    per_step = _setting(size, "train.batch_prompts", 32) * _setting(size, "rollout.group_size", 8)
    fresh = 1.0 - REPLAY_SHARE if METHODS[method].depth is not None else 1.0
    return int(size.budget / (per_step * fresh * GEN_PER_TRAINED))


def _setting(size: Size | Regime, key: str, default: float) -> float:
    found = [s.split("=", 1)[1] for s in size.settings if s.startswith(key + "=")]
    return float(found[-1]) if found else default
