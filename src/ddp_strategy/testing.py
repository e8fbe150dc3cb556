"""Fault injection for your own test suite, on the CPU: kill, hang, slow or fail a rank; damage a checkpoint.

Everything here works inside the training processes (as a Lightning callback) or on files, so it needs no GPU,
no cluster and no special launcher: start your script with Lightning's launcher or ``torchrun`` as usual.

Example::

    from .testing import FaultInjector

    injector = FaultInjector().kill_rank(1, at_step=5)  # SIGKILL rank 1 when it starts step 5
    trainer = Trainer(strategy=SafeDDPStrategy(), callbacks=[injector, ...])

A fault fires at most once per process, when ``trainer.global_step`` first equals ``at_step`` at the start of a
training batch on ``trainer.global_rank == rank``. Under ``torchrun --max-restarts=N`` faults fire only in the
first attempt by default (``attempt=0``; torchrun sets ``TORCHELASTIC_RESTART_COUNT``), so a restarted run can
resume past them; pass ``attempt=None`` to fire in every attempt.

File helpers (:func:`truncate_checkpoint`, :func:`corrupt_checkpoint`, :func:`write_garbage`) damage a checkpoint
the way a crashed copy or bit rot would; :func:`limit_file_size` makes every later write of the process fail
with ``EFBIG`` ("File too large"), as a full disk would; :func:`file_digests` records a directory's files so a
test can show that nothing already on disk was changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typing_extensions import override

from ._compat.lightning import Callback, pl

__all__ = [
    "Fault",
    "FaultInjector",
    "InjectedFault",
    "corrupt_checkpoint",
    "file_digests",
    "limit_file_size",
    "restart_count",
    "truncate_checkpoint",
    "write_garbage",
]

_KINDS = ("kill", "signal", "raise", "exit", "hang", "slow", "fail_writes")


class InjectedFault(RuntimeError):
    """The exception :meth:`FaultInjector.raise_on_rank` raises by default."""


def restart_count() -> int:
    """How many times ``torchrun`` restarted this job's workers (``TORCHELASTIC_RESTART_COUNT``; 0 otherwise)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


@dataclass(frozen=True)
class Fault:
    """One fault: what happens on which global rank, from which training step.

    Attributes:
        kind: ``"kill"`` (send ``arg`` as a signal, default SIGKILL, and wait for it), ``"signal"`` (send ``arg``,
            default SIGTERM, and go on training, as a preemption notice does), ``"raise"`` (raise
            :class:`InjectedFault`), ``"exit"`` (``os._exit(arg)``, no cleanup), ``"hang"`` (sleep ``arg`` seconds,
            default forever),
            ``"slow"`` (sleep ``arg`` seconds at every step from ``at_step`` on) or ``"fail_writes"`` (every
            later file write of the process beyond ``arg`` bytes fails, see :func:`limit_file_size`).
        rank: the global rank it happens on.
        at_step: the value of ``trainer.global_step`` at the start of the training batch it happens in.
        arg: the kind's argument (signal number, exit code, seconds, bytes), or ``None`` for its default.

    """

    kind: str
    rank: int
    at_step: int
    arg: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Fault kind must be one of {_KINDS}, got {self.kind!r}.")
        if self.rank < 0 or self.at_step < 0:
            raise ValueError(f"Fault rank and at_step must be >= 0, got rank={self.rank}, at_step={self.at_step}.")

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """Parse ``KIND:RANK:STEP[:ARG]``, e.g. ``kill:1:5``, ``kill:1:5:SIGTERM``, ``hang:0:3``, ``slow:1:0:0.05``.

        Handy for a command-line flag or an environment variable of a training script.

        Raises:
            ValueError: the text is not of that form.

        """
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"A fault is KIND:RANK:STEP[:ARG] (e.g. kill:1:5), got {spec!r}.")
        kind, rank, step = parts[0], int(parts[1]), int(parts[2])
        arg: float | None = None
        if len(parts) == 4:
            text = parts[3]
            arg = float(getattr(signal, text)) if text.upper().startswith("SIG") else float(text)
        return cls(kind, rank, step, arg)


