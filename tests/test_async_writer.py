from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from ddp_strategy.checkpoint import async_writer
from ddp_strategy.checkpoint.async_writer import AsyncCheckpointWriter, snapshot
from ddp_strategy.checkpoint.format import verify
from ddp_strategy.checkpoint.io import SafeCheckpointIO
from ddp_strategy.errors import CheckpointWriteError


class GatedIO(SafeCheckpointIO):
    """Blocks every write until the test opens the gate, to observe what happens while a write is in flight."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.started.set()
        assert self.gate.wait(10)
        if self.fail:
            raise CheckpointWriteError(f"disk full while writing {path}", path=str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def test_snapshot_copies_tensors_and_keeps_structure():
    weights = torch.ones(3)
    original = {"state_dict": {"w": weights}, "list": [weights, 1], "step": 3}
    frozen = snapshot(original)
    weights.add_(1)  # the optimizer keeps training after the snapshot
    assert torch.equal(frozen["state_dict"]["w"], torch.ones(3))
    assert frozen["list"][1] == 1 and frozen["step"] == 3


def test_write_happens_in_background_and_file_holds_snapshot(tmp_path: Path):
    io = GatedIO()
    writer = AsyncCheckpointWriter(io)
    weights = torch.zeros(4)
    path = tmp_path / "a.ckpt"
    assert writer.submit({"state_dict": {"w": weights}, "global_step": 1}, str(path)) is None
    assert io.started.wait(5) and writer.busy and not path.exists()  # training goes on: submit returned
    weights.add_(5)
    io.gate.set()
    assert writer.wait() is None
    loaded = SafeCheckpointIO().load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.zeros(4))
    assert verify(str(path)).global_step == 1  # type: ignore[union-attr]


def test_removal_is_deferred_until_the_new_write_succeeded(tmp_path: Path):
    io = GatedIO()
    writer = AsyncCheckpointWriter(io)
    old = tmp_path / "old.ckpt"
    SafeCheckpointIO().save_checkpoint({"x": 1}, old)
    writer.submit({"x": 2}, str(tmp_path / "new.ckpt"))
    assert io.started.wait(5)
    writer.remove_checkpoint(str(old))
    assert old.exists(), "old checkpoint removed before its replacement was complete"
    io.gate.set()
    assert writer.wait() is None
    assert not old.exists() and (tmp_path / "new.ckpt").exists()


def test_failed_write_keeps_old_checkpoint_and_is_reported_once(tmp_path: Path):
    io = GatedIO()
    io.fail = True
    writer = AsyncCheckpointWriter(io)
    old = tmp_path / "old.ckpt"
    SafeCheckpointIO().save_checkpoint({"x": 1}, old)
    writer.submit({"x": 2}, str(tmp_path / "new.ckpt"))
    writer.remove_checkpoint(str(old))
    io.gate.set()
    error = writer.submit({"x": 3}, str(tmp_path / "newer.ckpt"))  # the next save learns of the failure
    assert error is not None and "disk full" in error
    assert old.exists() and not (tmp_path / "newer.ckpt").exists()
    assert writer.wait() is None  # reported once


def test_at_most_one_write_in_flight(tmp_path: Path):
    io = GatedIO()
    writer = AsyncCheckpointWriter(io)
    writer.submit({"x": 1}, str(tmp_path / "1.ckpt"))
    assert io.started.wait(5)
    second_done = threading.Event()

    def second() -> None:
        writer.submit({"x": 2}, str(tmp_path / "2.ckpt"))
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_done.wait(0.3), "a second write started while the first was in flight"
    io.gate.set()
    thread.join(10)
    assert second_done.is_set()
    assert writer.wait() is None
    assert (tmp_path / "1.ckpt").exists() and (tmp_path / "2.ckpt").exists()


def test_snapshot_reuses_matching_buffers_and_allocates_for_changed_ones():
    live = {"state_dict": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "opt": [torch.full((2,), 7.0)], "step": 1}
    first = snapshot(live)
    live["state_dict"]["w"].add_(1)
    live["state_dict"]["b"] = torch.zeros(5)  # shape changed: a new buffer
    second = snapshot(live, first)
    assert second["state_dict"]["w"] is first["state_dict"]["w"]  # copied into the earlier buffer
    assert torch.equal(second["state_dict"]["w"], torch.full((4, 3), 2.0))
    assert second["state_dict"]["b"].shape == (5,) and second["state_dict"]["b"] is not first["state_dict"]["b"]
    assert second["opt"][0] is first["opt"][0] and second["step"] == 1
    assert second["state_dict"]["w"].data_ptr() != live["state_dict"]["w"].data_ptr()
    transposed = {"state_dict": {"w": torch.ones(3, 4).t()}}  # same shape, other strides: a new buffer
    assert snapshot(transposed, second)["state_dict"]["w"] is not second["state_dict"]["w"]


def test_reused_buffers_are_not_overwritten_while_their_write_is_in_flight(tmp_path: Path):
    io = GatedIO()
    writer = AsyncCheckpointWriter(io)
    weights = torch.zeros(1000)
    assert writer.submit({"state_dict": {"w": weights}, "global_step": 1}, str(tmp_path / "1.ckpt")) is None
    assert io.started.wait(5)
    weights.fill_(2.0)  # training goes on and the next checkpoint comes while the first write is still blocked
    second_submitted = threading.Event()

    def second() -> None:
        writer.submit({"state_dict": {"w": weights}, "global_step": 2}, str(tmp_path / "2.ckpt"))
        second_submitted.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_submitted.wait(0.3)  # it waits for the first write before touching the shared buffer
    io.gate.set()
    thread.join(10)
    assert second_submitted.is_set() and writer.wait() is None
    first = SafeCheckpointIO().load_checkpoint(tmp_path / "1.ckpt")
    assert torch.equal(first["state_dict"]["w"], torch.zeros(1000)), "the reused buffer corrupted an earlier write"
    assert torch.equal(
        SafeCheckpointIO().load_checkpoint(tmp_path / "2.ckpt")["state_dict"]["w"], torch.full((1000,), 2.0)
    )


def test_buffer_reuse_across_saves_and_opt_out(tmp_path: Path):
    weights = torch.zeros(256)
    for reuse in (True, False):
        writer = AsyncCheckpointWriter(SafeCheckpointIO(), reuse_buffers=reuse)
        pointers = []
        for step in range(3):
            weights.fill_(step)
            assert writer.submit({"state_dict": {"w": weights}}, str(tmp_path / f"{reuse}-{step}.ckpt")) is None
            assert writer.wait() is None
            pointers.append(writer._buffers["state_dict"]["w"].data_ptr() if reuse else writer._buffers)
        for step in range(3):
            loaded = SafeCheckpointIO().load_checkpoint(tmp_path / f"{reuse}-{step}.ckpt")
            assert torch.equal(loaded["state_dict"]["w"], torch.full((256,), float(step)))
        if reuse:
            assert len(set(pointers)) == 1  # one buffer, written three times
            writer.release_buffers()
        assert writer._buffers is None and (reuse or pointers == [None, None, None])


# ------------------------------------------------------------------ overlapped snapshots


def hold_deferred_copies(monkeypatch) -> threading.Event:
    """Make the writer thread wait for the returned event before it copies the deferred tensors."""
    release = threading.Event()
    copy = async_writer._copy_deferred

    def held(pending):
        assert release.wait(10)
        return copy(pending)

    monkeypatch.setattr(async_writer, "_copy_deferred", held)
    return release


def test_overlapped_snapshot_copies_deferred_tensors_in_background(tmp_path: Path, monkeypatch):
    release = hold_deferred_copies(monkeypatch)
    weights, running_mean = torch.zeros(1000), torch.zeros(3)
    writer = AsyncCheckpointWriter(SafeCheckpointIO())
    path = tmp_path / "a.ckpt"
    checkpoint = {"state_dict": {"w": weights, "bn.running_mean": running_mean}, "global_step": 7}
    assert writer.submit(checkpoint, str(path), deferred=lambda t: t is weights) is None
    assert writer.snapshot_pending  # submit returned before the parameters were copied
    running_mean.add_(1)  # a forward changes buffers: they were copied before submit returned
    waiter = threading.Thread(target=writer.wait_for_snapshot)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "wait_for_snapshot returned before the deferred copy was made"
    release.set()
    waiter.join(10)
    assert not writer.snapshot_pending and writer.overlapped_submissions == 1
    weights.add_(5)  # the optimizer step, after the gate
    assert writer.wait() is None
    loaded = SafeCheckpointIO().load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.zeros(1000))
    assert torch.equal(loaded["state_dict"]["bn.running_mean"], torch.zeros(3))
    assert writer.snapshot_wait_seconds > 0


def test_in_place_change_before_the_overlapped_copy_fails_that_write_loudly(tmp_path: Path, monkeypatch):
    release = hold_deferred_copies(monkeypatch)
    writer = AsyncCheckpointWriter(SafeCheckpointIO())
    old = tmp_path / "old.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4)}}, old)
    weights = torch.zeros(4)
    writer.submit({"state_dict": {"w": weights}}, str(tmp_path / "new.ckpt"), deferred=lambda t: True)
    writer.remove_checkpoint(str(old))  # requested by ModelCheckpoint while the write is in flight
    weights.add_(1)  # changed in place before the gate: the copy would mix old and new values
    release.set()
    error = writer.wait()
    assert error is not None and "async_snapshot='blocking'" in error and "1 parameter" in error
    assert not (tmp_path / "new.ckpt").exists()
    assert torch.equal(SafeCheckpointIO().load_checkpoint(old)["state_dict"]["w"], torch.ones(4))


def test_non_contiguous_tensors_are_copied_before_submit_returns(tmp_path: Path):
    writer = AsyncCheckpointWriter(SafeCheckpointIO())
    strided = torch.zeros(4, 4).t()
    seen = []
    writer.submit({"a": strided}, str(tmp_path / "c.ckpt"), deferred=lambda t: seen.append(t) or True)
    assert writer.wait() is None
    assert seen == [] and writer.overlapped_submissions == 0
    assert torch.equal(SafeCheckpointIO().load_checkpoint(tmp_path / "c.ckpt")["a"], strided)
