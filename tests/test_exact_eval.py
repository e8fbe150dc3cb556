"""Exact distributed evaluation: several ranks give the devices=1 answer, with uneven and empty shards.

The multi-process tests run ``tests/scripts/exact_eval.py``, which evaluates one dataloader per (sample count,
batch size) pair in a single ``validate`` / ``test`` / ``predict`` / ``fit`` call each, and compare rank 0's JSON
with a devices=1 run of the same script: counts exactly, floats within 1e-6, predictions in order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from ddp_strategy.evaluation import (
    BatchShardSampler,
    RankStridedIterable,
    SeededPermutationSampler,
    interleave_batches,
    shard_evaluation_dataloader,
)
from ddp_strategy.evaluation.logged import LoggedKey, merge_keys
from tests.proc import SCRIPTS, Run, run_script, stock_fit_finished

SCRIPT = str(SCRIPTS / "exact_eval.py")
ALL_SIZES = ",".join(str(n) for n in range(14))  # 0 to 13 samples
SOME_SIZES = "0,1,2,5,10,13"


def run_eval(tmp_path: Path, name: str, *args: str, timeout: float = 300) -> Run:
    out = tmp_path / f"{name}.json"
    return run_script([SCRIPT, "--out", str(out), *args], timeout=timeout, out=out)


def assert_same(reference: Any, got: Any, path: str = "") -> None:
    """Equal structure; floats within 1e-6 (sums over ranks add in another order), everything else exactly."""
    if isinstance(reference, dict):
        assert set(reference) == set(got), f"{path}: keys differ: {sorted(set(reference) ^ set(got))}"
        for key in reference:
            assert_same(reference[key], got[key], f"{path}.{key}")
    elif isinstance(reference, list):
        assert len(reference) == len(got), f"{path}: {len(reference)} entries on one device, {len(got)} here"
        for i, (a, b) in enumerate(zip(reference, got, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(reference, float):
        assert math.isclose(reference, got, rel_tol=0, abs_tol=1e-6), f"{path}: {reference} vs {got}"
    else:
        assert reference == got, f"{path}: {reference!r} vs {got!r}"


def sample_counts(results: list[dict[str, float]]) -> list[float]:
    return [value for entry in results for key, value in entry.items() if key.split("/")[0] == "samples"]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The devices=1 answer for every sample count 0..13 and batch size 1, 2, 5."""
    run = run_eval(tmp_path_factory.mktemp("reference"), "reference", "--devices", "1", "--sizes", ALL_SIZES)
    assert run.returncode == 0 and run.result is not None, run.describe()
    return run.result


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.compat), 3, 4])
def test_every_size_and_batch_size_matches_one_device(tmp_path: Path, single_device: dict[str, Any], world_size: int):
    run = run_eval(tmp_path, f"ws{world_size}", "--devices", str(world_size), "--sizes", ALL_SIZES, timeout=400)
    assert run.returncode == 0, run.describe()
    assert not run.orphans, run.describe()
    result = run.result
    assert result is not None and result["world_size"] == world_size
    # the sample counts are the data set sizes: nothing padded, nothing dropped (0-sample loaders log nothing)
    expected_counts = [float(n) for n, _ in result["configs"] if n > 0]
    assert sample_counts(result["validate"]) == expected_counts
    assert sample_counts(result["test"]) == expected_counts
    for stage in ("validate", "test", "predict", "fit"):
        assert_same(single_device[stage], result[stage], stage)
    # predictions: every sample once, in dataset order, on rank 0
    assert [sum(len(batch) for batch in loader) for loader in result["predict"]] == [n for n, _ in result["configs"]]


@pytest.mark.multiprocess
def test_custom_loaders_match_one_device(tmp_path: Path):
    reference = run_eval(tmp_path, "ref", "--devices", "1", "--sizes", SOME_SIZES, "--stages", "validate,test")
    assert reference.returncode == 0 and reference.result is not None, reference.describe()
    for loader, workers, warning in (
        ("iterable", "2", "over the IterableDataset IterableTensors is sharded by dealing its items round-robin"),
        ("custom_sampler", "0", "uses the custom sampler ReversedSampler; its batches are dealt whole"),
        ("user_sampler", "0", None),  # a hand-made padded DistributedSampler is replaced by exact sharding
    ):
        args = ["--devices", "3", "--sizes", SOME_SIZES, "--stages", "validate,test", "--loader", loader]
        run = run_eval(tmp_path, loader, *args, "--num-workers", workers)
        assert run.returncode == 0 and run.result is not None, run.describe()
        assert not run.orphans, run.describe()
        for stage in ("validate", "test"):
            assert_same(reference.result[stage], run.result[stage], f"{loader}.{stage}")
        if warning is not None:  # exactness rests on an assumption: said once per dataloader kind and stage
            assert run.output.count(warning) == 2, run.output[-3000:]
        else:
            assert "ddp_strategy: the val_dataloader" not in run.output


