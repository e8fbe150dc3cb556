"""Plain model weights out of a checkpoint: strip wrapper prefixes, load into a plain model, export.

A model trained under DDP and saved with ``ddp_model.state_dict()`` has every key prefixed with ``module.``;
``torch.compile`` adds ``_orig_mod.``; a Lightning checkpoint nests the weights under ``"state_dict"`` with keys
that are attribute paths of the ``LightningModule`` (``net.0.weight``). This module turns any of those into the
state dict a plain ``nn.Module`` accepts with ``load_state_dict(strict=True)``::

    from .export import export, load_into

    load_into(model, "epoch=3.ckpt", strip_prefix="net.")      # LightningModule attribute ``net`` -> plain model
    export("epoch=3.ckpt", "model.safetensors", strip_prefix="net.")

Files are read through :class:`~ddp_strategy.checkpoint.io.SafeCheckpointIO`, so integrity records are verified
and pickled code is refused; plain ``torch.save(model.state_dict())`` files and ``.safetensors`` files work too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointIntegrityError
from .atomic import atomic_file
from .io import SafeCheckpointIO

__all__ = [
    "SAFETENSORS_SUFFIX",
    "WRAPPER_PREFIXES",
    "common_prefixes",
    "export",
    "load_checkpoint_object",
    "load_into",
    "load_plain_state_dict",
    "plain_state_dict",
    "prefix_hint",
    "verify_safetensors",
]

#: Key prefixes added by wrappers around a model: ``DistributedDataParallel`` and ``torch.compile``.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: Output files with this suffix are written with ``safetensors``; anything else with ``torch.save``.
SAFETENSORS_SUFFIX = ".safetensors"
_MAX_LISTED_KEYS = 10
_SAFETENSORS_HINT = "Install it with: pip install 'ddp_strategy[export]' (or pip install safetensors)."


def _normalise_prefix(prefix: str) -> str:
    """``"net"`` and ``"net."`` both mean the attribute ``net``."""
    if not prefix.strip("."):
        raise ValueError(f"strip_prefix={prefix!r} is empty; pass an attribute path such as 'model.' or 'net.'.")
    return prefix if prefix.endswith(".") else prefix + "."


def _remove_common(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor] | None:
    """``tensors`` with ``prefix`` removed from every key, or ``None`` unless every key starts with it."""
    if not tensors or not all(key.startswith(prefix) for key in tensors):
        return None
    return {key[len(prefix) :]: value for key, value in tensors.items()}


def _remove_wrappers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` / ``_orig_mod.`` prefixes shared by every key, in any nesting order."""
    while True:
        for prefix in WRAPPER_PREFIXES:
            stripped = _remove_common(tensors, prefix)
            if stripped is not None:
                tensors = stripped
                break
        else:
            return tensors


def common_prefixes(keys: Iterable[str]) -> list[str]:
    """The leading attribute paths shared by every key, shortest first.

    ``["net.0.weight", "net.0.bias", "net.2.weight"]`` gives ``["net."]``; a key's last component (the parameter
    name) is never part of a prefix.
    """
    split = [key.split(".")[:-1] for key in keys]
    if not split:
        return []
    shared: list[str] = []
    for parts in zip(*split, strict=False):
        if any(part != parts[0] for part in parts):
            break
        shared.append(parts[0])
    return [".".join(shared[: depth + 1]) + "." for depth in range(len(shared))]


def _apply_strip_prefix(tensors: dict[str, torch.Tensor], strip_prefix: str) -> dict[str, torch.Tensor]:
    prefix = _normalise_prefix(strip_prefix)
    stripped = _remove_common(tensors, prefix)  # e.g. "module.net." on a DDP-saved dict
    if stripped is not None:
        return stripped
    unwrapped = _remove_wrappers(tensors)
    stripped = _remove_common(unwrapped, prefix)
    if stripped is not None:
        return stripped
    if prefix in WRAPPER_PREFIXES:
        return unwrapped  # already removed automatically
    offenders = [key for key in unwrapped if not key.startswith(prefix)]
    shared = common_prefixes(unwrapped)
    hint = f"All keys share {', '.join(repr(p) for p in shared)}." if shared else "The keys share no common prefix."
    raise ValueError(
        f"strip_prefix={strip_prefix!r} does not start every key ({len(offenders)} of {len(unwrapped)} do not, e.g. "
        f"{', '.join(offenders[:3])}). {hint} Pass one of those, or no strip_prefix."
    )


