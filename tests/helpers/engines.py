"""Tiny random models and darl-engine processes for the engine, rollout and fault tests.

What it is: `TINY_QWEN3` and `TINY_QWEN3_WIDE` (the shapes the engine tests use), `save_tiny` (a random tiny Qwen3,
Qwen2 or Llama saved as a Hugging Face folder, optionally with randomised norms and biases so a
wrong norm or a dropped bias shows in the log-probs), `teacher_forced` (transformers' log-probs of
a response, the reference the engine's behavior log-probs are compared with), `running_engines`
(darl-engine subprocesses on free loopback ports, waited for and always stopped), `running_standin`
(the same for the SGLang stand-in, `sglang_standin.py`), `serving` (an engine server built in the
test's own process, on a free loopback port), `asend_first_bucket_only` (the test as the
learner, sending the first bucket of a version and stopping) and `asession_answers` (what an
engine answers to the weight-update session's calls, in and out of order).
What it is not: a test, or a stand-in for an engine (`rollout_fakes.FakeEngine`,
`sglang_standin.py`).
"""

from __future__ import annotations

import subprocess
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from megatron_darl.channel.ports import free_port
from tests.helpers import REPO, repo_env

TINY_QWEN3: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=95, bos_token_id=94)
# wider, with larger initial weights and no end token: the engine server and weight-group tests,
# whose log-probs must differ measurably between two seeds
TINY_QWEN3_WIDE: dict[str, Any] = dict(
    vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=False)


def save_tiny(path: Path | str, seed: int = 0, config: dict[str, Any] | None = None, arch: str = "qwen3",
              random_norms: bool = False, **overrides: Any):
    """Save a random tiny model of `config` (default `TINY_QWEN3`) plus `overrides` at `path`;
    returns the model (eval mode)."""
    import torch
    import transformers

    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**(TINY_QWEN3 if config is None else config), **overrides})).eval()
    if random_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    return model


def save_wide(path: Path | str, seed: int = 0, **overrides: Any):
    """`save_tiny` of `TINY_QWEN3_WIDE` with randomised norms (the engine server's models)."""
    return save_tiny(path, seed, config=TINY_QWEN3_WIDE, random_norms=True, **overrides)


def teacher_forced(model, prompt: list[int], out: list[int], temperature: float):
    """Per-token log-probs of `out` after `prompt` under `model` at `temperature`."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(out)[:, None]).squeeze(1)


@asynccontextmanager
async def serving(server) -> AsyncIterator[str]:
    """An `engine.server.EngineServer` built in this process (to inject a fault) served on a free
    loopback port: yields its URL, and stops it on exit."""
    from aiohttp import web

    runner = web.AppRunner(server.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextmanager
def running_engines(specs: list[tuple[Path, str | None]], log_dir: Path, max_batch: int = 32,
                    startup_s: float = 60.0,
                    extra_args: tuple[str, ...] = ()) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """One darl-engine per (model_dir, api_key) with `extra_args` (more darl-engine flags), each
    logging to `<log_dir>/engine<i>.log`; yields their (url, process) once all answer /health, and
    always stops them on exit."""
    from megatron_darl.engine.server import engine_command
    from megatron_darl.launch.engine_host import healthy

    procs, urls, logs = [], [], []
    env = repo_env(OMP_NUM_THREADS="1")
    try:
        for i, (model_dir, key) in enumerate(specs):
            port = free_port()
            logs.append(open(Path(log_dir) / f"engine{i}.log", "w"))
            argv = engine_command(str(model_dir), port, api_key=key, max_batch=max_batch) + list(extra_args)
            procs.append(subprocess.Popen(argv,
                                          stdout=logs[-1], stderr=subprocess.STDOUT, env=env, cwd=REPO))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + startup_s
        for i, ((_, key), proc, url) in enumerate(zip(specs, procs, urls)):
            while not healthy(url, key):  # the launcher's own readiness check
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = (Path(log_dir) / f"engine{i}.log").read_text()[-3000:]
                    raise AssertionError(f"darl-engine {url} did not start:\n{text}")
                time.sleep(0.2)
        yield list(zip(urls, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


@contextmanager
def running_standin(model_dir: Path | str, log_dir: Path, startup_s: float = 90.0) -> Iterator[tuple[str, Path]]:
    """The SGLang stand-in of the pinned release (`sglang_standin.py`, the release read by
    `require_release`, which skips offline) on a free loopback port; yields (URL, its call log)
    once it answers, and always stops it."""
    import sys

    from megatron_darl.launch.engine_host import healthy
    from tests.helpers.sglang_release import require_release

    release = require_release()
    port, calls = free_port(), Path(log_dir) / "standin_calls.jsonl"
    log = open(Path(log_dir) / "standin.log", "w")
    argv = [sys.executable, "-m", "tests.helpers.sglang_standin", "--model", str(model_dir), "--port", str(port),
            "--release-root", release.root, "--version", release.version, "--calls", str(calls)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=repo_env(OMP_NUM_THREADS="1"), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while not healthy(url, None):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the stand-in did not start:\n"
                                     f"{(Path(log_dir) / 'standin.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, calls
    finally:
        proc.kill()
        proc.wait()
        log.close()


async def asend_first_bucket_only(url: str, bucket: list, name: str) -> None:
    """Be the learner (rank 0 over gloo) for one version that stops after its first bucket:
    join group `name`, open the session, send `bucket` without a weight_version, close the
    session and the group. The engine is left with part of a version."""
    import asyncio

    import torch.distributed as dist

    from megatron_darl.channel.process_group import init_custom_group
    from megatron_darl.learner.weights import describe
    from megatron_darl.rollout.sglang_client import SGLangClient
    from megatron_darl.trainer.weight_sender import _broadcast

    async with SGLangClient(url, max_retries=0) as c:
        port = free_port("127.0.0.1")
        host = asyncio.to_thread(init_custom_group, "127.0.0.1", port, 2, name, 0, "gloo", 20.0)
        _, group = await asyncio.gather(c.ainit_weights_update_group("127.0.0.1", port, 1, 2, name, "gloo"), host)
        await c.abegin_weight_update()
        post = c.aupdate_weights_from_distributed(**describe(bucket), version=None, group_name=name, flush_cache=False)
        await asyncio.gather(post, asyncio.to_thread(_broadcast, group, bucket, "cpu"))
        await c.aend_weight_update()
        await c.adestroy_weights_update_group(name)
    dist.destroy_process_group(group)


SESSION_CALLS = (("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                       "shapes": [[48]], "group_name": "g"}),
                 ("/end_weight_update", {}), ("/begin_weight_update", {"selector": "all"}),
                 ("/begin_weight_update", {}), ("/end_weight_update", {}), ("/end_weight_update", {}))


async def asession_answers(url: str) -> list[tuple[str, int, str]]:
    """(route, status, message) for SESSION_CALLS, in order: a bucket outside a session, an end
    without a begin, a begin, a second begin, an end, a second end."""
    import json

    from megatron_darl.rollout.sglang_client import EngineHTTPError, SGLangClient

    out = []
    async with SGLangClient(url, max_retries=0) as c:
        for route, body in SESSION_CALLS:
            try:
                out.append((route, 200, (await c.arequest("POST", route, body))["message"]))
            except EngineHTTPError as exc:
                out.append((route, exc.status, json.loads(exc.body).get("message")))
    return out
