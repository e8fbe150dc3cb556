"""``self.log(..., sync_dist=True)``: one collective per value, no barrier before it, the same values as stock.

And no per-batch broadcast of rank 0's SIGTERM flag (Lightning >= 2.5): the strategy's handler has SIGTERM.

Lightning's ``DDPStrategy.reduce`` (``_sync_ddp``) runs ``torch.distributed.barrier`` before the all-reduce of
every synced value: two collectives per value where one does (issue 30: the cost per ``sync_dist`` value).
``SafeDDPStrategy.reduce`` makes one (``ddp_strategy.collective_calls.all_reduce_value``): the all-reduce on NCCL,
an all-gather reduced on every rank on gloo, where an all-reduce paired with another rank's larger all-reduce
aborts the process (``tests/test_desync.py``, case ``log-in-training-step-rank-zero``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_strategy.collective_calls import all_reduce_value
from tests.proc import SCRIPTS, run_script, stock_fit_finished

pytestmark = pytest.mark.compat  # Lightning's reduce (and its barrier) on the lowest and newest supported versions


def _fit(tmp_path: Path, strategy: str) -> list[dict]:
    out = tmp_path / strategy
    run = run_script([str(SCRIPTS / "sync_dist_calls.py"), "--strategy", strategy, "--out", str(out)], timeout=180)
    # stock may abort at interpreter exit on gloo, after the ranks wrote their files (see stock_fit_finished; compat
    # CI, 2026-11-29); the strategy must exit 0
    finished = stock_fit_finished(run) if strategy == "ddp" else run.returncode == 0 and not run.orphans
    assert finished, run.describe()
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
def test_safe_logs_every_synced_value_by_one_collective_and_agrees_with_stock(tmp_path: Path):
    stock, safe = _fit(tmp_path, "ddp"), _fit(tmp_path, "safe_ddp")
    steps = len(stock[0]["raw"])
    assert steps == 7 and all(len(rank["synced"]) == steps for rank in stock + safe)
    # the symptom: stock's barrier before the all-reduce of each of the 3 values of every step; safe makes one
    # collective per value, on gloo an all-gather (an all-reduce could be paired with DDP's larger gradient one)
    values = 3 * steps
    assert [rank["calls_in_log"] for rank in stock] == 2 * [
        {"barrier": values, "all_reduce": values, "all_gather_single": 0}
    ]
    assert [rank["calls_in_log"] for rank in safe] == 2 * [{"barrier": 0, "all_reduce": 0, "all_gather_single": values}]
    # Lightning (>= 2.5) broadcasts rank 0's SIGTERM flag before every batch; safe's own handler has SIGTERM (its
    # default preemption signal), so the flag cannot be set, and safe skips that collective
    per_batch = steps if stock[0]["lightning_broadcasts_sigterm"] else 0
    assert [rank["sigterm_broadcasts"] for rank in stock] == [per_batch, per_batch]
    assert [rank["sigterm_broadcasts"] for rank in safe] == [0, 0]
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


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("value", "reduce_op", "expected"),
    [
        (torch.tensor([2.0, -4.0]), "product", [2.0, -4.0]),
        (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), "sum", [[1, 2], [3, 4]]),  # the shape and dtype kept
        (torch.tensor(2.5, dtype=torch.float64), "min", 2.5),  # a 0-d value, as `self.log` hands it
    ],
)
def test_all_reduce_value_on_gloo_gathers_once_and_reduces_on_every_rank(
    value: torch.Tensor, reduce_op: object, expected: object, monkeypatch: pytest.MonkeyPatch
):
    calls = _count_collectives(monkeypatch)
    result = all_reduce_value(value, None, reduce_op)
    assert result is value and result.tolist() == expected and result.dtype == value.dtype
    assert calls == ["all_gather_single"]


@pytest.mark.usefixtures("one_rank_group")
def test_all_reduce_value_on_gloo_warns_nothing():
    # torch 2.14 deprecates all_gather_into_tensor with a FutureWarning at every call (the user saw it once, and
    # every sync_dist value paid for Python's warning machinery); all_gather_single is the same collective
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all_reduce_value(torch.tensor([1.0, 2.0]), None, "sum").tolist() == [1.0, 2.0]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("value", "reduce_op"),
    [
        (torch.tensor([6, 3]), dist.ReduceOp.BAND),  # an op the gather does not reduce
        (torch.tensor([True]), "max"),  # a bool value
        (torch.zeros(2**20 + 1), "sum"),  # more than _GATHERED_MOST_ELEMENTS gathered
    ],
)
def test_all_reduce_value_on_gloo_keeps_lightnings_barrier_where_it_cannot_gather(
    value: torch.Tensor, reduce_op: object, monkeypatch: pytest.MonkeyPatch
):
    expected = value.clone()
    calls = _count_collectives(monkeypatch)
    assert all_reduce_value(value, None, reduce_op).equal(expected)
    assert calls == ["barrier", "all_reduce"]


def _count_collectives(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("barrier", "all_reduce", "all_gather_single"):
        original = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
    return calls


@pytest.mark.multiprocess
def test_on_gloo_a_value_reduced_on_one_rank_only_waits_where_an_all_reduce_aborts_the_process(tmp_path: Path):
    """The mechanism behind the gather: rank 0 reduces a 1-element value, rank 1 all-reduces 41 floats (as DDP's
    gradient bucket). By ``dist.all_reduce`` gloo kills rank 0 with a C++ ``terminate`` (SIGABRT, no Python error);
    by ``all_reduce_value`` both ranks' calls wait and end in gloo's timeout, a Python error desync detection acts on.
    """
    aborted = run_script([str(SCRIPTS / "gloo_size_mismatch.py"), "all_reduce"], timeout=90)
    assert not aborted.orphans, aborted.describe()
    assert "rank=0 exitcode=-6" in aborted.output, aborted.describe()  # SIGABRT, in gloo's network thread
    assert "op.preamble.length <= op.nbytes" in aborted.output and "rank=0 raised" not in aborted.output
    waited = run_script([str(SCRIPTS / "gloo_size_mismatch.py"), "all_reduce_value"], timeout=90)
    assert not waited.orphans and "op.preamble.length" not in waited.output, waited.describe()
    for rank in (0, 1):  # each rank's call returned a Python error after the group's 3-s timeout, then exited
        assert f"rank={rank} raised RuntimeError" in waited.output, waited.describe()
        assert f"rank={rank} exitcode=0" in waited.output, waited.describe()
