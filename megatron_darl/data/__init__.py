"""Data role: prompt sources (reasoning-gym, JSONL/parquet, HumanEval), tokenizers, prompt
formatting and the resumable `PromptLoader`. The contract is in `api.py`; `sources.py` builds
loaders from a `DataConfig`."""
