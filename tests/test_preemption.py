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
from tests.proc import ROOT, SCRIPTS, Run, _group_alive, free_port, run_scenario, run_script, run_script_until
from tests.test_checkpoint_multiprocess import max_abs_diff, uninterrupted_run

pytestmark = pytest.mark.multiprocess

#: the documented bound: every rank out within this many seconds of the first signal (small model, CPU)
EXIT_BOUND_SECONDS = 30.0

_SENT = re.compile(r"FaultInjector: sending (SIG\w+) at t=([\d.]+) \(training goes on\) on rank (\d+) at step (\d+)")
_STOP = re.compile(
    r"ddp_strategy: preempted: rank (\d+) "
    r"(received SIG\w+ at step \d+|stops for SIG\w+ on rank \d+ \(at step \d+\)); "
    r"all (\d+) rank\(s\) stopped (?:after step |at validation batch \d+ at step )(\d+) \(([\d.]+) s after the "
    r"signal\) and saved (\S+)(?: \(the training position of step \d+; the resumed run repeats this validation\))?; "
    r"resume with trainer\.fit\(\.\.\., ckpt_path=\"last\"\)\. Exiting with code (\d+) \((SIG\w+)\)\."
)


@dataclass
class Stop:
    step: int
    path: Path
    signalled: dict[int, int]  # rank -> global step at which it sent itself the signal
    receivers: set[int]  # ranks whose stop line says "received"
    first_signal: float  # time.time() of the first signal


def assert_stopped(output: str, *, signal_name: str = "SIGTERM", world_size: int = 2, written: bool = True) -> Stop:
    """One stop line per rank, agreeing on step, file and exit code (128 + signal), each within the bound of the
    signal; the step is >= every signal's, and the file (unless ``written`` is False: a later run replaced it)
    verifies and holds that step."""
    sent = _SENT.findall(output)
    assert sent and {s[0] for s in sent} == {signal_name}, output[-6000:]
    stops = _STOP.findall(output)
    assert sorted(int(s[0]) for s in stops) == list(range(world_size)), output[-6000:]
    code = str(128 + signal.Signals[signal_name])
    assert {(int(s[2]), s[3], s[5], s[6], s[7]) for s in stops} == {
        (world_size, stops[0][3], stops[0][5], code, signal_name)
    }
    assert all(float(s[4]) < EXIT_BOUND_SECONDS for s in stops), stops
    step, path = int(stops[0][3]), Path(stops[0][5])
    signalled = {int(rank): int(at) for _, _, rank, at in sent}
    assert step >= max(signalled.values())
    if written:
        assert verify(str(path)).global_step == step
    receivers = {int(s[0]) for s in stops if s[1].startswith("received")}
    return Stop(step, path, signalled, receivers, min(float(s[1]) for s in sent))


def assert_preempted(run: Run, finished: float, signal_name: str = "SIGTERM", world_size: int = 2) -> Stop:
    """The run stopped as documented: exit 128 + signal, every process out within the bound, nothing left."""
    assert run.returncode == 128 + signal.Signals[signal_name], run.describe()
    assert not run.timed_out and not run.orphans, run.describe()
    stop = assert_stopped(run.output, signal_name=signal_name, world_size=world_size)
    assert finished - stop.first_signal < EXIT_BOUND_SECONDS, run.describe()
    assert "Traceback" not in run.output and "failed" not in run.output.lower(), run.describe()
    return stop


def preempt_then_resume(
    tmp_path: Path, *opts: str, strategy: str = "safe_ddp", signal_name: str = "SIGTERM", devices: int = 2
) -> tuple[Run, Stop, float]:
    """Train 4 epochs on ``devices`` ranks with the faults and options ``opts``, then resume from ``last`` to the
    end; return the preempted run, its stop and the largest weight difference to the uninterrupted run."""
    train = ("--devices", str(devices)) if devices != 2 else ()
    full, full_steps = uninterrupted_run(tmp_path, train)
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.pt"
    common = ["--max-epochs", "4", "--ckpt-dir", str(ckpt), "--strategy", strategy, *train]
    run = run_scenario("fit_ok", tmp_path, *common, *opts)
    stop = assert_preempted(run, time.time(), signal_name, world_size=devices)
    assert stop.path == ckpt / "last.ckpt"
    again = run_scenario("fit_ok", tmp_path, *common, "--resume", "last", "--save-weights", str(resumed))
    assert again.returncode == 0 and not again.orphans, again.describe()
    assert f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}" in again.output, again.describe()
    assert again.result is not None
    if strategy != "safe_ddp_spawn":  # the spawn launcher's main process gets the weights back, not the step count
        assert again.result["global_step"] == full_steps
    return run, stop, max_abs_diff(full, resumed)


#: who gets SIGTERM at step 5: the FaultInjector options, and the ranks whose stop line says "received"
TARGETS = {
    "all-ranks": (["--fault", "signal:0:5", "--fault", "signal:1:5"], {0, 1}),
    "rank0-only": (["--fault", "signal:0:5"], {0}),
    "rank1-only": (["--fault", "signal:1:5"], {1}),
    # both at step 6: the agreed stop is after step 8, the last batch of epoch 1 (4 batches per epoch on 2 ranks),
    # whose epoch-end validation is due: every rank stops at its first batch (its checkpoint repeats it on resume)
    "on-an-epochs-last-batch": (["--fault", "signal:0:6", "--fault", "signal:1:6"], {0, 1}),
}


