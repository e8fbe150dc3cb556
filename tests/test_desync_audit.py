"""The desync monitor's work kept off the training thread and within its budget (issue 30), same verdicts as before.

Asserted without processes (fakes for the recorder and the control plane): the ledger's digest is the eager one
though it is computed by the reading thread; the comparison of published digests finds the same call as the
straightforward comparison it replaced; the audit's dumps come at the rate of calls and within the CPU budget, a
dump made on the training thread is published at the next beat, and a report names calls the recorder no longer
holds; a beat does not read the recorder while the training thread moves on, and a wait it then sees counts from
the skipped beat; the strategy's ``reduce`` adds the same ledger text as before.
"""

from __future__ import annotations

import pickle
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import ddp_strategy._compat.torch as compat_torch
import ddp_strategy.desync as desync_module
import ddp_strategy.desync_audit as audit_module
from ddp_strategy.collective_calls import CollectiveCalls
from ddp_strategy.collective_record import (
    TRACE_ENTRIES,
    CallAudit,
    CallLedger,
    CallNotes,
    CollectiveCall,
    first_published_difference,
)
from ddp_strategy.desync import DesyncMonitor
from ddp_strategy.desync_audit import RecorderAudit
from ddp_strategy.errors import CollectiveMismatchError


def test_the_ledger_digest_is_the_eager_one_computed_by_the_reading_thread():
    ledger = CallLedger()
    texts = [f"reduce training_step.x{i % 3} torch.float32[] mean" for i in range(50)]
    adder = threading.Thread(target=lambda: [ledger.add(t) for t in texts])
    adder.start()
    while adder.is_alive():
        ledger.state  # noqa: B018  # the heartbeat thread reads while the training thread adds
    adder.join()
    digest = 0
    for i, text in enumerate(texts, 1):
        digest = zlib.crc32(text.encode(), digest)
        assert ledger.digest_at(i) == digest
    assert ledger.state == (50, digest) and [n for n, _ in ledger.texts] == list(range(1, 51))
    unread = CallLedger()
    for i in range(5000):  # nothing reads it (no heartbeat): the adding thread settles, memory stays bounded
        unread.add(str(i))
    assert len(unread._pending) < 1024 and unread.state[0] == 5000


def test_a_beat_takes_few_calls_into_the_ledger_however_many_steps_a_second_the_rank_makes():
    # the beat runs on the training thread while it trains: 400 steps a second with a sync_dist log each made it
    # settle 400 calls at once (about 1 ms, issue 30 point 2); the adding thread settles every 64 instead
    ledger = CallLedger()
    for i in range(1000):
        ledger.add(f"reduce training_step.loss{i % 2} torch.float32[] mean")
    assert len(ledger._pending) < 64 and ledger.state[0] == 1000


def test_the_heartbeat_threads_comparison_at_a_peers_count_takes_in_only_the_calls_up_to_it(
    monkeypatch: pytest.MonkeyPatch,
):
    # the ledger comparison runs on the heartbeat thread (DesyncMonitor._look): it must not settle the training
    # thread's calls there (up to 4.8 ms of a background wake-up's CPU, bench/step_pauses.py at 32d963c), only those
    # up to the peer's count; how many calls there are costs nothing to read
    import ddp_strategy.collective_record as record

    monkeypatch.setattr(record, "_PENDING_MOST", 10**6)
    ledger = CallLedger()
    texts = [f"reduce training_step.loss torch.float32[] mean {i}" for i in range(100)]
    for text in texts:
        ledger.add(text)
    assert ledger.count == 100 and ledger._state[0] == 0  # counted, nothing settled
    digest = 0
    for text in texts[:10]:
        digest = zlib.crc32(text.encode(), digest)
    assert ledger.digest_at(10) == digest
    assert ledger._state[0] == 10 and len(ledger._pending) == 90 and ledger.count == 100  # up to 10 only
    assert ledger.digest_at(5) is not None and ledger._state[0] == 10  # nothing more to take in
    assert ledger.state[0] == 100 and ledger.digest_at(10) == digest


