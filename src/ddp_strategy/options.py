"""``StrategyOptions``: the arguments of :class:`~ddp_strategy.SafeDDPStrategy` of its own, validated once."""

from __future__ import annotations

import functools
import inspect
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from .control import to_timedelta
from .evaluation.coordinator import PREDICTIONS_ON
from .preemption import DEFAULT_PREEMPTION_SIGNALS, parse_signals

__all__ = ["DEFAULT_BARRIER_TIMEOUT", "StrategyOptions", "default_option_text", "option_text", "options_to_agree"]

#: How long a named barrier waits for the other ranks before raising ``CollectiveMismatchError``.
DEFAULT_BARRIER_TIMEOUT = timedelta(minutes=10)

_SAVE_ON = frozenset({"global_zero", "node_zero"})
_ASYNC_SNAPSHOT = frozenset({"overlap", "blocking"})
_SHARDING_CHECK = frozenset({"raise", "warn"})
_WEIGHT_CHECK = frozenset({"epoch", "save"})
_UNEVEN_INPUTS = frozenset({"raise", "warn"})
#: Options that may differ between ranks: how long a rank waits, how often the rendezvous reports. Every other one
#: decides which collectives a rank makes, or how it reads what they carry (see :func:`agreed_options`).
_PER_RANK_OPTIONS = frozenset({"barrier_timeout", "rendezvous_report_interval", "rendezvous_timeout"})


