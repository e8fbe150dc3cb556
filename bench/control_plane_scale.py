"""The control plane's traffic to the rendezvous store at scale: store operations per rank and per second, by state.

    python bench/control_plane_scale.py --label before --src-commit c03552a   # W = 8, 64, 256 (~6 minutes)
    python bench/control_plane_scale.py --worlds 8,32,64,128,256,512 --label after
    python bench/control_plane_scale.py --quick --out /tmp/cps               # W = 8, 32, short windows (CI smoke)

Issue 32 asks that every control-plane path make O(1) store operations per rank, per second and per event,
whatever the world size W. This measures it with the package's real code (``ControlPlane``, ``DesyncMonitor``,
``PreemptionAgreement``; of the working tree, or of ``--src-commit``) and a real ``torch.distributed.TCPStore``:

* **One real store server.** A child process hosts ``TCPStore(is_master=True, use_libuv=True)``, as rank 0's
  process does. Its CPU time (utime + stime from ``/proc/<pid>/stat``) is read at both ends of every measured
  window: *server busy* = server CPU seconds / wall seconds (1.0 = one core; its libuv loop is one thread).
* **Threads as ranks.** W simulated ranks run as threads of this process. Each has its own client connections:
  one for its training thread, one for its heartbeat thread (``heartbeat_store=``), more from ``store_factory=``.
  Every connection is wrapped in a :class:`CountingStore`, which prefixes keys with a fresh namespace per state
  (as ``PrefixStore`` does) and counts, per rank, operations (one per call), keys touched (a ``check`` or
  ``multi_get`` of N keys touches N) and payload bytes (keys and values sent and received; no protocol framing).
  Each rank gets a ``ControlPlane`` (``group=None``: no gloo, so only store traffic exists and gloo barriers or
  agreements are out of scope) with ``heartbeat_interval=1.0`` and a ``DesyncMonitor``, as the strategy builds
  them. The connections are opened once per W and reused by every state (opening one costs a reverse DNS lookup
  of 127.0.0.1 in torch's client, which this sandbox's resolver sometimes answers only after 5 s).
* **A fake Flight Recorder per rank.** ``collective_status``, ``collective_trace`` and ``_training_thread_in_torch``
  in ``ddp_strategy.desync`` are replaced by functions that find the simulated rank from the calling thread's name
  and return that rank's fake state (identical all_reduce entries on every rank, ``--trace-entries`` newest ones).
  ``os._exit`` in that module (a rank blocked in a collective exits after a verdict) ends only the calling
  heartbeat thread, and the verdict it prints goes to a counter instead of stderr.

States (each in a fresh namespace; keys left = ``num_keys()`` after the state minus before it):

``steady``: training threads call ``note_step`` every 10 ms; the background traffic (heartbeats, desync beats,
audits) over 6 s. ``barrier-late``: every rank but 0 waits in ``barrier("save")``; rank 0 enters 5 s later
(writing a checkpoint); traffic during the wait, and latency from rank 0's entry to the last rank's return.
``long-wait``: every rank waits in the same backend collective for 10 s; traffic, inquiries opened, verdict.
``desync``: rank 0 waits in ``barrier("only_rank0")``, the others in an all_reduce; time to ``desync_error`` on
every rank. ``failed-peer``: every rank but W-1 waits in ``barrier("save")``, rank W-1 publishes a failure after
1.5 s; time to the ``reason="failed"`` error on every waiting rank. ``preemption``: step loop in lockstep (a
``threading.Barrier`` stands in for DDP's all-reduce) with ``PreemptionAgreement.at_step_boundary`` every ~20 ms;
rank 1 receives SIGTERM at 1.5 s; traffic from then on and time until every rank stopped. (1.5 s rather than 1 s:
the barrier looks at missing ranks, and the agreement polls, every 1 s from the start, so an event at 1 s would
be seen at once by the phase of the clocks.) A state that overruns ``--budget`` is reported "timed out".

Counts are stable from run to run where times are not. The threads share one process (and its GIL) and 2 cores
with the server, so at large W the simulated ranks cannot keep up with what real ranks would ask: the *beat lag*
column (the heartbeat threads' actual / designed beat period) shows it; there, rates are what this machine could
issue and latencies include the simulation's own delay. Above the largest measured W the rows are
**extrapolated**: per state, a least-squares line per-rank ops/s = a + b*W over the measured W that kept up (see
:func:`extrapolate`), times W, times the server CPU per operation measured at the largest W (and the same with
keys touched). The preemption agreement is one event, not a lasting load: it is judged by its operations per rank
for the whole event and, at the extrapolated W, by the store server's time for one event (ops per rank x W x CPU
per op) against a tenth of the 15 s an event may take; the lasting states by their busy fraction. An event's
operations are its window's less the steady state's rate over the same time (:func:`event_ops`): the heartbeats
that run anyway.

**Barrier probe** (``--barrier-processes P``, default 8): one process queues all W training threads, and the W
waiter threads that the barrier's ``done`` wakes at once, behind one GIL, so its "last arrival -> last return"
measures the simulation as much as the protocol. After the barrier-late state, the same barrier (same code, server
and fakes) runs again with the ranks spread over P processes that each open their connections, report ready and
start together; CLOCK_MONOTONIC is shared by the processes, so the latency is the last return anywhere minus rank
0's entry. Real ranks are processes: the target is judged on the probe, the one-process figure shown beside it.
Results: ``bench/results/control_plane_scale_<label>.{json,md}``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib
import inspect
import io
import itertools
import json
import logging
import os
import pickle
import platform
import re
import select
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STATES = ("steady", "barrier-late", "long-wait", "desync", "failed-peer", "preemption")
HEARTBEAT = 1.0  # the strategy's default heartbeat_interval
HOST = "127.0.0.1"
CLIENT_TIMEOUT = timedelta(seconds=60)
BARRIER_TIMEOUT = timedelta(seconds=300)  # the states end long before; a hang is cut by the state's budget
EXTRAPOLATE = (512, 1024, 4096)
FAKE_USER_FILE = "/sim/train.py"  # a user file as the recorder's stacks show it (same on every rank)
FAKE_TORCH_FILE = "/sim/site-packages/torch/distributed/distributed_c10d.py"
_RANK_IN_NAME = re.compile(r"rank(\d+)$")
_SERVER_CODE = (
    "import time, torch.distributed as d\n"
    f"s = d.TCPStore({HOST!r}, 0, is_master=True, wait_for_workers=False, use_libuv=True)\n"
    "print(s.port, flush=True)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)

log = logging.getLogger("control_plane_scale")


class Package:
    """The ``ddp_strategy`` under test, imported from a source tree (the working tree's ``src``, or a commit's)."""

    def __init__(self, src: Path, commit: str, dirty: bool) -> None:
        sys.path.insert(0, str(src))
        for name in [m for m in sys.modules if m == "ddp_strategy" or m.startswith("ddp_strategy.")]:
            del sys.modules[name]
        self.root: Any = importlib.import_module("ddp_strategy")
        if not str(self.root.__file__).startswith(str(src)):
            raise SystemExit(f"ddp_strategy was imported from {self.root.__file__}, not from {src}")
        self.control: Any = importlib.import_module("ddp_strategy.control")
        self.desync: Any = importlib.import_module("ddp_strategy.desync")
        self.errors: Any = importlib.import_module("ddp_strategy.errors")
        self.preemption: Any = importlib.import_module("ddp_strategy.preemption")
        self.source = {"src": str(src), "commit": commit, "dirty": dirty}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def load_package(commit: str | None) -> Package:
    """The package from the working tree's ``src``, or from ``commit``'s ``src`` (extracted to a temporary dir)."""
    if commit is None:
        head = _git("rev-parse", "HEAD")
        return Package(ROOT / "src", head, dirty=bool(_git("status", "--porcelain", "--", "src")))
    full = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    tree = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", full, "src"], capture_output=True, check=True
    )
    target = Path(tempfile.mkdtemp(prefix=f"control-plane-scale-{full[:8]}-"))
    with tarfile.open(fileobj=io.BytesIO(tree.stdout)) as archive:
        archive.extractall(target, filter="data")
    return Package(target / "src", full, dirty=False)


PKG: Package | None = None


def pkg() -> Package:
    """The package under test (loaded by :func:`run`)."""
    if PKG is None:
        raise RuntimeError("load_package first")
    return PKG


class StateOver(ConnectionError):
    """Raised by a :class:`CountingStore` used after its state ended (the thread using it stops)."""


# ---------------------------------------------------------------------------------------------- the store server
class StoreServer:
    """A ``TCPStore`` server in a child process, with its CPU time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_CODE],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        atexit.register(self.kill)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            self.kill()
            raise RuntimeError(f"the store server did not start (got {line!r})")
        self.port = int(line)
        self._tick = os.sysconf("SC_CLK_TCK")

    def cpu_seconds(self) -> float:
        """The server process's utime + stime (all its threads)."""
        return _proc_cpu(self.proc.pid, self._tick)

    def kill(self) -> None:
        """End the server (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _proc_cpu(pid: int | str, tick: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # fields 14 and 15 of proc(5): utime, stime


def new_client() -> Any:
    """A new client connection to the benchmark's store server."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        HOST, _SERVER_PORT[0], is_master=False, use_libuv=True, timeout=CLIENT_TIMEOUT
    )


