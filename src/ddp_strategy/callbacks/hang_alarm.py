"""``HangAlarm``: what one rank does once the hang alarm is raised: dump its stacks, exchange reports, exit.

:class:`~ddp_strategy.callbacks.HangWatchdog` builds one on its watchdog thread when the alarm goes off (this rank
made no progress for ``timeout`` seconds, or another rank raised the alarm in the rendezvous store). The rank writes
the stacks of all its threads to a file and to stderr, publishes a short report in the store, the lowest rank that
reported prints the summary of all ranks (:func:`~.hang_report.summarize`), and the rank exits.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..control import ControlPlane, Store
from ..store import get_if_set
from .hang_report import BEFORE_BATCH, PER_BATCH_WAITS, dump_threads, frames, is_alive, locate, summarize

__all__ = ["PROCESS_KEY", "TRIGGER_KEY", "HangAlarm"]

log = logging.getLogger(f"{__package__}.hang_watchdog")  # the logger it had before the split

TRIGGER_KEY = "hang/trigger"  # the alarm: the reason of the rank that raised it
PROCESS_KEY = "hang/process/{rank}"  # each rank's host and pid, to kill a rank frozen without running Python
_REPORT_KEY = "hang/report/{rank}"
_REPORTED_KEY = "hang/reported"  # the ranks that published a report, one per line (``append``)
_REPORTED_COUNT_KEY = "hang/reported-count"  # how many did (``add``): every rank waits on this one counter
_DONE_KEY = "hang/done"
_ACK_COUNT_KEY = "hang/acks"  # how many ranks saw the summary (``add``)
_POLL = 0.05  # seconds between store polls while ranks exchange their reports
_READ_BATCH = 256  # reports per ``multi_get`` of the summarising rank


@dataclass(frozen=True)
class HangAlarm:
    """What one rank does once the hang alarm is raised: dump its stacks, exchange reports, summarise, exit.

    Every rank whose watchdog thread can run writes the Python stack of each of its threads, with where it is and
    its last progress, to ``<folder>/hang-rank<R>.txt`` and to stderr, and publishes a short report in the store;
    the lowest rank that reported prints the one-screen summary, kills ranks on its host that never reported and
    whose heartbeat stopped, and every rank exits with :attr:`exit_code`. Without a store, the rank prints its own
    view only.

    Attributes:
        rank: this rank.
        world_size: the number of ranks.
        control: ``SafeDDPStrategy``'s control plane (published positions and progress); ``None`` without one.
        store: the control plane's store, where the alarm and the reports go; ``None`` without one (or one rank).
        folder: where the stack dump goes.
        exit_code: the code the rank exits with.
        grace_period: seconds the ranks wait for each other's reports before the summary.
        step: the training step now (``trainer.global_step``; -1 without a trainer).
        progress: when (``time.monotonic()``) and in which hook the training thread last made progress.
        emit: writes a message to stderr.

    """

    rank: int
    world_size: int
    control: ControlPlane | None
    store: Store | None
    folder: Path
    exit_code: int
    grace_period: float
    step: Callable[[], int]
    progress: Callable[[], tuple[float, str]]
    emit: Callable[[str], None]

    def sound(self, reason: str, *, raise_alarm: bool) -> None:
        """Dump, exchange reports, summarise, exit with :attr:`exit_code`; never returns.

        Args:
            reason: why the alarm went off (the text of the summary's first line).
            raise_alarm: this rank saw no progress for ``timeout`` seconds: raise the alarm in the store for the
                other ranks (``False``: another rank raised it).

        """
        store = self.store
        store_error: Exception | None = None
        if store is not None and raise_alarm:
            try:
                store.set(TRIGGER_KEY, reason)
            except Exception as err:
                store_error = err
        try:
            report = self.report(reason)
            if store is None or store_error is not None:
                self._print_local(report, reason, store_error)
            else:
                self._coordinate(store, report, reason)
        except BaseException as err:  # the process must still exit: say what went wrong, then go
            self.emit(f"HangWatchdog (rank {self.rank}) could not finish its report: {err!r}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.exit_code)

    def report(self, reason: str) -> dict[str, Any]:
        """Write this rank's stack dump (file and stderr) and return the summary data for it.

        Args:
            reason: why the alarm went off.

        Returns:
            The report this rank publishes for :func:`~.hang_report.summarize`: rank, host, pid, training step,
            ``state`` and ``where`` (:func:`~.hang_report.locate`), last progress and seconds since, the dump's
            path, and the epoch, batches started in it and ``per_batch`` for the uneven-inputs verdict.

        """
        now = time.time()
        progress_at, progress_what = self.progress()
        idle = time.monotonic() - progress_at
        position = self.control.heartbeat.position if self.control is not None else None
        main = threading.main_thread()
        stack = frames(sys._current_frames().get(main.ident or -1))
        state, where = locate(stack, position)
        epoch, batches = self.control.heartbeat.progress if self.control is not None else (None, None)
        before_batch = any(f[2] == BEFORE_BATCH for f in stack)
        step = self.step()
        head = [
            f"HangWatchdog stack dump: rank {self.rank} of {self.world_size}, host {socket.gethostname()}, "
            f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}",
            f"Alarm: {reason}",
            f"Training thread: {state} in {where}",
            f"Training step {step}; last progress: {progress_what}, {idle:.1f} s ago",
        ]
        if position is not None:
            head.append(f"Published position: {position.describe(now)}")
        text = "\n".join([*head, "", dump_threads()])
        path = self.folder / f"hang-rank{self.rank}.txt"
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
        self.emit("\n".join(f"[rank{self.rank}]: {line}" for line in text.splitlines()))
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": step,
            "state": state,
            "where": where,
            "progress": progress_what,
            "idle": idle,
            "dump": written,
            # for the uneven-inputs verdict: the batches of its epoch this rank started (one it waits to start
            # included), and whether it waits in a collective every rank enters once per training batch
            "epoch": epoch,
            "batches": None if epoch is None else (batches or 0) + int(before_batch),
            "per_batch": state == "waiting" and (before_batch or where.startswith(PER_BATCH_WAITS)),
        }

    def _coordinate(self, store: Store, report: dict[str, Any], reason: str) -> None:
        """Publish this rank's report; the lowest reporting rank prints the summary, the others wait for it.

        The others exit only after the summary is out (a launcher may kill every rank as soon as one exits), and
        the summarising rank exits only after they saw it (its process hosts the store when it is rank 0). Each
        rank's polls read one counter, whatever the world size; only the summarising rank reads every report, in
        batches.
        """
        try:
            store.set(_REPORT_KEY.format(rank=self.rank), json.dumps(report))
            store.append(_REPORTED_KEY, f"{self.rank}\n")
            reported = int(store.add(_REPORTED_COUNT_KEY, 1))
            deadline = time.monotonic() + self.grace_period
            while reported < self.world_size and time.monotonic() < deadline:
                time.sleep(_POLL)
                reported = int(store.add(_REPORTED_COUNT_KEY, 0))
            present = sorted({int(line) for line in (get_if_set(store, _REPORTED_KEY) or b"").decode().split()})
        except Exception as err:
            self._print_local(report, reason, err)
            return
        if any(r < self.rank for r in present):  # a lower rank summarises
            try:
                deadline = time.monotonic() + self.grace_period + 2.0
                while not store.check([_DONE_KEY]) and time.monotonic() < deadline:
                    time.sleep(_POLL)
                if store.check([_DONE_KEY]):
                    store.add(_ACK_COUNT_KEY, 1)
                    return
            except Exception as err:  # the summarising rank 0 exited, taking the store with it
                self.emit(
                    f"HangWatchdog (rank {self.rank}): the store went away while waiting for the summary ({err})."
                )
                return
            present = [r for r in present if r >= self.rank]  # it never finished: summarise here instead
        try:
            reports: dict[int, dict[str, Any]] = {}
            for start in range(0, len(present), _READ_BATCH):
                chunk = present[start : start + _READ_BATCH]
                values = store.multi_get([_REPORT_KEY.format(rank=r) for r in chunk])
                reports.update({r: json.loads(value) for r, value in zip(chunk, values, strict=True)})
            positions = self.control.heartbeat.read_positions(store) if self.control is not None else {}
        except Exception as err:
            self._print_local(report, reason, err)
            return
        stale = max(3.0, 4 * self.control.heartbeat.interval) if self.control is not None else 3.0
        self.emit(
            summarize(reports, positions, self.world_size, trigger=reason, exit_code=self.exit_code, stale_after=stale)
        )
        try:
            alive = {r for r, p in positions.items() if is_alive(p, time.time(), stale)}
            self._kill_frozen(store, {**{r: {} for r in alive}, **reports})
            store.set(_DONE_KEY, "1")
            others = len([r for r in present if r != self.rank])
            deadline = time.monotonic() + 2.0
            while others and int(store.add(_ACK_COUNT_KEY, 0)) < others and time.monotonic() < deadline:
                time.sleep(_POLL)
        except Exception as err:
            log.debug("HangWatchdog: could not announce the summary (%s)", err)

    def _kill_frozen(self, store: Store, reports: dict[int, dict[str, Any]]) -> None:
        """Kill ranks on this host that never reported and whose heartbeat stopped (frozen without running Python).

        ``reports`` also holds (empty) entries for ranks whose heartbeat is recent: they are alive and left alone.
        """
        host = socket.gethostname()
        for rank in range(self.world_size):
            value = None if rank in reports else get_if_set(store, PROCESS_KEY.format(rank=rank))
            if value is None:
                continue
            process = json.loads(value)
            if process.get("host") != host:
                continue
            try:
                os.kill(int(process["pid"]), signal.SIGKILL)
                self.emit(f"HangWatchdog: killed rank {rank} (pid {process['pid']}): alive but unresponsive.")
            except ProcessLookupError:
                pass  # already gone: the usual case of a dead rank
            except OSError as err:
                self.emit(f"HangWatchdog: could not kill unresponsive rank {rank} (pid {process['pid']}): {err}")

    def _print_local(self, report: dict[str, Any], reason: str, store_error: Exception | None) -> None:
        lines = [f"===== HangWatchdog (rank {self.rank}): training hung; {reason} ====="]
        if store_error is not None:
            lines.append(
                f"The rendezvous store is unreachable ({store_error}); it is hosted by rank 0's process (the node-0 "
                "agent under torchrun), so rank 0 has most likely died or exited: look at its output. Only this "
                "rank's view follows."
            )
        lines.append(
            f"  rank {self.rank}: {report['state']} in {report['where']}; training step {report['step']}; "
            f"last progress: {report['progress']}"
        )
        if report["dump"]:
            lines.append(f"Stack dump: {report['dump']}")
        lines.append(f"This rank now exits with code {self.exit_code}.")
        self.emit("\n".join(lines))
