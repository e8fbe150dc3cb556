"""tests/proc.py leaves no process behind, also when pytest-timeout fails a test while its script is still running.

The suite runs pytest-timeout with ``timeout_method = "signal"``: the timeout raises inside the test, wherever it
waits, so only a ``finally`` in ``run_script`` can kill the script's process group. Each test below runs an inner
pytest (in a subprocess, with a 5 s ``--timeout``) whose one test starts ``tests/scripts/sleepers.py`` (a parent and
two children that ignore SIGTERM and sleep for an hour) and waits for it far longer than that timeout. Afterwards
the outer test looks up every pid the sleepers wrote.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proc import ROOT, _group_alive, free_port, kill_group, run_script

pytestmark = pytest.mark.timeout(120)

GUARDED = """
from tests.proc import SCRIPTS, run_script


def test_waits_longer_than_its_timeout():
    run_script([str(SCRIPTS / "sleepers.py"), "--pids", {pids!r}], timeout=600)
"""

# The same wait without tests/proc.py: the control that shows the survivor check can see orphans at all.
UNGUARDED = """
import subprocess
import sys

from tests.proc import SCRIPTS


def test_waits_longer_than_its_timeout():
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "sleepers.py"), "--pids", {pids!r}], start_new_session=True
    )
    proc.communicate(timeout=600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_inner(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run ``source`` as a pytest file with ``--timeout 5``; return its outcome and the sleepers' pids (the parent's
    last, once it has written it: then all three were running)."""
    pids = tmp_path / "pids.txt"
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(source.format(pids=str(pids)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "--timeout", "5", "-o", "timeout_method=signal"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    lines = pids.read_text().splitlines() if pids.exists() else []
    parent = [int(line.split()[1]) for line in lines if line.startswith("parent ")]
    return inner, [int(line) for line in lines if not line.startswith("parent ")] + parent


def test_timed_out_test_leaves_no_process_of_its_script_behind(tmp_path):
    inner, pids = run_inner(tmp_path, GUARDED)
    output = inner.stdout + inner.stderr
    assert inner.returncode == 1, output  # the inner test failed ...
    assert "Timeout (>5.0s) from pytest-timeout" in output, output  # ... because pytest-timeout fired
    assert len(pids) == 3, (pids, output)  # the parent and both children were running when it fired
    deadline = time.monotonic() + 10  # SIGKILLed children are reaped by init shortly after
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], f"survivors of {pids}:\n{output}"
    assert not _group_alive(pids[-1])  # the parent leads the script's process group


def test_without_tests_proc_the_same_timeout_leaves_orphans(tmp_path):
    """The control: a plain Popen + communicate, timed out the same way, leaves all three sleepers running."""
    inner, pids = run_inner(tmp_path, UNGUARDED)
    output = inner.stdout + inner.stderr
    try:
        assert inner.returncode == 1 and "Timeout (>5.0s) from pytest-timeout" in output, output
        assert len(pids) == 3, (pids, output)
        time.sleep(1)
        assert all(alive(pid) for pid in pids), f"expected orphans, found {[p for p in pids if alive(p)]}"
    finally:
        for pid in pids:  # each sleeper's group (all three share one)
            with contextlib.suppress(ProcessLookupError):
                kill_group(os.getpgid(pid))


@pytest.mark.parametrize("conftest", [True, False], ids=["with-conftest", "without"])
def test_sigterm_to_pytest_runs_the_finally_that_kills_the_scripts_group(tmp_path, conftest):
    """A CI job's timeout (or ``kill``) sends pytest SIGTERM. With tests/conftest.py's handler it ends the run like
    Ctrl-C, through ``run_script``'s ``finally``, and the sleepers die; without it the interpreter ends at once and
    all three keep running (the control)."""
    pids = tmp_path / "pids.txt"
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(GUARDED.format(pids=str(pids)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plugin = ["-p", "tests.conftest"] if conftest else []
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", *plugin,
         "--rootdir", str(tmp_path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    found: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and "parent " in pids.read_text()):
            assert time.monotonic() < deadline and inner.poll() is None, "the sleepers did not start"
            time.sleep(0.1)
        lines = pids.read_text().splitlines()
        found = [int(x) for x in lines if not x.startswith("parent ")] + [int(lines[-1].split()[1])]
        inner.send_signal(signal.SIGTERM)
        output, _ = inner.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in found) and time.monotonic() < deadline:
            time.sleep(0.1)
        if conftest:
            assert inner.returncode == 2 and "KeyboardInterrupt" in output, output  # pytest's interrupted exit
            assert not [pid for pid in found if alive(pid)], f"survivors of {found}:\n{output}"
        else:
            assert inner.returncode == -signal.SIGTERM, output
            assert all(alive(pid) for pid in found), f"expected orphans, found {[p for p in found if alive(p)]}"
    finally:
        kill_group(inner.pid)
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                kill_group(os.getpgid(pid))


def test_a_torchrun_leaves_no_torchelastic_folder_behind():
    # torchrun's agent makes a torchelastic_* log folder in the temporary directory and never removes it: each run
    # gets a private TMPDIR, removed after it (the folder was there while the run lasted)
    listing = "echo tmpdir=$TMPDIR; ls -d $TMPDIR/torchelastic_*"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--no-python", "sh", "-c", listing]
    run = run_script(cmd, timeout=60)
    assert run.returncode == 0 and not run.orphans, run.describe()
    private = Path(re.search(r"tmpdir=(\S+)", run.output).group(1))  # type: ignore[union-attr]
    assert re.search(rf"{re.escape(str(private))}/torchelastic_\w+", run.output), run.describe()
    assert private.name.startswith("proc-torchrun-") and not private.exists()


def test_a_run_gets_a_master_port_below_the_ephemeral_range_that_no_other_pick_repeats(monkeypatch):
    """The port a script's launcher listens on is picked by tests/proc.py, not by Lightning's ``bind(0)``.

    A ``bind(0)`` port lies in the kernel's ephemeral range, where another run's outgoing connection can take it
    before rank 0 listens (CI failed once on exactly that, ``EADDRINUSE`` in ``TCPStore``). A caller's own
    ``MASTER_PORT`` is kept.
    """
    monkeypatch.delenv("MASTER_PORT", raising=False)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    printed = [
        run_script(["-c", "import os; print(os.environ['MASTER_PORT'])"], timeout=60).output.strip() for _ in range(3)
    ]
    ports = [int(port) for port in printed] + [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), ports
    assert len(set(ports)) == len(ports), ports
    kept = run_script(["-c", "import os; print(os.environ['MASTER_PORT'])"], timeout=60, env={"MASTER_PORT": "12345"})
    assert kept.output.strip() == "12345"


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    """``free_port`` binds each candidate first: one that a listener holds is passed over, the next one returned."""
    import tests.proc as proc

    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        free = spare.getsockname()[1]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(proc, "_PORTS", [taken, free])
        monkeypatch.setattr(proc, "_next_port", 0)
        assert proc.free_port() == proc._PORTS[1]
        monkeypatch.setattr(proc, "_PORTS", [taken])
        monkeypatch.setattr(proc, "_next_port", 0)
        with pytest.raises(AssertionError, match="all 1 ports of this worker's share are in use"):
            proc.free_port()
