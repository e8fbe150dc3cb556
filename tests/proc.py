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
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
T = TypeVar("T")


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    timed_out: bool
    orphans: bool
    result: dict[str, Any] | None
    stopped: bool = False  # ended by run_script_until's ``stop`` while still running

    def describe(self) -> str:
        return (
            f"returncode={self.returncode} timed_out={self.timed_out} orphans={self.orphans} "
            f"stopped={self.stopped} seconds={self.seconds:.1f}\n--- output (tail) ---\n{self.output[-6000:]}"
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


def _start(
    args: list[str], env: dict[str, str] | None, prefix: list[str] | None = None
) -> tuple[subprocess.Popen[str], Path | None]:
    """``[prefix...] python args...`` from the repository root, in a new session, output piped (text).

    A torchrun (``-m torch.distributed.run``) gets a private ``TMPDIR``, returned to be removed after the run: its
    agent makes a ``torchelastic_*`` log folder in the temporary directory and never removes it.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("LOCAL_RANK", None)  # never inherit a rank from an outer launcher
    # Lightning's launcher would pick a port by bind(0), inside the ephemeral range: see _worker_ports
    if "MASTER_PORT" not in full_env:  # a caller's (or the environment's) port is kept, and no port is picked
        full_env["MASTER_PORT"] = str(free_port())
    private_tmp = Path(tempfile.mkdtemp(prefix="proc-torchrun-")) if "torch.distributed.run" in args else None
    if private_tmp is not None:
        full_env["TMPDIR"] = str(private_tmp)
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    return proc, private_tmp


def _end(proc: subprocess.Popen[str], private_tmp: Path | None) -> None:
    """Every exit path of a run: kill its group, close its pipe, reap it, remove its private ``TMPDIR``."""
    kill_group(proc.pid)
    if proc.stdout is not None:
        proc.stdout.close()
    proc.wait()
    if private_tmp is not None:
        shutil.rmtree(private_tmp, ignore_errors=True)


def _orphans_left(pgid: int) -> bool:
    """Whether a member of the group ``pgid`` is still alive 10 s after its leader ended (children get a moment)."""
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _group_alive(pgid)


def run_script(
    args: list[str],
    *,
    timeout: float,
    out: Path | None = None,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> Run:
    """Run ``[prefix...] python args...`` from the repository root with a hard timeout; kill its process group."""
    start = time.monotonic()
    proc, private_tmp = _start(args, env, prefix)
    timed_out = False
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc.pid)
            output, _ = proc.communicate()
        seconds = time.monotonic() - start
        orphans = _orphans_left(proc.pid)
    finally:
        _end(proc, private_tmp)  # every exit path, including an exception inside communicate() (pytest-timeout, Ctrl-C)
    result = json.loads(out.read_text()) if out is not None and out.exists() else None
    return Run(proc.returncode, output, seconds, timed_out, orphans, result)


def run_script_until(
    args: list[str], *, timeout: float, stop: Callable[[str, float], bool], env: dict[str, str] | None = None
) -> Run:
    """:func:`run_script` reading the output as it comes, ended early (``stopped=True``) once ``stop`` says so.

    ``stop(output, idle)`` gets the output so far and the seconds since its last line; it is asked every 0.2 s while
    the script runs. A stopped run's process group is killed while still running (its returncode is -SIGKILL). The
    hard timeout, the group kill in every exit path and the orphan check are :func:`run_script`'s.
    """
    start = time.monotonic()
    proc, private_tmp = _start(args, env)
    lines: list[str] = []
    last_line = [start]

    def read() -> None:  # until EOF: every process of the group holding the pipe has ended
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            last_line[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = stopped = False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            timed_out = now - start > timeout
            stopped = not timed_out and stop("".join(lines), now - last_line[0])
            if timed_out or stopped:
                kill_group(proc.pid)
                break
            time.sleep(0.2)
        proc.wait()
        reader.join(timeout=10)
        seconds = time.monotonic() - start
        orphans = _orphans_left(proc.pid)
    finally:
        kill_group(proc.pid)
        reader.join(timeout=10)
        _end(proc, private_tmp)
    return Run(proc.returncode, "".join(lines), seconds, timed_out, orphans, None, stopped)


def run_scenario(
    name: str, tmp_path: Path, *extra: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Run:
    """Run ``tests/scripts/scenario.py NAME`` and return its outcome (``result`` is rank 0's JSON)."""
    out = tmp_path / f"{name}.json"
    args = [str(SCRIPTS / "scenario.py"), name, "--out", str(out), *extra]
    return run_script(args, timeout=timeout, out=out, env=env)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and ``bind(0)`` (32768 unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_ports() -> list[int]:
    """This pytest worker's share of the ports below the ephemeral range, rotated to a random start.

    Below the ephemeral range no outgoing connection (another run's gloo or store client) can take a port between
    its pick and the rendezvous store's ``bind``: that race failed CI once, with Lightning's own pick (a
    ``bind(0)`` port) taken by the time rank 0 listened, while nine runs started at once. The pytest-xdist workers
    take disjoint shares, so two workers never pick the same port.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    high = _ephemeral_low()
    share = list(range(max(1024, high - 12000) + worker, high, workers))
    start = random.randrange(len(share))
    return share[start:] + share[:start]


_PORTS = _worker_ports()
_PORTS_LOCK = threading.Lock()
_next_port = 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the ephemeral range and new to this worker (for a rendezvous).

    A port is skipped while anything is bound to it, including a socket of an earlier run still in ``TIME_WAIT``
    (the check binds without ``SO_REUSEADDR``).

    Raises:
        AssertionError: every port of this worker's share is in use.

    """
    global _next_port
    with _PORTS_LOCK:
        for _ in range(len(_PORTS)):
            port = _PORTS[_next_port % len(_PORTS)]
            _next_port += 1
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise AssertionError(f"all {len(_PORTS)} ports of this worker's share are in use")


def torchrun_two_nodes(
    tmp_path: Path,
    *args: str,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    node1_prefix: list[str] | None = None,
    timeout: float = 240,
) -> list[Run]:
    """``scenario.py fit_ok`` as 2 torchrun "nodes" of ``nproc`` processes each, both started at once on this host.

    ``args`` go to the scenario (``--devices nproc --num-nodes 2`` are added); ``node1_prefix`` wraps node 1's
    command (e.g. a private mount namespace). Returns node 0's and node 1's runs; rank 0's JSON is node 0's result.
    """
    port = free_port()

    def node(rank: int) -> Run:
        out = tmp_path / f"node{rank}.json"
        cmd = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(rank)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPTS / "scenario.py"), "fit_ok"]
        cmd += ["--out", str(out), "--devices", str(nproc), "--num-nodes", "2", *args]
        prefix = node1_prefix if rank == 1 else None
        return run_script(cmd, timeout=timeout, out=out, env=env, prefix=prefix)

    return at_once(lambda: node(0), lambda: node(1))


def at_once(*jobs: Callable[[], T]) -> list[T]:
    """Run each of ``jobs`` in a thread of its own, all started together (e.g. two "nodes"); their results, in order.

    Raises:
        AssertionError: a job raised (its error is chained).

    """
    results: list[tuple[bool, Any]] = [(False, None)] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = (True, jobs[i]())
        except BaseException as err:  # re-raised below, in the test's thread
            results[i] = (False, err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ok, value in results:
        if not ok:
            raise AssertionError(f"a job run at once failed: {value!r}") from value
    return [value for _, value in results]


def stock_fit_finished(run: Run) -> bool:
    """Stock Lightning's run returned on every rank and no process is left.

    Stock Lightning destroys its process group at exit for NCCL only; with gloo a rank sometimes aborts at
    interpreter exit, after the run and the script's own output ("terminate called without an active exception",
    SIGABRT): that is accepted. Seen in a core dump here (torch 2.14.1): a gloo worker thread
    (``ProcessGroupGloo::runLoop``) drops the last reference to a finished work whose thread-local state holds a Python
    object while the main thread finalizes; taking the GIL then ends the thread with ``pthread_exit``, whose forced
    unwind calls ``std::terminate``. 4 of 12 bare stock fits aborted, 0 of 12 when the script destroyed the group;
    SafeDDPStrategy destroys it at exit (``RunLifecycle.create_process_group``).
    """
    aborted_at_exit = run.returncode == -signal.SIGABRT and "terminate called without an active exception" in run.output
    return (run.returncode == 0 or aborted_at_exit) and not run.orphans and not run.timed_out


def load_bench(name: str, path: Path) -> Any:
    """Import the benchmark script ``path`` as module ``name`` (the bench/ scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is created
    spec.loader.exec_module(module)
    return module
