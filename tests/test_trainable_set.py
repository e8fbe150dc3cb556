"""Changes of the trainable set after DDP was built (BackboneFinetuning, freezing and unfreezing mid-run).

The multi-process tests run ``tests/scripts/trainable_set.py``: a small transfer-learning model whose backbone
Lightning's ``BackboneFinetuning`` unfreezes at epoch 1 and whose neck a callback freezes and unfreezes later. Under
``SafeDDPStrategy`` (subprocess launcher and spawn, with different DDP options) both ranks end bit-identical and equal
to one device trained on the same global batches; under stock ``DDPStrategy`` each rank trains its own backbone.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ddp_strategy.consistency import Comparison
from ddp_strategy.control import ControlPlane
from ddp_strategy.errors import RankDivergenceError
from ddp_strategy.trainable import TrainableSet, TrainableSetWatcher, agree_on_trainable_set, describe_change
from tests.proc import SCRIPTS, Run, run_script, stock_fit_finished
from tests.test_control import run_agreeing

SCRIPT = str(SCRIPTS / "trainable_set.py")
BACKBONE = [f"backbone.{i}.{kind}" for i in (0, 1, 3) for kind in ("weight", "bias")]
TOLERANCE = 1e-5  # float32 sums in another order; stock DDP is off by about 3e-3


# ---------------------------------------------------------------------------------------------- the local test
def watched() -> tuple[nn.Sequential, TrainableSetWatcher]:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    net[0].requires_grad_(False)
    watcher = TrainableSetWatcher()
    # what the watcher reads of a DDP wrapper: its module and the names DDP ignores
    watcher.track(SimpleNamespace(module=net, parameters_to_ignore={"2.bias"}))  # type: ignore[arg-type]
    return net, watcher


def test_watcher_tells_unfrozen_and_frozen_parameters_and_ignores_what_ddp_ignores():
    net, watcher = watched()
    assert not watcher.changed()
    net[2].bias.requires_grad_(False)  # DDP ignores it: not its business
    assert not watcher.changed()
    net[0].requires_grad_(True)
    net[1].weight.requires_grad_(False)
    assert watcher.changed()
    change = watcher.current()
    assert change == TrainableSet(unfrozen=("0.weight", "0.bias"), frozen=("1.weight",), trainable=4)
    assert describe_change(change) == "now trainable: 0.weight, 0.bias; now frozen: 1.weight"
    net[0].requires_grad_(False)
    net[1].weight.requires_grad_(True)
    assert not watcher.changed()  # back to the set DDP was built with


@pytest.mark.parametrize("torch_loop", [True, False], ids=["torch's loop", "python fallback"])
def test_watcher_tells_one_parameter_of_a_frozen_backbone_unfrozen_and_one_of_the_head_frozen(monkeypatch, torch_loop):
    # the fine-tuning case the test exists for: most parameters frozen when DDP was built, read in one call into torch
    from ddp_strategy._compat import torch as compat

    if not torch_loop:
        monkeypatch.setattr(compat, "_ANY_REQUIRES_GRAD", None)
    backbone = nn.Sequential(*(nn.Linear(2, 2) for _ in range(40))).requires_grad_(False)
    net = nn.Sequential(backbone, nn.Linear(2, 2))
    watcher = TrainableSetWatcher()
    watcher.track(SimpleNamespace(module=net, parameters_to_ignore=set()))  # type: ignore[arg-type]
    assert not watcher.changed()
    backbone[37].bias.requires_grad_(True)
    assert watcher.changed()
    assert watcher.current() == TrainableSet(unfrozen=("0.37.bias",), frozen=(), trainable=3)
    backbone[37].bias.requires_grad_(False)
    net[1].weight.requires_grad_(False)
    assert watcher.changed()
    assert watcher.current() == TrainableSet(unfrozen=(), frozen=("1.weight",), trainable=1)
    net[1].weight.requires_grad_(True)
    assert not watcher.changed()


def test_any_requires_grad_reads_every_tensor_and_none_of_an_empty_list(monkeypatch):
    from ddp_strategy._compat import torch as compat

    frozen = [torch.zeros(2) for _ in range(5)]
    for loop in (compat._ANY_REQUIRES_GRAD, None):
        monkeypatch.setattr(compat, "_ANY_REQUIRES_GRAD", loop)
        assert compat.any_requires_grad([]) is False
        assert compat.any_requires_grad(frozen) is False
        assert compat.any_requires_grad([*frozen, torch.zeros(1, requires_grad=True)]) is True


# ---------------------------------------------------------------------------------------------- agreement (simulated)
def agree(plane: ControlPlane, change: TrainableSet, weight: torch.Tensor | None = None) -> None:
    weights = None
    if weight is not None:
        weights = Comparison([("backbone.0.weight", "parameter", weight)], when="by step 6", name="w")
    agree_on_trainable_set(plane, change, batch=7, step=6, weights=weights)


UNFROZEN = TrainableSet(unfrozen=("backbone.0.weight",), frozen=(), trainable=5)


def test_same_change_on_every_rank_is_agreed_in_one_collective(monkeypatch):
    outcome, _, objects, barriers = run_agreeing(2, monkeypatch, lambda p: agree(p, UNFROZEN, torch.ones(3)))
    assert outcome == {0: None, 1: None}
    assert objects.calls == [1, 1] and barriers == [1, 1]


def test_different_changes_are_listed_per_rank_on_every_rank(monkeypatch):
    other = TrainableSet(unfrozen=("head.weight",), frozen=("neck.0.bias",), trainable=5)
    outcome, _, _, _ = run_agreeing(2, monkeypatch, lambda p: agree(p, UNFROZEN if p.rank == 0 else other))
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, RankDivergenceError) and err.ranks == (1,)
        assert "changed differently on different ranks before training step 6 (batch 7 of this run)" in str(err)
        assert "rank 0: now trainable: backbone.0.weight; now frozen: none" in str(err)
        assert "rank 1: now trainable: head.weight; now frozen: neck.0.bias" in str(err)


def test_weights_that_differ_when_the_set_changes_are_named(monkeypatch):
    def fn(plane: ControlPlane) -> None:
        agree(plane, UNFROZEN, torch.ones(3) + (0.5 if plane.rank == 1 else 0.0))

    outcome, _, _, _ = run_agreeing(2, monkeypatch, fn)
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, RankDivergenceError) and err.tensors == ("backbone.0.weight",)
        assert "parameter 'backbone.0.weight' (max |difference| 0.5) differ on rank(s) 1" in str(err)
        assert "before the DDP wrapper was rebuilt" in str(err)


def test_change_on_one_rank_only_stops_that_rank_within_a_heartbeat(monkeypatch):
    def fn(plane: ControlPlane) -> float:
        start = time.monotonic()
        if plane.rank == 1:
            agree(plane, UNFROZEN)
        else:  # rank 0's test did not fire: it goes on to train batch 7 (and would wait in DDP's all-reduce)
            plane.heartbeat.note_step(6, batch=7)
            time.sleep(2.0)
        return time.monotonic() - start

    outcome, elapsed, _, _ = run_agreeing(2, monkeypatch, fn, timeout=30.0)  # barrier_timeout 30 s
    err = outcome[1]
    assert isinstance(err, RankDivergenceError), err
    assert elapsed.get(1) is None  # it raised ...
    assert "changed on rank 1 before training step 6 (batch 7 of this run; now trainable: backbone.0.weight" in str(err)
    assert "but rank(s) 0 went on training with the parameters DDP was built with" in str(err)
    waited = float(re.search(r"waited ([\d.]+) s", str(err.__cause__)).group(1))  # type: ignore[union-attr]
    assert waited < 2.0  # ... within heartbeats (0.1 s here), not after the 30 s timeout
    assert outcome[0] is None


# ---------------------------------------------------------------------------------------------- real processes
def fit(tmp_path: Path, name: str, *args: str, timeout: float = 180, namespace: str = "lightning") -> tuple[Run, Path]:
    out = tmp_path / name
    return run_script([SCRIPT, "--out", str(out), *args], timeout=timeout, env={"DDP_TEST_NAMESPACE": namespace}), out


def final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)["final"]  # type: ignore[no-any-return]


def initial(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)["initial"]  # type: ignore[no-any-return]


def report(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())  # type: ignore[no-any-return]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str] | None = None) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in (keys or list(a)))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: one device, the same global batches (twice the batch size), the same callbacks."""
    run, out = fit(tmp_path_factory.mktemp("one_device"), "single", "--strategy", "single")
    assert run.returncode == 0 and not run.orphans, run.describe()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "options", "expected"),
    [
        (
            "safe_ddp",
            [
                "--comm-hook",
                "--ddp-option",
                "gradient_as_bucket_view=true",
                "--ddp-option",
                "find_unused_parameters=true",
            ],
            {"static_graph": False, "find_unused_parameters": True, "gradient_as_bucket_view": True},
        ),
        (
            "safe_ddp_spawn",
            ["--ddp-option", "static_graph=true"],
            {"static_graph": True, "find_unused_parameters": False, "gradient_as_bucket_view": False},
        ),
    ],
    ids=["subprocess-bucket_view-unused-comm_hook", "spawn-static_graph-pytorch_lightning"],
)
def test_backbone_finetuning_and_freezing_mid_run_match_one_device(
    tmp_path: Path, one_device: Path, launcher: str, options: list[str], expected: dict[str, bool]
):
    # the spawn run uses the standalone pytorch_lightning package (ddp_strategy.pytorch_lightning), the other lightning
    namespace = "pytorch_lightning" if launcher == "safe_ddp_spawn" else "lightning"
    run, out = fit(tmp_path, launcher, "--strategy", launcher, *options, namespace=namespace)
    assert run.returncode == 0 and not run.timed_out and not run.orphans, run.describe()
    module = "ddp_strategy.pytorch_lightning.strategy" if namespace == "pytorch_lightning" else "ddp_strategy.strategy"
    assert report(out, 0)["strategy_module"] == module
    reference = final(one_device, 0)
    ranks = [final(out, r) for r in (0, 1)]
    for name in reference:
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # every rank holds the same weights, bit for bit
    assert max_diff(ranks[0], reference) < TOLERANCE  # and they are what one device computes on the same batches
    assert max_diff(ranks[0], initial(out, 0), BACKBONE) > 1e-3  # the backbone was trained (after the unfreeze)
    # the set changed three times (backbone unfrozen, neck frozen, neck unfrozen): DDP followed each, with its options
    lines = [line for line in run.output.splitlines() if "the set of trainable parameters changed" in line]
    assert len(lines) == 3, run.describe()
    assert "before training step 6 (now trainable: backbone.0.weight, backbone.0.bias," in lines[0]
    assert "before training step 14 (now trainable: none; now frozen: neck.0.weight, neck.0.bias;" in lines[1]
    assert "before training step 19 (now trainable: neck.0.weight, neck.0.bias; now frozen: none;" in lines[2]
    for rank in (0, 1):
        seen = report(out, rank)
        assert seen["trainable_set_changes"] == 3 and seen["global_step"] == 24
        assert seen["ddp_options"] == expected
        assert seen["param_group_lrs"] == report(one_device, 0)["param_group_lrs"]  # BackboneFinetuning's groups
        if "--comm-hook" in options:  # the hook registered at fit start all-reduced every step of every epoch
            assert seen["comm_hook_calls"] == {"0": 6, "1": 6, "2": 6, "3": 6}