class FaultInjector(Callback):
    """A callback that kills, hangs, slows or fails chosen ranks at chosen training steps.

    Build it with the chainable methods, or from :class:`Fault` values::

        FaultInjector().kill_rank(1, at_step=5).slow_rank(0, seconds=0.05)
        FaultInjector([Fault.parse("raise:1:3")])

    Before a fault fires, the callback prints ``FaultInjector: <what> on rank R at step K`` to stderr (flushed),
    so a test can tell an injected failure from a real one.

    Args:
        faults: the faults to inject.
        attempt: inject only in this ``torchrun`` restart attempt (see :func:`restart_count`); ``None``: always.

    """

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = (), *, attempt: int | None = 0) -> None:
        self.faults: list[Fault] = list(faults)
        self.attempt = attempt
        self._fired: set[Fault] = set()

    # ------------------------------------------------------------------ building
    def kill_rank(self, rank: int, at_step: int, sig: int = signal.SIGKILL) -> FaultInjector:
        """Send ``sig`` (default SIGKILL: no cleanup, no Python exception) to ``rank``'s own process."""
        return self._add(Fault("kill", rank, at_step, float(sig)))

    def signal_rank(self, rank: int, at_step: int, sig: int = signal.SIGTERM) -> FaultInjector:
        """Send ``sig`` (default SIGTERM) to ``rank``'s own process and go on training (a preemption notice)."""
        return self._add(Fault("signal", rank, at_step, float(sig)))

    def raise_on_rank(self, rank: int, at_step: int) -> FaultInjector:
        """Raise :class:`InjectedFault` in ``rank``'s training loop (the rank fails like a bug in user code)."""
        return self._add(Fault("raise", rank, at_step))

    def exit_rank(self, rank: int, at_step: int, code: int = 0) -> FaultInjector:
        """End ``rank``'s process at once with ``os._exit(code)``, as a stray ``sys.exit`` or OOM killer would."""
        return self._add(Fault("exit", rank, at_step, float(code)))

    def hang_rank(self, rank: int, at_step: int, seconds: float = float("inf")) -> FaultInjector:
        """Make ``rank`` sleep ``seconds`` (default: forever) in its training loop, holding up every collective."""
        return self._add(Fault("hang", rank, at_step, seconds))

    def slow_rank(self, rank: int, seconds: float, from_step: int = 0) -> FaultInjector:
        """Make ``rank`` sleep ``seconds`` at every training step from ``from_step`` on (a straggler)."""
        return self._add(Fault("slow", rank, from_step, seconds))

    def fail_writes(self, rank: int, at_step: int, max_bytes: int = 1024) -> FaultInjector:
        """From ``at_step`` on, every file write of ``rank``'s process beyond ``max_bytes`` fails (a full disk).

        With ``SafeDDPStrategy(async_save=True)`` the write in flight is allowed to finish first.
        """
        return self._add(Fault("fail_writes", rank, at_step, float(max_bytes)))

    def _add(self, fault: Fault) -> FaultInjector:
        self.faults.append(fault)
        return self

    # ------------------------------------------------------------------ firing
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.attempt is not None and restart_count() != self.attempt:
            return
        rank, step = trainer.global_rank, trainer.global_step
        for fault in self.faults:
            if fault.rank != rank:
                continue
            if fault.kind == "slow":
                if step >= fault.at_step:
                    time.sleep(fault.arg or 0.0)
                continue
            if step != fault.at_step or fault in self._fired:
                continue
            self._fired.add(fault)
            self._fire(fault, trainer)

    def _fire(self, fault: Fault, trainer: pl.Trainer) -> None:
        def say(what: str) -> None:
            sys.stdout.flush()
            sys.stderr.write(f"FaultInjector: {what} on rank {fault.rank} at step {fault.at_step}\n")
            sys.stderr.flush()

        if fault.kind == "signal":
            sig = signal.Signals(int(fault.arg if fault.arg is not None else signal.SIGTERM))
            say(f"sending {sig.name} at t={time.time():.3f} (training goes on)")
            os.kill(os.getpid(), sig)
        elif fault.kind == "kill":
            sig = signal.Signals(int(fault.arg if fault.arg is not None else signal.SIGKILL))
            say(f"sending {sig.name}")
            os.kill(os.getpid(), sig)
            time.sleep(60)  # a catchable signal may be handled later; never continue training meanwhile
        elif fault.kind == "raise":
            say("raising InjectedFault")
            raise InjectedFault(f"injected failure on rank {fault.rank} at step {fault.at_step}")
        elif fault.kind == "exit":
            code = int(fault.arg or 0)
            say(f"os._exit({code})")
            os._exit(code)
        elif fault.kind == "hang":
            seconds = float("inf") if fault.arg is None else fault.arg
            say(f"hanging for {seconds:g} s")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
        elif fault.kind == "fail_writes":
            writer = getattr(trainer.strategy, "async_writer", None)
            if writer is not None:  # async_save: let the write in flight finish (the limit is process-wide)
                writer.wait()
            max_bytes = int(fault.arg if fault.arg is not None else 1024)
            say(f"limiting file writes to {max_bytes} bytes")
            _set_file_size_limit(max_bytes)


