"""The placement seam: the loop does not know the launcher, the launcher names the trainer only
as a module to run, and the Learner protocol lists every call made on a learner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from megatron_darl.learner.api import Learner

PKG = Path(__file__).resolve().parents[3] / "megatron_darl"


def _loaded_after(imports: str) -> set[str]:
    code = f"import sys; {imports}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return {m for m in out.stdout.split() if m.startswith("megatron_darl")}


def test_loop_and_trainer_rank_do_not_import_the_launcher():
    mods = _loaded_after("import megatron_darl.trainer.loop, megatron_darl.trainer.rank")
    assert not [m for m in mods if m.startswith("megatron_darl.launch")], mods


def test_launcher_does_not_import_the_loop():
    mods = _loaded_after("import megatron_darl.launch.local, megatron_darl.launch.session, "
                         "megatron_darl.launch.slurm, megatron_darl.launch.slurm_job, megatron_darl.launch.engine_host")
    assert "megatron_darl.trainer.loop" not in mods and "megatron_darl.trainer.rank" not in mods, mods


def _learner_calls(path: Path, names: tuple[str, ...]) -> set[str]:
    """Attributes used on `learner` / `self.learner` in a source file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in names:
                out.add(node.attr)
            elif isinstance(base, ast.Attribute) and base.attr in names and isinstance(base.value, ast.Name) \
                    and base.value.id == "self":
                out.add(node.attr)
    return out


def test_learner_protocol_lists_every_call_of_loop_publisher_and_checkpointer():
    declared = {n for n in dir(Learner) if not n.startswith("_")} | set(Learner.__annotations__)
    used = set()
    for rel in ("trainer/loop.py", "trainer/publication.py", "trainer/checkpoints.py", "trainer/rank.py"):
        used |= _learner_calls(PKG / rel, ("learner",))
    used -= {"send_stop"}  # trainer/rank.py's own wrapper, not the learner's
    assert used, "found no learner calls: the scan is broken"
    assert used <= declared, f"calls missing from learner.api.Learner: {sorted(used - declared)}"
