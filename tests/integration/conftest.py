"""The Slurm tests' session fixtures, `slurm_cluster` and `demo_dir` (`tests/helpers/slurm.py`),
registered here so that every module of tests/integration shares one of each."""

from tests.helpers.slurm import demo_dir, slurm_cluster  # noqa: F401
