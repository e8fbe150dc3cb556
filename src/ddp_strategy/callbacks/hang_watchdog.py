"""``HangWatchdog``: turn a silent distributed hang into stack dumps, a cross-rank summary and a non-zero exit.

A rank that stops making progress (stuck in a collective, in its own code, or waiting for a rank that died)
would otherwise wait for the process-group timeout, 30 minutes by default, and then fail with a message that
names neither the culprit nor the place. With this callback, a thread on every rank watches the training
thread's progress (Lightning's batch, epoch, backward and optimizer hooks). When one rank sees none for
``timeout`` seconds, it raises an alarm in the rendezvous store; every rank that can still run Python then
writes the stacks of all its threads to a file and to stderr and publishes a short report; the lowest rank that
reported (rank 0 unless it is the one that is gone) prints a one-screen summary of where every rank is and which
ranks differ from the rest; and every rank exits with ``exit_code``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from typing_extensions import override

from .._compat.lightning import Callback, pl, rank_zero_warn
from ..control import ControlPlane, Store, to_timedelta
from ..peers import diagnose_failed_peers
from ..positions import Position, format_ranks, is_user_path, short_path

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]

log = logging.getLogger(__name__)

#: The default exit code of every rank after a detected hang (the code ``timeout(1)`` uses).
HANG_EXIT_CODE = 124

_TRIGGER_KEY = "hang/trigger"
_REPORT_KEY = "hang/report/{rank}"
_PROCESS_KEY = "hang/process/{rank}"
_DONE_KEY = "hang/done"
_ACK_KEY = "hang/ack/{rank}"
_POLL = 0.05  # seconds between store polls while ranks exchange their reports

_C10D_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
        "wait",
    }
)
_CONTROL_WAITS = frozenset({"barrier", "_await_outcome", "all_gather_object", "gather_object", "broadcast_object"})
# Lightning (>= 2.5) broadcasts a SIGTERM flag from rank 0 before every training batch, from this function
_BEFORE_BATCH = "_broadcast_sigterm_tensor"
_PER_BATCH_WAITS = ("backward pass: DDP's gradient all-reduce", "DDP ")  # locate()'s texts of per-batch waits

Frame = tuple[str, int, str]  # (file name, line number, function name)


def _text(frame: Frame) -> str:
    return f"{short_path(frame[0])}:{frame[1]} in {frame[2]}"


def _is_user(frame: Frame) -> bool:
    return is_user_path(frame[0])


def _frames(frame: FrameType | None) -> list[Frame]:
    """The stack of ``frame``, innermost first."""
    found: list[Frame] = []
    while frame is not None:
        found.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return found


def locate(stack: list[Frame], position: Position | None) -> tuple[str, str]:
    """Say where a rank's training thread is, from its stack (innermost frame first) and its published position.

    Returns:
        ``(state, where)``: ``state`` is ``"waiting"`` (in a barrier, a collective or DDP's gradient
        synchronisation: waiting for other ranks) or ``"running"`` (in its own code: a loop, a sleep, I/O);
        ``where`` is a description without times, so ranks at the same place get the same text.

    """
    user = next((_text(f) for f in stack if _is_user(f)), "")
    via = f" from {user}" if user else ""
    for f in stack:
        path = f[0].replace(os.sep, "/")
        if path.endswith("ddp_strategy/control.py") and f[2] in _CONTROL_WAITS:
            if position is not None and position.kind in ("barrier", "collective"):
                site = f" at {position.site}" if position.site else ""
                return "waiting", f"{position.kind} '{position.name}'{site}"
            return "waiting", f"a control-plane barrier{via}"
        if "/torch/distributed/" in path and f[2] in _C10D_COLLECTIVES:
            if any(g[2] == _BEFORE_BATCH for g in stack):
                per_batch = f"Lightning's per-batch {_BEFORE_BATCH}, before the next training batch"
                return "waiting", f"collective torch.distributed.{f[2]} ({per_batch}){via}"
            return "waiting", f"collective torch.distributed.{f[2]}{via}"
    if stack:
        path = stack[0][0].replace(os.sep, "/")
        if "/torch/autograd/" in path:
            return "waiting", f"backward pass: DDP's gradient all-reduce{via}"
        if path.endswith("torch/nn/parallel/distributed.py"):
            return "waiting", f"DDP {stack[0][2]} (buffer/parameter sync){via}"
    if user:
        return "running", f"its own code at {user}"
    return "running", f"code at {_text(stack[0])}" if stack else "an unknown place (no Python stack)"


def _dump_threads() -> str:
    """Every thread's Python stack, formatted like a traceback (most recent call last)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        parts.append(f"Thread {names.get(ident, '<unknown>')} (ident {ident}), most recent call last:")
        parts.append("".join(traceback.format_stack(frame)).rstrip())
        parts.append("")
    return "\n".join(parts)


