"""The embedded engine's side of SGLang's /generate: request validation and answer shapes (no I/O).

What it is: `parse_generate` turns a /generate body into (rid, input_ids, SamplingParams)
items, validating every field's type and range and answering `BadRequest` (HTTP 400) with the
field named; `response_json` writes a finished sequence the way SGLang 0.5.23 answers, with
`meta_info.weight_versions` spans (`[{"version", "start", "end"}]`) for the per-token versions,
and prompt log-probs from `logprob_start_len` (`parse_logprob_starts`, `prompt_logprob_entries`).
`sampling_params` is as strict as SGLang's own `SamplingParams` struct: a key SGLang does not
know (e.g. `seed` instead of `sampling_seed`) fails the request, so nothing can pass here and
fail on SGLang; SGLang fields this engine cannot honour (stop strings, penalties, grammars, ...)
are accepted at their neutral values only. The release's field list is pinned by a test
against its wheel (tests/unit/rollout/test_sglang_conformance.py). Where SGLang 0.5.23 decides a
value (a temperature below `SAMPLING_EPS` is greedy; a prompt plus an explicit `max_new_tokens`
beyond the model's context is refused) this does the same. Work per request is bounded: at most
`max_prompts` prompts and `max_tokens` prompt tokens (`TooLarge`, HTTP 413, naming the limit and
its darl-engine flag). `weight_version` only moves forward (`parse_weight_version`).
What it is not: the server (`server.py`), the reading of bodies (`http_io.py`) or the client side
(`sglang_requests.py`).
"""

from __future__ import annotations

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


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has no max_new_tokens
MAX_PROMPTS = 1024  # darl-engine --max-prompts-per-request (the rollout manager sends one per request)
MAX_REQUEST_TOKENS = 262144  # darl-engine --max-request-tokens: prompt tokens of one request, summed


class BadRequest(ValueError):
    """A malformed request body; the message names the field (answered with HTTP 400)."""

    status = 400


class TooLarge(BadRequest):
    """A request beyond a darl-engine bound; the message names the field and the limit (HTTP 413)."""

    status = 413


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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


def _integer(raw: dict, name: str, default: int | None, where: str, lo: int = INT64[0],
             hi: int = INT64[1]) -> int | None:
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
            raise BadRequest(f"field '{where}{key}' is unknown: SGLang's sampling_params are "
                             f"{list(SGLANG_SAMPLING_FIELDS)}")
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
        max_new_tokens=_integer(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, where, lo=1),
        stop_token_ids=list(stops), ignore_eos=bool(ignore_eos),
        seed=_integer(raw, "sampling_seed", None, where),  # SGLang's range: an int64
    )


