"""End-to-end tests of darl-convert: HF -> Megatron per-rank files -> HF, reshard, and error paths."""

import json
import os
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoint_tools import convert as convert_mod
from checkpoint_tools.api import CheckpointError, MissingTensorsError, ShapeMismatchError
from checkpoint_tools.commands import main
from checkpoint_tools.convert import hf_to_mcore, mcore_to_hf, reshard
from checkpoint_tools.hf_format import HFReader
from checkpoint_tools.mcore_format import RANK_FILE, load_mcore_rank_state, rank_dir, read_meta


def hf_tensors(d):
    r = HFReader(d)
    return {n: r.get(n) for n in r.names()}


def mcore_tensors(d):
    meta = read_meta(d)
    return {(t, p, k): v for t in range(meta.tp) for p in range(meta.pp)
            for k, v in load_mcore_rank_state(d, t, p).items()}


def assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        if a[k] is None:
            assert b[k] is None, k
            continue
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tied,dtype", [(False, torch.float32), (True, torch.bfloat16)],
                         ids=["untied-fp32", "tied-bf16"])
def test_round_trip_tp2_pp2_is_bit_identical_and_loads_in_transformers(hf_factory, tmp_path, tied, dtype):
    from transformers import AutoModelForCausalLM

    src = hf_factory("qwen3", tied, dtype)
    mc, out = str(tmp_path / "mc"), str(tmp_path / "hf")
    assert main(["--no-progress", "hf-to-mcore", "--hf-dir", src, "--out", mc, "--tp", "2", "--pp", "2"]) == 0
    assert sorted(d for d in os.listdir(mc) if d.startswith("mp_rank")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    blob = torch.load(os.path.join(mc, "mp_rank_01_001", RANK_FILE), weights_only=True)
    assert blob["checkpoint_version"] == 3.0
    last = blob["model"]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in last and "decoder.layers.2.mlp.linear_fc1.weight" not in last
    assert last["output_layer.weight"].shape == (256, 64)  # 300 padded to 512, split over tp=2 (tied too)
    meta = read_meta(mc)
    assert (meta.tp, meta.pp, meta.padded_vocab_size, meta.dtype) == (2, 2, 512, str(dtype)[6:])

    assert main(["--no-progress", "mcore-to-hf", "--mcore-dir", mc, "--out", out]) == 0
    assert_same_tensors(hf_tensors(src), hf_tensors(out))
    for f in ("tokenizer_config.json", "vocab.json", "generation_config.json"):
        assert open(os.path.join(src, f)).read() == open(os.path.join(out, f)).read(), f
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    original = AutoModelForCausalLM.from_pretrained(src)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and reloaded.dtype == dtype
    assert_same_tensors(original.state_dict(), reloaded.state_dict())
    ids = torch.tensor([[5, 17, 299, 0, 42]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, reloaded(ids).logits)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_round_trip_other_families(hf_factory, tmp_path, arch):
    src = hf_factory(arch, False, torch.float32)
    hf_to_mcore(src, str(tmp_path / "mc"), tp=2, pp=2, progress=False)
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"), progress=False)
    assert_same_tensors(hf_tensors(src), hf_tensors(str(tmp_path / "hf")))
    cfg = json.load(open(os.path.join(tmp_path / "hf", "config.json")))
    assert cfg["model_type"] == arch


@pytest.mark.parametrize("tied", [False, True])
def test_reshard_equals_direct_conversion(hf_factory, tmp_path, tied):
    src = hf_factory("qwen3", tied, torch.float32)
    d = {name: str(tmp_path / name) for name in ("t2p2", "t1p1", "r11", "r22")}
    hf_to_mcore(src, d["t2p2"], tp=2, pp=2, progress=False)
    hf_to_mcore(src, d["t1p1"], tp=1, pp=1, progress=False)
    assert main(["--no-progress", "reshard", "--mcore-dir", d["t2p2"], "--out", d["r11"],
                 "--tp", "1", "--pp", "1"]) == 0
    reshard(d["t1p1"], d["r22"], tp=2, pp=2, progress=False)  # the other way: vocab padding grows 384 -> 512
    assert_same_tensors(mcore_tensors(d["t1p1"]), mcore_tensors(d["r11"]))
    assert_same_tensors(mcore_tensors(d["t2p2"]), mcore_tensors(d["r22"]))
    assert read_meta(d["r22"]).padded_vocab_size == 512 and read_meta(d["r11"]).padded_vocab_size == 384
    assert os.path.isfile(os.path.join(d["r11"], "hf_extra", "tokenizer_config.json"))


def test_dtype_cast_and_shard_size_cap(hf_factory, tmp_path):
    src = hf_factory("qwen3", False, torch.float32)
    mc, out = str(tmp_path / "mc"), str(tmp_path / "hf")
    hf_to_mcore(src, mc, tp=1, pp=2, dtype="bf16", progress=False)
    assert read_meta(mc).dtype == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in mcore_tensors(mc).values() if v is not None)
    files = mcore_to_hf(mc, out, dtype="fp32", max_shard_size="40KB", progress=False)
    assert len(files) > 3
    for f in files:
        with safe_open(os.path.join(out, f), "pt") as h:
            sizes = [h.get_tensor(k).numel() * 4 for k in h.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, f  # a shard passes the cap only for one big tensor
    got = hf_tensors(out)
    for n, t in hf_tensors(src).items():
        assert got[n].dtype == torch.float32 and torch.equal(got[n], t.to(torch.bfloat16).float()), n
    cfg = json.load(open(os.path.join(out, "config.json")))
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg]
    assert keys and all(cfg[k] == "float32" for k in keys)


def test_hf_to_mcore_streams_one_tensor_group_at_a_time(hf_factory, tmp_path, monkeypatch):
    src = hf_factory("qwen3", False, torch.float32)
    alive, peak = [0], [0]
    real_get = HFReader.get

    def counting_get(self, name):
        t = real_get(self, name)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        return t

    monkeypatch.setattr(convert_mod.HFReader, "get", counting_get)
    hf_to_mcore(src, str(tmp_path / "mc"), tp=2, pp=1, progress=False)
    assert peak[0] <= 3  # q, k and v of one layer at most: the HF model is never held whole


def test_existing_output_needs_overwrite(hf_factory, tmp_path):
    src = hf_factory("qwen3", False, torch.float32)
    out = tmp_path / "mc"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):
        hf_to_mcore(src, str(out), progress=False)
    assert (out / "keep.txt").exists()
    hf_to_mcore(src, str(out), overwrite=True, progress=False)
    assert not (out / "keep.txt").exists()
    with pytest.raises(CheckpointError, match="already exists"):
        mcore_to_hf(str(out), str(out), progress=False)
    with pytest.raises(CheckpointError, match="must differ"):
        reshard(str(out), str(out), tp=1, pp=1, overwrite=True, progress=False)