def summarize(
    reports: dict[int, dict[str, Any]],
    positions: dict[int, Position | None],
    world_size: int,
    *,
    trigger: str,
    exit_code: int,
    now: float | None = None,
    stale_after: float = 3.0,
) -> str:
    """The one-screen summary rank 0 prints: where each rank is, grouped, and which ranks differ from the rest.

    Args:
        reports: the reports the ranks published (see :meth:`HangWatchdog._report`), by rank.
        positions: every rank's last published position (used for ranks without a report).
        world_size: the number of ranks.
        trigger: why the watchdog fired.
        exit_code: the code every rank exits with.
        now: the current wall-clock time (``time.time()``), for ages.
        stale_after: seconds without a heartbeat after which a rank without a report counts as gone; one whose
            heartbeat is newer is alive (its watchdog is off: it left the training loop, e.g. into teardown).

    """
    now = time.time() if now is None else now
    missing = [rank for rank in range(world_size) if rank not in reports]
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, report in sorted(reports.items()):
        groups.setdefault((report["state"], report["where"]), []).append(rank)
    lines = [f"===== HangWatchdog: training hung; {trigger} =====", "Where each rank is:"]
    for (state, where), ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        steps = sorted({reports[r]["step"] for r in ranks})
        step_text = ", ".join(str(s) for s in steps[:3]) + (", ..." if len(steps) > 3 else "")
        progress = reports[ranks[0]]["progress"]
        lines.append(
            f"  rank {format_ranks(ranks)}: {state} in {where}; training step {step_text}; "
            f"last progress: {progress} ({reports[ranks[0]]['idle']:.1f} s before the dump)"
        )
    alive = [rank for rank in missing if _alive(positions.get(rank), now, stale_after)]
    for rank in missing[:8]:
        position = positions.get(rank)
        if rank in alive and position is not None:
            lines.append(
                f"  rank {rank}: alive, no report (its watchdog is off: it has left the training loop); "
                f"{position.describe(now)}"
            )
            continue
        seen = "never published a position" if position is None else f"last seen: {position.describe(now)}"
        lines.append(f"  rank {rank}: NO REPORT (dead, or frozen without running Python); {seen}")
    if len(missing) > 8:
        lines.append(f"  ... and {len(missing) - 8} more ranks without a report: {format_ranks(missing)}")
    lines.extend(_verdict(groups, [r for r in missing if r not in alive], alive, _uneven(reports, positions, alive)))
    dumps = [reports[r]["dump"] for r in sorted(reports) if reports[r].get("dump")]
    if dumps:
        folder = os.path.dirname(dumps[0])
        same = all(os.path.dirname(d) == folder for d in dumps)
        names = ", ".join(os.path.basename(d) if same else d for d in dumps[:8]) + (" ..." if len(dumps) > 8 else "")
        lines.append(f"Stack dumps (all threads): {names}" + (f" in {folder}" if same else ""))
    lines.append(f"Every rank now exits with code {exit_code}.")
    return "\n".join(lines)


def _alive(position: Position | None, now: float, stale_after: float) -> bool:
    """Whether a rank's heartbeat is recent: it runs Python, even without a report."""
    return position is not None and position.kind != "failed" and now - position.heartbeat <= stale_after