def _state_dict_section(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``"state_dict"`` of a Lightning checkpoint, or ``obj`` itself for a plain state dict."""
    if "state_dict" not in obj:
        return obj
    section = obj["state_dict"]
    if not isinstance(section, Mapping):
        raise ValueError(f"The checkpoint's 'state_dict' entry is a {type(section).__name__}, not a mapping.")
    return section


def _tensors_only(section: Mapping[str, Any], top_level: Iterable[str]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"Entry {key!r} is a {type(value).__name__}, not a tensor, so this is neither a state dict nor a "
                f"Lightning checkpoint with a 'state_dict' (top-level keys: {', '.join(map(str, top_level))}). "
                "Pass a file saved from model.state_dict() or by Lightning."
            )
        tensors[key] = value
    if not tensors:
        raise ValueError("The checkpoint holds no tensors: its state dict is empty.")
    return tensors


def plain_state_dict(obj: Mapping[str, Any], *, strip_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The model tensors of a loaded checkpoint, keyed as a plain (unwrapped) model expects.

    Args:
        obj: a Lightning checkpoint dict (weights under ``"state_dict"``), a plain state dict, or a state dict
            saved from a ``DistributedDataParallel`` and/or ``torch.compile`` wrapped model.
        strip_prefix: an attribute path shared by every key to remove, e.g. ``"net."`` to turn the checkpoint of a
            ``LightningModule`` holding its network in ``self.net`` into that network's state dict. ``"net"`` and
            ``"net."`` are the same. Without it, Lightning attribute prefixes are kept.

    Returns:
        A new dict of the same tensors; ``module.`` and ``_orig_mod.`` prefixes shared by every key are removed
        (repeatedly, so ``module._orig_mod.`` too), before and after ``strip_prefix``.

    Raises:
        ValueError: a value is not a tensor, there are no tensors, or ``strip_prefix`` is not shared by every key.

    """
    tensors = _tensors_only(_state_dict_section(obj), obj.keys())
    if strip_prefix is not None:
        tensors = _apply_strip_prefix(tensors, strip_prefix)
    return _remove_wrappers(tensors)


def _safetensors_module(path: str) -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as err:
        raise ImportError(f"Reading '{path}' needs the safetensors package. {_SAFETENSORS_HINT}") from err
    if not os.path.exists(path):
        raise FileNotFoundError(f"Checkpoint '{path}' does not exist.")
    if os.path.isdir(path):
        raise CheckpointIntegrityError(f"'{path}' is a directory, not a .safetensors file.", path=path)
    return safetensors


def _invalid_safetensors(path: str, err: Exception) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"'{path}' is not a valid safetensors file ({err}): it is truncated or damaged. Export it again.", path=path
    )


def verify_safetensors(path: str) -> int:
    """Check that a ``.safetensors`` file is complete (its header describes exactly the file's bytes).

    Returns:
        The number of tensors in the file.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointIntegrityError: the file is truncated, damaged, or a directory.
        ImportError: safetensors is not installed.

    """
    safetensors = _safetensors_module(path)
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            return len(list(file.keys()))
    except safetensors.SafetensorError as err:
        raise _invalid_safetensors(path, err) from err


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    safetensors = _safetensors_module(path)
    try:
        return dict(safetensors.torch.load_file(path, device="cpu"))
    except safetensors.SafetensorError as err:
        raise _invalid_safetensors(path, err) from err


def load_checkpoint_object(path: str, *, weights_only: bool = True) -> dict[str, Any]:
    """Load a whole checkpoint file onto the CPU: verified ``torch.save`` files, or ``.safetensors`` files.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointIntegrityError: the file is truncated, altered, a directory, or not a checkpoint.
        UnsafeCheckpointError: the file holds pickled objects other than tensors and ``weights_only`` is ``True``.

    """
    if path.endswith(SAFETENSORS_SUFFIX):
        return _load_safetensors(path)
    return SafeCheckpointIO().load_checkpoint(path, map_location="cpu", weights_only=weights_only)


