"""In-process checks of SafeDDPStrategy's construction and registration (no process group needed)."""

from __future__ import annotations

import functools
import inspect
import pickle
from datetime import timedelta

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import ddp_strategy
from ddp_strategy import DEFAULT_BARRIER_TIMEOUT, SafeDDPStrategy
from ddp_strategy.options import option_text


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


def test_agreed_options_are_those_not_at_their_defaults_as_text_the_same_on_every_rank():
    """What the rendezvous and the handshakes compare across ranks (``SafeDDPStrategy.agreed_options``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert SafeDDPStrategy().agreed_options == {}
    # defaults passed explicitly, and the options that may differ per rank (how long a rank waits), are not listed
    same = SafeDDPStrategy(
        preemption_signals=["SIGTERM"], find_unused_parameters=False, weight_check="epoch", barrier_timeout=5,
        rendezvous_timeout=3, rendezvous_report_interval=2,
    )  # fmt: skip
    assert same.agreed_options == {}
    state = object()  # a hook state without a repr of its own: its class, not its address
    strategy = SafeDDPStrategy(
        preemption_signals=None, weight_check=5, bucket_cap_mb=1, static_graph=True,
        ddp_comm_hook=default_hooks.fp16_compress_hook, ddp_comm_state=state,
    )  # fmt: skip
    assert strategy.agreed_options == {
        "preemption_signals": "None",
        "weight_check": "5",
        "bucket_cap_mb": "1",
        "static_graph": "True",
        "ddp_comm_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
    }
    usr1 = SafeDDPStrategy(preemption_signals=["SIGTERM", "USR1"], exact_evaluation=False)
    assert usr1.agreed_options == {"preemption_signals": "(SIGTERM, SIGUSR1)", "exact_evaluation": "False"}


def scaled_allreduce_hook(state: object, bucket: object, *, scale: float) -> object:
    """A user's DDP communication hook with an argument, bound with ``functools.partial``."""
    raise NotImplementedError  # never called: only its text is compared


def test_a_comm_hook_with_bound_arguments_is_compared_by_them_not_by_its_class():
    # a rank that reads the hook's argument from its environment (scale=0.5 on one, 1.0 on the other) disagrees;
    # before, every `functools.partial` was "<functools.partial object>" and the ranks agreed
    def agreed(*args: object, **kwargs: object) -> str:
        hook = functools.partial(scaled_allreduce_hook, *args, **kwargs)
        return SafeDDPStrategy(ddp_comm_hook=hook).agreed_options["ddp_comm_hook"]

    hook = f"{__name__}.scaled_allreduce_hook"
    assert agreed(scale=0.5) == f"functools.partial({hook}, scale=0.5)"
    assert agreed(scale=0.5) != agreed(scale=1.0)
    assert agreed(scale=0.5) == agreed(scale=0.5)  # two partial objects, one text
    # keyword order does not matter; an argument without a repr of its own is named by its class, not its address
    assert agreed(object(), scale=1, b=2) == agreed(object(), b=2, scale=1)
    assert agreed(object()) == f"functools.partial({hook}, <builtins.object object>)"
    assert option_text([1, {"a": (2,)}]) == "[1, {'a': (2,)}]"


def test_the_line_that_made_the_strategy_is_kept():
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    strategy = SafeDDPStrategy()
    assert strategy.made_at == f"tests/test_strategy.py:{line} in test_the_line_that_made_the_strategy_is_kept"