def _uneven(reports: dict[int, dict[str, Any]], positions: dict[int, Position | None], alive: list[int]) -> str:
    """Uneven training inputs: a rank waits in a per-batch collective of an epoch another (live) rank ran out of.

    Rank ``b`` waits in DDP's gradient all-reduce or buffer sync, or in Lightning's per-batch broadcast; rank ``o``
    does not, and started fewer batches of that epoch (it ended the epoch, or left the training loop), or is in a
    later epoch. Ranks without a report count with their published position when alive (``alive``). Empty: none.
    """
    reached: dict[int, tuple[int, int]] = {
        r: (int(rep["epoch"]), int(rep["batches"])) for r, rep in reports.items() if rep.get("epoch") is not None
    }
    for rank in alive:
        position = positions.get(rank)
        if position is not None and position.epoch is not None:
            reached[rank] = (position.epoch, position.epoch_batch or 0)
    in_batch = [r for r, rep in reports.items() if rep.get("per_batch") and r in reached]

    def behind(o: int, b: int) -> bool:  # o ran out of the batches of b's epoch (it ended or left that epoch)
        (epoch_o, count_o), (epoch_b, count_b) = reached[o], reached[b]
        return epoch_o > epoch_b or (epoch_o == epoch_b and count_o < count_b)

    ran_out = sorted(o for o in reached if o not in in_batch and any(behind(o, b) for b in in_batch))
    if not ran_out:
        return ""
    counts = ", ".join(f"rank {r}: {n} (epoch {e})" for r, (e, n) in sorted(reached.items()))
    return (
        f"rank {format_ranks(ran_out)}: ran out of training batches while rank {format_ranks(in_batch)} still had "
        f"one (uneven inputs: the ranks' loaders yield different numbers of batches), so rank "
        f"{format_ranks(in_batch)} {'waits' if len(in_batch) == 1 else 'wait'} in a per-batch collective no other "
        f"rank enters. Batches started per rank in its epoch: {counts}. Give every rank the same number of batches "
        "(Lightning's DistributedSampler, or equal-length shards of an IterableDataset)"
    )


def _verdict(
    groups: dict[tuple[str, str], list[int]], missing: list[int], alive: list[int] | None = None, uneven: str = ""
) -> list[str]:
    waiting = sorted(r for (state, _), ranks in groups.items() if state == "waiting" for r in ranks)
    running = sorted(r for (state, _), ranks in groups.items() if state == "running" for r in ranks)
    found: list[str] = [uneven] if uneven else []
    if missing:
        found.append(f"rank {format_ranks(missing)}: gone (no report, heartbeat stopped): it died or exited early")
    if alive:
        verb = "waits" if len(waiting) == 1 else "wait"
        tail = f" while rank {format_ranks(waiting)} {verb} in it" if waiting else ""
        found.append(f"rank {format_ranks(alive)}: alive but outside the training loop (see above){tail}")
    if running and (waiting or missing):
        found.append(
            f"rank {format_ranks(running)}: running its own code (not in any collective) while "
            + (
                f"rank {format_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} for it"
                if waiting
                else "the others are gone"
            )
        )
    if not found and len(groups) > 1:
        sizes = sorted((len(ranks) for ranks in groups.values()), reverse=True)
        if sizes[0] > sizes[1]:
            largest = max(groups.values(), key=len)
            odd = sorted(r for ranks in groups.values() if ranks is not largest for r in ranks)
            found.append(f"rank {format_ranks(odd)}: at a different place than the others (see above)")
        else:
            found.append(
                "no majority: the ranks wait in different collectives (a rank-dependent branch around a barrier "
                "or collective is the usual cause)"
            )
    if not found:
        return [
            "Differs from the rest: none; every rank is at the same place (a collective all ranks entered hangs: "
            "look at the network or backend, or every rank is stuck in the same code)."
        ]
    return ["Differs from the rest:", *(f"  {line}" for line in found)]


