"""Experiment role: the comparison suite of docs/ALGORITHM.md as data (methods, runs, results).

What it is: `METHODS`, each method of the suite as the `darl-train` overrides that make it
(sync, naive async, decoupled PPO with AReaL's cap and with verl's token IS, the two of them with
replay over D-ARL's window, D-ARL and its ablations; the preregistered experiment's decoupled
PPO at a larger rate and the five D-ARL variants, `DARL_VARIANTS`); `darl_window`, the window K at staleness
eta; `RunSpec`, one training run (method, staleness eta, learning rate, seed, phase);
`RunResult`, what a finished run measured (its held-out accuracy curve against steps, generated
samples and wall-clock, the staleness it actually reached, its minimum ESS, its wall time).
What it is not: the runner (`runs.py`), the statistics (`analysis.py`) or the report
(`report.py`); nor a claim about which method wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASELINE_OFF = ["algo.replay=false", "algo.sg=false", "algo.pmis=false"]
REPLAY_FIFO = ["algo.replay=true", "algo.sg=false", "algo.pmis=false"]


@dataclass(frozen=True)
class Method:
    """One row of the suite: `overrides` on top of the base recipe; `eta_free` methods ignore eta
    (sync runs once, at eta = 0, and stands as the reference in every eta's table)."""

    name: str
    label: str
    overrides: tuple[str, ...]
    ablation: bool = False
    eta_free: bool = False
    tune_as: str | None = None  # ablations use the learning rate tuned for this method
    depth: int | None = None  # replay depth: runs with algo.k = eta + depth (`darl_window`); None: no window
    lr: float | None = None  # a learning rate of its own (the budget sizes); None: the size's


def _darl(*extra: str) -> tuple[str, ...]:
    """D-ARL's overrides, a key that `extra` sets given once (its value from `extra`)."""
    base = ("algo.policy_loss=darl", "algo.replay=true", "algo.sg=true", "algo.pmis=true", "algo.pmis_beta=ess")
    keys = {e.split("=", 1)[0] for e in extra}
    return (*(b for b in base if b.split("=", 1)[0] not in keys), *extra)


def _darl_published(*extra: str) -> tuple[str, ...]:
    """The D-ARL of the first published runs and its ablations: the clip at the proximal policy
    (`algo.trust_anchor=proximal`, the default of those runs) and selection that may let a reused
    group displace a never-trained one (`algo.sg_new_first=false`), the code path they took."""
    return _darl("algo.trust_anchor=proximal", "algo.sg_new_first=false", *extra)


# Replay depth: the behavior versions a group can be replayed from. New data of step t is of
# version >= t - eta (the staleness gate) and a group leaves the window when t - v > K, so a
# group trained once is offered again only from versions t - K .. t - eta - 1: K - eta versions.
# D-ARL's window is K = eta + REPLAY_DEPTH at every eta (K = 4 at eta = 1, as the seeds' suite);
# K <= eta means no replay at all (the depth ablation d = 0).
REPLAY_DEPTH = 3
DEPTH_ABLATIONS = (0, 1, 3, 7)  # K = 1, 2, 4, 8 at eta = 1

_METHODS = [
    Method("sync", "sync (eta = 0)", ("algo.max_head_offpolicyness=0", *BASELINE_OFF, "algo.policy_loss=ppo",
                                      "algo.old_logprob=proximal"), eta_free=True),
    Method("naive", "naive async", (*BASELINE_OFF, "algo.policy_loss=ppo", "algo.old_logprob=behavior",
                                    "algo.recompute_proximal=false")),
    Method("decoupled_areal", "decoupled, AReaL cap 5", (*BASELINE_OFF, "algo.policy_loss=decoupled",
                                                         "algo.behav_weight_cap=5.0")),
    Method("decoupled_verl", "decoupled, verl token IS 2", (*BASELINE_OFF, "algo.policy_loss=ppo",
                                                           "algo.old_logprob=proximal", "algo.rollout_is=token",
                                                           "algo.rollout_is_threshold=2.0")),
    # the seeds' replay baselines: D-ARL's window, FIFO over the reused groups, no selection, one
    # token mean (replay_4_async, replay_4_decoupled)
    Method("naive_replay", "naive async + replay", (*REPLAY_FIFO, "algo.policy_loss=ppo",
                                                    "algo.old_logprob=behavior", "algo.recompute_proximal=false"),
           depth=REPLAY_DEPTH),
    Method("decoupled_replay", "decoupled, AReaL cap 5, + replay", (*REPLAY_FIFO, "algo.policy_loss=decoupled",
                                                                    "algo.behav_weight_cap=5.0"), depth=REPLAY_DEPTH),
    Method("darl", f"D-ARL (K = eta + {REPLAY_DEPTH})", _darl_published(), depth=REPLAY_DEPTH),
    Method("darl_nosel", "D-ARL, no selection", _darl_published("algo.sg=false"), ablation=True, tune_as="darl",
           depth=REPLAY_DEPTH),
    Method("darl_nopmis", "D-ARL, no per-version objective", _darl_published("algo.pmis=false"), ablation=True,
           tune_as="darl", depth=REPLAY_DEPTH),
    *[Method(f"darl_d{d}", f"D-ARL, replay depth {d} (K = eta + {d})", _darl_published(), ablation=True,
             tune_as="darl", depth=d) for d in DEPTH_ABLATIONS],
]
MAIN_METHODS = [m.name for m in _METHODS if not m.ablation]
ABLATIONS = [m.name for m in _METHODS if m.ablation]

# The preregistered experiment's cells beyond the published ones: decoupled PPO without replay at
# the larger step a replay cell takes more often, and D-ARL read with the PPO clip anchored at
# each sample's own behavior policy (`behavior`) or at the balance mixture of the behavior
# policies (`mixture`), with selection that never lets a reused group displace a never-trained
# one (the default `algo.sg_new_first=true`), all at D-ARL's replay depth.
HIGH_LR = 2e-4
_PREREG_METHODS = [
    Method("decoupled_hi_lr", f"decoupled, AReaL cap 5, lr {HIGH_LR:g}", (*BASELINE_OFF, "algo.policy_loss=decoupled",
                                                                          "algo.behav_weight_cap=5.0"), lr=HIGH_LR),
    Method("darl_behav", "D-ARL, behavior-anchored clip", _darl("algo.trust_anchor=behavior"), depth=REPLAY_DEPTH),
    Method("darl_behav_tokens", "D-ARL, behavior-anchored, beta = tokens",
           _darl("algo.trust_anchor=behavior", "algo.pmis_beta=tokens"), depth=REPLAY_DEPTH),
    Method("darl_mixture", "D-ARL, clip against the balance mixture",
           _darl("algo.trust_anchor=mixture", "algo.pmis_beta=balance"), depth=REPLAY_DEPTH),
    Method("darl_behav_abs", "D-ARL, behavior-anchored, absolute gate 0.04",
           _darl("algo.trust_anchor=behavior", "algo.sg_tau_abs=0.04"), depth=REPLAY_DEPTH),
    Method("darl_behav_nosel", "D-ARL, behavior-anchored, no selection",
           _darl("algo.trust_anchor=behavior", "algo.sg=false"), depth=REPLAY_DEPTH),
]
DARL_VARIANTS = tuple(m.name for m in _PREREG_METHODS if m.name.startswith("darl"))
# The mismatch experiment's cells beyond those (experiment/plan.py, `mismatch_prereg`): verl's token
# IS in mask mode (IcePop-like: a token whose ratio pi_prox / mu leaves [1/2, 2] is dropped, not
# capped) and the behavior-anchored D-ARL with the published selection, which separates budget2's
# two changes (the anchor, and the selection that never lets a reused group displace a new one).
_MISMATCH_METHODS = [
    Method("ppo_tis_mask", "PPO, verl token IS mask [1/2, 2]", (*BASELINE_OFF, "algo.policy_loss=ppo",
                                                                "algo.old_logprob=proximal", "algo.rollout_is=token",
                                                                "algo.rollout_is_mode=mask",
                                                                "algo.rollout_is_threshold=2.0")),
    Method("darl_behav_oldsel", "D-ARL, behavior-anchored, published selection",
           _darl("algo.trust_anchor=behavior", "algo.sg_new_first=false"), depth=REPLAY_DEPTH),
]
METHODS: dict[str, Method] = {m.name: m for m in (*_METHODS, *_PREREG_METHODS, *_MISMATCH_METHODS)}
DECOUPLED = ("decoupled_areal", "decoupled_verl")


def darl_window(eta: int, depth: int = REPLAY_DEPTH) -> int:
    """K of the `darl` method (and of its selection / P-MIS ablations) at staleness eta: the
    staleness bound plus `depth` versions of replay (see REPLAY_DEPTH)."""
    return eta + depth


def method_window(method: str, eta: int) -> int | None:
    """`algo.k` a method runs with at staleness eta; None where it keeps the recipe's (no replay)."""
    depth = METHODS[method].depth
    return None if depth is None else darl_window(eta, depth)


@dataclass(frozen=True)
class RunSpec:
    """One `darl-train` run of the experiment; a tuning run whose settings a main run repeats is
    the same run (same name, done once). `minibatches` None keeps the recipe's
    `algo.ppo_n_minibatches`. `pilot_steps`: a pilot run of its own length (evaluated once, at
    its end), named apart from the main runs."""

    method: str
    eta: int
    lr: float
    seed: int
    minibatches: int | None = None
    pilot_steps: int | None = None
    regime: str = ""  # the budget size's regime (its settings come from the size); "" elsewhere

    @property
    def name(self) -> str:
        mb = f"_mb{self.minibatches}" if self.minibatches else ""
        pilot = f"pilot{self.pilot_steps}_" if self.pilot_steps else ""
        regime = f"{self.regime}_" if self.regime else ""
        return f"{pilot}{regime}{self.method}_eta{self.eta}_lr{self.lr:g}{mb}_s{self.seed}"

    def length(self, steps: int, every: int) -> tuple[int, int]:
        """(train.steps, eval.every_steps) of this run, given the experiment's."""
        return (self.pilot_steps, self.pilot_steps) if self.pilot_steps else (steps, every)

    @property
    def setting(self) -> "Setting":
        return Setting(self.lr, self.minibatches)

    def overrides(self, steps: int, every: int) -> list[str]:
        steps, every = self.length(steps, every)
        m = METHODS[self.method]
        out = list(m.overrides)
        if not m.eta_free:
            out.append(f"algo.max_head_offpolicyness={self.eta}")
        k = method_window(self.method, self.eta)
        if k is not None:
            out.append(f"algo.k={k}")
        out += [f"optim.lr={self.lr}", f"train.seed={self.seed}", f"train.steps={steps}",
                f"eval.every_steps={every}"]
        if self.minibatches:
            out.append(f"algo.ppo_n_minibatches={self.minibatches}")
        return out


@dataclass(frozen=True)
class Setting:
    """A point of the tuning grid: learning rate and (optionally) optimizer steps per batch."""

    lr: float
    minibatches: int | None = None

    @property
    def label(self) -> str:
        return f"lr {self.lr:g}" + (f", {self.minibatches} mb" if self.minibatches else "")


@dataclass
class Curve:
    """Held-out accuracy at each evaluation; index 0 is the warm start (step 0, 0 samples).
    `marks`: the sample mark each evaluation was scheduled for (eval.every_samples; the budget at
    the last one), empty for step-scheduled runs; `sampled`: avg@k at temperature 1
    (eval.sampled_k), empty when not measured."""

    steps: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)
    sampled: list[float] = field(default_factory=list)

    def scored_on(self, which: str) -> "Curve":
        """This curve with `accuracy` the greedy figure ("greedy") or the sampled one ("sampled")."""
        if which == "greedy":
            return self
        if which != "sampled" or len(self.sampled) != len(self.accuracy):
            raise ValueError(f"curve: no {which!r} accuracy at every point (eval.sampled_k unset?)")
        return Curve(self.steps, self.samples, self.wall_s, list(self.sampled), self.marks, self.sampled)


