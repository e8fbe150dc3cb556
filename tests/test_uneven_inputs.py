"""Uneven training inputs: ranks with different batch counts per epoch are named before the first step.

The script is a user's: Lightning's DistributedSampler turned off and the data split by hand, 32 samples on rank 0
and 28 on rank 1 (8 and 7 batches of 4). Stock Lightning trains 7 steps on both ranks, then rank 1 returns from
``fit`` while rank 0 is inside step 8's gradient all-reduce, which fails when rank 1's process exits (or, with more
epochs, silently pairs with rank 1's next epoch).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_strategy import SafeDDPStrategy, UnevenInputsError
from ddp_strategy.handshake import RankFacts, check_training_batches
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
            strategy._check_training_batches(uneven)
        assert caught.value.batches == (8.0, 7.0) and caught.value.missing_ranks == (1,)
    elif mode == "warn":
        with pytest.warns(UserWarning, match="ddp_strategy: Ranks have different numbers of training batches"):
            strategy._check_training_batches(uneven)
    else:
        strategy._check_training_batches(uneven)  # not compared at all
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