@pytest.mark.serial  # every rank out within EXIT_BOUND_SECONDS: run alone (make test)
@pytest.mark.parametrize(
    "target",
    [
        pytest.param("all-ranks", marks=pytest.mark.compat),
        "rank0-only",
        "rank1-only",
        pytest.param("on-an-epochs-last-batch", marks=pytest.mark.compat),
    ],
)
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_that_resumes_bit_exact(tmp_path, target):
    faults, receivers = TARGETS[target]
    # rank0-only: rank 0 also sends itself SIGTERM inside every save from step 5 on, so a second signal arrives
    # while the preemption checkpoint is being written; it changes nothing
    again = ["--signal-on-save", "5"] if target == "rank0-only" else []
    run, stop, diff = preempt_then_resume(tmp_path, *faults, *again)
    assert stop.receivers == receivers
    if target == "on-an-epochs-last-batch":  # Lightning >= 2.5 resumes it with epoch 2: nothing of it is skipped
        assert stop.step == 8
    if again:
        assert f"scenario: rank 0 sends itself SIGTERM during the save at step {stop.step}" in run.output
    assert diff == 0.0


@pytest.mark.serial  # every rank out within EXIT_BOUND_SECONDS: run alone (make test)
def test_sigterm_to_one_of_3_ranks_mid_epoch_resumes_bit_exact(tmp_path):
    # 3 batches per epoch on 3 ranks: rank 2's signal during the batch after step 3 stops every rank in the middle
    # of epoch 1 (after step 5 at the latest: the watches acknowledge at step 4); the resumed run's first step
    # reduces with the saved gradient-bucket layout (a last-bit difference otherwise)
    _, stop, diff = preempt_then_resume(tmp_path, "--fault", "signal:2:3", devices=3)
    assert stop.receivers == {2} and stop.step % 3 != 0
    assert diff == 0.0


@pytest.mark.serial  # every rank out within EXIT_BOUND_SECONDS: run alone (make test)
def test_sigusr1_is_handled_when_listed(tmp_path):
    # SLURM's --signal=USR1@N: listed in preemption_signals, it stops the run like SIGTERM, with exit code 138
    opts = ["--fault", "signal:1:5:SIGUSR1", "--preemption-signals", "SIGTERM,SIGUSR1"]
    _, stop, diff = preempt_then_resume(tmp_path, *opts, signal_name="SIGUSR1")
    assert stop.receivers == {1} and diff == 0.0


@pytest.mark.serial  # every rank out within EXIT_BOUND_SECONDS: run alone (make test)
@pytest.mark.parametrize("target", ["all-ranks", "rank0-only", pytest.param("rank1-only", marks=pytest.mark.compat)])
def test_spawn_launcher_exits_143_and_resumes_bit_exact(tmp_path, target):
    # the spawn launcher's main process is no rank: it exits with the code the ranks stopped with
    faults, receivers = TARGETS[target]
    _, stop, diff = preempt_then_resume(tmp_path, *faults, strategy="safe_ddp_spawn")
    assert stop.receivers == receivers
    assert diff == 0.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", list(TARGETS))
def test_torchrun_restarts_the_preempted_workers_which_resume_bit_exact(tmp_path, target):
    """torchrun --max-restarts=1: SIGTERM in the first attempt; both workers stop at one step and exit 143,
    torchrun restarts them, they resume from last.ckpt (ckpt_path="last") and end with the uninterrupted run's
    weights."""
    faults, receivers = TARGETS[target]
    full, full_steps = uninterrupted_run(tmp_path, ())
    ckpt, resumed, out = tmp_path / "ckpt", tmp_path / "resumed.pt", tmp_path / "torchrun.json"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += [str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(out), "--max-epochs", "4", "--ckpt-dir", str(ckpt)]
    cmd += ["--resume", "last", "--save-weights", str(resumed), *faults]  # the faults fire in the first attempt only
    run = run_script(cmd, timeout=240, out=out)
    assert run.returncode == 0 and not run.orphans, run.describe()
    first_attempt, _ = run.output.split("Restoring states from the checkpoint", 1)
    stop = assert_stopped(first_attempt, written=False)  # the restarted workers have written last.ckpt since
    assert stop.receivers == receivers and stop.path == ckpt / "last.ckpt"
    assert re.search(r"failed \(exitcode: 143\) local_rank: \d", first_attempt), run.describe()  # torchrun's report
    assert f"Restored all states from the checkpoint at {ckpt / 'last.ckpt'}" in run.output, run.describe()
    assert run.result is not None and run.result["global_step"] == full_steps
    assert max_abs_diff(full, resumed) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_during_the_preemption_save_leaves_no_bad_checkpoint(tmp_path):
    """The grace period ran out: SIGTERM to every rank, then SIGKILL to the whole job while a checkpoint file is
    being written after the signal. Every visible checkpoint verifies, and fit(ckpt_path="last") resumes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(free_port())}  # as tests/proc.py's runs get
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
    the broadcast its handler starts (stopped here after 10 s without output); nothing is saved after the signal."""
    ckpt = tmp_path / "ckpt"
    args = [
        str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(tmp_path / "out.json"), "--strategy", "ddp",
        "--max-epochs", "4", "--ckpt-dir", str(ckpt), "--fault", "signal:0:5", "--fault", "signal:1:5",
    ]  # fmt: skip

    def deadlocked(output: str, idle: float) -> bool:
        return output.count("Received SIGTERM") >= 2 and idle >= 10.0

    run = run_script_until(args, timeout=60, stop=deadlocked)
    assert run.stopped and not run.orphans, run.describe()  # still running, silent, 10 s after both signals
    assert "[rank: 0] Received SIGTERM" in run.output and "[rank: 1] Received SIGTERM" in run.output
    steps = [torch.load(p, weights_only=True)["global_step"] for p in ckpt.glob("*.ckpt")]
    assert all(step < 5 for step in steps), steps
