"""Drive the one-node SLURM cluster of ``.ci/slurm-cluster.sh`` from the tests (``tests/test_slurm.py``).

``start_cluster`` runs ``slurm-cluster.sh start DIR`` (all config and state under DIR) and ``stop_cluster`` its
``stop``. ``Cluster.submit`` writes an sbatch script into a job directory (``--nodes=1 --ntasks-per-node=2``, the
output of every task in ``job.out``) and submits it; ``Job`` reads the job's state and exit code from
``scontrol show job -o`` (the cluster keeps finished jobs for an hour, ``MinJobAge=3600``; there is no accounting
daemon for ``sacct``), waits for it with a hard deadline, and finds its processes by their environment
(``SLURM_JOB_ID`` and this cluster's ``SLURM_CONF``), so a test can prove that none is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CLUSTER_SCRIPT = ROOT / ".ci" / "slurm-cluster.sh"

#: slurm-cluster.sh exit codes that mean "this machine cannot run the cluster" (the tests skip with its message)
CANNOT_RUN = {3: "not root", 4: "no apt-get", 5: "packages not installed"}

#: job states after which nothing of the job runs any more (scontrol shows COMPLETING until its processes are gone)
FINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}

#: environment variables of the test process that must not reach the job (it gets its ranks from SLURM)
_NOT_FOR_JOBS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")


class CannotRun(Exception):
    """The cluster cannot run on this machine (the reason comes from slurm-cluster.sh)."""


def start_cluster(directory: Path) -> Cluster:
    """Start the cluster with its state in ``directory``; raise ``CannotRun`` or ``RuntimeError``."""
    done = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=120
    )
    if done.returncode in CANNOT_RUN:
        raise CannotRun(done.stderr.strip() or CANNOT_RUN[done.returncode])
    if done.returncode != 0:
        raise RuntimeError(f"slurm-cluster.sh start failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return Cluster(directory.resolve())


def stop_cluster(directory: Path) -> str:
    """Stop the cluster in ``directory``: cancel its jobs, SIGKILL what is left of them, stop its daemons."""
    done = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "stop", str(directory)], capture_output=True, text=True, timeout=180
    )
    if done.returncode != 0:
        raise RuntimeError(f"slurm-cluster.sh stop failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def parse_scontrol(line: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show ... -o`` line."""
    return dict(re.findall(r"(\S+?)=(\S*)", line))


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str] = field(init=False)
    jobs: list[Job] = field(default_factory=list)  # every job submitted, for clean_up

    def __post_init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_JOBS and not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.pop("PYTEST_CURRENT_TEST", None)
        self.env = env

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        """Run a SLURM client (sbatch, scontrol, scancel, ...) against this cluster; its stdout."""
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def submit(self, directory: Path, name: str, args: list[str], *, sbatch: tuple[str, ...] = ()) -> Job:
        """Write ``directory/job.sh`` (2 tasks on 1 node, ``srun --label python ARGS``: each output line starts
        with its task number, ``0: `` or ``1: ``) and submit it with sbatch; ``sbatch``: more ``#SBATCH`` options.
        Every job gets a time limit of 5 minutes (a safety net: the tests' own timeouts are shorter)."""
        directory.mkdir(parents=True, exist_ok=True)
        output = directory / "job.out"
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name=ddp-{name}",  # not bash/interactive: Lightning then uses SLURMEnvironment
            "#SBATCH --nodes=1",
            "#SBATCH --ntasks-per-node=2",  # = Trainer(devices=2, num_nodes=1)
            f"#SBATCH --output={output}",
            "#SBATCH --open-mode=append",  # a requeued run appends to the first run's output
            f"#SBATCH --chdir={directory}",  # Lightning's default_root_dir: hpc_ckpt_<n>.ckpt goes here
            "#SBATCH --time=5",
            *(f"#SBATCH {option}" for option in sbatch),
            'echo "job.sh: run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID starts at $(date +%s.%N)"',
            f"srun --label {shlex.join([sys.executable, *args])}",
        ]
        script = directory / "job.sh"
        script.write_text("\n".join(lines) + "\n")
        out = self.run("sbatch", "--parsable", str(script))
        job = Job(self, int(out.strip().split(";")[0]), directory, time.time())
        self.jobs.append(job)
        return job