def test_the_ledger_lets_the_gil_go_only_after_holding_it_a_quarter_millisecond(monkeypatch: pytest.MonkeyPatch):
    """A second of calls is settled without a sleep: on a VM a sleep costs more CPU than the calls (issue 30)."""
    import ddp_strategy.collective_record as record

    clock = [0.0]
    sleeps: list[int] = []
    ledger = CallLedger()
    monkeypatch.setattr(record.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(record.time, "sleep", lambda seconds: sleeps.append(len(ledger._pending)))
    monkeypatch.setattr(record, "_PENDING_MOST", 10**6)  # a backlog of calls, as before the adding thread settled
    for i in range(1000):
        ledger.add(f"reduce x{i}")
    assert ledger.state[0] == 1000 and sleeps == []  # quick enough: no sleep
    real_crc32 = record.zlib.crc32

    def slow_crc32(data: bytes, value: int) -> int:  # each call takes 10 us
        clock[0] += 1e-5
        return real_crc32(data, value)

    monkeypatch.setattr(record.zlib, "crc32", slow_crc32)
    for i in range(100):
        ledger.add(f"reduce y{i}")
    assert ledger.state[0] == 1100
    # looked at every 32 calls: each 32 take 0.32 ms, past 0.25 ms: a sleep after each while calls wait
    assert sleeps == [68, 36, 4]
    digest = 0
    for text in [f"reduce x{i}" for i in range(1000)] + [f"reduce y{i}" for i in range(100)]:
        digest = real_crc32(text.encode(), digest)
    assert ledger.state == (1100, digest) and ledger.digest_at(1000) is not None


def _old_first_published_difference(publications: Sequence[Mapping[str, Sequence[Any]]]) -> tuple[str, int] | None:
    """The comparison before issue 30 (one dict per publication and group), the reference."""
    import array

    def table(publication: Mapping[str, Sequence[Any]], group: str) -> dict[int, int]:
        if group not in publication:
            return {}
        first, data = publication[group]
        values = array.array("I")
        values.frombytes(bytes.fromhex(str(data)))
        return {int(first) + i: value for i, value in enumerate(values) if value}

    for group in sorted({group for publication in publications for group in publication}):
        tables = [table(publication, group) for publication in publications]
        for seq in sorted(set().union(*tables)):
            if len({t[seq] for t in tables if seq in t}) > 1:
                return group, seq
    return None


def _publication(rng: random.Random) -> dict[str, list[Any]]:
    import array

    published = {}
    for group in rng.sample(["0", "1", "2"], rng.randint(1, 3)):
        first = rng.randint(1, 30)
        values = array.array("I", (rng.choice([0, 7, 7, 7, 9]) for _ in range(rng.randint(0, 40))))
        published[group] = [first, values.tobytes().hex()]
    return published


def test_the_comparison_of_published_digests_names_the_call_the_old_comparison_named():
    rng = random.Random(30)
    found = 0
    for _ in range(3000):
        publications = [_publication(rng) for _ in range(rng.randint(2, 4))]
        expected = _old_first_published_difference(publications)
        assert first_published_difference(publications) == expected, publications
        found += expected is not None
    assert 300 < found < 2700  # both outcomes were exercised


def entry(seq: int, line: int, group: int = 0, created: int = 0) -> dict[str, Any]:
    """A Flight Recorder entry of an all-reduce made at ``model.py:<line>``."""
    return {
        "pg_id": group,
        "collective_seq_id": seq,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[1]],
        "input_dtypes": ["Float"],
        "retired": True,
        "time_created_ns": created or seq * 1000,
        "frames": [{"name": "step", "filename": "/home/me/model.py", "line": line}],
    }


class FakeRecorder:
    """The recorder's counters and entries (a ring of ``size``), and the number of dumps with stacks."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[dict[str, Any]] = []
        self.dumps = 0

    def call(self, n: int = 1, line: int = 10) -> None:
        for _ in range(n):
            self.entries.append(entry(len(self.entries) + 1, line))

    def status(self) -> dict[str, tuple[int, int]]:
        return {"0": (len(self.entries), len(self.entries))} if self.entries else {}

    def trace(self, before_parsing: Callable[[], object] | None = None) -> list[dict[str, Any]]:
        self.dumps += 1
        if before_parsing is not None:
            before_parsing()
        return self.entries[-self.size :]

    def dump(self, before_parsing: Callable[[], object] | None = None) -> tuple[list[dict[str, Any]], Any]:
        return self.trace(before_parsing), self.status()

    def pickled(self) -> bytes:
        """Torch's dump alone: the entries and the counters as they are now."""
        return pickle.dumps(self.dump())

    def unpickled(self, pickled: bytes) -> tuple[list[dict[str, Any]], Any]:
        return pickle.loads(pickled)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> FakeRecorder:
    fake = FakeRecorder()
    monkeypatch.setattr(audit_module, "collective_status", fake.status)
    monkeypatch.setattr(audit_module, "collective_trace", fake.trace)
    monkeypatch.setattr(audit_module, "collective_dump", fake.dump)
    monkeypatch.setattr(audit_module, "collective_dump_pickled", fake.pickled)
    monkeypatch.setattr(audit_module, "collective_dump_unpickled", fake.unpickled)
    return fake


