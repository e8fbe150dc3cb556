"""Both Lightning namespaces: ``lightning.pytorch`` and the standalone ``pytorch_lightning`` package.

Each Trainer accepts only strategies and callbacks built on its own package's classes, so ``ddp_strategy`` binds its
source to each (``ddp_strategy`` and ``ddp_strategy.pytorch_lightning``). The multi-process tests run the same
standalone scripts as the rest of the suite with ``DDP_TEST_NAMESPACE=pytorch_lightning`` (see
``tests/scripts/lightning_namespace.py``), importing everything the way a ``pytorch_lightning`` user would.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as PL
import torch

import ddp_strategy
import ddp_strategy.callbacks
import ddp_strategy.pytorch_lightning
import ddp_strategy.pytorch_lightning.callbacks
from tests.proc import SCRIPTS, run_scenario, run_script
from tests.test_exact_eval import assert_same

PL_ENV = {"DDP_TEST_NAMESPACE": "pytorch_lightning"}


@pytest.mark.parametrize(
    ("trainer_cls", "package", "strategy_module"),
    [
        (L.Trainer, ddp_strategy, "ddp_strategy.strategy"),
        (PL.Trainer, ddp_strategy.pytorch_lightning, "ddp_strategy.pytorch_lightning.strategy"),
    ],
    ids=["lightning", "pytorch_lightning"],
)
@pytest.mark.parametrize("by_name", [True, False], ids=["registered-name", "instance"])
def test_each_trainer_gets_the_strategy_of_its_own_namespace(trainer_cls, package, strategy_module, by_name):
    strategy = "safe_ddp" if by_name else package.SafeDDPStrategy(barrier_timeout=5)
    trainer = trainer_cls(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy).__module__ == strategy_module
    assert isinstance(trainer.strategy, package.SafeDDPStrategy)


def test_a_strategy_of_the_other_namespace_is_rejected_by_lightning():
    """What the namespace split prevents: stock Lightning's own type check."""
    with pytest.raises(ValueError, match="must be either a string or an instance of"):
        PL.Trainer(strategy=ddp_strategy.SafeDDPStrategy(), accelerator="cpu", devices=2, logger=False)


def test_callbacks_derive_from_their_own_namespace():
    for name in ddp_strategy.callbacks.__all__:
        if not isinstance(getattr(ddp_strategy.callbacks, name), type):
            continue
        assert issubclass(getattr(ddp_strategy.callbacks, name), L.Callback), name
        mirrored = getattr(ddp_strategy.pytorch_lightning.callbacks, name)
        assert issubclass(mirrored, PL.Callback) and not issubclass(mirrored, L.Callback), name


def test_errors_and_lightning_free_modules_are_shared():
    """``except ddp_strategy.CollectiveMismatchError`` catches the errors of both namespaces."""
    for name in ddp_strategy.errors.__all__:
        assert getattr(ddp_strategy.pytorch_lightning, name) is getattr(ddp_strategy, name)
    for name in sorted(ddp_strategy.pytorch_lightning.SHARED_MODULES):
        shared = importlib.import_module(f"ddp_strategy.pytorch_lightning.{name}")
        assert shared is importlib.import_module(f"ddp_strategy.{name}"), name
        parent, _, child = f"ddp_strategy.pytorch_lightning.{name}".rpartition(".")
        assert getattr(importlib.import_module(parent), child) is shared, name  # attribute access agrees too
    bound = importlib.import_module("ddp_strategy._compat.lightning")
    assert ddp_strategy._compat.lightning is bound and bound.NAMESPACE == "lightning"


def test_namespace_versions_are_checked_against_the_supported_range():
    from ddp_strategy._compat import SUPPORTED_LIGHTNING, supports_lightning
    from ddp_strategy._compat import lightning as bound
    from ddp_strategy.pytorch_lightning._compat import lightning as bound_pl

    assert ("lightning", L.__version__) == (bound.NAMESPACE, bound.VERSION)
    assert ("pytorch_lightning", PL.__version__) == (bound_pl.NAMESPACE, bound_pl.VERSION)
    assert SUPPORTED_LIGHTNING == (">=2.4", "<2.7")
    assert [supports_lightning(v) for v in ("2.3.3", "2.4.0", "2.5.6", "2.6.6", "2.7.0")] == [
        False,
        True,
        True,
        True,
        False,
    ]


@pytest.mark.multiprocess
@pytest.mark.compat
def test_pytorch_lightning_fit_and_resume_is_bit_exact(tmp_path: Path):
    """``pl.Trainer(strategy="safe_ddp", devices=2)`` on ``pytorch_lightning``: fit, stop, resume, same weights."""
    full, resumed, ckpt = tmp_path / "full.pt", tmp_path / "resumed.pt", str(tmp_path / "ckpt")
    common = ["--strategy", "safe_ddp_string"]
    runs = [
        run_scenario("fit_ok", tmp_path, "--max-epochs", "4", "--save-weights", str(full), *common, env=PL_ENV),
        run_scenario("fit_ok", tmp_path, "--max-epochs", "2", "--ckpt-dir", ckpt, *common, env=PL_ENV),
        run_scenario(
            "fit_ok", tmp_path, "--max-epochs", "4", "--ckpt-dir", ckpt, "--resume", "last",
            "--save-weights", str(resumed), *common, env=PL_ENV,
        ),
    ]  # fmt: skip
    for run in runs:
        assert run.returncode == 0 and not run.orphans, run.describe()
        assert run.result is not None
        assert run.result["trainer_module"].startswith("pytorch_lightning.")
        assert run.result["strategy_module"] == "ddp_strategy.pytorch_lightning.strategy"
        assert "handshake passed on 2 rank(s)" in run.output
    assert "Restored all states from the checkpoint" in runs[2].output
    a, b = torch.load(full, weights_only=True), torch.load(resumed, weights_only=True)
    assert a.keys() == b.keys()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) == 0.0


@pytest.mark.multiprocess
@pytest.mark.compat
def test_pytorch_lightning_exact_evaluation_matches_one_device(tmp_path: Path):
    sizes = "0,1,2,5,10,13"
    runs = {}
    for name, devices, env in (("one", "1", None), ("two", "2", PL_ENV)):
        out = tmp_path / f"{name}.json"
        script = [str(SCRIPTS / "exact_eval.py"), "--out", str(out), "--devices", devices, "--sizes", sizes]
        runs[name] = run_script(script, timeout=300, out=out, env=env)
        assert runs[name].returncode == 0 and runs[name].result is not None, runs[name].describe()
    one, two = runs["one"].result, runs["two"].result
    assert two["world_size"] == 2 and two["trainer"].startswith("pytorch_lightning.")
    for stage in ("validate", "test", "predict", "fit"):
        assert_same(one[stage], two[stage], stage)