@dataclass(frozen=True)
class StrategyOptions:
    """The options :class:`~ddp_strategy.SafeDDPStrategy` adds to ``DDPStrategy``'s, normalized and validated.

    Build it with :meth:`from_arguments`, which takes the values users pass (seconds or a ``timedelta``, signal
    names or numbers) and checks every one; the fields hold the normalized values.

    Args:
        barrier_timeout: how long a barrier (and each control-plane collective) waits for all ranks, as seconds
            or a ``timedelta``. Default: 10 minutes. Raise it if rank 0 legitimately takes longer alone (a long
            ``prepare_data`` download, a huge checkpoint write).
        handshake: run the start-up handshake. Default: ``True``.
        heartbeat_interval: seconds between the publications of each rank's position to the rendezvous store,
            used to say where a missing rank was. ``0`` disables the background heartbeat thread.
        async_save: write checkpoints in a background thread on rank 0 after a snapshot to CPU memory; training
            goes on during the write. At most one write is in flight; its outcome is agreed by all ranks at the
            next save or at teardown (which waits for it), and old checkpoints are removed only after it succeeded.
        async_snapshot: with ``async_save``, how a checkpoint saved during training is copied to CPU memory.
            ``"overlap"`` (default): parameters and optimizer state are copied while the next batch's forward and
            backward run, and the optimizer waits for the copy before it changes them (see
            :mod:`ddp_strategy.checkpoint.overlap`); an in-place change by other code in between fails that write
            loudly. ``"blocking"``: everything is copied before the save returns.
        save_on: ``"global_zero"`` (default): global rank 0 writes the one checkpoint; ranks that cannot see it at
            load time (a disk other nodes do not share) receive it from rank 0. ``"node_zero"``: local rank 0 of
            every node writes its own copy, for nodes without a shared filesystem.
        exact_evaluation: give every validation/test/predict sample to exactly one rank (no padded duplicates),
            let ranks with an empty shard take part in the epoch-end metric sync, and return predictions in
            dataset order. Default: ``True``. ``False`` keeps Lightning's padded ``DistributedSampler``.
        predictions_on: with exact evaluation, where ``trainer.predict`` returns all predictions in dataset order:
            ``"global_zero"`` (default; other ranks get their own share) or ``"all"``.
        sharding_check: compare the first training batches across ranks (a
            :class:`~ddp_strategy.callbacks.ShardingCheck` is added unless the Trainer has one): ``"warn"``
            (default) or ``"raise"`` when two ranks receive identical batches, ``None`` to skip.
        uneven_inputs: what to do when the ranks' training batch counts per epoch are known (map-style data,
            sized loaders) and differ, which would hang DDP's gradient all-reduce: ``"raise"`` (default) an
            :class:`~ddp_strategy.errors.UnevenInputsError` on every rank before the first step, ``"warn"``, or
            ``None`` to skip the comparison. Compared by the training handshake (at ``on_train_start``), and again
            at the start of every epoch whose training dataloader was reloaded since
            (``Trainer(reload_dataloaders_every_n_epochs=N)``), before that epoch's first step: one small gather on
            the control plane per reload, nothing in epochs without one. Needs ``handshake=True``.
        weight_check: when every rank's weights are compared (a fingerprint per parameter, and per buffer that DDP
            does not re-broadcast, compared on the control plane; see :mod:`ddp_strategy.consistency`):
            ``"epoch"`` (default): before every checkpoint save and at the end of every training epoch; ``"save"``:
            before saves only; an integer ``N``: also every ``N`` optimizer steps (what
            :class:`~ddp_strategy.callbacks.WeightSyncCheck` does); ``None``: never. On a mismatch every rank
            raises :class:`~ddp_strategy.errors.RankDivergenceError` naming the tensors, the ranks and the largest
            difference, and the checkpoint being saved is not written.
        weight_check_exclude: ``fnmatch`` patterns of tensor names the weight check skips (tensors that may
            legitimately differ between ranks). The running statistics of BatchNorm/InstanceNorm layers are never
            compared by this check (each rank updates them from its own batch).
        track_trainable_set: before each training step, test whether the parameters' ``requires_grad`` flags still
            match those DDP was built with; when they changed on every rank, agree on the new set and rebuild the DDP
            wrapper with the same options, so newly trainable parameters are all-reduced (and frozen ones no longer
            awaited). A set that changed differently, or on some ranks only, raises
            :class:`~ddp_strategy.errors.RankDivergenceError`. Default: ``True``.
        preemption_signals: the signals that stop a stage as a preemption (names or numbers; default
            ``("SIGTERM",)``, add ``"SIGUSR1"`` for SLURM's ``--signal``; ``None`` leaves signals to Lightning).
            When any subset of ranks receives one, the ranks agree on a boundary to stop at over the control plane
            (an optimizer step's end, a validation or evaluation batch's end; no collective in the handler, none per
            step); in ``fit`` they save one checkpoint there with the normal collective save (to
            ``ModelCheckpoint``'s ``last`` file, where ``fit(ckpt_path="last")`` finds it; during a validation, the
            training position it started at), and every rank raises :class:`~ddp_strategy.Preempted`, exiting with
            ``128 + signal`` (143 for SIGTERM). See :mod:`ddp_strategy.preemption` and docs/checkpoints.md.
        desync_detection: watch every collective of every rank (the strategy's, Lightning's ``self.log(...,
            sync_dist=True)``, torchmetrics', the user's ``torch.distributed`` calls and DDP's gradient all-reduce,
            through torch's Flight Recorder) and raise :class:`~ddp_strategy.errors.CollectiveMismatchError` on every
            rank, within seconds, when the ranks' calls differ or every rank waits in a collective another never
            enters (:class:`~ddp_strategy.errors.UnevenInputsError` for uneven training inputs). Default: ``True``;
            needs the heartbeat (``heartbeat_interval > 0``). See :mod:`ddp_strategy.desync`.
        rendezvous_report_interval: seconds between the lines the start-up rendezvous prints while ranks are missing
            (which ranks joined and which are missing, by node, with the likely causes) or while
            ``MASTER_ADDR:MASTER_PORT`` cannot be reached. Default: 30. See :mod:`ddp_strategy.rendezvous`.
        rendezvous_timeout: how long the start-up rendezvous waits for every rank before it raises
            :class:`~ddp_strategy.errors.RendezvousError` listing the missing ranks, as seconds or a ``timedelta``;
            ``None`` (default): the process group's ``timeout`` (30 minutes unless given), as torch's own
            rendezvous.

    """

    barrier_timeout: timedelta = DEFAULT_BARRIER_TIMEOUT
    handshake: bool = True
    heartbeat_interval: float = 1.0
    async_save: bool = False
    async_snapshot: str = "overlap"
    save_on: str = "global_zero"
    exact_evaluation: bool = True
    predictions_on: str = "global_zero"
    sharding_check: str | None = "warn"
    uneven_inputs: str | None = "raise"
    weight_check: str | int | None = "epoch"
    weight_check_exclude: tuple[str, ...] = ()
    track_trainable_set: bool = True
    preemption_signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    desync_detection: bool = True
    rendezvous_report_interval: float = 30.0
    rendezvous_timeout: timedelta | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        barrier_timeout: float | timedelta = DEFAULT_BARRIER_TIMEOUT,
        handshake: bool = True,
        heartbeat_interval: float = 1.0,
        async_save: bool = False,
        async_snapshot: str = "overlap",
        save_on: str = "global_zero",
        exact_evaluation: bool = True,
        predictions_on: str = "global_zero",
        sharding_check: str | None = "warn",
        uneven_inputs: str | None = "raise",
        weight_check: str | int | None = "epoch",
        weight_check_exclude: Sequence[str] = (),
        track_trainable_set: bool = True,
        preemption_signals: Sequence[str | int] | None = DEFAULT_PREEMPTION_SIGNALS,
        desync_detection: bool = True,
        rendezvous_report_interval: float = 30.0,
        rendezvous_timeout: float | timedelta | None = None,
    ) -> StrategyOptions:
        """Validate the arguments users pass to the strategy and normalize them (the one place that does).

        Returns:
            The options, with ``barrier_timeout`` a ``timedelta``, ``heartbeat_interval`` a float and
            ``preemption_signals`` a tuple of signals.

        Raises:
            ValueError: ``barrier_timeout`` (or a ``rendezvous_timeout`` that is not ``None``) is not a positive
                number of seconds or ``timedelta``, ``heartbeat_interval`` is negative or not a number,
                ``rendezvous_report_interval`` is not a positive number, ``preemption_signals`` names no handleable
                signal, or ``async_snapshot``, ``save_on``, ``predictions_on``, ``sharding_check``,
                ``uneven_inputs`` or ``weight_check`` is not one of its values.

        """
        timeout = to_timedelta(barrier_timeout, name="barrier_timeout")
        if not isinstance(heartbeat_interval, (int, float)) or heartbeat_interval < 0:
            raise ValueError(f"`heartbeat_interval` must be a number of seconds >= 0, got {heartbeat_interval!r}.")
        interval = rendezvous_report_interval
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not interval > 0:
            raise ValueError(f"`rendezvous_report_interval` must be a number of seconds > 0, got {interval!r}.")
        wait = rendezvous_timeout
        rendezvous_wait = None if wait is None else to_timedelta(wait, name="rendezvous_timeout")
        _check_choice("async_snapshot", async_snapshot, _ASYNC_SNAPSHOT)
        _check_choice("save_on", save_on, _SAVE_ON)
        _check_choice("predictions_on", predictions_on, PREDICTIONS_ON)
        _check_choice("sharding_check", sharding_check, _SHARDING_CHECK, optional=True)
        _check_choice("uneven_inputs", uneven_inputs, _UNEVEN_INPUTS, optional=True)
        periodic = isinstance(weight_check, int) and not isinstance(weight_check, bool)
        if not (weight_check is None or weight_check in _WEIGHT_CHECK or (periodic and int(weight_check) >= 1)):
            raise ValueError(
                f"`weight_check` must be one of {sorted(_WEIGHT_CHECK)}, a positive number of steps, or None, got "
                f"{weight_check!r}."
            )
        return cls(
            barrier_timeout=timeout,
            handshake=handshake,
            heartbeat_interval=float(heartbeat_interval),
            async_save=async_save,
            async_snapshot=async_snapshot,
            save_on=save_on,
            exact_evaluation=exact_evaluation,
            predictions_on=predictions_on,
            sharding_check=sharding_check,
            uneven_inputs=uneven_inputs,
            weight_check=weight_check,
            weight_check_exclude=tuple(weight_check_exclude),
            track_trainable_set=track_trainable_set,
            preemption_signals=parse_signals(preemption_signals),
            desync_detection=bool(desync_detection),
            rendezvous_report_interval=float(interval),
            rendezvous_timeout=rendezvous_wait,
        )

    @property
    def weight_check_every_n_steps(self) -> int | None:
        """The ``N`` of ``weight_check=N`` (a check every ``N`` optimizer steps); ``None`` for the named modes."""
        periodic = isinstance(self.weight_check, int) and not isinstance(self.weight_check, bool)
        return int(self.weight_check) if periodic and self.weight_check is not None else None

    @property
    def overlap_snapshots(self) -> bool:
        """Whether asynchronous saves during training copy parameters and optimizer state beside the next step."""
        return self.async_snapshot == "overlap"