def compare(audit: RecorderAudit, store: Any, *, background: bool = True) -> tuple[str, int] | None:
    """A beat's audit as the desync monitor runs it: publish (the beat), then compare (its look)."""
    mine = audit.publish(store, background=background)
    if mine is None or not audit.peer_published(store):
        return None
    return audit.compare_with_peer(mine, store.get(audit.peer_key))


def test_dumps_follow_the_rate_of_calls_and_stay_within_the_cpu_budget(
    recorder: FakeRecorder, monkeypatch: pytest.MonkeyPatch
):
    store = torch.distributed.HashStore()
    clock = [100.0]
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: clock[0])
    audit = RecorderAudit(0, 2, interval=5.0, entries=8, cpu_share=1.0)
    assert not audit.due()  # the first audit comes `interval` after the start at the latest
    clock[0] += 5.0
    recorder.call(10)  # 2 calls a second
    assert audit.due() and compare(audit, store) is None and recorder.dumps == 1
    assert audit._next == pytest.approx(clock[0] + 2.0)  # half of the 8 entries kept, at 2 calls a second
    assert store.check([audit.key]) and audit.calls.newest == {"0": 10}
    clock[0] += 2.0
    recorder.call(40)  # 20 calls a second: the next dump in 0.2 s, unless the budget says later
    audit.cpu_share = 1e-9  # the dump's CPU (thread time, > 0) allows none for a long time
    compare(audit, store)
    assert audit._next > clock[0] + 1000
    clock[0] += 1.0
    recorder.call(4, line=11)
    assert not audit.due()  # sampled: the budget holds the heartbeat's dumps back
    audit.dump_now()  # the training thread's dump as an epoch starts: whatever the budget
    assert not audit.due() and audit.fetched and recorder.dumps == 3
    audit.continue_fetched()  # its next step: the unpickling
    assert not audit.due() and audit.fetched
    audit.continue_fetched()  # the step after: the parsing
    assert audit.due() and not audit.fetched  # published at the next beat
    mine = compare(audit, store)
    assert mine is None and not audit.due()
    recorder.call(2)
    with audit._lock:  # the heartbeat thread is dumping: the training thread does not wait for it
        training = threading.Thread(target=audit.dump_now)
        training.start()
        training.join(5.0)
        assert not training.is_alive() and recorder.dumps == 3


def test_a_background_dump_lets_the_gil_go_between_torchs_dump_and_its_unpickling(monkeypatch: pytest.MonkeyPatch):
    """Both keep the GIL (0.5-0.7 and 0.2-0.4 ms for 32 entries): a training thread waits for one at most (issue 30)."""
    events: list[str] = []

    def dump(**options: bool) -> bytes:
        events.append("dump")
        status = {"last_enqueued_collective": 1, "last_started_collective": 1, "last_completed_collective": 1}
        return pickle.dumps({"pg_status": {"0": status}, "entries": [entry(1, 10)]})

    unpickle = pickle.loads
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace", dump, raising=False)
    monkeypatch.setattr(compat_torch.pickle, "loads", lambda data: events.append("unpickle") or unpickle(data))
    monkeypatch.setattr(audit_module, "collective_status", lambda: {"0": (1, 1)})
    monkeypatch.setattr(audit_module.time, "sleep", lambda seconds: events.append(f"sleep {seconds}"))
    RecorderAudit(0, 2)._dump()  # the heartbeat thread's
    sleep = f"sleep {audit_module._YIELD}"
    assert events == [sleep, "dump", sleep, "unpickle", sleep]
    events.clear()
    audit = RecorderAudit(0, 2)
    audit.dump_now()  # the training thread's, as an epoch starts: it would only wait longer for the GIL
    assert events == ["dump"]  # torch's dump alone in that step
    audit.continue_fetched()  # its next step: the unpickling alone
    assert events == ["dump", "unpickle"] and audit.calls.newest == {}
    audit.continue_fetched()  # the step after: the parsing
    # and it reads the recorder's counters from its one dump (a call of their own costs a third of a dump)
    assert events == ["dump", "unpickle"] and audit.calls.newest == {"0": 1} and audit._status == {"0": (1, 1)}


