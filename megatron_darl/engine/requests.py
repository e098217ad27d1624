"""The embedded engine's side of SGLang's /generate: request validation and answer shapes (no I/O).

What it is: `parse_generate` turns a /generate body into (rid, input_ids, SamplingParams)
items, validating every field's type and range and answering `BadRequest` (HTTP 400) with the
field named; `response_json` writes a finished sequence the way SGLang 0.5.23 answers, with
`meta_info.weight_versions` spans (`[{"version", "start", "end"}]`) for the per-token versions.
`sampling_params` is as strict as SGLang's own `SamplingParams` struct: a key SGLang does not
know (e.g. `seed` instead of `sampling_seed`) fails the request, so nothing can pass here and
fail on SGLang; SGLang fields this engine cannot honour (stop strings, penalties, grammars, ...)
are accepted at their neutral values only. The release's field list is pinned by a test
against its wheel (tests/unit/rollout/test_sglang_conformance.py). A temperature below
`SAMPLING_EPS` is greedy, as SGLang 0.5.23 decides it.
What it is not: the server (`server.py`) or the client side (`sglang_requests.py`).
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

from megatron_darl.engine.sampling import SAMPLING_EPS
from megatron_darl.types import SamplingParams

INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_TOKEN_IDS = 1024

# SGLang 0.5.23's sampling_params keys (its api/v1 contract, `_FIELDS_SamplingParams`)
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# fields honoured here; the others are accepted only at a value that changes nothing
SUPPORTED = {"max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "ignore_eos", "sampling_seed"}
NEUTRAL: dict[str, tuple] = {
    "stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "min_new_tokens": (None, 0),
    "n": (None, 1), "json_schema": (None, ""), "regex": (None, ""), "ebnf": (None, ""), "structural_tag": (None, ""),
    "logit_bias": (None, {}), "custom_params": (None, {}), "beam_width": (None, 1), "watermark": (None,),
    "choice": (None, []),
}
TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}  # no text is returned: any bool
TEXT_ONLY_INT = {"stream_interval"}  # no streaming: any int


class BadRequest(ValueError):
    """A malformed request body; the message names the field (answered with HTTP 400)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a number


