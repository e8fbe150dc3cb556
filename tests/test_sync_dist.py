"""``self.log(..., sync_dist=True)``: one all-reduce per value, no barrier before it, the same values as stock.

Lightning's ``DDPStrategy.reduce`` (``_sync_ddp``) runs ``torch.distributed.barrier`` before the all-reduce of
every synced value: two collectives per value where one does (issue 30: the cost per ``sync_dist`` value).
``SafeDDPStrategy.reduce`` makes the all-reduce alone (``ddp_strategy.collective_calls.all_reduce_value``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_strategy.collective_calls import all_reduce_value
from tests.proc import SCRIPTS, run_script

pytestmark = pytest.mark.compat  # Lightning's reduce (and its barrier) on the lowest and newest supported versions


def _fit(tmp_path: Path, strategy: str) -> list[dict]:
    out = tmp_path / strategy
    run = run_script([str(SCRIPTS / "sync_dist_calls.py"), "--strategy", strategy, "--out", str(out)], timeout=180)
    assert run.returncode == 0 and not run.orphans, run.describe()
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
def test_safe_logs_every_synced_value_by_one_all_reduce_and_agrees_with_stock(tmp_path: Path):
    stock, safe = _fit(tmp_path, "ddp"), _fit(tmp_path, "safe_ddp")
    steps = len(stock[0]["raw"])
    assert steps == 7 and all(len(rank["synced"]) == steps for rank in stock + safe)
    # the symptom: stock's barrier before each of the 3 values of every step; none with SafeDDPStrategy
    assert [rank["barriers_in_log"] for rank in stock] == [3 * steps, 3 * steps]
    assert [rank["barriers_in_log"] for rank in safe] == [0, 0]
    # every rank logged the same synced values, bit for bit the same as stock's
    assert safe[0]["synced"] == safe[1]["synced"] == stock[0]["synced"] == stock[1]["synced"]
    # and they are the mean, the sum and the largest of the ranks' own values
    for step, synced in enumerate(safe[0]["synced"]):
        raw = [rank["raw"][step] for rank in safe]
        assert synced["loss"] == pytest.approx((raw[0]["loss"] + raw[1]["loss"]) / 2, rel=1e-6)
        assert synced["seen"] == raw[0]["seen"] + raw[1]["seen"]
        assert synced["biggest"] == max(raw[0]["biggest"], raw[1]["biggest"])


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("value", "reduce_op", "expected"),
    [
        (torch.tensor([3.0, 5.0]), "mean", [3.0, 5.0]),  # gloo: a sum divided by the group's size
        (torch.tensor([3.0]), "avg", [3.0]),
        (torch.tensor([3.0]), "sum", [3.0]),
        (torch.tensor([3.0]), "MAX", [3.0]),
        (torch.tensor([3.0]), None, [3.0]),  # Lightning's documented default: a sum
        (torch.tensor([3.0]), dist.ReduceOp.MIN, [3.0]),
        (torch.tensor([7]), "mean", [7]),  # an integer stays an integer, as in Lightning (the strategy hands a double)
    ],
)
def test_all_reduce_value_reduces_in_place_as_lightning_does(value: torch.Tensor, reduce_op: object, expected: list):
    result = all_reduce_value(value, None, reduce_op)
    assert result is value and result.tolist() == expected and result.dtype == value.dtype


@pytest.mark.usefixtures("one_rank_group")
def test_all_reduce_value_refuses_an_unknown_operation_by_name():
    with pytest.raises(AttributeError, match="MEDIAN"):
        all_reduce_value(torch.tensor([1.0]), None, "median")


def test_all_reduce_value_returns_anything_else_and_anything_without_a_process_group_unchanged():
    assert not dist.is_initialized()
    value = torch.tensor([2.0])
    assert all_reduce_value(value) is value and all_reduce_value(3.5) == 3.5
