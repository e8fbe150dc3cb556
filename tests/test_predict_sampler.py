"""``batch_sampler.sampler`` of an exactly sharded evaluation dataloader: a :class:`RankShareSampler` (issue 20, 4).

Stock ``DDPStrategy`` gives every rank's predict dataloader a Lightning ``UnrepeatedDistributedSampler`` (Lightning's
own ``test_trainer_predict_ddp_spawn`` asserts it); exact evaluation deals whole batches with a batch sampler, which
now carries this rank's share as sample indices in that place, in its instance ``__dict__`` so that Lightning's
predict index wrapper (which copies the ``__dict__``) exposes it too. The unit tests check the share against the
batches it describes; the multi-process test runs ``trainer.predict`` on 2 ranks with ``SafeDDPStrategy`` and with
stock ``DDPStrategy`` (``tests/scripts/predict_sampler.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler, _IndexBatchSamplerWrapper
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

import ddp_strategy.evaluation
from ddp_strategy.evaluation import (
    BatchShardSampler,
    RankShareSampler,
    SeededPermutationSampler,
    interleave_batches,
    shard_evaluation_dataloader,
)
from tests.proc import SCRIPTS, run_script, stock_fit_finished


def single_device_batches(order: str, n: int, batch_size: int, drop_last: bool = False) -> BatchSampler:
    sampler: Sampler[int] = SequentialSampler(range(n)) if order == "sequential" else SeededPermutationSampler(n, 5)
    return BatchSampler(sampler, batch_size, drop_last)


def flatten(batches: Any) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.compat
@pytest.mark.parametrize("order", ["sequential", "shuffled"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 13])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 5])
def test_every_sample_once_over_the_ranks_in_each_ranks_batch_order(
    order: str, world_size: int, n: int, batch_size: int
):
    single = list(single_device_batches(order, n, batch_size))
    shares, dealt = [], []
    for rank in range(world_size):
        shard = BatchShardSampler(single_device_batches(order, n, batch_size), rank, world_size)
        share = shard.sampler
        assert isinstance(share, RankShareSampler)
        assert isinstance(share, UnrepeatedDistributedSampler) and isinstance(share, DistributedSampler)
        got = list(share)
        assert got == flatten(shard)  # this rank's batches, flattened, in order
        assert len(share) == len(got) == share.num_samples and share.total_size == n
        assert (share.rank, share.num_replicas, share.shuffle) == (rank, world_size, order == "shuffled")
        # Lightning's predict index wrapper copies the instance __dict__: the share survives, the batches stay.
        wrapped = _IndexBatchSamplerWrapper(shard)
        assert wrapped.sampler is share and list(wrapped.sampler) == got
        assert [list(batch) for batch in wrapped] == list(shard) and wrapped.seen_batch_indices == list(shard)
        shares.append(got)
        dealt.append(list(shard))
    assert sorted(i for share in shares for i in share) == list(range(n))  # every index exactly once
    assert interleave_batches(dealt) == single  # and the shares are the single device's batches, dealt


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [0, 1, 7, 13])
def test_length_follows_a_dropped_last_batch(world_size: int, n: int):
    """Validation and test keep ``drop_last`` (predict never drops): the share has what the batches hold."""
    for rank in range(world_size):
        share = BatchShardSampler(single_device_batches("sequential", n, 3, drop_last=True), rank, world_size).sampler
        assert len(share) == len(list(share))
        assert share.total_size == n // 3 * 3


def test_attributes_of_the_distributed_sampler_hold_this_shares_values():
    dataset = TensorDataset(torch.arange(9))
    stock = vars(DistributedSampler(dataset, num_replicas=2, rank=0))
    for order, shuffle, seed in [
        (SequentialSampler(dataset), False, 0),
        (SeededPermutationSampler(9, seed=11), True, 11),
        (RandomSampler(dataset, generator=torch.Generator().manual_seed(3)), True, 0),
    ]:
        share = BatchShardSampler(BatchSampler(order, 2, False), 1, 2, dataset=dataset).sampler
        assert all(hasattr(share, name) for name in stock)  # everything DistributedSampler.__init__ sets
        assert (share.dataset, share.num_replicas, share.rank, share.epoch) == (dataset, 2, 1, 0)
        assert (share.shuffle, share.seed, share.drop_last) == (shuffle, seed, False)
        assert (len(share), share.num_samples, share.total_size) == (4, 4, 9)  # batches 1 and 3 of 5


def test_set_epoch_moves_the_batches_and_the_share_together():
    shards = [BatchShardSampler(single_device_batches("shuffled", 11, 2), rank, 2) for rank in range(2)]
    before = [list(shard.sampler) for shard in shards]
    for shard in shards:
        shard.sampler.set_epoch(3)
        assert shard.sampler.epoch == 3 and shard.batch_sampler.sampler.epoch == 3  # forwarded
        assert list(shard.sampler) == flatten(shard)
    after = [list(shard.sampler) for shard in shards]
    assert after != before and sorted(after[0] + after[1]) == list(range(11))


def test_a_batch_sampler_of_unknown_composition_has_a_share_without_length():
    class Pairs(Sampler[list[int]]):  # a custom batch sampler: its batch sizes are only known by iterating
        def __iter__(self):
            return iter([[0, 1], [2], [3, 4, 5]])

        def __len__(self) -> int:
            return 3

    shard = BatchShardSampler(Pairs(), 0, 2)
    assert list(shard.sampler) == [0, 1, 3, 4, 5] and len(shard) == 2
    with pytest.raises(TypeError, match="Pairs has no known length"):
        len(shard.sampler)
    assert getattr(shard.sampler, "num_samples", None) is None


@pytest.mark.compat
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("predicting", [False, True])
def test_sharded_dataloaders_expose_the_share_and_run_the_same_batches(shuffle: bool, predicting: bool):
    dataset = TensorDataset(torch.arange(11))
    runs = []
    for rank in range(3):
        user = DataLoader(dataset, batch_size=2, shuffle=shuffle)
        loader: Any = shard_evaluation_dataloader(user, rank=rank, world_size=3, predicting=predicting, name="x")
        loader = loader.dataloader
        share = loader.batch_sampler.sampler
        assert type(loader.batch_sampler).__name__ == (
            "_IndexBatchSamplerWrapper" if predicting else "BatchShardSampler"
        )
        assert isinstance(share, RankShareSampler) and share.dataset is dataset and share.shuffle is shuffle
        batches = [batch[0].tolist() for batch in loader]
        assert list(share) == flatten(batches) and len(share) == len(flatten(batches))
        assert [batch[0].tolist() for batch in loader] == batches  # iterating the share changed nothing
        runs.append(batches)
    assert sorted(flatten(interleave_batches(runs))) == list(range(11))


@pytest.mark.compat
def test_lightning_sets_the_epoch_of_the_sharded_order_through_the_share():
    """Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` before each evaluation (the epoch of ``fit``).

    It now reaches the shard's :class:`SeededPermutationSampler`, so a shuffled evaluation order is ``seed + epoch``
    on every rank, as docs/evaluation.md says; before, nothing took Lightning's call and the order stayed epoch 0's.
    """
    dataset = TensorDataset(torch.arange(11))
    loaders = [
        shard_evaluation_dataloader(
            DataLoader(dataset, batch_size=2, shuffle=True), rank=rank, world_size=2, predicting=False, name="x"
        ).dataloader
        for rank in range(2)
    ]
    first = [[batch[0].tolist() for batch in loader] for loader in loaders]
    for loader in loaders:
        _set_sampler_epoch(loader, 2)
        assert loader.batch_sampler.batch_sampler.sampler.epoch == 2
    second = [[batch[0].tolist() for batch in loader] for loader in loaders]
    assert second != first
    assert sorted(flatten(second[0] + second[1])) == list(range(11))


@pytest.mark.compat
def test_exported_where_batch_shard_sampler_is_and_bound_to_each_namespace():
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning.overrides.distributed

    import ddp_strategy.pytorch_lightning.evaluation as mirrored

    assert "RankShareSampler" in ddp_strategy.evaluation.__all__ and "RankShareSampler" in mirrored.__all__
    assert issubclass(mirrored.RankShareSampler, pytorch_lightning.overrides.distributed.UnrepeatedDistributedSampler)
    assert issubclass(RankShareSampler, UnrepeatedDistributedSampler)


# ---------------------------------------------------------------------------------------------- multi-process
def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.multiprocess
def test_predict_sampler_is_an_unrepeated_distributed_sampler_as_under_stock_ddp(tmp_path: Path):
    """``trainer.predict`` on 2 CPU ranks, two dataloaders of 7 and 5 samples, batch size 2.

    ``batch_sampler.sampler`` is an ``UnrepeatedDistributedSampler`` under both strategies; its indices, the batch
    indices a prediction writer gets and the samples ``predict_step`` sees are the same, and the ranks' shares are
    disjoint and cover every sample once. The shares differ in kind: stock strides samples, exact evaluation deals
    whole batches.
    """
    expected_types = {"safe_ddp": "RankShareSampler", "ddp": "UnrepeatedDistributedSamplerWrapper"}
    shares: dict[str, list[list[list[int]]]] = {}
    for strategy, sampler_type in expected_types.items():
        out = tmp_path / f"{strategy}.json"
        run = run_script([str(SCRIPTS / "predict_sampler.py"), "--strategy", strategy, "--out", str(out)], timeout=120)
        finished = stock_fit_finished(run) if strategy == "ddp" else run.returncode == 0 and not run.timed_out
        assert finished and not run.orphans, run.describe()
        ranks = _ranks(out)
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
        shares[strategy] = []
        for i, size in enumerate((7, 5)):
            loaders = [r["loaders"][i] for r in ranks]
            for loader in loaders:
                assert (loader["sampler_type"], loader["unrepeated"]) == (sampler_type, True), strategy
                assert loader["sampler_indices"] == flatten(loader["batch_indices"]) == loader["seen"], strategy
            first, second = (loader["sampler_indices"] for loader in loaders)
            assert not set(first) & set(second) and sorted(first + second) == list(range(size)), strategy
            shares[strategy].append([first, second])
    # Exact evaluation deals batches of 2 round-robin; stock strides single samples.
    assert shares["safe_ddp"] == [[[0, 1, 4, 5], [2, 3, 6]], [[0, 1, 4], [2, 3]]]
    assert shares["ddp"] == [[[0, 2, 4, 6], [1, 3, 5]], [[0, 2, 4], [1, 3]]]
