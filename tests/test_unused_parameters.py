"""Parameters that take no part in the loss under DDP's find_unused_parameters=False (issue 29, point 2): named by
module path on every rank, with the fix that keeps SafeDDPStrategy, at the first step where it can be known; stock
Lightning beside it. The runs are tests/scripts/unused_params.py (2 CPU ranks, Lightning's subprocess launcher)."""

from __future__ import annotations

import multiprocessing
import os
import re

import pytest
import torch
from torch import nn

from ddp_strategy.errors import UnusedParametersError
from ddp_strategy.unused_parameters import UnusedParameterCheck, reducer_parameter_names, unused_parameters_message
from tests.proc import SCRIPTS, Run, free_port, run_script

AUX = "aux_head.weight, aux_head.bias"


def unused_run(*options: str, strategy: str = "safe_ddp") -> Run:
    return run_script([str(SCRIPTS / "unused_params.py"), "--strategy", strategy, *options], timeout=150)


def error_lines(run: Run, error: str) -> dict[int, str]:
    """Each rank's line of the uncaught ``error`` (torch prefixes a rank's traceback lines with ``[rank<r>]: ``)."""
    found = re.findall(rf"^\[rank(\d)\]: (?:ddp_strategy\.errors\.)?{error}: (.*)$", run.output, re.M)
    return {int(rank): text for rank, text in found}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_stock_names_no_parameter_and_advises_replacing_the_strategy():
    run = unused_run(strategy="ddp")
    lines = error_lines(run, "RuntimeError")
    assert sorted(lines) == [0, 1], run.describe()
    for text in lines.values():
        assert "aux_head" not in text and "strategy='ddp_find_unused_parameters_true'" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_layer_never_in_the_loss_is_named_on_every_rank_after_the_first_backward():
    run = unused_run()
    assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    lines = error_lines(run, "UnusedParametersError")
    assert sorted(lines) == [0, 1], run.describe()
    for text in lines.values():
        assert f"at step 1 (after the first backward) on every rank: {AUX}." in text
        assert "SafeDDPStrategy(find_unused_parameters=True)" in text and "SafeDDPStrategy(static_graph=True)" in text
        assert "ddp_find_unused_parameters_true" not in text  # Lightning's hint replaces the strategy
    assert "first failure was on another rank" not in run.output  # every rank found it itself (issue 29, point 3)
    assert "Expected to have finished reduction" not in run.output  # named before DDP's next forward


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_layer_that_drops_out_of_the_loss_later_is_named_from_ddps_error():
    """aux_head is in the loss at step 1 only: DDP raises at step 3's forward; every rank names its parameters."""
    run = unused_run("--unused-from-step", "1")
    assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    lines = error_lines(run, "UnusedParametersError")
    assert sorted(lines) == [0, 1], run.describe()
    for rank, text in lines.items():
        assert f"at step 2 (DDP found it at the next step's forward) on rank(s) {rank}: {AUX}." in text
    assert "first failure was on another rank" not in run.output


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_replicas_that_diverged_for_it_name_the_parameters_as_the_cause():
    """aux_head leaves the loss at step 4, the epoch's last: the epoch-end weight agreement sees the replicas differ
    before DDP's next forward, and names the parameters without a gradient as the most likely cause."""
    run = unused_run("--unused-from-step", "3")
    lines = error_lines(run, "RankDivergenceError")
    assert sorted(lines) == [0, 1], run.describe()
    for text in lines.values():
        assert text.startswith("Model replicas diverged by step 4 (end of training epoch 0)")
        assert f"The most likely cause: on this rank, {AUX} had no gradient in the last backward" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fix", ["--find-unused", "--static-graph"])
def test_the_fixes_the_error_names_let_the_run_finish(fix):
    run = unused_run(fix)
    assert run.returncode == 0 and "FINISHED step=8" in run.output, run.describe()


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.unused_inner = nn.Linear(3, 3)


class _Model(nn.Module):
    """Nested modules, a frozen layer, a parameter shared by two modules and one DDP ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)
        self.block = _Nested()
        self.tied = nn.Linear(3, 3)
        self.block.tied = self.tied  # the same parameters under a second name
        self.ignored = nn.Linear(3, 3)
        self.last = nn.Linear(3, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.last(self.tied(self.block.inner(self.first(self.frozen(x))))) * 1.0


def _names_ddp_reports(port: int) -> tuple[list[str], list[str], list[str]]:
    """One gloo rank: DDP's own names of the unused parameters (TORCH_DISTRIBUTED_DEBUG=INFO), the names that
    reducer_parameter_names gives DDP's indices, and the ones the first-backward check finds."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.set_debug_level_from_env()
    try:
        model = _Model()
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["ignored.weight", "ignored.bias"])
        ddp = DistributedDataParallel(model)
        ddp(torch.randn(2, 3)).sum().backward()
        found = [name for name, param in reducer_parameter_names(ddp) if param.grad is None]
        try:
            ddp(torch.randn(2, 3))
        except RuntimeError as err:
            text = str(err)
        reported = re.search(r"Parameters which did not receive grad for rank 0: (.*)", text)
        indices = re.search(r"Parameter indices which did not receive grad for rank 0: ([\d ]+)", text)
        assert reported is not None and indices is not None, text
        names = reducer_parameter_names(ddp)
        mapped = [names[int(i)][0] for i in indices.group(1).split()]
        # DDP writes a parameter of the root module as ".scale"; named_parameters() (and the error) as "scale"
        own = [name.removeprefix(".") for name in reported.group(1).strip().split(", ")]
        return sorted(own), sorted(mapped), sorted(found)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddps_parameter_indices_map_to_the_names_ddp_itself_reports():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        reported, mapped, found = pool.apply(_names_ddp_reports, (free_port(),))
    assert reported == ["block.unused_inner.bias", "block.unused_inner.weight", "scale"]
    assert mapped == reported and found == reported


def test_the_message_groups_ranks_and_says_which_fix_keeps_the_strategy():
    same = unused_parameters_message({0: ["a.w"], 1: ["a.w"]}, world_size=2, step=1, when="after the first backward")
    assert "at step 1 (after the first backward) on every rank: a.w." in same
    some = unused_parameters_message({0: [], 1: ["a.w"], 2: ["a.w"]}, world_size=3, step=None, when="x")
    assert "(x) on rank(s) 1, 2: a.w." in some
    differ = unused_parameters_message({0: ["a.w"], 1: ["b.w"]}, world_size=2, step=5, when="x")
    assert "rank 0: a.w; rank 1: b.w." in differ
    many = unused_parameters_message({0: [f"p{i}" for i in range(25)]}, world_size=1, step=1, when="x")
    assert "p19 and 5 more." in many


def test_no_check_without_ddp_or_with_its_remedies():
    assert not UnusedParameterCheck.applies(nn.Linear(2, 2))
    check = UnusedParameterCheck(lambda: None)
    error = RuntimeError(
        "Expected to have finished reduction in the prior iteration ... Parameter indices which "
        "did not receive grad for rank 0: 1"
    )
    assert check.error_instead(nn.Linear(2, 2), error, None) is None  # not a DDP wrapper: left as it is
    assert check.error_instead(None, UnusedParametersError("x", parameters={}, step=1), None) is None