@pytest.mark.multiprocess
def test_stock_ddp_trains_a_separate_backbone_on_every_rank(tmp_path: Path, one_device: Path):
    options = ["--ddp-option", "gradient_as_bucket_view=true", "--ddp-option", "find_unused_parameters=true"]
    run, out = fit(tmp_path, "stock", "--strategy", "ddp", *options)
    assert stock_fit_finished(run), run.describe()  # no error, no warning
    ranks = [final(out, r) for r in (0, 1)]
    assert max_diff(ranks[0], ranks[1], BACKBONE) > 1e-3  # the unfrozen backbone's gradients were never all-reduced
    assert max_diff(ranks[0], ranks[1], ["head.weight", "head.bias"]) == 0.0  # the head's were
    assert min(max_diff(rank, final(one_device, 0)) for rank in ranks) > 1e-3  # neither rank is the model trained


@pytest.mark.multiprocess
def test_requires_grad_changed_on_one_rank_only_is_named_within_seconds(tmp_path: Path):
    run, _ = fit(tmp_path, "flip", "--scenario", "local_flip", "--barrier-timeout", "120")
    assert run.returncode != 0 and not run.timed_out and not run.orphans, run.describe()
    assert (
        "[rank1]: ddp_strategy.errors.RankDivergenceError: The set of trainable parameters changed on rank 1 before "
        "training step 8 (batch 9 of this run; now trainable: none; now frozen: neck.0.bias), but rank(s) 0 went on "
        "training with the parameters DDP was built with"
    ) in run.output, run.describe()
    waited = float(re.search(r"Rank 1 waited ([\d.]+) s at barrier 'trainable-set:batch-9'", run.output).group(1))  # type: ignore[union-attr]
    assert waited < 10  # not the 120 s barrier timeout
    # rank 0, waiting in DDP's all-reduce for rank 1, stops when rank 1 exits and names rank 1's error
    assert "The first failure was on another rank: rank 1 failed with RankDivergenceError" in run.output
