"""`darl-convert`: command-line front end for HF <-> Megatron-Core conversion and resharding.

What it is: argparse subcommands `hf-to-mcore`, `mcore-to-hf`, `reshard` mapping flags onto
`checkpoint_tools.convert`; bad input exits with status 2 and a one-line message.
What it is not: conversion logic (see `convert.py`).
"""

from __future__ import annotations

import argparse
import sys

from checkpoint_tools.api import SPECS, CheckpointError
from checkpoint_tools.convert import DTYPES, hf_to_mcore, mcore_to_hf, reshard


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="darl-convert", description="Convert Qwen3/Qwen2/Llama checkpoints "
                                "between Hugging Face safetensors and Megatron-LM per-rank files.")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron per-rank files")
    a.add_argument("--hf-dir", required=True, help="folder with config.json and safetensors")
    a.add_argument("--out", required=True, help="output folder (mp_rank_* folders + darl_meta.json)")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (must divide the layer count)")
    a.add_argument("--spec", choices=SPECS, default="local", help="Megatron layer spec the names follow")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="Megatron vocab padding multiple")
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast tensors (default: keep)")
    a.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    b = sub.add_parser("mcore-to-hf", help="Megatron per-rank files -> HF folder")
    b.add_argument("--mcore-dir", required=True, help="folder written by hf-to-mcore, reshard or the learner")
    b.add_argument("--out", required=True, help="output HF folder")
    b.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here (default: the carried copy)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast tensors (default: keep)")
    b.add_argument("--max-shard-size", default="2GB", help="safetensors shard cap (also the write buffer), e.g. 2GB")
    b.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    c = sub.add_parser("reshard", help="Megatron per-rank files -> another TP/PP layout")
    c.add_argument("--mcore-dir", required=True, help="source folder")
    c.add_argument("--out", required=True, help="output folder")
    c.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    c.add_argument("--pp", type=int, required=True, help="target pipeline-parallel size")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = not args.no_progress
    try:
        if args.command == "hf-to-mcore":
            meta = hf_to_mcore(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, spec=args.spec,
                               make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                               overwrite=args.overwrite, progress=progress)
            print(f"wrote {args.out}: tp={meta.tp} pp={meta.pp} dtype={meta.dtype} vocab {meta.vocab_size}"
                  f" padded to {meta.padded_vocab_size}")
        elif args.command == "mcore-to-hf":
            files = mcore_to_hf(args.mcore_dir, args.out, tokenizer_dir=args.tokenizer_dir, dtype=args.dtype,
                                max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=progress)
            print(f"wrote {args.out}: {len(files)} safetensors shard(s)")
        else:
            meta = reshard(args.mcore_dir, args.out, tp=args.tp, pp=args.pp, overwrite=args.overwrite,
                           progress=progress)
            print(f"wrote {args.out}: tp={meta.tp} pp={meta.pp}")
    except CheckpointError as e:
        print(f"darl-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