@dataclass
class Job:
    cluster: Cluster = field(repr=False)
    id: int
    directory: Path
    submitted: float

    @property
    def output_path(self) -> Path:
        return self.directory / "job.out"

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def info(self) -> dict[str, str]:
        """The job's record from ``scontrol show job -o`` (JobState, ExitCode, Restarts, BeginTime, ...)."""
        return parse_scontrol(self.cluster.run("scontrol", "show", "job", "-o", str(self.id)))

    def describe(self) -> str:
        try:
            record = self.info()
            facts = " ".join(f"{k}={record.get(k)}" for k in ("JobState", "ExitCode", "Restarts", "Reason"))
        except Exception as e:  # a description for a failure message
            facts = f"(scontrol failed: {e})"
        return f"job {self.id}: {facts}\n--- {self.output_path} (tail) ---\n{self.output()[-8000:]}"

    def step(self, rank: int) -> tuple[int, float, str] | None:
        """What ``slurm_train.py``'s rank last wrote: (global step, time, running|paused), or None yet."""
        path = self.directory / "progress" / f"rank{rank}.step"
        try:
            step, when, what = path.read_text().split()
        except (OSError, ValueError):
            return None
        return int(step), float(when), what

    def script_pids(self) -> list[int]:
        """The PIDs that ``slurm_train.py``'s ranks wrote at their start."""
        return sorted(int(p.read_text()) for p in (self.directory / "progress").glob("rank*.pid"))

    def wait(self, condition: str, predicate: Callable[[], bool], timeout: float, poll: float = 0.1) -> None:
        """Poll ``predicate()`` until true; fail with the job's state and output after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {condition}\n{self.describe()}")
            time.sleep(poll)

    def wait_for_step(self, step: int, timeout: float, paused: bool = False) -> int:
        """Wait until every rank reported ``step`` (and, with ``paused``, is pausing there); the highest step."""

        def reached() -> bool:
            found = [self.step(rank) for rank in (0, 1)]
            if any(f is None for f in found):
                return False
            if paused:
                return all(f is not None and f[0] == step and f[2] == "paused" for f in found)
            return all(f is not None and f[0] >= step for f in found)

        self.wait(f"step {step}{' (paused)' if paused else ''} on both ranks", reached, timeout)
        return max(f[0] for f in (self.step(0), self.step(1)) if f is not None)

    def wait_for_state(self, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its record."""
        record: dict[str, str] = {}

        def done() -> bool:
            nonlocal record
            record = self.info()
            return record.get("JobState") in states

        self.wait(f"job state in {sorted(states)}", done, timeout, poll=0.2)
        return record

    def wait_until_gone(self, timeout: float) -> dict[str, str]:
        """Wait until the job is in a final state and no process of it is left; its record."""
        record = self.wait_for_state(FINAL_STATES, timeout)
        self.wait("no process of the job left", lambda: not self.processes(), timeout=15)
        alive = [pid for pid in self.script_pids() if _alive(pid)]
        assert not alive, f"processes of the training script still alive: {alive}\n{self.describe()}"
        return record

    def processes(self) -> list[int]:
        """The PIDs of every live process whose environment names this job and this cluster."""
        return _processes_with({f"SLURM_JOB_ID={self.id}", f"SLURM_CONF={self.cluster.conf}"})

    def cancel(self, *options: str) -> float:
        """``scancel [options] JOBID``; the time just before it ran."""
        sent = time.time()
        self.cluster.run("scancel", *options, str(self.id))
        return sent

    def task_exits(self, step: str = "0") -> list[TaskExit]:
        """How each task of job step ``step`` ended, in the order slurmd logged it (every run of a requeued job)."""
        log = self.cluster.directory / "log" / "slurmd.log"
        found = []
        pattern = re.compile(
            rf"^\[([^\]]+)\] \[{self.id}\.{step}\] task (\d+) \((\d+)\) exited"
            r"(?: with exit code (\d+)\.|\. Killed by signal (\d+)\.)"
        )
        for line in log.read_text(errors="replace").splitlines():
            m = pattern.match(line)
            if m:
                when = datetime.fromisoformat(m[1]).timestamp()  # slurmd logs local time
                outcome = f"exit code {m[4]}" if m[4] is not None else f"signal {m[5]}"
                found.append(TaskExit(when, int(m[2]), int(m[3]), outcome))
        return found

    def clean_up(self) -> None:
        """SIGKILL every process of the job by PID (its tasks, srun, the batch shell), and cancel it if it still
        runs (``scancel`` alone would take KillWait's 30 s with a task that does not end on SIGTERM)."""
        deadline = time.monotonic() + 15
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(Exception):
            if self.info().get("JobState") not in FINAL_STATES:
                self.cluster.run("scancel", str(self.id), check=False)


@dataclass
class TaskExit:
    time: float  # when slurmd logged it
    task: int
    pid: int
    outcome: str  # "exit code N" or "signal N"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _processes_with(entries: set[str]) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = set(Path(f"/proc/{name}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if all(e.encode() in environ for e in entries) and _alive(int(name)):
            found.append(int(name))
    return found
