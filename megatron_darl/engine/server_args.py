"""`darl-engine`'s command line: the argv that starts one engine, and the parser that reads it.

What it is: `engine_command` (the argv of one engine, for tests, benches and restarts that start
one by hand), `build_parser` (every flag `darl-engine` takes, with its default and help) and
`limits_from` (the request bounds those flags set, as `http_io.Limits`).
What it is not: the server or its startup (`server.py`'s `main` loads the model and serves), nor
the command the launcher builds from a run's config (`command.py`'s `EngineSpec`).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_darl.engine.decoder import ENGINE_DTYPES
from megatron_darl.engine.http_io import Limits


def engine_command(model_dir: str, port: int, host: str = "127.0.0.1", api_key: str | None = None,
                   threads: int = 1, max_batch: int = 64, python: str = sys.executable,
                   dtype: str = "float32") -> list[str]:
    """The argv that starts one engine (what `darl-engine` runs), for launchers and restarts.

    Args:
        model_dir: the HF model folder the engine loads (`--model`).
        port: the TCP port to listen on (`--port`).
        host: the address to bind (`--host`); the default serves this machine only.
        api_key: the bearer token every request must carry (`--api-key`); None or empty: no flag, so the
            engine falls back to `$DARL_ENGINE_API_KEY` (none if unset).
        threads: torch threads of the engine process (`--threads`).
        max_batch: the most sequences decoded together (`--max-batch`).
        python: the interpreter that runs `-m megatron_darl.engine`; the default is this process's.
        dtype: the engine dtype (`--dtype`: float32, bfloat16, float16); float32 adds no flag.
    """
    cmd = [python, "-m", "megatron_darl.engine", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch)]
    cmd += ["--dtype", dtype] if dtype != "float32" else []
    return cmd + (["--api-key", api_key] if api_key else [])


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _add_limit_flags(ap: argparse.ArgumentParser) -> None:
    d = Limits()
    ap.add_argument("--max-prompts-per-request", type=_positive(int), default=d.max_prompts,
                    help=f"prompts in one /generate request at most (413 beyond; default {d.max_prompts})")
    ap.add_argument("--max-request-tokens", type=_positive(int), default=d.max_tokens,
                    help=f"prompt tokens of one request, summed, at most (413 beyond; default {d.max_tokens})")
    ap.add_argument("--max-body-mb", type=_positive(float), default=d.max_body_bytes / 1024**2,
                    help=f"request body size in MiB at most (413 beyond; default {d.max_body_bytes // 1024**2})")
    ap.add_argument("--body-timeout-s", type=_positive(float), default=d.body_timeout_s,
                    help=f"seconds to receive a request body (408 and closed after; default {d.body_timeout_s:g})")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `darl-engine --model HF_DIR --host 127.0.0.1 --port P [--api-key K] [--threads N]
    [--max-batch N] [--dtype float32|bfloat16|float16] [--max-prompts-per-request N]
    [--max-request-tokens N] [--max-body-mb M] [--body-timeout-s S]`."""
    ap = argparse.ArgumentParser(prog="darl-engine",
                                 description="Embedded rollout engine speaking SGLang's HTTP protocol.")
    ap.add_argument("--model", required=True, help="HF model folder (config.json + *.safetensors)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=os.environ.get("DARL_ENGINE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every request (default: $DARL_ENGINE_API_KEY)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 beats 2 on a shared small box)")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences decoded together at most")
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without a seed")
    ap.add_argument("--dtype", default="float32", choices=sorted(ENGINE_DTYPES),
                    help="weights, activations and KV cache (default float32; logits and log-probs stay fp32)")
    _add_limit_flags(ap)
    return ap


def limits_from(args: argparse.Namespace) -> Limits:
    """The request bounds of the parsed flags (`--max-prompts-per-request` and the others)."""
    return Limits(max_prompts=args.max_prompts_per_request, max_tokens=args.max_request_tokens,
                  max_body_bytes=int(args.max_body_mb * 1024**2), body_timeout_s=args.body_timeout_s)
