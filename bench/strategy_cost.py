"""The CPU time SafeDDPStrategy's own code adds to a training step, measured directly by instrumentation.

Usage: python bench/strategy_cost.py [--devices N] [--steps N] [--workloads mlp cifar tiny] [--results-dir DIR]
                                    [--name NAME] [--heartbeat-parts] [--control]

``bench/suite.py`` compares whole steps of interleaved fits of stock ``DDPStrategy`` and ``SafeDDPStrategy()``. On
this shared 2-core machine the same configuration's step time moves by 2-6% between fits and rounds (where the
25.6M-parameter MLP's memory lands, what the other processes do), so a ratio target of <= 1.01 cannot be read off
it with a handful of rounds. This script measures the difference itself: in fits of the suite's two workloads with
``SafeDDPStrategy()`` at its defaults (Lightning's own launcher, gloo, one thread per rank), every method that
``SafeDDPStrategy`` overrides is wrapped with a thread-CPU-time counter, and so is the ``DDPStrategy``
implementation it calls through ``super()``; a key's time excludes every timed call nested in it (the strategy's own
time of a method is its time less the ``DDPStrategy`` code and the other timed methods it called, each counted once).
The callbacks the strategy adds are timed by Lightning's turn of each hook (a copy of Lightning's hook loop): from
the ``getattr`` of the hook to its return, the hook's code and Lightning's dispatch to it (inherited no-op hooks
included), which a run without the callback does not have. A callback without hooks placed first in the list is
timed the same way and left out of the total, for reference: the first turn after the backward pays cache misses
whatever callback takes it. Every figure is less the instrumentation's own CPU, calibrated in the same process (per
timed call, and per timed call nested in another). The strategy's background threads (the control plane's heartbeat
threads, the preemption watch) count by their thread CPU clocks; a thread that only waits 1 s at a time, as they do
between beats, is measured beside them and left out of the total, for reference (what this machine charges for
waking a thread, see ``idle_reference``). The window is ``--steps`` training steps after a warm-up; the epoch-end
weight agreement, once per epoch, is reported on its own.

Writes ``strategy_cost.json`` and ``strategy_cost.md`` (``--name``: another name) into ``--results-dir`` (default
``bench/results``); ``--workloads`` adds ``tiny``, ``bench/tiny_step.py``'s model with its ``sync_dist`` log;
``DDP_STRATEGY_BENCH_NO_DESYNC=1`` measures ``SafeDDPStrategy(desync_detection=False)`` into
``strategy_cost_no_desync.{json,md}``; ``--heartbeat-parts`` also times the heartbeat's parts on each thread (the
beat on the training thread, its publication and hook; the audit's dump and parsing there; the look on the heartbeat
thread and its store read; the rest is that thread's wake-ups and loop: ``HEARTBEAT_PARTS``); ``--control`` fits
:class:`PassThroughDDPStrategy` after each workload's fit, timed the same way, and reports each of its figures beside
the strategy's with their difference (what the instrument reads where code does nothing else).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "workloads"))
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer import call as lightning_call  # noqa: E402
from run import MLP, MLP_SHAPE, SyncedCIFAR10Classifier  # noqa: E402
from tiny import SHAPE, tiny_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ddp_strategy.control as control_module  # noqa: E402
from bench.results_io import machine, write  # noqa: E402
from ddp_strategy import SafeDDPStrategy  # noqa: E402
from ddp_strategy import strategy as strategy_module  # noqa: E402
from ddp_strategy.collective_record import LogSites  # noqa: E402
from ddp_strategy.desync import DesyncMonitor  # noqa: E402
from ddp_strategy.desync_audit import RecorderAudit  # noqa: E402
from ddp_strategy.heartbeat import Heartbeat, _Wakeup  # noqa: E402

WARMUP = 5
#: DDP_STRATEGY_BENCH_NO_DESYNC=1: `SafeDDPStrategy(desync_detection=False)`, results in strategy_cost_no_desync.*
NO_DESYNC = os.environ.get("DDP_STRATEGY_BENCH_NO_DESYNC") == "1"
BATCH = {"mlp": 8, "cifar": 16, "tiny": 32}  # per rank: as in bench/suite.py; tiny as in bench/tiny_step.py


class Counters:
    """Exclusive thread CPU seconds and calls per key, the training thread's nesting of timed calls, calibration.

    ``own``: SafeDDPStrategy's methods and the loop iterations that run the callbacks it added; ``inner``: the
    ``DDPStrategy`` code they reach through ``super()`` (not counted). A key's time excludes every timed call
    nested in it (counted under its own key), so the keys add up without counting anything twice.
    """

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self.inner: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        #: timed calls nested directly in each key's calls (each adds some of the wrapper's own work to the parent)
        self.nested: dict[str, int] = {}
        #: per call, inside the window: the own CPU seconds of the strategy's collectives (PER_CALL)
        self.per_call: dict[str, list[float]] = {}
        self.recording = False
        #: the instrumentation's own CPU seconds inside a timed call, and inside its parent per nested call
        self.overhead = (0.0, 0.0)
        self._stack: list[list[float]] = []  # per open timed call: [nested calls' seconds, nested calls]

    def snapshot(self) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        return dict(self.own), dict(self.calls), dict(self.nested)

    def timed(self, key: str, run: Callable[..., Any], args: Any, kwargs: Any, *, inner: bool = False) -> Any:
        stack = self._stack
        frame = [0.0, 0]
        stack.append(frame)
        start = time.thread_time()
        try:
            return run(*args, **kwargs)
        finally:
            took = time.thread_time() - start
            stack.pop()
            if stack:
                stack[-1][0] += took
                stack[-1][1] += 1
            own = took - frame[0]
            if inner:  # not the strategy's: left out of every figure
                self.inner[key] = self.inner.get(key, 0.0) + own
            else:
                self._count(key, own, int(frame[1]))

    def _count(self, key: str, own: float, nested: int) -> None:
        self.own[key] = self.own.get(key, 0.0) + own
        self.calls[key] = self.calls.get(key, 0) + 1
        self.nested[key] = self.nested.get(key, 0) + nested
        if self.recording and key in PER_CALL:
            leaf, per_nested = self.overhead
            self.per_call.setdefault(key, []).append(own - leaf - per_nested * nested)

    def calibrate(self, rounds: int = 20000) -> None:
        """Measure the wrapper's own CPU inside a timed call (a leaf) and inside a parent per nested call."""
        probe = Counters()

        def leaf() -> None:
            return None

        def parent() -> None:
            probe.timed("leaf", leaf, (), {})

        for _ in range(3):  # warm, then keep the last round's figures
            probe.own.clear()
            probe.calls.clear()
            for _ in range(rounds):
                probe.timed("leaf", leaf, (), {})
            leaf_cost = probe.own["leaf"] / probe.calls["leaf"]
            probe.own.clear()
            probe.calls.clear()
            for _ in range(rounds):
                probe.timed("parent", parent, (), {})
            nested_cost = probe.own["parent"] / probe.calls["parent"] - leaf_cost
        self.overhead = (leaf_cost, max(0.0, nested_cost))


