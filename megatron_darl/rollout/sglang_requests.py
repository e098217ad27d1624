"""Request bodies and response parsing for SGLang's HTTP protocol (no I/O).

What it is: pure functions that turn the rollout API's types into the JSON bodies SGLang's
routes take, and SGLang's answers back into `GenerateResponse`, checking every field they
read (a server that answers something else gets a `ResponseFormatError` naming the field).
The transport that sends them is `sglang_client.py`; keeping them apart lets the bodies be
tested without a server, as AReaL does.
What it is not: a transport, or a server-side parser (the embedded engine parses in
`engine/requests.py`).
"""

from __future__ import annotations

import math
from typing import Any

# SGLang 0.5.23's weight-update session (the routes that need one, the release's messages) lives
# in channel/weight_session.py, shared with darl-engine, which holds the rules; re-exported here
from megatron_darl.channel.weight_session import (  # noqa: F401
    NO_SESSION_OPEN,
    SESSION_ALREADY_OPEN,
    SESSION_ROUTES,
    SESSION_SELECTORS,
    session_required,
)
from megatron_darl.types import FINISH_REASONS, PAUSE_MODES, GenerateRequest, GenerateResponse

# The SGLang release this protocol is written and tested against (setup.py's `sglang` extra
# pins it; tests/helpers/sglang_release.py reads that release's own source). See docs/sglang_protocol.md.
SGLANG_VERSION = "0.5.23"


class ResponseFormatError(ValueError):
    """A server answered 2xx with a body that is not what SGLang's protocol says."""


class UpdateFailedError(RuntimeError):
    """A weight route answered 2xx with success=false (the engine keeps its old weights)."""


def generate_body(req: GenerateRequest) -> dict[str, Any]:
    """POST /generate: token ids in, sampled ids and their log-probs out."""
    if not req.input_ids:
        raise ValueError(f"GenerateRequest {req.rid!r}: input_ids is empty")
    return {
        "input_ids": list(req.input_ids),
        "sampling_params": req.sampling.to_json(),
        "return_logprob": True,
        "stream": False,
        "rid": req.rid,
    }


def pause_body(mode: str) -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r}; allowed: {PAUSE_MODES}")
    return {"mode": mode}


def abort_body(rid: str | None, abort_all: bool) -> dict[str, Any]:
    if rid is None and not abort_all:
        raise ValueError("abort_request needs a rid, or abort_all=True")
    return {"rid": rid or "", "abort_all": abort_all}


def flushes_cache(pause_mode: str) -> bool:
    """Whether a weight update may ask SGLang to flush its cache (`flush_cache`) under this pause
    mode. sglang 0.5.23 flushes only when no request holds KV (`Scheduler.flush_cache`:
    `is_fully_idle(ignore_waiting=<paused>)`), and a refused flush fails the update call itself
    ("Weights were updated, but the cache was not flushed ..."). `abort` ends every request and
    `retract` moves the running ones back to the waiting queue without their KV: both flush.
    `in_place` keeps the running batch and its KV: no flush (the prefix cache keeps older
    versions' KV, as the kept requests do)."""
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {pause_mode!r}; allowed: {PAUSE_MODES}")
    return pause_mode != "in_place"


def update_from_disk_body(model_path: str, version: int, abort_all_requests: bool = False,
                          flush_cache: bool = True) -> dict[str, Any]:
    """POST /update_weights_from_disk. SGLang stores `weight_version` as a string and echoes it
    in meta_info.weight_version, so the integer version travels as its decimal string."""
    return {
        "model_path": model_path,
        "weight_version": str(version),
        "abort_all_requests": abort_all_requests,
        "flush_cache": flush_cache,
    }


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int,
                    group_name: str = "weight_update_group", backend: str = "nccl") -> dict[str, Any]:
    """POST /init_weights_update_group: the engine joins the learner's broadcast group."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def update_distributed_body(names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None,
                            group_name: str = "weight_update_group", flush_cache: bool = True,
                            abort_all_requests: bool = False) -> dict[str, Any]:
    """POST /update_weights_from_distributed: the engine receives these tensors, in this order,
    one broadcast each from rank 0 of `group_name`. `version` None leaves the engine's
    weight_version as it is (a bucket before the last of a version)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, "
                         f"{len(shapes)} shapes")
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": None if version is None else str(version),
    }


def begin_session_body(selector: str = "all") -> dict[str, Any]:
    """POST /begin_weight_update: open the weight-update session (all runners: target and draft)."""
    if selector not in SESSION_SELECTORS:
        raise ValueError(f"begin_weight_update selector {selector!r}; allowed: {SESSION_SELECTORS}")
    return {"selector": selector}


def end_session_body() -> dict[str, Any]:
    """POST /end_weight_update: close the session (the release's class has no field of its own)."""
    return {}


