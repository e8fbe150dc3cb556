"""Monitored barrier and agreement logic, with several ranks simulated by threads sharing one in-memory store."""

from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_strategy import control as control_module
from ddp_strategy.checkpoint import protocol
from ddp_strategy.checkpoint.io import SafeCheckpointIO
from ddp_strategy.control import (
    ControlPlane,
    RankFailure,
    also_failed,
    failures,
    first_failure,
    from_rank,
    to_timedelta,
)
from ddp_strategy.errors import (
    CheckpointIntegrityError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DDPStrategyError,
)

# fast unit tests, also run against the lowest and newest Lightning; waits bounded in seconds: run alone (make test)
pytestmark = [pytest.mark.compat, pytest.mark.serial]


def make_planes(world_size: int, timeout: float = 1.0, heartbeat: float = 0.1) -> list[ControlPlane]:
    store = dist.HashStore()
    return [
        ControlPlane(
            rank=r,
            world_size=world_size,
            store=store,
            group=None,
            timeout=timedelta(seconds=timeout),
            heartbeat_interval=heartbeat,
        )
        for r in range(world_size)
    ]


def run_ranks(planes: list[ControlPlane], fn) -> dict[int, BaseException | None]:
    outcome: dict[int, BaseException | None] = {}

    def target(plane: ControlPlane) -> None:
        try:
            fn(plane)
            outcome[plane.rank] = None
        except BaseException as err:
            outcome[plane.rank] = err

    threads = [threading.Thread(target=target, args=(p,)) for p in planes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a simulated rank hung"
    for p in planes:
        p.close()
    return outcome


def test_barrier_passes_when_every_rank_arrives_repeatedly():
    planes = make_planes(3)
    outcome = run_ranks(planes, lambda p: [p.barrier(f"b{i}") for i in range(5)])
    assert outcome == {0: None, 1: None, 2: None}
    assert all(p.heartbeat.position.kind == "barrier" and p.heartbeat.position.name == "b4" for p in planes)


def test_a_training_step_after_barriers_records_the_next_barriers_number():
    """The heartbeat reads the next barrier's number from an attribute each barrier sets (no call per step)."""
    planes = make_planes(2, heartbeat=0)

    def two_barriers_then_a_step(plane: ControlPlane) -> None:
        plane.barrier("first")
        plane.barrier("second")
        plane.heartbeat.note_step(7, batch=8, epoch=0, epoch_batch=8)

    assert run_ranks(planes, two_barriers_then_a_step) == {0: None, 1: None}
    for plane in planes:
        position = plane.heartbeat.position
        assert (position.kind, position.name, position.seq) == ("training step", "7", 2)
        assert plane.heartbeat.next_barrier == 2
        plane.close()


def test_barrier_reached_by_rank0_only_names_missing_rank_and_its_position():
    planes = make_planes(2, timeout=1.0)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 0:
            plane.barrier("only_rank0", site="train.py:10 in main")
        else:
            plane.heartbeat.note_step(7)
            time.sleep(1.6)

    start = time.monotonic()
    outcome = run_ranks(planes, fn)
    assert time.monotonic() - start < 5
    err = outcome[0]
    assert isinstance(err, CollectiveMismatchError)
    assert err.name == "only_rank0" and err.missing_ranks == (1,)
    text = str(err)
    assert "barrier 'only_rank0'" in text and "train.py:10 in main" in text
    assert "rank 1: training step 7" in text
    assert outcome[1] is None


def test_barrier_names_must_match():
    planes = make_planes(2)
    outcome = run_ranks(planes, lambda p: p.barrier("save" if p.rank == 0 else "load"))
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, CollectiveMismatchError)
        assert "'save' on rank(s) 0" in str(err) and "'load' on rank(s) 1" in str(err)


def test_unnamed_barrier_pairs_with_named_one():
    planes = make_planes(2)
    outcome = run_ranks(planes, lambda p: p.barrier("x" if p.rank == 0 else None))
    assert outcome == {0: None, 1: None}


