"""Faults across real processes: dead ranks, an elastic torchrun restart, bad ckpt_path values, a read-only disk.

Faults are injected with ``ddp_strategy.testing`` (the ``--fault`` flag of tests/scripts/scenario.py adds a
``FaultInjector``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from ddp_strategy.checkpoint.format import verify
from ddp_strategy.testing import corrupt_checkpoint, file_digests, truncate_checkpoint, write_garbage
from tests.proc import SCRIPTS, Run, run_scenario, run_script

pytestmark = pytest.mark.multiprocess


def torchrun(tmp_path: Path, name: str, *args: str, restarts: int = 0, timeout: float = 150) -> Run:
    out = tmp_path / f"{name}.json"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts)]
    cmd += [str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(out), *args]
    return run_script(cmd, timeout=timeout, out=out)


def max_abs_diff(a: Path, b: Path) -> float:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys()
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


# ---------------------------------------------------------------------- a rank dies mid-training
@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("fault", ["kill:1:3", "raise:1:3"], ids=["sigkill", "exception"])
def test_dead_rank_stops_every_rank_naming_it(tmp_path, launcher, fault):
    """Rank 1 is SIGKILLed (or raises) at step 3: the job ends non-zero well within the barrier timeout (60 s),
    nothing is left running, and the output names rank 1 as the cause."""
    args = ["--max-epochs", "3", "--fault", fault, "--barrier-timeout", "60"]
    run = torchrun(tmp_path, "dead", *args) if launcher == "torchrun" else run_scenario("fit_ok", tmp_path, *args)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert (
        f"FaultInjector: {'sending SIGKILL' if 'kill' in fault else 'raising InjectedFault'} on rank 1 at step 3"
        in (run.output)
    ), run.describe()
    out = run.output
    ours_failed = "The first failure was on another rank: rank 1 failed with InjectedFault" in out
    ours_gone = "Rank(s) 1 stopped sending heartbeats" in out
    lightning_observer = "[rank: 1] Child process with PID" in out and "terminated with code -9" in out
    torchrun_report = "rank      : 1 (local_rank: 1)" in out and ("exitcode  : -9" in out or "exitcode  : 1 " in out)
    if "raise" in fault:
        assert ours_failed, run.describe()  # rank 0's own error names rank 1, not only gloo's peer address
    elif launcher == "lightning":
        # whichever comes first: our diagnosis (rank 0's collective failed) or Lightning's observer (polls every 5 s)
        assert ours_gone or lightning_observer, run.describe()
    else:  # torchrun SIGTERMs rank 0 as soon as it sees rank 1 gone; rank 0 still reports why it stops
        assert "ddp_strategy: rank 0 stops after RuntimeError: " in out, run.describe()
    if launcher == "torchrun":
        assert torchrun_report, run.describe()
    assert run.seconds < 120, run.describe()


# ---------------------------------------------------------------------- elastic restart
@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_from_newest_checkpoint_bit_exact(tmp_path):
    """torchrun --max-restarts=1: rank 1 is SIGKILLed at step 6 in the first attempt; the restarted workers run the
    same script (ckpt_path="last" resolves to the newest checkpoint, step 6) and end with the weights of an
    uninterrupted run."""
    common = ["--max-epochs", "3", "--every-n-train-steps", "2", "--resume", "last"]
    full_w, crash_w = tmp_path / "full.pt", tmp_path / "crash.pt"
    runs: dict[str, Run] = {}

    def reference() -> None:
        runs["full"] = torchrun(tmp_path, "full", *common, "--ckpt-dir", str(tmp_path / "c_full"), "--save-weights",
                                str(full_w), timeout=240)  # fmt: skip

    thread = threading.Thread(target=reference)
    thread.start()
    crash = torchrun(
        tmp_path, "crash", *common, "--ckpt-dir", str(tmp_path / "c_crash"), "--save-weights", str(crash_w),
        "--fault", "kill:1:6", restarts=1, timeout=240,
    )  # fmt: skip
    thread.join()
    full = runs["full"]
    for run in (full, crash):
        assert run.returncode == 0 and not run.orphans and not run.timed_out, run.describe()
    out = crash.output
    assert "FaultInjector: sending SIGKILL on rank 1 at step 6" in out, crash.describe()
    assert 'fit(ckpt_path="last") is set, but there is no last checkpoint available' in out  # first attempt
    assert f"Restored all states from the checkpoint at {tmp_path / 'c_crash' / 'last.ckpt'}" in out
    assert out.count("FaultInjector:") == 1  # the restarted attempt did not fire again
    assert full.result is not None and crash.result is not None
    assert crash.result["global_step"] == full.result["global_step"] == 12
    assert max_abs_diff(full_w, crash_w) == 0.0


# ---------------------------------------------------------------------- bad ckpt_path values
@pytest.mark.timeout(240)
def test_bad_checkpoint_paths_fail_clearly_on_every_rank_and_damage_nothing(tmp_path):
    first = run_scenario("fit_ok", tmp_path, "--max-epochs", "1", "--ckpt-dir", str(tmp_path / "ckpt"))
    assert first.returncode == 0, first.describe()
    good = tmp_path / "ckpt" / "last.ckpt"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a-directory.ckpt").mkdir()
    write_garbage(bad / "garbage.ckpt", size=10_000)
    for name in ("truncated.ckpt", "corrupted.ckpt"):
        shutil.copy(good, bad / name)
    truncate_checkpoint(bad / "truncated.ckpt", keep_fraction=0.5)
    corrupt_checkpoint(bad / "corrupted.ckpt")
    state = torch.load(good, weights_only=True)["state_dict"]
    torch.save(state, bad / "plain.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, bad / "ddp.pt")
    before = {**file_digests(bad), **{f"ckpt/{k}": v for k, v in file_digests(tmp_path / "ckpt").items()}}
    cases = {
        "missing": str(bad / "nope.ckpt"),
        "directory": str(bad / "a-directory.ckpt"),
        "garbage": str(bad / "garbage.ckpt"),
        "truncated": str(bad / "truncated.ckpt"),
        "corrupted": str(bad / "corrupted.ckpt"),
        "plain": str(bad / "plain.pt"),
        "ddp": str(bad / "ddp.pt"),
        "other_model": f"{good}@other",
    }
    out = tmp_path / "results"
    run = run_script(
        [str(SCRIPTS / "bad_inputs.py"), "--out", str(out), *(f"{k}={v}" for k, v in cases.items())], timeout=200
    )
    assert run.returncode == 0 and not run.orphans and not run.timed_out, run.describe()
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0].keys() == results[1].keys() == cases.keys()
    expected = {
        "missing": ("FileNotFoundError", ["nope.ckpt", "does not exist", "ckpt_path='last'"]),
        "directory": ("CheckpointIntegrityError", ["a-directory.ckpt", "directory"]),
        "garbage": ("CheckpointIntegrityError", ["garbage.ckpt"]),
        "truncated": ("CheckpointIntegrityError", ["truncated.ckpt"]),
        "corrupted": ("CheckpointIntegrityError", ["corrupted.ckpt"]),
        "plain": ("CheckpointMismatchError", ["plain.pt' is a plain state_dict", "load_into", "ddp-ckpt inspect"]),
        "ddp": ("CheckpointMismatchError", ["ddp.pt' is a DDP-saved state_dict", "'module.'", "load_into"]),
        "other_model": (
            "CheckpointMismatchError",
            [
                "does not match OtherModel",
                "missing from it: 'encoder.0.bias'",
                "unexpected: 'net.0.bias'",
                "strict_loading = False",
            ],
        ),
    }
    for case, (kind, needles) in expected.items():
        for rank in (0, 1):
            got = results[rank][case]
            assert got["type"] == kind, (case, rank, got)
            for needle in needles:
                assert needle in got["message"], (case, rank, needle, got["message"])
        assert results[0][case]["message"] == results[1][case]["message"] or case == "other_model", case
    after = {**file_digests(bad), **{f"ckpt/{k}": v for k, v in file_digests(tmp_path / "ckpt").items()}}
    assert after == before  # nothing on disk was changed, and nothing was written next to the inputs


# ---------------------------------------------------------------------- read-only checkpoint directory
def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -m` (root) for a read-only bind mount")
def test_read_only_checkpoint_directory_fails_on_every_rank_and_keeps_checkpoints(tmp_path):
    """Resume from a directory that has become read-only (a read-only bind mount: root ignores chmod): the resume
    reads fine, the first save raises CheckpointWriteError on every rank, and the old files are unchanged."""
    ckpt = tmp_path / "ckpt"
    first = run_scenario("fit_ok", tmp_path, "--max-epochs", "1", "--ckpt-dir", str(ckpt))
    assert first.returncode == 0, first.describe()
    before = file_digests(ckpt)
    out = tmp_path / "ro.json"
    readonly = f'mount --bind "{ckpt}" "{ckpt}" && mount -o remount,ro,bind "{ckpt}" && exec "$@"'
    run = run_script(
        [str(SCRIPTS / "scenario.py"), "fit_ok", "--out", str(out), "--max-epochs", "2", "--ckpt-dir", str(ckpt),
         "--resume", "last"],
        timeout=200, prefix=["unshare", "-m", "sh", "-c", readonly, "sh"],
    )  # fmt: skip
    assert run.returncode != 0 and not run.orphans and not run.timed_out, run.describe()
    assert "Restored all states from the checkpoint" in run.output, run.describe()
    assert "[rank0]: ddp_strategy.errors.CheckpointWriteError: Saving checkpoint" in run.output, run.describe()
    assert "Read-only file system" in run.output
    assert "[rank1]: ddp_strategy.errors.CheckpointWriteError: Rank 0 failed to write checkpoint" in run.output
    assert file_digests(ckpt) == before
    assert verify(str(ckpt / "last.ckpt")).global_step == 4  # type: ignore[union-attr]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_failure_every_rank_hits_by_itself_is_reported_as_such():
    """Every rank's training_step raises the same ValueError at step 2 (a data guard every batch fails). Stock: each
    rank prints its own traceback and nothing relates them. SafeDDPStrategy: no rank says "the first failure was on
    another rank"; a rank whose diagnosis finds the other failed says every rank failed with this same error by
    itself (issue 29, point 3). Whether a rank finds the other's failure published is timing: when neither does,
    no diagnosis is printed (the message itself: tests/test_peers.py)."""
    runs = {
        s: run_script([str(SCRIPTS / "same_failure.py"), "--strategy", s], timeout=150) for s in ("ddp", "safe_ddp")
    }
    for strategy, run in runs.items():
        assert run.returncode == 1 and not run.timed_out and not run.orphans, (strategy, run.describe())
        for rank in (0, 1):
            assert f"[rank{rank}]: ValueError: labels out of range in this batch" in run.output, (strategy, rank)
    assert "failed with this same error" not in runs["ddp"].output
    safe = runs["safe_ddp"].output
    assert "first failure was on another rank" not in safe
    said = re.findall(
        r"^ddp_strategy: rank (\d) stops after ValueError: labels out of range in this batch\. (.*)$", safe, re.M
    )
    for _, text in said:
        assert text == (
            "Every rank failed with this same error (this rank at step 2): each rank hit it by itself, so it is no "
            "consequence of another rank's failure; the cause is in this error."
        )
