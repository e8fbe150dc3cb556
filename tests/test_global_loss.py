"""GlobalTrainingLoss logs the mean of the ranks' losses (seed 001: "why do I see 4 losses?")."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_strategy.callbacks import GlobalTrainingLoss
from tests.proc import SCRIPTS, run_script


@pytest.mark.multiprocess
def test_logged_loss_is_the_mean_over_ranks(tmp_path: Path):
    out = tmp_path / "result.json"
    run = run_script([str(SCRIPTS / "global_loss.py"), "--out", str(out)], timeout=120, out=out)
    assert run.returncode == 0 and not run.orphans, run.describe()
    assert run.result is not None
    # rank r's loss at batch b is r + 1 + b: rank 0 logs 1, 2 locally, rank 1 logs 2, 3; the global values are
    # their means, and the epoch value the mean over all steps and ranks
    assert run.result["step"] == [1.5, 2.5]
    assert run.result["epoch"] == 2.0


def test_needs_step_or_epoch():
    with pytest.raises(ValueError, match="on_step=True or on_epoch=True"):
        GlobalTrainingLoss(on_step=False, on_epoch=False)