def test_a_rank_that_publishes_second_finds_the_call_its_peer_made_elsewhere(recorder: FakeRecorder):
    store = torch.distributed.HashStore()
    ranks = [RecorderAudit(rank, 2, interval=0.0, entries=8, cpu_share=1.0) for rank in (0, 1)]
    recorder.call(3)
    assert compare(ranks[0], store) is None  # rank 1 has not published yet
    recorder.entries[-1]["frames"] = [{"name": "step", "filename": "/home/me/model.py", "line": 99}]
    assert compare(ranks[1], store) == ("0", 3)  # rank 1's call #3 came from another line than rank 0's


def test_a_report_names_calls_only_an_earlier_audit_saw(recorder: FakeRecorder):
    recorder.size = 4
    audit = RecorderAudit(0, 2, entries=4)
    notes = CallNotes()
    recorder.call(2)
    note = notes.begin("self.log('x', sync_dist=True) in training_step")
    recorder.entries.append(entry(3, 12, created=time.time_ns()))  # made inside the strategy's note
    notes.end(note)
    audit.update()  # audits 1-3, without notes
    recorder.call(7)  # 4-10: the recorder holds 7-10 now
    calls = audit.report_calls(notes, most=256)
    assert [c.seq for c in calls] == [1, 2, 3, 7, 8, 9, 10]  # 4-6 left the recorder before an audit saw them
    assert calls[2].what == "self.log('x', sync_dist=True) in training_step"
    assert calls[2].site.endswith("model.py:12 in step") and calls[0].what == ""
    assert [c.seq for c in audit.report_calls(notes, most=3)] == [8, 9, 10]


class FakeHeartbeat:
    interval = 1.0

    def __init__(self) -> None:
        self.position: object = object()

    @property
    def mark(self) -> object:  # as Heartbeat.mark: changes whenever the position does
        return self.position

    def add_beat(self, hook: Any) -> None:
        pass


class FakeControl:
    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.store = torch.distributed.HashStore()
        self.heartbeat = FakeHeartbeat()
        self.in_barrier: tuple[str, float] | None = None
        self.desync_error = None

    def forget_at_close(self, *keys: str, shared: bool = False) -> None:
        pass


def test_a_beat_reads_the_recorder_only_when_the_training_thread_did_not_move_on(monkeypatch: pytest.MonkeyPatch):
    reads: list[int] = []
    status = {"0": (7, 6)}  # collective #7 pending

    def collective_status() -> dict[str, tuple[int, int]]:
        reads.append(1)
        return status

    monkeypatch.setattr(desync_module, "collective_status", collective_status)
    monkeypatch.setattr(desync_module, "collective_trace", list)
    monkeypatch.setattr(desync_module, "_training_thread_in_torch", lambda: True)
    control = FakeControl()
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    assert monitor._watched_wait() == ("collective 0#7", pytest.approx(time.time(), abs=5))  # no move since start
    assert reads == [1]
    reads.clear()
    monitor._wait = ("", 0.0)
    control.heartbeat.position = object()  # a new training step
    assert monitor._watched_wait() == ("", 0.0) and reads == []
    skipped = monitor._skipped_at
    time.sleep(0.01)
    what, since = monitor._watched_wait()  # no new step since: the counters are read
    assert (what, since) == ("collective 0#7", skipped) and reads == [1]  # counted from the skipped beat
    monitor._wait = (what, since)
    assert monitor._watched_wait() == (what, since)  # unchanged: the same wait, the same start
    monitor.ledger.add("reduce x torch.float32[] mean")  # a strategy collective: it moved on
    assert monitor._watched_wait() == ("", 0.0) and reads == [1, 1]
    control.in_barrier = ("barrier 3 'save'", 5.0)
    control.heartbeat.position = object()  # a barrier is a new position, and a wait
    assert monitor._watched_wait() == ("barrier 3 'save'", 5.0)


