"""Benchmark: darl-engine under hostile and careless clients, one real engine on 127.0.0.1.

What it is: the probes that found the defects, against one `darl-engine` process on the demo's
model shape (`config.learner.TINY_QWEN3`, random weights, the demo tokenizer's 89 ids; or
`--model DIR`), started with its default limits and `--body-timeout-s 2`. Each probe runs while
a thread polls /health every 20 ms; one row per probe: requests sent, errors (answers other than
the expected one), p50/p99 latency of its requests, the worst /health latency during it, and the
engine's RSS after it, then the engine log's count of tracebacks and, last, one JSON line.
Probes: 500 clients that hang up after 0.5 s (then 8 fresh requests; the note gives the prompts
dropped and the tokens decoded after the hang-up), temperature 1e-40 and 1e-7 (strict JSON,
finite log-probs), 10,000-deep JSON, one request of 1M prompts (4.8 MiB), one 60 MiB prompt, one
request at the limits (1024 prompts, 261,120 tokens), stalled bodies (408), clients that hang up
halfway through their body, weight versions -5, 10**29 and backwards, max_new_tokens 10**9.
What it is not: a test (tests/faults/test_engine_clients.py is), or a throughput benchmark
(`bench/engine.py`); latencies depend on the machine and on what else runs on it.

    python bench/engine_clients.py [--model HF_DIR] [--clients 500] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_darl.channel.ports import free_port
from megatron_darl.engine.server import engine_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = list(range(3, 19))  # 16 tokens


def save_demo_shaped_model(path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_darl.config.learner import TINY_QWEN3

    torch.manual_seed(0)
    cfg = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "architectures"}, vocab_size=89, eos_token_id=88)
    cfg.architectures = TINY_QWEN3["architectures"]
    Qwen3ForCausalLM(cfg).save_pretrained(path)


WATCH = r"""
import sys, threading, time, urllib.request
url, worst, lock = sys.argv[1] + "/health", [0.0], threading.Lock()
def poll():
    while True:
        t0 = time.perf_counter()
        try:
            urllib.request.urlopen(url, timeout=60).read()
        except OSError:
            pass
        with lock:
            worst[0] = max(worst[0], time.perf_counter() - t0)
        time.sleep(0.02)
threading.Thread(target=poll, daemon=True).start()
for line in sys.stdin:
    time.sleep(0.1)  # one more poll after the probe
    with lock:
        print(worst[0], flush=True)
        worst[0] = 0.0
