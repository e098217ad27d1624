"""Faults and hostile input on the embedded engine, probed as a user's bad day would: each test
reproduces a probe that did not hold and checks that it now does.

- one request never kills the engine: `sampling_seed` 2**64 (and the old `seed` key), NaN or
  Infinity temperature are refused with a clean 400 naming the field, and the engine serves
  normally afterwards; a failure while one request joins the batch fails that request only
  (logged); a failure inside a decode step fails every request of that step's batch, and only
  those (logged); neither ends the decode loop;
- SIGTERM with a request waiting stops the engine promptly (it answers the request 503);
- a well-formed safetensors full of NaN is refused by /update_weights_from_disk (400,
  success false, old weights kept), and so is every malformed file (empty, header cut off,
  header only, data cut off, integer dtype, missing, extra or misshapen tensor), with
  the file and the cause named; a model that gives non-finite logits is reported by
  /health_generate (503) and refused at start.
Engines are real `darl-engine` processes (or the same server in this process where a fault must
be injected) on 127.0.0.1, always stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (a hard dependency: imported, never skipped)
from safetensors.torch import load_file, save_file

from megatron_darl.channel.ports import free_port
from megatron_darl.engine.decoder import Decoder
from megatron_darl.engine.server import EngineServer, engine_command
from tests.helpers import REPO, repo_env
from tests.helpers.engines import running_engines, save_tiny, serving


def save_nan_copy(src: Path, dst: Path) -> Path:
    """A well-formed HF folder whose every tensor is NaN."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def call(url: str, route: str, body: dict | str | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url + route, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw) if raw else ""
    except ValueError:
        return status, raw


def generate(url: str, sampling: dict | str, rid: str = "r", timeout: float = 60) -> tuple[int, dict | str]:
    sp = sampling if isinstance(sampling, str) else json.dumps(sampling)
    body = f'{{"input_ids": [1, 2, 3], "rid": "{rid}", "return_logprob": true, "sampling_params": {sp}}}'
    return call(url, "/generate", body, timeout)


@contextmanager
def engine(model: Path, log_dir: Path):
    """One darl-engine on `model` (its log: `<log_dir>/engine0.log`): (url, process)."""
    with running_engines([(model, None)], log_dir, max_batch=16, startup_s=90) as started:
        yield started[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-engine")
    save_tiny(root / "v0", 0)
    save_nan_copy(root / "v0", root / "nan")
    with engine(root / "v0", root) as (url, proc):
        yield {"root": root, "url": url, "proc": proc}


def assert_serving(url: str) -> None:
    assert call(url, "/health_generate")[0] == 200
    status, out = generate(url, {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 5}, rid="after")
    assert status == 200 and len(out["output_ids"]) == 3, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sampling,field", [
    ('{"sampling_seed": 18446744073709551616}', "sampling_seed"),
    ('{"seed": 18446744073709551616}', "seed"),  # what killed the decode loop before
    ('{"temperature": NaN}', "temperature"),
    ('{"temperature": Infinity}', "temperature"),
    ('{"top_p": NaN}', "top_p"),
    ('{"max_new_tokens": -4}', "max_new_tokens"),
    ('{"top_k": 0}', "top_k"),
])
def test_one_hostile_request_gets_a_400_and_the_engine_goes_on(world, sampling, field):
    status, out = generate(world["url"], sampling)
    assert status == 400 and f"sampling_params.{field}" in out["error"], (status, out)
    assert world["proc"].poll() is None
    assert_serving(world["url"])


@pytest.mark.timeout(180)
def test_nan_weights_are_refused_and_the_old_weights_kept(world):
    url = world["url"]
    before = generate(url, {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 9, "temperature": 0.0})[1]
    status, out = call(url, "/update_weights_from_disk",
                       {"model_path": str(world["root"] / "nan"), "weight_version": "5"})
    assert status == 400 and out["success"] is False and "non-finite" in out["message"], out
    assert call(url, "/model_info")[1]["weight_version"] == "0"
    after = generate(url, {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 9, "temperature": 0.0})[1]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert_serving(url)


