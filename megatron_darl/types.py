"""The only values that cross process boundaries: trajectories, train batches, weight versions,
and the generate requests and responses of the engine protocol.

What it is: plain dataclasses over numpy arrays, with a flat-array form (`to_arrays` /
`from_arrays`) that the shared-memory ring buffer stores byte for byte and reads back as
zero-copy views. No pickle anywhere: every field is a fixed-dtype array or UTF-8 JSON bytes.
`SamplingParams`, `GenerateRequest` and `GenerateResponse` are what the rollout manager and
evaluation send to an engine over SGLang's HTTP protocol and get back (the bodies are built and
parsed in `rollout/sglang_requests.py` and `engine/requests.py`).
What it is not: a container for model state or config; those never leave their process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# finish reasons as SGLang reports them (meta_info.finish_reason.type); codes for flat storage
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# The flat form of a Trajectory: field name -> dtype, in storage order. Scalars are stored as
# arrays of length 1 so that every field is a 1-D array a reader can view without copying.
TRAJECTORY_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("prompt_ids", np.dtype(np.int32)),
    ("response_ids", np.dtype(np.int32)),
    ("behav_logprobs", np.dtype(np.float32)),
    ("behav_versions", np.dtype(np.int32)),
    ("reward", np.dtype(np.float32)),
    ("prompt_id", np.dtype(np.int64)),
    ("group_id", np.dtype(np.int64)),
    ("finish_reason", np.dtype(np.int8)),
    ("metadata", np.dtype(np.uint8)),
    ("policy_mask", np.dtype(np.uint8)),
)
# fields that a record written before they existed lacks (a replay-store checkpoint of an earlier
# release): `from_arrays` gives them their default
DEFAULTED_FIELDS: tuple[str, ...] = ("policy_mask",)


@dataclass
class Trajectory:
    """One response to one prompt, as the rollout engine produced it.

    A partial rollout interrupted by a weight update spans several behavior versions, so the
    version is per token (`behav_versions`), next to the behavior log-prob of each token under
    the sampling temperature (`behav_logprobs`). The G responses of one prompt share `group_id`.
    A multi-turn response also holds tokens the policy did not sample (a tool's output, inserted
    by the rollout): `policy_mask` is 0 there, and those tokens have no behavior log-prob (0.0)
    and no version (-1). The learner conditions on them and never trains them.
    """

    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    behav_logprobs: np.ndarray  # float32 [R], log mu(y_t) of each sampled token
    behav_versions: np.ndarray  # int32 [R], weight version that sampled each token
    reward: float
    prompt_id: int  # unique per prompt draw: the unit of "trained exactly once" accounting
    group_id: int  # the G responses of one prompt share it; a group is never split
    finish_reason: str = "stop"  # one of FINISH_REASONS
    metadata: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable only
    policy_mask: np.ndarray | None = None  # uint8 [R]: 1 sampled by the policy, 0 tool output; None: all 1

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int32)
        self.behav_logprobs = np.asarray(self.behav_logprobs, dtype=np.float32)
        self.behav_versions = np.asarray(self.behav_versions, dtype=np.int32)
        n = len(self.response_ids)
        if self.policy_mask is None:
            self.policy_mask = np.ones(n, dtype=np.uint8)
        self.policy_mask = np.asarray(self.policy_mask, dtype=np.uint8)
        if len(self.behav_logprobs) != n or len(self.behav_versions) != n or len(self.policy_mask) != n:
            raise ValueError(
                f"Trajectory(prompt_id={self.prompt_id}): response_ids has {n} tokens but "
                f"behav_logprobs has {len(self.behav_logprobs)}, behav_versions "
                f"{len(self.behav_versions)} and policy_mask {len(self.policy_mask)}; they must match "
                f"token for token"
            )
        if int(self.policy_mask.max(initial=0)) > 1:  # a weight of 2 would count a token twice
            raise ValueError(f"Trajectory(prompt_id={self.prompt_id}): policy_mask holds "
                             f"{int(self.policy_mask.max())}; allowed: 0 (tool output) and 1 (sampled by the policy)")
        if not self.policy_mask.all():
            self._check_tool_tokens()
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Trajectory.finish_reason={self.finish_reason!r}; allowed: {FINISH_REASONS}"
            )

    def _check_tool_tokens(self) -> None:
        """Tokens the policy did not sample carry no version (-1) and no log-prob (0.0)."""
        tool = self.policy_mask == 0
        if (self.behav_versions[tool] != -1).any() or (self.behav_logprobs[tool] != 0.0).any():
            at = int(np.flatnonzero(tool & ((self.behav_versions != -1) | (self.behav_logprobs != 0.0)))[0])
            raise ValueError(
                f"Trajectory(prompt_id={self.prompt_id}): response token {at} is tool output (policy_mask 0) "
                f"but has version {int(self.behav_versions[at])} and log-prob {float(self.behav_logprobs[at])}; "
                f"tool output has neither (version -1, log-prob 0.0)"
            )

    @property
    def version(self) -> int:
        """Behavior version of the sequence: the oldest version among the tokens the policy
        sampled (staleness is measured from the oldest policy that contributed), -1 when it
        sampled none."""
        sampled = self.behav_versions[self.policy_mask > 0]
        return int(sampled.min()) if len(sampled) else -1

    @property
    def num_policy_tokens(self) -> int:
        return int(self.policy_mask.sum())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat form: one 1-D array per field of TRAJECTORY_FIELDS, in that order."""
        meta = json.dumps(self.metadata, separators=(",", ":"), sort_keys=True).encode("utf-8")
        values = {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "behav_logprobs": self.behav_logprobs,
            "behav_versions": self.behav_versions,
            "reward": np.array([self.reward]),
            "prompt_id": np.array([self.prompt_id]),
            "group_id": np.array([self.group_id]),
            "finish_reason": np.array([FINISH_REASONS.index(self.finish_reason)]),
            "metadata": np.frombuffer(meta, dtype=np.uint8),
            "policy_mask": self.policy_mask,
        }
        return {name: np.ascontiguousarray(values[name], dtype=dt) for name, dt in TRAJECTORY_FIELDS}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "Trajectory":
        """Inverse of `to_arrays`. Token arrays are kept as given (views stay views); a record
        of an earlier release without `policy_mask` reads as all policy tokens."""
        missing = [name for name, _ in TRAJECTORY_FIELDS if name not in arrays and name not in DEFAULTED_FIELDS]
        if missing:
            raise KeyError(f"Trajectory.from_arrays: missing fields {missing}")
        code = int(arrays["finish_reason"][0])
        if not 0 <= code < len(FINISH_REASONS):
            raise ValueError(f"Trajectory.from_arrays: finish_reason code {code} out of range")
        meta = bytes(arrays["metadata"]).decode("utf-8")
        return cls(
            prompt_ids=arrays["prompt_ids"],
            response_ids=arrays["response_ids"],
            behav_logprobs=arrays["behav_logprobs"],
            behav_versions=arrays["behav_versions"],
            reward=float(arrays["reward"][0]),
            prompt_id=int(arrays["prompt_id"][0]),
            group_id=int(arrays["group_id"][0]),
            finish_reason=FINISH_REASONS[code],
            metadata=json.loads(meta) if meta else {},
            policy_mask=arrays.get("policy_mask"),
        )


