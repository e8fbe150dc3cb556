"""The default weight agreement: ranks whose weights differ are named at the next epoch end or save, and a checkpoint
of diverged ranks is never written (unit tests with simulated ranks, then real 2-process runs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.callbacks import WeightSyncCheck
from ddp_strategy.checkpoint import protocol
from ddp_strategy.checkpoint.format import verify
from ddp_strategy.consistency import LIKELY_CAUSES, Comparison, Divergence, WeightAgreement, compare
from ddp_strategy.control import ControlPlane
from ddp_strategy.errors import RankDivergenceError
from tests.proc import run_scenario, stock_fit_finished
from tests.test_control import run_agreeing


# ---------------------------------------------------------------------------------------------- which tensors
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.sync = nn.SyncBatchNorm(2)
        self.register_buffer("counter", torch.zeros(1))
        self.register_buffer("rank_local", torch.zeros(1))


def ddp_stand_in(broadcast_buffers: bool, ignore: tuple[str, ...] = ()) -> DistributedDataParallel:
    """A DistributedDataParallel object with only the options the selection reads (no process group needed)."""
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    ddp.broadcast_buffers = broadcast_buffers
    ddp.parameters_to_ignore = set(ignore)
    return ddp


def names(agreement: WeightAgreement, model: object, module: nn.Module) -> list[str]:
    return [name for name, _, _ in agreement.tensors(model, module=module)]


def test_the_default_check_compares_parameters_and_the_buffers_ddp_does_not_rebroadcast():
    net = Net()
    strategy_default = WeightAgreement(norm_statistics=False)  # what SafeDDPStrategy uses
    params = ["lin.weight", "lin.bias", "bn.weight", "bn.bias", "sync.weight", "sync.bias"]
    # broadcast_buffers=True (DDP's default): rank 0's buffers overwrite the others at every forward
    assert names(strategy_default, ddp_stand_in(True), net) == params
    # broadcast_buffers=False: buffers must agree, except a per-rank BatchNorm's statistics (SyncBatchNorm's agree)
    assert names(strategy_default, ddp_stand_in(False), net) == [
        *params,
        "counter",
        "rank_local",
        "sync.running_mean",
        "sync.running_var",
        "sync.num_batches_tracked",
    ]
    # tensors DDP itself ignores are rank-local by design; user exclusions apply last
    ignoring = ddp_stand_in(False, ignore=("rank_local",))
    assert "rank_local" not in names(strategy_default, ignoring, net)
    assert "counter" not in names(WeightAgreement(norm_statistics=False, exclude=["count*"]), ignoring, net)
    # WeightSyncCheck keeps comparing BatchNorm statistics when asked to compare buffers (its documented behaviour)
    assert "bn.running_mean" in names(WeightAgreement(), ddp_stand_in(False), net)


def test_compare_names_the_differing_tensors_and_ranks():
    same = [(1, 4), (2, 4), None]
    assert compare([same, list(same), list(same)]) is None
    assert compare([same, [(1, 4), (9, 4), None], list(same)]) == Divergence(indices=(1,), ranks=(1,))
    assert compare([same, same[:2]]) == Divergence(indices=(), ranks=(1,), counts=(3, 2))


# ---------------------------------------------------------------------------------------------- saves (simulated)
def _save_with_weights(plane: ControlPlane, written: list[Any], *, edit_rank: int | None, writers=(0,)) -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    if plane.rank == edit_rank:
        weight[1, 2] += 0.25  # a rank-local edit
    weights = Comparison([("head.weight", "parameter", weight)], when="by step 3", name="checkpoint-weights:x.ckpt")
    protocol.save(
        control=plane,
        write=written.append,
        checkpoint={"global_step": 3},
        path="/ckpt/epoch=0-step=3.ckpt",
        is_writer=plane.rank in writers,
        every_writer_needs_states=len(writers) > 1,
        weights=weights,
    )


def test_agreeing_weights_cost_a_save_no_extra_collective(monkeypatch):
    written: list[Any] = []
    outcome, _, objects, barriers = run_agreeing(
        2, monkeypatch, lambda p: _save_with_weights(p, written, edit_rank=None)
    )
    assert outcome == {0: None, 1: None}
    assert len(written) == 1 and len(written[0]["ddp_strategy"]["rng_states"]) == 2
    assert objects.calls == [2, 2] and barriers == [2, 2]  # the RNG gather (now carrying fingerprints) and the outcome


@pytest.mark.parametrize("writers", [(0,), (0, 2)], ids=["global_zero", "node_zero"])
def test_diverged_weights_are_named_on_every_rank_and_nothing_is_written(monkeypatch, writers):
    written: list[Any] = []
    ranks = 3

    def fn(plane: ControlPlane) -> None:
        _save_with_weights(plane, written, edit_rank=1, writers=writers)

    outcome, _, objects, _ = run_agreeing(ranks, monkeypatch, fn)
    assert written == []  # no writer wrote
    for rank in range(ranks):
        err = outcome[rank]
        assert isinstance(err, RankDivergenceError), (rank, err)
        assert err.tensors == ("head.weight",) and err.ranks == (1,)
        text = str(err)
        assert text.startswith(
            "Model replicas diverged by step 3: parameter 'head.weight' (max |difference| 0.25) differ on rank(s) 1 "
            "from rank 0. Checkpoint '/ckpt/epoch=0-step=3.ckpt' was not written; the checkpoints already on disk "
            "are unchanged."
        )
        assert text.endswith(LIKELY_CAUSES)
    assert objects.calls == [3] * ranks  # the slow path (the differing tensor's values) runs only on a mismatch


# ---------------------------------------------------------------------------------------------- options
def test_strategy_weight_check_settings():
    assert SafeDDPStrategy().weight_check == "epoch"
    epoch = SafeDDPStrategy()._weights.check
    assert epoch is not None and epoch.at_epoch_end and epoch.every_n_steps is None
    assert not epoch.agreement.norm_statistics  # per-rank BatchNorm statistics are no false alarm
    every = SafeDDPStrategy(weight_check=50, weight_check_exclude=["*.rank_local"])._weights.check
    assert every is not None and every.every_n_steps == 50 and every.at_epoch_end and every.exclude == ("*.rank_local",)
    saves = SafeDDPStrategy(weight_check="save")._weights.check
    assert saves is not None and not saves.at_epoch_end and saves.every_n_steps is None
    assert SafeDDPStrategy(weight_check=None)._weights.check is None
    for bad in ("always", 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="`weight_check` must be one of"):
            SafeDDPStrategy(weight_check=bad)  # type: ignore[arg-type]


class CountingControl:
    def __init__(self) -> None:
        self.names: list[str] = []

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        self.names.append(name)
        return [obj, obj]


def test_epoch_end_check_runs_once_per_step_and_not_after_a_save_at_that_step():
    control = CountingControl()
    trainer = SimpleNamespace(
        global_step=8, current_epoch=1, world_size=2, optimizers=[], strategy=SimpleNamespace(control_plane=control)
    )
    module = nn.Linear(2, 2)
    check = WeightSyncCheck(None, at_epoch_end=True)
    check.on_train_batch_end(trainer, module, None, None, 0)  # every_n_steps=None: nothing during the epoch
    assert control.names == []
    check.on_train_epoch_end(trainer, module)
    assert control.names == ["weight-sync:step-8"] and check.agreement.last_step == 8
    trainer.global_step = 12
    check.agreement.last_step = 12  # the strategy's check before a save at step 12 found the ranks equal
    check.on_train_epoch_end(trainer, module)
    assert control.names == ["weight-sync:step-8"]
    check.reset()  # a new fit (the strategy resets its check in setup): step 12 is a new step
    check.on_train_epoch_end(trainer, module)
    assert control.names == ["weight-sync:step-8", "weight-sync:step-12"]


# ---------------------------------------------------------------------------------------------- real processes
def assert_named_on_every_rank(output: str, step: int, moment: str = "") -> None:
    for rank in (0, 1):
        error = f"[rank{rank}]: ddp_strategy.errors.RankDivergenceError"
        assert f"{error}: Model replicas diverged by step {step}{moment}" in output, output[-6000:]
    assert "parameter 'net.0.weight' (max |difference| 0.001) differ on rank(s) 1 from rank 0." in output


@pytest.mark.multiprocess
def test_rank_local_edit_is_named_at_the_next_epoch_end_before_its_checkpoint(tmp_path: Path):
    # rank 1 adds 1e-3 to one weight before step 6 (epoch 1 of 4 steps); checkpoints every epoch, nothing else added
    ckpt = tmp_path / "ckpt"
    run = run_scenario("diverge_mid_training", tmp_path, "--max-epochs", "3", "--ckpt-dir", str(ckpt), timeout=150)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert_named_on_every_rank(run.output, 8, " (end of training epoch 1)")
    # epoch 1's checkpoint (which would hold rank 0's copy only) was never written; epoch 0's are intact
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        record = verify(str(ckpt / name))
        assert record is not None and record.global_step == 4


@pytest.mark.multiprocess
def test_rank_local_edit_fails_the_next_asynchronous_save_on_every_rank(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    args = ["--max-epochs", "3", "--ckpt-dir", str(ckpt), "--every-n-train-steps", "2", "--async-save"]
    run = run_scenario("diverge_mid_training", tmp_path, *args, timeout=150)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert_named_on_every_rank(run.output, 6)
    assert run.output.count(f"Checkpoint '{ckpt / 'epoch=1-step=6.ckpt'}' was not written") == 2  # both ranks
    # the step-6 save (the first after the edit) wrote nothing; the earlier ones, written asynchronously, verify
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert verify(str(ckpt / "last.ckpt")).global_step == 4  # type: ignore[union-attr]


@pytest.mark.multiprocess
def test_stock_ddp_saves_the_checkpoint_of_diverged_ranks_silently(tmp_path: Path):
    ckpt, weights = tmp_path / "ckpt", tmp_path / "weights"
    args = ["--strategy", "ddp", "--max-epochs", "3", "--ckpt-dir", str(ckpt), "--save-rank-weights", str(weights)]
    run = run_scenario("diverge_mid_training", tmp_path, *args, timeout=150)
    assert stock_fit_finished(run), run.describe()  # stock's known gloo abort at interpreter exit is no failure here
    ranks = [torch.load(weights / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    difference = (ranks[0]["net.0.weight"] - ranks[1]["net.0.weight"]).abs().max().item()
    assert difference == pytest.approx(1e-3, rel=1e-3)  # the replicas stay apart until the end
    assert "epoch=2-step=12.ckpt" in {p.name for p in ckpt.iterdir()}
    last = torch.load(ckpt / "last.ckpt", weights_only=False)["state_dict"]
    assert torch.equal(last["net.0.weight"], ranks[0]["net.0.weight"])  # rank 0's copy only; rank 1's is lost


@pytest.mark.gpu
def test_weight_fingerprints_of_a_resnet18_are_computed_on_the_gpu():
    """The GPU path: fingerprints computed on the device (one transfer of two integers per tensor), bit-exact."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).cuda()
    twin = torchvision.models.resnet18(weights=None).cuda()
    twin.load_state_dict(model.state_dict())
    agreement = WeightAgreement(norm_statistics=False)
    ours = agreement.comparison(model, when="", name="gpu")
    theirs = agreement.comparison(twin, when="", name="gpu")
    assert all(t.is_cuda for _, _, t in ours.tensors)
    transfers: list[str] = []
    original = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        transfers.append(str(tuple(self.shape)))
        return original(self, *args, **kwargs)

    torch.Tensor.cpu = counting_cpu  # type: ignore[method-assign]
    try:
        digests = ours.digests()
    finally:
        torch.Tensor.cpu = original  # type: ignore[method-assign]
    assert transfers == [f"({len(ours.tensors)}, 2)"]  # one stacked transfer of the digests, nothing else
    assert compare([digests, theirs.digests()]) is None
    with torch.no_grad():
        twin.fc.bias[3] += 1e-6
    assert compare([digests, theirs.digests()]) == Divergence(
        indices=(len(ours.tensors) - 1,), ranks=(1,)
    )  # fc.bias is the last parameter
