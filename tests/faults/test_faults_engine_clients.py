"""darl-engine under hostile and careless clients (issue 34): each test reproduces a probe that did
not hold and checks that it now does.

- a temperature below SGLang's `_SAMPLING_EPS` (1e-6) is greedy, with finite log-probs, in strict
  JSON; finite logits that overflow once divided by the temperature fail the request (500)
  instead of answering NaN.
Engines are real `darl-engine` processes on 127.0.0.1 (or the server in this process where a
fault is injected), always stopped.
What it is not: the engine's protocol tests (tests/unit/engine/) or its other faults
(test_faults_engine.py).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import aiohttp  # noqa: E402

from megatron_darl.engine.decoder import Decoder  # noqa: E402
from megatron_darl.engine.server import EngineServer  # noqa: E402
from tests.helpers.engines import running_engines, save_tiny, serving  # noqa: E402


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One engine with 16 rows."""
    root = tmp_path_factory.mktemp("clients-plain")
    save_tiny(root / "m")
    with running_engines([(root / "m", None)], root, max_batch=16, startup_s=90) as started:
        yield {"url": started[0][0], "log": root / "engine0.log"}


def post(url: str, body: dict | bytes | str, timeout: float = 120) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def strict(raw: bytes):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(raw, parse_constant=refuse)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1e-40, 1e-7, 5e-324])
def test_a_temperature_below_sglangs_eps_is_greedy_with_finite_logprobs(plain, temperature):
    """Was: 200 with NaN log-probs (not strict JSON), the same token at every step."""
    def generate(t: float):
        body = {"input_ids": [5, 6, 7], "return_logprob": True,
                "sampling_params": {"temperature": t, "max_new_tokens": 8, "ignore_eos": True}}
        status, raw = post(plain["url"] + "/generate", body)
        assert status == 200, raw
        meta = strict(raw)["meta_info"]["output_token_logprobs"]
        return [tok for _, tok, _ in meta], [lp for lp, _, _ in meta]

    tiny, greedy = generate(temperature), generate(0.0)
    assert tiny == greedy and all(lp < 0 for lp in tiny[1]), (tiny, greedy)


@pytest.mark.timeout(120)
def test_logits_that_overflow_under_the_temperature_fail_the_request(tmp_path):
    """Finite logits of 1e37 divided by T = 0.01 overflow float32: no NaN may reach an answer."""
    save_tiny(tmp_path / "m")
    decoder = Decoder(tmp_path / "m", max_batch=4)
    decode = decoder.model.decode

    def loud(*args):  # finite logits as large as 1e37
        logits = decode(*args)
        return logits / logits.abs().amax(dim=-1, keepdim=True) * 1e37

    decoder.model.decode = loud
    server = EngineServer(decoder, str(tmp_path / "m"))

    async def main():
        async with serving(server) as url, aiohttp.ClientSession() as s:
            answers = []
            for t in (0.01, 1.0):
                body = {"input_ids": [1, 2], "rid": f"t{t}", "sampling_params": {"temperature": t, "max_new_tokens": 3}}
                async with s.post(url + "/generate", json=body) as r:
                    answers.append((r.status, await r.read()))
            return answers

    (hot_status, hot), (ok_status, ok) = asyncio.run(main())
    assert hot_status == 500 and "non-finite log-prob" in strict(hot)["error"], hot
    assert ok_status == 200 and len(strict(ok)["output_ids"]) == 3
