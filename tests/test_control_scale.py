"""The control plane's store work per rank does not grow with the world size (issue 32): counted, not timed.

Up to 48 ranks are simulated by threads, each with its own counting view of one in-memory store; the counts are
exact whatever the machine's load, so they are compared between world sizes directly.
"""

from __future__ import annotations

import array
import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy.control import ControlPlane
from ddp_strategy.desync import CallNotes, DesyncMonitor, RankReport
from ddp_strategy.errors import CollectiveMismatchError

pytestmark = pytest.mark.serial  # dozens of threads with sub-second waits: run alone (make test)


class CountingStore:
    """One rank's connection to a shared store: counts its calls and the keys they touch (``by_key``: per key)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops = 0
        self.keys = 0
        self.by_key: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, keys: int, key: str = "") -> None:
        with self._lock:
            self.ops += 1
            self.keys += keys
            self.by_key[key] = self.by_key.get(key, 0) + 1

    def set(self, key: str, value: str) -> None:
        self._count(1, key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count(1, key)
        return bytes(self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(len(keys), "multi_get")
        return list(self.inner.multi_get(keys))

    def check(self, keys: list[str]) -> bool:
        self._count(len(keys), keys[0] if len(keys) == 1 else "")
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._count(len(keys))
        self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count(1, "delete_key")
        return bool(self.inner.delete_key(key))

    def add(self, key: str, amount: int) -> int:
        self._count(1, key)
        return int(self.inner.add(key, amount))

    def append(self, key: str, value: str) -> None:
        self._count(1)
        self.inner.append(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._count(1, key)
        return bytes(self.inner.compare_set(key, expected, desired))


def counted_planes(
    world_size: int, timeout: float, heartbeat: Any = 0
) -> tuple[list[ControlPlane], list[CountingStore], Any]:
    """``world_size`` simulated ranks on one in-memory store, each through its own counting view.

    ``heartbeat``: the interval for every rank, or a function of the rank (``0``: no heartbeat thread).
    """
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    interval = heartbeat if callable(heartbeat) else (lambda _: heartbeat)
    planes = [
        ControlPlane(
            rank=r, world_size=world_size, store=stores[r], group=None, timeout=timedelta(seconds=timeout),
            heartbeat_interval=interval(r),
        )
        for r in range(world_size)
    ]  # fmt: skip
    return planes, stores, shared


def late_rank_barrier(world_size: int, late: float, timeout: float = 30.0) -> tuple[list[CountingStore], Any]:
    """Every rank enters barrier 'save'; rank 0 (writing a checkpoint) ``late`` seconds after the others.

    Returns each rank's store view (its count covers the barrier only: no heartbeat thread) and the shared store.
    """
    planes, stores, shared = counted_planes(world_size, timeout)
    for store in stores:
        store.ops = store.keys = 0  # count the barrier, not the construction
    assert barrier_on_threads(planes, lambda rank: late if rank == 0 else 0.0) == []
    return stores, shared


def barrier_on_threads(planes: list[ControlPlane], delay: Any) -> list[BaseException]:
    """Each plane enters barrier 'save' on a thread of its own, ``delay(rank)`` s late; closes them; the errors."""
    errors: list[BaseException] = []

    def rank(plane: ControlPlane) -> None:
        try:
            time.sleep(delay(plane.rank))
            plane.barrier("save")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(p,)) for p in planes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated rank hung"
    for plane in planes:
        plane.close()
    return errors


#: store operations of one scan by a barrier's leader: a read of the arrivals, a read of the ranks that published a
#: position (each one `compare_set` that never waits: `store.get_if_set`), one batched read of the missing ranks'
#: positions (up to 256 of them)
SCAN_OPS = 3


def test_a_barrier_with_a_late_rank_costs_each_rank_the_same_few_operations_at_8_and_48_ranks():
    # before issue 32 every waiting rank polled `check` of all W arrival keys every 0.5-20 ms and, once a second,
    # each missing key alone: O(W) keys per poll, O(W^2) in all
    counts = {}
    for world_size in (8, 48):
        stores, _ = late_rank_barrier(world_size, late=1.5)
        scans = [s.by_key.get("barrier/0/arrived", 0) for s in stores]
        assert sum(1 for n in scans if n) == 1  # one rank (the first to arrive) watches the others
        deleted = [s.by_key.get("delete_key", 0) for s in stores]
        assert sorted(deleted)[-2:] == [0, 5]  # the last rank to leave deletes the barrier's 5 keys
        # without the leader's scans (once per second while rank 0 is missing: how many depends on the clock) and
        # the deletes: arrive (publish, append, compare_set, add), up to 4 quick looks, one blocking wait, get, leave
        counts[world_size] = sorted(s.ops - SCAN_OPS * n - d for s, n, d in zip(stores, scans, deleted, strict=True))
        assert max(counts[world_size]) <= 12, (world_size, counts[world_size])
        lead = scans.index(max(scans))
        # keys touched: its scans read the arrival list and the one missing rank's position, not W keys
        assert stores[lead].keys - SCAN_OPS * scans[lead] - deleted[lead] <= 12
    assert max(counts[48]) == max(counts[8])  # the same work per rank at 6 times the ranks


def test_a_barrier_leaves_no_key_behind():
    _, shared = late_rank_barrier(16, late=0.2)
    # left per run: each rank's position and the list of ranks that published one (one key for all)
    assert shared.num_keys() == 16 + 1


def test_rank0_only_barrier_is_named_by_the_leader_alone():
    # 32 ranks, rank 0 enters a barrier no one else does: rank 0 leads it and reads the 31 missing positions in one
    # batched read per scan, instead of 31 single reads
    world_size = 32
    planes, stores, _ = counted_planes(world_size, timeout=1.0)
    for plane in planes[1:]:
        plane.heartbeat.note_step(7)
        plane.heartbeat.publish(plane.store)  # as its heartbeat thread would
    stores[0].ops = stores[0].keys = 0
    with pytest.raises(CollectiveMismatchError) as info:
        planes[0].barrier("only_rank0", site="train.py:10 in training_step")
    assert info.value.missing_ranks == tuple(range(1, world_size))
    text = str(info.value)
    assert "rank(s) 1-31 never arrived" in text and "rank 1: training step 7" in text
    assert "(15 more rank(s) not shown)" in text  # 16 positions travel in the verdict, not 31
    assert stores[0].ops <= 20  # arrive, quick looks, wait, one scan at the timeout (arrived + one batched read)
    for plane in planes:
        plane.close()


class _Beat:
    """What a DesyncMonitor reads and sets of its control plane's heartbeat (no threads)."""

    interval = 1.0
    fast_beat = False
    inline = False  # a beat on the heartbeat thread (Heartbeat.inline)

    def __init__(self) -> None:
        self.position = type("P", (), {"kind": "barrier"})()
        self.wake_tasks: list[Any] = []  # left for the heartbeat thread's next wake-up (Heartbeat.at_next_wake)

    @property
    def mark(self) -> object:  # as Heartbeat.mark: changes whenever the position does
        return self.position

    def add_beat(self, hook: Any) -> None:
        pass

    def failures_published(self, store: Any) -> int:
        return int(store.add("failure/count", 0))

    def publish_if_due(self, store: Any) -> None:
        pass  # as Heartbeat.publish_if_due without a heartbeat thread

    def read_with_failures(self, store: Any, keys: list[str]) -> list[bytes]:
        return list(store.multi_get(["failure/count", *keys]))[1:]  # as Heartbeat's, no failure published here

    def at_next_wake(self, task: Any) -> None:
        self.wake_tasks[:] = [task]  # as Heartbeat's: replaces a task not run yet


