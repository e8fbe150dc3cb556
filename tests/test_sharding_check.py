"""ShardingCheck: fingerprints, the comparison and its cause sentences with simulated ranks, and real runs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset

from ddp_strategy.callbacks import ShardingCheck, ensure_sharding_check
from ddp_strategy.callbacks.sharding_check import (
    BatchReport,
    LoaderFacts,
    analyse,
    batch_fingerprint,
    batch_indices,
    describe_loader,
)
from ddp_strategy.errors import ShardingError
from tests.proc import run_scenario

# ------------------------------------------------------------------------------------------- fingerprints


def test_batch_fingerprint_is_bit_exact_and_follows_structure():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    y = torch.tensor([0, 1, 0])
    assert batch_fingerprint((x, y)) == batch_fingerprint((x.clone(), y.clone()))
    changed = x.clone()
    changed[2, 3] += 1e-6
    assert batch_fingerprint((changed, y)) != batch_fingerprint((x, y))
    assert batch_fingerprint((y, x)) != batch_fingerprint((x, y))  # structure counts
    assert batch_fingerprint({"x": x, "ids": ["a", "b", "c"]}) != batch_fingerprint({"x": x, "ids": ["a", "b", "d"]})
    assert batch_fingerprint(x.to(torch.float64)) != batch_fingerprint(x)  # dtype counts


def test_batch_fingerprint_of_opaque_objects_is_unknown():
    class Opaque:
        pass

    assert batch_fingerprint([Opaque(), Opaque()]) is None


def dataset(n: int = 10, constant: bool = False) -> TensorDataset:
    x = torch.ones(n, 3) if constant else torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return TensorDataset(x)


def test_batch_indices_follow_the_distributed_sampler_without_side_effects():
    ds = dataset(10)
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        loader = DataLoader(ds, batch_size=2, sampler=sampler)
        state = torch.get_rng_state()
        predicted = [batch_indices(loader, i) for i in range(3)]
        assert torch.equal(state, torch.get_rng_state())  # no random numbers drawn
        actual = list(loader.batch_sampler)
        assert predicted == actual[:3]


def test_batch_indices_of_a_sequential_sampler_and_unknown_otherwise():
    ds = dataset(10)
    assert batch_indices(DataLoader(ds, batch_size=4), 1) == [4, 5, 6, 7]
    state = torch.get_rng_state()
    assert batch_indices(DataLoader(ds, batch_size=4, shuffle=True), 0) is None  # would consume the global RNG
    assert torch.equal(state, torch.get_rng_state())

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert batch_indices(DataLoader(Stream()), 0) is None


def test_describe_loader():
    ds = dataset(10)
    facts = describe_loader(DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=4, rank=3, seed=9)))
    assert (facts.distributed, facts.num_replicas, facts.rank, facts.seed, facts.shuffle) == (True, 4, 3, 9, True)
    g = torch.Generator().manual_seed(7)
    facts = describe_loader(DataLoader(ds, sampler=RandomSampler(ds, generator=g)))
    assert (facts.sampler, facts.generator_seed, facts.distributed) == ("RandomSampler", 7, False)
    assert describe_loader([1, 2, 3]).iterable


# ------------------------------------------------------------------------------------------- analysis

RANDOM = LoaderFacts(
    kind="DataLoader", dataset="TensorDataset", sampler="RandomSampler", batch_sampler="BatchSampler", shuffle=True
)
SEQUENTIAL = dataclasses.replace(RANDOM, sampler="SequentialSampler")


def dist_facts(rank: int, num_replicas: int = 2, seed: int = 0) -> LoaderFacts:
    return dataclasses.replace(
        RANDOM,
        sampler="DistributedSampler",
        distributed=True,
        num_replicas=num_replicas,
        rank=rank,
        seed=seed,
        shuffle=True,
    )


def report(rank: int, loader: LoaderFacts, data: tuple[Any, ...], indices: tuple[Any, ...] = (None, None), **kw: Any):
    return BatchReport(
        rank=rank,
        use_distributed_sampler=kw.get("use_distributed_sampler", False),
        global_seed="1234",
        loaders=(loader,),
        data=data,
        indices=indices,
    )


def test_different_batches_pass():
    assert analyse([report(0, RANDOM, ("a", "b")), report(1, RANDOM, ("c", "d"))], 2) is None


def test_one_equal_batch_of_two_is_not_a_duplicate():
    assert analyse([report(0, RANDOM, ("a", "b")), report(1, RANDOM, ("a", "d"))], 2) is None


def test_no_distributed_sampler_names_the_flag_and_the_global_rng():
    finding = analyse([report(0, RANDOM, ("a", "b")), report(1, RANDOM, ("a", "b"))], 2)
    assert finding is not None and finding.duplicates == ((0, 1),) and finding.ranks == (0, 1)
    assert "use_distributed_sampler=False" in finding.cause and "global RNG (PL_GLOBAL_SEED=1234" in finding.cause
    assert "remove use_distributed_sampler=False" in finding.message
    assert "coincidence" not in finding.message  # a plain RandomSampler never shards: no doubt to mention


def test_identical_generator_seed_is_named():
    seeded = dataclasses.replace(RANDOM, generator_seed=7)
    finding = analyse([report(0, seeded, ("a", "b")), report(1, seeded, ("a", "b"))], 2)
    assert finding is not None and "generator has the same seed (7) on every rank" in finding.cause


def test_only_the_identical_ranks_are_named():
    reports = [report(0, RANDOM, ("a", "b")), report(1, RANDOM, ("c", "d")), report(2, RANDOM, ("a", "b"))]
    finding = analyse(reports, 3)
    assert finding is not None and finding.duplicates == ((0, 2),)
    assert finding.message.startswith("ShardingCheck: ranks 0, 2 received identical training batches")


def test_correct_distributed_samplers_never_alarm_even_with_identical_data_and_indices():
    # A constant dataset, or a dataset smaller than the world size (DistributedSampler pads with repeats).
    reports = [report(r, dist_facts(r), ("same", "same"), ("i0", "i0")) for r in range(2)]
    assert analyse(reports, 2) is None


def test_equal_data_with_different_known_indices_is_a_coincidence():
    reports = [
        report(0, SEQUENTIAL, ("same", "same"), ("i0", "i1")),
        report(1, SEQUENTIAL, ("same", "same"), ("i2", "i3")),
    ]
    assert analyse(reports, 2) is None


def test_equal_indices_with_different_data_is_a_dataset_sharded_by_rank():
    reports = [report(0, SEQUENTIAL, ("a", "b"), ("i0", "i1")), report(1, SEQUENTIAL, ("c", "d"), ("i0", "i1"))]
    assert analyse(reports, 2) is None


def test_same_indices_are_named_when_known():
    reports = [report(r, SEQUENTIAL, ("a", "b"), ("i0", "i1")) for r in range(2)]
    finding = analyse(reports, 2)
    assert finding is not None and "the same data and the same sample indices" in finding.message
    assert "SequentialSampler" in finding.cause


def test_unfingerprintable_batches_are_never_duplicates():
    assert analyse([report(0, RANDOM, (None, None)), report(1, RANDOM, (None, None))], 2) is None


def test_rank_independent_distributed_sampler_arguments():
    reports = [report(r, dist_facts(0, num_replicas=1), ("a", "b")) for r in range(2)]
    finding = analyse(reports, 2)
    assert finding is not None and finding.duplicates == ((0, 1),)
    assert "num_replicas=1, rank=0" in finding.cause
    assert "num_replicas 1 on rank(s) 0-1 but the world size is 2" in finding.message
    assert "the same sampler rank on several ranks (rank=0 on ranks 0-1)" in finding.message


def test_per_rank_sampler_seeds_make_overlapping_shards():
    reports = [report(r, dist_facts(r, seed=r), ("a", "b") if r == 0 else ("c", "d")) for r in range(2)]
    finding = analyse(reports, 2)
    assert finding is not None and finding.duplicates == ()
    assert "different seeds on different ranks (0 on rank(s) 0; 1 on rank(s) 1)" in finding.message
    assert "shards overlap" in finding.cause


def test_iterable_dataset_cause_mentions_the_possible_coincidence():
    stream = LoaderFacts(kind="DataLoader", dataset="Stream", iterable=True)
    finding = analyse([report(r, stream, ("a", "b"), use_distributed_sampler=True) for r in range(2)], 2)
    assert finding is not None and "IterableDataset (Stream)" in finding.cause and "islice" in finding.message
    assert "coincidence" in finding.message


def test_custom_sampler_kept_by_lightning():
    custom = dataclasses.replace(RANDOM, sampler="MySampler", batch_sampler="MyBatchSampler")
    finding = analyse([report(r, custom, ("a", "b"), use_distributed_sampler=True) for r in range(2)], 2)
    assert finding is not None
    assert "a MySampler under a MyBatchSampler, which Lightning did not replace" in finding.cause
    assert "ShardingCheck(on_duplicate='warn')" in finding.message


# ------------------------------------------------------------------------------------------- callback


class FakeControl:
    """Rank 1 reports ``other_data``; rank 0 is this process."""

    def __init__(self, other_data: tuple[str | None, ...] | None = None) -> None:
        self.other_data = other_data
        self.names: list[str] = []

    def all_gather_object(self, obj: BatchReport, name: str) -> list[BatchReport]:
        self.names.append(name)
        other = obj if self.other_data is None else dataclasses.replace(obj, data=self.other_data)
        return [obj, dataclasses.replace(other, rank=1)]


def fake_trainer(control: Any, world_size: int = 2) -> Any:
    ds = dataset(16)
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    return SimpleNamespace(
        world_size=world_size,
        global_rank=0,
        is_global_zero=True,
        strategy=SimpleNamespace(control_plane=control),
        fit_loop=SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[loader])),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        callbacks=[],
    )


def run_batches(check: ShardingCheck, trainer: Any, n: int) -> None:
    check.on_train_start(trainer, None)
    for i in range(n):
        check.on_train_batch_start(trainer, None, (torch.full((4, 3), float(i)),), i)


def test_raise_mode_raises_after_the_configured_batches_and_gathers_once():
    control = FakeControl()
    check = ShardingCheck(batches=3)
    trainer = fake_trainer(control)
    with pytest.raises(ShardingError) as info:
        run_batches(check, trainer, 3)
    assert control.names == ["sharding-check"]
    assert info.value.ranks == (0, 1) and "use_distributed_sampler=False" in info.value.cause
    check.on_train_batch_start(trainer, None, (torch.zeros(1),), 3)  # nothing more afterwards
    assert control.names == ["sharding-check"]


def test_warn_mode_warns_and_later_batches_cost_nothing():
    control = FakeControl()
    check = ShardingCheck(batches=2, on_duplicate="warn")
    trainer = fake_trainer(control)
    with pytest.warns(UserWarning, match="ShardingCheck: ranks 0-1 received identical training batches"):
        run_batches(check, trainer, 2)
    check.on_train_batch_start(trainer, None, (torch.zeros(1),), 2)
    assert control.names == ["sharding-check"] and check.compared and check.finding is not None


def test_different_batches_report_nothing():
    control = FakeControl(other_data=("x", "y"))
    check = ShardingCheck(batches=2)
    run_batches(check, fake_trainer(control), 2)
    assert check.compared and check.finding is None and control.names == ["sharding-check"]


def test_short_training_is_compared_at_its_end():
    control = FakeControl()
    check = ShardingCheck(batches=5, on_duplicate="warn")
    trainer = fake_trainer(control)
    run_batches(check, trainer, 1)
    assert control.names == []
    with pytest.warns(UserWarning, match="first 1 batch"):
        check.on_train_end(trainer, None)
    assert control.names == ["sharding-check"]


def test_single_process_does_nothing():
    control = FakeControl()
    check = ShardingCheck()
    run_batches(check, fake_trainer(control, world_size=1), 3)
    check.on_train_end(fake_trainer(control, world_size=1), None)
    assert control.names == [] and not check.compared


def test_without_control_plane_or_process_group_the_error_says_so():
    check = ShardingCheck()
    with pytest.raises(RuntimeError, match="neither SafeDDPStrategy's control plane nor an initialised"):
        run_batches(check, fake_trainer(None), 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"batches": 0}, "`batches` must be a positive integer, got 0"), ({"on_duplicate": "ignore"}, "'ignore'")],
)
def test_arguments_are_validated(kwargs: dict[str, Any], match: str):
    with pytest.raises(ValueError, match=match):
        ShardingCheck(**kwargs)


def test_ensure_sharding_check_adds_one_unless_present():
    trainer = fake_trainer(None)
    added = ensure_sharding_check(trainer, "warn")
    assert trainer.callbacks == [added] and added.on_duplicate == "warn"
    assert ensure_sharding_check(trainer) is added and len(trainer.callbacks) == 1
    mine = ShardingCheck(batches=5)
    trainer.callbacks = [mine]
    assert ensure_sharding_check(trainer) is mine


# ------------------------------------------------------------------------------------------- real runs


def _ok(run: Any) -> dict[str, Any]:
    assert run.returncode == 0 and not run.orphans, run.describe()
    assert run.result is not None, run.describe()
    return dict(run.result["sharding_check"])


@pytest.mark.multiprocess
def test_no_distributed_sampler_raises_on_every_rank(tmp_path):
    run = run_scenario(
        "fit_ok", tmp_path, "--sharding-check", "raise", "--no-distributed-sampler", "--max-epochs", "1", timeout=90
    )
    assert run.returncode != 0 and not run.orphans and not run.timed_out, run.describe()
    assert "ShardingError: ShardingCheck: ranks 0-1 received identical training batches" in run.output
    assert (
        "Trainer(use_distributed_sampler=False) is set and the training DataLoader uses a RandomSampler" in run.output
    )
    assert run.output.count("ShardingError: ShardingCheck:") == 2, run.describe()  # raised on both ranks


@pytest.mark.multiprocess
def test_no_distributed_sampler_warns_in_warn_mode(tmp_path):
    run = run_scenario(
        "fit_ok", tmp_path, "--sharding-check", "warn", "--no-distributed-sampler", "--max-epochs", "1", timeout=90
    )
    result = _ok(run)
    assert result["compared"] and result["data_equal"] and "use_distributed_sampler=False" in result["finding"]
    assert run.output.count("UserWarning: ShardingCheck: ranks 0-1 received identical") == 1, run.describe()


@pytest.mark.multiprocess
def test_correct_run_reports_nothing(tmp_path):
    run = run_scenario("fit_ok", tmp_path, "--sharding-check", "raise", "--max-epochs", "1", timeout=90)
    result = _ok(run)
    assert result == {
        "compared": True,
        "finding": None,
        "data_equal": False,
        "indices_equal": False,
        "indices_known": True,
    }
    assert "ShardingCheck" not in run.output


@pytest.mark.multiprocess
def test_user_distributed_sampler_on_constant_data_is_no_false_alarm(tmp_path):
    # DistributedSampler(ds) built by rank-independent code, use_distributed_sampler=False, every sample alike:
    # the batches are bit-identical on both ranks, but the sampler shards correctly.
    run = run_scenario(
        "fit_ok",
        tmp_path,
        *("--sharding-check", "raise", "--user-sampler", "--no-distributed-sampler", "--constant-data"),
        *("--max-epochs", "1"),
        timeout=90,
    )
    result = _ok(run)
    assert result["compared"] and result["finding"] is None
    assert result["data_equal"] and result["indices_known"] and not result["indices_equal"]


@pytest.mark.multiprocess
def test_dataset_smaller_than_the_world_is_no_false_alarm(tmp_path):
    # One sample for two ranks: Lightning's DistributedSampler gives both rank sample 0 (padding). One batch per
    # epoch and one epoch: the comparison runs at the end of training.
    run = run_scenario(
        "fit_ok", tmp_path, "--sharding-check", "raise", "--train-size", "1", "--max-epochs", "1", timeout=90
    )
    result = _ok(run)
    assert result["compared"] and result["finding"] is None and run.result is not None
    assert run.result["global_step"] == 1
    assert result["data_equal"] and result["indices_equal"] and result["indices_known"]


@pytest.mark.multiprocess
def test_sampler_seed_per_rank_is_reported(tmp_path):
    run = run_scenario(
        "fit_ok", tmp_path, "--sharding-check", "warn", "--sampler-seed-per-rank", "--max-epochs", "1", timeout=90
    )
    result = _ok(run)
    assert not result["data_equal"] and result["finding"] is not None
    assert "uses different seeds on different ranks (0 on rank(s) 0; 1 on rank(s) 1)" in result["finding"]


@pytest.mark.multiprocess
def test_mismatched_sampler_seeds_are_named_when_resuming_mid_epoch(tmp_path):
    # issue 20: a mid-epoch resume wraps the training sampler; the handshake still compares the ranks' seeds
    ckpt = tmp_path / "ckpt"
    opts = ["--sampler-seed-per-rank", "--ckpt-dir", str(ckpt), "--every-n-train-steps", "3"]
    first = run_scenario("fit_ok", tmp_path, *opts, "--max-steps", "3", "--max-epochs", "2", timeout=90)
    assert first.returncode == 0 and not first.orphans, first.describe()
    again = run_scenario("fit_ok", tmp_path, *opts, "--resume", "last", "--max-epochs", "1", timeout=90)
    assert again.returncode == 0 and not again.orphans, again.describe()
    assert "Restored all states from the checkpoint" in again.output
    assert "no shuffling DistributedSampler" not in again.output
    table = "Ranks use different training DistributedSampler seeds (0 on rank(s) 0; 1 on rank(s) 1)"
    assert table in again.output, again.describe()


@pytest.mark.multiprocess
def test_stock_ddp_strategy_uses_the_default_group(tmp_path):
    run = run_scenario(
        "fit_ok",
        tmp_path,
        *("--strategy", "ddp", "--sharding-check", "raise", "--no-distributed-sampler", "--max-epochs", "1"),
        timeout=90,
    )
    assert run.returncode != 0 and not run.orphans and not run.timed_out, run.describe()
    assert "ShardingError: ShardingCheck: ranks 0-1 received identical training batches" in run.output


@pytest.mark.multiprocess
def test_safe_ddp_strategy_checks_sharding_by_default(tmp_path):
    # no ShardingCheck added by the user: SafeDDPStrategy(sharding_check="warn") adds one
    run = run_scenario("fit_ok", tmp_path, "--no-distributed-sampler", "--max-epochs", "1", timeout=90)
    result = _ok(run)
    assert result["compared"] and "use_distributed_sampler=False" in result["finding"]
    assert run.output.count("UserWarning: ShardingCheck: ranks 0-1 received identical") == 1, run.describe()