@dataclass
class RunResult:
    """What one finished run measured (read back from its run folder)."""

    spec: RunSpec
    curve: Curve
    staleness_mean: float | None  # mean over steps of the trained batch's mean staleness
    staleness_max: float | None  # largest staleness of any trained sequence
    ess_min: float | None  # smallest per-step ESS fraction of the trained batch
    train_wall_s: float  # the training loop's wall-clock, evaluations excluded
    nonfinite_loss: bool  # a NaN/inf train/loss was logged
    samples_generated: float
    steps_per_s: float
    run_cost: dict | None = None  # wall_s, cpu_s (all processes) and load of the run's own invocation
    # drift diagnostics, means over the steps that log them (None where none does):
    clip_frac: float | None = None  # share of tokens the PPO clip acts on (`train/clip_frac`)
    ess_oldest: float | None = None  # ESS fraction of the step's oldest behavior version (`algo/ess_frac/v{k}`)
    kl_k3: float | None = None  # KL(mu || pi_prox) estimate k3 over the batch (`algo/kl_k3`)
    reused_frac: float | None = None  # share of trained groups trained before (`replay/reused_frac`)
    clip_frac_behavior: float | None = None  # share of tokens a clip anchored at mu acts on (`algo/clip_frac_behavior`)
    # the run's totals, from the last metrics row that logs them (None where no row does, as in
    # runs made before the counter existed: unknown, not 0):
    evicted_untrained: float | None = None  # groups that left the replay pool never trained
    filtered_groups: float | None = None  # groups selection filtered out (`replay/filtered_groups`)
    # engine-learner mismatch at the same version, means over the steps that log it (`algo/mismatch_*`)
    mismatch_abs_mean: float | None = None
    mismatch_kl: float | None = None
    mismatch_clip_frac: float | None = None  # tokens a PPO ratio would clip at lr 0

    @property
    def final_accuracy(self) -> float:
        return self.curve.accuracy[-1]
