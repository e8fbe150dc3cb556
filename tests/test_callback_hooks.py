"""The strategy's callbacks let Lightning pass over the per-batch hooks they have nothing to do in (issue 30).

Lightning dispatches every hook of every callback at every step (about 1 us each, more with cold caches: the
reference callback of ``bench/results/strategy_cost.json``); a hook set to ``None`` on the instance is skipped by its
``callable`` test. Asserted: which hooks are skipped and when they come back, that a real fit runs with them
skipped (and still runs the hooks with work), and that a check a user creates keeps callable hooks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from ddp_strategy._compat.callback_hooks import (
    BATCH_HOOKS,
    restore_hooks,
    skip_hooks,
    skip_inherited_batch_hooks,
)
from ddp_strategy.callbacks import ShardingCheck, WeightSyncCheck
from ddp_strategy.callbacks.sharding_check import ensure_sharding_check


class Counting(Callback):
    """Counts its own per-batch hooks; its inherited ones are skipped."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        skip_inherited_batch_hooks(self)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.calls["on_train_batch_end"] = self.calls.get("on_train_batch_end", 0) + 1

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.calls["on_after_backward"] = self.calls.get("on_after_backward", 0) + 1


def test_inherited_per_batch_hooks_are_skipped_and_own_ones_kept():
    counting = Counting()
    own = {"on_train_batch_end", "on_after_backward"}
    assert all(getattr(counting, name) is None for name in set(BATCH_HOOKS) - own)
    assert all(callable(getattr(counting, name)) for name in own)
    assert callable(counting.on_save_checkpoint) and callable(counting.on_train_epoch_end)  # not per-batch hooks
    restore_hooks(counting, BATCH_HOOKS)
    assert all(callable(getattr(counting, name)) for name in BATCH_HOOKS)
    with pytest.raises(ValueError, match="not a per-batch hook"):
        skip_hooks(counting, ["on_save_checkpoint"])  # Lightning calls it directly: it must stay callable


def test_a_fit_passes_over_the_skipped_hooks_and_runs_the_others():
    counting = Counting()
    quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
    trainer = pl.Trainer(max_steps=3, callbacks=[counting], limit_val_batches=0, accelerator="cpu", devices=1, **quiet)
    trainer.fit(BoringModel())
    assert counting.calls == {"on_train_batch_end": 3, "on_after_backward": 3}


class _SubclassCheck(ShardingCheck):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:  # a subclass's own version
        super().on_train_batch_start(trainer, *args)


def test_the_strategys_sharding_check_is_skipped_once_done_until_the_next_fit():
    trainer: Any = SimpleNamespace(callbacks=[], world_size=2)
    check = ensure_sharding_check(trainer)  # the strategy's own
    assert check.on_after_backward is None and callable(check.on_train_batch_start)
    check._set_done(True)
    assert check.on_train_batch_start is None
    check.on_train_start(trainer, None)  # type: ignore[arg-type]  # a new fit collects again
    assert callable(check.on_train_batch_start)
    mine = ShardingCheck()  # a user's: every hook callable, also once done
    mine._set_done(True)
    assert callable(mine.on_train_batch_start) and callable(mine.on_after_backward)
    sub = _SubclassCheck()
    sub.skip_idle_hooks()
    sub._set_done(True)
    assert callable(sub.on_train_batch_start)  # the subclass's own hook always runs


def test_the_strategys_weight_check_skips_the_batch_end_only_without_every_n_steps():
    check = WeightSyncCheck(None, at_epoch_end=True)
    assert callable(check.on_train_batch_end)  # a user's: callable
    check.skip_idle_hooks()
    assert check.on_train_batch_end is None and check.on_before_backward is None
    check.every_n_steps = 5
    assert callable(check.on_train_batch_end)
    check.every_n_steps = None
    assert check.on_train_batch_end is None
    assert callable(check.on_train_epoch_end)


def test_lightnings_hook_loop_passes_over_a_skipped_hook():
    """A skipped hook costs Lightning a ``getattr`` and a ``callable`` test, not a call in its profiler context."""
    from lightning.pytorch.trainer import call

    ran: list[str] = []

    class Hooked(Callback):
        def on_before_zero_grad(self, *args: Any) -> None:
            ran.append("hooked")

    skipped = Hooked()
    skip_hooks(skipped, ["on_before_zero_grad"], unless_overridden_below=Hooked)  # idle now
    trainer: Any = SimpleNamespace(
        callbacks=[Hooked(), skipped], lightning_module=None, profiler=pl.profilers.PassThroughProfiler()
    )
    call._call_callback_hooks(trainer, "on_before_zero_grad", torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert ran == ["hooked"]  # the second one was passed over


def test_the_preemption_stop_skips_the_step_end_until_a_signal():
    """Issue 30: before any signal a training step's end has nothing to check; Lightning's turn of the hook cost half
    of the strategy's added instructions per tiny step (callgrind, session 22 note). The hook comes back as soon
    as the rank receives a signal (from the signal handler) or its watch learns of one."""
    import signal

    from ddp_strategy.callbacks.preemption_stop import PreemptionStop
    from ddp_strategy.preemption import PreemptionAgreement, train_position

    agreement = PreemptionAgreement(rank=0, world_size=1, start=train_position(0))
    stop = PreemptionStop(agreement, control=lambda: None, finish_writes=lambda: None)
    assert callable(stop.on_train_batch_end)
    trainer: Any = SimpleNamespace(global_step=3)
    stop.on_train_start(trainer, None)  # type: ignore[arg-type]
    assert stop.on_train_batch_end is None and callable(stop.on_validation_batch_end)
    assert agreement._position_source is not None and agreement._position_source() == train_position(3)
    trainer.global_step = 5
    assert agreement._position_source() == train_position(5)  # what the watch acks at: the rank's step now
    agreement.request(signal.SIGTERM)
    assert callable(stop.on_train_batch_end)
    stop.on_train_start(trainer, None)  # type: ignore[arg-type]  # already requested: stays callable
    assert callable(stop.on_train_batch_end)
