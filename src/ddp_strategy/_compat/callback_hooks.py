"""Per-batch callback hooks that Lightning skips: a hook attribute set to ``None`` on the callback instance.

Lightning runs a callback hook through ``trainer.call._call_callback_hooks``, which for every callback in the list
reads the hook with ``getattr`` and, when it is callable, calls it inside a profiler context: about 1 us per
callback and hook (more with cold caches), at every training step, for a hook the callback inherits as a no-op too.
The strategy's callbacks have nothing to do in most per-batch hooks; each sets those to ``None`` on its instance
(:func:`skip_hooks`), which Lightning's ``callable`` test passes over, and gives them back when they have work again
(:func:`restore_hooks`). Only hooks that Lightning calls through ``_call_callback_hooks`` alone are skipped this
way (:data:`BATCH_HOOKS`; ``on_save_checkpoint``, called directly, is not one), and only where the callback's class
does not define its own (a subclass's override always runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .lightning import Callback

__all__ = ["BATCH_HOOKS", "restore_hooks", "skip_hooks", "skip_inherited_batch_hooks"]

#: The hooks Lightning runs per batch, each only through ``_call_callback_hooks`` (which skips a non-callable one).
BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


def _own(callback: Any, name: str, since: type) -> bool:
    """Whether ``type(callback)`` defines hook ``name`` below ``since`` (a subclass's own version)."""
    return getattr(type(callback), name, None) is not getattr(since, name, None)


def skip_hooks(callback: Any, names: Iterable[str], *, unless_overridden_below: type = Callback) -> None:
    """Make Lightning pass over ``callback``'s hooks ``names`` (per-batch hooks only, see :data:`BATCH_HOOKS`).

    Args:
        callback: the callback instance.
        names: the hooks; each must be in :data:`BATCH_HOOKS`.
        unless_overridden_below: a hook that ``type(callback)`` defines anew below this class keeps running (the
            class whose own version has nothing to do: a subclass may have work there).

    """
    for name in names:
        if name not in BATCH_HOOKS:
            raise ValueError(f"{name!r} is not a per-batch hook that Lightning calls only through its hook loop")
        if not _own(callback, name, unless_overridden_below):
            setattr(callback, name, None)


def restore_hooks(callback: Any, names: Iterable[str]) -> None:
    """Give ``callback`` its hooks ``names`` back (its class's methods)."""
    for name in names:
        callback.__dict__.pop(name, None)


def skip_inherited_batch_hooks(callback: Any) -> None:
    """Skip every per-batch hook that ``callback`` inherits from Lightning's ``Callback`` (a no-op there)."""
    skip_hooks(callback, BATCH_HOOKS)
