"""In-process checks of SafeDDPStrategy's construction and registration (no process group needed)."""

from __future__ import annotations

import pickle
from datetime import timedelta

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import ddp_strategy
from ddp_strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy


def test_public_names_and_error_hierarchy():
    for name in (
        "DuplicateDeviceError",
        "RankDivergenceError",
        "CollectiveMismatchError",
        "CheckpointIntegrityError",
        "SetupMismatchError",
        "RendezvousError",
        "CheckpointWriteError",
        "UnsafeCheckpointError",
    ):
        assert issubclass(getattr(ddp_strategy, name), ddp_strategy.DDPStrategyError)
    assert issubclass(ddp_strategy.DDPStrategyError, RuntimeError)


@pytest.mark.parametrize(("name", "start_method"), [("safe_ddp", "popen"), ("safe_ddp_spawn", "spawn")])
def test_registered_names_build_our_strategy(name, start_method):
    assert name in StrategyRegistry
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, SafeDDPStrategy)
    assert trainer.strategy._start_method == start_method


def test_accepts_everything_ddp_accepts():
    strategy = SafeDDPStrategy(
        find_unused_parameters=True,
        static_graph=False,
        process_group_backend="gloo",
        timeout=timedelta(minutes=1),
        start_method="spawn",
        barrier_timeout=12,
    )
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}
    assert strategy.process_group_backend == "gloo"
    assert strategy.barrier_timeout == timedelta(seconds=12)
    assert SafeDDPStrategy().barrier_timeout == DEFAULT_BARRIER_TIMEOUT


@pytest.mark.parametrize("kwargs", [{"barrier_timeout": 0}, {"barrier_timeout": "5"}, {"heartbeat_interval": -1}])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SafeDDPStrategy(**kwargs)


def test_picklable_before_setup_for_spawn():
    strategy = pickle.loads(pickle.dumps(SafeDDPStrategy(barrier_timeout=3)))
    assert strategy.barrier_timeout == timedelta(seconds=3)
    assert strategy.control_plane is None