# ---------------------------------------------------------------------- files
def _set_file_size_limit(max_bytes: int) -> tuple[int, int]:
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, previous[1]))
    return previous


@contextlib.contextmanager
def limit_file_size(max_bytes: int) -> Iterator[None]:
    """Inside the block, writing past ``max_bytes`` of any file fails with ``OSError(EFBIG)``, as a full disk would.

    Uses ``RLIMIT_FSIZE`` (and ignores ``SIGXFSZ``), so it applies to the whole process, every thread included.
    Child processes started inside the block inherit the limit.

    Args:
        max_bytes: the largest file size writes may reach.

    """
    old_handler = signal.getsignal(signal.SIGXFSZ)
    previous = _set_file_size_limit(max_bytes)
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, old_handler)


def truncate_checkpoint(path: str | os.PathLike[str], keep_fraction: float = 0.5) -> int:
    """Cut a file to ``keep_fraction`` of its size, as a crashed non-atomic writer or an interrupted copy would.

    Returns:
        The new size in bytes.

    Raises:
        ValueError: ``keep_fraction`` is not in [0, 1).

    """
    if not 0.0 <= keep_fraction < 1.0:
        raise ValueError(f"keep_fraction must be in [0, 1), got {keep_fraction!r}.")
    size = int(os.path.getsize(path) * keep_fraction)
    os.truncate(path, size)
    return size


def corrupt_checkpoint(path: str | os.PathLike[str], offset: int | None = None, nbytes: int = 1) -> int:
    """Flip every bit of ``nbytes`` bytes at ``offset`` (default: the middle of the file), as bit rot would.

    The file keeps its size, so only a checksum notices.

    Returns:
        The offset of the first damaged byte.

    Raises:
        ValueError: the range is not inside the file.

    """
    size = os.path.getsize(path)
    start = size // 2 if offset is None else offset
    if nbytes < 1 or start < 0 or start + nbytes > size:
        raise ValueError(f"Cannot damage bytes {start}..{start + nbytes} of '{path}' ({size} bytes).")
    with open(path, "r+b") as file:
        file.seek(start)
        data = file.read(nbytes)
        file.seek(start)
        file.write(bytes(b ^ 0xFF for b in data))
    return start


def write_garbage(path: str | os.PathLike[str], size: int = 4096, seed: int = 0) -> None:
    """Write ``size`` random (but reproducible) bytes to ``path``: a file that is not a checkpoint at all."""
    Path(path).write_bytes(random.Random(seed).randbytes(size))


def file_digests(directory: str | os.PathLike[str]) -> dict[str, str]:
    """SHA-256 of every file below ``directory`` by relative path: compare two calls to show nothing changed."""
    root = Path(directory)
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found