@pytest.mark.multiprocess
@pytest.mark.compat
def test_per_step_sync_with_uneven_steps_raises_a_named_error(tmp_path: Path):
    # 3 samples, batch size 1, 2 ranks: rank 0 runs 2 steps, rank 1 runs 1; a per-step all-reduce would hang
    args = ["--devices", "2", "--sizes", "3", "--batch-sizes", "1", "--stages", "validate", "--step-sync"]
    run = run_eval(tmp_path, "uneven", *args, timeout=120)
    assert run.returncode != 0, run.describe()
    assert not run.orphans, run.describe()
    assert "UnevenEvaluationError" in run.output
    assert "ranks run different numbers of steps (rank 0: 2, rank 1: 1)" in run.output
    assert "on_step=False, on_epoch=True, sync_dist=True" in run.output
    assert run.seconds < 60, run.describe()


@pytest.mark.multiprocess
def test_per_step_sync_with_even_steps_is_allowed(tmp_path: Path):
    args = ["--devices", "2", "--sizes", "4", "--batch-sizes", "1", "--stages", "validate", "--step-sync"]
    run = run_eval(tmp_path, "even", *args, timeout=120)
    assert run.returncode == 0, run.describe()
    assert run.result is not None and sample_counts(run.result["validate"]) == [4.0]


@pytest.mark.multiprocess
def test_stock_lightning_counts_padded_duplicates(tmp_path: Path):
    """The gap this package closes, measured: stock DDP evaluates 12 samples out of 10 and 3 out of 2 on 3 ranks.

    The same loaders with SafeDDPStrategy count 10 and 2: they are part of the full grid above.
    """
    args = ["--devices", "3", "--sizes", "10,2", "--batch-sizes", "1", "--stages", "test", "--strategy", "ddp"]
    stock = run_eval(tmp_path, "stock", *args)
    assert stock.result is not None, stock.describe()
    assert sample_counts(stock.result["test"]) == [12.0, 3.0]


@pytest.mark.multiprocess
def test_stock_lightning_padding_turns_accuracy_0_9_into_0_9167(tmp_path: Path):
    """README's and docs/evaluation.md's example: 10 test samples, 9 classified right, 3 ranks. One device and
    SafeDDPStrategy report 0.9000 over 10 samples; stock DDPStrategy evaluates 12 (samples 0 and 1 twice) and
    reports 0.9167."""
    results = {}
    for name, args in {
        "one_device": ["--devices", "1"],
        "stock": ["--devices", "3", "--strategy", "ddp"],
        "safe": ["--devices", "3", "--strategy", "safe_ddp"],
    }.items():
        out = tmp_path / f"{name}.json"
        run = run_script([str(SCRIPTS / "padded_accuracy.py"), *args, "--out", str(out)], timeout=180, out=out)
        finished = stock_fit_finished(run) if name == "stock" else run.returncode == 0 and not run.orphans
        assert finished and run.result is not None, run.describe()
        results[name] = run.result
    assert [results[n]["world_size"] for n in ("one_device", "stock", "safe")] == [1, 3, 3]
    assert (results["one_device"]["samples"], f"{results['one_device']['acc']:.4f}") == (10.0, "0.9000")
    assert (results["stock"]["samples"], f"{results['stock']['acc']:.4f}") == (12.0, "0.9167")
    assert (results["safe"]["samples"], f"{results['safe']['acc']:.4f}") == (10.0, "0.9000")


# ---------------------------------------------------------------------------------------------- unit tests
def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _batches(loader: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 13])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_are_dealt_whole_and_interleave_back(world_size: int, n: int, batch_size: int, drop_last: bool):
    single = list(BatchSampler(range(n), batch_size, drop_last))
    shares = [
        list(BatchShardSampler(BatchSampler(range(n), batch_size, drop_last), r, world_size))
        for r in range(4)[:world_size]
    ]
    assert [
        len(BatchShardSampler(BatchSampler(range(n), batch_size, drop_last), r, world_size)) for r in range(world_size)
    ] == [len(share) for share in shares]
    assert interleave_batches(shares) == single
    assert sorted(i for share in shares for batch in share for i in batch) == sorted(i for b in single for i in b)