def group_trajectories(trajs: list[Trajectory]) -> dict[int, list[Trajectory]]:
    """Group responses by `group_id`, keeping arrival order inside each group."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    return groups


@dataclass
class TrainBatch:
    """What the learner trains on: B sequences, right-padded to a common length L.

    `tokens[i, :lengths[i]]` is prompt followed by response; `loss_mask` is 1 on response tokens
    that count. Per-token log-prob arrays are aligned with `tokens` (the value at position t is
    the log-prob of tokens[i, t] given the tokens before it; 0 on prompt and padding).
    `prox_logprobs` is filled by the learner's recompute pass when the algorithm needs it.
    """

    tokens: np.ndarray  # int64 [B, L]
    lengths: np.ndarray  # int64 [B]
    loss_mask: np.ndarray  # float32 [B, L]
    advantages: np.ndarray  # float32 [B]
    behav_logprobs: np.ndarray  # float32 [B, L]
    token_versions: np.ndarray  # int64 [B, L], -1 off the response
    versions: np.ndarray  # int64 [B], per-sequence behavior version (Trajectory.version)
    group_index: np.ndarray  # int64 [B], dense 0..G-1 index of each sequence's group
    rewards: np.ndarray  # float32 [B]
    prompt_ids: np.ndarray  # int64 [B]
    prox_logprobs: np.ndarray | None = None  # float32 [B, L], learner-filled
    # float32 [B, L] per kept version k: log mu_k of every token (pmis_beta=balance, exact snapshots)
    behav_logprobs_by_version: dict[int, np.ndarray] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass(frozen=True)
class WeightVersion:
    """A published set of policy weights: what engines load to move to `version`.

    `weight_sync` is how this version reaches the engines: the `rollout.weight_sync` setting as
    `RolloutConfig.effective_weight_sync` resolves it. "shm" and "disk": `location` is a folder
    of Hugging Face-named safetensors that engines load with /update_weights_from_disk, under
    /dev/shm (embedded engines beside the learner) or on a shared file system. "distributed":
    the learner broadcasts the tensors to the paused engines over a process group
    (`rollout/weight_push.py`); there is no folder, and `location` is only a label,
    `<learner address>#v<version>`.
    Serialized as JSON under these field names; files written before the field was renamed
    call it `kind` (`channel/weight_notice.weight_version_from_json` reads both).
    """

    version: int
    weight_sync: str  # "shm" | "disk" | "distributed"
    location: str
    num_bytes: int = 0


def make_train_batch(trajs: list[Trajectory], advantages: np.ndarray) -> TrainBatch:
    """Pad trajectories into a TrainBatch; `advantages[i]` belongs to `trajs[i]`.

    Groups keep their order; `group_index` renumbers group ids densely in order of appearance.
    """
    if not trajs:
        raise ValueError("make_train_batch: no trajectories")
    b = len(trajs)
    lengths = np.array([t.num_tokens for t in trajs], dtype=np.int64)
    width = int(lengths.max())
    tokens = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.float32)
    behav = np.zeros((b, width), dtype=np.float32)
    tver = np.full((b, width), -1, dtype=np.int64)
    dense: dict[int, int] = {}
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        tokens[i, :p] = t.prompt_ids
        tokens[i, p : p + r] = t.response_ids
        mask[i, p : p + r] = t.policy_mask  # tool output is context, never a trained token
        behav[i, p : p + r] = t.behav_logprobs
        tver[i, p : p + r] = t.behav_versions
        dense.setdefault(t.group_id, len(dense))
    return TrainBatch(
        tokens=tokens,
        lengths=lengths,
        loss_mask=mask,
        advantages=np.asarray(advantages, dtype=np.float32).reshape(b),
        behav_logprobs=behav,
        token_versions=tver,
        versions=np.array([t.version for t in trajs], dtype=np.int64),
        group_index=np.array([dense[t.group_id] for t in trajs], dtype=np.int64),
        rewards=np.array([t.reward for t in trajs], dtype=np.float32),
        prompt_ids=np.array([t.prompt_id for t in trajs], dtype=np.int64),
    )


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class SamplingParams:
    """The subset of SGLang `sampling_params` an RL rollout uses. `to_json` gives SGLang's
    field names: `seed` travels as `sampling_seed` (SGLang's SamplingParams is a strict struct:
    an unknown key fails the whole request)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation (SGLang's convention)
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # per-request sampler seed (SGLang: `sampling_seed`, an int64)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": int(self.max_new_tokens),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "ignore_eos": bool(self.ignore_eos),
        }
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        return d


@dataclass
class GenerateRequest:
    """One sequence to continue: `input_ids` is the prompt plus any partial response so far."""

    input_ids: list[int]
    sampling: SamplingParams
    rid: str  # request id, used by /abort_request


@dataclass
class GenerateResponse:
    """What came back for one request. `output_versions[t]` is the weight version that sampled
    token t, read from the answer's `meta_info.weight_versions` spans (`[{version, start,
    end}]`, one per version that produced tokens; SGLang and the embedded engine both send
    them), or from its single `weight_version` when a server sends no spans."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    meta: dict[str, Any] = field(default_factory=dict)
