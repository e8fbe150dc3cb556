"""Where a rank is: the record each rank publishes so that others can explain a hang.

A :class:`Position` names the last strategy-level collective a rank entered (or the training step it is in),
the call site that led there, and when. Positions are published to the rendezvous store by
:class:`~ddp_strategy.control.ControlPlane`; when a barrier times out, the ranks that arrived read the
positions of the ranks that did not, and put them in the error message.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from types import FrameType

__all__ = ["Position", "call_site", "format_ranks", "is_user_path", "short_path"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames in these libraries are skipped when looking for the user's own call site.
LIBRARY_MARKERS = (
    f"{os.sep}lightning{os.sep}",
    f"{os.sep}lightning_fabric{os.sep}",
    f"{os.sep}lightning_utilities{os.sep}",
    f"{os.sep}pytorch_lightning{os.sep}",
    f"{os.sep}torch{os.sep}",
    f"{os.sep}torchmetrics{os.sep}",
    # torch wraps some collectives (all_gather_into_tensor in 2.13) in its `deprecated` decorator
    f"{os.sep}typing_extensions.py",
)
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def is_user_path(path: str) -> bool:
    """Whether a frame's file is the user's own code: not this package, the deep-learning libraries or the stdlib."""
    if path.startswith(_PACKAGE_DIR) or (path.startswith(_STDLIB_DIR) and "-packages" not in path):
        return False
    return not path.startswith("<") and not any(marker in path for marker in LIBRARY_MARKERS)


def short_path(path: str) -> str:
    """A file path as messages show it: relative to ``site-packages`` or to the working directory when inside."""
    for marker in ("site-packages", "dist-packages"):
        if marker in path:
            return path.split(marker + os.sep, 1)[1]
    cwd = os.getcwd()
    return os.path.relpath(path, cwd) if path.startswith(cwd) else path


@dataclass(frozen=True)
class Position:
    """One rank's last known position.

    Attributes:
        kind: what the rank was doing: ``"barrier"``, ``"collective"``, ``"training step"``, ``"started"``,
            or ``"failed"``.
        name: the barrier or collective name, the step number for ``"training step"``, or the error text for
            ``"failed"``.
        site: the call site that led there, e.g. ``"train.py:42 in main"``; empty when unknown.
        seq: how many control-plane operations this rank had entered before this one.
        since: wall-clock time (``time.time()``) when the rank entered this position.
        heartbeat: wall-clock time of the rank's last sign of life.
        batch: for ``"training step"``: how many training batches this rank had started in this run, this one
            included (a batch count, unlike the step number, also advances inside gradient accumulation); else
            ``None``.
        epoch: the training epoch of the last training batch this rank started (``None`` before the first).
        epoch_batch: how many batches of that epoch this rank had started.
        waiting: what the rank's training thread waits in, as its heartbeat thread last saw it: a collective
            (``"collective <group>#<seq>"``, pending in torch's Flight Recorder) or a control-plane barrier
            (``"barrier <seq> '<name>'"``); empty when it waits in none (it runs).
        waiting_since: wall-clock time since when it waits there unchanged.
        calls: how many collectives the strategy made for this rank (``reduce`` for ``self.log(...,
            sync_dist=True)``, ``all_gather``, ``broadcast``), and ``digest``: a CRC-32 chained over what each was.
            Two ranks whose digests differ at the same count made different calls (see :mod:`ddp_strategy.desync`).

    """

    kind: str
    name: str
    site: str = ""
    seq: int = 0
    since: float = 0.0
    heartbeat: float = 0.0
    batch: int | None = None
    epoch: int | None = None
    epoch_batch: int | None = None
    waiting: str = ""
    waiting_since: float = 0.0
    calls: int = 0
    digest: int = 0

    def describe(self, now: float | None = None) -> str:
        """A one-line human description, e.g. ``barrier 'save' at train.py:42 in main (entered 3.1 s ago)``."""
        now = time.time() if now is None else now
        if self.kind == "failed":
            return f"failed with {self.name} ({max(0.0, now - self.since):.1f} s ago)"
        if self.kind == "training step":
            text = f"training step {self.name}"
        elif self.kind in ("barrier", "collective"):
            text = f"{self.kind} '{self.name}'"
        else:
            text = self.name or self.kind
        if self.site:
            text += f" at {self.site}"
        text += f" (entered {max(0.0, now - self.since):.1f} s ago"
        if self.heartbeat:
            text += f", last heartbeat {max(0.0, now - self.heartbeat):.1f} s ago"
        return text + ")"

    def to_json(self) -> str:
        """Serialise for the rendezvous store."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> Position:
        """Inverse of :meth:`to_json` (accepts the bytes a store returns)."""
        return cls(**json.loads(data))


def _frame_text(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    short = os.path.relpath(path) if not os.path.isabs(path) or path.startswith(os.getcwd()) else path
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"


def call_site(skip: int = 1) -> str:
    """Describe the code that called into the strategy.

    The result names the first frame outside ``ddp_strategy`` and the deep-learning libraries (the user's
    code), followed by the first frame outside ``ddp_strategy`` when that is a library frame, e.g.
    ``"train.py:40 in main (via lightning/pytorch/trainer/call.py:105 in _call_setup_hook)"``.

    Args:
        skip: how many innermost frames to ignore (1 skips this function's caller's caller chain start).

    """
    frame: FrameType | None = sys._getframe(skip)
    first_outside: FrameType | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_PACKAGE_DIR):
            if first_outside is None:
                first_outside = frame
            if not any(marker in path for marker in LIBRARY_MARKERS):
                user = _frame_text(frame)
                return user if frame is first_outside else f"{user} (via {_frame_text(first_outside)})"
        frame = frame.f_back
    return _frame_text(first_outside) if first_outside is not None else ""


def format_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """Compress a list of ranks into ranges: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``.

    Args:
        ranks: Ranks in any order, duplicates allowed.

    Returns:
        Sorted ranks, consecutive ones joined into ranges.

    Example:
        >>> format_ranks([5, 0, 2, 1, 1])
        '0-2, 5'
        >>> format_ranks([])
        ''

    """
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for rank in ordered:
        if start is None:
            start = prev = rank
        elif prev is not None and rank == prev + 1:
            prev = rank
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = rank
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)
