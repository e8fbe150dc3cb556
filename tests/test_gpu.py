"""GPU/NCCL tests: the data plane on NCCL, the control plane on gloo. Skipped with a reason without 2 CUDA devices."""

from __future__ import annotations

import pytest

from tests.proc import run_scenario

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def test_fit_on_nccl_passes_handshake(tmp_path):
    run = run_scenario("fit_ok", tmp_path, "--accelerator", "gpu", "--devices", "2")
    assert run.returncode == 0, run.describe()
    assert "distributed_backend=nccl" in run.output
    assert "train handshake passed on 2 rank(s)" in run.output
    assert not run.orphans, run.describe()


def test_rank0_only_barrier_raises_with_nccl_data_plane(tmp_path):
    run = run_scenario("barrier_rank0_only", tmp_path, "--accelerator", "gpu", "--barrier-timeout", "5")
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert "CollectiveMismatchError" in run.output and "rank(s) 1 never arrived" in run.output


def test_two_ranks_on_one_gpu_raise_duplicate_device_error(tmp_path):
    run = run_scenario("duplicate_gpu", tmp_path, "--accelerator", "gpu")
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert "DuplicateDeviceError" in run.output and "same device cuda:0" in run.output
