"""Check logic of the start-up handshake, with ranks simulated as RankFacts (duplicate GPUs can only be tested so)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_strategy.errors import DuplicateDeviceError, RankDivergenceError, SetupMismatchError
from ddp_strategy.handshake import (
    RankFacts,
    check_facts,
    collect_facts,
    sampler_seeds,
    seed_report,
    seed_summary,
    train_sampler_seeds,
)
from ddp_strategy.options import default_option_text


def facts_for(world_size: int, module: nn.Module | None = None, overrides: dict | None = None) -> list[RankFacts]:
    overrides = overrides or {}
    module = module or nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    base = collect_facts(
        rank=0, local_rank=0, node_rank=0, world_size=world_size, device=torch.device("cpu"), module=module
    )
    return [
        dataclasses.replace(base, rank=r, local_rank=r, pid=1000 + r, **overrides.get(r, {})) for r in range(world_size)
    ]


def test_consistent_ranks_pass():
    check_facts(facts_for(4))


def test_cpu_ranks_may_share_the_cpu():
    facts = facts_for(2)
    assert all(f.device == "cpu" and f.device_id is None for f in facts)
    check_facts(facts)


def test_duplicate_gpu_names_ranks_host_and_device():
    gpu = {"device": "cuda:0", "device_id": "cuda-uuid:GPU-1234", "host": "node7"}
    other = {"device": "cuda:1", "device_id": "cuda-uuid:GPU-5678", "host": "node7"}
    facts = facts_for(3, overrides={0: gpu, 1: other, 2: gpu})
    with pytest.raises(DuplicateDeviceError) as info:
        check_facts(facts)
    err = info.value
    assert err.ranks == (0, 2) and err.device == "cuda:0" and err.host == "node7"
    assert "rank 0" in str(err) and "rank 2" in str(err) and "node7" in str(err)
    assert "Duplicate GPU detected" in str(err)


def test_same_device_index_on_different_hosts_is_fine():
    facts = facts_for(
        2,
        overrides={
            0: {"device": "cuda:0", "device_id": "cuda-uuid:A", "host": "a"},
            1: {"device": "cuda:0", "device_id": "cuda-uuid:B", "host": "b"},
        },
    )
    check_facts(facts)


def test_version_and_world_size_mismatch_table():
    base = facts_for(1)[0]
    facts = facts_for(
        4,
        overrides={
            2: {"versions": {**base.versions, "torch": "2.0.0"}},
            3: {"versions": {**base.versions, "torch": "2.0.0"}, "world_size": 8},
        },
    )
    with pytest.raises(SetupMismatchError) as info:
        check_facts(facts)
    text = str(info.value)
    assert set(info.value.fields) == {"torch", "world_size"}
    assert "2.0.0" in text and "2-3" in text and "0-1" in text
    assert "constraints" in text


@pytest.mark.parametrize("field", ["python", "torch", "lightning", "ddp_strategy"])
def test_each_compared_version_is_a_field_of_the_table(field):
    """Every version the handshake collects is compared: one differing rank names that field, its values and ranks."""
    base = facts_for(1)[0]
    key = next(k for k in base.versions if k == field or (field == "lightning" and "lightning" in k))
    facts = facts_for(3, overrides={2: {"versions": {**base.versions, key: "0.0.other"}}})
    with pytest.raises(SetupMismatchError) as info:
        check_facts(facts)
    assert list(info.value.fields) == [key]
    assert re.search(rf"{re.escape(key)} +{re.escape(base.versions[key])} +0-1\n +0\.0\.other +2", str(info.value))


def test_strategy_options_that_differ_are_rows_of_the_table_with_the_default_named():
    """The options every rank must be given alike (``SafeDDPStrategy.agreed_options``): rank 2 left SIGTERM to
    Lightning, rank 3 gave DDP another bucket size; an option a rank does not list is at its default there."""
    facts = facts_for(
        4,
        overrides={
            2: {"options": {"preemption_signals": "None"}},
            3: {"options": {"bucket_cap_mb": "1"}},
        },
    )
    with pytest.raises(SetupMismatchError) as info:
        check_facts(facts)
    text = str(info.value)
    assert list(info.value.fields) == ["option bucket_cap_mb", "option preemption_signals"]
    bucket_default = re.escape(default_option_text("bucket_cap_mb"))
    assert re.search(rf"option bucket_cap_mb +{bucket_default} \(default\) +0-2\n +1 +3\n", text), text
    assert re.search(r"option preemption_signals +\(SIGTERM,\) \(default\) +0-1, 3\n +None +2\n", text), text
    assert "give every rank the same strategy arguments" in text


def test_the_same_options_on_every_rank_pass():
    facts = facts_for(
        3, overrides={r: {"options": {"weight_check": "5", "process_group_backend": "gloo"}} for r in range(3)}
    )
    check_facts(facts)


def test_parameter_shape_mismatch_names_tensor():
    a = facts_for(2)
    other = collect_facts(
        rank=1,
        local_rank=1,
        node_rank=0,
        world_size=2,
        device=torch.device("cpu"),
        module=nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)),
    )
    with pytest.raises(SetupMismatchError) as info:
        check_facts([a[0], other])
    assert "'0.weight': rank 0 has parameter [3, 4]" in str(info.value)
    assert "rank 1 has parameter [5, 4]" in str(info.value)


def test_missing_and_extra_tensors_are_listed():
    a = collect_facts(
        rank=0, local_rank=0, node_rank=0, world_size=2, device=torch.device("cpu"), module=nn.Linear(2, 2)
    )
    b = collect_facts(
        rank=1,
        local_rank=1,
        node_rank=0,
        world_size=2,
        device=torch.device("cpu"),
        module=nn.Linear(2, 2, bias=False),
    )
    with pytest.raises(SetupMismatchError, match="rank 1 lacks 1 tensor\\(s\\) of rank 0: 'bias'"):
        check_facts([a, b])


def test_value_divergence_names_first_tensor_and_rank():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    facts = facts_for(3, module=model)
    with torch.no_grad():
        model[1].running_mean += 1
    changed = collect_facts(rank=2, local_rank=2, node_rank=0, world_size=3, device=torch.device("cpu"), module=model)
    with pytest.raises(RankDivergenceError) as info:
        check_facts([facts[0], facts[1], changed])
    assert info.value.tensors == ("1.running_mean",)
    assert info.value.ranks == (2,)
    assert "buffer '1.running_mean'" in str(info.value)


def test_seed_report():
    assert seed_report(facts_for(2, overrides={0: {"seed": "1"}, 1: {"seed": "1"}})) is None
    text = seed_report(facts_for(3, overrides={0: {"seed": "1"}, 1: {"seed": "1"}, 2: {"seed": None}}))
    assert text is not None and "not set on rank(s) 2" in text and "1 on rank(s) 0-1" in text


# ------------------------------------------------------------------ seed report: global seed vs. sampler seed


def seeded(world_size: int, seed: str | None, samplers: dict[int, tuple[int, ...] | None]) -> list[RankFacts]:
    return facts_for(world_size, overrides={r: {"seed": seed, "sampler_seeds": samplers[r]} for r in range(world_size)})


def test_collect_facts_records_sampler_seeds():
    kw = {"rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1, "device": torch.device("cpu"), "module": None}
    assert collect_facts(**kw).sampler_seeds is None  # the strategy passed nothing: unknown
    assert collect_facts(**kw, sampler_seeds=[7, 8]).sampler_seeds == (7, 8)


def test_seeds_that_agree_give_no_warning_and_one_summary_line():
    facts = seeded(2, "1234", {0: (1234,), 1: (1234,)})
    assert seed_report(facts) is None
    assert seed_summary(facts) == (
        "ddp_strategy: seeds agree on all 2 rank(s): global seed 1234, training DistributedSampler seed 1234."
    )


def test_no_summary_before_the_training_dataloader_is_known():
    facts = seeded(2, "1234", {0: None, 1: None})  # e.g. the handshake of the sanity-check validation
    assert seed_report(facts) is None and seed_summary(facts) is None


def test_sampler_seeds_differing_between_ranks_warn():
    facts = seeded(3, "1234", {0: (0,), 1: (1,), 2: (2,)})
    text = seed_report(facts)
    assert text is not None and seed_summary(facts) is None
    assert "different training DistributedSampler seeds (0 on rank(s) 0; 1 on rank(s) 1; 2 on rank(s) 2)" in text
    assert "shards overlap" in text


def test_sampler_seed_other_than_the_global_seed_warns():
    text = seed_report(seeded(2, "1234", {0: (0,), 1: (0,)}))
    assert text is not None
    assert "DistributedSampler seed (0) differs from the global seed (1234) on all 2 ranks" in text
    assert "seed=int(os.environ['PL_GLOBAL_SEED'])" in text


def test_unseeded_run_with_one_sampler_seed_is_fine():
    facts = seeded(2, None, {0: (0,), 1: (0,)})
    assert seed_report(facts) is None
    assert seed_summary(facts) == (
        "ddp_strategy: seeds agree on all 2 rank(s): global seed not set, training DistributedSampler seed 0."
    )


def test_no_shuffling_sampler_and_both_problems_together():
    assert seed_summary(seeded(2, "5", {0: (), 1: ()})) == (
        "ddp_strategy: seeds agree on all 2 rank(s): global seed 5, no shuffling DistributedSampler."
    )
    facts = facts_for(2, overrides={0: {"seed": "1", "sampler_seeds": (1,)}, 1: {"seed": "2", "sampler_seeds": (2,)}})
    text = seed_report(facts)
    assert text is not None and "different global seeds" in text and "different training DistributedSampler" in text


def test_sampler_seeds_of_dataloaders():
    ds = TensorDataset(torch.zeros(8, 1))
    loaders = [
        DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0, seed=5)),
        DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False, seed=6)),  # no effect
        DataLoader(ds, shuffle=True),
        [1, 2],
    ]
    assert sampler_seeds(loaders) == (5,)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(_combined_loader=SimpleNamespace(flattened=loaders)))
    assert train_sampler_seeds(trainer) == (5,)
    assert train_sampler_seeds(SimpleNamespace(fit_loop=SimpleNamespace(_combined_loader=None))) is None
    assert train_sampler_seeds(None) is None


def test_sampler_seeds_look_through_the_mid_epoch_resume_sampler():
    # issue 20: on a mid-epoch resume the training sampler is wrapped (ResumeSampler); its seed must still be seen,
    # or the seed agreement check is silently off in every resumed run
    from ddp_strategy.sampling import ResumeSampler

    ds = TensorDataset(torch.zeros(8, 1))
    wrapped = ResumeSampler(DistributedSampler(ds, num_replicas=2, rank=0, seed=7), skip=2)
    assert sampler_seeds([DataLoader(ds, sampler=wrapped)]) == (7,)
    assert sampler_seeds([DataLoader(ds, batch_size=2, sampler=ResumeSampler(wrapped, skip=0))]) == (7,)
