"""The gates of overlapped asynchronous snapshots (``ddp_strategy.checkpoint.overlap`` and the optimizer closure)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.checkpoint.overlap import SnapshotGate, deferrable_tensors, install_snapshot_gate


class Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.automatic_optimization = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def fake_trainer(fn: TrainerFn = TrainerFn.FITTING, training: bool = True, **overrides: Any) -> Any:
    module = Module()
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # creates the moments
    values = {
        "lightning_module": module,
        "state": SimpleNamespace(fn=fn),
        "training": training,
        "sanity_checking": False,
        "optimizers": [optimizer],
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def test_parameters_and_optimizer_state_are_deferred_buffers_are_not():
    trainer = fake_trainer()
    deferred = deferrable_tensors(trainer)
    assert deferred is not None
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    assert all(deferred(t) for t in module.state_dict().values() if t.data_ptr() == module.lin.weight.data_ptr())
    assert deferred(module.lin.weight.detach()) and deferred(module.lin.bias.detach())
    assert all(deferred(t) for state in optimizer.state_dict()["state"].values() for t in state.values() if t.dim())
    assert not deferred(module.bn.running_mean) and not deferred(module.bn.running_var)
    assert not deferred(module.lin.weight.detach().clone())


@pytest.mark.parametrize(
    "overrides",
    [
        {"fn": TrainerFn.VALIDATING},
        {"training": False},  # fit's validation: a WeightAveraging swap may follow at once
        {"sanity_checking": True},
    ],
    ids=["validate-call", "fit-validation", "sanity-check"],
)
def test_nothing_is_deferred_outside_training(overrides):
    fn = overrides.pop("fn", TrainerFn.FITTING)
    assert deferrable_tensors(fake_trainer(fn, **overrides)) is None


def test_nothing_is_deferred_with_manual_optimization():
    trainer = fake_trainer()
    trainer.lightning_module.automatic_optimization = False
    assert deferrable_tensors(trainer) is None


def test_gate_is_installed_first_once_and_waits_in_its_hooks():
    calls: list[str] = []
    other = Callback()
    trainer = SimpleNamespace(callbacks=[other])
    install_snapshot_gate(trainer, lambda: calls.append("old"))
    gate = install_snapshot_gate(trainer, lambda: calls.append("wait"))
    assert trainer.callbacks == [gate, other]  # first, and the previous fit's gate is gone
    assert isinstance(gate, SnapshotGate)
    gate.on_train_epoch_start(None, None)  # type: ignore[arg-type]
    gate.on_train_epoch_end(None, None)  # type: ignore[arg-type]
    gate.on_validation_start(None, None)  # type: ignore[arg-type]
    gate.on_train_end(None, None)  # type: ignore[arg-type]
    gate.on_exception(None, None, RuntimeError())  # type: ignore[arg-type]
    assert calls == ["wait"] * 5
    gate.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]  # the overlap window: no wait
    assert calls == ["wait"] * 5


class FakeWriter:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.snapshot_pending = True

    def wait_for_snapshot(self) -> None:
        if self.snapshot_pending:
            self.events.append("snapshot copied")
        self.snapshot_pending = False


def test_optimizer_update_waits_for_the_snapshot_after_forward_and_backward(monkeypatch):
    events: list[str] = []

    def stock_optimizer_step(self, optimizer, closure, model=None, **kwargs):  # what the precision plugin does
        closure()
        events.append("parameters updated")

    monkeypatch.setattr(DDPStrategy, "optimizer_step", stock_optimizer_step)
    strategy = SafeDDPStrategy()
    strategy._saving.writer = FakeWriter(events)  # type: ignore[assignment]
    strategy.optimizer_step(None, lambda: events.append("forward and backward"))
    assert events == ["forward and backward", "snapshot copied", "parameters updated"]
    events.clear()
    strategy.optimizer_step(None, lambda: events.append("forward and backward"))  # nothing pending: no wait
    assert events == ["forward and backward", "parameters updated"]
    events.clear()

    def save_in_training_step() -> None:  # a snapshot that starts during the closure is waited for too
        events.append("forward and backward")
        strategy._saving.writer.snapshot_pending = True  # type: ignore[union-attr]

    strategy.optimizer_step(None, save_in_training_step)
    assert events == ["forward and backward", "snapshot copied", "parameters updated"]


def test_async_snapshot_option_is_validated():
    with pytest.raises(ValueError, match=r"async_snapshot.*'later'"):
        SafeDDPStrategy(async_save=True, async_snapshot="later")


@pytest.mark.parametrize(("mode", "overlap"), [("overlap", True), ("blocking", False)])
def test_async_snapshot_mode_decides_whether_saves_overlap(mode, overlap):
    assert SafeDDPStrategy(async_save=True, async_snapshot=mode).options.overlap_snapshots is overlap
    assert SafeDDPStrategy(async_save=True).options.overlap_snapshots  # the default