def test_unknown_architecture_and_bad_layout_fail_before_writing(hf_factory, tmp_path, capsys):
    src = hf_factory("qwen3", False, torch.float32)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, open(bad / "config.json", "w"))
    assert main(["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o1")]) == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err and not (tmp_path / "o1").exists()
    with pytest.raises(CheckpointError, match="num_key_value_heads=2"):
        hf_to_mcore(src, str(tmp_path / "o2"), tp=4, progress=False)
    with pytest.raises(CheckpointError, match="pp_size=3"):
        hf_to_mcore(src, str(tmp_path / "o3"), pp=3, progress=False)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        hf_to_mcore(str(tmp_path), str(tmp_path / "o4"), progress=False)
    with pytest.raises(CheckpointError, match="darl_meta.json is missing"):
        mcore_to_hf(str(tmp_path), str(tmp_path / "o5"), progress=False)


def _copy_hf_without(src, dst, drop=(), replace=None):
    os.makedirs(dst)
    tensors = {n: t for n, t in hf_tensors(src).items() if n not in drop}
    tensors.update(replace or {})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def test_missing_and_misshapen_hf_tensors_are_named(hf_factory, tmp_path):
    src = hf_factory("qwen3", False, torch.float32)
    gone = ["model.layers.3.self_attn.k_norm.weight", "lm_head.weight"]
    _copy_hf_without(src, str(tmp_path / "a"), drop=gone)
    with pytest.raises(MissingTensorsError) as e:
        hf_to_mcore(str(tmp_path / "a"), str(tmp_path / "o"), progress=False)
    assert e.value.names == sorted(gone) and all(n in str(e.value) for n in gone)
    _copy_hf_without(src, str(tmp_path / "b"), replace={"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 95)})
    with pytest.raises(ShapeMismatchError, match=r"o_proj.weight.*\(64, 95\).*\(64, 96\)"):
        hf_to_mcore(str(tmp_path / "b"), str(tmp_path / "o2"), progress=False)


def test_missing_and_misshapen_mcore_tensors_are_named(hf_factory, tmp_path):
    src = hf_factory("qwen3", False, torch.float32)
    mc = str(tmp_path / "mc")
    hf_to_mcore(src, mc, tp=2, pp=2, progress=False)
    path = os.path.join(rank_dir(mc, 1, 1, 2), RANK_FILE)
    blob = torch.load(path, weights_only=True)
    del blob["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    torch.save(blob, path)
    with pytest.raises(MissingTensorsError, match="mp_rank_01_001/decoder.layers.0.mlp.linear_fc2.weight"):
        mcore_to_hf(mc, str(tmp_path / "o"), progress=False)
    blob["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(64, 47)
    torch.save(blob, path)
    with pytest.raises(ShapeMismatchError, match=r"mp_rank_01_001.*linear_fc2.weight.*\(64, 47\).*\(64, 48\)"):
        reshard(mc, str(tmp_path / "o2"), tp=1, pp=1, progress=False)


def test_tokenizer_dir_wins_and_generation_config_is_derived_when_absent(hf_factory, tmp_path):
    from transformers import GenerationConfig

    src = hf_factory("qwen3", False, torch.float32)
    mc, out, tok = str(tmp_path / "mc"), str(tmp_path / "hf"), tmp_path / "tok"
    hf_to_mcore(src, mc, progress=False)
    os.remove(os.path.join(mc, "hf_extra", "generation_config.json"))
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"marker": "explicit"}')
    mcore_to_hf(mc, out, tokenizer_dir=str(tok), progress=False)
    assert json.load(open(os.path.join(out, "tokenizer_config.json"))) == {"marker": "explicit"}
    assert open(os.path.join(out, "vocab.json")).read() == '{"a": 0}'  # still carried from the source
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)
    with pytest.raises(CheckpointError, match="--tokenizer-dir"):
        mcore_to_hf(mc, str(tmp_path / "hf2"), tokenizer_dir=str(tmp_path / "nope"), progress=False)
