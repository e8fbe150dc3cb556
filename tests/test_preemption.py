"""Preemption across real processes: SIGTERM to every rank, to rank 0 only, to rank 1 only, under Lightning's
subprocess and spawn launchers and under torchrun; every rank stops at one agreed step with a checkpoint, exits
with 143, and the run resumes from it bit-exactly. Stock Lightning deadlocks in the same script (bounded here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddp_strategy.checkpoint.format import verify
from tests.proc import ROOT, SCRIPTS, Run, _group_alive, run_scenario, run_script
from tests.test_checkpoint_multiprocess import max_abs_diff, uninterrupted_run

pytestmark = pytest.mark.multiprocess

#: the documented bound: every rank out within this many seconds of the first signal (small model, CPU)
EXIT_BOUND_SECONDS = 30.0

_SENT = re.compile(r"FaultInjector: sending SIGTERM at t=([\d.]+) \(training goes on\) on rank (\d+) at step (\d+)")
_STOP = re.compile(
    r"ddp_strategy: preempted: rank (\d+) "
    r"(received SIGTERM at step \d+|stops for SIGTERM on rank \d+ \(at step \d+\)); "
    r"all (\d+) rank\(s\) stopped after step (\d+) \([\d.]+ s after the signal\) and saved (\S+); resume with "
    r"trainer\.fit\(\.\.\., ckpt_path=\"last\"\)\. Exiting with code 143 \(SIGTERM\)\."
)


@dataclass
class Stop:
    step: int
    path: Path
    signalled: dict[int, int]  # rank -> global step at which it sent itself SIGTERM
    receivers: set[int]  # ranks whose stop line says "received"


def assert_preempted(run: Run, finished: float, world_size: int = 2) -> Stop:
    """The run stopped as documented: exit 143, one stop line per rank agreeing on step and file, within the bound,
    the file verifies and holds a step >= every signal's, no process left."""
    assert run.returncode == 143, run.describe()
    assert not run.timed_out and not run.orphans, run.describe()
    sent = _SENT.findall(run.output)
    assert sent, run.describe()
    stops = _STOP.findall(run.output)
    assert sorted(int(s[0]) for s in stops) == list(range(world_size)), run.describe()
    assert {(int(s[2]), int(s[3]), s[4]) for s in stops} == {(world_size, int(stops[0][3]), stops[0][4])}
    step, path = int(stops[0][3]), Path(stops[0][4])
    signalled = {int(rank): int(at) for _, rank, at in sent}
    assert finished - min(float(t) for t, _, _ in sent) < EXIT_BOUND_SECONDS, run.describe()
    record = verify(str(path))
    assert record.global_step == step and step >= max(signalled.values())
    assert "Traceback" not in run.output and "failed" not in run.output.lower(), run.describe()
    receivers = {int(s[0]) for s in stops if s[1].startswith("received")}
    return Stop(step, path, signalled, receivers)


def preempt_then_resume(
    tmp_path: Path, *fault_and_launch: str, strategy: str = "safe_ddp", runs_out: list[Run] | None = None
) -> tuple[Stop, float]:
    """Train 4 epochs with SIGTERM sent as ``fault_and_launch`` says, then resume from ``last`` to the end; return
    the stop and the largest weight difference to the uninterrupted run."""
    full, full_steps = uninterrupted_run(tmp_path, ())
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.pt"
    common = ["--max-epochs", "4", "--ckpt-dir", str(ckpt), "--strategy", strategy]
    run = run_scenario("fit_ok", tmp_path, *common, *fault_and_launch)
    if runs_out is not None:
        runs_out.append(run)
    stop = assert_preempted(run, time.time())
    assert stop.path == ckpt / "last.ckpt"
    again = run_scenario("fit_ok", tmp_path, *common, "--resume", "last", "--save-weights", str(resumed))
    assert again.returncode == 0 and not again.orphans, again.describe()
    assert f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}" in again.output, again.describe()
    assert again.result is not None
    if strategy != "safe_ddp_spawn":  # the spawn launcher's main process gets the weights back, not the step count
        assert again.result["global_step"] == full_steps
    return stop, max_abs_diff(full, resumed)


@pytest.mark.parametrize(
    ("faults", "receivers"),
    [
        pytest.param(["--fault", "signal:0:5", "--fault", "signal:1:5"], {0, 1}, marks=pytest.mark.compat),
        (["--fault", "signal:0:5"], {0}),
        (["--fault", "signal:1:5"], {1}),
    ],
    ids=["all-ranks", "rank0-only", "rank1-only"],
)
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_that_resumes_bit_exact(tmp_path, faults, receivers):
    stop, diff = preempt_then_resume(tmp_path, *faults)
    assert stop.receivers == receivers
    assert diff == 0.0


