"""A rank that leaves while the store's host (rank 0) leaves too keeps its exit code: no thread of the package is
inside a store call while the interpreter finalizes (ddp_strategy.exit_safety). Two real processes, one TCPStore."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.proc import ROOT, SCRIPTS, free_port

SCRIPT = str(SCRIPTS / "exit_with_store_thread.py")


def leave(role: str) -> tuple[int, str]:
    """Start the store's host, then the rank (``role``); return the rank's exit code and output."""
    port = free_port()
    host = subprocess.Popen([sys.executable, SCRIPT, "host", str(port)], cwd=ROOT)
    try:
        time.sleep(1.0)  # listening
        rank = subprocess.run(
            [sys.executable, SCRIPT, role, str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    finally:
        host.kill()
        host.wait()
    return rank.returncode, rank.stdout + rank.stderr


@pytest.mark.timeout(240)
def test_a_notice_watch_blocked_at_exit_does_not_abort_the_process():
    """The hazard first: a bare thread blocked in store.wait aborts the process (SIGABRT, "terminate called without
    an active exception") in at least one of three tries (every try on this machine); with a NoticeWatch, whose
    atexit hook wakes and joins its thread, the rank exits 143 every time."""
    plain = [leave("plain") for _ in range(3)]
    assert any(code == -signal.SIGABRT and "terminate called without an active exception" in out for code, out in plain)
    for _ in range(3):
        code, out = leave("watch")
        assert code == 143, out[-3000:]
