"""ddp_strategy.testing in one process: fault specs, when each fault fires, the file helpers."""

from __future__ import annotations

import errno
import os
import resource
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddp_strategy.checkpoint.format import verify
from ddp_strategy.checkpoint.io import SafeCheckpointIO
from ddp_strategy.errors import CheckpointIntegrityError, CheckpointWriteError
from ddp_strategy.testing import (
    Fault,
    FaultInjector,
    InjectedFault,
    corrupt_checkpoint,
    file_digests,
    limit_file_size,
    restart_count,
    truncate_checkpoint,
    write_garbage,
)


def fake_trainer(rank: int, step: int) -> Any:
    return SimpleNamespace(global_rank=rank, global_step=step, strategy=SimpleNamespace())


def fire(injector: FaultInjector, rank: int, step: int) -> None:
    injector.on_train_batch_start(fake_trainer(rank, step), None, None, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("kill:1:5", Fault("kill", 1, 5)),
        ("kill:1:5:SIGTERM", Fault("kill", 1, 5, float(signal.SIGTERM))),
        ("hang:0:3:2.5", Fault("hang", 0, 3, 2.5)),
        ("slow:1:0:0.05", Fault("slow", 1, 0, 0.05)),
    ],
)
def test_parse(spec: str, fault: Fault) -> None:
    assert Fault.parse(spec) == fault


@pytest.mark.parametrize("spec", ["kill:1", "explode:1:2", "kill:-1:2", "kill:x:2"])
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        Fault.parse(spec)


def test_raise_fires_once_on_its_rank_and_step(capsys: pytest.CaptureFixture[str]) -> None:
    injector = FaultInjector().raise_on_rank(1, at_step=3)
    fire(injector, rank=0, step=3)  # another rank
    fire(injector, rank=1, step=2)  # another step
    with pytest.raises(InjectedFault, match="injected failure on rank 1 at step 3"):
        fire(injector, rank=1, step=3)
    assert "FaultInjector: raising InjectedFault on rank 1 at step 3" in capsys.readouterr().err
    fire(injector, rank=1, step=3)  # at most once per process


def test_faults_fire_only_in_the_chosen_torchrun_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_count() == 1
    fire(FaultInjector().raise_on_rank(0, at_step=0), rank=0, step=0)  # attempt 0 only: nothing happens
    with pytest.raises(InjectedFault):
        fire(FaultInjector(attempt=None).raise_on_rank(0, at_step=0), rank=0, step=0)


def test_slow_rank_sleeps_every_step_from_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("ddp_strategy.testing.time.sleep", slept.append)
    injector = FaultInjector().slow_rank(1, seconds=0.25, from_step=2)
    for step in range(5):
        fire(injector, rank=1, step=step)
        fire(injector, rank=0, step=step)
    assert slept == [0.25, 0.25, 0.25]


def test_hang_sleeps_for_the_given_time(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    clock = iter([0.0, 0.0, 0.0, 5.0, 5.0])
    monkeypatch.setattr("ddp_strategy.testing.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("ddp_strategy.testing.time.sleep", slept.append)
    fire(FaultInjector().hang_rank(0, at_step=1, seconds=5.0), rank=0, step=1)
    assert slept == [5.0]


def test_kill_sends_the_signal_to_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("ddp_strategy.testing.os.kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr("ddp_strategy.testing.time.sleep", lambda s: None)
    fire(FaultInjector().kill_rank(0, at_step=2, sig=signal.SIGUSR1), rank=0, step=2)
    assert sent == [(os.getpid(), signal.SIGUSR1)]


def test_fail_writes_limits_the_file_size_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr("ddp_strategy.testing._set_file_size_limit", lambda n: calls.append(n) or (0, 0))
    fire(FaultInjector().fail_writes(0, at_step=1, max_bytes=2048), rank=0, step=1)
    assert calls == [2048]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "good.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.arange(10_000.0)}, "global_step": 7}, path)
    return path


def test_truncate_and_corrupt_are_detected(checkpoint: Path, tmp_path: Path) -> None:
    size = checkpoint.stat().st_size
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(checkpoint.read_bytes())
    assert truncate_checkpoint(cut, keep_fraction=0.25) == size // 4 == cut.stat().st_size
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(checkpoint.read_bytes())
    offset = corrupt_checkpoint(flipped)
    assert offset == size // 2 and flipped.stat().st_size == size
    assert flipped.read_bytes()[offset] == checkpoint.read_bytes()[offset] ^ 0xFF
    for damaged in (cut, flipped):
        with pytest.raises(CheckpointIntegrityError):
            verify(str(damaged))
    with pytest.raises(ValueError):
        corrupt_checkpoint(flipped, offset=size)
    with pytest.raises(ValueError):
        truncate_checkpoint(cut, keep_fraction=1.0)


def test_write_garbage_is_reproducible(tmp_path: Path) -> None:
    write_garbage(tmp_path / "a", size=100, seed=3)
    write_garbage(tmp_path / "b", size=100, seed=3)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert len((tmp_path / "a").read_bytes()) == 100


def test_limit_file_size_fails_a_save_and_keeps_the_previous_file(checkpoint: Path) -> None:
    before = file_digests(checkpoint.parent)
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)
    with limit_file_size(1024):
        with pytest.raises(CheckpointWriteError, match="File too large") as info:
            SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(100_000)}}, checkpoint)
        with pytest.raises(OSError) as raw, open(checkpoint.parent / "big", "wb") as f:
            f.write(b"x" * 4096)
    assert isinstance(info.value.__cause__, OSError)
    assert raw.value.errno == errno.EFBIG
    assert resource.getrlimit(resource.RLIMIT_FSIZE) == soft  # restored
    (checkpoint.parent / "big").unlink()
    assert file_digests(checkpoint.parent) == before  # no temporary file left, the old checkpoint unchanged