def load_plain_state_dict(
    path: str, *, strip_prefix: str | None = None, weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """Load a checkpoint file and return its plain model state dict (see :func:`plain_state_dict`).

    Args:
        path: a ``SafeCheckpointIO`` / Lightning checkpoint, a ``torch.save(model.state_dict())`` file (DDP- or
            ``torch.compile``-prefixed or not), or a ``.safetensors`` file. Loaded onto the CPU.
        strip_prefix: see :func:`plain_state_dict`.
        weights_only: keep ``True`` unless you trust the file: ``False`` allows arbitrary pickled objects (code).

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointIntegrityError: the file is truncated, altered, a directory, or not a checkpoint.
        UnsafeCheckpointError: the file holds pickled objects other than tensors and ``weights_only`` is ``True``.
        ValueError: see :func:`plain_state_dict`.

    """
    return plain_state_dict(load_checkpoint_object(path, weights_only=weights_only), strip_prefix=strip_prefix)


def _listed(keys: set[str]) -> str:
    shown = sorted(keys)[:_MAX_LISTED_KEYS]
    more = f", ... and {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
    return ", ".join(shown) + more


def prefix_hint(checkpoint_keys: Iterable[str], model_keys: Iterable[str], *, already: str | None = None) -> str:
    """Advice when the two key sets differ only by a common prefix, or ``""``.

    Args:
        checkpoint_keys: the keys of the (already stripped) checkpoint state dict.
        model_keys: the keys of the model's state dict.
        already: the ``strip_prefix`` that produced ``checkpoint_keys``, prepended to the suggested one.

    """
    ckpt, model = set(checkpoint_keys), set(model_keys)
    for prefix in common_prefixes(ckpt):
        if {key[len(prefix) :] for key in ckpt} == model:
            full = (_normalise_prefix(already) if already else "") + prefix
            return (
                f"Every checkpoint key starts with {prefix!r} and matches the model once it is removed: pass "
                f"strip_prefix={full!r} (ddp-ckpt export --strip-prefix {full})."
            )
    for prefix in common_prefixes(model):
        if {prefix + key for key in ckpt} == model:
            return (
                f"Every model key starts with {prefix!r} and the checkpoint has the same keys without it: load into "
                f"the submodule at {prefix[:-1]!r} of your model instead."
            )
    return ""


def load_into(module: nn.Module, path: str, *, strict: bool = True, strip_prefix: str | None = None) -> None:
    """Load the weights of any checkpoint into a plain (unwrapped) model.

    This is how to load a DDP-saved ``module.``-prefixed state dict, a ``torch.compile`` one, or a Lightning
    checkpoint into a plain ``nn.Module``: the wrapper prefixes are removed automatically, and ``strip_prefix``
    removes the ``LightningModule`` attribute the network lived in (``"net."`` for ``self.net``).

    Args:
        module: the plain model to load into, e.g. a freshly constructed network.
        path: the checkpoint file (see :func:`load_plain_state_dict`).
        strict: require the checkpoint's keys to match the model's exactly.
        strip_prefix: see :func:`plain_state_dict`.

    Raises:
        ValueError: with ``strict``, the keys differ (up to 10 missing and 10 unexpected keys are listed, and the
            ``strip_prefix`` to pass when removing a shared prefix would make them match); or a tensor's shape
            differs from the model's.
        FileNotFoundError, CheckpointIntegrityError, UnsafeCheckpointError: see :func:`load_plain_state_dict`.

    """
    state = load_plain_state_dict(path, strip_prefix=strip_prefix)
    expected = set(module.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if strict and (missing or unexpected):
        parts = [f"The state dict in '{path}' does not match {type(module).__name__}'s keys."]
        if missing:
            parts.append(f"{len(missing)} missing (in the model, not in the checkpoint): {_listed(missing)}.")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (in the checkpoint, not the model): {_listed(unexpected)}.")
        hint = prefix_hint(state, expected, already=strip_prefix)
        parts.append(hint or "Check that the model is built with the same architecture and configuration.")
        raise ValueError(" ".join(parts))
    try:
        module.load_state_dict(state, strict=strict)
    except RuntimeError as err:
        raise ValueError(f"Loading '{path}' into {type(module).__name__} failed: {err}") from err


def _for_safetensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory (safetensors refuses both); shared ones are cloned."""
    seen: set[tuple[str, int]] = set()
    prepared: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        tensor = tensor.detach()
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if storage[1] and storage in seen:
            tensor = tensor.clone()
        elif storage[1]:
            seen.add(storage)
        prepared[key] = tensor.contiguous()
    return prepared


def _safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    try:
        from safetensors.torch import save
    except ImportError as err:
        raise ImportError(f"Writing a .safetensors file needs the safetensors package. {_SAFETENSORS_HINT}") from err
    return save(_for_safetensors(state), metadata={"format": "pt"})


def _write_atomically(state: dict[str, torch.Tensor], out: str) -> None:
    with atomic_file(out) as file:
        if out.endswith(SAFETENSORS_SUFFIX):
            file.write(_safetensors_bytes(state))
        else:
            torch.save(state, file)


def _check_output(path: str, out: str) -> None:
    same = os.path.realpath(path) == os.path.realpath(out)
    if same or (os.path.exists(path) and os.path.exists(out) and os.path.samefile(path, out)):
        raise ValueError(f"Refusing to export '{path}' over itself; choose another output path.")
    if os.path.isdir(out):
        raise ValueError(f"Output '{out}' is a directory; pass a file path such as '{out.rstrip('/')}/model.pt'.")


def export(
    path: str, out: str, *, strip_prefix: str | None = None, weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """Write the plain model state dict of a checkpoint to a new file.

    The output is loadable into the plain model with ``load_state_dict(..., strict=True)``: a ``.safetensors``
    ``out`` is written with ``safetensors.torch.save_file`` (tensors made contiguous, tensors sharing memory
    cloned), any other suffix with ``torch.save``. The file appears atomically (a temporary file in the same
    directory is renamed over ``out``).

    Args:
        path: the checkpoint to read (see :func:`load_plain_state_dict`).
        out: the file to write; must not be ``path`` itself.
        strip_prefix: see :func:`plain_state_dict`.
        weights_only: see :func:`load_plain_state_dict`.

    Returns:
        The state dict that was written.

    Raises:
        ValueError: ``out`` is ``path`` or a directory, or see :func:`plain_state_dict`.
        ImportError: ``out`` ends in ``.safetensors`` and safetensors is not installed.
        FileNotFoundError, CheckpointIntegrityError, UnsafeCheckpointError: see :func:`load_plain_state_dict`.

    """
    _check_output(path, out)
    state = load_plain_state_dict(path, strip_prefix=strip_prefix, weights_only=weights_only)
    _write_atomically(state, out)
    return state