class _Control:
    """What a DesyncMonitor's inquiry reads of its control plane (one simulated rank, no threads)."""

    def __init__(self, rank: int, world_size: int, store: CountingStore) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.desync_error: CollectiveMismatchError | None = None
        self.in_barrier = None
        self.heartbeat: Any = _Beat()
        store.inner.add("failure/count", 0)  # as Heartbeat.start (not counted: the beats are)

    def forget_at_close(self, *keys: str, shared: bool = False) -> None:
        pass


def inquiry(world_size: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[CountingStore], list[Any]]:
    """Every rank answers inquiry 1: rank 0 waits in barrier 'only_rank0', the others in the next all-reduce."""
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    controls = [_Control(r, world_size, stores[r]) for r in range(world_size)]
    monitors = [DesyncMonitor(c, CallNotes()) for c in controls]  # type: ignore[arg-type]

    def report(self: DesyncMonitor) -> RankReport:
        rank = self.control.rank
        waiting = "barrier 3 'only_rank0'" if rank == 0 else "collective 0#7"
        site = "train.py:55 in training_step" if rank == 0 else ""
        return RankReport(rank=rank, calls=(), waiting=waiting, waiting_since=1.0, barrier_site=site, step=2)

    monkeypatch.setattr(DesyncMonitor, "report", report)
    monkeypatch.setattr(DesyncMonitor, "_current_wait", lambda self: ("", 0.0))
    shared.add("desync/inquiry", 1)  # rank 0 opened inquiry 1
    results: list[Any] = [None] * world_size

    def answer(rank: int) -> None:
        results[rank] = monitors[rank]._answer(stores[rank], 1)

    threads = [threading.Thread(target=answer, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated rank hung"
    return stores, results


def test_a_desync_inquiry_costs_each_rank_the_same_few_operations_at_8_and_32_ranks(monkeypatch):
    # before issue 32 every rank looped over W single checks and 2W position reads every 50 ms, then read all W
    # reports (W^2 reports through the store); now one rank reads the reports, in batches, and writes the verdict
    per_world = {}
    for world_size in (8, 32):
        stores, results = inquiry(world_size, monkeypatch)
        texts = {str(error) for error in results}
        assert len(texts) == 1 and "wait at barrier 'only_rank0'" in texts.pop()  # the same verdict everywhere
        deciders = [s for s in stores if s.by_key.get("multi_get")]
        assert len(deciders) == 1  # only the rank that completed the count read the reports
        assert deciders[0].by_key["multi_get"] == -(-world_size // 16)  # in batches of 16
        # each look at the verdict (paced by W: 50 ms up to 64 ranks) is one loop of three reads: the verdict, the
        # newest inquiry's number, the count of failed ranks
        looks = [s.by_key.get("desync/verdict/1", 0) for s in stores]
        others = [s.ops - 3 * n for s, n in zip(stores, looks, strict=True) if s is not deciders[0]]
        # set(report), add(reported), get(verdict), add(read), append(holding), and the last reader's two deletes:
        # the same at any world size
        assert max(others) <= 6, others
        per_world[world_size] = max(others)
    assert per_world[32] == per_world[8]
    # left: the inquiry counter, the stuck-rank counter (both made by the monitor at its start, so that a beat reads
    # them in one multi_get), who holds the verdict, the failure count (all four deleted at the control plane's
    # close); the reports, the report count, the verdict and its read count are gone
    assert stores[0].inner.num_keys() == 4
    for key in ("desync/inquiry", "desync/stuck", "desync/holding", "failure/count"):
        assert stores[0].inner.check([key])


class _BeatingBeat(_Beat):
    """A :class:`_Beat` whose beat hooks run: what :meth:`DesyncMonitor.beat` sets and reads besides the store."""

    def set_waiting(self, what: str, since: float) -> None:
        pass

    def set_ledger(self, calls: int, digest: int) -> None:
        pass

    def read_position(self, store: Any, rank: int) -> None:
        return None


class _BeatingControl(_Control):
    """A :class:`_Control` with a :class:`_BeatingBeat`."""

    def __init__(self, rank: int, world_size: int, store: CountingStore) -> None:
        super().__init__(rank, world_size, store)
        self.heartbeat = _BeatingBeat()


def test_a_rank_stuck_in_a_wait_beats_with_one_store_operation_at_any_world_size(monkeypatch):
    # while a rank waits (a late rank at a checkpoint barrier, a slow collective) it beats fast, to answer an
    # inquiry within a fraction of a second: each of those beats is one multi_get of three counters (the heartbeat's
    # failure count with the monitor's two), whatever W is (before issue 32: two adds and a read of the next rank's
    # position on every beat)
    monkeypatch.setattr(DesyncMonitor, "_current_wait", lambda self: ("collective 0#7", time.time() - 60))
    per_beat = {}
    for world_size in (8, 64):
        shared = dist.HashStore()
        stores = [CountingStore(shared) for _ in range(2)]  # the training thread's and the beat thread's
        control = _BeatingControl(1, world_size, stores[0])
        monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
        monitor.beat(stores[1])  # the first: counts itself stuck, looks at the next rank's ledger
        assert control.heartbeat.fast_beat
        stores[1].ops, stores[1].by_key = 0, {}
        for _ in range(10):
            monitor.beat(stores[1])
        per_beat[world_size] = stores[1].ops / 10
        assert stores[1].by_key == {"multi_get": 10}
    assert per_beat == {8: 1.0, 64: 1.0}


def test_ranks_that_fail_together_survey_their_peers_once(caplog):
    # rank 15 dies (its heartbeat stops); ranks 1-14 get a backend error each and diagnose at once (rank 0, the
    # store's host, runs on: when it fails, the others stop publishing, as its store is about to go): one of them
    # reads every rank's position and publishes what it found, the others read that one key
    from ddp_strategy.peers import diagnose_failed_peers

    world_size = 16
    planes, stores, _ = counted_planes(world_size, timeout=5, heartbeat=lambda r: 0.05 if r < world_size - 1 else 0)
    time.sleep(0.2)  # every live rank has published a heartbeat
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    found: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda p=p: found.__setitem__(p.rank, diagnose_failed_peers(p, error)))
        for p in planes[1:-1]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a simulated rank hung"
    assert sorted(found) == list(range(1, 15)) and all(d is not None for d in found.values())
    surveyors = [rank for rank in range(15) if stores[rank].by_key.get("multi_get")]
    assert len(surveyors) == 1  # one rank read the positions (batched); before issue 32 all 14 did, 10 times a second
    assert found[surveyors[0]].gone == (15,)
    # the others named rank 15 from the survey, or the surveyor's own failure, published while it surveyed, if their
    # heartbeat thread read that first (which failure of simultaneous ones counts as the first: issue 29)
    assert all(d.gone == (15,) or d.failed == (surveyors[0],) for d in found.values())
    for plane in planes:
        plane.close()


def test_after_an_inquiry_finds_nothing_in_a_wait_the_ranks_beat_at_the_normal_pace_again(monkeypatch):
    # every rank waits in the same collective for minutes (a long checkpoint write on another thread, a slow loader):
    # the one inquiry for that wait finds no divergence, and is not reopened while the wait lasts; the fast beats,
    # there to answer an inquiry quickly, stop too (before: 5 polls a second per rank for the whole wait)
    world_size = 8
    wait = ["collective 0#7"]
    monkeypatch.setattr(DesyncMonitor, "_current_wait", lambda self: (wait[0], time.time() - 60))
    monkeypatch.setattr(
        DesyncMonitor,
        "report",
        lambda self: RankReport(rank=self.control.rank, calls=(), waiting=wait[0], waiting_since=1.0, step=2),
    )
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    controls = [_BeatingControl(r, world_size, stores[r]) for r in range(world_size)]
    monitors = [DesyncMonitor(c, CallNotes()) for c in controls]  # type: ignore[arg-type]
    fast_before: dict[int, bool] = {}

    def beat_until_answered(monitor: DesyncMonitor, store: CountingStore) -> None:
        monitor.beat(store)  # counts itself stuck
        fast_before[monitor.control.rank] = monitor.control.heartbeat.fast_beat
        deadline = time.monotonic() + 30
        while monitor._answered < 1 and time.monotonic() < deadline:
            monitor.beat(store)
            time.sleep(0.01)

    threads = [threading.Thread(target=beat_until_answered, args=pair) for pair in zip(monitors, stores, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated rank hung"
    assert fast_before == dict.fromkeys(range(world_size), True)  # fast while an inquiry may come
    assert int(shared.add("desync/inquiry", 0)) == 1  # one inquiry for the whole wait
    for monitor, store in zip(monitors, stores, strict=True):
        assert monitor.control.desync_error is None  # nothing diverged
        monitor.beat(store)
        assert not monitor.control.heartbeat.fast_beat  # the normal pace again
    wait[0] = "collective 0#8"  # a new wait: an inquiry may come again, so the beats are fast again
    monitors[3].beat(stores[3])
    assert monitors[3].control.heartbeat.fast_beat


def test_a_beat_on_the_training_thread_reads_nothing_its_look_runs_at_the_heartbeat_threads_next_wake_up(monkeypatch):
    # rank 0's store answers within milliseconds when its host has no idle core, and answering an inquiry waits for
    # every rank's report: a beat run by a training step (Heartbeat.inline) leaves its reads, and the inquiry they
    # find, to the heartbeat thread (before, it read the store itself: up to 3.5 ms of a step's wall time)
    world_size = 2
    monkeypatch.setattr(
        DesyncMonitor,
        "report",
        lambda self: RankReport(rank=self.control.rank, calls=(), waiting="", waiting_since=0.0, step=2),
    )
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    controls = [_BeatingControl(r, world_size, stores[r]) for r in range(world_size)]
    monitors = [DesyncMonitor(c, CallNotes()) for c in controls]  # type: ignore[arg-type]
    beat0 = controls[0].heartbeat
    shared.add("desync/inquiry", 1)  # rank 1 opened inquiry 1
    beat0.inline = True
    stores[0].ops = 0
    monitors[0].beat(stores[0])
    assert stores[0].ops == 0 and len(beat0.wake_tasks) == 1  # no store call: the look at the next wake-up
    assert monitors[0]._answered == 0 and not shared.check(["desync/report/1/0"])  # the training thread went on
    beat0.inline = False  # the heartbeat thread's next wake-up: it reads, answers, and with rank 1's report the verdict
    rank1 = threading.Thread(target=monitors[1]._answer, args=(stores[1], 1))
    rank1.start()
    beat0.wake_tasks.pop()(stores[0])
    rank1.join(timeout=30)
    assert not rank1.is_alive() and monitors[0]._answered == 1
    stores[0].ops = 0
    monitors[0].beat(stores[0])  # on the heartbeat thread (the training thread is not stepping): it reads at once
    assert stores[0].ops > 0 and beat0.wake_tasks == []


def _looking_rank0(peer_audit: dict[str, list[Any]]) -> tuple[CountingStore, DesyncMonitor]:
    """Rank 0 of 2 with rank 1's heartbeat and audit publication (``peer_audit``) in the store: a look's set-up."""
    shared = dist.HashStore()
    store = CountingStore(shared)
    monitor = DesyncMonitor(_BeatingControl(0, 2, store), CallNotes())  # type: ignore[arg-type]
    shared.set("pos/1", json.dumps({"calls": 0, "digest": 0}))  # rank 1's heartbeat
    shared.set(monitor.recorder.peer_key, json.dumps(peer_audit))
    return store, monitor


def _digests(*values: int) -> dict[str, list[Any]]:
    """An audit publication: the default group's calls from #1 on, by their CRC-32s."""
    return {"0": [1, array.array("I", values).tobytes().hex()]}


def test_a_look_reads_the_next_ranks_audited_calls_in_its_one_multi_get(monkeypatch):
    # the look runs on the heartbeat thread, where each answer of the store costs a GIL hand-over: the next rank's
    # audited calls come in the look's one multi_get (a `check` until that rank first published), not in a
    # `check` and a `get` of their own
    store, monitor = _looking_rank0(_digests(7, 8))  # rank 1's calls #1 and #2
    opened: list[int] = []
    monkeypatch.setattr(monitor, "_answer", lambda store, inquiry: opened.append(inquiry))
    monkeypatch.setattr(monitor.recorder, "due", lambda: True)
    for mine, expected in ((_digests(7), {"pos/1", "desync/audit/1", "multi_get"}), (_digests(7, 9), {"multi_get"})):
        monkeypatch.setattr(monitor.recorder, "publish", lambda store, background, mine=mine: mine)
        monitor._next_look = 0.0  # a beat that looks
        store.ops, store.by_key = 0, {}
        monitor.beat(store)
        assert set(store.by_key) - {"desync/inquiry"} == expected, store.by_key  # then one multi_get alone
    assert opened == [1] and monitor._audit_inquired == {("0", 2)}  # call #2 differs: an inquiry, once


def test_a_look_lets_the_gil_go_between_the_ledgers_comparison_and_the_audits(monkeypatch):
    # the look's Python after its read (the next rank's position and audit publication decoded and compared) once
    # held the GIL for 1.133 ms of CPU on the heartbeat thread (bench/results/step_pauses-dump-unpickle-1d38bd0):
    # a short sleep between the two comparisons lets a waiting training thread take the GIL; a look without an
    # audit to compare does not sleep
    from ddp_strategy import desync as desync_module

    mine = _digests(7)
    store, monitor = _looking_rank0(mine)  # rank 1 audited the same call
    order: list[str] = []
    monkeypatch.setattr(desync_module, "let_go_of_the_gil", lambda: order.append("let go"))
    ledger_differs = monitor._ledger_differs
    monkeypatch.setattr(monitor, "_ledger_differs", lambda peer: order.append("ledger") or ledger_differs(peer))
    compare = monitor.recorder.compare_with_peer
    monkeypatch.setattr(
        monitor.recorder, "compare_with_peer", lambda mine, peer: order.append("audit") or compare(mine, peer)
    )
    monkeypatch.setattr(monitor.recorder, "publish", lambda store, background: mine)
    for due, expected in ((True, ["ledger", "let go", "audit"]), (False, ["ledger"])):
        monkeypatch.setattr(monitor.recorder, "due", lambda due=due: due)
        order.clear()
        monitor._next_look = 0.0  # a beat that looks
        monitor.beat(store)
        assert order == expected
    assert monitor._audit_inquired == set() and monitor.control.desync_error is None  # the same call: nothing to ask


def test_a_beat_on_the_training_thread_leaves_the_audits_dump_to_the_next_step(monkeypatch):
    # the dump (about 0.7 ms with cold caches), its unpickling (0.4), its parsing (0.8) and a beat (about 0.3 ms):
    # any two in one step could pause it over 1 ms, so each has a step of its own
    shared = dist.HashStore()
    control = _BeatingControl(0, 2, CountingStore(shared))
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    recorder = monitor.recorder
    dumps: list[bool] = []
    pieces: list[str] = []

    def dump(*, background: bool = True) -> int:  # the heartbeat thread's: all of it at once
        dumps.append(background)
        return 0

    def fetch() -> bool:  # the training thread's: torch's dump only
        dumps.append(False)
        recorder._pickled = b"..."
        return True

    def unpickle(pickled: bytes) -> None:
        pieces.append("unpickle")
        recorder._pickled, recorder._fetched = None, []

    def parse(fetched: list[Any]) -> None:
        pieces.append("parse")
        recorder._fetched = None

    monkeypatch.setattr(recorder, "_dump", dump)
    monkeypatch.setattr(recorder, "_fetch", fetch)
    monkeypatch.setattr(recorder, "_unpickle_fetched", unpickle)
    monkeypatch.setattr(recorder, "_parse_fetched", parse)
    tasks: list[Any] = []
    control.heartbeat.at_next_step = tasks.append  # type: ignore[attr-defined]
    recorder._next = 0.0  # a dump is due
    control.heartbeat.inline = True
    monitor.beat(CountingStore(shared))
    assert dumps == [] and len(tasks) == 1  # none in the beat: one for the next step
    tasks[0]()  # that step
    assert dumps == [False] and not recorder.dump_due()  # the training thread's dump; the next one later
    assert tasks[1:] == [monitor._continue_in_step] and pieces == []  # the rest at the steps after
    tasks[1]()
    assert pieces == ["unpickle"] and tasks[2:] == [monitor._continue_in_step]
    tasks[2]()
    assert pieces == ["unpickle", "parse"] and len(tasks) == 3  # done: no task left
    control.heartbeat.inline = False  # on the heartbeat thread (the training thread is not stepping): in the beat
    recorder._next = monitor._next_look = 0.0  # a dump due, and a beat that looks (once an interval)
    monitor.beat(CountingStore(shared))
    assert dumps == [False, True] and len(tasks) == 3
    monitor.audit_now()  # a training epoch starts: the dump now, whatever the budget; the rest at the next steps
    assert dumps == [False, True, False] and tasks[3:] == [monitor._continue_in_step]


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_get_if_set_reads_a_key_in_one_operation_without_waiting_or_creating_it(kind):
    from ddp_strategy.store import get_if_set

    base = (
        dist.HashStore()
        if kind == "hash"
        else dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    )
    store = CountingStore(dist.PrefixStore("run/", base))
    started = time.monotonic()
    assert get_if_set(store, "pos/3") is None  # a plain `get` would wait up to the store's timeout here
    assert time.monotonic() - started < 5
    assert not store.inner.check(["pos/3"])  # nothing was set
    store.inner.set("pos/3", "")
    assert get_if_set(store, "pos/3") == b""
    store.inner.set("pos/3", '{"kind": "training step"}')
    assert get_if_set(store, "pos/3") == b'{"kind": "training step"}'
    assert store.ops == 3


def test_a_barrier_on_a_real_libuv_store_wakes_no_rank_before_its_outcome():
    # torch's libuv TCPStore server wakes every waiter of a key on a compare_set of it, even one that sets nothing
    # (torch 2.14.1). Read with `store.get_if_set`, a barrier's `done` ended the waits of the ranks that arrived
    # first as soon as a later rank looked, and they read an empty outcome: "could not reach the rendezvous store"
    # (seen with 64 simulated ranks in bench/control_plane_scale.py). The keys a rank waits for are read with
    # check + get; ranks arriving 10 ms apart while the first ones already wait show it.
    world_size = 16
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    clients = [
        dist.TCPStore("127.0.0.1", master.port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
        for _ in range(2 * world_size)
    ]
    spares = {r: [dist.PrefixStore("run/", clients[world_size + r])] for r in range(world_size)}
    planes = [
        ControlPlane(
            rank=r, world_size=world_size, store=dist.PrefixStore("run/", clients[r]), group=None,
            timeout=timedelta(seconds=30), heartbeat_interval=0, store_factory=lambda r=r: spares[r].pop(),
        )
        for r in range(world_size)
    ]  # fmt: skip
    assert barrier_on_threads(planes, lambda rank: 1.0 if rank == 0 else 0.01 * rank) == []