class HangWatchdog(Callback):
    """Dump every rank's stacks and stop the job when a rank makes no progress for ``timeout`` seconds.

    Progress is any of Lightning's batch, epoch, backward, optimizer or checkpoint hooks on this rank. When a
    rank sees no progress for ``timeout`` seconds (stuck in a gloo/NCCL collective, in a barrier only some ranks
    called, in its own code such as an endless loop or sleep, or waiting for a rank that died), it raises an
    alarm through the rendezvous store of :class:`~ddp_strategy.SafeDDPStrategy`'s control plane. Then every rank
    whose watchdog thread can run

    1. writes the Python stack of each of its threads, with where it is and its last progress, to
       ``<dump_dir>/hang-rank<R>.txt`` and to stderr;
    2. publishes a short report (training step, last progress, where its training thread is waiting);

    the lowest rank that reported (rank 0 unless rank 0 is the one that is gone) prints a one-screen summary:
    each place ranks are at (barrier name and call site, collective, training step), ranks without a report
    with their last published position and heartbeat, and which ranks differ from the rest; and every rank
    exits with ``exit_code`` (``os._exit`` after flushing), so the launcher returns non-zero instead of waiting
    for the process-group timeout. A rank that reported nothing within ``grace_period`` and still runs on the
    summarising rank's host (frozen without running Python) is killed.

    When the training thread fails with an exception instead (gloo notices a dead peer at once), the callback
    names peers that failed first or whose heartbeat has stopped, since the backend's error names only an address
    (:func:`~ddp_strategy.peers.diagnose_failed_peers`, shared with ``SafeDDPStrategy``: one message per failure).

    Without ``SafeDDPStrategy`` (or with one process) the watchdog still dumps this rank's stacks and exits.

    Args:
        timeout: seconds (or a ``timedelta``) without progress on a rank before the alarm. Set it well above
            the longest legitimate gap between two hooks (a checkpoint write, the first batch of a slow
            dataloader, a long validation ``setup``).
        dump_dir: where the per-rank stack files go. Default: ``<trainer.default_root_dir>/hang_dumps``.
        grace_period: seconds the ranks wait for each other's reports after the alarm before the summary.
        exit_code: the exit code of every rank after a hang (1-255). Default: 124.
        poll_interval: seconds between two checks of the watchdog thread. Default: ``min(1, timeout / 4)``.

    Raises:
        ValueError: an argument is not a positive number (``exit_code``: not an integer in 1-255).

    """

    def __init__(
        self,
        timeout: float | timedelta = 600.0,
        *,
        dump_dir: str | os.PathLike[str] | None = None,
        grace_period: float = 10.0,
        exit_code: int = HANG_EXIT_CODE,
        poll_interval: float | None = None,
    ) -> None:
        self.timeout = to_timedelta(timeout, name="timeout").total_seconds()
        self.grace_period = to_timedelta(grace_period, name="grace_period").total_seconds()
        if not isinstance(exit_code, int) or isinstance(exit_code, bool) or not 1 <= exit_code <= 255:
            raise ValueError(f"`exit_code` must be an integer from 1 to 255 (non-zero), got {exit_code!r}.")
        self.exit_code = exit_code
        self.poll_interval = (
            min(1.0, self.timeout / 4)
            if poll_interval is None
            else to_timedelta(poll_interval, name="poll_interval").total_seconds()
        )
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self._progress_at = time.monotonic()
        self._progress_what = "setup"
        self._stop = threading.Event()
        self._firing = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer: pl.Trainer | None = None
        self._control: ControlPlane | None = None
        self._store: Store | None = None
        self._rank = 0
        self._world_size = 1
        self._folder = Path("hang_dumps")

    def __getstate__(self) -> dict[str, Any]:
        # The spawn launcher pickles the Trainer with its callbacks: leave the thread, events and store behind.
        state = dict(self.__dict__)
        for name in ("_stop", "_firing", "_thread", "_trainer", "_control", "_store"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop, self._firing = threading.Event(), threading.Event()
        self._thread = self._trainer = self._control = self._store = None

    # ------------------------------------------------------------------ life cycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm()
        control = getattr(trainer.strategy, "control_plane", None)
        self._control = control if isinstance(control, ControlPlane) else None
        self._trainer = trainer
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._folder = self.dump_dir if self.dump_dir is not None else Path(trainer.default_root_dir) / "hang_dumps"
        self._store = None
        if self._control is not None and self._control.world_size > 1:
            self._store = self._control.connect()
            process = {"host": socket.gethostname(), "pid": os.getpid()}
            self._store.set(_PROCESS_KEY.format(rank=self._rank), json.dumps(process))
        elif trainer.world_size > 1:
            rank_zero_warn(
                "HangWatchdog coordinates ranks through SafeDDPStrategy's control plane, which this run does not "
                f"have ({type(trainer.strategy).__name__}); each rank will only dump its own stacks and exit."
            )
        self._stop = threading.Event()
        self._note("setup")
        self._thread = threading.Thread(
            target=self._watch, name=f"ddp_strategy-hang-watchdog-rank{self._rank}", daemon=True
        )
        self._thread.start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()  # the strategy's teardown (its own timeouts) follows; nothing left to watch

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._disarm()
        else:
            self._note("on_validation_end")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._firing.is_set():
            # The watchdog is dumping and will exit the process; returning would let this rank exit on the error
            # first, and a launcher may then kill the rank that is printing the summary.
            time.sleep(2 * self.grace_period + 5.0)
        armed = self._thread is not None
        self._disarm()
        if armed and self._control is not None:
            # The backend's error names an address, not a rank: name the peers that failed or are gone. Shared
            # with SafeDDPStrategy.on_exception (called after this): one wait and one message per failure.
            diagnose_failed_peers(self._control, exception)

    def _disarm(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # ------------------------------------------------------------------ progress
    def _note(self, what: str) -> None:
        self._progress_at = time.monotonic()
        self._progress_what = what

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_fit_start")

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_sanity_check_start")

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_sanity_check_end")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_train_start")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(f"on_train_epoch_start (epoch {trainer.current_epoch})")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(f"on_train_epoch_end (epoch {trainer.current_epoch})")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._note(f"on_train_batch_start (batch {batch_idx})")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._note(f"on_train_batch_end (batch {batch_idx})")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._note("on_before_backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_after_backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._note("on_before_optimizer_step")

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._note("on_before_zero_grad")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_validation_start")

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_validation_epoch_start")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_validation_epoch_end")

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._note(f"on_validation_batch_start (batch {batch_idx})")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._note(f"on_validation_batch_end (batch {batch_idx})")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_test_start")

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._note(f"on_test_batch_start (batch {batch_idx})")

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._note(f"on_test_batch_end (batch {batch_idx})")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note("on_predict_start")

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._note(f"on_predict_batch_start (batch {batch_idx})")

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._note(f"on_predict_batch_end (batch {batch_idx})")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._note("on_save_checkpoint")

    # ------------------------------------------------------------------ the watchdog thread
    def _watch(self) -> None:
        stop, store = self._stop, self._store
        while not stop.wait(self.poll_interval):
            idle = time.monotonic() - self._progress_at
            if idle > self.timeout:
                reason = (
                    f"rank {self._rank} made no progress for {idle:.1f} s (timeout {self.timeout:g} s; "
                    f"last progress: {self._progress_what})"
                )
                if stop.is_set():
                    return
                self._fire(reason, raise_alarm=True)
                return
            if store is None:
                continue
            try:
                alarm = store.check([_TRIGGER_KEY])
                reason = store.get(_TRIGGER_KEY).decode() if alarm else ""
            except Exception:  # the store is gone (rank 0 exited or died): only this rank's own progress counts now
                continue
            if alarm and not stop.is_set():
                self._fire(reason, raise_alarm=False)
                return

    def _fire(self, reason: str, *, raise_alarm: bool) -> None:
        """Dump, exchange reports, summarise, exit. Runs on the watchdog thread; never returns."""
        self._firing.set()
        store = self._store
        store_error: Exception | None = None
        if store is not None and raise_alarm:
            try:
                store.set(_TRIGGER_KEY, reason)
            except Exception as err:
                store_error = err
        try:
            report = self._report(reason)
            if store is None or store_error is not None:
                self._print_local(report, reason, store_error)
            else:
                self._coordinate(store, report, reason)
        except BaseException as err:  # the process must still exit: say what went wrong, then go
            self._emit(f"HangWatchdog (rank {self._rank}) could not finish its report: {err!r}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.exit_code)

    def _report(self, reason: str) -> dict[str, Any]:
        """Write this rank's stack dump (file and stderr) and return the summary data for it."""
        now = time.time()
        idle = time.monotonic() - self._progress_at
        position = self._control.position if self._control is not None else None
        main = threading.main_thread()
        stack = _frames(sys._current_frames().get(main.ident or -1))
        state, where = locate(stack, position)
        epoch, batches = self._control.progress if self._control is not None else (None, None)
        before_batch = any(f[2] == _BEFORE_BATCH for f in stack)
        trainer = self._trainer
        step = int(trainer.global_step) if trainer is not None else -1
        head = [
            f"HangWatchdog stack dump: rank {self._rank} of {self._world_size}, host {socket.gethostname()}, "
            f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}",
            f"Alarm: {reason}",
            f"Training thread: {state} in {where}",
            f"Training step {step}; last progress: {self._progress_what}, {idle:.1f} s ago",
        ]
        if position is not None:
            head.append(f"Published position: {position.describe(now)}")
        text = "\n".join([*head, "", _dump_threads()])
        path = self._folder / f"hang-rank{self._rank}.txt"
        written = ""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            written = str(path.resolve())
        except OSError as err:
            text += f"\n(could not write {path}: {err})"
        self._emit("\n".join(f"[rank{self._rank}]: {line}" for line in text.splitlines()))
        return {
            "rank": self._rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": step,
            "state": state,
            "where": where,
            "progress": self._progress_what,
            "idle": idle,
            "dump": written,
            # for the uneven-inputs verdict: the batches of its epoch this rank started (one it waits to start
            # included), and whether it waits in a collective every rank enters once per training batch
            "epoch": epoch,
            "batches": None if epoch is None else (batches or 0) + int(before_batch),
            "per_batch": state == "waiting" and (before_batch or where.startswith(_PER_BATCH_WAITS)),
        }

    def _coordinate(self, store: Store, report: dict[str, Any], reason: str) -> None:
        """Publish this rank's report; the lowest reporting rank prints the summary, the others wait for it.

        The others exit only after the summary is out (a launcher may kill every rank as soon as one exits), and
        the summarising rank exits only after they saw it (its process hosts the store when it is rank 0).
        """
        keys = [_REPORT_KEY.format(rank=r) for r in range(self._world_size)]
        try:
            store.set(keys[self._rank], json.dumps(report))
            deadline = time.monotonic() + self.grace_period
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(_POLL)
            present = [r for r in range(self._world_size) if store.check([keys[r]])]
        except Exception as err:
            self._print_local(report, reason, err)
            return
        if any(r < self._rank for r in present):  # a lower rank summarises
            try:
                deadline = time.monotonic() + self.grace_period + 2.0
                while not store.check([_DONE_KEY]) and time.monotonic() < deadline:
                    time.sleep(_POLL)
                if store.check([_DONE_KEY]):
                    store.set(_ACK_KEY.format(rank=self._rank), "1")
                    return
            except Exception as err:  # the summarising rank 0 exited, taking the store with it
                self._emit(
                    f"HangWatchdog (rank {self._rank}): the store went away while waiting for the summary ({err})."
                )
                return
            present = [r for r in present if r >= self._rank]  # it never finished: summarise here instead
        try:
            reports = {r: json.loads(store.get(keys[r])) for r in present}
            positions = self._control.read_positions(store) if self._control is not None else {}
        except Exception as err:
            self._print_local(report, reason, err)
            return
        stale = max(3.0, 4 * self._control.heartbeat_interval) if self._control is not None else 3.0
        self._emit(
            summarize(reports, positions, self._world_size, trigger=reason, exit_code=self.exit_code, stale_after=stale)
        )
        try:
            alive = {r for r, p in positions.items() if _alive(p, time.time(), stale)}
            self._kill_frozen(store, {**{r: {} for r in alive}, **reports})
            store.set(_DONE_KEY, "1")
            acks = [_ACK_KEY.format(rank=r) for r in present if r != self._rank]
            deadline = time.monotonic() + 2.0
            while acks and not store.check(acks) and time.monotonic() < deadline:
                time.sleep(_POLL)
        except Exception as err:
            log.debug("HangWatchdog: could not announce the summary (%s)", err)

    def _kill_frozen(self, store: Store, reports: dict[int, dict[str, Any]]) -> None:
        """Kill ranks on this host that never reported and whose heartbeat stopped (frozen without running Python).

        ``reports`` also holds (empty) entries for ranks whose heartbeat is recent: they are alive and left alone.
        """
        host = socket.gethostname()
        for rank in range(self._world_size):
            key = _PROCESS_KEY.format(rank=rank)
            if rank in reports or not store.check([key]):
                continue
            process = json.loads(store.get(key))
            if process.get("host") != host:
                continue
            try:
                os.kill(int(process["pid"]), signal.SIGKILL)
                self._emit(f"HangWatchdog: killed rank {rank} (pid {process['pid']}): alive but unresponsive.")
            except ProcessLookupError:
                pass  # already gone: the usual case of a dead rank
            except OSError as err:
                self._emit(f"HangWatchdog: could not kill unresponsive rank {rank} (pid {process['pid']}): {err}")

    def _print_local(self, report: dict[str, Any], reason: str, store_error: Exception | None) -> None:
        lines = [f"===== HangWatchdog (rank {self._rank}): training hung; {reason} ====="]
        if store_error is not None:
            lines.append(
                f"The rendezvous store is unreachable ({store_error}); it is hosted by rank 0's process (the node-0 "
                "agent under torchrun), so rank 0 has most likely died or exited: look at its output. Only this "
                "rank's view follows."
            )
        lines.append(
            f"  rank {self._rank}: {report['state']} in {report['where']}; training step {report['step']}; "
            f"last progress: {report['progress']}"
        )
        if report["dump"]:
            lines.append(f"Stack dump: {report['dump']}")
        lines.append(f"This rank now exits with code {self.exit_code}.")
        self._emit("\n".join(lines))

    @staticmethod
    def _emit(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
