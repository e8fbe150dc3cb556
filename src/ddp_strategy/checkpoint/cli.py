"""``ddp-ckpt``: inspect, verify and export checkpoint files from the command line.

::

    ddp-ckpt inspect epoch=3.ckpt [--json]         # integrity, step/epoch/world size, tensors, RNG states
    ddp-ckpt verify ckpts/*.ckpt [--strict]        # one line per file; exit 1 if any is truncated/altered
    ddp-ckpt export epoch=3.ckpt model.safetensors --strip-prefix net.

Expected failures (missing files, damaged checkpoints, bad arguments) print one line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from ..errors import CheckpointIntegrityError, DDPStrategyError, UnsafeCheckpointError
from .export import SAFETENSORS_SUFFIX, export, load_checkpoint_object, verify_safetensors
from .format import verify
from .keys import RNG_STATES_KEY, WORLD_SIZE_KEY, package_state

__all__ = ["describe", "main"]

_PROG = "ddp-ckpt"
#: Failures reported as one line on stderr with exit code 1 instead of a traceback.
_REPORTED_ERRORS = (DDPStrategyError, FileNotFoundError, ValueError, OSError, ImportError)
_MAX_TOP_LEVEL_KEYS = 20


# ----------------------------------------------------------------------------------------------------- formatting
def _one_line(text: str) -> str:
    return " ".join(text.split())


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _known(value: int | None) -> str:
    return "unknown" if value is None else str(value)


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ----------------------------------------------------------------------------------------------------- integrity
def _integrity(path: str) -> dict[str, Any]:
    """The integrity status of ``path`` for reports; ``FileNotFoundError`` propagates."""
    try:
        if path.endswith(SAFETENSORS_SUFFIX):
            verify_safetensors(path)
            return {"status": "no-record", "detail": "complete safetensors file (no integrity record)"}
        record = verify(path)
    except CheckpointIntegrityError as err:
        return {"status": "invalid", "error": _one_line(str(err))}
    if record is None:
        return {"status": "no-record", "detail": "no integrity record (foreign file)"}
    return {"status": "verified", "record": asdict(record)}


def _integrity_text(integrity: Mapping[str, Any]) -> str:
    if integrity["status"] == "invalid":
        return f"INVALID: {integrity['error']}"
    if integrity["status"] == "no-record":
        return str(integrity["detail"])
    record = integrity["record"]
    checksum = str(record["checksum"])
    shown = checksum if len(checksum) <= 23 else f"{checksum[:23]}..."
    return (
        f"verified (format {record['format_version']}, {record['payload_bytes']} payload bytes, "
        f"{shown}, writer {record['writer'] or 'unknown'!r})"
    )


# ----------------------------------------------------------------------------------------------------- describe
def _state_section(obj: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(kind, tensors section)``: a Lightning checkpoint, a plain state dict, or something else."""
    section = obj.get("state_dict")
    if isinstance(section, Mapping):
        return "lightning", section
    if obj and all(isinstance(value, torch.Tensor) for value in obj.values()):
        return "state_dict", obj
    return "other", {}