def _timed(method: Callable[..., Any], key: str, counters: Counters, *, inner: bool = False) -> Any:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        return counters.timed(key, method, args, kwargs, inner=inner)

    return timed


#: the key of the strategy's ``self.log`` wrapper (see `instrument_log_sites`): one call per logged ``sync_dist`` value
LOG_WRAPPER = "self.log wrapper"
#: the strategy's collectives and its ``self.log`` wrapper, whose own time is also kept per call (for a median per call)
PER_CALL = ("reduce", "all_gather", "broadcast", LOG_WRAPPER)


class PassThroughDDPStrategy(DDPStrategy):
    """The control (``--control``): ``DDPStrategy`` with SafeDDPStrategy's per-step overrides, each doing nothing else.

    Timed exactly as ``SafeDDPStrategy`` is, its figures are what the instrument reads for an override that only
    calls ``super()`` at the same places of the step (its ``reduce`` makes the strategy's collective,
    ``all_reduce_value``, not counted either): the in-situ floor of the method, which the warm calibration does not
    remove, plus a call's cost that any strategy overriding the method pays. It fits after the strategy's fit of the
    same workload: a process group it made first would keep torch's Flight Recorder at 2000 entries, which the
    strategy's audit then stops dumping during training (``RecorderAudit.note_size``), not the default's figures.
    """

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return strategy_module.all_reduce_value(tensor, group, reduce_op)


