"""Local supervisor: a crash of any child stops the run by name; nothing is left behind."""

import os
import signal
import sys
import time

import pytest

from megatron_darl.launch.supervisor import ChildFailed, Supervisor
from tests.helpers import repo_env

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[1].split()[0] != "Z"


def _spawn_grandchild_script(pidfile):
    # the child starts a sleeping grandchild, records its pid, then sleeps itself
    return [PY, "-c", (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid));"
        "print('ready', flush=True); time.sleep(60)"
    )]


@pytest.mark.timeout(60)
def test_crash_of_one_child_stops_all_and_names_it(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    cleaned = []
    with pytest.raises(ChildFailed) as exc:
        with Supervisor(str(tmp_path / "logs"), echo=None, grace_s=2) as sup:
            sup.on_shutdown(lambda: cleaned.append(True))
            sleeper = sup.start("engine0", _spawn_grandchild_script(pidfile))
            sup.start("manager", [PY, "-c", "import time, sys; time.sleep(1.0); sys.exit(7)"])
            main = sup.start("learner0", [PY, "-c", "import time; time.sleep(60)"])
            sup.wait(main, timeout_s=30)
    assert exc.value.role == "manager" and exc.value.code == 7
    assert "manager" in str(exc.value) and "exit code 7" in str(exc.value)
    assert cleaned == [True]
    time.sleep(0.2)
    assert not _alive(sleeper.pid)
    assert not _alive(int(pidfile.read_text())), "grandchild left behind"


@pytest.mark.timeout(60)
def test_logs_are_prefixed_and_teed(tmp_path, capsys):
    import io

    buf = io.StringIO()
    with Supervisor(str(tmp_path / "logs"), echo=buf) as sup:
        c = sup.start("learner0", [PY, "-c", "print('hello'); print('world')"])
        assert sup.wait(c, timeout_s=30) == 0
    assert "[learner0] hello\n[learner0] world\n" in buf.getvalue()
    assert (tmp_path / "logs" / "learner0.log").read_text() == "hello\nworld\n"


@pytest.mark.timeout(60)
def test_killed_child_reports_signal(tmp_path):
    with pytest.raises(ChildFailed, match="SIGKILL"):
        with Supervisor(str(tmp_path / "logs"), echo=None, grace_s=1) as sup:
            victim = sup.start("engine0", [PY, "-c", "import time; time.sleep(60)"])
            main = sup.start("learner0", [PY, "-c", "import time; time.sleep(60)"])
            time.sleep(0.5)
            os.kill(victim.pid, signal.SIGKILL)
            sup.wait(main, timeout_s=30)
    assert not _alive(main.pid)


@pytest.mark.timeout(60)
def test_launcher_death_takes_children_down(tmp_path):
    """If the launcher itself is SIGKILLed, the parent-death signal stops its children."""
    pidfile = tmp_path / "child.pid"
    script = (
        "import sys, time;"
        "from megatron_darl.launch.supervisor import Supervisor;"
        "sup = Supervisor(%r, echo=None); sup.__enter__();"
        "c = sup.start('engine0', [sys.executable, '-c', 'import time; time.sleep(60)']);"
        "open(%r, 'w').write(str(c.pid)); time.sleep(60)"
    ) % (str(tmp_path / "logs"), str(pidfile))
    import subprocess

    launcher = subprocess.Popen([PY, "-c", script], env=repo_env())
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert _alive(child)
    launcher.kill()
    launcher.wait()
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child)