def test_published_failure_stops_waiting_ranks_early():
    planes = make_planes(3, timeout=30.0)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 2:
            plane.note_failure(ValueError("disk on fire"))
        else:
            plane.barrier("handshake")

    start = time.monotonic()
    outcome = run_ranks(planes, fn)
    assert time.monotonic() - start < 5, "waiting ranks did not stop early"
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, CollectiveMismatchError)
        assert err.missing_ranks == (2,)
        assert "failed with ValueError: disk on fire" in str(err)


def test_stale_heartbeat_is_called_out():
    planes = make_planes(2, timeout=1.5, heartbeat=0.05)
    planes[1].close()  # rank 1 stops publishing: it looks dead

    outcome = run_ranks(planes[:1], lambda p: p.barrier("wait_for_dead"))
    text = str(outcome[0])
    assert "rank 1: started" in text and "no heartbeat since" in text


def test_live_rank_is_not_called_dead():
    planes = make_planes(2, timeout=1.5, heartbeat=0.05)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 0:
            plane.barrier("wait_for_live")
        else:
            time.sleep(2.0)

    outcome = run_ranks(planes, fn)
    assert "rank 1: started" in str(outcome[0]) and "no heartbeat since" not in str(outcome[0])


def test_single_rank_barrier_is_immediate():
    (plane,) = make_planes(1)
    plane.barrier("solo")
    assert plane.all_gather_object({"a": 1}, "solo") == [{"a": 1}]
    plane.close()


@pytest.mark.parametrize("value", [0, -1, "10", None, True, timedelta(0)])
def test_to_timedelta_rejects_bad_values(value):
    with pytest.raises(ValueError, match="barrier_timeout"):
        to_timedelta(value, name="barrier_timeout")


def test_to_timedelta_accepts_seconds_and_timedelta():
    assert to_timedelta(2.5, name="t") == timedelta(seconds=2.5)
    assert to_timedelta(timedelta(minutes=1), name="t") == timedelta(minutes=1)


class DeadStore:
    """A store whose host has gone away: every call fails like a lost TCP connection."""

    def __init__(self) -> None:
        self.alive = True

    def _call(self, *args, **kwargs):
        if not self.alive:
            raise RuntimeError("Connection reset by peer")

    set = get = multi_get = check = wait = delete_key = add = append = compare_set = _call


def test_unreachable_store_is_reported_as_rank0_gone():
    store = DeadStore()
    plane = ControlPlane(
        rank=1, world_size=2, store=store, group=None, timeout=timedelta(seconds=5), heartbeat_interval=0
    )
    store.alive = False
    with pytest.raises(CollectiveMismatchError, match="could not reach the rendezvous store") as info:
        plane.barrier("after_rank0_died")
    assert info.value.missing_ranks == (0,)
    assert isinstance(info.value.__cause__, RuntimeError)
    plane.close()


