"""Two torchrun "nodes" on this machine (one process each), with and without a shared checkpoint disk.

A non-shared disk is simulated with a mount namespace: node 1 runs with the checkpoint directory bind-mounted
onto a private directory, so it sees neither node 0's files nor can node 0 see its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ddp_strategy.checkpoint.format import verify
from tests.proc import Run, torchrun_two_nodes

pytestmark = pytest.mark.multiprocess


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -m` (root) to simulate private disks")


def two_nodes(
    tmp_path: Path, *args: str, private: Path | None = None, shared: Path | None = None, nproc: int = 1
) -> list[Run]:
    """Run scenario.py as 2 nodes x ``nproc`` processes under torchrun; node 1 sees ``private`` at ``shared``."""
    prefix = None
    if private is not None and shared is not None:
        prefix = ["unshare", "-m", "sh", "-c", f'mount --bind "{private}" "{shared}" && exec "$@"', "sh"]
    return torchrun_two_nodes(tmp_path, *args, nproc=nproc, node1_prefix=prefix)


def ok(runs: list[Run]) -> None:
    for run in runs:
        assert run.returncode == 0 and not run.orphans and not run.timed_out, run.describe()


def max_abs_diff(a: Path, b: Path) -> float:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def test_two_nodes_train_with_global_and_local_ranks(tmp_path):
    runs = two_nodes(tmp_path)
    ok(runs)
    assert runs[0].result is not None and runs[0].result["world_size"] == 2
    assert "train handshake passed on 2 rank(s)" in runs[0].output


@needs_namespaces
def test_resume_when_only_node0_has_the_checkpoint(tmp_path):
    """save_on="global_zero" on a disk node 1 cannot see: node 1 resolves no "last" checkpoint by itself, gets rank
    0's path, receives the file from rank 0, and the resumed run matches the uninterrupted one bit for bit."""
    shared, private = tmp_path / "ckpt", tmp_path / "node1-disk"
    shared.mkdir()
    private.mkdir()
    full, resumed = tmp_path / "full.pt", tmp_path / "resumed.pt"
    ok(two_nodes(tmp_path, "--max-epochs", "4", "--save-weights", str(full)))
    ok(two_nodes(tmp_path, "--max-epochs", "2", "--ckpt-dir", str(shared), private=private, shared=shared))
    assert (shared / "last.ckpt").exists() and not any(private.iterdir())  # only node 0 has it
    runs = two_nodes(
        tmp_path, "--max-epochs", "4", "--ckpt-dir", str(shared), "--resume", "last", "--save-weights", str(resumed),
        private=private, shared=shared,
    )  # fmt: skip
    ok(runs)
    assert "resolved the checkpoint to resume as None; using rank 0's" in runs[1].output
    assert "cannot read" in runs[0].output and "rank 0 sends it to them" in runs[0].output
    assert max_abs_diff(full, resumed) == 0.0


@needs_namespaces
def test_node_zero_writers_keep_a_copy_per_node_and_resume_locally(tmp_path):
    shared, private = tmp_path / "ckpt", tmp_path / "node1-disk"
    shared.mkdir()
    private.mkdir()
    common = ["--ckpt-dir", str(shared), "--save-on", "node_zero"]
    ok(two_nodes(tmp_path, "--max-epochs", "2", *common, private=private, shared=shared))
    for disk in (shared, private):  # each node wrote its own complete copy
        record = verify(str(disk / "last.ckpt"))
        assert record is not None and record.global_step == 8 and record.world_size == 2
    runs = two_nodes(tmp_path, "--max-epochs", "3", *common, "--resume", "last", private=private, shared=shared)
    ok(runs)
    assert "cannot read" not in runs[0].output  # every node read its own copy
    assert runs[0].result is not None and runs[0].result["global_step"] == 12


@needs_namespaces
@pytest.mark.timeout(600)
def test_two_nodes_of_two_processes_with_private_disks_resume_on_both(tmp_path):
    """2 nodes x 2 processes (world size 4): global vs local ranks, one writer per node (local rank 0) with a
    checkpoint directory per node, and a resume in which every node reads its own copy."""
    shared, private = tmp_path / "ckpt", tmp_path / "node1-disk"
    shared.mkdir()
    private.mkdir()
    common = ["--ckpt-dir", str(shared), "--save-on", "node_zero"]
    first, second = tmp_path / "ranks1", tmp_path / "ranks2"
    ok(two_nodes(tmp_path, "--max-epochs", "1", *common, "--rank-report", str(first), private=private, shared=shared,
                 nproc=2))  # fmt: skip
    facts = [json.loads((first / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(f["global_rank"], f["local_rank"], f["node_rank"], f["world_size"]) for f in facts] == [
        (0, 0, 0, 4), (1, 1, 0, 4), (2, 0, 1, 4), (3, 1, 1, 4),
    ]  # fmt: skip
    assert [f["env"]["GROUP_RANK"] for f in facts] == ["0", "0", "1", "1"]  # torchrun's node rank
    assert [f["is_writer"] for f in facts] == [True, False, True, False]
    for disk in (shared, private):  # each node's writer put a complete copy on its own disk
        record = verify(str(disk / "last.ckpt"))
        assert record is not None and record.global_step == 2 and record.world_size == 4
    runs = two_nodes(tmp_path, "--max-epochs", "2", *common, "--resume", "last", "--rank-report", str(second),
                     private=private, shared=shared, nproc=2)  # fmt: skip
    ok(runs)
    assert "cannot read" not in runs[0].output  # every node read its own copy
    assert "Restored all states from the checkpoint" in runs[0].output, runs[0].describe()
    assert [json.loads((second / f"rank{r}.json").read_text())["global_step"] for r in range(4)] == [4, 4, 4, 4]
    for disk in (shared, private):
        assert verify(str(disk / "last.ckpt")).global_step == 4  # type: ignore[union-attr]
