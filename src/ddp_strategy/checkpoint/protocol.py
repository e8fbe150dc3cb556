"""The collective save and load protocols: who writes, who checks, and how every rank learns the outcome.

Save (every rank calls :func:`save`):

1. every rank sends its RNG state, and the fingerprints of the weights that must agree, to the writer (one gather on
   the control plane);
2. the writer (global rank 0) compares the fingerprints; when every rank holds the same weights it adds the RNG
   states to the checkpoint and writes it with the ``CheckpointIO``, else it writes nothing;
3. every rank agrees on the outcome (one :meth:`~ddp_strategy.control.ControlPlane.agree`); when a writer failed,
   every rank raises :class:`CheckpointWriteError` with the first failing writer's message; when the weights
   differ, every rank raises :class:`~ddp_strategy.errors.RankDivergenceError` (after one more gather, of the
   differing tensors, for the message) and the checkpoints already on disk are unchanged. Returning from
   :func:`save` means the file is complete on disk: no rank can read a checkpoint before it exists.

Load (every rank calls :func:`load`): rank 0 verifies the requested file; when it is a ``last`` checkpoint that
fails verification, rank 0 falls back to the newest valid checkpoint in the same directory, with a warning naming
the skipped file. Meanwhile every other rank checks whether it sees a valid copy of the requested file. One
agreement gives every rank rank 0's decision (a path or an error) and who can read it (a second one is needed only
after a fallback); every rank loads that one path onto its own device, and rank 0 sends the file's bytes to the
ranks that cannot read it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from ..consistency import Comparison, Divergence, compare
from ..control import ControlPlane, RankFailure, also_failed, first_failure
from ..errors import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointWriteError,
    DDPStrategyError,
)
from . import rng
from .format import IntegrityRecord, filesystem, verify
from .keys import NO_RNG_REASON_KEY, PACKAGE_KEY, RNG_STATES_KEY, WORLD_SIZE_KEY

__all__ = ["check_model_keys", "check_resumable", "load", "resolve", "save"]

log = logging.getLogger(__name__)

_LAST_PREFIX = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST; "last.ckpt", "last-v1.ckpt"


def save(
    *,
    control: ControlPlane,
    write: Callable[[dict[str, Any]], None],
    checkpoint: dict[str, Any],
    path: str,
    is_writer: bool,
    every_writer_needs_states: bool = False,
    weights: Comparison | None = None,
    section: dict[str, Any] | None = None,
) -> None:
    """Collectively save ``checkpoint`` (see the module docstring). Every rank must call it.

    Args:
        control: the control plane.
        write: writes the final checkpoint dict on a writer rank (the strategy's ``CheckpointIO``).
        checkpoint: this rank's checkpoint dict (only the writers' are written).
        path: destination, for messages.
        is_writer: whether this rank writes a copy (global rank 0, or local rank 0 of each node).
        every_writer_needs_states: gather the RNG states onto every rank (several writers) instead of rank 0 only.
        weights: the weights every rank must hold identically for the checkpoint to be written, or ``None``.
        section: more entries of the ``ddp_strategy`` section (the writer's are written).

    Raises:
        CheckpointWriteError: on every rank, when any writer failed; the previous file is intact. A writer whose
            ``CheckpointIO`` raised anything but an error of this package re-raises that exception instead, after
            the other ranks have learnt it.
        RankDivergenceError: on every rank, when the ranks hold different ``weights``; nothing was written.

    """
    name = os.path.basename(path)
    mine = (rng.capture(), weights.digests() if weights is not None else None)
    if every_writer_needs_states:
        gathered: list[Any] | None = control.all_gather_object(mine, name=f"checkpoint-save:{name}")
    else:
        gathered = control.gather_object(mine, name=f"checkpoint-save:{name}")
    states = [state for state, _ in gathered] if gathered is not None else None

    def write_copy() -> Divergence | None:
        if not is_writer:
            return None
        if weights is not None and gathered is not None:
            divergence = compare([digests for _, digests in gathered])
            if divergence is not None:
                return divergence  # never write a checkpoint of ranks that disagree
        package = {**(section or {}), WORLD_SIZE_KEY: control.world_size, RNG_STATES_KEY: states}
        write({**checkpoint, PACKAGE_KEY: package})
        return None

    def write_error(failed: list[RankFailure]) -> BaseException:
        unexpected = _own_unexpected(failed, control.rank)
        if unexpected is not None:
            return unexpected
        first = failed[0]
        if first.rank == control.rank:
            message = first.message
        else:
            message = f"Rank {first.rank} failed to write checkpoint '{path}': {first.message}"
        return CheckpointWriteError(message + also_failed(failed), path=path)

    def decide(values: Sequence[Divergence | RankFailure | None]) -> Divergence | None:
        outcomes = first_failure(write_error)(values)
        return next((outcome for outcome in outcomes if outcome is not None), None)  # every writer found the same

    divergence = control.agree(f"checkpoint-saved:{name}", write_copy, decide)
    if divergence is not None and weights is not None:
        raise weights.error(
            control,
            divergence,
            outcome=f"Checkpoint '{path}' was not written; the checkpoints already on disk are unchanged.",
        )


def _own_unexpected(failed: list[RankFailure], rank: int) -> BaseException | None:
    """The exception ``rank``'s own step raised, when it is not an error of this package (re-raised as is there)."""
    for failure in failed:
        if failure.rank == rank and failure.exception is not None:
            return None if isinstance(failure.exception, DDPStrategyError) else failure.exception
    return None


def _candidates(path: str) -> list[tuple[int, float, str]]:
    """Other checkpoint files in ``path``'s directory, newest first (by global step, then mtime)."""
    fs = filesystem(path)
    directory = os.path.dirname(path) or "."
    found: list[tuple[int, float, str]] = []
    for entry in fs.ls(directory, detail=True):
        other = str(entry["name"])
        base = os.path.basename(other)
        if entry.get("type") != "file" or not base.endswith(".ckpt") or base.startswith("."):
            continue
        if os.path.abspath(other) == os.path.abspath(path):
            continue
        try:
            record = verify(other)
        except (CheckpointIntegrityError, OSError):
            continue
        step = record.global_step if record is not None and record.global_step is not None else -1
        found.append((step, float(fs.modified(other).timestamp()), other))
    return sorted(found, reverse=True)


def resolve(path: str) -> tuple[str, IntegrityRecord | None]:
    """Pick the checkpoint to load for ``path`` on this rank (rank 0 calls it).

    A ``last`` checkpoint that fails verification falls back to the newest valid checkpoint in its directory,
    with a warning naming the skipped file. Any other failing path is an error.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointIntegrityError: ``path`` fails verification and no fallback applies.

    """
    try:
        return path, verify(path)
    except CheckpointIntegrityError as err:
        if not os.path.basename(path).startswith(_LAST_PREFIX):
            raise
        for _, _, other in _candidates(path):
            log.warning(
                "ddp_strategy: skipping checkpoint '%s' (%s); resuming from the newest valid checkpoint '%s' instead.",
                path,
                err,
                other,
            )
            return other, verify(other)
        raise CheckpointIntegrityError(
            f"{err} No other valid checkpoint was found in '{os.path.dirname(path)}' to fall back to.", path=path
        ) from err


def load(
    *,
    control: ControlPlane,
    read: Callable[[str], dict[str, Any]],
    path: str,
) -> tuple[str, dict[str, Any]]:
    """Collectively agree on the checkpoint to load, then load it on every rank. Every rank must call it.

    Args:
        control: the control plane.
        read: loads a path on this rank (the strategy's ``CheckpointIO`` with this rank's ``map_location``).
        path: the requested checkpoint path.

    Returns:
        The path actually loaded and the loaded checkpoint.

    Raises:
        FileNotFoundError: the checkpoint does not exist (raised on every rank).
        CheckpointIntegrityError: the checkpoint is damaged and no fallback applies (raised on every rank).

    """

    def probe() -> _Probe:
        if control.rank != 0:
            return path, None, "", _readable(path)
        try:
            chosen = resolve(path)[0]
        except FileNotFoundError as err:
            return path, "missing", str(err), False
        except CheckpointIntegrityError as err:
            return path, "invalid", str(err), False
        return chosen, None, "", True  # resolve verified `chosen`

    def check_error(failed: list[RankFailure]) -> BaseException:
        unexpected = _own_unexpected(failed, control.rank)
        if unexpected is not None:
            return unexpected
        first = failed[0]
        return CheckpointIntegrityError(
            f"Rank {first.rank} could not check checkpoint '{path}': {first.message}{also_failed(failed)}", path=path
        )

    def decide(values: Sequence[_Probe | RankFailure]) -> tuple[str, list[bool]]:
        decision = values[0]
        if not isinstance(decision, RankFailure):  # rank 0's verdict on the file comes first
            _, failure, message, _ = decision
            if failure == "missing":
                raise FileNotFoundError(
                    f"{message} (checked by rank 0). Pass an existing checkpoint file, or ckpt_path='last' to resume "
                    "from the newest checkpoint of the run's ModelCheckpoint."
                )
            if failure == "invalid":
                raise CheckpointIntegrityError(message, path=path)
        probes = first_failure(check_error)(values)  # raises when some rank's check itself failed
        return probes[0][0], [probe[3] for probe in probes]

    chosen, readable = control.agree(f"checkpoint-resolve:{os.path.basename(path)}", probe, decide)
    if chosen != path:  # rank 0 fell back to another file: who can read that one?
        mine = True if control.rank == 0 else _readable(chosen)  # rank 0 verified it in resolve
        readable = control.agree("checkpoint-visible", mine, first_failure(check_error))
    if all(readable):
        return chosen, read(chosen)
    # Some ranks cannot see (or cannot verify) the file: rank 0 sends its bytes to everybody.
    if control.rank == 0:
        blind = [rank for rank, ok in enumerate(readable) if not ok]
        log.warning("ddp_strategy: rank(s) %s cannot read '%s' on their disk; rank 0 sends it to them", blind, chosen)
        with filesystem(chosen).open(chosen, "rb") as file:
            data: bytes | None = file.read()
    else:
        data = None
    payload = control.broadcast_object(data, name="checkpoint-transfer")
    if payload is None:
        raise CheckpointIntegrityError(f"Rank 0 sent no data for checkpoint '{chosen}'.", path=chosen)
    if readable[control.rank]:
        return chosen, read(chosen)
    with tempfile.TemporaryDirectory(prefix="ddp_strategy-") as tmp:
        local = os.path.join(tmp, os.path.basename(chosen))
        with open(local, "wb") as file:
            file.write(payload)
        return chosen, read(local)


#: Each rank's part of the load decision: ``(chosen path, failure, message, readable)``. The first three are rank
#: 0's resolution (``failure`` is ``None``, ``"missing"`` or ``"invalid"``; the other ranks send the requested path,
#: ``None`` and ``""``), ``readable`` whether this rank sees a valid copy of the requested path.
_Probe = tuple[str, str | None, str, bool]


def _readable(path: str) -> bool:
    """Whether this rank sees a complete, valid copy of ``path``."""
    try:
        verify(path)
    except (OSError, CheckpointIntegrityError):
        return False
    return True


def restore_rng(checkpoint: dict[str, Any], *, rank: int, world_size: int) -> str | None:
    """Restore this rank's RNG state from a checkpoint.

    Returns:
        ``None`` when the state was restored exactly, else a warning text (no state saved, or another world size,
        in which case every rank is reseeded deterministically from the checkpoint's global step and its rank).

    """
    section = checkpoint.get(PACKAGE_KEY)
    states = section.get(RNG_STATES_KEY) if isinstance(section, dict) else None
    saved_world = section.get(WORLD_SIZE_KEY) if isinstance(section, dict) else None
    if not isinstance(states, list) or not states:
        reason = section.get(NO_RNG_REASON_KEY) if isinstance(section, dict) else None
        why = f"it was saved {reason}" if isinstance(reason, str) else "it was not written by SafeDDPStrategy"
        return (
            f"The checkpoint holds no per-rank RNG state ({why}); random number generators continue from their "
            "current state, so the resumed run will not repeat an uninterrupted one."
        )
    if saved_world != world_size or len(states) != world_size:
        step = int(checkpoint.get("global_step", 0))
        rng.reseed(step, rank)
        return (
            f"The checkpoint was written by {saved_world} ranks and is resumed on {world_size}: per-rank RNG states "
            f"cannot be mapped, so every rank was reseeded deterministically from (global_step={step}, rank). The "
            "run is reproducible but will not match an uninterrupted run."
        )
    rng.restore(states[rank])
    return None


def batches_done_mid_epoch(checkpoint: dict[str, Any], *, last_batch_ends_epoch: bool = True) -> int:
    """How many batches of an unfinished training epoch a (step) checkpoint had consumed; 0 at epoch boundaries.

    Mirrors ``FitLoop.update_restart_stage``: the epoch was started but not processed. A checkpoint saved in
    ``on_train_batch_end`` of the epoch's *last* batch (a step checkpoint or a preemption stop that falls there) is
    an epoch boundary where Lightning counts that epoch as done on restore (``last_batch_ends_epoch``, Lightning >=
    2.5.0; see :func:`saved_after_last_batch`): nothing is left to skip, the run goes on with the next epoch.
    """
    try:
        loops = checkpoint["loops"]["fit_loop"]
        total = loops["epoch_progress"]["total"]
        if not (total["started"] == total["ready"] and total["processed"] == total["started"] - 1):
            return 0
        if last_batch_ends_epoch and saved_after_last_batch(checkpoint):
            return 0
        return int(loops["epoch_loop.batch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return 0


def saved_after_last_batch(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was saved in ``on_train_batch_end`` of the last batch of an unfinished epoch.

    Lightning >= 2.5.0 restores such a checkpoint at the start of the next epoch (``FitLoop.reset``: restarted on
    train batch end, mid-epoch, ``is_last_batch``); the epoch counter in the file is one lower until then.
    """
    try:
        loops = checkpoint["loops"]["fit_loop"]
        epochs = loops["epoch_progress"]["total"]
        batches = loops["epoch_loop.batch_progress"]
        total = batches["total"]
        return bool(
            epochs["started"] == epochs["ready"]
            and epochs["processed"] == epochs["started"] - 1
            and batches.get("is_last_batch", False)
            and total["started"] == total["ready"] == total["processed"]
            and total["completed"] == total["processed"] - 1
        )
    except (KeyError, TypeError):
        return False


def saved_before_training(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was saved before its fit trained anything (no epoch started, no optimizer step).

    That is ``trainer.save_checkpoint`` before ``fit`` (after another stage): an uninterrupted run would go on into
    ``fit``, whose set-up re-seeds from ``seed_everything``'s seed, so that re-seeding must follow the RNG restore.
    """
    try:
        total = checkpoint["loops"]["fit_loop"]["epoch_progress"]["total"]
        return int(checkpoint.get("global_step", 0)) == 0 and int(total["started"]) == 0
    except (KeyError, TypeError, ValueError):
        return False


def _listed(keys: list[str], limit: int = 10) -> str:
    shown = keys[:limit]
    return ", ".join(repr(k) for k in shown) + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


def check_resumable(checkpoint: dict[str, Any], path: str) -> None:
    """Refuse a file that holds weights only (a plain or DDP ``module.``-prefixed ``state_dict``) as ``ckpt_path``.

    ``trainer.fit(ckpt_path=...)`` resumes a whole training state (weights, optimizer, loops, RNG); a bare state
    dict has none of it, and Lightning would fail later with a ``KeyError``.

    Raises:
        CheckpointMismatchError: ``checkpoint`` has no ``"state_dict"`` entry.

    """
    if "state_dict" in checkpoint:
        return
    tensors = sorted(k for k, v in checkpoint.items() if hasattr(v, "shape"))
    if tensors and all(k.startswith("module.") for k in tensors):
        what = f"a DDP-saved state_dict ({len(tensors)} tensors, every key starts with 'module.')"
    elif tensors:
        what = f"a plain state_dict ({len(tensors)} tensors, e.g. {_listed(tensors, 3)})"
    else:
        what = f"not a Lightning checkpoint (top-level keys: {_listed(sorted(map(str, checkpoint)), 5)})"
    raise CheckpointMismatchError(
        f"'{path}' is {what}: it holds no training state (no 'state_dict', optimizer or loop entries), so "
        "trainer.fit(ckpt_path=...) cannot resume from it. To start training from these weights, load them into "
        "the network before fit, without ckpt_path: `ddp_strategy.checkpoint.export.load_into(model.net, path)` "
        "(it removes DDP's 'module.' prefix; `strip_prefix=` removes others). `ddp-ckpt inspect PATH` shows what "
        "the file holds.",
        path=path,
    )


def check_model_keys(checkpoint: dict[str, Any], model_keys: list[str], path: str, model_name: str) -> None:
    """Refuse, before loading anything, a checkpoint whose ``state_dict`` keys differ from the model's.

    Raises:
        CheckpointMismatchError: listing the missing and unexpected keys (up to 10 of each).

    """
    section = checkpoint.get("state_dict")
    if not isinstance(section, dict):
        return
    ours, theirs = set(model_keys), set(section)
    missing, unexpected = sorted(ours - theirs), sorted(theirs - ours)
    if not (missing or unexpected):
        return
    parts = [f"Checkpoint '{path}' does not match {model_name}: it was written for another model or configuration."]
    if missing:
        parts.append(f"{len(missing)} key(s) of the model are missing from it: {_listed(missing)}.")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) in it are unexpected: {_listed(unexpected)}.")
    parts.append(
        "Resume with the checkpoint of this model (same architecture and hyperparameters). To start a new run from "
        "the weights that match, call `ddp_strategy.checkpoint.export.load_into(model, path, strict=False)` and fit "
        "without ckpt_path; to resume anyway, set `model.strict_loading = False`."
    )
    raise CheckpointMismatchError(" ".join(parts), path=path, missing=missing, unexpected=unexpected)