def test_interleave_rejects_shares_that_are_not_a_round_robin_deal():
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        interleave_batches([[1], [2, 3, 4]])


def test_seeded_permutation_is_the_same_on_every_rank_and_changes_with_the_epoch():
    a, b = SeededPermutationSampler(20, seed=7), SeededPermutationSampler(20, seed=7)
    assert list(a) == list(b) and sorted(a) == list(range(20))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(20))


@pytest.mark.compat
@pytest.mark.parametrize(
    ("make", "ordered"),
    [
        pytest.param(lambda ds: DataLoader(ds, batch_size=3), True, id="sequential"),
        pytest.param(lambda ds: DataLoader(ds, batch_size=3, shuffle=True), False, id="random"),
        pytest.param(lambda ds: DataLoader(ds, batch_size=3, drop_last=True), True, id="drop_last"),
        pytest.param(
            lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, False)),
            False,
            id="batch_sampler",
        ),
        pytest.param(
            lambda ds: DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 3, 0, shuffle=False)),
            True,
            id="user_distributed_sampler",
        ),
        pytest.param(
            lambda ds: DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 3, 0, shuffle=True)),
            False,
            id="user_distributed_sampler_shuffled",
        ),
    ],
)
@pytest.mark.parametrize("predicting", [False, True])
def test_sharded_dataloaders_cover_every_sample_once(make: Any, ordered: bool, predicting: bool):
    dataset = _dataset(11)
    shards = []
    for rank in range(3):
        result = shard_evaluation_dataloader(make(dataset), rank=rank, world_size=3, predicting=predicting, name="x")
        assert result.sharded
        shards.append(_batches(result.dataloader))
    everything = [i for batch in interleave_batches(shards) for i in batch]
    drops = make(dataset).drop_last and not predicting  # devices=1 drops the partial batch; predict never does
    expected = list(range(9)) if drops else list(range(11))
    assert sorted(everything) == expected  # every sample exactly once (random orders: one seeded order for all ranks)
    if ordered:
        assert everything == expected
    if predicting:  # Lightning's index tracking (used by prediction writers) is kept
        wrapped = shard_evaluation_dataloader(make(dataset), rank=0, world_size=3, predicting=True, name="x")
        assert type(wrapped.dataloader.batch_sampler).__name__ == "_IndexBatchSamplerWrapper"


@pytest.mark.compat
def test_iterable_dataset_is_strided_by_rank():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    shares = []
    for rank in range(3):
        result = shard_evaluation_dataloader(
            DataLoader(Stream(), batch_size=2), rank=rank, world_size=3, predicting=False, name="val_dataloader"
        )
        assert result.sharded and isinstance(result.dataloader.dataset, RankStridedIterable)
        assert result.warning is not None and "val_dataloader over the IterableDataset Stream" in result.warning
        shares.append([i for batch in result.dataloader for i in batch.tolist()])
    assert sorted(i for share in shares for i in share) == list(range(10))


@pytest.mark.compat
def test_single_rank_and_non_dataloaders_are_left_alone():
    loader = DataLoader(_dataset(4), batch_size=2)
    assert shard_evaluation_dataloader(loader, rank=0, world_size=1, predicting=False, name="x").dataloader is loader
    batches = [torch.zeros(2)]
    result = shard_evaluation_dataloader(batches, rank=0, world_size=2, predicting=False, name="val_dataloader")
    assert not result.sharded and result.dataloader is batches
    assert result.warning is not None and "val_dataloader is a list, not a DataLoader" in result.warning
    unbatched = DataLoader(_dataset(4), batch_size=None)
    result = shard_evaluation_dataloader(unbatched, rank=0, world_size=2, predicting=False, name="x")
    assert not result.sharded and result.warning is not None and "batch_size=None" in result.warning


def _key(key: str) -> LoggedKey:
    return LoggedKey(
        key, "validation_step", key, True, "mean", False, True, False, True, False, True, None, None, True, False
    )


@pytest.mark.compat
def test_logged_keys_merge_in_one_order_for_every_rank():
    merged = merge_keys([[_key("a"), _key("c")], [], [_key("b"), _key("a")]])
    assert [k.key for k in merged] == ["a", "c", "b"]