def _prompts(body: dict, vocab_size: int, max_prompts: int, max_tokens: int,
             context: int | None) -> tuple[list[list[int]], bool]:
    """`input_ids` -> (prompts, batched?), the cheap bounds (count, lengths, total) checked
    before any token is looked at."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("field 'input_ids' is required: a non-empty list of token ids (or a list of such lists)")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    if len(prompts) > max_prompts:
        raise TooLarge(f"field 'input_ids' holds {len(prompts)} prompts; at most {max_prompts} per request "
                       "(darl-engine --max-prompts-per-request)")
    total = 0
    for i, p in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(p, list) or not p:
            raise BadRequest(f"field '{where}' must be a non-empty list of token ids in [0, {vocab_size})")
        if context is not None and len(p) >= context:  # sglang tokenizer_manager._validate_one_request
            raise BadRequest(f"field '{where}': the input ({len(p)} tokens) is longer than the model's "
                             f"context length ({context} tokens)")
        total += len(p)
    if total > max_tokens:
        raise TooLarge(f"field 'input_ids' holds {total} tokens; at most {max_tokens} per request "
                       "(darl-engine --max-request-tokens)")
    for i, p in enumerate(prompts):
        if not all(type(t) is int and 0 <= t < vocab_size for t in p):  # no bools, no floats
            where = f"input_ids[{i}]" if batched else "input_ids"
            raise BadRequest(f"field '{where}' must be a non-empty list of token ids in [0, {vocab_size})")
    return [list(p) for p in prompts], batched


def _check_context(prompts: list[list[int]], raw_sp: Any, sps: list[SamplingParams], context: int) -> None:
    """SGLang 0.5.23 refuses a prompt plus an explicit max_new_tokens beyond the model's context
    (tokenizer_manager._validate_one_request, without --allow-auto-truncate); without
    max_new_tokens it decodes its default and stops at the context (finish_reason length)."""
    raws = raw_sp if isinstance(raw_sp, list) else [raw_sp] * len(prompts)
    for i, (p, raw, sp) in enumerate(zip(prompts, raws, sps, strict=True)):
        if isinstance(raw, dict) and raw.get("max_new_tokens") is not None and len(p) + sp.max_new_tokens > context:
            where = f"sampling_params[{i}]." if isinstance(raw_sp, list) else "sampling_params."
            raise BadRequest(f"field '{where}max_new_tokens': requested token count exceeds the model's maximum "
                             f"context length of {context} tokens: {len(p)} input + {sp.max_new_tokens} new "
                             f"= {len(p) + sp.max_new_tokens}")


def parse_generate(body: dict, vocab_size: int, max_prompts: int = MAX_PROMPTS, max_tokens: int = MAX_REQUEST_TOKENS,
                   context: int | None = None) -> tuple[list[tuple[str, list[int], SamplingParams]], bool]:
    """A /generate body -> ([(rid, input_ids, sampling)], batched?). `context`: the model's
    positions (None: unchecked)."""
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
    prompts, batched = _prompts(body, vocab_size, max_prompts, max_tokens, context)
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise BadRequest(f"field 'sampling_params' has {len(raw_sp)} entries for {len(prompts)} prompts")
        sps = [parse_sampling(s, f"sampling_params[{i}].") for i, s in enumerate(raw_sp)]
    else:
        sps = [parse_sampling(raw_sp)] * len(prompts)
    if context is not None:
        _check_context(prompts, raw_sp, sps, context)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif batched and isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        rids = rid
    elif not batched and isinstance(rid, str) and rid:
        rids = [rid]
    else:
        raise BadRequest("field 'rid' must be a non-empty string (a list of strings, one per prompt, for batched "
                         "input_ids)")
    return list(zip(rids, prompts, sps, strict=True)), batched


def parse_logprob_starts(body: dict, prompts: list[list[int]]) -> list[int]:
    """`logprob_start_len` (one int for every prompt, or a list with one per prompt) -> per prompt
    the first position whose prompt log-prob is answered in `input_token_logprobs`, -1 for none
    (absent, -1, or no `return_logprob`: SGLang 0.5.23 then ignores it, scheduler.py:3256-3258).
    A start beyond the prompt is refused with SGLang's own message (scheduler.py:3275-3280,
    where it aborts the request)."""
    raw = body.get("logprob_start_len")
    if raw is None or not body.get("return_logprob"):
        return [-1] * len(prompts)
    starts = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(starts) != len(prompts) or not all(_is_int(x) for x in starts):
        raise BadRequest(f"field 'logprob_start_len' must be an integer (or one per prompt, {len(prompts)}), "
                         f"got {_short(raw)}")
    for p, start in zip(prompts, starts):
        if start < -1:
            raise BadRequest(f"field 'logprob_start_len' must be -1 (none) or >= 0, got {start}")
        if start > len(p):
            raise BadRequest(f"field 'logprob_start_len': req.logprob_start_len={start} is higher than the number "
                             f"of input tokens len(req.origin_input_ids)={len(p)}. Please use a smaller "
                             "logprob_start_len.")
    return [int(x) for x in starts]


def prompt_logprob_entries(tokens: list[int], start: int, values: list[float | None] | None) -> list[list]:
    """SGLang's `input_token_logprobs` from `start`: `[logprob, token_id, null]` per prompt token
    `tokens[start:]`, the first one's log-prob null (its logits are not computed:
    `[None] + input_token_logprobs[:-1]`, logprob_result_processor.py:38); [] without a start."""
    if values is None or start < 0:
        return []
    return [[v, t, None] for v, t in zip(values, tokens[start:], strict=True)]


def parse_weight_version(raw: Any, current: int) -> int:
    """`weight_version` of a weight update -> the engine's next version (None: current + 1).
    SGLang keeps whatever string it is sent; this engine keeps an int64 that never goes back, so
    the per-token versions of its answers only grow (the same version again is a reload)."""
    if raw is None:
        return current + 1
    try:
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            raise ValueError
        version = int(raw)
    except ValueError:
        raise BadRequest(f"field 'weight_version' must be an integer (or its decimal string), "
                         f"got {_short(raw)}") from None
    if not 0 <= version <= INT64[1]:
        raise BadRequest(f"field 'weight_version' must be in [0, {INT64[1]}], got {_short(version)}")
    if version < current:
        raise BadRequest(f"field 'weight_version' is {version}, behind the engine's current version {current}: "
                         "versions only move forward")
    return version


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
                  prompt_len: int, latency_s: float, current_version: int,
                  input_logprobs: list[list] | None = None) -> dict:
    """SGLang's /generate answer for one finished (or aborted) request, with return_logprob and
    no tokenizer: `text` is empty and log-prob entries carry no text; `input_logprobs`: the
    prompt's entries (`prompt_logprob_entries`), [] when none were asked for."""
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
            "input_token_logprobs": list(input_logprobs or []),
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, output_ids, strict=False)],
            "output_token_logprobs_length": len(output_ids),
        },
    }