# ---------------------------------------------------------------------------------------------------- agree
class ThreadedObjects:
    """``torch.distributed``'s object collectives for ranks simulated by threads (the control planes' group is None).

    Every call is one round in which each rank's object is pickled (so what does not pickle fails here as it would
    over gloo) and every rank receives all of them. ``calls[rank]`` counts the object collectives of each rank.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.sent: dict[tuple[int, int], bytes] = {}
        self.calls = [0] * world_size
        self.meeting = threading.Barrier(world_size, timeout=20)
        self.local = threading.local()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(control_module, "all_gather_objects", self.all_gather_objects)
        monkeypatch.setattr(control_module, "gather_objects", self.gather_objects)
        monkeypatch.setattr(control_module, "broadcast_object", self.broadcast_object)

    def _exchange(self, obj: object) -> list[object]:
        rank = self.local.rank
        round_ = self.calls[rank]
        self.calls[rank] += 1
        self.sent[(round_, rank)] = pickle.dumps(obj)
        self.meeting.wait()
        return [pickle.loads(self.sent[(round_, r)]) for r in range(self.world_size)]

    def all_gather_objects(self, obj: object, **_: object) -> list[object]:
        return self._exchange(obj)

    def gather_objects(self, obj: object, *, dst: int, rank: int, **_: object) -> list[object] | None:
        everyone = self._exchange(obj)
        return everyone if rank == dst else None

    def broadcast_object(self, obj: object, *, src: int, **_: object) -> object:
        return self._exchange(obj)[src]


def run_agreeing(
    world_size: int, monkeypatch: pytest.MonkeyPatch, fn, timeout: float = 5.0
) -> tuple[dict[int, BaseException | None], dict[int, object], ThreadedObjects, list[int]]:
    """Run ``fn(plane)`` on ``world_size`` threaded ranks; return errors, results, the fake and barriers per rank."""
    objects = ThreadedObjects(world_size)
    objects.install(monkeypatch)
    planes = make_planes(world_size, timeout=timeout)
    results: dict[int, object] = {}

    barriers = [0] * world_size

    def target(plane: ControlPlane) -> None:
        objects.local.rank = plane.rank
        try:
            results[plane.rank] = fn(plane)
        finally:
            barriers[plane.rank] = plane.heartbeat.next_barrier

    outcome = run_ranks(planes, target)
    return outcome, results, objects, barriers


def test_agree_every_rank_takes_the_same_decision(monkeypatch):
    def fn(plane: ControlPlane) -> tuple[int, str]:
        total = plane.agree("sum", plane.rank * 10, sum)
        first = plane.agree("rank-zero", lambda: f"r{plane.rank}", from_rank(0))
        return total, first

    outcome, results, objects, barriers = run_agreeing(3, monkeypatch, fn)
    assert outcome == {0: None, 1: None, 2: None}
    assert results == {0: (30, "r0"), 1: (30, "r0"), 2: (30, "r0")}
    assert objects.calls == [2, 2, 2] and barriers == [2, 2, 2]  # one barrier and one gather per agreement


def test_agree_local_failure_raises_the_same_error_on_every_rank(monkeypatch):
    decided = []

    def local(rank: int) -> int:
        if rank == 1:
            raise ValueError("disk on fire")
        return rank

    def make_error(failed: list[RankFailure]) -> BaseException:
        first = failed[0]
        return CheckpointWriteError(f"Rank {first.rank} failed: {first}{also_failed(failed)}", path="p")

    def fn(plane: ControlPlane) -> list[int]:
        decide = first_failure(make_error)

        def recorded(values):
            decided.append(plane.rank)
            return decide(values)

        return plane.agree("outcome", lambda: local(plane.rank), recorded)

    outcome, results, _, _ = run_agreeing(3, monkeypatch, fn)
    assert sorted(decided) == [0, 1, 2]  # the failing rank took part: nobody waited for it
    messages = {rank: str(err) for rank, err in outcome.items()}
    assert set(messages.values()) == {"Rank 1 failed: ValueError: disk on fire"}
    assert all(type(err) is CheckpointWriteError for err in outcome.values())
    assert isinstance(outcome[1].__cause__, ValueError)  # the failing rank keeps its own traceback
    assert outcome[0].__cause__ is None and outcome[2].__cause__ is None
    assert results == {}


def test_agree_names_every_failing_rank(monkeypatch):
    def fn(plane: ControlPlane) -> int:
        def local() -> int:
            if plane.rank != 1:
                raise OSError(f"no space on rank {plane.rank}")
            return 1

        return plane.agree("outcome", local, from_rank(1))

    outcome, _, _, _ = run_agreeing(3, monkeypatch, fn)
    texts = {str(err) for err in outcome.values()}
    assert texts == {"Rank 0 failed: OSError: no space on rank 0 (rank(s) 0, 2 failed; the first failure is shown)"}
    assert all(isinstance(err, DDPStrategyError) for err in outcome.values())


def test_agree_decide_raising_raises_the_same_error_everywhere(monkeypatch):
    def same_or_raise(values) -> str:
        if len(set(values)) > 1:
            raise CollectiveMismatchError(f"ranks disagree: {list(values)}", name="versions", missing_ranks=[])
        return values[0]

    outcome, _, _, _ = run_agreeing(2, monkeypatch, lambda p: p.agree("versions", f"v{p.rank}", same_or_raise))
    assert [str(outcome[r]) for r in (0, 1)] == ["ranks disagree: ['v0', 'v1']"] * 2


def test_agree_missing_rank_is_named_and_own_failure_kept(monkeypatch):
    def fn(plane: ControlPlane) -> None:
        if plane.rank == 0:
            plane.agree("lonely", lambda: 1 / 0, sum, site="train.py:3 in main")
        else:
            time.sleep(1.5)

    outcome, _, _, _ = run_agreeing(2, monkeypatch, fn, timeout=1.0)
    err = outcome[0]
    assert isinstance(err, CollectiveMismatchError) and err.name == "lonely" and err.missing_ranks == (1,)
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert isinstance(chain[-1], ZeroDivisionError)  # this rank's own failure is kept at the end of the chain
    assert outcome[1] is None


def test_agree_on_a_single_rank():
    (plane,) = make_planes(1)
    assert plane.agree("solo", {"a": 1}, first_failure(lambda failed: RuntimeError("unused"))) == [{"a": 1}]
    assert plane.agree("solo", lambda: "x", from_rank(0)) == "x"
    with pytest.raises(DDPStrategyError, match=r"^Rank 0 failed: KeyError: 'k'$") as info:
        plane.agree("solo", lambda: {}["k"], from_rank(0))
    assert isinstance(info.value.__cause__, KeyError)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not a value: the rank stops at once
        plane.agree("solo", interrupted, from_rank(0))
    plane.close()


def test_rank_failure_travels_without_its_exception():
    ours = RankFailure.of(3, CheckpointWriteError("Saving checkpoint 'p' failed: disk full", path="p"))
    assert ours.message == "Saving checkpoint 'p' failed: disk full" and ours.type_name == "CheckpointWriteError"
    other = RankFailure.of(2, OSError(28, "No space left on device"))
    assert other.message == "OSError: [Errno 28] No space left on device"
    copy = pickle.loads(pickle.dumps(ours))
    assert copy == ours and copy.exception is None and isinstance(ours.exception, CheckpointWriteError)
    assert failures([1, copy, None, other]) == [copy, other]


# ------------------------------------------------------------------------- the checkpoint protocol on agree
def _checkpoint(path: Path, step: int) -> Path:
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, path)
    return path


def _save(plane: ControlPlane, write, *, writers=(0,), path="/ckpt/epoch=1.ckpt") -> None:
    protocol.save(
        control=plane,
        write=write,
        checkpoint={"global_step": 3},
        path=path,
        is_writer=plane.rank in writers,
        every_writer_needs_states=len(writers) > 1,
    )


def test_save_outcome_is_one_agreement(monkeypatch):
    written = []
    outcome, _, objects, barriers = run_agreeing(2, monkeypatch, lambda p: _save(p, written.append))
    assert outcome == {0: None, 1: None}
    assert len(written) == 1 and len(written[0]["ddp_strategy"]["rng_states"]) == 2
    assert objects.calls == [2, 2] and barriers == [2, 2]  # the RNG gather and the outcome


def test_failed_save_raises_on_every_rank_with_the_writers_message(monkeypatch):
    def write(_: dict) -> None:
        raise CheckpointWriteError("Saving checkpoint '/ckpt/epoch=1.ckpt' failed: File too large", path="x")

    outcome, _, objects, barriers = run_agreeing(2, monkeypatch, lambda p: _save(p, write))
    assert str(outcome[0]) == "Saving checkpoint '/ckpt/epoch=1.ckpt' failed: File too large"
    assert str(outcome[1]) == (
        "Rank 0 failed to write checkpoint '/ckpt/epoch=1.ckpt': Saving checkpoint '/ckpt/epoch=1.ckpt' failed: "
        "File too large"
    )
    assert all(type(err) is CheckpointWriteError and err.path == "/ckpt/epoch=1.ckpt" for err in outcome.values())
    assert objects.calls == [2, 2] and barriers == [2, 2]


def test_unexpected_save_error_is_re_raised_on_its_writer_and_reported_to_the_others(monkeypatch):
    boom = ValueError("boom")

    def write(_: dict) -> None:
        raise boom

    outcome, _, objects, _ = run_agreeing(2, monkeypatch, lambda p: _save(p, write))
    assert outcome[0] is boom
    assert type(outcome[1]) is CheckpointWriteError
    assert str(outcome[1]) == "Rank 0 failed to write checkpoint '/ckpt/epoch=1.ckpt': ValueError: boom"
    assert objects.calls == [2, 2]


def test_failed_saves_of_several_writers_name_them_all(monkeypatch):
    def fn(plane: ControlPlane) -> None:
        def write(_: dict) -> None:
            raise CheckpointWriteError(f"disk {plane.rank} full", path="x")

        _save(plane, write, writers=(0, 2))

    outcome, _, _, _ = run_agreeing(3, monkeypatch, fn)
    note = " (rank(s) 0, 2 failed; the first failure is shown)"
    assert str(outcome[0]) == "disk 0 full" + note
    for rank in (1, 2):
        assert str(outcome[rank]) == "Rank 0 failed to write checkpoint '/ckpt/epoch=1.ckpt': disk 0 full" + note


def _load(plane: ControlPlane, path: Path):
    def read(where: str) -> dict:
        return SafeCheckpointIO().load_checkpoint(where)

    chosen, checkpoint = protocol.load(control=plane, read=read, path=str(path))
    return os.path.basename(chosen), checkpoint["global_step"]


def test_load_agrees_in_one_round(monkeypatch, tmp_path):
    path = _checkpoint(tmp_path / "epoch=1.ckpt", 4)
    outcome, results, objects, barriers = run_agreeing(2, monkeypatch, lambda p: _load(p, path))
    assert outcome == {0: None, 1: None}
    assert results == {0: ("epoch=1.ckpt", 4), 1: ("epoch=1.ckpt", 4)}
    assert objects.calls == [1, 1] and barriers == [1, 1]


def test_load_of_a_missing_checkpoint_raises_the_same_error_everywhere(monkeypatch, tmp_path):
    outcome, _, objects, _ = run_agreeing(2, monkeypatch, lambda p: _load(p, tmp_path / "nope.ckpt"))
    assert all(type(err) is FileNotFoundError for err in outcome.values())
    assert str(outcome[0]) == str(outcome[1])
    assert "nope.ckpt" in str(outcome[0]) and "(checked by rank 0)" in str(outcome[0])
    assert objects.calls == [1, 1]


def test_load_of_a_damaged_checkpoint_raises_the_same_error_everywhere(monkeypatch, tmp_path):
    path = _checkpoint(tmp_path / "epoch=1.ckpt", 4)
    path.write_bytes(path.read_bytes()[:-7])
    outcome, _, _, _ = run_agreeing(2, monkeypatch, lambda p: _load(p, path))
    assert all(type(err) is CheckpointIntegrityError and err.path == str(path) for err in outcome.values())
    assert str(outcome[0]) == str(outcome[1])


def test_load_falls_back_on_every_rank(monkeypatch, tmp_path):
    _checkpoint(tmp_path / "epoch=0-step=2.ckpt", 2)
    last = _checkpoint(tmp_path / "last.ckpt", 4)
    last.write_bytes(last.read_bytes()[:-7])
    outcome, results, objects, _ = run_agreeing(2, monkeypatch, lambda p: _load(p, last))
    assert outcome == {0: None, 1: None}
    assert results == {0: ("epoch=0-step=2.ckpt", 2), 1: ("epoch=0-step=2.ckpt", 2)}
    assert objects.calls == [2, 2]  # the decision, then who can read the fallback


def test_load_sends_the_file_to_a_rank_that_cannot_read_it(monkeypatch, tmp_path):
    path = _checkpoint(tmp_path / "epoch=1.ckpt", 4)
    seen_by = threading.local()
    readable = protocol._readable
    monkeypatch.setattr(protocol, "_readable", lambda where: seen_by.rank == 0 and readable(where))

    def fn(plane: ControlPlane):
        seen_by.rank = plane.rank
        return _load(plane, path)

    outcome, results, objects, _ = run_agreeing(2, monkeypatch, fn)
    assert outcome == {0: None, 1: None}
    assert results == {0: ("epoch=1.ckpt", 4), 1: ("epoch=1.ckpt", 4)}
    assert objects.calls == [2, 2]  # the decision, then the transfer


def test_unexpected_check_failure_stops_every_rank(monkeypatch, tmp_path):
    path = _checkpoint(tmp_path / "epoch=1.ckpt", 4)
    seen_by = threading.local()
    readable = protocol._readable

    def check(where: str) -> bool:
        if seen_by.rank == 1:
            raise PermissionError("no access to the mount")
        return readable(where)

    monkeypatch.setattr(protocol, "_readable", check)

    def fn(plane: ControlPlane):
        seen_by.rank = plane.rank
        return _load(plane, path)

    outcome, _, _, _ = run_agreeing(2, monkeypatch, fn)
    assert type(outcome[0]) is CheckpointIntegrityError
    assert str(outcome[0]) == f"Rank 1 could not check checkpoint '{path}': PermissionError: no access to the mount"
    assert type(outcome[1]) is PermissionError  # re-raised as is on the rank it happened on


def _gloo_network_threads() -> set[str]:
    """The thread ids of gloo's network threads in this process (one per gloo device)."""
    task = Path("/proc/self/task")
    return {t.name for t in task.iterdir() if (t / "comm").read_text().strip() == "gloo_tcp_loop"}