_SERVER_PORT = [0]


# ---------------------------------------------------------------------------------------------- counting
def _size(value: str | bytes) -> int:
    return len(value.encode()) if isinstance(value, str) else len(value)


class CountingStore:
    """A client connection seen through a key prefix, counting operations, keys and bytes (the ``Store`` protocol).

    Not thread-safe, like the client it wraps: one thread uses it. ``closed`` makes every later call raise.
    """

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.ops = 0
        self.keys = 0
        self.nbytes = 0
        self.calls: Counter[str] = Counter()
        self.closed = False

    def _count(self, method: str, keys: Sequence[str], nbytes: int) -> list[str]:
        if self.closed:
            raise StateOver("the benchmark state is over")
        self.ops += 1
        self.keys += len(keys)
        self.calls[method] += 1
        full = [self.prefix + k for k in keys]
        self.nbytes += nbytes + sum(len(k) for k in full)
        return full

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``."""
        (full,) = self._count("set", [key], _size(value))
        self.client.set(full, value)

    def get(self, key: str) -> bytes:
        """The value of ``key`` (waits for it)."""
        (full,) = self._count("get", [key], 0)
        value: bytes = self.client.get(full)
        self.nbytes += len(value)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in one round trip."""
        values: list[bytes] = self.client.multi_get(self._count("multi_get", keys, 0))
        self.nbytes += sum(len(v) for v in values)
        return values

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Store ``values`` under ``keys``, in one round trip."""
        self.client.multi_set(self._count("multi_set", keys, sum(_size(v) for v in values)), values)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (no wait)."""
        return bool(self.client.check(self._count("check", keys, 1)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key is set."""
        full = self._count("wait", keys, 0)
        if timeout is None:
            self.client.wait(full)
        else:
            self.client.wait(full, timeout)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return bool(self.client.delete_key(self._count("delete_key", [key], 1)[0]))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key``; its new value."""
        return int(self.client.add(self._count("add", [key], 16)[0], amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; the value it holds after."""
        (full,) = self._count("compare_set", [key], _size(expected) + _size(desired))
        value: bytes = self.client.compare_set(full, expected, desired)
        self.nbytes += len(value)
        return value

    def num_keys(self) -> int:
        """The number of keys in the whole store (every namespace)."""
        self._count("num_keys", [], 8)
        return int(self.client.num_keys())

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the value of ``key``."""
        (full,) = self._count("append", [key], _size(value))
        self.client.append(full, value)


@dataclass
class Tally:
    """Counts summed over ranks at one moment, with the clocks."""

    wall: float
    server_cpu: float
    client_cpu: float
    ops: list[int]
    keys: list[int]
    nbytes: list[int]
    calls: Counter[str]
    background_ops: int  # operations on the ranks' connections other than their training threads'
    beats: int
    beat_actual: float
    beat_designed: float


def _beat(control: Any) -> Any:
    """Where the heartbeat's methods are: ``control.heartbeat`` (issue 27), else the control plane (older commits)."""
    heartbeat = getattr(control, "heartbeat", None)
    return heartbeat if heartbeat is not None and hasattr(heartbeat, "note_step") else control


def _interval(control: Any) -> float:
    """The scaled heartbeat interval: ``control.heartbeat.interval``, ``control.heartbeat_interval`` before issue 27."""
    beat = _beat(control)
    return float(beat.interval if beat is not control else control.heartbeat_interval)


class BeatClock:
    """A beat hook (``Heartbeat.add_beat``) timing the heartbeat thread's beats against their designed period.

    The heartbeat waits 0.2 s while ``fast_beat`` is set, else ``heartbeat_interval``, then runs the beat hooks.
    When the simulation cannot keep up (every rank in one process), the beats come later than designed: the ratio
    ``actual / designed`` over a window is the *beat lag* (1.0: on time). :meth:`clocks` counts the interval still
    open (a beat that is late, or still running, counts up to now), so a rank whose beat never comes shows.
    """

    FAST = 0.2  # ControlPlane's fast beat

    def __init__(self, control: Any) -> None:
        self.control = control
        self.beats = 0
        self.actual = 0.0
        self.designed = 0.0
        self._last = time.monotonic()  # the heartbeat thread started with the control plane
        self._next = _interval(control)

    def __call__(self, store: Any) -> None:
        now = time.monotonic()
        self.actual += now - self._last
        self.designed += self._next
        self._last = now
        self.beats += 1
        self._next = self.FAST if getattr(_beat(self.control), "fast_beat", False) else _interval(self.control)

    def clocks(self, now: float) -> tuple[float, float]:
        """``(actual, designed)`` seconds of beats up to ``now``, the open interval included."""
        last, wanted = self._last, self._next
        return self.actual + (now - last), self.designed + min(wanted, now - last)


# ---------------------------------------------------------------------------------------------- fake recorder
@dataclass
class FakeRecorder:
    """One simulated rank's Flight Recorder: its collectives on group "0" and whether its thread is in torch."""

    enqueued: int = 0
    completed: int = 0
    in_torch: bool = False

    def run(self, seq: int) -> None:
        """Collectives up to ``seq`` were made and completed."""
        self.enqueued = self.completed = seq

    def block(self, seq: int) -> None:
        """Collective ``seq`` is pending and the training thread waits in it."""
        self.enqueued, self.completed, self.in_torch = seq, seq - 1, True


_RECORDERS: dict[int, FakeRecorder] = {}
_TRACE_ENTRIES = [16]
_IDLE = FakeRecorder()


def _current_recorder() -> FakeRecorder:
    found = _RANK_IN_NAME.search(threading.current_thread().name)
    return _RECORDERS.get(int(found.group(1)), _IDLE) if found else _IDLE


def fake_collective_status() -> dict[str, tuple[int, int]]:
    """``collective_status`` of the calling thread's simulated rank."""
    recorder = _current_recorder()
    return {"0": (recorder.enqueued, recorder.completed)}


@functools.lru_cache(maxsize=16384)
def _entry(seq: int) -> dict[str, Any]:
    return {
        "pg_id": 0,
        "collective_seq_id": seq,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "frames": [
            {"filename": FAKE_TORCH_FILE, "line": 2800, "name": "all_reduce"},
            {"filename": FAKE_USER_FILE, "line": 42, "name": "training_step"},
        ],
        "time_created_ns": 1_700_000_000_000_000_000 + seq * 10_000_000,
        "is_p2p": False,
    }


def fake_collective_trace(before_parsing: Callable[[], object] | None = None) -> list[dict[str, Any]]:
    """``collective_trace`` of the calling thread's simulated rank: its newest ``--trace-entries`` entries."""
    if before_parsing is not None:
        before_parsing()  # the audit's short sleep between torch's dump and its unpickling
    recorder = _current_recorder()
    first = max(1, recorder.enqueued - _TRACE_ENTRIES[0] + 1)
    return [{**_entry(seq), "retired": seq <= recorder.completed} for seq in range(first, recorder.enqueued + 1)]


def fake_collective_dump(
    before_parsing: Callable[[], object] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """``collective_dump`` of the calling thread's simulated rank: its trace and status."""
    return fake_collective_trace(before_parsing), fake_collective_status()


def fake_collective_dump_pickled() -> bytes:
    """``collective_dump_pickled`` of the calling thread's simulated rank: its dump as bytes."""
    return pickle.dumps(fake_collective_dump())


def fake_collective_dump_unpickled(pickled: bytes) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """``collective_dump_unpickled``: what :func:`fake_collective_dump_pickled` returned, read back."""
    return pickle.loads(pickled)  # this process's own pickle


def fake_training_thread_in_torch() -> bool:
    """``_training_thread_in_torch`` of the calling thread's simulated rank."""
    return _current_recorder().in_torch


class _ProcessStandIn:
    """Stands in for ``os`` inside ``ddp_strategy.desync``: ``_exit`` ends only the calling rank's heartbeat thread."""

    def __init__(self) -> None:
        self.exits: dict[int, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _exit(self, code: int) -> None:
        found = _RANK_IN_NAME.search(threading.current_thread().name)
        self.exits[int(found.group(1)) if found else -1] = time.monotonic()
        raise SystemExit(code)


class _SysStandIn:
    """Stands in for ``sys`` inside ``ddp_strategy.desync``: what it writes to stderr is counted, not shown."""

    def __init__(self) -> None:
        self.lines = 0
        self.first = ""
        self.stderr = self
        self.stdout = self

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        if not self.first:
            self.first = text[:400]
        return len(text)

    def flush(self) -> None:
        """Nothing to flush."""


_PROCESS = _ProcessStandIn()
_SYS = _SysStandIn()


def install_fakes() -> None:
    """Replace the torch inputs (and the process exit) of ``ddp_strategy.desync`` by the simulated ranks' fakes."""
    desync = pkg().desync
    needed = ("collective_status", "collective_trace", "_training_thread_in_torch", "os", "sys")
    missing = [name for name in needed if not hasattr(desync, name)]
    if missing:
        raise SystemExit(f"ddp_strategy.desync has no {', '.join(missing)}: update the benchmark's fakes")
    desync.collective_status = fake_collective_status
    desync.collective_trace = fake_collective_trace
    desync._training_thread_in_torch = fake_training_thread_in_torch
    desync.os = _PROCESS
    desync.sys = _SYS
    try:  # the periodic audit of the recorder, a module of its own since issue 30
        audit = importlib.import_module("ddp_strategy.desync_audit")
    except ModuleNotFoundError:
        return
    for name, fake in (
        ("collective_status", fake_collective_status),
        ("collective_trace", fake_collective_trace),
        ("collective_dump", fake_collective_dump),
        ("collective_dump_pickled", fake_collective_dump_pickled),
        ("collective_dump_unpickled", fake_collective_dump_unpickled),
    ):
        if hasattr(audit, name):
            setattr(audit, name, fake)


class LogCount(logging.Handler):
    """Counts the package's log records by their format string (the messages are not shown)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname}: {str(record.msg)[:120]}"] += 1


# ---------------------------------------------------------------------------------------------- the simulation
@dataclass
class Rank:
    """One simulated rank: its connections, control plane, monitor, fake recorder, and what happened to it."""

    rank: int
    stores: list[CountingStore]
    control: Any  # ddp_strategy.control.ControlPlane
    monitor: Any  # ddp_strategy.desync.DesyncMonitor
    clock: BeatClock
    recorder: FakeRecorder
    done: float | None = None  # when its training thread's task ended (time.monotonic)
    error: BaseException | None = None
    error_at: float | None = None
    result: Any = None


@contextlib.contextmanager
def native_stderr_muted() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: torch's client prints a warning whenever the reverse lookup fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class ClientPool:
    """Client connections opened in parallel once per W and reused by every state.

    Per rank: its training thread's, its heartbeat thread's, and ``spares`` more for ``store_factory`` (a connection
    opened during a state would add the reverse-DNS stall to what the state measures); one more, uncounted, reads
    ``num_keys`` and counters.
    """

    PER_RANK = 2

    def __init__(self, world: int, spares: int, ranks: Sequence[int] | None = None) -> None:
        self.world = world
        #: the simulated ranks this process hosts (every rank, unless a barrier probe spreads them over processes)
        self.ranks = list(range(world)) if ranks is None else list(ranks)
        self.width = self.PER_RANK + spares
        count = self.width * len(self.ranks) + 1
        started = time.monotonic()
        with native_stderr_muted(), ThreadPoolExecutor(max_workers=min(1024, count)) as pool:
            clients = list(pool.map(lambda _: new_client(), range(count)))
        self.observer = clients.pop()
        self.clients = clients
        self.count = count
        self.extra = 0  # connections opened during states because a rank's spares ran out
        self.open_seconds = time.monotonic() - started

    def of(self, rank: int) -> list[Any]:
        """The connections of ``rank``: training thread, heartbeat thread, then the spares."""
        index = rank - self.ranks[0]
        return self.clients[self.width * index : self.width * (index + 1)]


class Sim:
    """The W simulated ranks of one state, in a fresh namespace of the store."""

    def __init__(
        self, pool: ClientPool, server: StoreServer | None, state: str, logs: LogCount, prefix: str | None = None
    ) -> None:
        self.pool = pool
        self.server = server
        self.world = pool.world
        self.state = state
        self.prefix = prefix or f"bench/{uuid.uuid4().hex[:12]}/{state}/"
        self.stop = threading.Event()
        self.logs = logs
        self.keys_before = int(pool.observer.num_keys())
        self.threads_before = set(threading.enumerate())
        _RECORDERS.clear()
        self.ranks: list[Rank] = []
        for rank in pool.ranks:
            recorder = FakeRecorder()
            _RECORDERS[rank] = recorder
            self.ranks.append(self._make_rank(rank, recorder))
        self.threads: list[threading.Thread] = []

    def _make_rank(self, rank: int, recorder: FakeRecorder) -> Rank:
        train_client, beat_client, *spares = self.pool.of(rank)
        stores = [CountingStore(train_client, self.prefix), CountingStore(beat_client, self.prefix)]

        def factory() -> CountingStore:
            if spares:
                client = spares.pop(0)
            else:
                self.pool.extra += 1
                client = new_client()
            store = CountingStore(client, self.prefix)
            stores.append(store)
            return store

        package = pkg()
        control = package.control.ControlPlane(
            rank=rank,
            world_size=self.world,
            store=stores[0],
            group=None,
            timeout=BARRIER_TIMEOUT,
            heartbeat_interval=HEARTBEAT,
            heartbeat_store=stores[1],
            store_factory=factory,
        )
        desync = package.desync
        monitor = desync.DesyncMonitor(control, desync.CallNotes(), ledger=desync.CallLedger())
        clock = BeatClock(control)
        _beat(control).add_beat(clock)  # after the monitor's beat
        return Rank(rank, stores, control, monitor, clock, recorder)

    # -------------------------------------------------------------------------------------- threads
    def start(self, task: Callable[[Rank], Any]) -> None:
        """Run ``task(rank)`` on a daemon thread per rank (its training thread), recording its end or error."""

        def body(sim_rank: Rank) -> None:
            try:
                sim_rank.result = task(sim_rank)
            except BaseException as err:
                sim_rank.error, sim_rank.error_at = err, time.monotonic()
            finally:
                sim_rank.done = time.monotonic()

        for sim_rank in self.ranks:
            thread = threading.Thread(target=body, args=(sim_rank,), name=f"sim-rank{sim_rank.rank}", daemon=True)
            self.threads.append(thread)
        for thread in self.threads:
            thread.start()

    def wait_for(self, condition: Callable[[], bool], deadline: float, poll: float = 0.01) -> bool:
        """Poll ``condition`` until it holds (``True``) or ``deadline`` (``time.monotonic``) passes (``False``)."""
        while not condition():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def sleep(self, seconds: float) -> None:
        """Sleep in a rank's thread; raise :class:`StateOver` once the state is over."""
        if self.stop.wait(seconds):
            raise StateOver("the benchmark state is over")

    # -------------------------------------------------------------------------------------- counts
    def tally(self) -> Tally:
        """The counts and clocks now."""
        ops, keys, nbytes, calls = [], [], [], Counter[str]()
        background = 0
        for sim_rank in self.ranks:
            stores = list(sim_rank.stores)
            ops.append(sum(s.ops for s in stores))
            keys.append(sum(s.keys for s in stores))
            nbytes.append(sum(s.nbytes for s in stores))
            background += ops[-1] - stores[0].ops
            for store in stores:
                calls.update(store.calls)
        now = time.monotonic()
        clocks = [r.clock.clocks(now) for r in self.ranks]
        times = os.times()
        return Tally(
            wall=now,
            server_cpu=self.server.cpu_seconds() if self.server is not None else 0.0,
            client_cpu=times.user + times.system,
            ops=ops,
            keys=keys,
            nbytes=nbytes,
            calls=calls,
            background_ops=background,
            beats=sum(r.clock.beats for r in self.ranks),
            beat_actual=sum(actual for actual, _ in clocks),
            beat_designed=sum(designed for _, designed in clocks),
        )

    def positions(self) -> dict[str, Any]:
        """What the ranks' published positions show now (uncounted): how many wait, how old the heartbeats are."""
        key = str(getattr(pkg().control, "_POSITION_KEY", "pos/{rank}"))
        now = time.time()
        ages, waiting = [], 0
        for rank in range(self.world):
            full = self.prefix + key.format(rank=rank)
            if not self.pool.observer.check([full]):
                continue
            position = json.loads(self.pool.observer.get(full))
            ages.append(now - float(position.get("heartbeat") or 0.0))
            waiting += bool(position.get("waiting"))
        return {
            "published": len(ages),
            "waiting": waiting,
            "heartbeat_age_max_s": max(ages, default=None),
            "heartbeat_older_than_4s": sum(age > 4.0 for age in ages),
        }

    def keys_left(self) -> int:
        """Keys this state added to the store (it ran in a namespace of its own)."""
        return int(self.pool.observer.num_keys()) - self.keys_before

    def read_counter(self, key: str) -> int:
        """The value of counter ``key`` of this namespace (uncounted)."""
        return int(self.pool.observer.add(self.prefix + key, 0))

    # -------------------------------------------------------------------------------------- teardown
    def close(self) -> bool:
        """End the state: every later store call raises, the heartbeats stop; whether every thread ended."""
        self.stop.set()
        for sim_rank in self.ranks:
            for store in list(sim_rank.stores):
                store.closed = True
        for sim_rank in self.ranks:
            with contextlib.suppress(Exception):
                sim_rank.control.close(graceful=False)
        deadline = time.monotonic() + 20
        for thread in set(threading.enumerate()) - self.threads_before:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not (set(threading.enumerate()) - self.threads_before)


def window(first: Tally, last: Tally) -> dict[str, Any]:
    """Rates between two tallies."""
    wall = max(last.wall - first.wall, 1e-9)
    world = len(first.ops)
    ops = [b - a for a, b in zip(first.ops, last.ops, strict=True)]
    keys = [b - a for a, b in zip(first.keys, last.keys, strict=True)]
    nbytes = [b - a for a, b in zip(first.nbytes, last.nbytes, strict=True)]
    calls = last.calls - first.calls
    server = last.server_cpu - first.server_cpu
    beats = last.beats - first.beats
    designed = last.beat_designed - first.beat_designed
    lag = (last.beat_actual - first.beat_actual) / designed if designed > 0 else None
    return {
        "seconds": wall,
        "ops": sum(ops),
        "keys": sum(keys),
        "bytes": sum(nbytes),
        "ops_per_s": sum(ops) / wall,
        "ops_per_rank_s": sum(ops) / world / wall,
        "ops_per_rank_s_max": max(ops) / wall,
        "keys_per_s": sum(keys) / wall,
        "keys_per_rank_s": sum(keys) / world / wall,
        "bytes_per_s": sum(nbytes) / wall,
        "bytes_per_rank_s": sum(nbytes) / world / wall,
        "server_cpu_s": server,
        "server_busy": server / wall,
        "client_busy": (last.client_cpu - first.client_cpu) / wall,
        "beats": beats,
        "beat_lag": lag,
        "background_ops_per_beat": (last.background_ops - first.background_ops) / beats if beats else None,
        "background_ops_per_rank_s": (last.background_ops - first.background_ops) / world / wall,
        "calls": dict(calls.most_common()),
    }


# ---------------------------------------------------------------------------------------------- states
@dataclass
class Timing:
    """The windows of one state's run (the seconds are set by the command line, shorter with ``--quick``)."""

    steady: float = 6.0
    warmup: float = 1.5
    late: float = 5.0
    wait: float = 10.0
    fail_after: float = 1.5  # half a poll interval off the barrier's own 1 s look at the missing ranks
    signal_after: float = 1.5  # half a poll interval off the agreement's own 1 s polls
    step: float = 0.02
    budget: float = 90.0  # seconds a state may take beyond its own windows before it is cut ("timed out")


@dataclass
class Outcome:
    """What one state measured: the traffic window, the latency and notes."""

    traffic: dict[str, Any]
    latency_s: float | None = None
    latency: str = ""
    notes: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"


def _train(sim: Sim, sim_rank: Rank, period: float) -> None:
    """A training loop: one completed all_reduce and one ``note_step`` per step, until the state is over."""
    step = 100
    while True:
        step += 1
        sim_rank.recorder.run(step)
        _beat(sim_rank.control).note_step(step, batch=step, epoch=0, epoch_batch=step)
        sim.sleep(period)


def state_steady(sim: Sim, timing: Timing) -> Outcome:
    sim.start(lambda r: _train(sim, r, 0.01))
    time.sleep(timing.warmup)
    first = sim.tally()
    time.sleep(timing.steady)
    return Outcome(window(first, sim.tally()))


def _enter_training(sim_rank: Rank) -> None:
    sim_rank.recorder.run(100)
    _beat(sim_rank.control).note_step(100, batch=100, epoch=0, epoch_batch=100)


def state_barrier_late(sim: Sim, timing: Timing) -> Outcome:
    entered: list[float] = []

    def task(sim_rank: Rank) -> None:
        _enter_training(sim_rank)
        if sim_rank.rank == 0:
            sim.sleep(timing.late)  # writing a checkpoint
            entered.append(time.monotonic())
        sim_rank.control.barrier("save")

    first = sim.tally()
    sim.start(task)
    deadline = first.wall + timing.late + timing.budget
    sim.wait_for(lambda: bool(entered), deadline)
    at_entry = sim.tally()
    all_back = sim.wait_for(lambda: all(r.done is not None for r in sim.ranks), deadline)
    outcome = Outcome(window(first, at_entry))
    errors = [r for r in sim.ranks if r.error is not None]
    outcome.notes["errors"] = _errors(errors)
    if not entered or not all_back:
        outcome.status = "timed out"
    elif not errors:
        outcome.latency_s = max(r.done for r in sim.ranks if r.done is not None) - entered[0]
        outcome.latency = f"rank 0 enters -> last rank returns: {outcome.latency_s:.2f} s"
    return outcome


def state_long_wait(sim: Sim, timing: Timing) -> Outcome:
    def task(sim_rank: Rank) -> None:
        _enter_training(sim_rank)
        sim_rank.recorder.block(101)
        sim.sleep(timing.wait)
        sim_rank.recorder.run(101)
        sim_rank.recorder.in_torch = False

    first = sim.tally()
    sim.start(task)
    time.sleep(timing.wait)
    outcome = Outcome(window(first, sim.tally()))
    outcome.notes["positions_at_end"] = sim.positions()
    inquiries = sim.read_counter(str(getattr(pkg().desync, "_INQUIRY_KEY", "desync/inquiry")))
    verdicts = [r.control.desync_error for r in sim.ranks if r.control.desync_error is not None]
    verdict = "none" if not verdicts else str(verdicts[0]).splitlines()[0][:160]
    outcome.notes.update({"inquiries": inquiries, "verdict": verdict, "ranks_with_verdict": len(verdicts)})
    outcome.latency = f"inquiries opened: {inquiries}; verdict: {verdict}"
    return outcome


def state_desync(sim: Sim, timing: Timing) -> Outcome:
    def task(sim_rank: Rank) -> None:
        _enter_training(sim_rank)
        if sim_rank.rank == 0:
            sim_rank.control.barrier("only_rank0")
        else:
            sim_rank.recorder.block(101)
            while not sim.stop.is_set():
                sim.sleep(1.0)

    def told(sim_rank: Rank) -> bool:
        mismatch = pkg().errors.CollectiveMismatchError
        return sim_rank.control.desync_error is not None or isinstance(sim_rank.error, mismatch)

    first = sim.tally()
    sim.start(task)
    told_at: dict[int, float] = {}

    def everyone_told() -> bool:
        for sim_rank in sim.ranks:
            if sim_rank.rank not in told_at and told(sim_rank):
                told_at[sim_rank.rank] = time.monotonic()
        return len(told_at) == sim.world

    done = sim.wait_for(everyone_told, first.wall + timing.budget)
    outcome = Outcome(window(first, sim.tally()))
    outcome.notes["positions_at_end"] = sim.positions()
    error = sim.ranks[0].error or sim.ranks[0].control.desync_error
    outcome.notes.update(
        {
            "rank0_error": _describe(error),
            "ranks_with_error": len(told_at),
            "inquiries": sim.read_counter(str(getattr(pkg().desync, "_INQUIRY_KEY", "desync/inquiry"))),
        }
    )
    if not done:
        outcome.status = "timed out"
    else:
        outcome.latency_s = max(told_at.values()) - first.wall
        reason = getattr(error, "reason", None)
        outcome.latency = f"start -> desync_error on every rank: {outcome.latency_s:.2f} s (rank 0: reason={reason})"
    return outcome


def state_failed_peer(sim: Sim, timing: Timing) -> Outcome:
    failed_at: list[float] = []
    last = sim.world - 1

    def task(sim_rank: Rank) -> None:
        _enter_training(sim_rank)
        if sim_rank.rank != last:
            sim_rank.control.barrier("save")
            return
        sim.sleep(timing.fail_after)
        failed_at.append(time.monotonic())
        sim_rank.control.note_failure(RuntimeError("injected"))
        while not sim.stop.is_set():
            sim.sleep(1.0)

    waiting = sim.ranks[:last]
    first = sim.tally()
    sim.start(task)
    deadline = first.wall + timing.fail_after + timing.budget
    done = sim.wait_for(lambda: all(r.done is not None for r in waiting), deadline)
    outcome = Outcome(window(first, sim.tally()))
    errors = [r for r in waiting if r.error is not None]
    reasons = Counter(str(getattr(r.error, "reason", type(r.error).__name__)) for r in errors)
    outcome.notes.update({"reasons": dict(reasons), "errors": _errors(errors)})
    if not done or not failed_at:
        outcome.status = "timed out"
    elif len(errors) == len(waiting):
        outcome.latency_s = max(r.error_at for r in errors if r.error_at is not None) - failed_at[0]
        named = ", ".join(f"{n}x {k}" for k, n in reasons.items())
        outcome.latency = f"failure -> error on every waiting rank: {outcome.latency_s:.2f} s ({named})"
    else:
        outcome.status = "some ranks returned without an error"
    return outcome


def state_preemption(sim: Sim, timing: Timing) -> Outcome:
    lockstep = threading.Barrier(sim.world, timeout=timing.budget)
    preemption = pkg().preemption
    make_agreement = preemption.PreemptionAgreement
    watch = getattr(preemption, "NoticeWatch", None)  # one blocked store wait per rank (absent in older code)

    def agreement_of(r: Rank) -> Any:
        if "start" in inspect.signature(make_agreement).parameters:  # boundary agreement: the watch acknowledges
            notices = watch(r.control.connect(), rank=r.rank, renew=60.0)
            start = preemption.train_position(100)
            return make_agreement(rank=r.rank, world_size=sim.world, start=start, watch=notices)
        if watch is None:
            return make_agreement(rank=r.rank, world_size=sim.world, poll_interval=HEARTBEAT)
        notices = watch(r.control.connect(), rank=r.rank, renew=60.0)  # as PreemptionHandling makes it
        return make_agreement(rank=r.rank, world_size=sim.world, poll_interval=HEARTBEAT, watch=notices)

    agreements = [agreement_of(r) for r in sim.ranks]

    def task(sim_rank: Rank) -> int:
        agreement = agreements[sim_rank.rank]
        step = 100
        try:
            while True:
                step += 1
                sim_rank.recorder.run(step)
                _beat(sim_rank.control).note_step(step, batch=step, epoch=0, epoch_batch=step)
                sim.sleep(timing.step)  # forward and backward
                lockstep.wait()  # DDP's gradient all-reduce: no rank runs ahead
                if agreement.at_step_boundary(sim_rank.control.store, step):
                    return step
        except BaseException:
            lockstep.abort()
            raise

    first = sim.tally()
    sim.start(task)
    time.sleep(timing.signal_after)
    requested = time.monotonic()
    agreements[1].request(signal.SIGTERM)
    at_request = sim.tally()
    done = sim.wait_for(lambda: all(r.done is not None for r in sim.ranks), requested + timing.budget)
    outcome = Outcome(window(at_request, sim.tally()))
    before = window(first, at_request)
    errors = [r for r in sim.ranks if r.error is not None]
    stops = sorted({r.result for r in sim.ranks if r.error is None and r.result is not None})
    outcome.notes.update(
        {
            "before_signal_ops_per_rank_s": before["ops_per_rank_s"],
            "before_signal_keys_per_rank_s": before["keys_per_rank_s"],
            "stop_steps": stops,
            "steps_per_s": (max(stops) - 100) / (time.monotonic() - first.wall) if stops else None,
            "errors": _errors(errors),
        }
    )
    if not done:
        outcome.status = "timed out"
    elif errors:
        outcome.status = "ranks failed"
    else:
        outcome.latency_s = max(r.done for r in sim.ranks if r.done is not None) - requested
        outcome.latency = f"SIGTERM on rank 1 -> every rank stopped: {outcome.latency_s:.2f} s (stop step {stops})"
    return outcome


STATE_RUNNERS: dict[str, Callable[[Sim, Timing], Outcome]] = {
    "steady": state_steady,
    "barrier-late": state_barrier_late,
    "long-wait": state_long_wait,
    "desync": state_desync,
    "failed-peer": state_failed_peer,
    "preemption": state_preemption,
}


# ---------------------------------------------------------------------------------------------- barrier probe
# Real ranks are processes. With every simulated rank a thread of one process, the W training threads and W waiter
# threads that the barrier's `done` wakes at once queue for one GIL, so the time from the last arrival to the last
# return measures the simulation as much as the protocol. The probe runs the barrier-late state's barrier again with
# the ranks spread over several processes (the same code, store server and fakes), for that latency only.
PROBE_FLAG = "--barrier-probe-child"
_PROBE_TAG = "BARRIER-PROBE "
_PROBE_READY, _PROBE_GO = "probe/ready", "probe/go"


def _probe_child(spec: dict[str, Any]) -> None:
    """One probe process: its share of the ranks wait in ``barrier("save")``; rank 0 enters ``late`` s after "go"."""
    global PKG
    PKG = Package(Path(spec["src"]), spec["commit"], dirty=False)
    _TRACE_ENTRIES[0] = spec["trace_entries"]
    _SERVER_PORT[0] = spec["port"]
    install_fakes()
    threading.stack_size(1 << 20)
    with package_logs() as logs:
        pool = ClientPool(spec["world"], spec["spares"], range(spec["first"], spec["last"]))
        sim = Sim(pool, None, "barrier-probe", logs, prefix=spec["prefix"])
        entered: list[float] = []

        def task(sim_rank: Rank) -> None:
            _enter_training(sim_rank)
            if sim_rank.rank == 0:
                sim.sleep(spec["late"])  # writing a checkpoint
                entered.append(time.monotonic())
            sim_rank.control.barrier("save")

        pool.observer.add(spec["prefix"] + _PROBE_READY, 1)
        pool.observer.wait([spec["prefix"] + _PROBE_GO], timedelta(seconds=900))
        sim.start(task)
        sim.wait_for(
            lambda: all(r.done is not None for r in sim.ranks), time.monotonic() + spec["late"] + spec["budget"]
        )
        failed = [r for r in sim.ranks if r.error is not None]
        result = {
            "entered": entered[0] if entered else None,
            "done": [r.done for r in sim.ranks],
            "errors": _errors(failed),
            "open_s": pool.open_seconds,
        }
        print(_PROBE_TAG + json.dumps(result), flush=True)
        sim.close()
    os._exit(0)  # no interpreter finalization with store threads about


def barrier_probe(world: int, processes: int, timing: Timing, spares: int) -> dict[str, Any]:
    """The barrier-late state's latency with the ``world`` ranks spread over ``processes`` processes.

    Every process opens its ranks' connections, counts itself ready and waits for "go" (so that slow connection
    set-ups are not timed); rank 0 then enters ``timing.late`` s later. CLOCK_MONOTONIC is shared by the processes,
    so the latency is the last rank's return (any process) minus rank 0's entry.
    """
    prefix = f"bench/{uuid.uuid4().hex[:12]}/barrier-probe/"
    cuts = [round(i * world / processes) for i in range(processes + 1)]
    base = {
        "src": pkg().source["src"],
        "commit": pkg().source["commit"],
        "trace_entries": _TRACE_ENTRIES[0],
        "port": _SERVER_PORT[0],
        "world": world,
        "spares": spares,
        "prefix": prefix,
        "late": timing.late,
        "budget": timing.budget,
    }
    children = [
        subprocess.Popen(
            [sys.executable, __file__, PROBE_FLAG, json.dumps({**base, "first": first, "last": last})],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        for first, last in itertools.pairwise(cuts)
    ]
    observer = new_client()
    outcome: dict[str, Any] = {"processes": processes, "status": "ok"}
    try:
        deadline = time.monotonic() + 900
        while int(observer.add(prefix + _PROBE_READY, 0)) < processes:
            if time.monotonic() > deadline or any(c.poll() is not None for c in children):
                outcome["status"] = "a probe process did not start"
                return outcome
            time.sleep(0.2)
        observer.set(prefix + _PROBE_GO, "1")
        results = []
        for child in children:
            out, _ = child.communicate(timeout=timing.late + timing.budget + 120)
            lines = [line for line in out.splitlines() if line.startswith(_PROBE_TAG)]
            if not lines:
                outcome["status"] = f"a probe process ended with {child.returncode} and no result"
                return outcome
            results.append(json.loads(lines[-1][len(_PROBE_TAG) :]))
        entered = [r["entered"] for r in results if r["entered"] is not None]
        done = [d for r in results for d in r["done"]]
        errors = [r["errors"] for r in results if r["errors"]]
        if not entered or None in done or errors:
            outcome["status"] = f"timed out or failed: {errors}"
            return outcome
        outcome["latency_s"] = max(done) - entered[0]
        outcome["median_s"] = sorted(done)[len(done) // 2] - entered[0]
        return outcome
    except subprocess.TimeoutExpired:
        outcome["status"] = "timed out"
        return outcome
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=10)


def _describe(error: BaseException | None) -> str:
    if error is None:
        return ""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _errors(ranks: list[Rank]) -> dict[str, int]:
    """The ranks' errors, counted by their text with numbers replaced by N (rank numbers, seconds)."""
    return dict(Counter(re.sub(r"\d+(\.\d+)?", "N", _describe(r.error)) for r in ranks).most_common(5))


def run_state(state: str, pool: ClientPool, server: StoreServer, timing: Timing, logs: LogCount) -> dict[str, Any]:
    """One state at one W: build the ranks, run the state, tear down; the measurement as a JSON-ready dict."""
    logs.counts.clear()
    exits_before = len(_PROCESS.exits)
    stderr_before = _SYS.lines
    started = time.monotonic()
    sim = Sim(pool, server, state, logs)
    build_s = time.monotonic() - started
    outcome = Outcome({}, status="not run")
    try:
        outcome = STATE_RUNNERS[state](sim, timing)
    except Exception as err:  # a broken state is reported, the benchmark goes on
        outcome.status = f"failed: {_describe(err)}"
    finally:
        log_counts = dict(logs.counts.most_common(8))
        keys_left = sim.keys_left()
        clean = sim.close()
    return {
        "state": state,
        "world": pool.world,
        "kind": "measured",
        "status": outcome.status,
        "build_s": build_s,
        "run_s": time.monotonic() - started,
        **outcome.traffic,
        "latency_s": outcome.latency_s,
        "latency": outcome.latency,
        "keys_left": keys_left,
        "notes": {
            **outcome.notes,
            "log_records": log_counts,
            "exits": len(_PROCESS.exits) - exits_before,
            "stderr_lines": _SYS.lines - stderr_before,
            "threads_ended": clean,
        },
        "loadavg": os.getloadavg(),
    }


# ---------------------------------------------------------------------------------------------- extrapolation
def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b*x``; a single point gives ``b = 0``."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if n < 2 or var == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return mean_y - slope * mean_x, slope


MIN_SERVER_CPU = 0.2  # seconds: below, a state's own server CPU per operation is too coarse (10 ms clock ticks)


def _server_cost(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Server CPU seconds per operation and per key touched, over ``rows``."""
    cpu = sum(r["server_cpu_s"] for r in rows)
    ops = sum(r["ops"] for r in rows)
    keys = sum(r["keys"] for r in rows)
    return (cpu / ops if ops else 0.0), (cpu / keys if keys else 0.0)


RATES = ("ops_per_rank_s", "keys_per_rank_s", "bytes_per_rank_s")
MAX_LAG = 1.5  # rows whose beats came later than this (x designed) are left out of the fit when two others remain


def demand(row: dict[str, Any], name: str) -> float:
    """A measured per-rank rate scaled up by the row's beat lag: what the ranks would have asked, on time."""
    lag = row.get("beat_lag") or 1.0
    return float(row[name]) * max(1.0, lag)


BACKGROUND = "background_ops_per_rank_s"


def interval_at(world: int) -> float:
    """The measured package's heartbeat (and background poll) interval at ``world`` ranks, per configured second.

    The package grows its background polls' intervals beyond some number of ranks (``control.scaled_interval``);
    a package without that function polls at the configured pace at any W.
    """
    scaled = getattr(pkg().control, "scaled_interval", None)
    return float(scaled(1.0, world)) if scaled is not None else 1.0


def event_ops(row: dict[str, Any], rows: list[dict[str, Any]]) -> float:
    """Store operations per rank of an event row (its window is the event), less the ongoing background.

    The window (signal -> every rank stopped) also holds the heartbeats and beat hooks that run anyway; their rate
    is the steady state's at the same W (when measured), taken off: ``(rate - steady rate) x window``.
    """
    steady = [r for r in rows if r["state"] == "steady" and r["world"] == row["world"] and "ops" in r]
    background = steady[0]["ops_per_rank_s"] if steady else 0.0
    return max(0.0, float(row["ops_per_rank_s"]) - background) * float(row["latency_s"])


def extrapolate(rows: list[dict[str, Any]], worlds: Sequence[int]) -> list[dict[str, Any]]:
    """Rows for larger W: per-rank rates fitted as ``a + b*W``, server busy = total rate x CPU per op at the top W.

    The fit runs over the state's measured rows that ended ``ok`` and whose beat lag is at most :data:`MAX_LAG`
    (when fewer than two are, over its two smallest W), each rate scaled by its beat lag (see :func:`demand`): where
    the simulation fell behind, the measured rate is what this machine could issue, not what the ranks asked; the
    result is then a lower bound. A fitted rate never goes below the smallest one fitted (the background part's
    neither). The part of it made by the
    background threads (heartbeat, beat hooks, blocking waits: fitted apart) is then scaled by the package's own
    interval at W (:func:`interval_at`): its polls come once per interval. The CPU per operation is
    the state's own at its largest measured W, or (when that state used less than :data:`MIN_SERVER_CPU` of server
    CPU there) the one of every state at the largest measured W together.
    """
    out = []
    ok = [r for r in rows if r["kind"] == "measured" and "ops" in r and r["status"] == "ok"]
    largest = max((r["world"] for r in ok), default=0)
    pooled = _server_cost([r for r in ok if r["world"] == largest])
    for state in STATES:
        measured = [r for r in ok if r["state"] == state]
        if not measured:
            continue
        top = max(measured, key=lambda r: r["world"])
        own = top["server_cpu_s"] >= MIN_SERVER_CPU
        per_op, per_key = _server_cost([top]) if own else pooled
        kept_up = [r for r in measured if (r.get("beat_lag") or 1.0) <= MAX_LAG]
        basis = kept_up if len(kept_up) >= 2 else sorted(measured, key=lambda r: r["world"])[:2]
        fits = {name: _fit([(r["world"], demand(r, name)) for r in basis]) for name in RATES}
        floors = {name: min(demand(r, name) for r in basis) for name in RATES}
        polls = [(r["world"], demand(r, BACKGROUND)) for r in basis if BACKGROUND in r]
        background = _fit(polls) if polls else (0.0, 0.0)
        background_floor = min((rate for _, rate in polls), default=0.0)
        top_world = max(r["world"] for r in rows if r["state"] == state)
        worlds_above = [w for w in worlds if w > top_world]
        for world in worlds_above:
            rates = {name: max(floors[name], a + b * world) for name, (a, b) in fits.items()}
            # the background threads' polls come once per (scaled) interval: at W their rate is the fitted one
            # times the interval at the top measured W over the interval the package uses at W
            slower = interval_at(top_world) / interval_at(world)
            # floored like the total (a fitted slope below zero is noise): the background share cannot shrink
            # below the smallest measured one merely because the line through the totals was clamped
            polled = min(rates["ops_per_rank_s"], max(background_floor, background[0] + background[1] * world))
            kept = (rates["ops_per_rank_s"] - polled * (1.0 - slower)) / rates["ops_per_rank_s"] if polled else 1.0
            rates = {name: value * kept for name, value in rates.items()}
            per_event: dict[str, Any] = {}
            if state in EVENT_WINDOW_STATES and all(r.get("latency_s") for r in basis):
                # an event's operations per rank do not depend on how long it took: the most measured, times W
                ops_per_event = max(event_ops(r, rows) for r in basis)
                per_event = {
                    "ops_per_rank_event": ops_per_event,
                    "server_s_per_event": ops_per_event * world * per_op,
                }
            out.append(
                {
                    **per_event,
                    "state": state,
                    "world": world,
                    "kind": "extrapolated",
                    "status": "extrapolated",
                    **rates,
                    "ops_per_s": rates["ops_per_rank_s"] * world,
                    "keys_per_s": rates["keys_per_rank_s"] * world,
                    "bytes_per_s": rates["bytes_per_rank_s"] * world,
                    "server_busy": rates["ops_per_rank_s"] * world * per_op,
                    "server_busy_by_keys": rates["keys_per_rank_s"] * world * per_key,
                    "fit": {name: {"a": a, "b": b} for name, (a, b) in fits.items()},
                    "background_fit": {"a": background[0], "b": background[1]},
                    "poll_interval_factor": 1.0 / slower,
                    "server_cpu_per_op_us": per_op * 1e6,
                    "server_cpu_per_key_us": per_key * 1e6,
                    "server_cost_from": f"{state} at W={top['world']}" if own else f"every state at W={largest}",
                    "from_worlds": [r["world"] for r in basis],
                    "from_rows_that_kept_up": len(kept_up) >= 2,
                }
            )
    return out


# ---------------------------------------------------------------------------------------------- report
def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.{digits}f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.{digits}f}k"
    return f"{value:.{digits}f}"


def _busy(row: dict[str, Any]) -> str:
    if row["kind"] == "extrapolated":
        return f"{row['server_busy']:.2f} ({row['server_busy_by_keys']:.2f} by keys)"
    return f"{row['server_busy']:.2f}"


def markdown(result: dict[str, Any]) -> str:
    """The results table."""
    head = (
        "| label | state | W | kind | ops/s per rank (mean / max) | ops/s total | keys/s per rank | keys/s total | "
        "B/s per rank | B/s total | server busy | client CPU | beat lag | bg ops/beat | latency / outcome | keys left |"
    )
    lines = [head, "|" + "---|" * 16]
    for row in result["rows"]:
        measured = row["kind"] == "measured"
        if "ops" not in row and measured:
            lines.append(
                f"| {result['label']} | {row['state']} | {row['world']} | measured | {row['status']} |" + " |" * 11
            )
            continue
        per_rank = _num(row["ops_per_rank_s"], 2)
        if measured:
            per_rank += f" / {_num(row['ops_per_rank_s_max'], 1)}"
        outcome = row.get("latency") or ""
        probe = row.get("probe")
        if probe:
            outcome += (
                f"; in {probe['processes']} processes: {probe['latency_s']:.2f} s"
                if "latency_s" in probe
                else f"; in {probe['processes']} processes: {probe['status']}"
            )
        if measured and row["status"] != "ok":
            outcome = f"**{row['status']}** {outcome}".strip()
        cells = [
            result["label"],
            row["state"],
            str(row["world"]),
            row["kind"] if measured else "*extrapolated*",
            per_rank,
            _num(row["ops_per_s"]),
            _num(row["keys_per_rank_s"]),
            _num(row["keys_per_s"]),
            _num(row["bytes_per_rank_s"], 0),
            _num(row["bytes_per_s"]),
            _busy(row),
            f"{row['client_busy']:.2f}" if measured else "-",
            _num(row.get("beat_lag"), 2) if measured else "-",
            _num(row.get("background_ops_per_beat"), 1) if measured else "-",
            outcome
            if measured
            else (
                f"{row['server_s_per_event']:.2f} s of server time per event" if "server_s_per_event" in row else "-"
            ),
            str(row["keys_left"]) if measured else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    extrapolated = [r for r in result["rows"] if r["kind"] == "extrapolated"]
    if extrapolated:
        biggest = max(r["world"] for r in extrapolated)
        busy = ", ".join(
            f"{r['state']} {r['server_busy']:.2f} ({r['server_busy_by_keys']:.2f})"
            for r in extrapolated
            if r["world"] == biggest
        )
        lines += ["", f"Server busy at W={biggest} (extrapolated; by operations, in brackets by keys): {busy}."]
    env = result["environment"]
    source = result["source"]
    lines += [
        "",
        f"{result['date']}, label `{result['label']}`: threads as ranks in one process, one TCPStore server process "
        f"(libuv); heartbeat_interval={HEARTBEAT:g} s, fake Flight Recorder with {result['trace_entries']} entries. "
        f"{env['cores']} cores, load average {result['loadavg_start'][0]:.1f} at the start and "
        f"{result['loadavg_end'][0]:.1f} at the end; torch {env['torch']}, ddp_strategy {env['ddp_strategy']} "
        f"at commit {source['commit'][:10]}{' (with uncommitted changes)' if source['dirty'] else ''}.",
        "Server busy = server CPU s / wall s (1.00: its one loop thread saturated); client CPU = CPU s / wall s of "
        "the process running every simulated rank. Beat lag = the heartbeat threads' actual / designed beat period "
        "(1.00: on time; well above: the simulation fell behind, so its rates are what this machine could issue, "
        "and its latencies include the simulation's own delay). Bg ops/beat = store operations of the background "
        "threads per beat and rank (a count: stable where times are not). Bytes: keys and values only. "
        f"Extrapolated rows: per-rank rates x beat lag, fitted as a + b*W over the state's measured W that ended "
        f"ok with a beat lag <= {MAX_LAG:g} (else over its two smallest W: a lower bound), the background threads' "
        "part (fitted apart) times the package's own poll interval at the top measured W / at W "
        "(`control.scaled_interval`: x1 up to 512 ranks, x1/8 at 4096); server busy = total "
        "ops/s x the server CPU per operation at the state's largest measured W (in brackets: x the CPU per key "
        "touched); above 1.00 one server core cannot serve it.",
    ]
    return "\n".join(lines) + "\n"


def print_row(row: dict[str, Any]) -> None:
    """One progress line."""
    if "ops" not in row:
        print(f"{row['state']:>12} W={row['world']:<4} {row['status']}", flush=True)
        return
    print(
        f"{row['state']:>12} W={row['world']:<4} ops/s/rank {row['ops_per_rank_s']:8.2f} "
        f"total {row['ops_per_s']:9.1f} keys/s {row['keys_per_s']:10.1f} server {row['server_busy']:.2f} "
        f"client {row['client_busy']:.2f} keys left {row['keys_left']:>5} {row['status']} {row['latency']}"
        + (f" | probe {row['probe']}" if row.get("probe") else ""),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worlds", default="8,64,256", help="comma-separated world sizes (default 8,64,256)")
    parser.add_argument("--states", default=",".join(STATES), help=f"comma-separated, of {', '.join(STATES)}")
    parser.add_argument("--quick", action="store_true", help="W = 8, 32 and short windows (CI smoke)")
    parser.add_argument("--label", default="current", help="stored in the JSON and shown in the table")
    parser.add_argument("--out", type=Path, help="output path without suffix (.json and .md are written)")
    parser.add_argument("--extrapolate", default=",".join(map(str, EXTRAPOLATE)), help="W to extrapolate to")
    parser.add_argument("--trace-entries", type=int, default=16, help="fake Flight Recorder entries per rank")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds a state may overrun before it is cut")
    parser.add_argument("--spares", type=int, default=2, help="connections per rank kept for store_factory")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target judged on this run is missed")
    parser.add_argument(
        "--barrier-processes",
        type=int,
        default=8,
        help="also time the barrier-late state's barrier with the ranks spread over this many processes (1: not)",
    )
    parser.add_argument(
        "--src-commit",
        metavar="REV",
        help="measure the package of this commit (its src/, extracted to a temporary directory), not the working tree",
    )
    args = parser.parse_args(argv)
    if args.quick and args.worlds == parser.get_default("worlds"):
        args.worlds = "8,32"
    args.world_list = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    args.state_list = [s.strip() for s in args.states.split(",") if s.strip()]
    unknown = [s for s in args.state_list if s not in STATES]
    if unknown or any(w < 2 for w in args.world_list):
        parser.error(f"unknown states {unknown}" if unknown else "every world size must be >= 2")
    if args.out is None:
        args.out = RESULTS / (f"control_plane_scale_{args.label}" + ("-quick" if args.quick else ""))
    args.out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
    return args


def timing_for(args: argparse.Namespace) -> Timing:
    if args.quick:
        return Timing(steady=3.0, warmup=1.0, late=3.0, wait=6.0, budget=min(args.budget, 45.0))
    return Timing(budget=args.budget)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddp_strategy": getattr(pkg().root, "__version__", "?"),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
    }


@contextlib.contextmanager
def package_logs() -> Iterator[LogCount]:
    """Count the package's log records instead of printing them."""
    handler = LogCount()
    logger = logging.getLogger("ddp_strategy")
    old = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old[0])
        logger.propagate = old[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    global PKG
    timing = timing_for(args)
    PKG = load_package(args.src_commit)
    _TRACE_ENTRIES[0] = args.trace_entries
    install_fakes()
    result: dict[str, Any] = {
        "label": args.label,
        "source": PKG.source,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "worlds": args.world_list,
        "states": args.state_list,
        "quick": args.quick,
        "timing": timing.__dict__,
        "trace_entries": args.trace_entries,
        "heartbeat_interval": HEARTBEAT,
        "environment": environment(),
        "loadavg_start": os.getloadavg(),
        "pytest_running_at_start": _pytest_running(),
        "rows": [],
        "connections": {},
    }
    server = StoreServer()
    _SERVER_PORT[0] = server.port
    try:
        with package_logs() as logs:
            for world in args.world_list:
                pool = ClientPool(world, args.spares)
                opened: dict[str, Any] = {"open_s": [pool.open_seconds], "count": pool.count, "extra": 0}
                print(f"W={world}: {pool.count} connections opened in {pool.open_seconds:.1f} s", flush=True)
                for state in args.state_list:
                    row = run_state(state, pool, server, timing, logs)
                    if state == "barrier-late" and args.barrier_processes > 1:
                        row["probe"] = barrier_probe(world, args.barrier_processes, timing, args.spares)
                    result["rows"].append(row)
                    print_row(row)
                    if not row["notes"]["threads_ended"]:  # a thread may still use a client: open new ones
                        opened["extra"] += pool.extra
                        pool = ClientPool(world, args.spares)
                        opened["open_s"].append(pool.open_seconds)
                opened["extra"] += pool.extra
                result["connections"][str(world)] = opened
                del pool
    finally:
        server.kill()
    extra = [int(w) for w in args.extrapolate.split(",") if w.strip()]
    result["rows"] += extrapolate(result["rows"], extra)
    result["loadavg_end"] = os.getloadavg()
    return result


FLAT_WITHIN = 2.0  # per-rank store operations per second: largest / smallest over the measured W
BUSY_AT_MOST = 0.10  # rank 0's store server at the largest extrapolated W
BARRIER_WITHIN = 0.5  # seconds from the last arrival to the last rank's return
ERROR_WITHIN = 15.0  # seconds from a cause to the named error on every rank
TIMED_STATES = {"desync": ERROR_WITHIN, "failed-peer": ERROR_WITHIN, "preemption": ERROR_WITHIN}
#: states whose rows measure exactly the event's window (see state_preemption): judged per event, not per second
EVENT_WINDOW_STATES = frozenset({"preemption"})


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 32's targets, each as ``{"target", "value", "ok"}`` (``ok`` is ``None`` when it cannot be judged).

    Judged on this run's rows: every state ended ``ok``; per-rank operations per second flat within
    :data:`FLAT_WITHIN` from the smallest to the largest measured W; at the largest measured W a barrier done within
    :data:`BARRIER_WITHIN` s of its last arrival and every named error within :data:`ERROR_WITHIN` s of its cause;
    at the largest extrapolated W the server busy at most :data:`BUSY_AT_MOST` (judged only when at least three W
    were measured: two points make a noisy line).
    """
    rows = result["rows"]
    measured = [r for r in rows if r["kind"] == "measured"]
    out: list[dict[str, Any]] = []
    bad = [f"{r['state']} W={r['world']}: {r['status']}" for r in measured if r["status"] != "ok"]
    out.append({"target": "every state ended ok", "value": "; ".join(bad) or "all ok", "ok": not bad})
    worlds = sorted({r["world"] for r in measured})
    top = worlds[-1] if worlds else 0
    for state in STATES:
        mine = sorted((r for r in measured if r["state"] == state and "ops" in r), key=lambda r: r["world"])
        # the preemption state's rates are taken over the agreement alone (signal -> every rank stopped): it is
        # judged by its operations per rank for the whole event (see event_ops); once it is fast, a rate says little
        per_event = state in EVENT_WINDOW_STATES and all(r.get("latency_s") for r in mine)
        if len(mine) >= 2:
            rates = [event_ops(r, rows) if per_event else r["ops_per_rank_s"] for r in mine]
            ratio = max(rates) / max(min(rates), 1e-9)
            value = f"{ratio:.2f}x (W={mine[0]['world']}..{mine[-1]['world']}: " + ", ".join(f"{v:.1f}" for v in rates)
            what = "ops per rank per event" if per_event else "ops/s per rank"
            out.append(
                {
                    "target": f"{state}: {what} flat within {FLAT_WITHIN:g}x",
                    "value": value + ")",
                    "ok": ratio <= FLAT_WITHIN,
                }
            )
        at_top = [r for r in mine if r["world"] == top]
        bound = BARRIER_WITHIN if state == "barrier-late" else TIMED_STATES.get(state)
        if bound is not None and at_top:
            latency = at_top[0].get("latency_s")
            value = "-" if latency is None else f"{latency:.2f} s"
            probe = at_top[0].get("probe")
            if probe:  # ranks are processes: judged on the probe, the one-process figure shown beside it
                spread = f"ranks in {probe['processes']} processes"
                value = (
                    f"{probe['latency_s']:.2f} s ({spread}; one process: {value})"
                    if "latency_s" in probe
                    else (f"{spread}: {probe['status']}; one process: {value}")
                )
                latency = probe.get("latency_s")
            out.append(
                {
                    "target": f"{state} at W={top}: within {bound:g} s",
                    "value": value,
                    "ok": latency is not None and latency <= bound,
                }
            )
    extrapolated = [r for r in rows if r["kind"] == "extrapolated"]
    if extrapolated:
        far = max(r["world"] for r in extrapolated)
        judged = len(worlds) >= 3
        not_judged = "" if judged else "; not judged: fewer than 3 W measured"
        at_far = [r for r in extrapolated if r["world"] == far]
        lasting = [r for r in at_far if "server_s_per_event" not in r]
        if lasting:
            busiest = max(lasting, key=lambda r: r["server_busy"])
            out.append(
                {
                    "target": f"server busy at W={far} (extrapolated) at most {BUSY_AT_MOST:g} in every lasting state",
                    "value": f"{busiest['server_busy']:.3f} ({busiest['state']}, the busiest){not_judged}",
                    "ok": busiest["server_busy"] <= BUSY_AT_MOST if judged else None,
                }
            )
        # an event (the preemption agreement) is one burst, not a load: its server time is judged against the time
        # the event may take (ERROR_WITHIN), the same share of the server as a lasting state's busy fraction
        for row in (r for r in at_far if "server_s_per_event" in r):
            bound = BUSY_AT_MOST * ERROR_WITHIN
            out.append(
                {
                    "target": f"{row['state']} at W={far} (extrapolated): server time per event at most "
                    f"{bound:g} s ({BUSY_AT_MOST:g} of {ERROR_WITHIN:g} s)",
                    "value": f"{row['server_s_per_event']:.2f} s ({row['ops_per_rank_event']:.1f} ops per rank)"
                    + not_judged,
                    "ok": row["server_s_per_event"] <= bound if judged else None,
                }
            )
    return out


def targets_markdown(checked: list[dict[str, Any]]) -> str:
    """The targets as a table."""
    lines = ["| target | value | met |", "|---|---|---|"]
    for t in checked:
        met = {True: "yes", False: "**no**", None: "not judged"}[t["ok"]]
        lines.append(f"| {t['target']} | {t['value']} | {met} |")
    return "\n".join(lines) + "\n"


def _pytest_running() -> bool:
    found = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True, check=False)
    return bool(found.stdout.strip())


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [PROBE_FLAG]:
        _probe_child(json.loads(argv[1]))
    args = parse_args(argv)
    threading.stack_size(1 << 20)  # a thousand threads or more
    result = run(args)
    result["targets"] = targets(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = markdown(result) + "\n" + targets_markdown(result["targets"])
    args.out.with_suffix(".md").write_text(text)
    print()
    print(text)
    missed = [t["target"] for t in result["targets"] if t["ok"] is False]
    if args.check and missed:
        print(f"targets missed: {'; '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