"""


class HealthWatch:
    """GET /health every 20 ms from its own process (the probes' clients share no GIL with
    it); `worst()`: the slowest answer since the previous call."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", WATCH, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def worst(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def post(session, url: str, body: bytes, timeout: float = 600) -> tuple[int, bytes, float]:
    """POST `body` to `url` (a full route); (status, answer, seconds); status -1: the connection failed."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read(), time.perf_counter() - t0
    except aiohttp.ClientError as exc:
        return -1, repr(exc).encode(), time.perf_counter() - t0


def gen_body(rid: str, **sampling) -> bytes:
    return json.dumps({"input_ids": PROMPT, "rid": rid, "return_logprob": True, "sampling_params": sampling}).encode()


async def info(session, url: str) -> dict:
    async with session.get(url + "/get_server_info") as r:
        return await r.json()


async def probe_hang_up(session, url: str, clients: int) -> dict:
    before = (await info(session, url))["tokens_generated"]

    async def leaver(i):
        try:
            await post(session, url + "/generate", gen_body(f"gone{i}", max_new_tokens=240, ignore_eos=True),
                       timeout=0.5)
        except asyncio.TimeoutError:
            pass

    await asyncio.gather(*(leaver(i) for i in range(clients)))
    fresh = await asyncio.gather(*(post(session, url + "/generate",
                                        gen_body(f"fresh{i}", max_new_tokens=16, ignore_eos=True))
                                   for i in range(8)))
    await asyncio.sleep(1.0)
    now = await info(session, url)
    decoded = now["tokens_generated"] - before - 8 * 16
    return {"requests": clients + 8, "errors": sum(s != 200 for s, _, _ in fresh), "lat": [t for _, _, t in fresh],
            "note": f"{now.get('client_disconnects', '?')} hang-ups seen, {now.get('aborted_disconnected', '?')} "
                    f"prompts dropped; {decoded} of {clients * 240} tokens decoded"}


def strict_json(raw: bytes):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(raw, parse_constant=refuse)


async def probe_temperature(session, url: str) -> dict:
    outs = await asyncio.gather(*(post(session, url + "/generate",
                                       gen_body(f"t{i}", temperature=t, max_new_tokens=16, ignore_eos=True))
                                  for i, t in enumerate([1e-40, 1e-7] * 25)))
    errors = 0
    for status, raw, _ in outs:
        try:
            lps = [e[0] for e in strict_json(raw)["meta_info"]["output_token_logprobs"]]
            errors += status != 200 or not all(-1e30 < lp <= 0 for lp in lps)
        except (ValueError, KeyError):
            errors += 1
    return {"requests": len(outs), "errors": errors, "lat": [t for _, _, t in outs], "note": "200, finite log-probs"}


async def probe_expect(session, url: str, bodies: list[bytes], expect: int, note: str,
                       route: str = "/generate") -> dict:
    outs = await asyncio.gather(*(post(session, url + route, b) for b in bodies))
    return {"requests": len(outs), "errors": sum(s != expect for s, _, _ in outs), "lat": [t for _, _, t in outs],
            "note": f"{note}: {sorted({s for s, _, _ in outs})}"}


async def raw_client(port: int, close_after_s: float | None) -> tuple[float, bytes]:
    """Announce a 1000-byte body, send 10 bytes, then wait for the answer (or hang up)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    writer.write(b'{"input_i')
    await writer.drain()
    if close_after_s is not None:
        await asyncio.sleep(close_after_s)
        writer.close()
        return time.perf_counter() - t0, b""
    answer = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return time.perf_counter() - t0, answer


async def probe_stalled(port: int) -> dict:
    outs = await asyncio.gather(*(raw_client(port, None) for _ in range(5)))
    errors = sum(not a.startswith(b"HTTP/1.1 408") for _, a in outs)
    return {"requests": 5, "errors": errors, "lat": [t for t, _ in outs],
            "note": "408 and closed after --body-timeout-s 2"}


async def probe_slow_leavers(port: int, log_path: str) -> dict:
    def hung_up() -> int:
        return sum("hung up" in line for line in open(log_path))

    lines_before = hung_up()
    outs = await asyncio.gather(*(raw_client(port, 0.3) for _ in range(20)))
    await asyncio.sleep(0.5)
    lines = hung_up() - lines_before
    return {"requests": 20, "errors": abs(lines - 20), "lat": [t for t, _ in outs],
            "note": f"{lines} log lines for 20 clients"}


async def probe_versions(session, url: str, model: str) -> dict:
    bodies = [json.dumps({"model_path": model, "weight_version": v}).encode() for v in ("-5", str(10**29))]
    out = await probe_expect(session, url, bodies, 400, "weight_version -5, 10**29", "/update_weights_from_disk")
    status, _, _ = await post(session, url + "/update_weights_from_disk",
                              json.dumps({"model_path": model, "weight_version": "7"}).encode())
    back = await post(session, url + "/update_weights_from_disk",
                      json.dumps({"model_path": model, "weight_version": "6"}).encode())
    out["requests"] += 2
    out["errors"] += (status != 200) + (back[0] != 400)
    out["lat"].append(back[2])
    out["note"] += f"; 7 then 6: {status}, {back[0]}"
    return out


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def run_probes(url: str, port: int, pid: int, model: str, log_path: str, clients: int) -> list[dict]:
    deep = b'{"input_ids": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    million = json.dumps({"input_ids": [[1]] * 1_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()
    huge = b'{"input_ids": [' + b"1, " * (20 * 1024**2) + b'1], "sampling_params": {"max_new_tokens": 1}}'
    limit = json.dumps({"input_ids": [[1 + (i + j) % 80 for j in range(255)] for i in range(1024)],
                        "sampling_params": {"ignore_eos": True}}).encode()
    long = gen_body("long", max_new_tokens=10**9)
    watch, rows = HealthWatch(url), []
    probes = [
        (f"{clients} clients hang up after 0.5 s", lambda s: probe_hang_up(s, url, clients)),
        ("temperature 1e-40 / 1e-7", lambda s: probe_temperature(s, url)),
        ("JSON nested 10,000 deep", lambda s: probe_expect(s, url, [deep] * 20, 400, "status")),
        (f"1M prompts ({len(million) / 2**20:.1f} MiB)", lambda s: probe_expect(s, url, [million], 413, "status")),
        (f"one prompt of {len(huge) / 2**20:.0f} MiB", lambda s: probe_expect(s, url, [huge], 413, "status")),
        (f"1024 prompts, 261,120 tokens ({len(limit) / 2**20:.1f} MiB)",
         lambda s: probe_expect(s, url, [limit], 200, "status")),
        ("stalled body", lambda s: probe_stalled(port)),
        ("hang up halfway through the body", lambda s: probe_slow_leavers(port, log_path)),
        ("weight_version -5, 10**29, backwards", lambda s: probe_versions(s, url, model)),
        ("max_new_tokens 10**9", lambda s: probe_expect(s, url, [long] * 5, 400, "status")),
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        watch.worst()  # from here on
        for name, probe in probes:
            out = await probe(session)
            lat = sorted(out.pop("lat"))
            rows.append({"probe": name, **out, "p50_s": statistics.median(lat),
                         "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "health_worst_s": watch.worst(),
                         "rss_mib": rss_mib(pid)})
            print(f"  done: {name}", flush=True)
    watch.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF folder (default: a random model of the demo's shape)")
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="darl-engine-clients-")
    model = args.model or os.path.join(tmp, "model")
    if not args.model:
        save_demo_shaped_model(model)
    port, log_path = free_port(), os.path.join(tmp, "engine.log")
    cmd = engine_command(model, port, threads=args.threads) + ["--body-timeout-s", "2"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"darl-engine did not start:\n{open(log_path).read()[-3000:]}")
                time.sleep(0.2)
        print(f"darl-engine pid {proc.pid} on {url}, {args.threads} thread(s), max batch 64, log {log_path}",
              flush=True)
        rows = asyncio.run(run_probes(url, port, proc.pid, model, log_path, args.clients))
    finally:
        proc.terminate()
        proc.wait(30)
    tracebacks = open(log_path).read().count("Traceback")
    print("\n| probe | requests | errors | p50 | p99 | /health worst | RSS | note |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['probe']} | {r['requests']} | {r['errors']} | {r['p50_s'] * 1000:.0f} ms "
              f"| {r['p99_s'] * 1000:.0f} ms | {r['health_worst_s'] * 1000:.0f} ms | {r['rss_mib']:.0f} MiB "
              f"| {r['note']} |")
    print(f"\ntracebacks in the engine log: {tracebacks}")
    print(json.dumps({"rows": rows, "tracebacks": tracebacks}))


if __name__ == "__main__":
    main()
