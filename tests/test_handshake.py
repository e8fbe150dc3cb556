"""Check logic of the start-up handshake, with ranks simulated as RankFacts (duplicate GPUs can only be tested so)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ddp_strategy.errors import DuplicateDeviceError, RankDivergenceError, SetupMismatchError
from ddp_strategy.handshake import RankFacts, check_facts, collect_facts, seed_report


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
