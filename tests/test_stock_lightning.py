"""What stock Lightning (``DDPStrategy``, Lightning 2.6.6) does in the situations of README's table, each run bounded
and checked for its specific symptom, next to the test of what ``SafeDDPStrategy`` does instead.

Other stock cells are shown next to their ``SafeDDPStrategy`` test: the rank-0-only barrier and the version mismatch
(tests/test_multiprocess.py), resume and a truncated ``last.ckpt`` (tests/test_checkpoint_multiprocess.py), padded
evaluation (tests/test_exact_eval.py), two ranks on one GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ddp_strategy.checkpoint.io import SafeCheckpointIO
from tests.proc import SCRIPTS, Run, run_scenario, run_script, stock_fit_finished


def rank_lines(run: Run, rank: int) -> list[str]:
    """The lines a rank's uncaught error printed (torch prefixes them with ``[rank<r>]: ``)."""
    prefix = f"[rank{rank}]: "
    return [line.removeprefix(prefix) for line in run.output.splitlines() if line.startswith(prefix)]


def replica_differences(directory: Path) -> dict[str, float]:
    """Largest absolute difference per tensor between rank 0's and rank 1's final weights."""
    a, b = (torch.load(directory / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}


@pytest.mark.multiprocess
def test_stock_rank_crash_reaches_the_others_as_a_peer_address(tmp_path):
    """Rank 1 raises in on_train_start. Stock: rank 0 fails in its next collective with gloo's "Connection closed by
    peer" and an address, or, when Lightning's process observer (in rank 0, the launching process) sees rank 1's exit
    first, is killed by it (SIGKILL), before or while it prints gloo's error; either way nothing on rank 0 names rank 1
    or its error. (SafeDDPStrategy: rank 0 quotes rank 1's error,
    tests/test_multiprocess.py::test_rank_failing_before_handshake_stops_the_others_early.)"""
    run = run_scenario("crash_rank1_before_handshake", tmp_path, "--strategy", "ddp", timeout=90)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert "ValueError: injected failure on rank 1" in rank_lines(run, 1), run.describe()
    rank0 = "\n".join(rank_lines(run, 0))
    if run.returncode == -9:
        # The observer killed rank 0 (seen twice in CI, 2026-11-29): before gloo's error reached it (rank 0 printed
        # nothing), or while rank 0 was printing that error (its traceback, possibly cut short, is on record).
        assert "terminated with code 1. Forcefully terminating all other processes" in run.output, run.describe()
        assert rank0 == "" or rank0.startswith("Traceback (most recent call last):"), run.describe()
    else:
        assert "RuntimeError: " in rank0 and "Connection closed by peer [127.0.0.1]:" in rank0, run.describe()
    assert "injected failure" not in rank0 and "rank 1" not in rank0, run.describe()


@pytest.mark.multiprocess
def test_stock_weight_changed_on_one_rank_after_wrapping_trains_on_with_different_replicas(tmp_path):
    """Rank 1 adds 0.5 to one weight in on_train_start. Stock: the fit completes without a word, and at its end the
    ranks still hold different weights (DDP averages gradients, so each replica keeps its offset). (SafeDDPStrategy:
    tests/test_multiprocess.py::test_weight_changed_on_one_rank_after_wrapping_is_named_before_first_step.)"""
    weights = tmp_path / "weights"
    run = run_scenario("diverge_after_wrap", tmp_path, "--strategy", "ddp", "--save-rank-weights", str(weights))
    assert stock_fit_finished(run), run.describe()
    assert "Error" not in run.output and "differ" not in run.output
    assert run.result is not None and run.result["global_step"] == 8  # trained to the end
    differences = replica_differences(weights)
    assert differences["net.3.weight"] == pytest.approx(0.5, rel=1e-3)
    assert [k for k, v in differences.items() if v > 0] == ["net.3.weight"]


@pytest.mark.multiprocess
def test_stock_disk_full_during_a_save_fails_on_rank0_only(tmp_path):
    """A file size limit hits rank 0's checkpoint write. Stock: only rank 0 sees the OSError; rank 1 fails later in
    a collective with gloo's "Connection closed by peer". (SafeDDPStrategy: the same CheckpointWriteError on every
    rank, tests/test_checkpoint_multiprocess.py::
    test_failed_write_raises_on_every_rank_and_keeps_previous_checkpoint.)"""
    run = run_scenario("fail_write", tmp_path, "--strategy", "ddp", "--max-epochs", "3", "--ckpt-dir", str(tmp_path))
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert "OSError: [Errno 27] File too large" in rank_lines(run, 0), run.describe()
    rank1 = "\n".join(rank_lines(run, 1))
    assert "File too large" not in rank1 and "Connection closed by peer" in rank1, run.describe()


def test_stock_atomic_save_copies_into_the_final_path_when_tmpdir_is_on_another_filesystem(tmp_path, monkeypatch):
    """Stock TorchCheckpointIO saves through an fsspec transaction: a temporary file in $TMPDIR, then shutil.move. With
    $TMPDIR on another filesystem the move is a copy into the final path, so a crash during that copy leaves a
    truncated checkpoint under the final name (simulated here by a copy that stops halfway). SafeCheckpointIO's
    temporary file is in the checkpoint's own directory and is renamed over the target: no copy at all."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    monkeypatch.setattr(tempfile, "tempdir", str(shm))  # as TMPDIR=/dev/shm
    copies: list[tuple[str, str]] = []

    def copy_that_stops_halfway(src: str, dst: str, *args: object, **kwargs: object) -> str:
        copies.append((str(src), str(dst)))
        data = Path(src).read_bytes()
        Path(dst).write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt("the job was killed during the copy")

    monkeypatch.setattr(shutil, "copyfile", copy_that_stops_halfway)  # shutil.move -> copy2 -> copyfile
    final = tmp_path / "last.ckpt"
    checkpoint = {"state_dict": {"w": torch.arange(100_000, dtype=torch.float32)}}
    with pytest.raises(KeyboardInterrupt):
        TorchCheckpointIO().save_checkpoint(checkpoint, final)
    assert len(copies) == 1 and Path(copies[0][0]).parent == shm and copies[0][1] == str(final)
    with pytest.raises(RuntimeError, match="PytorchStreamReader failed"):
        torch.load(final, weights_only=True)  # what a resume from this last.ckpt meets

    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(src: str, dst: str, *args: object, **kwargs: object) -> None:
        replaced.append((str(src), str(dst)))
        real_replace(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", recording_replace)
    ours = tmp_path / "safe.ckpt"
    SafeCheckpointIO().save_checkpoint(checkpoint, ours)
    assert len(copies) == 1  # no copy
    assert [dst for _, dst in replaced] == [str(ours)] and Path(replaced[0][0]).parent == tmp_path
    assert torch.equal(torch.load(ours, weights_only=True)["state_dict"]["w"], checkpoint["state_dict"]["w"])


@pytest.mark.multiprocess
def test_stock_per_step_sync_with_uneven_shards_runs_on_padded_duplicates(tmp_path):
    """3 validation samples, batch size 1, 2 ranks, a value logged with on_step=True, sync_dist=True. Stock: it runs
    (the padded sampler gives both ranks 2 steps) and counts 4 samples. (SafeDDPStrategy: UnevenEvaluationError,
    tests/test_exact_eval.py::test_per_step_sync_with_uneven_steps_raises_a_named_error.)"""
    out = tmp_path / "stock.json"
    args = ["--devices", "2", "--sizes", "3", "--batch-sizes", "1", "--stages", "validate", "--step-sync"]
    run = run_script(
        [str(SCRIPTS / "exact_eval.py"), *args, "--strategy", "ddp", "--out", str(out)], timeout=120, out=out
    )
    assert stock_fit_finished(run) and run.result is not None, run.describe()
    assert "UnevenEvaluationError" not in run.output
    (results,) = run.result["validate"]
    assert results["samples"] == 4.0  # sample 0 counted twice


@pytest.mark.multiprocess
def test_stock_without_distributed_sampler_every_rank_trains_on_the_same_batches_silently(tmp_path):
    """Trainer(use_distributed_sampler=False) with a shuffling DataLoader. Stock: both ranks receive identical
    batches for a whole epoch and nothing says so. (SafeDDPStrategy adds ShardingCheck:
    tests/test_sharding_check.py::test_no_distributed_sampler_warns_in_warn_mode.)"""
    log = tmp_path / "batches"
    args = ["--strategy", "ddp", "--no-distributed-sampler", "--max-epochs", "1", "--batch-log", str(log)]
    run = run_scenario("fit_ok", tmp_path, *args)
    assert stock_fit_finished(run), run.describe()
    batches = [json.loads((log / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(batches[0]) == 8 and batches[0] == batches[1]  # all 64 samples on each rank, in the same order
    assert "ShardingCheck" not in run.output and "identical" not in run.output


@pytest.mark.multiprocess
def test_stock_differently_named_barriers_pair_silently(tmp_path):
    """Rank 0 calls barrier("save") while rank 1 calls barrier("load") at the same step. Stock: the two unrelated
    barriers pair up and the fit goes on to its end. (SafeDDPStrategy: CollectiveMismatchError on every rank,
    tests/test_multiprocess.py::test_barriers_with_different_names_raise_on_every_rank.)"""
    run = run_scenario("barrier_names_differ", tmp_path, "--strategy", "ddp")
    assert stock_fit_finished(run), run.describe()
    assert run.result is not None and run.result["global_step"] == 8  # 2 epochs of 4 steps
    assert "'save'" not in run.output and "'load'" not in run.output


def test_lightning_rejects_a_hand_written_duplicate_device_list_itself():
    """devices=[0, 0] never reaches a strategy: Lightning's device parser refuses it (so the real ways two ranks
    share a GPU are launcher and environment mistakes, tested in tests/test_gpu.py)."""
    from lightning.fabric.utilities.device_parser import _parse_gpu_ids
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"Device ID's \(GPU\) must be unique"):
        _parse_gpu_ids([0, 0], include_cuda=True)