def _number(raw: dict, name: str, default: float, where: str) -> float:
    v = raw.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise BadRequest(f"field '{where}{name}' must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise BadRequest(f"field '{where}{name}' must be finite, got {v!r}")
    return float(v)


def _integer(raw: dict, name: str, default: int | None, where: str, lo: int = INT64[0], hi: int = INT64[1]) -> int | None:
    v = raw.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise BadRequest(f"field '{where}{name}' must be an integer, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise BadRequest(f"field '{where}{name}' must be in [{lo}, {hi}], got {v}")
    return v


def parse_sampling(raw: object, where: str = "sampling_params.") -> SamplingParams:
    """An SGLang `sampling_params` object -> SamplingParams, every field checked for type and range."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"field '{where.rstrip('.')}' must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if key not in SGLANG_SAMPLING_FIELDS:
            raise BadRequest(f"field '{where}{key}' is unknown: SGLang's sampling_params are {list(SGLANG_SAMPLING_FIELDS)}")
        if key in NEUTRAL and not any(value == n and type(value) is type(n) for n in NEUTRAL[key]):
            raise BadRequest(f"field '{where}{key}'={value!r} is not supported by the embedded engine "
                             f"(accepted: {[n for n in NEUTRAL[key] if n is not None] or 'null'})")
        if key in TEXT_ONLY and value is not None and not isinstance(value, bool):
            raise BadRequest(f"field '{where}{key}' must be a boolean, got {type(value).__name__}")
        if key in TEXT_ONLY_INT:
            _integer(raw, key, None, where)
    temperature = _number(raw, "temperature", 1.0, where)
    if temperature < 0:
        raise BadRequest(f"field '{where}temperature' must be >= 0 (0: greedy), got {temperature}")
    if temperature < SAMPLING_EPS:  # as sglang/srt/sampling/sampling_params.py: below _SAMPLING_EPS, greedy
        temperature = 0.0
    top_p = _number(raw, "top_p", 1.0, where)
    if not 0 < top_p <= 1:
        raise BadRequest(f"field '{where}top_p' must be in (0, 1], got {top_p}")
    top_k = _integer(raw, "top_k", -1, where)
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"field '{where}top_k' must be -1 (no truncation) or >= 1, got {top_k}")
    stops = raw.get("stop_token_ids")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and 0 <= t <= INT64[1] for t in stops):
        raise BadRequest(f"field '{where}stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                         "non-negative integer token ids")
    ignore_eos = raw.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadRequest(f"field '{where}ignore_eos' must be a boolean, got {type(ignore_eos).__name__}")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k,
        max_new_tokens=_integer(raw, "max_new_tokens", 128, where, lo=1),
        stop_token_ids=list(stops), ignore_eos=bool(ignore_eos),
        seed=_integer(raw, "sampling_seed", None, where),  # SGLang's range: an int64
    )


def parse_generate(body: dict, vocab_size: int) -> tuple[list[tuple[str, list[int], SamplingParams]], bool]:
    """A /generate body -> ([(rid, input_ids, sampling)], batched?)."""
    if body.get("text") is not None:
        raise BadRequest("field 'text' is not supported: the embedded engine has no tokenizer; send 'input_ids'")
    if body.get("stream"):
        raise BadRequest("field 'stream' must be false: the embedded engine does not stream")
    for name in ("top_logprobs_num", "token_ids_logprob", "return_hidden_states", "image_data", "lora_path"):
        if body.get(name) not in (None, 0, False, []):
            raise BadRequest(f"field '{name}' is not supported by the embedded engine")
    for name in ("return_logprob",):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"field '{name}' must be a boolean, got {type(body[name]).__name__}")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("field 'input_ids' is required: a non-empty list of token ids (or a list of such lists)")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for i, p in enumerate(prompts):
        ok = isinstance(p, list) and p and all(type(t) is int and 0 <= t < vocab_size for t in p)  # no bools
        if not ok:
            where = f"input_ids[{i}]" if batched else "input_ids"
            raise BadRequest(f"field '{where}' must be a non-empty list of token ids in [0, {vocab_size})")
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise BadRequest(f"field 'sampling_params' has {len(raw_sp)} entries for {len(prompts)} prompts")
        sps = [parse_sampling(s, f"sampling_params[{i}].") for i, s in enumerate(raw_sp)]
    else:
        sps = [parse_sampling(raw_sp)] * len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif batched and isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        rids = rid
    elif not batched and isinstance(rid, str) and rid:
        rids = [rid]
    else:
        raise BadRequest("field 'rid' must be a non-empty string (a list of strings, one per prompt, for batched input_ids)")
    return list(zip(rids, [list(p) for p in prompts], sps)), batched


def weight_version_spans(versions: list[int], current: int) -> list[dict[str, Any]]:
    """Per-token versions -> SGLang's spans: one `{"version", "start", "end"}` per run of tokens
    of one version (half-open over the output); no tokens: one empty span of `current`, as
    sglang's `compute_weight_version_spans` gives."""
    spans: list[dict[str, Any]] = []
    for t, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = t + 1
        else:
            spans.append({"version": str(v), "start": t, "end": t + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


def response_json(rid: str, output_ids: list[int], logprobs: list[float], versions: list[int], finish: dict,
                  prompt_len: int, latency_s: float, current_version: int) -> dict:
    """SGLang's /generate answer for one finished (or aborted) request, with return_logprob and
    no tokenizer: `text` is empty and log-prob entries carry no text."""
    spans = weight_version_spans(versions, current_version)
    if finish.get("type") == "abort":
        finish = {"type": "abort", "message": finish.get("message"), "status_code": None, "err_type": None}
    return {
        "text": "",
        "output_ids": list(output_ids),
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": latency_s,
            "input_token_logprobs": [],
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, output_ids)],
            "output_token_logprobs_length": len(output_ids),
        },
    }


async def read_json_body(request: Any, allow_empty: bool = False) -> dict:
    """The JSON object of an aiohttp request's body (`BadRequest` naming what is wrong otherwise)."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body
