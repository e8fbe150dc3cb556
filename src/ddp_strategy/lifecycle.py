"""``RunLifecycle``: the process groups of a run, and the control plane and desync monitor of each stage.

It owns what the strategy builds for a stage and takes down after it: the default process group (created once, kept
until the process exits), the control plane, the desync monitor, the pinning of the gloo worker threads (and the
fork-hazard warning when it was incomplete), whether the stage failed, what a failure publishes (and which peer it
blames), the comparison of the ranks' strategy collectives at the end, and the error the launcher raises instead of
a backend error that diverged collectives caused.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ._compat.lightning import (
    destroy_default_process_group,
    init_default_process_group,
    pl,
    rank_zero_warn,
    trainer_of,
    training_dataloaders,
    training_progress,
)
from ._compat.torch import collective_status, collective_trace_enabled, recorder_size
from .collective_calls import CollectiveCalls
from .collective_record import TRACE_ENTRIES, CallLedger, first_published_difference
from .control import ControlPlane
from .desync import DesyncMonitor
from .errors import CollectiveMismatchError, DDPStrategyError
from .fork_safety import fork_hazard, pin_collective_threads
from .host import StrategyHost
from .options import StrategyOptions
from .peers import diagnose_failed_peers
from .positions import call_site
from .preemption import Preempted
from .rendezvous import member_of, open_rendezvous

__all__ = ["RunLifecycle"]

_BACKEND_MARKERS = ("gloo", "Gloo", "NCCL", "c10d")
_PEER_GONE_MARKERS = ("Connection closed", "Connection reset", "Broken pipe")


class RunLifecycle:
    """The control plane and desync monitor of the current stage, and what happens when the stage ends or fails.

    Args:
        calls: the strategy's own collectives; the desync monitor is built with their notes and handed to them.
        options: the strategy's options (``barrier_timeout``, ``heartbeat_interval``, ``desync_detection``: a
            monitor needs the heartbeat).

    """

    def __init__(self, calls: CollectiveCalls, options: StrategyOptions) -> None:
        self.calls = calls
        self.barrier_timeout = options.barrier_timeout
        self.heartbeat_interval = options.heartbeat_interval
        self.desync_detection = options.desync_detection
        self.rendezvous_report_interval = options.rendezvous_report_interval
        self.rendezvous_timeout = options.rendezvous_timeout
        #: The control plane, between :meth:`start` and :meth:`close`.
        self.control: ControlPlane | None = None
        #: The desync monitor, while the control plane exists and desync detection is on (several ranks).
        self.desync: DesyncMonitor | None = None
        #: Whether the stage failed on this rank (no collective close, no agreement on the last async write).
        self.failed = False
        #: Whether the gloo worker threads of the process groups keep a Python thread state (see fork_safety).
        self.collective_threads_pinned = False
        self._default_group_pinned = False
        self._epoch: tuple[int, int | None] = (-1, None)  # (batch_idx, epoch) of the last training batch noted

    def control_plane_or_none(self) -> ControlPlane | None:
        """The control plane, or ``None`` outside a stage (a bound method: what holds it still pickles)."""
        return self.control

    def create_process_group(self, strategy: Any) -> None:
        """``DDPStrategy.setup_distributed``, except that NCCL is initialised lazily (no ``device_id``).

        Two ranks on one GPU then reach the device check on the control plane instead of failing inside NCCL's own
        init. With desync detection, torch's Flight Recorder (on by default) is given its size first (it reads it then).

        Args:
            strategy: the strategy being set up.

        """
        # torch's recorder reads its size when the first process group is made (the environment is restored after)
        tracing = collective_trace_enabled(TRACE_ENTRIES) if self.desync_detection else contextlib.nullcontext(0)
        with tracing:
            created = init_default_process_group(strategy, store=lambda _, timeout: self._rendezvous(strategy, timeout))
        if created and strategy.process_group_backend != "nccl":  # Lightning registers this for NCCL itself
            # The default group outlives teardown (fit, then validate/test, reuse it, as in stock Lightning) and
            # is destroyed when the process exits.
            atexit.register(destroy_default_process_group)

    def _rendezvous(self, strategy: Any, timeout: timedelta | None) -> Any:
        """The reporting rendezvous (``rendezvous.py``); its store goes to ``init_process_group``."""
        environment = strategy.cluster_environment
        return open_rendezvous(
            member_of(strategy, strategy.agreed_options, strategy.made_at),
            environment.main_address,
            environment.main_port,
            interval=self.rendezvous_report_interval,
            timeout=self.rendezvous_timeout,
            pg_timeout=timeout if timeout is not None else timedelta(minutes=30),
        )

    def start(self, strategy: StrategyHost) -> None:
        """At ``setup_environment``: create the control plane (and desync monitor) unless it exists; not failed.

        Args:
            strategy: the strategy being set up (its world size; its Trainer's training progress, ``(epoch, batches
                fetched in it)``, for the desync monitor).

        """
        self._epoch = (-1, None)
        world_size = strategy.world_size

        def progress() -> tuple[int, int] | None:
            return training_progress(trainer_of(strategy.lightning_module))

        if self.control is None:
            self.control = ControlPlane.create(timeout=self.barrier_timeout, heartbeat_interval=self.heartbeat_interval)
            self.desync = None
            watch = self.desync_detection and world_size > 1 and self.heartbeat_interval > 0
            if watch and collective_status():  # torch's Flight Recorder is on (see setup_distributed)
                self.desync = DesyncMonitor(
                    self.control,
                    self.calls.notes,
                    progress=progress,
                    ledger=CallLedger(),
                    recorder_entries=recorder_size(),
                )
            self.calls.watched_by(self.desync)
            if world_size > 1:  # before any DataLoader forks a worker (see fork_safety)
                groups = [self.control.group] if self._default_group_pinned else [dist.group.WORLD, self.control.group]
                self.collective_threads_pinned = pin_collective_threads(groups)
                self._default_group_pinned = True
        self.failed = False

    def barrier(self, name: str | None, fallback: Callable[[str | None], None]) -> None:
        """``strategy.barrier(name)``: the control plane's monitored barrier, or ``fallback`` outside a stage.

        Args:
            name: the barrier's name, for errors.
            fallback: DDP's own barrier, for when there is no control plane or no default process group.

        Raises:
            CollectiveMismatchError: some ranks did not arrive within the timeout, or arrived at another barrier.

        """
        control = self.control
        if control is None or not dist.is_initialized():
            fallback(name)
            return
        control.barrier(name, site=call_site(skip=3))

    def warn_about_fork_hazard(self, strategy: StrategyHost) -> None:
        """On rank 0, when the gloo threads could not all be pinned: name the DataLoaders that fork every epoch."""
        trainer = trainer_of(strategy.lightning_module)
        if trainer is None or not strategy.is_global_zero or self.collective_threads_pinned:
            return
        val = trainer.val_dataloaders
        loaders = [("training", loader) for loader in training_dataloaders(trainer)]
        loaders += [("validation", loader) for loader in (val if isinstance(val, list | tuple) else [val])]
        warning = fork_hazard(loaders, world_size=strategy.world_size)
        if warning is not None:
            rank_zero_warn(warning)

    def note_step(self, trainer: pl.Trainer | None, step: int, batches: int, batch_idx: int) -> None:
        """Before a training step: this rank's position, which the heartbeat publishes (an attribute assignment)."""
        if self.control is not None:
            last_idx, epoch = self._epoch
            if batch_idx <= last_idx or epoch is None:  # a new epoch (or the first batch noted): read it, once
                epoch = trainer.current_epoch if trainer is not None else None
            self._epoch = (batch_idx, epoch)
            self.control.heartbeat.note_step(step, batch=batches, epoch=epoch, epoch_batch=batch_idx + 1)
        if batch_idx == 0 and self.desync is not None:  # the previous epoch's last calls, once per epoch (~1 ms)
            self.desync.audit_now()

    def raise_agreed_desync(self) -> None:
        """Raise the desync every rank agreed on, at this rank's next strategy hook (its ranks run on otherwise)."""
        if self.control is not None and self.control.desync_error is not None:
            raise self.control.desync_error

    def agreed_error_instead(self, error: BaseException) -> BaseException | None:
        """The desync error the ranks agreed on, to raise instead of the backend error it caused; else ``None``."""
        monitor = self.desync
        if monitor is None or isinstance(error, DDPStrategyError):
            return None
        if monitor.control.desync_error is not None:
            return monitor.control.desync_error
        text = str(error)
        if not isinstance(error, RuntimeError) or not any(m in text for m in _BACKEND_MARKERS):
            return None
        if any(m in text for m in _PEER_GONE_MARKERS):
            return None  # a peer process is gone: the failure diagnosis names it (peers.py)
        return monitor.inquire()  # the backend refused a call: ask every rank whether their collectives diverged

    def on_exception(self, exception: BaseException, global_rank: int) -> None:
        """Before Lightning's ``on_exception``: publish this rank's failure and name a failed peer, once.

        A preemption is no failure. The desync every rank agreed on is neither published nor diagnosed (every rank
        reached it itself): rank 0 shows it first, the others wait for that.
        """
        if isinstance(exception, Preempted):  # every rank stopped at the agreed step: no failure to name
            return
        self.failed = True
        control = self.control
        if control is None:
            return
        if exception is control.desync_error:
            self._hand_over_desync(global_rank)
            return
        control.note_failure(exception)
        diagnose_failed_peers(control, exception)  # logs it, unless a HangWatchdog's on_exception did
        if global_rank == 0:  # the store's host: let every peer read the failure before it goes away
            control.await_failure_seen()

    def close(self, global_rank: int) -> CollectiveMismatchError | None:
        """At ``teardown``: compare the ranks' strategy collectives, then close the control plane.

        Closing is collective only after a success (after a failure other ranks may never reach a closing barrier).

        Returns:
            The error to raise once Lightning's teardown ran, when the ranks' strategy collectives differed.

        """
        if self.control is None:
            return None
        diverged: CollectiveMismatchError | None = None
        try:
            self.compare_strategy_calls()
        except CollectiveMismatchError as err:
            diverged, self.failed = err, True
            # as on_exception, which runs after the control plane is gone here; every rank has the error from the
            # gather, so rank 0 waits for no verdict
            self._hand_over_desync(global_rank, await_verdicts=False)
        try:
            self.control.close(graceful=not self.failed)
        finally:
            self.control = None
            self.desync = None
            self.calls.watched_by(None)
        return diverged

    def _hand_over_desync(self, global_rank: int, *, await_verdicts: bool = True) -> None:
        """Rank 0 shows the agreed desync first; the others wait for that (rank 0 may be blocked in a collective)."""
        if self.desync is None:
            return
        if global_rank == 0:
            self.desync.rank0_stopping(await_verdicts=await_verdicts)
        else:
            self.desync.await_rank0()

    def compare_strategy_calls(self) -> None:
        """At the end of a stage: every rank made the same strategy collectives, or all raise the same error.

        The heartbeat compares them during the run; a short run may end before it looks. One small gather.

        Raises:
            CollectiveMismatchError: the ranks' strategy collectives, or their recorded collectives, differ.

        """
        control, monitor = self.control, self.desync
        if control is None or monitor is None or self.failed:
            return
        gathered = control.all_gather_object((monitor.ledger.state, monitor.update_audit()), name="strategy-calls")
        states = [state for state, _ in gathered]
        difference = first_published_difference([publication for _, publication in gathered])
        if len(set(states)) == 1 and difference is None:
            return
        error = monitor.inquire()
        if error is None and difference is not None:
            group, seq = difference
            error = CollectiveMismatchError(
                f"The ranks made different collective calls: call #{seq} of process group {group} differs between "
                "ranks (its op, tensor shapes or dtypes, or the line of code that made it), too long ago to describe. "
                "Look for a collective in a rank-dependent branch.",
                name=f"collective #{seq}",
                missing_ranks=[],
                reason="desync",
            )
        if error is None:
            counts = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(states))
            error = CollectiveMismatchError(
                f"The ranks made different collectives through the strategy in this run ({counts} calls; the lists "
                "differ), too long ago to name the first one. Look for `self.log(..., sync_dist=True)`, "
                "`self.all_gather` or `strategy.broadcast` in a rank-dependent branch, or metric names that differ "
                "between ranks.",
                name="strategy-calls",
                missing_ranks=[],
                reason="desync",
            )
        raise error
