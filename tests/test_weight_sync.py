"""WeightSyncCheck: check logic with simulated ranks, and real multi-process runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from ddp_strategy.callbacks import WeightSyncCheck
from ddp_strategy.errors import RankDivergenceError
from ddp_strategy.fingerprint import fingerprint_tensors
from tests.proc import run_scenario


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)


class FakeControl:
    """Plays the other ranks: rank 1 holds ``other``'s tensors."""

    def __init__(self, other: nn.Module, check: WeightSyncCheck, trainer: Any) -> None:
        self.other, self.check, self.trainer = other, check, trainer
        self.calls: list[str] = []

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        self.calls.append(name)
        tensors = self.check._tensors(self.trainer, self.other)
        if name.startswith("weight-sync:step"):
            return [obj, [fp.digest for fp in fingerprint_tensors(tensors)]]
        by_name = {n: t.detach().clone() for n, _, t in tensors}
        return [obj, {n: by_name[n] for n in obj}]


def make(check: WeightSyncCheck, edit) -> tuple[Any, Module]:
    torch.manual_seed(0)
    mine, other = Module(), Module()
    other.load_state_dict(mine.state_dict())
    edit(other)
    trainer = SimpleNamespace(global_step=10, world_size=2, optimizers=[], lightning_module=mine)
    trainer.strategy = SimpleNamespace(control_plane=FakeControl(other, check, trainer))
    return trainer, mine


def test_equal_replicas_pass():
    check = WeightSyncCheck(every_n_steps=5)
    trainer, mine = make(check, lambda other: None)
    check.check(trainer, mine)
    assert trainer.strategy.control_plane.calls == ["weight-sync:step-10"]  # compared, found nothing


def test_differing_parameter_is_named_with_rank_and_largest_difference():
    check = WeightSyncCheck(every_n_steps=5)

    def edit(other: Module) -> None:
        with torch.no_grad():
            other.lin.weight[0, 1] += 0.25

    trainer, mine = make(check, edit)
    with pytest.raises(RankDivergenceError) as info:
        check.check(trainer, mine)
    assert info.value.tensors == ("lin.weight",) and info.value.ranks == (1,)
    assert "parameter 'lin.weight' (max |difference| 0.25)" in str(info.value)
    assert "by step 10" in str(info.value)


def test_excluded_buffers_are_not_compared_and_warn_mode_warns():
    def edit(other: Module) -> None:
        other.bn.running_mean += 1

    check = WeightSyncCheck(every_n_steps=5, exclude=["bn.running_*"])
    trainer, mine = make(check, edit)
    check.check(trainer, mine)  # excluded: no error, although the comparison ran
    assert trainer.strategy.control_plane.calls == ["weight-sync:step-10"]

    warn = WeightSyncCheck(every_n_steps=5, on_mismatch="warn")
    trainer, mine = make(warn, edit)
    with pytest.warns(UserWarning, match="buffer 'bn.running_mean'"):
        warn.check(trainer, mine)


def test_buffers_that_ddp_broadcasts_at_each_forward_are_not_compared():
    from torch.nn.parallel import DistributedDataParallel

    def edit(other: Module) -> None:
        other.bn.running_mean += 1  # what each rank's own batch does to BatchNorm statistics
        with torch.no_grad():
            other.lin.bias[0] += 0.5

    check = WeightSyncCheck(every_n_steps=5)
    trainer, mine = make(check, edit)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # stands for the strategy's wrapped model
    ddp.broadcast_buffers = True  # (a property with a setter in torch 2.x)
    trainer.strategy.model = ddp
    with pytest.raises(RankDivergenceError) as info:
        check.check(trainer, mine)
    assert info.value.tensors == ("lin.bias",)  # the parameter is named; the re-broadcast buffer is not
    ddp.broadcast_buffers = False  # then DDP leaves buffers alone: a difference stays, and counts
    with pytest.raises(RankDivergenceError) as info:
        check.check(trainer, mine)
    assert set(info.value.tensors) == {"lin.bias", "bn.running_mean"}


@pytest.mark.multiprocess
def test_batchnorm_statistics_are_no_false_alarm(tmp_path):
    # each rank's BatchNorm statistics differ after every step (its own batch); DDP re-broadcasts them
    run = run_scenario("fit_ok", tmp_path, "--batchnorm", "--weight-sync-check", "1", "--max-epochs", "2")
    assert run.returncode == 0 and not run.orphans, run.describe()
    assert "RankDivergenceError" not in run.output and "WeightSyncCheck" not in run.output


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"every_n_steps": 1.5}, {"on_mismatch": "ignore"}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        WeightSyncCheck(**kwargs)


@pytest.mark.multiprocess
def test_weight_changed_on_one_rank_mid_training_is_reported_within_n_steps(tmp_path):
    run = run_scenario("diverge_mid_training", tmp_path, "--weight-sync-check", "2", "--max-epochs", "3")
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    # edited before step 6's batch on rank 1; checked every 2 steps: reported at step 6 on every rank
    for rank in (0, 1):
        assert f"[rank{rank}]: ddp_strategy.errors.RankDivergenceError: Model replicas diverged by step 6" in run.output
    assert "parameter 'net.0.weight' (max |difference| 0.001)" in run.output and "rank(s) 1 from rank 0" in run.output


@pytest.mark.multiprocess
def test_correct_run_reports_nothing(tmp_path):
    run = run_scenario("fit_ok", tmp_path, "--weight-sync-check", "1", "--max-epochs", "2")
    assert run.returncode == 0, run.describe()
    assert "diverged" not in run.output