@pytest.mark.compat
def test_spawn_launcher_exits_143_and_resumes_bit_exact(tmp_path):
    # the spawn launcher's main process is no rank: it exits with the code the ranks stopped with
    stop, diff = preempt_then_resume(tmp_path, "--fault", "signal:1:5", strategy="safe_ddp_spawn")
    assert stop.receivers == {1}
    assert diff == 0.0


def test_a_second_sigterm_during_the_save_changes_nothing(tmp_path):
    # rank 0 sends itself SIGTERM inside every save from step 5 on: the first starts the stop, the next one arrives
    # while the preemption checkpoint is being written
    runs: list[Run] = []
    stop, diff = preempt_then_resume(tmp_path, "--fault", "signal:1:5", "--signal-on-save", "5", runs_out=runs)
    assert f"scenario: rank 0 sends itself SIGTERM during the save at step {stop.step}" in runs[0].output
    assert diff == 0.0


@pytest.mark.timeout(300)
def test_torchrun_restarts_the_preempted_workers_which_resume_bit_exact(tmp_path):
    """torchrun --max-restarts=1: rank 1 gets SIGTERM in the first attempt; both workers stop at one step and exit
    143, torchrun restarts them, they resume from last.ckpt (ckpt_path="last") and end with the uninterrupted run's
    weights."""
    full, full_steps = uninterrupted_run(tmp_path, ())
    ckpt, resumed, out = tmp_path / "ckpt", tmp_path / "resumed.pt", tmp_path / "torchrun.json"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += [str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(out), "--max-epochs", "4", "--ckpt-dir", str(ckpt)]
    cmd += ["--resume", "last", "--save-weights", str(resumed), "--fault", "signal:1:5"]  # first attempt only
    run = run_script(cmd, timeout=240, out=out)
    assert run.returncode == 0 and not run.orphans, run.describe()
    first_attempt = run.output.split("Restoring states from the checkpoint")[0]
    stops = _STOP.findall(first_attempt)
    assert sorted(int(s[0]) for s in stops) == [0, 1], run.describe()
    assert re.search(r"failed \(exitcode: 143\) local_rank: \d", run.output), run.describe()  # torchrun's report
    assert f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}" in run.output, run.describe()
    assert run.result is not None and run.result["global_step"] == full_steps
    assert max_abs_diff(full, resumed) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_the_preemption_save_leaves_no_bad_checkpoint(tmp_path):
    """The grace period ran out: SIGTERM to every rank, then SIGKILL to the whole job while a checkpoint file is
    being written after the signal. Every visible checkpoint verifies, and fit(ckpt_path="last") resumes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LOCAL_RANK", None)
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(tmp_path / "x.json")]
    cmd += ["--max-epochs", "4", "--ckpt-dir", str(ckpt), "--hidden", "500000"]  # 22 MB per checkpoint
    cmd += ["--fault", "signal:0:5", "--fault", "signal:1:5"]
    log_path = tmp_path / "job.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 150
        while "FaultInjector: sending SIGTERM" not in log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text(errors="replace")
            time.sleep(0.01)
        while not any(e.name.startswith(".") for e in os.scandir(ckpt)):  # a write after the signal is in progress
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text(errors="replace")
            time.sleep(0.001)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        while _group_alive(proc.pid):
            time.sleep(0.05)
    files = sorted(ckpt.glob("*.ckpt"))
    assert files, "no checkpoint at all"
    for path in files:
        assert verify(str(path)).global_step is not None, path
    again = run_scenario(
        "fit_ok", tmp_path, "--max-epochs", "4", "--ckpt-dir", str(ckpt), "--hidden", "500000", "--resume", "last"
    )
    assert again.returncode == 0 and not again.orphans, again.describe()
    assert "Restored all states from the checkpoint" in again.output, again.describe()


@pytest.mark.timeout(120)
def test_stock_lightning_deadlocks_when_every_rank_gets_sigterm(tmp_path):
    """The same script with stock DDPStrategy: both ranks print Lightning's "Received SIGTERM", then wait forever in
    the broadcast its handler starts (killed here after 45 s); nothing is saved after the signal."""
    ckpt = tmp_path / "ckpt"
    run = run_scenario(
        "fit_ok", tmp_path, "--strategy", "ddp", "--max-epochs", "4", "--ckpt-dir", str(ckpt),
        "--fault", "signal:0:5", "--fault", "signal:1:5", timeout=45,
    )  # fmt: skip
    assert run.timed_out, run.describe()
    assert "[rank: 0] Received SIGTERM" in run.output and "[rank: 1] Received SIGTERM" in run.output
    steps = [torch.load(p, weights_only=True)["global_step"] for p in ckpt.glob("*.ckpt")]
    assert all(step < 5 for step in steps), steps