def _check_choice(name: str, value: object, choices: frozenset[str], *, optional: bool = False) -> None:
    if (optional and value is None) or value in choices:
        return
    raise ValueError(f"`{name}` must be one of {sorted(choices)}{' or None' if optional else ''}, got {value!r}.")


def options_to_agree(
    options: StrategyOptions, *, backend: str | None, ddp_settings: Mapping[str, Any]
) -> dict[str, str]:
    """The options every rank must be given alike, as text: those not at their defaults, and the backend.

    Each of them decides which collectives a rank makes or what they carry: ``preemption_signals`` whether
    Lightning's broadcast before every training batch runs, ``weight_check`` and ``sharding_check`` the gathers of
    the control plane, ``exact_evaluation`` the evaluation samplers (and so the number of evaluation batches), and
    DDP's own keyword arguments (``bucket_cap_mb``, ``static_graph``, a ``ddp_comm_hook``) the gradient all-reduces.
    The rendezvous and the handshakes compare them (:mod:`ddp_strategy.rendezvous`, :mod:`ddp_strategy.handshake`).
    Options equal to their defaults are left out, so that a rank passing a default explicitly agrees with one that
    does not, and the text stays short.

    Args:
        options: the strategy's own options.
        backend: the process group backend (``"gloo"``, ``"nccl"``), ``None`` when not known yet.
        ddp_settings: the keyword arguments Lightning gives ``DistributedDataParallel`` and its communication hook
            settings (:func:`~ddp_strategy._compat.lightning.ddp_settings`).

    Returns:
        ``{name: text}``; a DDP keyword argument is named as given (``bucket_cap_mb``).

    """
    default = StrategyOptions()
    agreed = {
        f.name: option_text(getattr(options, f.name))
        for f in fields(StrategyOptions)
        if f.name not in _PER_RANK_OPTIONS and getattr(options, f.name) != getattr(default, f.name)
    }
    if "preemption_signals" in agreed and not options.preemption_signals:
        agreed["preemption_signals"] = "None"  # as passed: signals left to Lightning
    ddp_defaults = _ddp_defaults()
    for name, value in ddp_settings.items():
        if name not in ddp_defaults or value != ddp_defaults[name]:
            agreed[name] = option_text(value)
    if backend is not None:
        agreed["process_group_backend"] = backend
    return agreed