class PassThroughLog(Callback):
    """The control's ``self.log`` wrapper (``--control``): calls the module's ``log``, nothing else, timed as
    ``SafeDDPStrategy``'s wrapper is (less the ``LightningModule.log`` it calls)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        inner = _timed(pl_module.log, LOG_WRAPPER, self.counters, inner=True)

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            return inner(name, value, *args, **kwargs)

        pl_module.log = _timed(log, LOG_WRAPPER, self.counters)  # type: ignore[method-assign]


def instrument_strategy(counters: Counters, cls: type[DDPStrategy] = SafeDDPStrategy) -> Callable[[], None]:
    """Wrap every method ``cls`` defines and its ``super()`` target; returns the function that undoes it."""
    undo: list[Callable[[], None]] = []
    for name, attr in list(vars(cls).items()):
        if name.startswith("__") or not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)):
            continue
        setattr(cls, name, _timed(attr, name, counters))
        undo.append(functools.partial(setattr, cls, name, attr))
        parent = getattr(DDPStrategy, name, None)
        if callable(parent):  # what super().<name>() reaches: only ``cls``'s methods call it in this script
            had_own = name in vars(DDPStrategy)
            setattr(DDPStrategy, name, _timed(parent, name, counters, inner=True))
            undo.append(
                functools.partial(setattr, DDPStrategy, name, parent)
                if had_own
                else functools.partial(delattr, DDPStrategy, name)
            )

    # the strategy's `reduce` makes its collective through `all_reduce_value` (Lightning's `DDPStrategy.reduce`
    # without the barrier; on gloo an all-gather and the sum of its rows, in place of gloo's all-reduce and its sum):
    # the collective, as `DDPStrategy.reduce` was, is not the strategy's own time
    reduce_value = strategy_module.all_reduce_value
    setattr(strategy_module, "all_reduce_value", _timed(reduce_value, "reduce", counters, inner=True))  # noqa: B010
    undo.append(functools.partial(setattr, strategy_module, "all_reduce_value", reduce_value))

    def restore() -> None:
        for action in reversed(undo):
            action()

    return restore


def instrument_callback_hooks(counters: Counters) -> Callable[[], None]:
    """Time, in Lightning's loop over the callbacks, each turn of a callback the strategy added, whole.

    A copy of Lightning's ``_call_callback_hooks`` (2.6) whose turn of a ``ddp_strategy`` callback is timed from
    Lightning's ``getattr`` of the hook to its return: the hook's own code and Lightning's dispatch to it (the
    profiler's context, the callback's ``state_key``), which a run without that callback does not have.
    """
    original = lightning_call._call_callback_hooks

    def turn(callback: Callback, hook_name: str, trainer: pl.Trainer, args: Any, kwargs: Any) -> None:
        fn = getattr(callback, hook_name)
        if callable(fn):
            with trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):
                fn(trainer, trainer.lightning_module, *args, **kwargs)

    def call_callback_hooks(
        trainer: pl.Trainer, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
    ) -> None:
        pl_module = trainer.lightning_module
        if pl_module:
            prev_fx_name = pl_module._current_fx_name
            pl_module._current_fx_name = hook_name
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if monitoring_callbacks is True:
            callbacks = [cb for cb in callbacks if isinstance(cb, (EarlyStopping, Checkpoint))]
        elif monitoring_callbacks is False:
            callbacks = [cb for cb in callbacks if not isinstance(cb, (EarlyStopping, Checkpoint))]
        for callback in callbacks:
            if isinstance(callback, Reference) or type(callback).__module__.startswith("ddp_strategy"):
                key = f"{type(callback).__name__}.{hook_name}"
                counters.timed(key, turn, (callback, hook_name, trainer, args, kwargs), {})
            else:
                turn(callback, hook_name, trainer, args, kwargs)
        if pl_module:
            pl_module._current_fx_name = prev_fx_name

    lightning_call._call_callback_hooks = call_callback_hooks
    return functools.partial(setattr, lightning_call, "_call_callback_hooks", original)


#: the name of the idle reference thread (see `idle_reference`): counted as the strategy's threads are, not in the total
IDLE_REFERENCE = "reference-idle-1s"


def strategy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ddp_strategy-") or t.name == IDLE_REFERENCE]


#: the native threads torch's gloo backend started for the strategy's control group: ``{tid: name}``
CONTROL_GROUP_THREADS: dict[int, str] = {}


def native_threads() -> dict[int, str]:
    """This process's threads, Python's and native ones: ``{tid: name}`` (Linux ``/proc``)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            threads[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    return threads


def native_thread_cpu(tid: int) -> float:
    """A thread's CPU seconds (``/proc``'s schedstat: the clock ``time.thread_time`` reads); 0 once it ended."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except OSError:
        return 0.0


def instrument_control_group() -> Callable[[], None]:
    """Note the threads torch starts for the strategy's gloo control group (counted as the strategy's threads).

    Each gloo group has a network thread (``gloo_tcp_loop``) that wakes every 10 ms whether or not the group is used
    (its ``epoll_wait`` timeout), and worker threads (``pt_gloo_runloop``) that run its collectives. A stock
    ``DDPStrategy`` has the default group's; the control group's are the strategy's own.
    """
    original = getattr(control_module, "new_control_gloo_group")  # noqa: B009 (patched for the fit)

    def new_group_noting_threads(timeout: Any) -> Any:
        before = native_threads()
        group = original(timeout)
        for tid, name in native_threads().items():
            if tid not in before:
                CONTROL_GROUP_THREADS[tid] = f"control group's {name} ({tid})"
        return group

    setattr(control_module, "new_control_gloo_group", new_group_noting_threads)  # noqa: B010
    return functools.partial(setattr, control_module, "new_control_gloo_group", original)


def instrument_log_sites(counters: Counters) -> Callable[[], None]:
    """Time the strategy's wrapper of the module's ``log`` (``LogSites``), less the ``LightningModule.log`` it calls.

    Every ``self.log(..., sync_dist=True)`` goes through it (it names the value the strategy's ``reduce`` syncs).
    """
    original = LogSites.install

    def install(sites: LogSites, module: Any) -> None:
        sites.uninstall()
        module.log = _timed(module.log, LOG_WRAPPER, counters, inner=True)  # what the wrapper calls
        original(sites, module)
        module.log = _timed(module.log, LOG_WRAPPER, counters)

    setattr(LogSites, "install", install)  # noqa: B010 (patched for the fit)
    return functools.partial(setattr, LogSites, "install", original)


#: ``--heartbeat-parts``: the heartbeat's code timed by part on the thread named (a call on the other thread is not
#: timed), each part with what it calls; a part indented by two spaces runs inside the one above it. While the
#: training thread trains, it runs the beat (``Heartbeat.beat_if_due``, from ``note_step``) and the audit's dump, its
#: unpickling and its parsing at the steps after one: those count in ``on_train_batch_start``'s figure, not again.
#: The heartbeat thread, waking a quarter of an interval after a beat was due, runs what the beat left it (the desync
#: monitor's look, which reads the store), or its own beat when the training thread did not beat; the rest of its CPU
#: is its wake-ups and its loop (:data:`HEARTBEAT_REST`).
HEARTBEAT_PARTS: dict[str, tuple[str, Any, str]] = {
    "training thread: the beat (`beat_if_due`)": ("training", Heartbeat, "beat_if_due"),
    "  the position's publication (its JSON and its `set`)": ("training", Heartbeat, "publish"),
    "  the desync monitor's beat (the ledger's digest, the audit's publication)": ("training", DesyncMonitor, "beat"),
    "training thread: the audit's dump, at the step after a beat": ("training", DesyncMonitor, "_dump_in_step"),
    "training thread: its unpickling, at the step after that": ("training", RecorderAudit, "_unpickle_fetched"),
    "training thread: its parsing, at the step after that": ("training", RecorderAudit, "_parse_fetched"),
    "heartbeat thread: what a beat left it (`_after_inline_beat`)": ("heartbeat", Heartbeat, "_after_inline_beat"),
    "  the desync monitor's look (`_look`)": ("heartbeat", DesyncMonitor, "_look"),
    "    its store read (`read_with_failures`, one `multi_get`)": ("heartbeat", Heartbeat, "read_with_failures"),
    "heartbeat thread: its own beats (`_beat_once`)": ("heartbeat", Heartbeat, "_beat_once"),
}
HEARTBEAT_REST = "heartbeat thread: the rest (wake-ups and the loop)"


class HeartbeatParts:
    """``--heartbeat-parts``: the heartbeat's CPU by part (:data:`HEARTBEAT_PARTS`), each by its thread's clock.

    Each timed call costs its thread two clock reads (about 1 us); a few calls a second, not subtracted.
    """

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> Callable[[], None]:
        """Wrap each part; returns the function that undoes it."""
        undo: list[Callable[[], None]] = []
        for label, (thread, owner, name) in HEARTBEAT_PARTS.items():
            original = getattr(owner, name)
            setattr(owner, name, self._timed(label, thread == "heartbeat", original))
            undo.append(functools.partial(setattr, owner, name, original))

        def restore() -> None:
            for action in reversed(undo):
                action()

        return restore

    def _timed(self, label: str, on_heartbeat_thread: bool, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name.startswith("ddp_strategy-heartbeat") != on_heartbeat_thread:
                return method(*args, **kwargs)  # the part of the other thread (a beat there, a dump as epochs start)
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.cpu), dict(self.calls)


def heartbeat_parts_per_step(window: Window, heartbeat_cpu_per_step: float) -> dict[str, Any]:
    """Per step in the window: each part's CPU and calls, and the rest of the heartbeat thread's CPU."""
    (cpu0, calls0), (cpu1, calls1) = window.parts_start, window.parts_end
    per_step = {label: (cpu1.get(label, 0.0) - cpu0.get(label, 0.0)) / window.steps for label in HEARTBEAT_PARTS}
    top = sum(v for label, v in per_step.items() if label.startswith("heartbeat thread:"))
    return {
        "cpu_per_step_s": {**per_step, HEARTBEAT_REST: heartbeat_cpu_per_step - top},
        "calls_in_window": {label: calls1.get(label, 0) - calls0.get(label, 0) for label in HEARTBEAT_PARTS},
    }


def idle_reference(stop: threading.Event) -> threading.Thread:
    """A thread that only waits, 1 s at a time, as the heartbeat thread does between beats; left out of the total.

    Its CPU time is what this machine charges a thread for waking once a second and nothing else: on a virtual
    machine the wake-up from an idle or busy core is charged to the woken thread (about 0.1 ms per wake-up on this
    one in the MLP's fits, where bare metal takes a few microseconds). The strategy's heartbeat thread wakes once a
    second (two threads did before 66a1c4b), so about this figure of its CPU time is the cost of waking, not of its
    work. It sleeps as the heartbeat thread does (``heartbeat._Wakeup``, since 7ad47d1; ``threading.Event`` before),
    and ends within a second of ``stop``.
    """

    def wait() -> None:
        sleep = _Wakeup()
        while not stop.is_set():
            sleep.wait(1.0)

    thread = threading.Thread(target=wait, name=IDLE_REFERENCE, daemon=True)
    thread.start()
    return thread


def thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):  # the thread has ended
        return 0.0


class Reference(Callback):
    """A callback without hooks, first in the Trainer's list: the cost of one more callback in a run with callbacks.

    Timed as the strategy's callbacks are, and left out of the total. Being first, its turn after the backward
    pays the cache misses that the first callback's turn pays whoever it is (in a run with the progress bar or a
    checkpoint callback, one of those), so the strategy's callbacks are timed as they are in such a run.
    """


class Window(Callback):
    """Snapshots at the start of step ``WARMUP`` and of step ``WARMUP + steps``, and the training thread's CPU."""

    def __init__(self, counters: Counters, steps: int, parts: HeartbeatParts | None = None) -> None:
        self.counters, self.steps, self.parts = counters, steps, parts
        self.start: Any = None
        self.end: Any = None
        self.parts_start: Any = None
        self.parts_end: Any = None
        self.step_cpu: list[float] = []
        self._begin = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before those the strategy added; a new list, as Lightning is iterating over the current one
        trainer.callbacks = [Reference(), *trainer.callbacks]  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx in (WARMUP, WARMUP + self.steps):
            threads = {t.name: thread_cpu(t) for t in strategy_threads()}
            threads.update({name: native_thread_cpu(tid) for tid, name in CONTROL_GROUP_THREADS.items()})
            mark = (self.counters.snapshot(), threads)
            parts = self.parts.snapshot() if self.parts is not None else None
            if idx == WARMUP:
                self.start, self.parts_start = mark, parts
            else:
                self.end, self.parts_end = mark, parts
            self.counters.recording = idx == WARMUP
        self._begin = time.thread_time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if WARMUP <= idx < WARMUP + self.steps:
            self.step_cpu.append(time.thread_time() - self._begin)


def own_per_step(window: Window) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """Per training step in the window: each key's own CPU (less the instrumentation's), its calls, the threads'."""
    (own0, calls0, nested0), threads0 = window.start
    (own1, calls1, nested1), threads1 = window.end
    leaf, per_nested = window.counters.overhead
    steps = window.steps
    calls = {key: calls1.get(key, 0) - calls0.get(key, 0) for key in calls1}
    own = {
        key: (
            own1[key]
            - own0.get(key, 0.0)
            - leaf * calls[key]
            - per_nested * (nested1.get(key, 0) - nested0.get(key, 0))
        )
        / steps
        for key in own1
        if calls.get(key, 0) > 0
    }
    threads = {name: (threads1.get(name, 0.0) - cpu) / steps for name, cpu in threads0.items()}
    return own, {k: v for k, v in calls.items() if k in own}, threads


def fit(
    workload: str, devices: int, steps: int, root: str, heartbeat_parts: bool = False, control: bool = False
) -> dict[str, Any]:
    """One timed fit of ``workload``: ``SafeDDPStrategy()``, or with ``control`` :class:`PassThroughDDPStrategy`."""
    torch.manual_seed(0)
    model: pl.LightningModule
    if workload == "mlp":
        model = MLP()
        data = TensorDataset(torch.randn(BATCH["mlp"] * devices * (WARMUP + steps + 1), MLP_SHAPE[0]))
    elif workload == "tiny":
        model = tiny_module(sync_dist=True)  # bench/tiny_step.py's model, with its sync_dist log: all framework
        count = BATCH["tiny"] * devices * (WARMUP + steps + 1)
        data = TensorDataset(torch.randn(count, SHAPE[0]), torch.randint(0, SHAPE[2], (count,)))
    else:
        model = SyncedCIFAR10Classifier()  # the suite's workload: one sync_dist value logged per step
        count = BATCH["cifar"] * devices * (WARMUP + steps + 1)
        data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    counters = Counters()
    counters.calibrate()
    parts = HeartbeatParts() if heartbeat_parts else None
    window = Window(counters, steps, parts)
    CONTROL_GROUP_THREADS.clear()
    restore = [
        instrument_strategy(counters, PassThroughDDPStrategy if control else SafeDDPStrategy),
        instrument_callback_hooks(counters),
        instrument_control_group(),
        instrument_log_sites(counters),
        *([parts.install()] if parts is not None else []),
    ]
    strategy = PassThroughDDPStrategy() if control else SafeDDPStrategy(desync_detection=not NO_DESYNC)
    stop_idle = threading.Event()
    idle_reference(stop_idle)
    try:
        trainer = pl.Trainer(
            default_root_dir=root,
            accelerator="cpu",
            devices=devices,
            # DDP_STRATEGY_BENCH_NO_DESYNC=1: the same without desync detection, for a side-by-side figure
            strategy=strategy,
            max_epochs=1,  # one epoch of WARMUP + steps + 1 steps: the epoch-end check runs once, after the window
            callbacks=[window, *([PassThroughLog(counters)] if control else [])],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, DataLoader(data, batch_size=BATCH[workload], shuffle=True))
    finally:
        stop_idle.set()
        for undo in reversed(restore):
            undo()
    own, calls, threads = own_per_step(window)
    idle = threads.pop(IDLE_REFERENCE, 0.0)
    reference = {k: own.pop(k) for k in list(own) if k.startswith(f"{Reference.__name__}.")}
    leaf, per_nested = counters.overhead
    epoch_end = {k: v - leaf * counters.calls[k] for k, v in counters.own.items() if k.endswith("on_train_epoch_end")}
    per_step_total = sum(own.values()) + sum(threads.values())
    step_cpu = statistics.median(window.step_cpu)
    heartbeat = next((cpu for name, cpu in threads.items() if name.startswith("ddp_strategy-heartbeat")), 0.0)
    return {
        "workload": workload,
        "strategy": "control" if control else "safe",
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "step_cpu_median_s": step_cpu,
        "own_cpu_per_step_s": per_step_total,
        "fraction_of_step": per_step_total / step_cpu,
        "own_per_method_s": dict(sorted(own.items(), key=lambda kv: -kv[1])),
        "calls_in_window": calls,
        "threads_cpu_per_step_s": threads,
        # not counted: the turns of a callback without hooks placed first (see Reference)
        "reference_callback_per_step_s": reference,
        # not counted: a thread that only waits 1 s at a time (see idle_reference)
        "idle_thread_per_step_s": idle,
        "epoch_end_check_s": epoch_end,
        # the instrumentation's own CPU per timed call and per nested timed call, subtracted from every figure
        "instrumentation_overhead_s": {"per_call": leaf, "per_nested_call": per_nested},
        # own CPU per `self.log(..., sync_dist=True)` value: its wrapper call and its `reduce`, paired in order
        "per_sync_dist_value_s": per_value(counters.per_call.get(LOG_WRAPPER, []), counters.per_call.get("reduce", [])),
        # own CPU per call of the strategy's collectives in the window: median, 10th and 90th percentile
        "own_per_call_s": {
            key: {"median": statistics.median(v), "p10": quantile(v, 0.1), "p90": quantile(v, 0.9), "calls": len(v)}
            for key, v in sorted(counters.per_call.items())
            if v
        },
        # --heartbeat-parts: the heartbeat's CPU by part on each thread (see HEARTBEAT_PARTS)
        **({"heartbeat_parts": heartbeat_parts_per_step(window, heartbeat)} if parts is not None else {}),
    }


def per_value(wrapper: list[float], reduce: list[float]) -> dict[str, float] | None:
    """Median [10th, 90th percentile] of wrapper + reduce per logged value (``None`` unless one of each per value)."""
    if not wrapper or len(wrapper) != len(reduce):
        return None
    both = [a + b for a, b in zip(wrapper, reduce, strict=True)]
    return {"median": statistics.median(both), "p10": quantile(both, 0.1), "p90": quantile(both, 0.9)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render(result: dict[str, Any]) -> list[str]:
    overhead = result["workloads"][0]["instrumentation_overhead_s"]
    detection = "" if result.get("desync_detection", True) else "(desync_detection=False)"
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"Lightning {result['machine']['lightning']}: `SafeDDPStrategy({detection})` at its defaults, "
        f"{result['devices']} rank(s) (Lightning's launcher, gloo, one thread per rank), rank 0's figures, "
        f"{WARMUP} warm-up steps then a window of the steps below. Own time = CPU time inside `SafeDDPStrategy`'s "
        "methods less the `DDPStrategy` code they call, plus Lightning's turns of the callbacks it adds (dispatch "
        "and hook, inherited no-op hooks included) and its background threads. Every timed call's figure is less "
        f"the instrumentation's own CPU, calibrated in the same process: {overhead['per_call'] * 1e6:.2f} us per "
        f"timed call and {overhead['per_nested_call'] * 1e6:.2f} us per timed call nested in another.",
        "",
        "| workload | parameters | steps | step CPU (ms, median) | own CPU per step (us) | share of the step | "
        "implied safe/stock | epoch-end weight agreement (ms, once per epoch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["workloads"]:
        epoch_end = sum(row["epoch_end_check_s"].values())
        lines.append(
            f"| {row['workload']} | {row['parameters']:,} | {row['steps']} | {row['step_cpu_median_s'] * 1e3:.1f} | "
            f"{row['own_cpu_per_step_s'] * 1e6:.0f} | {row['fraction_of_step']:.3%} | "
            f"{1 + row['fraction_of_step']:.4f} | {epoch_end * 1e3:.1f} |"
        )
    lines += ["", "Own CPU time per step by method or callback hook (us; calls in the window in brackets):", ""]
    for row in result["workloads"]:
        parts = [
            f"`{k}` {v * 1e6:.1f} ({row['calls_in_window'].get(k, 0)})" for k, v in row["own_per_method_s"].items()
        ]
        parts += [f"thread `{k}` {v * 1e6:.1f}" for k, v in row["threads_cpu_per_step_s"].items()]
        lines.append(f"- {row['workload']}: " + ", ".join(parts))
    lines += [
        "",
        "Not counted, for reference: the turns of a callback without hooks placed first in the Trainer's list (us per "
        "step; the cost of one more callback in a run with callbacks):",
        "",
    ]
    for row in result["workloads"]:
        turns = row.get("reference_callback_per_step_s", {})
        parts = [f"`{k.split('.', 1)[1]}` {v * 1e6:.1f}" for k, v in sorted(turns.items(), key=lambda kv: -kv[1])]
        lines.append(f"- {row['workload']}: {sum(turns.values()) * 1e6:.1f} in all: " + ", ".join(parts))
    lines += [
        "",
        "Not counted, for reference: a thread that only waits, 1 s at a time, as the heartbeat thread "
        "does between its beats (us of its CPU per step: what this machine charges for waking a thread once a "
        "second):",
        "",
    ]
    for row in result["workloads"]:
        idle = row.get("idle_thread_per_step_s")
        lines.append(f"- {row['workload']}: " + ("not measured" if idle is None else f"{idle * 1e6:.1f}"))
    head = "Own CPU time per call of the strategy's collectives (us, median [10th, 90th percentile], calls):"
    lines += ["", head, ""]
    for row in result["workloads"]:
        parts = [
            f"`{k}` {v['median'] * 1e6:.1f} [{v['p10'] * 1e6:.1f}, {v['p90'] * 1e6:.1f}] ({v['calls']})"
            for k, v in row.get("own_per_call_s", {}).items()
        ]
        lines.append(f"- {row['workload']}: " + (", ".join(parts) or "none"))
    head = (
        "Own CPU time per `self.log(..., sync_dist=True)` value: the strategy's `self.log` wrapper and its `reduce`, "
        "summed per value (us, median [10th, 90th percentile]):"
    )
    lines += ["", head, ""]
    for row in result["workloads"]:
        value = row.get("per_sync_dist_value_s")
        text = (
            "none"
            if value is None
            else f"{value['median'] * 1e6:.1f} [{value['p10'] * 1e6:.1f}, {value['p90'] * 1e6:.1f}]"
        )
        lines.append(f"- {row['workload']}: {text}")
    lines += render_control(result)
    with_parts = [row for row in result["workloads"] if "heartbeat_parts" in row]
    if with_parts:
        head = (
            "The heartbeat by part, on each thread (`--heartbeat-parts`; us per step, calls in the window in brackets; "
            "a part indented runs inside the one above; each part includes what it calls; the training thread's parts "
            "are in its `on_train_batch_start` figure above):"
        )
        lines += ["", head, ""]
        for row in with_parts:
            parts = row["heartbeat_parts"]
            lines.append(f"- {row['workload']}:")
            for label, cpu in parts["cpu_per_step_s"].items():
                calls = parts["calls_in_window"].get(label)
                indent = "  " * (1 + (len(label) - len(label.lstrip(" "))) // 2)
                lines.append(f"{indent}- {label.strip()}: {cpu * 1e6:.1f}" + ("" if calls is None else f" ({calls})"))
    return lines


def render_control(result: dict[str, Any]) -> list[str]:
    """``--control``: each per-step key of the control beside the strategy's, and their difference (us per step)."""
    controls = {row["workload"]: row for row in result.get("control_workloads", [])}
    if not controls:
        return []
    lines = [
        "",
        "The control (`--control`): `PassThroughDDPStrategy`, a `DDPStrategy` whose per-step overrides "
        "(`on_train_batch_start`, `post_backward`, `optimizer_step`, `reduce`) only call `super()` (its `reduce` "
        "the strategy's collective) and a `self.log` wrapper that only calls the module's `log`, fitted and timed "
        "the same way right after the strategy's fit: what the instrument reads at those places for code that does "
        "nothing else (us per step; per value: median of the wrapper and `reduce` summed):",
        "",
        "| workload | key | `SafeDDPStrategy()` | control | strategy less control |",
        "|---|---|---|---|---|",
    ]
    for row in result["workloads"]:
        control = controls.get(row["workload"])
        if control is None:
            continue
        for key, cpu in control["own_per_method_s"].items():
            if key.startswith(f"{Reference.__name__}."):
                continue
            mine = row["own_per_method_s"].get(key, 0.0)
            lines.append(
                f"| {row['workload']} | `{key}` | {mine * 1e6:.1f} | {cpu * 1e6:.1f} | {(mine - cpu) * 1e6:.1f} |"
            )
        mine_value, control_value = row.get("per_sync_dist_value_s"), control.get("per_sync_dist_value_s")
        if mine_value is not None and control_value is not None:
            a, b = mine_value["median"] * 1e6, control_value["median"] * 1e6
            lines.append(f"| {row['workload']} | per `sync_dist` value | {a:.1f} | {b:.1f} | {a - b:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cifar"], choices=["mlp", "cifar", "tiny"])
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", help="results file name, no suffix (default strategy_cost[_no_desync])")
    parser.add_argument(
        "--heartbeat-parts", action="store_true", help="time the heartbeat's parts on each thread too (HEARTBEAT_PARTS)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="after each workload's fit, time a fit of PassThroughDDPStrategy the same way (the instrument's floor)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="strategy-cost-")
    rows, controls = [], []
    # the strategy's fit first: the process group is its own (see PassThroughDDPStrategy)
    for workload in args.workloads:
        rows.append(fit(workload, args.devices, args.steps, scratch, args.heartbeat_parts))
        if args.control:
            controls.append(fit(workload, args.devices, args.steps, scratch, control=True))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    result = {
        "devices": args.devices,
        "desync_detection": not NO_DESYNC,
        "workloads": rows,
        **({"control_workloads": controls} if controls else {}),
        **machine(),
    }
    name = args.name or ("strategy_cost_no_desync" if NO_DESYNC else "strategy_cost")
    write(args.results_dir, name, result, render(result))


if __name__ == "__main__":
    main()
