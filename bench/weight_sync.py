"""Benchmark: publishing a new policy version vs a plain copy of the same bytes, 10M-500M params.

What it is: for Qwen3-architecture models of about 10M to 500M parameters (Megatron-Core
`GPTModel`s built by the learner's own `build_model`, random init, fp32 on CPU), the time of
`Publisher.publish(v)` -- the learner's real weight path: Megatron names mapped to Hugging Face
names by the `checkpoint_tools` adapter, buckets written as safetensors with config.json, the
folder renamed into place, the weight notice rewritten -- beside the time to write the same
parameter bytes, unconverted, to one file in the same folder (the floor of any publication to
that medium). Both to /dev/shm (how embedded engines on the node receive weights) and to disk
(`--disk-dir`, how SGLang servers do; the filesystem type is printed, since a tmpfs /tmp is no
disk). After one untimed publication, runs alternate (publish, copy, publish, ...) and the median
of `--reps` is reported; the published folder is deleted between runs. Prints one line per
(size, destination) and, last, one JSON line with every figure and `publish_over_copy` per
destination at the largest size.
Then the time per version until an engine serves it, the two ways `rollout.weight_sync` offers,
with a real `darl-engine` (CPU) started on the model: *disk* = `Publisher.publish` to the disk
folder + the engine's `/update_weights_from_disk` (it reads, checks and swaps in the folder);
*distributed* = `Publisher.publish` with `weight_sync=distributed` (gather, copy to CPU, finite
check, no file) + `WeightSender.serve` (one bucket post per 256 MB and one gloo broadcast per
tensor to the engine, which checks and swaps them in); the engine joins its group once, untimed.
`disk/dist` is their ratio (median of `--reps` each, alternated).
What it is not: an NCCL broadcast (GPU clusters; docs/clusters.md projects it), or several engines; numbers
depend on the machine and on whatever else runs on it.

    python3 bench/weight_sync.py [--sizes 10 50 100 250 500] [--reps 3] [--disk-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_darl.trainer.publication import Publisher

VOCAB = 32000


def hf_config(target_m: float) -> dict:
    """A Qwen3 config.json of about `target_m` million parameters (tied embeddings, GQA 4:1)."""
    target = target_m * 1e6
    h = (256 if target_m <= 20 else 512 if target_m <= 60 else 768 if target_m <= 150
         else 1024 if target_m <= 300 else 1280)
    inter, head_dim = 3 * h, 64
    heads = h // head_dim
    kv = max(1, heads // 4)
    per_layer = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter + 2 * h + 2 * head_dim
    layers = max(1, round((target - VOCAB * h) / per_layer))
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": h,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "max_position_embeddings": 4096,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "float32"}


class _ExportingLearner:
    """What `Publisher` needs of a learner: the main rank and `export_hf` (the learner's own)."""

    is_main = True

    def __init__(self, chunks, adapter, ctx, src_dir):
        self.chunks, self.adapter, self.ctx, self.src_dir = chunks, adapter, ctx, src_dir

    def export_hf(self, out_dir: str) -> None:
        from megatron_darl.learner import weights

        weights.save_hf_weights(self.chunks, self.adapter, self.ctx, out_dir, [self.src_dir])

    def iter_hf_buckets(self, bucket_bytes: int = 256 << 20):
        from megatron_darl.learner import weights

        return weights.iter_hf_buckets(self.chunks, self.adapter, self.ctx, bucket_bytes)

    def hf_folder_info(self) -> tuple[dict, list[str]]:
        from megatron_darl.learner import weights

        return weights.hf_config(self.adapter, self.chunks), [self.src_dir]


def build(target_m: float, ctx, work: str) -> tuple[_ExportingLearner, list[torch.Tensor]]:
    from checkpoint_tools.adapters import get_adapter
    from megatron_darl.config.learner import ModelConfig, ParallelConfig
    from megatron_darl.learner import model

    src = os.path.join(work, f"src{target_m:g}")
    os.makedirs(src, exist_ok=True)
    cfg = hf_config(target_m)
    with open(os.path.join(src, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    mcfg = ModelConfig(hf_dir=src, init="random", dtype="fp32", spec="local")
    chunks = model.build_model(cfg, mcfg, ParallelConfig(), ctx.pg, on_gpu=ctx.on_gpu)
    adapter = get_adapter(cfg, spec="local", make_vocab_size_divisible_by=mcfg.make_vocab_size_divisible_by)
    return _ExportingLearner(chunks, adapter, ctx, src), [p.detach() for c in chunks for p in c.parameters()]


def plain_copy(params: list[torch.Tensor], folder: str) -> float:
    """Seconds to write the parameters' bytes as they are to one file in `folder` (then removed)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "plain.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for p in params:
            fh.write(memoryview(p.cpu().contiguous().numpy()).cast("B"))
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as fh:
        for line in fh:
            _, mount, typ = line.split()[:3]
            if os.path.abspath(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, typ
    return kind


def measure(learner: _ExportingLearner, params: list[torch.Tensor], root: str, kind: str, reps: int) -> dict:
    os.makedirs(root, exist_ok=True)
    pub = Publisher(learner, os.path.join(root, "weights"), os.path.join(root, "notice.json"),
                    os.path.join(root, "status.json"), kind)
    pub_s, copy_s = [], []
    pub.publish(reps)  # untimed warm-up: first-touch page faults of the medium, lazy imports
    shutil.rmtree(pub.folder(reps))
    for v in range(reps):
        t0 = time.perf_counter()
        pub.publish(v)
        pub_s.append(time.perf_counter() - t0)
        shutil.rmtree(pub.folder(v))
        copy_s.append(plain_copy(params, os.path.join(root, "weights", f"plain{v}")))
        shutil.rmtree(os.path.join(root, "weights", f"plain{v}"))
    return {"publish_s": statistics.median(pub_s), "copy_s": statistics.median(copy_s),
            "publish_all_s": pub_s, "copy_all_s": copy_s}


def measure_versions(learner: _ExportingLearner, root: str, reps: int) -> dict:
    """Seconds per version until a real darl-engine serves it: disk vs distributed."""
    import asyncio

    from megatron_darl.rollout.sglang_client import SGLangClient
    from megatron_darl.trainer.weight_sender import WeightSender
    from megatron_darl.types import WeightVersion

    os.makedirs(root, exist_ok=True)
    model = os.path.join(root, "model")
    learner.export_hf(model)
    with _engine(model) as url:
        disk = Publisher(learner, os.path.join(root, "weights"), os.path.join(root, "notice.json"),
                         os.path.join(root, "status.json"), "disk")
        sender = WeightSender(os.path.join(root, "dist", "notice.json"), "127.0.0.1", os.path.join(root, "fallback"),
                              learner.hf_folder_info(), backend="gloo", timeout_s=600)
        dist = Publisher(learner, os.path.join(root, "dist"), os.path.join(root, "dist", "notice.json"),
                         os.path.join(root, "dist", "status.json"), "distributed", sender=sender)
        async def load(v: int) -> None:
            async with SGLangClient(url, timeout_s=600, max_retries=0) as client:
                await client.aupdate_weights(WeightVersion(v, "disk", disk.folder(v)))

        def via_disk(v: int) -> float:
            t0 = time.perf_counter()
            disk.publish(v)
            asyncio.run(load(v))
            dt = time.perf_counter() - t0
            shutil.rmtree(disk.folder(v))
            return dt

        def via_dist(v: int) -> float:
            t0 = time.perf_counter()
            dist.publish(v)
            result = sender.serve({"id": str(v), "engines": [{"index": 0, "url": url, "group": "bench"}]})
            assert result["ok"] == [0], result
            return time.perf_counter() - t0

        try:
            via_disk(1000), via_dist(1001)  # untimed: the engine joins its group, first touches
            disk_s, dist_s = [], []
            for v in range(reps):
                disk_s.append(via_disk(2 * v))
                dist_s.append(via_dist(2 * v + 1))
        finally:
            sender.close()
    return {"disk_version_s": statistics.median(disk_s), "dist_version_s": statistics.median(dist_s),
            "disk_version_all_s": disk_s, "dist_version_all_s": dist_s}


class _engine:
    """A darl-engine subprocess on `model` (127.0.0.1), up until the block ends."""

    def __init__(self, model: str):
        from megatron_darl.engine.server import engine_command
        from megatron_darl.trainer.weight_sender import free_port

        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self.cmd = engine_command(model, int(self.url.rsplit(":", 1)[1]), max_batch=4)

    def __enter__(self) -> str:
        import subprocess
        import urllib.request

        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self.url
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"darl-engine on {self.cmd[-1]} did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[10, 50, 100, 250, 500], help="millions of parameters")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--disk-dir", default=tempfile.gettempdir(), help="a folder on the disk to publish to")
    p.add_argument("--quick", action="store_true", help="10M and 50M, 2 repetitions")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.reps = [10, 50], 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    from megatron_darl.config.learner import ParallelConfig
    from megatron_darl.learner.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), seed=0)
    dests = {"shm": tempfile.mkdtemp(prefix="darl-bench-ws-", dir="/dev/shm"),
             "disk": tempfile.mkdtemp(prefix="darl-bench-ws-", dir=args.disk_dir)}
    rows, versions = [], []
    print(f"{'params':>8} {'dest':>5} {'fs':>6} {'GB':>6} {'publish s':>10} {'copy s':>8} {'publish GB/s':>12} "
          f"{'copy GB/s':>10} {'publish/copy':>12}", flush=True)
    try:
        for size in args.sizes:
            learner, params = build(size, ctx, dests["disk"])
            n = sum(t.numel() for t in params)
            nbytes = sum(t.numel() * t.element_size() for t in params)
            for dest, folder in dests.items():
                m = measure(learner, params, os.path.join(folder, f"m{size:g}"), "shm" if dest == "shm" else "disk",
                            args.reps)
                row = {"target_m": size, "params": n, "bytes": nbytes, "dest": dest, "fs": fs_type(folder), **m,
                       "ratio": m["publish_s"] / m["copy_s"]}
                rows.append(row)
                print(f"{n / 1e6:7.1f}M {dest:>5} {row['fs']:>6} {nbytes / 1e9:6.2f} {m['publish_s']:10.2f} "
                      f"{m['copy_s']:8.2f} {nbytes / 1e9 / m['publish_s']:12.2f} {nbytes / 1e9 / m['copy_s']:10.2f} "
                      f"{row['ratio']:12.2f}", flush=True)
            v = measure_versions(learner, os.path.join(dests["disk"], f"v{size:g}"), args.reps)
            v.update({"target_m": size, "params": n, "bytes": nbytes,
                      "disk_over_dist": v["disk_version_s"] / v["dist_version_s"]})
            versions.append(v)
            print(f"{n / 1e6:7.1f}M per version until the engine serves it: disk {v['disk_version_s']:.2f} s, "
                  f"distributed (gloo) {v['dist_version_s']:.2f} s, disk/dist {v['disk_over_dist']:.2f}", flush=True)
            del learner, params
    finally:
        for folder in dests.values():
            shutil.rmtree(folder, ignore_errors=True)
        destroy_parallel()
    largest = max(r["target_m"] for r in rows)
    print(json.dumps({"rows": rows, "versions": versions, "reps": args.reps,
                      "publish_over_copy": {r["dest"]: r["ratio"] for r in rows if r["target_m"] == largest},
                      "disk_over_dist": {f"{v['target_m']:g}M": v["disk_over_dist"] for v in versions}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
