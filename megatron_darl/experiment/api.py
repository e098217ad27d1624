"""Experiment role: the comparison suite of docs/ALGORITHM.md as data (methods, runs, results).

What it is: `METHODS`, each method of the suite as the `darl-train` overrides that make it
(sync, naive async, decoupled PPO with AReaL's cap and with verl's token IS, D-ARL and its
ablations); `RunSpec`, one training run (method, staleness eta, learning rate, seed, phase);
`RunResult`, what a finished run measured (its held-out accuracy curve against steps, generated
samples and wall-clock, the staleness it actually reached, its minimum ESS, its wall time).
What it is not: the runner (`runs.py`), the statistics (`analysis.py`) or the report
(`report.py`); nor a claim about which method wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASELINE_OFF = ["replay.enable=false", "replay.sg=false", "replay.pmis=false"]


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


def _darl(*extra: str) -> tuple[str, ...]:
    return ("algo.policy_loss=darl", "replay.enable=true", "replay.sg=true", "replay.pmis=true",
            "replay.pmis_beta=ess", *extra)


# D-ARL's window follows eta unless an ablation fixes it: with K < eta the store would age out
# groups the staleness gate lets through before they are trained (replay/store.py), which is a
# different experiment from "replay over the K newest versions" (see the K ablations).
DARL_K = "auto"

_METHODS = [
    Method("sync", "sync (eta = 0)", ("staleness.max_head_offpolicyness=0", *BASELINE_OFF, "algo.policy_loss=ppo",
                                      "algo.old_logprob=proximal"), eta_free=True),
    Method("naive", "naive async", (*BASELINE_OFF, "algo.policy_loss=ppo", "algo.old_logprob=behavior",
                                    "algo.recompute_proximal=false")),
    Method("decoupled_areal", "decoupled, AReaL cap 5", (*BASELINE_OFF, "algo.policy_loss=decoupled",
                                                         "algo.behav_weight_cap=5.0")),
    Method("decoupled_verl", "decoupled, verl token IS 2", (*BASELINE_OFF, "algo.policy_loss=ppo",
                                                           "algo.old_logprob=proximal", "algo.rollout_is=token",
                                                           "algo.rollout_is_threshold=2.0")),
    Method("darl", "D-ARL (K = max(2, eta))", _darl()),
    Method("darl_nosel", "D-ARL, no selection", _darl("replay.sg=false"), ablation=True, tune_as="darl"),
    Method("darl_nopmis", "D-ARL, no per-version objective", _darl("replay.pmis=false"), ablation=True,
           tune_as="darl"),
    *[Method(f"darl_k{k}", f"D-ARL, K = {k}", _darl(f"replay.k={k}"), ablation=True, tune_as="darl")
      for k in (1, 2, 4, 8)],
]
METHODS: dict[str, Method] = {m.name: m for m in _METHODS}
MAIN_METHODS = [m.name for m in _METHODS if not m.ablation]
ABLATIONS = [m.name for m in _METHODS if m.ablation]
DECOUPLED = ("decoupled_areal", "decoupled_verl")


def darl_window(eta: int) -> int:
    """K of the `darl` method (and of its selection / P-MIS ablations) at staleness eta."""
    return max(2, eta)


@dataclass(frozen=True)
class RunSpec:
    """One `darl-train` run of the experiment; a tuning run whose settings a main run repeats is
    the same run (same name, done once). `minibatches` None keeps the recipe's
    `algo.ppo_n_minibatches`."""

    method: str
    eta: int
    lr: float
    seed: int
    minibatches: int | None = None

    @property
    def name(self) -> str:
        mb = f"_mb{self.minibatches}" if self.minibatches else ""
        return f"{self.method}_eta{self.eta}_lr{self.lr:g}{mb}_s{self.seed}"

    @property
    def setting(self) -> "Setting":
        return Setting(self.lr, self.minibatches)

    def overrides(self, steps: int, every: int) -> list[str]:
        m = METHODS[self.method]
        out = list(m.overrides)
        if not m.eta_free:
            out.append(f"staleness.max_head_offpolicyness={self.eta}")
        if self.method in ("darl", "darl_nosel", "darl_nopmis"):
            out.append(f"replay.k={darl_window(self.eta)}")
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
    """Held-out accuracy at each evaluation; index 0 is the warm start (step 0, 0 samples)."""

    steps: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)


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

    @property
    def final_accuracy(self) -> float:
        return self.curve.accuracy[-1]
