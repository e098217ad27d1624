"""Request bodies and response parsing for SGLang's HTTP protocol (no I/O).

What it is: pure functions that turn the rollout API's types into the JSON bodies SGLang's
routes take, and SGLang's answers back into `GenerateResponse`, checking every field they
read (a server that answers something else gets a `ResponseFormatError` naming the field).
The transport that sends them is `sglang_client.py`; keeping them apart lets the bodies be
tested without a server, as AReaL does.
What it is not: a transport, or a server-side parser (the embedded engine parses in
`engine_server.py`).
"""

from __future__ import annotations

from typing import Any

from megatron_darl.rollout.api import PAUSE_MODES, GenerateRequest, GenerateResponse
from megatron_darl.types import FINISH_REASONS


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


def update_from_disk_body(model_path: str, version: int, abort_all_requests: bool = False) -> dict[str, Any]:
    """POST /update_weights_from_disk. SGLang stores `weight_version` as a string and echoes it
    in meta_info.weight_version, so the integer version travels as its decimal string."""
    return {
        "model_path": model_path,
        "weight_version": str(version),
        "abort_all_requests": abort_all_requests,
        "flush_cache": True,
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


def update_distributed_body(names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                            group_name: str = "weight_update_group", flush_cache: bool = True) -> dict[str, Any]:
    """POST /update_weights_from_distributed: the engine receives these tensors, in this order,
    from the learner's NCCL broadcast."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": str(version),
    }


def parse_version(raw: Any, default: int) -> int:
    """SGLang's weight_version is a free string ("default" before any update): integers are
    ours, anything else means the engine still runs the weights it started with."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default


def parse_generate(rid: str, data: Any, default_version: int) -> GenerateResponse:
    """SGLang's /generate answer -> GenerateResponse. Per-token versions come from the embedded
    engine's `meta_info.output_token_versions`; SGLang has one `weight_version` per request,
    so then every token is tagged with it."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise ResponseFormatError(f"/generate {rid!r}: expected an object with 'meta_info', got {str(data)[:200]}")
    meta = data["meta_info"]
    out = data.get("output_ids")
    if not isinstance(out, list):
        raise ResponseFormatError(f"/generate {rid!r}: 'output_ids' missing or not a list")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or len(triples) != len(out):
        raise ResponseFormatError(
            f"/generate {rid!r}: 'meta_info.output_token_logprobs' must hold one [logprob, id, text] per output id "
            f"({len(out)}); was return_logprob sent?")
    for i, (t, tok) in enumerate(zip(triples, out)):
        if not isinstance(t, list) or len(t) < 2 or t[1] != tok:
            raise ResponseFormatError(f"/generate {rid!r}: meta_info.output_token_logprobs[{i}]={t!r} does not match output id {tok}")
    version = parse_version(meta.get("weight_version"), default_version)
    versions = meta.get("output_token_versions")
    if versions is None:
        versions = [version] * len(out)
    elif not isinstance(versions, list) or len(versions) != len(out):
        raise ResponseFormatError(f"/generate {rid!r}: 'meta_info.output_token_versions' must have one entry per output id")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_REASONS:
        raise ResponseFormatError(f"/generate {rid!r}: meta_info.finish_reason={reason!r}; expected type in {FINISH_REASONS}")
    return GenerateResponse(
        rid=rid,
        output_ids=[int(x) for x in out],
        output_logprobs=[float(t[0]) for t in triples],
        output_versions=[int(v) for v in versions],
        finish_reason=kind,
        weight_version=version,
        meta={k: meta[k] for k in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency") if k in meta},
    )


def check_success(route: str, data: Any) -> dict[str, Any]:
    """Weight routes answer {"success": bool, "message": str}; a 200 with success=false is an
    error too."""
    if not isinstance(data, dict) or "success" not in data:
        raise ResponseFormatError(f"{route}: expected {{'success', 'message'}}, got {str(data)[:200]}")
    if not data["success"]:
        raise UpdateFailedError(f"{route}: server reports failure: {data.get('message')}")
    return data
