"""Real multi-process runs on the CPU with gloo: Lightning's launcher re-runs tests/scripts/scenario.py per rank."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
import torch

from tests.proc import SCRIPTS, run_scenario, run_script, stock_fit_finished

pytestmark = pytest.mark.multiprocess


def assert_clean_failure(run, *needles: str) -> None:
    assert run.returncode != 0, run.describe()
    assert not run.timed_out, run.describe()
    assert not run.orphans, "processes were left behind\n" + run.describe()
    for needle in needles:
        assert needle in run.output, f"{needle!r} not in output\n" + run.describe()


@pytest.mark.parametrize(
    ("devices", "strategy"),
    [pytest.param(2, "safe_ddp_string", marks=pytest.mark.compat), (3, "safe_ddp"), (4, "safe_ddp")],
)
def test_fit_passes_handshake(tmp_path, devices, strategy):
    run = run_scenario("fit_ok", tmp_path, "--devices", str(devices), "--strategy", strategy)
    assert run.returncode == 0, run.describe()
    assert not run.orphans, run.describe()
    assert run.result is not None
    assert run.result["strategy"] == "SafeDDPStrategy"
    assert run.result["world_size"] == devices
    per_rank = math.ceil(64 / devices)  # DistributedSampler pads training shards to equal length
    assert run.result["global_step"] == 2 * math.ceil(per_rank / 8)
    assert run.result["control_plane_closed"] is True
    (seconds,) = run.result["handshake_seconds"]
    assert 0 < seconds < 10
    assert f"train handshake passed on {devices} rank(s)" in run.output


def test_spawn_launcher_name_works(tmp_path):
    run = run_scenario("fit_ok", tmp_path, "--strategy", "safe_ddp_spawn")
    assert run.returncode == 0, run.describe()
    assert "train handshake passed on 2 rank(s)" in run.output
    assert not run.orphans, run.describe()


def torchrun(tmp_path, *args: str, timeout: float = 120):
    out = tmp_path / "torchrun.json"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "scenario.py")]
    return run_script([*cmd, *args, "--out", str(out)], timeout=timeout, out=out)


def test_torchrun_launch(tmp_path):
    run = torchrun(tmp_path, "fit_ok")
    assert run.returncode == 0, run.describe()
    assert run.result is not None and run.result["world_size"] == 2
    assert "train handshake passed on 2 rank(s)" in run.output
    assert not run.orphans, run.describe()


def assert_rank1_names_rank0s_barrier(run) -> None:
    """Rank 1, blocked in DDP's all-reduce, names rank 0's error, and torch's store warnings do not flood the output.

    Rank 1 learns of rank 0's failure on its heartbeat thread (before rank 0, which may host the store, exits).
    A waiting barrier polls the store without timed-out waits, each of which printed two ``[c10d] waitForInput``
    lines (about 20 in a 10 s wait; issue 20).
    """
    line = next((x for x in run.output.splitlines() if x.startswith("ddp_strategy: rank 1 stops after")), "")
    assert "The first failure was on another rank: rank 0 failed with CollectiveMismatchError" in line, run.describe()
    source = (SCRIPTS / "scenario.py").read_text().splitlines()
    lineno = next(i for i, x in enumerate(source, 1) if 'barrier("only_rank0")' in x)
    assert f"barrier 'only_rank0' (tests/scripts/scenario.py:{lineno} in training_step)" in line, run.describe()
    assert sum("[c10d]" in x for x in run.output.splitlines()) <= 2, run.describe()


def assert_both_ranks_name_the_barrier(run, barrier: str, inside: int, missing: int) -> None:
    """The desync error on both ranks: the barrier, its call site, the rank that never arrived and where it is."""
    source = (SCRIPTS / "scenario.py").read_text().splitlines()
    lineno = next(i for i, x in enumerate(source, 1) if f'barrier("{barrier}")' in x)
    head = (
        f"CollectiveMismatchError: Rank(s) {inside} wait at barrier '{barrier}' "
        f"(tests/scripts/scenario.py:{lineno} in training_step), but rank(s) {missing} never arrived"
    )
    assert run.output.count(head) >= 2, run.describe()  # each rank printed it
    assert f"rank {missing}: waits in collective #" in run.output, run.describe()
    assert "DDP's gradient all-reduce (backward)" in run.output, run.describe()
    assert sum("[c10d]" in x for x in run.output.splitlines()) <= 2, run.describe()


def test_torchrun_rank0_only_barrier_fails_whole_job(tmp_path):
    run = torchrun(tmp_path, "barrier_rank0_only")  # barrier_timeout 60 s: named by the desync detection first
    assert_clean_failure(run, "CollectiveMismatchError", "rank(s) 1 never arrived")
    assert_both_ranks_name_the_barrier(run, "only_rank0", inside=0, missing=1)


def test_two_fits_and_validate_in_one_process(tmp_path):
    run = run_scenario("two_fits", tmp_path)
    assert run.returncode == 0, run.describe()
    assert run.result is not None and len(run.result["handshake_seconds"]) == 2
    assert run.output.count("train handshake passed") == 2
    assert not run.orphans, run.describe()
    # the default group survives between the fits and is destroyed when each rank's process exits
    assert run.output.count("at exit: default process group initialized=False") == 2, run.describe()


@pytest.mark.compat
@pytest.mark.serial
def test_barrier_reached_only_by_rank0_is_named_within_seconds_whatever_the_barrier_timeout(tmp_path):
    run = run_scenario("barrier_rank0_only", tmp_path, "--barrier-timeout", "600", timeout=90)
    assert_clean_failure(run, "CollectiveMismatchError", "barrier 'only_rank0'", "rank(s) 1 never arrived")
    assert_both_ranks_name_the_barrier(run, "only_rank0", inside=0, missing=1)
    assert "training step 2, epoch 0" in run.output, run.describe()  # where rank 1 was
    # whole job: start-up (a few seconds) + the desync detection (seconds) + teardown; stock Lightning never returns
    assert run.seconds < 40, run.describe()


@pytest.mark.compat
@pytest.mark.serial
def test_barrier_reached_only_by_rank0_raises_naming_rank1_after_the_timeout_without_desync_detection(tmp_path):
    timeout = 5
    run = run_scenario(
        "barrier_rank0_only", tmp_path, "--barrier-timeout", str(timeout), "--no-desync", timeout=90
    )  # fmt: skip
    assert_clean_failure(
        run,
        "CollectiveMismatchError",
        "barrier 'only_rank0'",
        "rank(s) 1 never arrived",
        "rank 1: training step 2",
    )
    assert f"waited {timeout}." in run.output
    assert_rank1_names_rank0s_barrier(run)
    # whole job: start-up (a few seconds) + barrier_timeout + teardown; stock Lightning never returns
    assert run.seconds < timeout + 40, run.describe()


@pytest.mark.serial
def test_barrier_reached_only_by_rank1_raises_naming_rank0(tmp_path):
    run = run_scenario("barrier_rank1_only", tmp_path, "--barrier-timeout", "600", timeout=90)
    assert_clean_failure(run, "CollectiveMismatchError", "barrier 'only_rank1'", "rank(s) 0 never arrived")
    assert_both_ranks_name_the_barrier(run, "only_rank1", inside=1, missing=0)


def test_barriers_with_different_names_raise_on_every_rank(tmp_path):
    run = run_scenario("barrier_names_differ", tmp_path, "--barrier-timeout", "30")
    assert_clean_failure(run, "'save' on rank(s) 0; 'load' on rank(s) 1")
    assert run.output.count("Ranks reached different barriers") >= 2  # both ranks raise the same error


@pytest.mark.compat
def test_weight_changed_on_one_rank_after_wrapping_is_named_before_first_step(tmp_path):
    run = run_scenario("diverge_after_wrap", tmp_path)
    assert_clean_failure(run, "RankDivergenceError", "parameter 'net.3.weight'", "rank(s) 1 from rank 0")
    assert "before the first step" in run.output


def test_buffer_changed_on_one_rank_is_named(tmp_path):
    run = run_scenario("diverge_buffer", tmp_path)
    assert_clean_failure(run, "RankDivergenceError", "buffer 'counter'")


def test_another_torch_version_on_one_rank_raises_the_same_table_on_every_rank(tmp_path):
    """A real 2-process run in which rank 1 reports another torch version (its ``torch.__version__`` is set in the
    model's ``setup`` hook, as if its node had another torch installed): every rank raises SetupMismatchError with
    one table naming the field, each value and the ranks holding it."""
    run = run_scenario("torch_version_differs", tmp_path)
    assert_clean_failure(run, "scenario: rank 1 reports torch 2.0.0")
    for rank in (0, 1):
        table = (
            rf"\[rank{rank}\]: ddp_strategy\.errors\.SetupMismatchError: Ranks disagree on their set-up:\n"
            rf"\[rank{rank}\]:   field +value +ranks\n"
            rf"\[rank{rank}\]:   torch +{re.escape(torch.__version__)} +0\n"
            rf"\[rank{rank}\]: +2\.0\.0 +1\n"
        )
        assert re.search(table, run.output), run.describe()


def test_stock_lightning_does_not_compare_versions(tmp_path):
    """The same run with stock DDPStrategy: nothing compares the ranks' software; the fit completes."""
    run = run_scenario("torch_version_differs", tmp_path, "--strategy", "ddp")
    assert stock_fit_finished(run), run.describe()  # stock's known gloo abort at interpreter exit is no failure here
    assert "scenario: rank 1 reports torch 2.0.0" in run.output  # rank 1 did report the other version
    assert "Ranks disagree" not in run.output and "handshake" not in run.output
    assert run.result is not None and run.result["global_step"] == 8  # 2 epochs of 4 steps: trained to the end


@pytest.mark.serial
def test_rank_failing_before_handshake_stops_the_others_early(tmp_path):
    run = run_scenario("crash_rank1_before_handshake", tmp_path, "--barrier-timeout", "120")
    assert_clean_failure(run, "injected failure on rank 1", "failed with ValueError: injected failure on rank 1")
    assert run.seconds < 60, "rank 0 waited for the barrier timeout instead of stopping early\n" + run.describe()


def main_thread_frames(dump: str) -> list[str]:
    """The frames (innermost first) of the thread running the script's ``<module>`` in a faulthandler dump."""
    for block in dump.split("\n\n"):
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        if frames and frames[-1].endswith("in <module>") and "scenario.py" in frames[-1]:
            return frames
    raise AssertionError(f"no main thread in:\n{dump}")


@pytest.mark.serial
def test_stock_lightning_hangs_on_rank0_only_barrier(tmp_path):
    """The gap, as it shows: with stock DDPStrategy, rank 0 sits inside torch.distributed.barrier while rank 1 has
    trained past the barrier into the step's gradient all-reduce, and nothing names the barrier. Both ranks dump
    their stacks 6 s (rank 1) and 8 s (rank 0) after training starts, then rank 0 ends the job; without that the
    wait lasts until the process-group timeout, 30 minutes by default."""
    from lightning.pytorch.strategies import DDPStrategy

    dumps = tmp_path / "stacks"
    run = run_scenario(
        "barrier_rank0_only", tmp_path, "--strategy", "ddp", "--dump-stacks-after", "6", "--dump-dir", str(dumps),
        timeout=90,
    )  # fmt: skip
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    rank0 = (dumps / "rank0.txt").read_text()
    rank1 = (dumps / "rank1.txt").read_text()
    assert rank0.startswith("Timeout (0:00:08)!") and rank1.startswith("Timeout (0:00:06)!"), (rank0, rank1)
    frames0, frames1 = main_thread_frames(rank0), main_thread_frames(rank1)
    # rank 0: torch.distributed.barrier <- DDPStrategy.barrier <- training_step of the script
    assert "distributed_c10d.py" in frames0[0] and frames0[0].endswith("in barrier"), frames0
    inside = [i for i, f in enumerate(frames0) if "strategies/ddp.py" in f and f.endswith("in barrier")]
    assert inside and "scenario.py" in frames0[inside[0] + 1] and frames0[inside[0] + 1].endswith("in training_step")
    # rank 1: in the backward pass (DDP's gradient all-reduce waits for rank 0), past its training_step
    assert frames1[0].endswith("in _engine_run_backward"), frames1
    assert not [f for f in frames1 if f.endswith("in barrier") or f.endswith("in training_step")], frames1
    assert "only_rank0" not in run.output  # nothing reports which barrier is waiting
    assert "CollectiveMismatchError" not in run.output
    assert DDPStrategy()._timeout == timedelta(minutes=30)  # what the wait is bounded by otherwise
