"""Uneven training inputs: ranks with different batch counts per epoch are named before the first step.

The script is a user's: Lightning's DistributedSampler turned off and the data split by hand, 32 samples on rank 0
and 28 on rank 1 (8 and 7 batches of 4). Stock Lightning trains 7 steps on both ranks, then rank 1 returns from
``fit`` while rank 0 is inside step 8's gradient all-reduce, which fails when rank 1's process exits (or, with more
epochs, silently pairs with rank 1's next epoch).

With ``--shrink-at-epoch 1`` the shards are even in epoch 0 and rank 1's loses a batch when the Trainer reloads
``train_dataloader`` for epoch 1 (``reload_dataloaders_every_n_epochs=1``): the counts are compared again then.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddp_strategy import SafeDDPStrategy, UnevenInputsError
from ddp_strategy.handshake import RankFacts, check_training_batches, compare_training_batches
from tests.proc import SCRIPTS, run_script

SCRIPT = str(SCRIPTS / "uneven_inputs.py")


def facts(*batches: float | None) -> list[RankFacts]:
    return [
        RankFacts(
            rank=r, local_rank=r, node_rank=0, host="h", pid=r, device="cpu", device_id=None,
            versions={}, world_size=len(batches), seed=None, training_batches=b,
        )
        for r, b in enumerate(batches)
    ]  # fmt: skip


def test_equal_or_unknown_counts_pass():
    assert check_training_batches(facts(8, 8, 8)) is None
    assert check_training_batches(facts(8, float("inf"))) is None  # an iterable: compared at run time instead
    assert check_training_batches(facts(None, None)) is None  # not training


def test_differing_counts_name_each_rank_and_the_fix():
    message = check_training_batches(facts(8, 7, 8, 6))
    assert message is not None
    assert "8 on rank(s) 0, 2; 7 on rank(s) 1; 6 on rank(s) 3" in message
    assert "wait forever in step 7" in message
    assert "limit_train_batches=6" in message and "use_distributed_sampler=True" in message


def steps(output: str, rank: int) -> list[int]:
    # two ranks print to one pipe: a line's text and its newline are separate writes, so lines may run together
    return [int(s) for s in re.findall(rf"rank={rank} step=(\d+)", output)]


@pytest.mark.multiprocess
def test_uneven_batches_raise_on_every_rank_before_the_first_step(tmp_path: Path):
    run = run_script([SCRIPT, "--strategy", "safe_ddp"], timeout=120)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    message = (
        "UnevenInputsError: Ranks have different numbers of training batches per epoch: 8 on rank(s) 0; 7 on rank(s) 1"
    )
    assert run.output.count(message) >= 2, run.describe()  # raised on both ranks
    assert steps(run.output, 0) == [] and steps(run.output, 1) == [], "no training step may run"
    assert run.seconds < 60, run.describe()


@pytest.mark.parametrize("mode", ["raise", "warn", None])
def test_the_strategy_raises_warns_or_skips_as_configured(mode):
    strategy = SafeDDPStrategy(uneven_inputs=mode)
    uneven = facts(8, 7)
    if mode == "raise":
        with pytest.raises(UnevenInputsError, match="8 on rank\\(s\\) 0; 7 on rank\\(s\\) 1") as caught:
            strategy._handshakes.check_training_batches(uneven)
        assert caught.value.batches == (8.0, 7.0) and caught.value.missing_ranks == (1,)
    elif mode == "warn":
        with pytest.warns(UserWarning, match="ddp_strategy: Ranks have different numbers of training batches"):
            strategy._handshakes.check_training_batches(uneven)
    else:
        strategy._handshakes.check_training_batches(uneven)  # not compared at all
    with pytest.raises(ValueError, match="uneven_inputs"):
        SafeDDPStrategy(uneven_inputs="ignore")


@pytest.mark.multiprocess
def test_stock_lightning_runs_uneven_steps_until_rank0_fails_in_step_8(tmp_path: Path):
    run = run_script([SCRIPT, "--strategy", "ddp"], timeout=120)
    assert not run.timed_out and not run.orphans, run.describe()
    assert "UnevenInputsError" not in run.output
    assert steps(run.output, 1) == list(range(1, 8)) and "rank=1 fit-done" in run.output, run.describe()
    assert steps(run.output, 0) == list(range(1, 8)) and "rank=0 fit-done" not in run.output, run.describe()
    # rank 0 is inside step 8's backward (DDP's gradient all-reduce) when rank 1, done, exits
    backward = run.output.rfind("in backward")
    assert backward != -1 and "Connection closed by peer" in run.output[backward:], run.describe()
    assert run.returncode != 0


def test_counts_after_a_reload_name_the_epoch_and_the_fix():
    assert compare_training_batches([7.0, 7.0], epoch=3) is None
    assert compare_training_batches([8.0, float("inf")], epoch=3) is None  # unknown length: not compared
    message = compare_training_batches([8.0, 7.0], epoch=1)
    assert message is not None
    assert message.startswith("Ranks have different numbers of training batches in epoch 1, after the training ")
    assert "8 on rank(s) 0; 7 on rank(s) 1" in message and "step 8 of epoch 1" in message
    assert "reload_dataloaders_every_n_epochs" in message and "smallest count of any epoch (7 here)" in message
    assert compare_training_batches([8.0, 7.0]) == check_training_batches(facts(8, 7))  # the handshake's message


class GatherControl:
    """A control plane of two ranks whose other rank (rank 0) reports ``other`` batches."""

    def __init__(self, other: float) -> None:
        self.other = other
        self.gathers: list[str] = []

    def all_gather_object(self, obj: Any, name: str, **_: Any) -> list[Any]:
        self.gathers.append(name)
        return [self.other, obj]


def test_a_fit_without_reloads_has_no_reload_check_callback_and_a_reload_adds_it_first_once():
    from lightning.pytorch.trainer.states import TrainerFn

    from ddp_strategy.handshake_runner import _ReloadedTrainingBatchesCheck

    strategy = SafeDDPStrategy()
    handshakes = strategy._handshakes
    earlier, user = _ReloadedTrainingBatchesCheck(lambda _: None), object()
    trainer: Any = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), callbacks=[earlier, user])
    handshakes.setup(trainer, world_size=2)
    assert trainer.callbacks == [user]  # a previous fit's check is gone: no turn in Lightning's per-batch hooks
    handshakes.training_loader_loaded(trainer)  # the fit's first load, before the training handshake
    assert trainer.callbacks == [user] and handshakes.train_loader_reloaded
    handshakes.run("train", strategy)  # no control plane: compares nothing, but the counts count as compared
    assert not handshakes.train_loader_reloaded
    handshakes.training_loader_loaded(trainer)  # a reload (reload_dataloaders_every_n_epochs): compared from now on
    added = trainer.callbacks[0]
    assert isinstance(added, _ReloadedTrainingBatchesCheck) and trainer.callbacks[1:] == [user]
    handshakes.training_loader_loaded(trainer)
    assert trainer.callbacks == [added, user]  # once per fit
    single: Any = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), callbacks=[])
    handshakes.setup(single, world_size=1)
    handshakes.run("train", strategy)
    handshakes.training_loader_loaded(single)
    assert single.callbacks == []  # one rank: nothing to compare


@pytest.mark.parametrize("mode", ["raise", "warn", None])
def test_the_epoch_start_compares_only_after_a_reload(mode):
    strategy = SafeDDPStrategy(uneven_inputs=mode)
    control = GatherControl(other=8.0)
    strategy._lifecycle.control = control  # type: ignore[assignment]
    trainer: Any = SimpleNamespace(current_epoch=1, num_training_batches=7)
    strategy._handshakes.check_reloaded_training_batches(trainer)  # no reload since the handshake: no collective
    assert control.gathers == []
    strategy._handshakes.train_loader_reloaded = True
    if mode == "raise":
        with pytest.raises(UnevenInputsError, match=r"in epoch 1, .*8 on rank\(s\) 0; 7 on rank\(s\) 1") as caught:
            strategy._handshakes.check_reloaded_training_batches(trainer)
        assert caught.value.batches == (8.0, 7.0) and caught.value.missing_ranks == (1,)
    elif mode == "warn":
        with pytest.warns(
            UserWarning, match="ddp_strategy: Ranks have different numbers of training batches in epoch 1"
        ):
            strategy._handshakes.check_reloaded_training_batches(trainer)
    else:
        strategy._handshakes.check_reloaded_training_batches(trainer)
    assert control.gathers == ([] if mode is None else ["training-batches:epoch-1"])
    assert not strategy._handshakes.train_loader_reloaded  # compared once per reload
    strategy._handshakes.check_reloaded_training_batches(trainer)
    assert len(control.gathers) == (0 if mode is None else 1)
    strategy._lifecycle.control = None


def epoch_steps(output: str, rank: int, epoch: int) -> list[int]:
    return [int(s) for s in re.findall(rf"rank={rank} step=(\d+) epoch={epoch}", output)]


@pytest.mark.multiprocess
def test_a_shard_that_shrinks_at_a_reload_raises_on_every_rank_before_that_epoch(tmp_path: Path):
    run = run_script([SCRIPT, "--strategy", "safe_ddp", "--shrink-at-epoch", "1"], timeout=120)
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    message = (
        "UnevenInputsError: Ranks have different numbers of training batches in epoch 1, after the training "
        "dataloader was reloaded (Trainer(reload_dataloaders_every_n_epochs=...)): 8 on rank(s) 0; 7 on rank(s) 1."
    )
    assert run.output.count(message) >= 2, run.describe()  # raised on both ranks
    for rank in (0, 1):  # epoch 0 ran in full (even shards); no step of epoch 1 ran
        assert epoch_steps(run.output, rank, 0) == list(range(1, 9)), run.describe()
        assert epoch_steps(run.output, rank, 1) == [], run.describe()
    assert "fit-done" not in run.output
    assert run.seconds < 60, run.describe()


@pytest.mark.multiprocess
def test_stock_lightning_trains_the_shrunken_epoch_until_rank0_fails_in_its_step_8(tmp_path: Path):
    run = run_script([SCRIPT, "--strategy", "ddp", "--shrink-at-epoch", "1"], timeout=90)
    assert not run.timed_out and not run.orphans, run.describe()
    assert "UnevenInputsError" not in run.output
    for rank in (0, 1):
        assert epoch_steps(run.output, rank, 0) == list(range(1, 9)), run.describe()
        assert epoch_steps(run.output, rank, 1) == list(range(1, 8)), run.describe()
    # rank 1 ran out after 7 batches and returned from fit; rank 0 is inside step 8's backward (DDP's gradient
    # all-reduce) when rank 1's process exits
    assert "rank=1 fit-done" in run.output and "rank=0 fit-done" not in run.output, run.describe()
    backward = run.output.rfind("in backward")
    assert backward != -1 and "Connection closed by peer" in run.output[backward:], run.describe()
    assert run.returncode != 0