def option_text(value: object) -> str:
    """An option's value as text that is the same on every rank: no object address, signals by name.

    Functions and classes are named by module and qualified name; a ``functools.partial`` (a communication hook
    with bound arguments) by its function and its arguments' texts; tuples, lists and dicts element by element; an
    object whose repr holds its address by its class.
    """
    if isinstance(value, signal.Signals):
        return value.name
    if isinstance(value, tuple):
        return "(" + ", ".join(option_text(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(option_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{option_text(k)}: {option_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, functools.partial):  # a hook with bound arguments (its repr holds addresses)
        bound = [option_text(value.func), *(option_text(v) for v in value.args)]
        bound += [f"{name}={option_text(v)}" for name, v in sorted(value.keywords.items())]
        return f"functools.partial({', '.join(bound)})"
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value) or inspect.isclass(value):
        return f"{value.__module__}.{value.__qualname__}"
    text = repr(value)
    if " at 0x" in text:  # an object without a repr of its own: its class
        return f"<{type(value).__module__}.{type(value).__qualname__} object>"
    return text


def default_option_text(name: str) -> str:
    """The text of option ``name``'s default (``"not set"`` for one without, such as ``ddp_comm_hook``)."""
    if name in {f.name for f in fields(StrategyOptions)}:
        return option_text(getattr(StrategyOptions(), name))
    ddp_defaults = _ddp_defaults()
    return option_text(ddp_defaults[name]) if name in ddp_defaults else "not set"


def _ddp_defaults() -> dict[str, Any]:
    """``DistributedDataParallel``'s keyword arguments with a default, and the defaults."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
