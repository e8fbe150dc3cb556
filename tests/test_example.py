"""The CIFAR-10 example end to end, on 2 CPU processes with SafeDDPStrategy (as `make demo` runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.proc import ROOT, run_script

pytestmark = pytest.mark.multiprocess

TRAIN = str(ROOT / "examples" / "cifar10" / "train.py")
EVALUATE = str(ROOT / "examples" / "cifar10" / "evaluate.py")
ARCHIVE = ROOT.parent / "shared" / "data" / "cifar10-jpg.tar.gz"
EPOCH_LINE = re.compile(r"^epoch (\d+): val_acc=([0-9.]+) val_loss=([0-9.]+)$", re.MULTILINE)


def epochs(output: str) -> list[tuple[int, float]]:
    return [(int(e), float(acc)) for e, acc, _ in EPOCH_LINE.findall(output)]


def check_demo_output(run, max_epochs: int) -> list[tuple[int, float]]:
    assert run.returncode == 0, run.describe()
    assert not run.orphans, run.describe()
    history = epochs(run.output)
    # printed once per epoch (rank 0 only), not once per rank
    assert [e for e, _ in history] == list(range(max_epochs)), run.describe()
    assert history[-1][1] > history[0][1], f"validation accuracy did not rise: {history}"
    assert run.output.count("test_acc=") == 1
    assert "train handshake passed on 2 rank(s)" in run.output
    return history


def check_single_device_evaluation(ckpt_dir: Path, samples: int) -> None:
    """`make demo`'s second step: the 2-process test result equals a devices=1 evaluation of that checkpoint."""
    run = run_script([EVALUATE, "--ckpt-dir", str(ckpt_dir)], timeout=300)
    assert run.returncode == 0, run.describe()
    assert "identical to the single-device evaluation" in run.output, run.describe()
    assert re.search(rf"test_samples +2 process\(es\): {samples}\.0+ +1 device: {samples}\.0+", run.output), run.output


def test_example_on_synthetic_data(tmp_path: Path):
    # 499 test images in batches of 64 on 2 ranks: 8 batches, the last one partial, dealt 4 and 4
    dirs = ["--data-dir", str(tmp_path / "empty"), "--ckpt-dir", str(tmp_path / "ckpt")]
    args = [TRAIN, "--devices", "2", "--max-epochs", "3", "--train-samples", "2000", "--val-samples", "499"]
    run = run_script([*args, "--no-archive", *dirs], timeout=300)
    check_demo_output(run, 3)
    assert "SYNTHETIC" in run.output and run.output.count("SYNTHETIC") == 1
    assert "data source: synthetic" in run.output
    assert "on 499 images (2 process(es)" in run.output
    check_single_device_evaluation(tmp_path / "ckpt", 499)


@pytest.mark.slow
@pytest.mark.skipif(not ARCHIVE.exists(), reason=f"real CIFAR-10 archive not found at {ARCHIVE}")
def test_example_on_real_cifar10(tmp_path: Path):
    # the default data dir (repo/data, git-ignored) keeps the one-time extraction cache shared with `make demo`
    run = run_script([TRAIN, "--devices", "2", "--max-epochs", "3", "--ckpt-dir", str(tmp_path / "ckpt")], timeout=600)
    history = check_demo_output(run, 3)
    assert "data source: jpeg-folders" in run.output
    check_single_device_evaluation(tmp_path / "ckpt", 1000)
    assert history[-1][1] > 0.3, history  # 10 classes: chance is 0.1
