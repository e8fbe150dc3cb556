"""DDP's gradient-bucket layout across a resume (ddp_strategy.bucket_layout), with real DDP wrappers on 3 gloo ranks.

The multi-process resume tests (tests/test_checkpoint_multiprocess.py) compare whole runs; these pin the mechanism:
the rebuild after the first optimizer step, the saved layout a new wrapper starts with, and the named conditions.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import pytest
import torch
from torch import nn

from ddp_strategy.bucket_layout import BucketLayout, BucketLayoutKeeper
from ddp_strategy.checkpoint.keys import BUCKET_LAYOUT_KEY
from tests.proc import free_port

WORLD = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _step(ddp: Any, keeper: BucketLayoutKeeper) -> None:
    ddp(torch.randn(4, 8)).sum().backward()
    if ddp is not keeper.settled:  # as SafeDDPStrategy.optimizer_step does, after the update
        keeper.after_optimizer_step(ddp)


def _layout(ddp: Any) -> list[list[str]]:
    from ddp_strategy._compat.torch import ddp_bucket_parameters

    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket] for bucket in ddp_bucket_parameters(ddp)]


def _resumed(section: dict[str, Any]) -> tuple[Any, BucketLayoutKeeper, list[list[str]]]:
    from torch.nn.parallel import DistributedDataParallel

    keeper = BucketLayoutKeeper(world_size=WORLD)
    keeper.resume_from(section)
    module = _model()
    with keeper.constructing(module):
        ddp = DistributedDataParallel(module)
    return ddp, keeper, _layout(ddp)


def _rank(rank: int, port: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ddp_strategy.bucket_layout").addHandler(Collect())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    try:
        # a fresh run: DDP's construction layout, rebuilt in backward order right after the first optimizer step
        keeper = BucketLayoutKeeper(world_size=WORLD)
        module = _model()
        with keeper.constructing(module):
            ddp = DistributedDataParallel(module)
        out["constructed"], out["state_before"] = _layout(ddp), keeper.state()
        out["settled_before"] = keeper.settled is None
        _step(ddp, keeper)
        out["rebuilt"], out["state"] = _layout(ddp), keeper.state()
        out["settled_after"] = keeper.settled is ddp
        _step(ddp, keeper)
        out["still"] = _layout(ddp)
        # a wrapper built without `constructing` (as a change of the trainable set rebuilds one): not settled, so
        # the next step's call takes it over and runs its rebuild
        other = DistributedDataParallel(_model())
        out["other_unsettled"] = other is not keeper.settled
        _step(other, keeper)
        out["other_settled"], out["other_rebuilt"] = keeper.settled is other, _layout(other)
        section = {BUCKET_LAYOUT_KEY: out["state"]}

        # a resumed run: its first step reduces with the saved layout; its own rebuild agrees, nothing is named
        ddp2, keeper2, out["resumed_first"] = _resumed(section)
        _step(ddp2, keeper2)
        out["resumed_rebuilt"], out["resumed_mismatch"] = _layout(ddp2), keeper2.mismatch
        out["records_clean"] = list(records)

        # a layout in another order than this model's backward: applied, then named after the rebuild
        backwards = {BUCKET_LAYOUT_KEY: {"buckets": [list(reversed(out["rebuilt"][0]))], "reduction": {}}}
        backwards[BUCKET_LAYOUT_KEY]["reduction"] = out["state"]["reduction"]
        ddp3, keeper3, out["reordered_first"] = _resumed(backwards)
        _step(ddp3, keeper3)
        out["reordered_mismatch"] = keeper3.mismatch

        # another model's parameters: not applied (DDP's own layout), named at once
        foreign = {BUCKET_LAYOUT_KEY: {"buckets": [["encoder.weight", "encoder.bias"]], "reduction": {}}}
        _, keeper4, out["foreign_first"] = _resumed(foreign)
        out["foreign_mismatch"] = keeper4.mismatch

        # saved on another backend: applied, and the backend is named
        nccl = {BUCKET_LAYOUT_KEY: {"buckets": out["state"]["buckets"], "reduction": {"backend": "nccl"}}}
        _, keeper5, out["nccl_first"] = _resumed(nccl)
        out["nccl_mismatch"] = keeper5.mismatch
        out["records"] = records
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return results


BACKWARD = ["2.bias", "2.weight", "0.bias", "0.weight"]  # the order this model's gradients become ready
FORWARD = ["0.weight", "0.bias", "2.weight", "2.bias"]  # DDP's construction order


def test_the_layout_is_rebuilt_after_the_first_optimizer_step_and_kept(ranks):
    for out in ranks.values():
        assert out["constructed"] == [FORWARD] and out["state_before"] is None  # nothing to save before the rebuild
        assert out["rebuilt"] == [BACKWARD] and out["still"] == [BACKWARD]
        assert out["settled_before"] and out["settled_after"]  # one rebuild per wrapper, then an identity test
        assert out["other_unsettled"] and out["other_settled"] and out["other_rebuilt"] == [BACKWARD]
        assert out["state"]["buckets"] == [BACKWARD] and out["state"]["reduction"] == {"backend": "gloo"}


def test_a_resumed_wrapper_starts_with_the_saved_layout(ranks):
    for out in ranks.values():
        assert out["resumed_first"] == [BACKWARD]  # a plain DDP wrapper would start with FORWARD
        assert out["resumed_rebuilt"] == [BACKWARD] and out["resumed_mismatch"] is None
        assert out["records_clean"] == []


def test_a_layout_the_backward_does_not_reproduce_is_named(ranks):
    for out in ranks.values():
        assert out["reordered_first"] == [list(reversed(BACKWARD))]
        assert "DDP rebuilt its gradient buckets in another order than the saved run" in out["reordered_mismatch"]
        assert any("the gradients became ready in another order" in r for r in out["records"])


def test_another_models_layout_is_not_applied_and_is_named(ranks):
    for out in ranks.values():
        assert out["foreign_first"] == [FORWARD]
        assert "hold other parameters than the trainable ones" in out["foreign_mismatch"]


def test_another_backend_is_named(ranks):
    for out in ranks.values():
        assert out["nccl_first"] == [BACKWARD]
        assert out["nccl_mismatch"] == "the all-reduce may add in another order (backend nccl when saved, gloo now)"
        assert any("from 3 ranks on, the resumed run may differ" in r for r in out["records"])


@pytest.mark.parametrize(
    "entry",
    [
        None,
        "3 2 1 0",
        {"buckets": "x"},
        {"buckets": [[0, 1]]},
        {"buckets": [["a", "a"]]},
        {"buckets": [["a"]], "reduction": {"backend": 1}},
    ],
)
def test_an_entry_of_another_shape_is_no_layout(entry):
    assert BucketLayout.from_dict(entry) is None


def test_the_entry_round_trips():
    layout = BucketLayout((("b", "a"), ("c",)), (("backend", "gloo"),))
    assert BucketLayout.from_dict(layout.to_dict()) == layout


def test_two_ranks_are_not_warned(caplog):
    # a sum of two floats does not depend on the order: at 2 ranks a mismatch is recorded, never warned about
    keeper = BucketLayoutKeeper(world_size=2)
    with caplog.at_level(logging.WARNING):
        keeper._name_mismatch("the checkpoint's gradient buckets hold other parameters than the trainable ones")
    assert keeper.mismatch is not None and caplog.records == []