def destroy_group_body(group_name: str = "weight_update_group") -> dict[str, Any]:
    """POST /destroy_weights_update_group: the engine leaves and frees the group."""
    return {"group_name": group_name}


def parse_version(raw: Any, default: int) -> int:
    """SGLang's weight_version is a free string ("default" before any update): integers are
    ours, anything else means the engine still runs the weights it started with."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default


def parse_generate(rid: str, data: Any, default_version: int) -> GenerateResponse:
    """SGLang's /generate answer -> GenerateResponse. Besides a normal answer this takes the two
    shapes a pause produces, both normal outcomes: a request aborted while still queued
    (`output_ids: []`, finish_reason abort, empty log-prob lists; SGLang leaves out
    `prompt_tokens` then) and one aborted mid-decode (its partial output with log-probs).
    Per-token versions come from `meta_info.weight_versions`; see `token_versions`."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise ResponseFormatError(f"/generate {rid!r}: expected an object with 'meta_info', got {str(data)[:200]}")
    meta = data["meta_info"]
    out = data.get("output_ids")
    if not isinstance(out, list) or not all(type(t) is int for t in out):
        raise ResponseFormatError(f"/generate {rid!r}: 'output_ids' missing or not a list of token ids")
    logprobs = _output_logprobs(rid, meta, out)
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_REASONS:
        raise ResponseFormatError(f"/generate {rid!r}: meta_info.finish_reason={reason!r}; "
                                  f"expected type in {FINISH_REASONS}")
    version = parse_version(meta.get("weight_version"), default_version)
    return GenerateResponse(
        rid=rid,
        output_ids=list(out),
        output_logprobs=logprobs,
        output_versions=token_versions(rid, meta, len(out), default_version),
        finish_reason=kind,
        weight_version=version,
        meta={k: meta[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                                   "e2e_latency", "weight_versions") if k in meta},
    )


def _output_logprobs(rid: str, meta: dict, out: list[int]) -> list[float]:
    """`meta_info.output_token_logprobs`: one `[logprob, token_id, text]` per output id."""
    triples = meta.get("output_token_logprobs")
    if triples is None and not out:
        return []  # nothing generated: some abort paths send no log-prob lists at all
    if not isinstance(triples, list) or len(triples) != len(out):
        raise ResponseFormatError(
            f"/generate {rid!r}: 'meta_info.output_token_logprobs' must hold one [logprob, id, text] per output id "
            f"({len(out)}); was return_logprob sent?")
    lps = []
    for i, (t, tok) in enumerate(zip(triples, out, strict=True)):
        if not isinstance(t, list) or len(t) < 2 or t[1] != tok or not _is_number(t[0]) or not math.isfinite(t[0]):
            raise ResponseFormatError(f"/generate {rid!r}: meta_info.output_token_logprobs[{i}]={t!r} is not "
                                      f"[finite logprob, {tok}, text]")
        lps.append(float(t[0]))
    return lps


def token_versions(rid: str, meta: dict, n: int, default_version: int) -> list[int]:
    """The weight version of each of the `n` output tokens, from SGLang's per-request spans
    `meta_info.weight_versions = [{"version", "start", "end"}]` (half-open token ranges over the
    output, in order, covering it; written by sglang's `add_weight_versions_to_meta_info`). A
    request that continued across a weight update (pause_mode retract or in_place) has one span
    per version. Without spans every token gets `meta_info.weight_version`."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [parse_version(meta.get("weight_version"), default_version)] * n
    if not isinstance(spans, list):
        raise ResponseFormatError(f"/generate {rid!r}: meta_info.weight_versions must be a list of spans")
    versions: list[int] = []
    for i, span in enumerate(spans):
        ok = isinstance(span, dict) and type(span.get("start")) is int and type(span.get("end")) is int
        if not ok or span["start"] != len(versions) or span["end"] < span["start"]:
            raise ResponseFormatError(f"/generate {rid!r}: meta_info.weight_versions[{i}]={span!r} does not continue "
                                      f"the spans before it at token {len(versions)}")
        versions += [parse_version(span.get("version"), default_version)] * (span["end"] - span["start"])
    if len(versions) != n:
        raise ResponseFormatError(f"/generate {rid!r}: meta_info.weight_versions cover {len(versions)} tokens, "
                                  f"the answer has {n}")
    return versions


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_success(route: str, data: Any) -> dict[str, Any]:
    """Weight routes answer {"success": bool, "message": str}; a 200 with success=false is an
    error too."""
    if not isinstance(data, dict) or "success" not in data:
        raise ResponseFormatError(f"{route}: expected {{'success', 'message'}}, got {str(data)[:200]}")
    if not data["success"]:
        raise UpdateFailedError(f"{route}: server reports failure: {data.get('message')}")
    return data
