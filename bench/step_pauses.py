"""Pauses of the training thread caused by SafeDDPStrategy's background threads: stock DDPStrategy beside it.

Usage: python bench/step_pauses.py [--steps N] [--rounds N] [--results-dir DIR]

Issue 30 asks that the strategy's background work never pause the training thread for more than 1 ms. Python
threads share one GIL: while a background thread runs Python code or a C call that keeps the GIL (a Flight Recorder
dump, ``pickle.loads``), the training thread cannot run; it gets the GIL back when the background thread blocks (a
store operation, a sleep) or, for Python code only, after the switch interval (5 ms). In 2-rank fits of a tiny model
(a step takes a few ms; one value logged with ``sync_dist=True`` per step), alternating stock ``DDPStrategy`` and
``SafeDDPStrategy()`` at its defaults, rounds in turn, rank 0 records:

* **the background threads' GIL holds**: a profile function on the strategy's threads (``ddp_strategy-*``) splits
  their run into *stretches* between two calls that release the GIL (store operations, sleeps, waits); a stretch's
  thread CPU time is how long that thread kept the GIL (a training thread wanting it waited at most that long), less
  the profile function's own CPU per event (calibrated in the same process). The longest stretch, and the longest
  single C call in one (its name), are reported, and the longest stretch between each pair of such sites (the
  ``SITES_SHOWN`` longest pairs): which work holds the GIL how long. The profile function sees calls made from
  Python code only: a release inside a C-level callable (a ``functools.partial`` of ``time.sleep``) ends no
  stretch. A stretch that ran a garbage collection (``gc.callbacks``, per thread) is counted apart, and each
  stretch's wall time is kept beside its CPU;
* **every Flight Recorder dump with stacks** (``collective_trace``, ``collective_dump``, ``collective_dump_pickled``):
  on which thread, its wall and CPU time, the first one (the slowest, symbols loaded) included;
* **every heartbeat beat** (``Heartbeat._beat_once``): on which thread (the training thread runs the due beat at a
  step's start while it trains; the heartbeat thread beats when it does not), its wall and CPU time; and every
  desync audit's dump the training thread runs at a step of its own after a beat (``DesyncMonitor._dump_in_step``),
  its unpickling at the step after (``RecorderAudit._unpickle_fetched``, since it has its own step) and its parsing
  at the step after that (``RecorderAudit._parse_fetched``; ``BEAT_PARTS``);
* **the gaps between consecutive training-step hooks** of a callback (``on_train_batch_start``, before and after
  backward, before the optimizer step and zeroing, ``on_train_batch_end``): the longest (with the hooks it lies
  between and its step) and the 99.9th percentile, stock against safe (what the training thread saw, the machine's
  own noise included).

Each timed dump and beat part also records the thread's minor page faults, involuntary context switches and garbage
collections during it (:class:`CallUsage`), and the report lists the training thread's calls over 1 ms of CPU with
them: what a long call's CPU held besides its own work.

Writes ``step_pauses.json`` and ``step_pauses.md`` into ``--results-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ddp_strategy.desync as desync_module  # noqa: E402
import ddp_strategy.desync_audit as audit_module  # noqa: E402
import ddp_strategy.heartbeat as heartbeat_module  # noqa: E402
from bench.results_io import machine, write  # noqa: E402
from ddp_strategy import SafeDDPStrategy  # noqa: E402
from ddp_strategy._compat.torch import collective_trace_enabled  # noqa: E402
from ddp_strategy.collective_record import TRACE_ENTRIES  # noqa: E402

BATCH = 16
WIDTH = 32
BATCHES_PER_EPOCH = 500


def releases_gil(call: Any) -> str:
    """Whether a C call (a profile event's ``arg``) lets the GIL go: ``"yes"`` (a store operation, a sleep),
    ``"if it blocks"`` (a lock's ``acquire``: only a contended one waits without the GIL), else ``""``.

    A background stretch of GIL hold ends at each such call.
    """
    owner = getattr(call, "__self__", None)
    name = getattr(call, "__name__", "")
    if owner is time and name == "sleep":
        return "yes"
    # a torch binding (its `__self__` is pybind11's function record): the store's operations let the GIL go
    if type(owner).__name__.startswith("pybind11") and name in STORE_OPERATIONS:
        return "yes"
    if name in ("acquire", "acquire_lock") and type(owner).__name__ in ("lock", "RLock"):
        return "if it blocks"
    return ""


#: the rendezvous store's operations (torch bindings that let the GIL go while they wait for the store)
STORE_OPERATIONS = {
    *("set", "get", "check", "add", "multi_get", "multi_set", "compare_set", "append", "delete_key", "wait"),
}
#: the stretches reported per pair of sites (the longest of each), longest first
SITES_SHOWN = 4
#: a lock's ``acquire`` that took longer than this (wall seconds) waited, the GIL released
BLOCKED_AFTER = 50e-6
HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class Tiny(pl.LightningModule):
    """Two small linear layers: a step of a few ms, most of it the framework's and the collectives'."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HookClock(Callback):
    """The time of every training-step hook; the gaps between consecutive ones after ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.gaps: list[float] = []
        self._last: float | None = None
        self._first = False  # in an epoch's first batch (the strategy's once-per-epoch audit dump: not counted)
        self._hook = ""  # the hook of the last tick
        #: the longest gap: its seconds, the hooks it lies between and the global step
        self.longest: dict[str, Any] = {"gap_s": 0.0}

    def _tick(self, trainer: pl.Trainer, hook: str = "") -> None:
        now = time.perf_counter()
        if trainer.global_step >= self.warmup and self._last is not None and not self._first:
            gap = now - self._last
            self.gaps.append(gap)
            if gap > self.longest["gap_s"]:
                self.longest = {"gap_s": gap, "after": self._hook, "before": hook, "step": trainer.global_step}
        self._last, self._hook = now, hook

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None  # the epoch's end (and the weight agreement) is not a training step


def _hook(name: str) -> Callable[..., None]:
    def hook(self: HookClock, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._tick(trainer, name)

    hook.__name__ = name
    return hook


for _name in HOOKS[1:]:
    setattr(HookClock, _name, _hook(_name))


def _batch_start(self: HookClock, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
    self._first = batch_idx == 0
    self._tick(trainer, "on_train_batch_start")


HookClock.on_train_batch_start = _batch_start  # type: ignore[method-assign]


class SchedStat:
    """The calling thread's scheduler counts (``/proc/thread-self/schedstat``): nanoseconds on a core and runnable.

    Opened once on the thread that makes it (``/proc/thread-self`` names the opening thread), read with one ``pread``.
    Without the file (not Linux, or no schedstats), :meth:`read` gives ``None``.
    """

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[int, int] | None:
        """``(ns on a core, ns runnable but waiting for one)`` since the thread started."""
        if self._fd is None:
            return None
        on_core, waiting = os.pread(self._fd, 128, 0).split()[:2]
        return int(on_core), int(waiting)


class Holds:
    """The strategy's background threads' GIL-holding stretches, from a profile function on those threads."""

    def __init__(self, event_cost: float, collections_here: Callable[[], int] = lambda: 0) -> None:
        self.event_cost = event_cost  # the profile function's own CPU per event
        #: how many garbage collections the calling thread has run: a stretch that ran one is counted apart
        self.collections_here = collections_here
        self.longest: dict[str, Any] = {"cpu_s": 0.0}
        #: the longest stretch that ran no garbage collection
        self.longest_without_collection: dict[str, Any] = {"cpu_s": 0.0}
        self.stretches = 0
        self.over_1ms = 0
        self.over_1ms_with_collection = 0
        self.with_collection = 0  # stretches that ran a garbage collection, of any length
        #: stretches over 1 ms of wall time, and those over 1 ms on a core by the scheduler's count, both less the
        #: profile function's own CPU. A stretch's wall time is its time on a core, its time runnable (waiting for a
        #: core: preempted while it held the GIL, or woken to take the GIL back) and the rest (asleep inside a call
        #: that let the GIL go unseen, e.g. waiting to take it back); only the time on a core is certainly the GIL held
        self.over_1ms_wall = 0
        self.over_1ms_on_core = 0
        self.longest_by_wall: dict[str, Any] = {"wall_s": 0.0}
        self.longest_c_call: dict[str, Any] = {"cpu_s": 0.0}
        #: the longest stretch between each pair of sites (from, to) that let the GIL go: which work holds it how long
        self.by_sites: dict[tuple[str, str], float] = {}
        self.recording = False
        self._local = threading.local()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        local = self._local
        if not hasattr(local, "mine"):
            local.mine = threading.current_thread().name.startswith("ddp_strategy-")
            local.schedstat = SchedStat() if local.mine else None
            local.sched = local.c_sched = local.schedstat.read() if local.schedstat else None
            local.start, local.events, local.began = time.thread_time(), 0, "thread start"
            local.c_start, local.c_wall, local.c_events = 0.0, 0.0, 0
            local.wall, local.collections = time.perf_counter(), self.collections_here()
        if not local.mine:
            return
        local.events += 1
        if event == "c_call":
            local.c_start, local.c_wall, local.c_events = time.thread_time(), time.perf_counter(), local.events
            if local.schedstat is not None and releases_gil(arg):  # where a stretch may end: the scheduler's counts
                local.c_sched = local.schedstat.read()
        elif event in ("c_return", "c_exception"):
            now = time.thread_time()
            releases = releases_gil(arg)
            if releases == "yes" or (releases and time.perf_counter() - local.c_wall > BLOCKED_AFTER):
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                self._close(local, local.c_start, local.c_events, where)  # it ended as the call let the GIL go
                local.sched = local.schedstat.read() if local.schedstat is not None else None
                local.start, local.events, local.began = time.thread_time(), 0, where
                local.wall, local.collections = time.perf_counter(), self.collections_here()
            elif self.recording and now - local.c_start > self.longest_c_call["cpu_s"]:
                owner = getattr(arg, "__self__", None)
                where = getattr(owner, "__name__", type(owner).__name__) if owner is not None else ""
                where = "" if where.startswith("pybind11") else where  # a torch binding: its name says it
                name = getattr(arg, "__name__", "?")
                self.longest_c_call = {"cpu_s": now - local.c_start, "call": f"{where}.{name}".lstrip(".")}

    def _close(self, local: Any, end: float, events: int, where: str) -> None:
        held = max(0.0, end - local.start - self.event_cost * events)
        if self.recording:
            collected = self.collections_here() != local.collections
            self.stretches += 1
            self.over_1ms += held > 1e-3
            self.over_1ms_with_collection += held > 1e-3 and collected
            self.with_collection += collected
            sites = (local.began, where)
            self.by_sites[sites] = max(held, self.by_sites.get(sites, 0.0))
            wall = local.c_wall - local.wall  # from its start to the call that let the GIL go
            on_core = runnable = None
            if local.sched is not None and local.c_sched is not None:
                profiling = self.event_cost * events  # the profile function's own CPU, on a core and in the wall time
                on_core = max(0.0, (local.c_sched[0] - local.sched[0]) / 1e9 - profiling)
                runnable = max(0.0, (local.c_sched[1] - local.sched[1]) / 1e9)  # waiting for a core
                self.over_1ms_wall += wall - profiling > 1e-3
                self.over_1ms_on_core += on_core > 1e-3
            stretch = {
                "cpu_s": held,
                "wall_s": wall,
                "on_core_s": on_core,
                "runnable_s": runnable,
                "thread": threading.current_thread().name,
                "events": events,
                "from": local.began,
                "to": where,
                "garbage_collection": collected,
            }
            if held > self.longest["cpu_s"]:
                self.longest = stretch
            if wall - self.event_cost * events > self.longest_by_wall.get("wall_less_profiling_s", 0.0):
                self.longest_by_wall = {**stretch, "wall_less_profiling_s": wall - self.event_cost * events}
            if not collected and held > self.longest_without_collection["cpu_s"]:
                self.longest_without_collection = stretch


def calibrate_profile(holds: Holds, rounds: int = 200000) -> float:
    """CPU seconds the profile function adds per event, on a thread it watches (one named ``ddp_strategy-*``)."""

    def work() -> None:
        for _ in range(rounds):
            len("")  # one C call: two events

    result: list[float] = []

    def run() -> None:
        start = time.thread_time()
        work()
        plain = time.thread_time() - start
        sys.setprofile(holds.profile)
        start = time.thread_time()
        work()
        profiled = time.thread_time() - start
        sys.setprofile(None)
        result.append((profiled - plain) / (2 * rounds))

    thread = threading.Thread(target=run, name="ddp_strategy-calibration")
    thread.start()
    thread.join()
    return result[0]


class CallUsage:
    """What one timed call cost its thread: wall and CPU seconds, page faults, preemptions, garbage collections.

    A call's CPU time is not all its own work: a minor page fault (memory the allocator takes anew from the kernel)
    costs a few microseconds of kernel time on a VM, and a garbage collection the call's allocation made due runs
    inside it. ``getrusage(RUSAGE_THREAD)`` counts the faults and the involuntary context switches exactly (its
    split of CPU into user and system time is sampled by ticks: not used).
    """

    def __init__(self, collections_here: Callable[[], int]) -> None:
        self._collections_here = collections_here
        self._usage = resource.getrusage(resource.RUSAGE_THREAD)  # read before the clocks: not in the call's times
        self._collections = collections_here()
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def ended(self) -> dict[str, Any]:
        """The call's figures from its start: ``wall_s``, ``cpu_s``, ``minor_faults``, ``preempted``, ``gc``."""
        wall, cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return {
            "thread": threading.current_thread().name,
            "wall_s": wall,
            "cpu_s": cpu,
            "minor_faults": usage.ru_minflt - self._usage.ru_minflt,
            "major_faults": usage.ru_majflt - self._usage.ru_majflt,
            "preempted": usage.ru_nivcsw - self._usage.ru_nivcsw,
            "gc": self._collections_here() - self._collections,
        }


class Dumps:
    """Every ``collective_trace`` call (a dump with stacks): thread, wall and CPU seconds, whether in training."""

    def __init__(self, collections_here: Callable[[], int] = lambda: 0) -> None:
        self.calls: list[dict[str, Any]] = []
        self.training = False
        self._collections_here = collections_here

    def wrap(self, dump: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(dump)
        def timed(*args: Any, **kwargs: Any) -> Any:
            usage = CallUsage(self._collections_here)
            try:
                return dump(*args, **kwargs)
            finally:
                self.calls.append({**usage.ended(), "during_training": self.training})

        return timed


class Beats:
    """Every heartbeat beat (``Heartbeat._beat_once``) in training, and every other ``kind`` of call wrapped.

    Per call: its kind, thread, wall and CPU seconds, and the rest of :class:`CallUsage`.
    """

    def __init__(self, collections_here: Callable[[], int] = lambda: 0) -> None:
        self.calls: list[dict[str, Any]] = []
        self.training = False
        self._collections_here = collections_here

    def wrap(self, method: Callable[..., Any], kind: str = "beat") -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(owner: Any, *args: Any, **kwargs: Any) -> Any:
            usage = CallUsage(self._collections_here)
            try:
                return method(owner, *args, **kwargs)
            finally:
                if self.training:
                    self.calls.append({"kind": kind, **usage.ended()})

        return timed

    def summary(self, kind: str = "beat") -> dict[str, Any]:
        """The calls of ``kind`` in training by thread: how many, the longest by wall time and by CPU time."""
        threads: dict[str, dict[str, Any]] = {}
        for call in (c for c in self.calls if c["kind"] == kind):
            row = threads.setdefault(call["thread"], {"count": 0, "longest_wall_s": 0.0, "longest_cpu_s": 0.0})
            row["count"] += 1
            row["longest_wall_s"] = max(row["longest_wall_s"], call["wall_s"])
            if call["cpu_s"] >= row["longest_cpu_s"]:
                row["longest_cpu_s"] = call["cpu_s"]
                row["longest_cpu_call"] = call  # with its faults, preemptions and collections
        for thread, row in threads.items():  # the typical call beside the longest
            mine = [c for c in self.calls if c["kind"] == kind and c["thread"] == thread]
            row["median_wall_s"] = statistics.median(c["wall_s"] for c in mine)
            row["median_cpu_s"] = statistics.median(c["cpu_s"] for c in mine)
            row["over_1ms_cpu"] = [c for c in mine if c["cpu_s"] > 1e-3]
        return threads


class Collections:
    """Python's garbage collections in the training window: the longest (wall), its generation and thread.

    A collection runs on the thread whose allocation triggered it and keeps the GIL: one triggered on a background
    thread pauses the training thread for its whole length.
    """

    def __init__(self) -> None:
        self.recording = False
        self.longest: dict[str, Any] = {"wall_s": 0.0}
        self.count = 0
        self._began = 0.0
        self._by_thread: dict[int, int] = {}  # collections begun on each thread, recording or not

    def on_this_thread(self) -> int:
        """How many garbage collections the calling thread has begun."""
        return self._by_thread.get(threading.get_ident(), 0)

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            ident = threading.get_ident()
            self._by_thread[ident] = self._by_thread.get(ident, 0) + 1
        elif self.recording:
            took = time.perf_counter() - self._began
            self.count += 1
            if took > self.longest["wall_s"]:
                thread = threading.current_thread().name
                self.longest = {"wall_s": took, "generation": info.get("generation"), "thread": thread}


class Phase(Callback):
    """Marks the training window (after ``warmup`` steps) for the holds and the dumps."""

    def __init__(self, holds: Holds, dumps: Dumps, collections: Collections, beats: Beats, warmup: int) -> None:
        self.holds, self.dumps, self.collections, self.beats, self.warmup = holds, dumps, collections, beats, warmup

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        on = trainer.global_step >= self.warmup
        self.holds.recording = self.dumps.training = self.collections.recording = self.beats.training = on

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.holds.recording = self.dumps.training = self.collections.recording = self.beats.training = False


#: The heartbeat's work timed by :class:`Beats`: (kind, class, its method's names, newest first: the first the package
#: code has is timed, so that an older ``src/`` runs too).
BEAT_PARTS: tuple[tuple[str, type, tuple[str, ...]], ...] = (
    ("beat", heartbeat_module.Heartbeat, ("_beat_once",)),
    ("step dump", desync_module.DesyncMonitor, ("_dump_in_step",)),
    ("step unpickle", audit_module.RecorderAudit, ("_unpickle_fetched", "unpickle_fetched")),
    ("step parse", audit_module.RecorderAudit, ("_parse_fetched", "parse_fetched")),
    ("wake reads", heartbeat_module.Heartbeat, ("_after_inline_beat",)),
)


def fit(variant: str, steps: int, warmup: int, root: str, event_cost: float) -> dict[str, Any]:
    torch.manual_seed(0)
    clock = HookClock(warmup)
    collections = Collections()
    holds = Holds(event_cost, collections.on_this_thread)
    dumps = Dumps(collections.on_this_thread)
    beats = Beats(collections.on_this_thread)
    originals = {
        (module, name): getattr(module, name)
        for module, name in ((desync_module, "collective_trace"), (audit_module, "collective_trace"))
        + ((audit_module, "collective_dump"),) * hasattr(audit_module, "collective_dump")
        # the training thread's dump at a step of its own, its unpickling at the next (since 58e246f)
        + ((audit_module, "collective_dump_pickled"),) * hasattr(audit_module, "collective_dump_pickled")
    }
    for (module, name), dump in originals.items():
        setattr(module, name, dumps.wrap(dump))
    timed = {}  # (class, method name): the method, for each part of BEAT_PARTS this package code has
    for kind, owner, names in BEAT_PARTS:
        name = next((n for n in names if hasattr(owner, n)), None)
        if name is not None:
            timed[owner, name] = getattr(owner, name)
            setattr(owner, name, beats.wrap(timed[owner, name], kind))
    data = TensorDataset(torch.randn(BATCH * 2 * BATCHES_PER_EPOCH, WIDTH))
    gc.callbacks.append(collections.callback)
    threading.setprofile(holds.profile)
    started = time.perf_counter()
    try:
        trainer = pl.Trainer(
            default_root_dir=root,
            accelerator="cpu",
            devices=2,
            strategy=SafeDDPStrategy() if variant == "safe" else DDPStrategy(),
            max_steps=warmup + steps,
            callbacks=[clock, Phase(holds, dumps, collections, beats, warmup)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        # the recorder on for both, at the strategy's size (the first process group of the process sets it)
        with collective_trace_enabled(TRACE_ENTRIES):
            trainer.fit(Tiny(), DataLoader(data, batch_size=BATCH))
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        gc.callbacks.remove(collections.callback)
        for (module, name), dump in originals.items():
            setattr(module, name, dump)
        for (owner, name), method in timed.items():
            setattr(owner, name, method)
    gaps = sorted(clock.gaps)
    in_training = [d for d in dumps.calls if d["during_training"]]
    background = [d for d in in_training if d["thread"].startswith("ddp_strategy-")]
    training_thread = [d for d in in_training if not d["thread"].startswith("ddp_strategy-")]
    return {
        "variant": variant,
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "hook_gaps": {
            "count": len(gaps),
            "median_s": statistics.median(gaps),
            "p999_s": gaps[min(len(gaps) - 1, int(0.999 * len(gaps)))],
            "max_s": gaps[-1],
            "longest": clock.longest,  # between which hooks, at which step
        },
        "background_holds": {
            "stretches": holds.stretches,
            "over_1ms": holds.over_1ms,
            "over_1ms_with_collection": holds.over_1ms_with_collection,
            "with_collection": holds.with_collection,
            "over_1ms_wall": holds.over_1ms_wall,
            "over_1ms_on_core": holds.over_1ms_on_core,
            "longest_by_wall": holds.longest_by_wall,
            "longest": holds.longest,
            "longest_without_collection": holds.longest_without_collection,
            "longest_c_call": holds.longest_c_call,
            "longest_by_sites": [
                {"from": began, "to": ended, "cpu_s": held}
                for (began, ended), held in sorted(holds.by_sites.items(), key=lambda kv: -kv[1])[:SITES_SHOWN]
            ],
        },
        "garbage_collections": {"count": collections.count, "longest": collections.longest},
        "beats": beats.summary(),
        # the audit's dumps the training thread ran at a step of their own (DesyncMonitor._dump_in_step), their
        # unpickling at the step after (RecorderAudit._unpickle_fetched; before, part of the dump's step) and their
        # parsing at the step after that (RecorderAudit._parse_fetched)
        "step_dumps": beats.summary("step dump"),
        "step_unpickles": beats.summary("step unpickle"),
        "step_parses": beats.summary("step parse"),
        # the heartbeat thread's wake-ups: what a beat on the training thread left them (the store's reads)
        "wake_reads": beats.summary("wake reads"),
        "dumps": {
            "all": dumps.calls,
            "first": dumps.calls[0] if dumps.calls else None,
            "during_training": len(in_training),
            "background": len(background),
            "longest_background_wall_s": max((d["wall_s"] for d in background), default=0.0),
            "longest_background_cpu_s": max((d["cpu_s"] for d in background), default=0.0),
            # on the training thread (its own work, not a background pause): as each epoch starts, and since d9b3690
            # the audit's dumps at a step of their own (timed whole under "step_dumps")
            "training_thread": len(training_thread),
            "longest_training_thread_wall_s": max((d["wall_s"] for d in training_thread), default=0.0),
            "longest_training_thread_cpu": max(training_thread, key=lambda d: d["cpu_s"], default=None),
            "training_thread_over_1ms_cpu": [d for d in training_thread if d["cpu_s"] > 1e-3],
        },
    }


def _by_thread(summary: dict[str, Any]) -> str:
    """A :meth:`Beats.summary` as text: per thread, its count and its longest call (ms wall / CPU)."""
    return ", ".join(
        f"`{thread}` {b['count']} ({b['longest_wall_s'] * 1e3:.3f} / {b['longest_cpu_s'] * 1e3:.3f})"
        for thread, b in sorted(summary.items())
    )


def _section(title: str, items: list[str]) -> list[str]:
    """A report section: a blank line, ``title``, a blank line and ``items``; nothing without items."""
    return ["", title, "", *items] if items else []


def _usage_text(call: dict[str, Any]) -> str:
    """One call's :class:`CallUsage` figures as text."""
    collected = ", a garbage collection" if call.get("gc") else ""
    return (
        f"{call['cpu_s'] * 1e3:.3f} / {call['wall_s'] * 1e3:.3f} ({call.get('minor_faults', 0)} faults, "
        f"{call.get('preempted', 0)} preempted{collected})"
    )


def _training_thread_usage(row: dict[str, Any]) -> str:
    """The training thread's calls over 1 ms of CPU in one fit, and the longest of each kind, as text."""
    over = [("torch dump", d) for d in row["dumps"]["training_thread_over_1ms_cpu"]]
    longest_dump = row["dumps"].get("longest_training_thread_cpu")
    parts = [f"longest torch dump {_usage_text(longest_dump)}"] if longest_dump else []
    for key, name in TRAINING_THREAD_PARTS:
        for thread, summary in sorted(row.get(key, {}).items()):
            if thread.startswith("ddp_strategy-"):  # a background thread's: its GIL stretches are timed apart
                continue
            over += [(name, call) for call in summary.get("over_1ms_cpu", [])]
            if "longest_cpu_call" in summary:
                parts.append(f"longest {name} {_usage_text(summary['longest_cpu_call'])}")
    over_text = "; ".join(f"{name} {_usage_text(call)}" for name, call in over) or "none"
    return f"over 1 ms: {over_text}. " + "; ".join(parts)


#: The training thread's timed parts of the heartbeat (:data:`BEAT_PARTS`' summaries), as the report names them.
TRAINING_THREAD_PARTS = (
    ("beats", "beat"),
    ("step_dumps", "audit's dump"),
    ("step_unpickles", "unpickling"),
    ("step_parses", "parsing"),
)


def render(result: dict[str, Any]) -> list[str]:
    machine = result["machine"]
    lines = [
        f"Measured {result['date']} on {machine['platform']}, torch {machine['torch']}, Lightning "
        f"{machine['lightning']}: 2 ranks (Lightning's launcher, gloo), a {WIDTH}-wide two-layer model, batch "
        f"{BATCH}, one value logged with `sync_dist=True` per step, {result['warmup']} warm-up steps then "
        f"{result['steps']} steps per fit; stock `DDPStrategy` and `SafeDDPStrategy()` at its defaults alternate, "
        f"{result['rounds']} round(s); rank 0's figures. Profile function's own CPU per event, subtracted: "
        f"{result['profile_event_cost_s'] * 1e6:.2f} us.",
        "",
        "| round | variant | median step-hook gap (ms) | 99.9th percentile (ms) | longest gap (ms) | "
        "background GIL stretches | longest stretch (ms, thread, between the calls that let the GIL go) "
        "| stretches over 1 ms | longest C call in one "
        "(ms) | recorder dumps on background threads in training (longest, ms wall / CPU) | on the training thread "
        "(as epochs start, and the audit's at a step of their own; longest torch dump, ms wall) | longest garbage "
        "collection (ms, generation, thread) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["fits"]:
        gaps, holds, dumps = row["hook_gaps"], row["background_holds"], row["dumps"]
        longest = holds["longest"]
        stretch = (
            f"{longest['cpu_s'] * 1e3:.3f} ({longest.get('thread', '-')}, from {longest.get('from')} to "
            f"{longest.get('to')})"
            if holds["stretches"]
            else "-"
        )
        call = holds["longest_c_call"]
        call_text = f"{call['cpu_s'] * 1e3:.3f} (`{call['call']}`)" if holds["stretches"] else "-"
        dump_text = (
            f"{dumps['background']} ({dumps['longest_background_wall_s'] * 1e3:.3f} / "
            f"{dumps['longest_background_cpu_s'] * 1e3:.3f}) | {dumps['training_thread']} "
            f"({dumps['longest_training_thread_wall_s'] * 1e3:.3f})"
            if row["variant"] == "safe"
            else "- | -"
        )
        collected = row["garbage_collections"]["longest"]
        gc_text = (
            f"{collected['wall_s'] * 1e3:.1f} ({collected['generation']}, {collected['thread']})"
            if row["garbage_collections"]["count"]
            else "-"
        )
        lines.append(
            f"| {row['round']} | {row['variant']} | {gaps['median_s'] * 1e3:.3f} | {gaps['p999_s'] * 1e3:.3f} | "
            f"{gaps['max_s'] * 1e3:.3f} | {holds['stretches'] if row['variant'] == 'safe' else '-'} | {stretch} | "
            f"{holds['over_1ms'] if row['variant'] == 'safe' else '-'} | {call_text} | {dump_text} | {gc_text} |"
        )
    firsts = [row["dumps"]["first"] for row in result["fits"] if row["variant"] == "safe" and row["dumps"]["first"]]
    lines += [
        "",
        "The first recorder dump with stacks of each safe fit (before training, in the strategy's set-up):",
        "",
    ]
    for row, first in zip([r for r in result["fits"] if r["variant"] == "safe"], firsts, strict=False):
        lines.append(
            f"- round {row['round']}: thread `{first['thread']}`, {first['wall_s'] * 1e3:.2f} ms wall, "
            f"{first['cpu_s'] * 1e3:.2f} ms CPU, during training: {first['during_training']}"
        )
    lines += ["", "The longest stretches of each safe fit by the sites that let the GIL go before and after (ms):", ""]
    for row in result["fits"]:
        by_sites = row["background_holds"].get("longest_by_sites")
        if row["variant"] == "safe" and by_sites:
            text = ", ".join(f"{s['from']} to {s['to']} {s['cpu_s'] * 1e3:.3f}" for s in by_sites)
            lines.append(f"- round {row['round']}: {text}")
    apart = [
        r for r in result["fits"] if r["variant"] == "safe" and "over_1ms_with_collection" in r["background_holds"]
    ]
    if apart:
        lines += [
            "",
            "Stretches that ran a garbage collection (one triggered on that thread by its allocation, which the "
            "process's allocations make due), counted apart; the longest stretch without one, its CPU and its wall "
            "time from its start to the call that let the GIL go (wall far above CPU: the thread was off its core):",
            "",
        ]
        for row in apart:
            holds = row["background_holds"]
            alone = holds["longest_without_collection"]
            lines.append(
                f"- round {row['round']}: {holds['over_1ms']} over 1 ms, {holds['over_1ms_with_collection']} of them "
                f"with a collection ({holds['with_collection']} stretches with one in all); the longest without one "
                f"{alone['cpu_s'] * 1e3:.3f} ms CPU, "
                f"{alone.get('wall_s', 0.0) * 1e3:.3f} ms wall ({alone.get('thread', '-')}, from {alone.get('from')} "
                f"to {alone.get('to')}); the longest in all {holds['longest'].get('wall_s', 0.0) * 1e3:.3f} ms wall"
            )
    beaten = [r for r in result["fits"] if r["variant"] == "safe" and "beats" in r]
    if beaten:
        lines += [
            "",
            "The heartbeat's beats in training, by the thread that ran them (count; longest ms wall / CPU):",
            "",
        ]
        for row in beaten:
            kinds = ("beats", "step_dumps", "step_unpickles", "step_parses", "wake_reads")
            text, steps, unpickles, parses, reads = (_by_thread(row.get(kind, {})) for kind in kinds)
            extra = f"; the audit's dumps at a step of their own: {steps}" if steps else ""
            extra += f"; their unpickling at the step after: {unpickles}" if unpickles else ""
            after = "that" if unpickles else "the dump"
            extra += f"; their parsing at the step after {after}: {parses}" if parses else ""
            extra += f"; the heartbeat thread's wake-ups, with the beats' store reads: {reads}" if reads else ""
            lines.append(f"- round {row['round']}: {text or 'none'}{extra}")
    lines += _section(
        "The longest step-hook gap of each fit: the hooks it lies between, the global step (ms):",
        [
            f"- round {row['round']}, {row['variant']}: {gap['gap_s'] * 1e3:.3f} from `{gap['after']}` to "
            f"`{gap['before']}` at step {gap['step']}"
            for row in result["fits"]
            if (gap := row["hook_gaps"].get("longest"))
        ],
    )
    lines += _section(
        "The training thread's calls in the strategy over 1 ms of CPU (torch's dumps, beats, the audit's steps), "
        "and what their CPU held (`getrusage(RUSAGE_THREAD)`: minor page faults, each a few microseconds of "
        "kernel time; involuntary context switches; a garbage collection on that thread), and the longest of "
        "each kind (ms CPU / wall):",
        [
            f"- round {row['round']}: {_training_thread_usage(row)}"
            for row in result["fits"]
            if row["variant"] == "safe" and "training_thread_over_1ms_cpu" in row["dumps"]
        ],
    )
    scheduled = [r for r in result["fits"] if r["variant"] == "safe" and "over_1ms_on_core" in r["background_holds"]]
    if scheduled:
        lines += [
            "",
            "The scheduler's counts (`/proc/thread-self/schedstat`, read where a stretch starts and where it may "
            "end): stretches over 1 ms of wall time, and those over 1 ms on a core, both less the profile function's "
            "own CPU (its calibrated cost per event). A stretch's wall time is its "
            "time on a core (the GIL held), its time runnable (waiting for a core: preempted while it held the GIL, "
            "or woken to take the GIL back) and the rest (asleep in a call that let the GIL go unseen). The longest "
            "stretch by wall time, split so:",
            "",
        ]
        for row in scheduled:
            holds = row["background_holds"]
            longest = holds["longest_by_wall"]
            split = "the scheduler's counts not read"
            if longest.get("runnable_s") is not None:
                wall, on_core = longest["wall_less_profiling_s"], longest["on_core_s"]
                runnable = longest["runnable_s"]
                split = (
                    f"{on_core * 1e3:.3f} on a core, {runnable * 1e3:.3f} runnable, "
                    f"{max(0.0, wall - on_core - runnable) * 1e3:.3f} the rest"
                )
            lines.append(
                f"- round {row['round']}: {holds['over_1ms_wall']} over 1 ms of wall time, {holds['over_1ms_on_core']} "
                f"over 1 ms on a core; the longest by wall time ({longest.get('from')} to {longest.get('to')}): "
                f"{longest.get('wall_less_profiling_s', 0.0) * 1e3:.3f} ms, {split}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="step-pauses-")
    event_cost = calibrate_profile(Holds(0.0))
    fits = []
    for round_ in range(1, args.rounds + 1):
        for variant in ("stock", "safe") if round_ % 2 else ("safe", "stock"):
            row = fit(variant, args.steps, args.warmup, scratch, event_cost)
            fits.append({"round": round_, **row})
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    result = {
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "profile_event_cost_s": event_cost,
        "fits": fits,
        **machine(),
    }
    write(args.results_dir, "step_pauses", result, render(result))


if __name__ == "__main__":
    main()