def _await_gloo_network_threads(known: set[str], within: float = 5.0) -> set[str]:
    """The network threads once one beyond ``known`` has named itself, or as they are after ``within`` seconds.

    torch's gloo threads are named ``python`` until they first run, which a loaded machine can delay.
    """
    deadline = time.monotonic() + within
    while not (threads := _gloo_network_threads()) - known and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux /proc")
def test_the_control_group_uses_the_default_gloo_groups_device_and_network_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Issue 30: a gloo device's network thread wakes every 10 ms; the control group adds none to a gloo world."""
    from ddp_strategy._compat import torch as torch_compat

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        # the default group's own network thread names itself once it runs: CI (torch 2.13) once listed none yet
        threads = _await_gloo_network_threads(set())
        assert len(threads) == 1
        group = torch_compat.new_control_gloo_group(timedelta(seconds=30))
        assert not _gloo_network_threads() - threads and dist.get_backend(group) == "ddp_strategy_gloo"
        value = torch.ones(2)
        dist.all_reduce(value, group=group)
        gathered: list[object] = [None]
        dist.all_gather_object(gathered, {"rank": 0}, group=group)
        assert value.tolist() == [1.0, 1.0] and gathered == [{"rank": 0}]
        assert not _gloo_network_threads() - threads  # still none after use (a new thread names itself as it runs)
        assert torch_compat.gloo_worker_threads(group) == 2  # the fork-safety pinning finds its workers
        # a world larger than SHARED_DEVICE_MOST_RANKS: a device of its own, pairs connected on first use
        monkeypatch.setattr(torch_compat, "SHARED_DEVICE_MOST_RANKS", 0)
        lazy = torch_compat.new_control_gloo_group(timedelta(seconds=30))
        assert len(_await_gloo_network_threads(threads) - threads) == 1 and dist.get_backend(lazy) == "gloo"
    finally:
        dist.destroy_process_group()