def test_after_a_verdict_a_rank_exits_only_while_its_training_thread_stays_in_one_frame(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """A collective that returned with the backend's error stays pending in the recorder, and a training thread that
    raises it, or tears down through torch's code, is in torch's code now and then: it must reach the launcher, which
    raises the agreed error. Only a thread found in the same frame at the same instruction at two beats is blocked,
    and only then does the process print the error and exit."""
    monkeypatch.setattr(desync_module, "collective_status", lambda: {"0": (7, 6)})  # collective #7 pending for good
    monkeypatch.setattr(desync_module, "collective_trace", list)
    monkeypatch.setattr(desync_module, "_training_thread_in_torch", lambda: True)
    exits: list[int] = []
    monkeypatch.setattr(desync_module.os, "_exit", exits.append)
    control = FakeControl()
    control.rank = 1  # type: ignore[misc]  # rank 0 would first wait for the others to hold the verdict
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    control.desync_error = CollectiveMismatchError("ranks diverged", name="x", missing_ranks=[])  # type: ignore[assignment]
    monitor._verdict_at = time.monotonic() - 10.0  # its delay after the verdict has passed

    def frame() -> Any:
        return sys._getframe()

    raising = [frame(), frame(), frame()]  # three frames alive at once: three places
    seen = iter([*raising, raising[-1]])
    monkeypatch.setattr(desync_module, "_training_thread_frame", lambda: next(seen), raising=False)
    for _ in raising:  # a thread moving from frame to frame: not blocked, however long after the verdict
        monitor._break_if_blocked(control.store)
    assert exits == [] and "CollectiveMismatchError" not in capsys.readouterr().err
    monitor._break_if_blocked(control.store)  # the same frame as at the last beat: blocked
    assert exits == [desync_module._EXIT_CODE]
    err = capsys.readouterr().err
    assert "[rank1]: ddp_strategy.errors.CollectiveMismatchError: ranks diverged" in err
    assert "blocked inside a collective" in err


class GoneStore:
    """Rank 0's store after rank 0 exited: every look fails."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_a_blocked_rank_other_than_0_exits_after_rank_0_stopped_and_at_the_latest_bound_after_the_verdict():
    """Rank 0's exit releases the others' collectives, which then raise the agreed error through the launcher: a
    rank other than 0 exits by itself only when its collective did not return 2 s after rank 0 stopped, or at the
    latest 9 s after the verdict (rank 0 announces its stop within about 7). The same at any rank number."""
    control = FakeControl()
    control.rank, control.world_size = 4095, 4096  # type: ignore[misc]  # before: 0.5 s per rank, 34 minutes
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    now = time.monotonic()
    assert not monitor._may_exit(control.store, now)  # rank 0 has not stopped yet
    assert not monitor._may_exit(control.store, now - desync_module._BREAK_LATEST + 1.0)
    control.store.set(desync_module.RANK0_STOPPING_KEY, "1")
    assert not monitor._may_exit(control.store, now)  # rank 0 just stopped: its exit may release the collective
    assert monitor._rank0_stopped_at is not None
    monitor._rank0_stopped_at -= desync_module._AFTER_RANK0
    assert monitor._may_exit(control.store, now)  # it did not return: exit

    gone = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    assert not gone._may_exit(GoneStore(), now)  # type: ignore[arg-type]  # rank 0 has exited: its store is gone
    assert gone._rank0_stopped_at is not None

    late = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    assert desync_module._BREAK_LATEST == 9.0 and desync_module._AFTER_RANK0 == 2.0  # docs/diagnostics.md
    assert late._may_exit(FakeControl().store, now - desync_module._BREAK_LATEST)  # rank 0 never said it stops


def test_a_blocked_rank_0_exits_one_second_after_the_verdict_without_a_store_look():
    control = FakeControl()
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    now = time.monotonic()
    assert control.rank == 0
    assert not monitor._may_exit(GoneStore(), now)  # type: ignore[arg-type]
    assert monitor._may_exit(GoneStore(), now - desync_module._BREAK_AFTER)  # type: ignore[arg-type]
    assert monitor._rank0_stopped_at is None


def test_reduce_adds_the_ledger_text_it_added_before_and_keeps_it_per_logged_value(monkeypatch: pytest.MonkeyPatch):
    calls = CollectiveCalls()
    monitor: Any = SimpleNamespace(control=SimpleNamespace(desync_error=None), ledger=CallLedger())
    calls.watched_by(monitor)
    logged = [("training_step", "loss")]
    monkeypatch.setattr("ddp_strategy.collective_calls.logged_metric_of_caller", lambda depth: logged[0])
    calls.log_sites.sites[("training_step", "loss")] = "model.py:3 in training_step"
    tensor = torch.zeros(())
    ran = []
    for op in ("mean", "mean", "sum"):
        calls.reduce(lambda t, group, reduce_op: ran.append(reduce_op), tensor, None, op)
    expected = [
        f"reduce training_step.loss {tensor.dtype}{list(tensor.shape)} mean",  # the text before issue 30
        f"reduce training_step.loss {tensor.dtype}{list(tensor.shape)} mean",
        f"reduce training_step.loss {tensor.dtype}{list(tensor.shape)} sum",
    ]
    assert [what for _, what in monitor.ledger.texts] == expected and ran == ["mean", "mean", "sum"]
    assert len(calls._texts) == 2
    logged[0] = ("on_train_epoch_end", "acc")  # its line not known yet: not kept, the note may still gain it
    calls.reduce(lambda t, group, reduce_op: None, tensor, None, "mean")
    assert len(calls._texts) == 2 and monitor.ledger.state[0] == 4
    assert calls.notes.lookup(time.time_ns()) == ""  # every note closed
    # inside `self.log(..., sync_dist=True)` (a step value): named by the call, without a look at the stack
    monkeypatch.setattr("ddp_strategy.collective_calls.logged_metric_of_caller", lambda depth: 1 / 0)
    calls.log_sites.current = ("training_step", "loss")
    calls.reduce(lambda t, group, reduce_op: None, tensor, None, "mean")
    assert monitor.ledger.texts[-1][1] == expected[0]
    # an unhashable reduce_op: recorded, its texts made anew at each call and never kept
    calls.reduce(lambda t, group, reduce_op: None, tensor, None, ["sum"])
    assert monitor.ledger.texts[-1][1] == f"reduce training_step.loss {tensor.dtype}{list(tensor.shape)} ['sum']"
    assert len(calls._texts) == 2


def test_the_logged_value_is_known_inside_its_log_call_only():
    from ddp_strategy.collective_record import LogSites

    seen: list[Any] = []
    sites = LogSites()
    module = SimpleNamespace(_current_fx_name="training_step")
    module.log = lambda name, value, **kwargs: seen.append(sites.current)  # Lightning's log, which syncs now
    sites.install(module)
    module.log("loss", 1.0, sync_dist=True)
    module.log("acc", 1.0)  # no sync: not a value the strategy reduces
    assert seen == [("training_step", "loss"), None] and sites.current is None
    assert sites.sites[("training_step", "loss")].endswith(
        " in test_the_logged_value_is_known_inside_its_log_call_only"
    )
    sites.uninstall()


def test_collective_call_history_is_kept_per_group():
    audit = CallAudit()
    audit.add([CollectiveCall("0", seq, "all_reduce", ((1,),), ("Float",)) for seq in range(1, 300)])
    assert len(audit.calls["0"]) == 256 and audit.calls["0"][-1].seq == 299


@pytest.mark.parametrize("background", [True, False])
def test_only_a_background_audit_lets_the_gil_go_around_its_dump(
    recorder: FakeRecorder, monkeypatch: pytest.MonkeyPatch, background: bool
):
    # on the heartbeat thread the dump lets a training thread take the GIL around its parts; in a beat on the training
    # thread (Heartbeat.inline) those sleeps would only make that thread wait longer
    sleeps: list[float] = []
    monkeypatch.setattr(audit_module, "let_go_of_the_gil", lambda: sleeps.append(1.0))
    clock = [100.0]
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: clock[0])
    audit = RecorderAudit(0, 2, interval=5.0, entries=16, cpu_share=1.0)
    clock[0] += 5.0
    recorder.call(8)
    audit.dump_if_due(background=background)
    if not background:
        audit.continue_fetched()  # the training thread's next step: the unpickling
        audit.continue_fetched()  # and the one after: the parsing
    assert recorder.dumps == 1 and audit.calls.newest == {"0": 8}
    # before the dump, between it and its parsing, after it, and between the two chunks of 4 entries
    assert len(sleeps) == (4 if background else 0), sleeps


def test_a_training_thread_dumps_unpickles_and_parses_at_three_steps_all_budgeted_superseded_by_any_later_dump(
    recorder: FakeRecorder, monkeypatch: pytest.MonkeyPatch
):
    # torch's dump, its unpickling and the parsing (up to about 0.7, 0.4 and 0.8 ms with cold caches): one a step
    clock, cpu = [100.0], [0.0]
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(audit_module.time, "thread_time", lambda: cpu[0])

    def costs(seconds: float, work: Callable[..., Any]) -> Callable[..., Any]:
        def costly(*args: Any) -> Any:
            cpu[0] += seconds
            return work(*args)

        return costly

    monkeypatch.setattr(audit_module, "collective_dump_pickled", costs(7e-4, recorder.pickled))
    monkeypatch.setattr(audit_module, "collective_dump_unpickled", costs(4e-4, recorder.unpickled))
    monkeypatch.setattr(audit_module, "calls_from_trace", costs(2e-4, audit_module.calls_from_trace))
    audit = RecorderAudit(0, 2, interval=5.0, entries=16, cpu_share=1e-4)
    clock[0] += 5.0
    recorder.call(4)
    audit.dump_if_due(background=False)  # a step: torch's dump alone
    assert audit.fetched and audit.calls.newest == {} and recorder.dumps == 1
    assert not audit.dump_due() and audit._next == 110.0  # none due before the unpickling schedules the next
    audit.continue_fetched()  # the next step: the unpickling, which holds the counters: the next dump's time
    assert audit.fetched and audit.calls.newest == {}
    assert audit._next == pytest.approx(105.0 + (7e-4 + 4e-4) / 1e-4)  # the dump's and the unpickling's CPU
    audit.continue_fetched()  # the step after: the parsing, whose CPU pushes the next dump later too
    assert not audit.fetched and audit.calls.newest == {"0": 4}
    assert audit._next == pytest.approx(105.0 + (7e-4 + 4e-4 + 2e-4) / 1e-4)
    clock[0] = audit._next
    recorder.call(4)
    audit.dump_now()  # a training epoch starts: whatever the budget, and its work counts in none
    before = audit._next
    audit.continue_fetched()
    audit.continue_fetched()
    assert audit._next == before and audit.calls.newest == {"0": 8} and recorder.dumps == 2
    for superseding in ("update", "_dump"):  # a stage's end on the training thread; the heartbeat thread's dump
        for unpickled in (False, True):
            clock[0] = audit._next
            recorder.call(2)
            audit.dump_if_due(background=False)
            if unpickled:
                audit.continue_fetched()
            assert audit.fetched
            recorder.call(2)
            getattr(audit, superseding)()  # its dump holds the newest entries
            assert not audit.fetched and audit.calls.newest == {"0": recorder.entries[-1]["collective_seq_id"]}
            audit.continue_fetched()  # nothing left
            assert not audit.fetched
    assert audit.calls.newest == {"0": 24} and recorder.dumps == 10


def test_on_the_training_thread_a_beat_never_dumps_the_dump_has_a_step_of_its_own_and_the_next_beat_publishes(
    recorder: FakeRecorder,
):
    # a beat on the training thread (Heartbeat.inline) publishes and compares; the dump it found due runs at the next
    # step (DesyncMonitor._dump_in_step through Heartbeat.at_next_step): no step takes a beat and a dump
    store = torch.distributed.HashStore()
    ranks = [RecorderAudit(r, 2, interval=0.0) for r in (0, 1)]
    recorder.call(3)
    assert compare(ranks[1], store) is None  # rank 1, on its heartbeat thread: dumps and publishes at once
    assert store.check([ranks[1].key])
    recorder.entries[1] = entry(2, line=99)  # rank 0's call #2 from another line
    assert ranks[0].dump_due() and compare(ranks[0], store, background=False) is None
    assert recorder.dumps == 1 and ranks[0].dump_due()  # the beat did not dump: still due
    ranks[0].dump_if_due(background=False)  # the next training step: torch's dump only
    assert recorder.dumps == 2 and ranks[0].fetched and ranks[0].calls.newest == {}  # nothing parsed yet
    ranks[0].continue_fetched()  # the step after it: the unpickling
    assert ranks[0].fetched and ranks[0].calls.newest == {}
    ranks[0].continue_fetched()  # the step after that: the parsing
    assert not ranks[0].fetched and not store.check([ranks[0].key]) and ranks[0].due()  # published at the next beat
    ranks[0]._next = float("inf")  # no new dump is due then: the beat publishes what the step's dump found
    assert compare(ranks[0], store, background=False) == ("0", 2) and recorder.dumps == 2
    assert store.check([ranks[0].key]) and not ranks[0].due()


def test_a_recorder_keeping_more_than_the_audits_entries_ends_the_dumps_during_training_with_one_warning_on_rank_0(
    recorder: FakeRecorder, monkeypatch: pytest.MonkeyPatch
):
    """A group made before the strategy's: torch's 2000 entries, whose dump holds the GIL about 20 ms (issue 30)."""
    recorder.size = 2000
    clock = [100.0]
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: clock[0])
    store = torch.distributed.HashStore()
    ranks = [RecorderAudit(rank, 2, interval=5.0, entries=8, cpu_share=1.0) for rank in (0, 1)]
    recorder.call(6)
    clock[0] += 5.0
    for audit in ranks:  # a recorder holding no more than the audit's size shows nothing yet
        compare(audit, store)
        assert audit.oversized is None
    recorder.call(30, line=11)
    clock[0] += 5.0
    with pytest.warns(UserWarning) as shown:
        compare(ranks[0], store)
        compare(ranks[1], store)
    assert [str(w.message) for w in shown] == [audit_module.OVERSIZED_RING.format(entries=36, most=8)]  # rank 0's
    assert "TORCH_FR_BUFFER_SIZE=8" in str(shown[0].message) and "init_process_group" in str(shown[0].message)
    assert [audit.oversized for audit in ranks] == [36, 36]
    assert [audit.calls.newest for audit in ranks] == [{"0": 36}, {"0": 36}]  # that dump's calls are still audited
    dumps = recorder.dumps
    recorder.call(100)
    clock[0] += 60.0
    for audit in ranks:  # no dump during training from now on: not at a beat, not as an epoch starts
        assert not audit.due() and not audit.dump_due()
        audit.dump_if_due()
        audit.dump_if_due(background=False)
        audit.dump_now()
        assert not audit.fetched
    assert recorder.dumps == dumps
    assert ranks[0].update()["0"] and recorder.dumps == dumps + 1  # a stage's end still dumps, compared everywhere
    assert ranks[0].calls.newest == {"0": 136}


def test_a_recorder_the_strategy_did_not_size_ends_the_dumps_during_training_at_set_up(
    monkeypatch: pytest.MonkeyPatch,
):
    """The process's first group was not the strategy's: the recorder keeps torch's 2000 (the life cycle passes
    ``recorder_size()``), and the monitor knows it before training, before a dump could hold them all."""
    monkeypatch.setattr(desync_module, "collective_trace", list)  # nothing recorded yet: the ring is empty
    with pytest.warns(UserWarning) as shown:
        monitor = DesyncMonitor(FakeControl(), CallNotes(), recorder_entries=2000)  # type: ignore[arg-type]
    assert monitor.recorder.oversized == 2000 and not monitor.recorder.dump_due()
    assert [str(w.message) for w in shown] == [audit_module.OVERSIZED_RING.format(entries=2000, most=TRACE_ENTRIES)]
    sized = DesyncMonitor(FakeControl(), CallNotes(), recorder_entries=TRACE_ENTRIES)  # type: ignore[arg-type]
    assert sized.recorder.oversized is None


def test_the_training_threads_own_dump_shows_an_oversized_recorder_too(recorder: FakeRecorder):
    recorder.size = 2000
    recorder.call(9)
    audit = RecorderAudit(1, 2, interval=5.0, entries=8, cpu_share=1.0)  # rank 1: no warning
    audit.dump_now()
    audit.continue_fetched()  # the unpickling, where the entries are first seen
    assert audit.oversized == 9 and not audit.dump_due()
    small = RecorderAudit(1, 2, interval=5.0, entries=8, cpu_share=1.0)
    recorder.size = 8  # the strategy's size: the recorder never holds more
    small.dump_now()
    small.continue_fetched()
    assert small.oversized is None
