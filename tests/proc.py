"""Run standalone multi-process scripts with hard timeouts, and prove no process is left behind.

Every script runs in a new session (its own process group). Lightning's launcher and torchrun start their ranks
in that same group, so after the script ends any member still alive is an orphan: the test fails, and the group
is killed either way so a broken run never stalls CI. The group is killed in every exit path (a ``finally``), also
when pytest-timeout (``timeout_method = "signal"``) fails the test while it waits for the script, so a timed-out
test leaves no process behind either (``tests/test_proc.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    timed_out: bool
    orphans: bool
    result: dict[str, Any] | None

    def describe(self) -> str:
        return (
            f"returncode={self.returncode} timed_out={self.timed_out} orphans={self.orphans} "
            f"seconds={self.seconds:.1f}\n--- output (tail) ---\n{self.output[-6000:]}"
        )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies still count for killpg(0); ignore them by checking /proc
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group ``pgid``; nothing happens when none is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_script(
    args: list[str],
    *,
    timeout: float,
    out: Path | None = None,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> Run:
    """Run ``[prefix...] python args...`` from the repository root with a hard timeout; kill its process group."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("LOCAL_RANK", None)  # never inherit a rank from an outer launcher
    start = time.monotonic()
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    timed_out = False
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc.pid)
            output, _ = proc.communicate()
        seconds = time.monotonic() - start
        # Give children a moment to notice the end of their parent before calling them orphans.
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = _group_alive(proc.pid)
    finally:
        # Every exit path, including an exception raised inside communicate() (pytest-timeout, Ctrl-C).
        kill_group(proc.pid)
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()
    result = json.loads(out.read_text()) if out is not None and out.exists() else None
    return Run(proc.returncode, output, seconds, timed_out, orphans, result)


def run_scenario(
    name: str, tmp_path: Path, *extra: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Run:
    """Run ``tests/scripts/scenario.py NAME`` and return its outcome (``result`` is rank 0's JSON)."""
    out = tmp_path / f"{name}.json"
    args = [str(SCRIPTS / "scenario.py"), name, "--out", str(out), *extra]
    return run_script(args, timeout=timeout, out=out, env=env)
