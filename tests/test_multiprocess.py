"""Real multi-process runs on the CPU with gloo: Lightning's launcher re-runs tests/scripts/scenario.py per rank."""

from __future__ import annotations

import math

import pytest

from tests.proc import SCRIPTS, run_scenario, run_script

pytestmark = pytest.mark.multiprocess


def assert_clean_failure(run, *needles: str) -> None:
    assert run.returncode != 0, run.describe()
    assert not run.timed_out, run.describe()
    assert not run.orphans, "processes were left behind\n" + run.describe()
    for needle in needles:
        assert needle in run.output, f"{needle!r} not in output\n" + run.describe()


@pytest.mark.parametrize(("devices", "strategy"), [(2, "safe_ddp_string"), (3, "safe_ddp"), (4, "safe_ddp")])
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


def test_torchrun_rank0_only_barrier_fails_whole_job(tmp_path):
    run = torchrun(tmp_path, "barrier_rank0_only", "--barrier-timeout", "5")
    assert_clean_failure(run, "CollectiveMismatchError", "rank(s) 1 never arrived")


def test_two_fits_and_validate_in_one_process(tmp_path):
    run = run_scenario("two_fits", tmp_path)
    assert run.returncode == 0, run.describe()
    assert run.result is not None and len(run.result["handshake_seconds"]) == 2
    assert run.output.count("train handshake passed") == 2
    assert not run.orphans, run.describe()
    # the default group survives between the fits and is destroyed when each rank's process exits
    assert run.output.count("at exit: default process group initialized=False") == 2, run.describe()


def test_barrier_reached_only_by_rank0_raises_naming_rank1(tmp_path):
    timeout = 5
    run = run_scenario("barrier_rank0_only", tmp_path, "--barrier-timeout", str(timeout), timeout=90)
    assert_clean_failure(
        run,
        "CollectiveMismatchError",
        "barrier 'only_rank0'",
        "rank(s) 1 never arrived",
        "rank 1: training step 2",
    )
    assert f"waited {timeout}." in run.output
    # whole job: start-up (a few seconds) + barrier_timeout + teardown; stock Lightning never returns
    assert run.seconds < timeout + 40, run.describe()


def test_barrier_reached_only_by_rank1_raises_naming_rank0(tmp_path):
    run = run_scenario("barrier_rank1_only", tmp_path, "--barrier-timeout", "5", timeout=90)
    assert_clean_failure(run, "CollectiveMismatchError", "barrier 'only_rank1'", "rank(s) 0 never arrived")


def test_barriers_with_different_names_raise_on_every_rank(tmp_path):
    run = run_scenario("barrier_names_differ", tmp_path, "--barrier-timeout", "30")
    assert_clean_failure(run, "'save' on rank(s) 0; 'load' on rank(s) 1")
    assert run.output.count("Ranks reached different barriers") >= 2  # both ranks raise the same error


def test_weight_changed_on_one_rank_after_wrapping_is_named_before_first_step(tmp_path):
    run = run_scenario("diverge_after_wrap", tmp_path)
    assert_clean_failure(run, "RankDivergenceError", "parameter 'net.3.weight'", "rank(s) 1 from rank 0")
    assert "before the first step" in run.output


def test_buffer_changed_on_one_rank_is_named(tmp_path):
    run = run_scenario("diverge_buffer", tmp_path)
    assert_clean_failure(run, "RankDivergenceError", "buffer 'counter'")


def test_rank_failing_before_handshake_stops_the_others_early(tmp_path):
    run = run_scenario("crash_rank1_before_handshake", tmp_path, "--barrier-timeout", "120")
    assert_clean_failure(run, "injected failure on rank 1", "failed with ValueError: injected failure on rank 1")
    assert run.seconds < 60, "rank 0 waited for the barrier timeout instead of stopping early\n" + run.describe()


@pytest.mark.slow
def test_stock_lightning_hangs_on_rank0_only_barrier(tmp_path):
    """The measured gap: stock DDPStrategy ignores the name and waits for the 30-minute process-group timeout."""
    run = run_scenario("barrier_rank0_only", tmp_path, "--strategy", "ddp", timeout=30)
    assert run.timed_out, "stock Lightning was expected to hang here\n" + run.describe()