def save_malformed_copy(src: Path, dst: Path, shape: str) -> Path:
    """An HF folder whose model.safetensors is broken in the way `shape` names."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    raw = (src / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    if shape in ("empty", "header_cut", "header_only", "data_cut"):
        cut = {"empty": 0, "header_cut": header_end // 2, "header_only": header_end, "data_cut": len(raw) - 100}[shape]
        (dst / "model.safetensors").write_bytes(raw[:cut])
        return dst
    if shape == "wrong_dtype":
        tensors[name] = tensors[name].to(torch.int32)
    elif shape == "missing_tensor":
        del tensors[name]
    elif shape == "extra_tensor":
        tensors["model.layers.7.mlp.up_proj.weight"] = tensors[name].clone()
    elif shape == "wrong_shape":
        tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape,cause", [
    ("empty", "not a readable safetensors file (0 bytes)"),
    ("header_cut", "not a readable safetensors file"),  # was a 500 "Server got itself in trouble"
    ("header_only", "not a readable safetensors file"),
    ("data_cut", "not a readable safetensors file"),
    ("wrong_dtype", "'model.layers.0.mlp.up_proj.weight' has dtype int32"),
    ("missing_tensor", "missing tensor 'model.layers.0.mlp.up_proj.weight'"),
    ("extra_tensor", "unexpected tensor 'model.layers.7.mlp.up_proj.weight'"),
    ("wrong_shape", "'model.layers.0.mlp.up_proj.weight' has shape (63, 32)"),
])
def test_a_malformed_weights_file_gets_a_400_naming_file_and_cause(world, shape, cause):
    url, greedy = world["url"], {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 9, "temperature": 0.0}
    before = generate(url, greedy)[1]
    folder = save_malformed_copy(world["root"] / "v0", world["root"] / f"bad_{shape}", shape)
    status, out = call(url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "5"})
    assert status == 400 and out["success"] is False and cause in out["message"], (status, out)
    named = str(folder) if shape == "missing_tensor" else "model.safetensors:"
    assert named in out["message"], out
    assert call(url, "/model_info")[1]["weight_version"] == "0"
    after = generate(url, greedy)[1]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert world["proc"].poll() is None
    assert_serving(url)


@pytest.mark.timeout(120)
def test_an_engine_does_not_start_on_nan_weights(world, tmp_path):
    run = subprocess.run(engine_command(str(world["root"] / "nan"), free_port()), capture_output=True, text=True,
                         env=repo_env(OMP_NUM_THREADS="1"), cwd=REPO, timeout=90)
    assert run.returncode != 0 and "non-finite" in run.stderr, run.stderr[-2000:]


@pytest.mark.timeout(120)
def test_sigterm_with_a_waiting_request_stops_promptly(tmp_path):
    save_tiny(tmp_path / "m")
    with engine(tmp_path / "m", tmp_path) as (url, proc):
        assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
        answers: list = []

        def waiting():  # parked behind the pause: never finishes on its own
            answers.append(generate(url, {"max_new_tokens": 4}, rid="parked", timeout=90))

        import threading

        t = threading.Thread(target=waiting)
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)  # was 65 s: aiohttp waited 60 s for the parked handler
        except subprocess.TimeoutExpired:
            pytest.fail("darl-engine did not stop within 30 s of SIGTERM")
        t.join(timeout=30)
    assert code in (0, -signal.SIGTERM)
    assert answers and answers[0][0] == 503, answers


# ---- faults injected into the server in this process --------------------------------------

async def _apost(session, url, route, body):
    async with session.post(url + route, json=body) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.timeout(120)
def test_a_failure_joining_one_request_fails_that_request_only(tmp_path, caplog):
    import aiohttp

    save_tiny(tmp_path / "m")
    decoder = Decoder(tmp_path / "m", max_batch=8)
    add = decoder.add

    def add_failing(seq):  # a defect the door's validation did not catch, for one request
        if seq.rid == "poison":
            raise ValueError("Overflow when unpacking long long")
        add(seq)

    decoder.add = add_failing
    server = EngineServer(decoder, str(tmp_path / "m"))
    body = {"input_ids": [1, 2, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}

    async def main():
        async with serving(server) as url, aiohttp.ClientSession() as s:
            outs = await asyncio.wait_for(asyncio.gather(*(_apost(s, url, "/generate", {**body, "rid": rid})
                                                           for rid in ("a", "poison", "b"))), 60)
            after = await asyncio.wait_for(_apost(s, url, "/generate", {**body, "rid": "c"}), 60)
            async with s.get(url + "/health_generate") as r:
                health = r.status
        return outs, after, health

    with caplog.at_level(logging.ERROR, logger="darl-engine"):
        (a, poison, b), after, health = asyncio.run(main())
    assert poison[0] == 500 and "Overflow" in poison[1]["error"], poison
    assert a[0] == b[0] == after[0] == 200 and len(after[1]["output_ids"]) == 5
    assert health == 200
    assert any("poison" in r.getMessage() for r in caplog.records), "the failure is logged, naming the request"


@pytest.mark.timeout(120)
def test_a_failure_in_the_decode_step_fails_its_batch_only_and_the_engine_goes_on(tmp_path, caplog):
    """Two rows a batch, three requests queued while paused: the step holding "poison" raises
    once; the two requests of that step fail (500, named cause), the third runs on the next step."""
    import aiohttp

    save_tiny(tmp_path / "m")
    decoder = Decoder(tmp_path / "m", max_batch=2)
    step, failed_batch = decoder.step, []

    def step_failing():  # a defect inside the batched forward, once
        if not failed_batch and any(s.rid == "poison" for s in decoder.rows):
            failed_batch.extend(s.rid for s in decoder.rows)
            raise ValueError("Overflow when unpacking long long")
        return step()

    decoder.step = step_failing
    server = EngineServer(decoder, str(tmp_path / "m"))
    body = {"input_ids": [1, 2, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}

    async def main():
        async with serving(server) as url, aiohttp.ClientSession() as s:
            assert (await _apost(s, url, "/pause_generation", {"mode": "in_place"}))[0] == 200
            sent = [asyncio.create_task(_apost(s, url, "/generate", {**body, "rid": rid}))
                    for rid in ("a", "poison", "b")]
            while len(server.pending) < 3:
                await asyncio.sleep(0.01)
            assert (await _apost(s, url, "/continue_generation", {}))[0] == 200
            outs = await asyncio.wait_for(asyncio.gather(*sent), 60)
            after = await asyncio.wait_for(_apost(s, url, "/generate", {**body, "rid": "c"}), 60)
            async with s.get(url + "/health_generate") as r:
                health = r.status
        return dict(zip(("a", "poison", "b"), outs)), after, health

    with caplog.at_level(logging.ERROR, logger="darl-engine"):
        outs, after, health = asyncio.run(main())
    assert len(failed_batch) == 2 and "poison" in failed_batch, failed_batch
    for rid, (status, answer) in outs.items():
        if rid in failed_batch:
            assert (status == 500 and "decode step failed" in answer["error"]
                    and "Overflow" in answer["error"]), (rid, answer)
        else:  # queued behind the failed step: decoded on the next one
            assert status == 200 and len(answer["output_ids"]) == 5, (rid, answer)
    assert after[0] == 200 and len(after[1]["output_ids"]) == 5 and health == 200
    assert any("decode step failed; failing its 2 request(s)" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_health_generate_detects_a_model_that_gives_nan(tmp_path):
    import aiohttp

    save_tiny(tmp_path / "m")
    decoder = Decoder(tmp_path / "m", max_batch=8)
    server = EngineServer(decoder, str(tmp_path / "m"))

    async def main():
        async with serving(server) as url, aiohttp.ClientSession() as s:
            async with s.get(url + "/health_generate") as r:
                good = r.status
            decoder.model.norm = torch.full_like(decoder.model.norm, float("nan"))  # weights broke in memory
            async with s.get(url + "/health_generate") as r:
                bad = (r.status, await r.text())
            gen = await asyncio.wait_for(_apost(s, url, "/generate", {
                "input_ids": [1, 2], "rid": "x", "sampling_params": {"max_new_tokens": 3}}), 60)
        return good, bad, gen

    good, bad, gen = asyncio.run(main())
    assert good == 200
    assert bad[0] == 503 and "non-finite" in bad[1], bad
    assert gen[0] == 500 and "non-finite" in gen[1]["error"], gen