def _tensor_rows(section: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    others: list[str] = []
    for name, value in section.items():
        if not isinstance(value, torch.Tensor):
            others.append(f"{name} ({type(value).__name__})")
            continue
        rows.append(
            {
                "name": str(name),
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "numel": value.numel(),
                "bytes": value.numel() * value.element_size(),
            }
        )
    return rows, others


def _rng_states(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    states = package_state(dict(obj)).get(RNG_STATES_KEY)
    if states is None:
        return None
    if not isinstance(states, list | tuple):
        return {"ranks": 0, "present": [], "malformed": type(states).__name__}
    return {"ranks": len(states), "present": [bool(state) for state in states]}


def describe(path: str, obj: Mapping[str, Any], integrity: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-serialisable summary of a loaded checkpoint (what ``ddp-ckpt inspect --json`` prints).

    Args:
        path: the file it was loaded from.
        obj: the loaded checkpoint (Lightning dict or plain state dict).
        integrity: the integrity status, ``{"status": "verified" | "no-record" | "invalid", ...}``.

    """
    record = integrity.get("record") or {}
    kind, section = _state_section(obj)
    rows, others = _tensor_rows(section)
    return {
        "path": path,
        "integrity": dict(integrity),
        "kind": kind,
        "global_step": record.get("global_step", _optional_int(obj.get("global_step"))),
        "epoch": record.get("epoch", _optional_int(obj.get("epoch"))),
        "world_size": record.get("world_size", _optional_int(package_state(dict(obj)).get(WORLD_SIZE_KEY))),
        "top_level_keys": [str(key) for key in obj],
        "rng_states": _rng_states(obj),
        "tensors": rows,
        "non_tensor_entries": others,
        "total_parameters": sum(row["numel"] for row in rows),
        "total_bytes": sum(row["bytes"] for row in rows),
    }


def _rng_text(rng: Mapping[str, Any] | None) -> str:
    if rng is None:
        return "none saved"
    if "malformed" in rng:
        return f"malformed ({rng['malformed']}, expected a list)"
    present = [rank for rank, ok in enumerate(rng["present"]) if ok]
    missing = [rank for rank, ok in enumerate(rng["present"]) if not ok]
    text = f"{rng['ranks']} ranks, present for ranks {', '.join(map(str, present)) or 'none'}"
    return text + (f"; missing for ranks {', '.join(map(str, missing))}" if missing else "")


def _keys_text(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_MAX_TOP_LEVEL_KEYS])
    return shown + (f", ... and {len(keys) - _MAX_TOP_LEVEL_KEYS} more" if len(keys) > _MAX_TOP_LEVEL_KEYS else "")


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    cells = [("name", "shape", "dtype", "size")]
    cells += [(row["name"], str(tuple(row["shape"])), row["dtype"], _human_bytes(row["bytes"])) for row in rows]
    widths = [max(len(cell[column]) for cell in cells) for column in range(4)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(cell, widths, strict=True)).rstrip() for cell in cells]


def _report_text(summary: Mapping[str, Any]) -> list[str]:
    lines = [
        f"path:           {summary['path']}",
        f"integrity:      {_integrity_text(summary['integrity'])}",
    ]
    if "kind" not in summary:
        return lines
    lines += [
        f"global_step:    {_known(summary['global_step'])}",
        f"epoch:          {_known(summary['epoch'])}",
        f"world_size:     {_known(summary['world_size'])}",
        f"top-level keys: {_keys_text(summary['top_level_keys'])}",
        f"rng states:     {_rng_text(summary['rng_states'])}",
        f"state_dict:     {len(summary['tensors'])} tensors, {summary['total_parameters']:,} parameters "
        f"(incl. buffers), {_human_bytes(summary['total_bytes'])}",
    ]
    if summary["non_tensor_entries"]:
        lines.append(f"non-tensors:    {', '.join(summary['non_tensor_entries'])}")
    if summary["tensors"]:
        lines += ["", *_table(summary["tensors"])]
    return lines


# ----------------------------------------------------------------------------------------------------- commands
def _cmd_inspect(args: argparse.Namespace) -> int:
    path: str = args.path
    integrity = _integrity(path)
    summary: dict[str, Any] = {"path": path, "integrity": integrity}
    if integrity["status"] != "invalid":
        summary = describe(path, load_checkpoint_object(path, weights_only=not args.trust), integrity)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join(_report_text(summary)))
    return 1 if integrity["status"] == "invalid" else 0


def _verify_line(path: str, *, strict: bool) -> tuple[str, bool]:
    """``(line, ok)`` for one file."""
    try:
        if path.endswith(SAFETENSORS_SUFFIX):
            verify_safetensors(path)
            return f"NO-RECORD {path} (complete safetensors file without an integrity record)", not strict
        record = verify(path)
    except (CheckpointIntegrityError, OSError) as err:
        return f"INVALID {path}: {_one_line(str(err))}", False
    if record is None:
        return f"NO-RECORD {path} (complete file without an integrity record)", not strict
    facts = f"step {_known(record.global_step)}, epoch {_known(record.epoch)}, world size {_known(record.world_size)}"
    return f"OK {path} ({facts})", True


def _cmd_verify(args: argparse.Namespace) -> int:
    all_ok = True
    for path in args.paths:
        line, ok = _verify_line(path, strict=args.strict)
        print(line, flush=True)
        all_ok = all_ok and ok
    return 0 if all_ok else 1


def _cmd_export(args: argparse.Namespace) -> int:
    state = export(args.path, args.out, strip_prefix=args.strip_prefix, weights_only=not args.trust)
    tensor_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    print(
        f"wrote {len(state)} tensors ({_human_bytes(tensor_bytes)} of tensor data, "
        f"{os.path.getsize(args.out)} bytes on disk) to {args.out}"
    )
    return 0


# ----------------------------------------------------------------------------------------------------- parser
_TRUST_HELP = "allow arbitrary pickled objects (runs code from the file): only for checkpoints you trust"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="Inspect, verify and export ddp_strategy checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", help="show integrity, progress, RNG states and tensors of a checkpoint")
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    inspect.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    inspect.set_defaults(handler=_cmd_inspect)

    check = commands.add_parser("verify", help="check files against their integrity records")
    check.add_argument("paths", metavar="PATH", nargs="+")
    check.add_argument("--strict", action="store_true", help="also fail files without an integrity record")
    check.set_defaults(handler=_cmd_verify)

    out = commands.add_parser("export", help="write the plain model state dict (.safetensors or torch.save)")
    out.add_argument("path", metavar="PATH")
    out.add_argument("out", metavar="OUT", help="output file; a .safetensors suffix writes safetensors")
    out.add_argument("--strip-prefix", metavar="P", help="attribute prefix shared by every key to remove, e.g. net.")
    out.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    out.set_defaults(handler=_cmd_export)
    return parser


def _error_text(err: BaseException) -> str:
    text = _one_line(str(err)) or type(err).__name__
    if isinstance(err, UnsafeCheckpointError):
        text += " With ddp-ckpt, pass --trust to load a file you trust."
    return text


def main(argv: list[str] | None = None) -> int:
    """Run ``ddp-ckpt`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except _REPORTED_ERRORS as err:
        print(f"{_PROG}: error: {_error_text(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
