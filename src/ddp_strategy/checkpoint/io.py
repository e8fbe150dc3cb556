"""``SafeCheckpointIO``: crash-safe, verified checkpoint files (a Lightning ``CheckpointIO``).

Saving streams ``torch.save`` into a temporary file *in the destination directory* (so the final rename never
crosses a filesystem), checksumming on the way (CRC-32, computed by a helper thread beside each large write while
``torch.save``'s own zip CRCs are off; see :class:`~ddp_strategy.checkpoint.hashing.HashingWriter`) and starting the
disk write of each part as soon as it is written (:class:`~ddp_strategy.checkpoint.atomic.EarlyWriteback`), appends
the integrity record, ``fsync``s the file, ``os.replace``s it over the destination and ``fsync``s the directory.
Until that rename, the previous file at the destination is untouched; after it, the new file is complete and
durable. Nothing is buffered in RAM beyond ``torch.save``'s own chunks. Remote fsspec paths are written to a local
temporary file, uploaded, and verified by size and footer.

Loading verifies the integrity record first (:func:`~ddp_strategy.checkpoint.format.verify`), then calls
``torch.load`` with ``weights_only=True`` unless the caller explicitly passes ``weights_only=False``. torch's own
switches are honoured as ``torch.load`` honours them (:func:`resolve_weights_only`):
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces ``weights_only=True`` even over an explicit ``False``;
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` allows pickled objects when the caller did not pass ``weights_only``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from typing_extensions import override

from .._compat.lightning import FIT_TAKES_WEIGHTS_ONLY, CheckpointIO, CheckpointPath
from ..errors import CheckpointIntegrityError, CheckpointWriteError, UnsafeCheckpointError
from ..version import __version__
from .atomic import EarlyWriteback, atomic_file
from .format import IntegrityRecord, filesystem, verify, write_footer
from .hashing import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, WRITEBACK_PIECE_BYTES, HashingWriter
from .keys import WORLD_SIZE_KEY, package_state

__all__ = ["FORCE_NO_WEIGHTS_ONLY", "FORCE_WEIGHTS_ONLY", "SafeCheckpointIO", "resolve_weights_only"]

log = logging.getLogger(__name__)


_CAN_SKIP_ZIP_CRCS = hasattr(torch.serialization, "set_crc32_options")  # torch >= 2.6

#: torch's switch that makes every ``torch.load`` weights-only, even one that passes ``weights_only=False``.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
#: torch's escape hatch: ``torch.load`` calls that do not pass ``weights_only`` load arbitrary pickled objects.
FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
#: How to load a trusted checkpoint that holds pickled objects, with the Lightning release in use.
_ALLOW_PICKLES = (
    f"trainer.fit(..., weights_only=False) or set {FORCE_NO_WEIGHTS_ONLY}=1 (torch's switch)"
    if FIT_TAKES_WEIGHTS_ONLY
    else f"{FORCE_NO_WEIGHTS_ONLY}=1 set (torch's switch; this Lightning release's trainer.fit has no weights_only)"
)
_TRUE = ("1", "y", "yes", "true")  # the values torch.load accepts as set


def _set(variable: str) -> bool:
    return os.getenv(variable, "0").lower() in _TRUE


def resolve_weights_only(weights_only: bool | None) -> tuple[bool, str | None]:
    """Whether a load is weights-only, deciding as ``torch.load`` does with its two environment variables.

    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` set (``1``, ``y``, ``yes`` or ``true``, any case): weights-only, whatever the
    caller passed. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set: pickled objects are allowed when the caller passed
    nothing (``None``); an explicit ``True`` stays. Neither: weights-only unless the caller passed ``False``.

    Returns:
        ``(weights_only, variable)``: ``variable`` is the environment variable that decided against what the caller
        passed (or, for ``None``, against the weights-only default), else ``None``.

    Raises:
        RuntimeError: both variables are set (``torch.load`` raises the same).

    """
    force, force_no = _set(FORCE_WEIGHTS_ONLY), _set(FORCE_NO_WEIGHTS_ONLY)
    if force and force_no:
        raise RuntimeError(
            f"Only one of `{FORCE_WEIGHTS_ONLY}` or `{FORCE_NO_WEIGHTS_ONLY}` should be set, but both were set "
            "(torch.load refuses this too). Unset one of them."
        )
    if force:
        return True, FORCE_WEIGHTS_ONLY if weights_only is False else None
    if force_no and weights_only is None:
        return False, FORCE_NO_WEIGHTS_ONLY
    return weights_only is not False, None


@contextlib.contextmanager
def _zip_crcs_off() -> Iterator[None]:
    """Make ``torch.save`` skip the CRC-32 of each zip record while a checkpoint is written.

    The integrity record's CRC-32 of the whole payload is computed beside the write instead
    (:class:`~ddp_strategy.checkpoint.hashing.HashingWriter` with ``parallel=True``), and ``torch.load`` never checks
    zip CRCs. torch's serialization settings are per thread (``torch.utils.serialization.config``), so a
    ``torch.save`` in another thread meanwhile is not affected; the calling thread's setting is restored after.
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _torch_load(file: Any, map_location: Any, *, weights_only: bool, path: str) -> Any:
    """``torch.load``; a file it cannot read is a :class:`CheckpointIntegrityError`.

    Raises:
        pickle.UnpicklingError: with ``weights_only``, the file holds pickled objects other than tensors.
        CheckpointIntegrityError: the file cannot be read.

    """
    try:
        return torch.load(file, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only:
            raise
        raise CheckpointIntegrityError(f"Checkpoint '{path}' cannot be unpickled: {err}", path=path) from err
    except (RuntimeError, EOFError) as err:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' could not be read by torch.load: {err}", path=path
        ) from err


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _writer_tag() -> str:
    return f"ddp_strategy {__version__}"


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class SafeCheckpointIO(CheckpointIO):
    """Atomic, fsynced, checksummed checkpoint files that ``torch.load`` still reads as usual.

    ``SafeDDPStrategy`` uses it by default; it can also be given to any Lightning strategy with
    ``Trainer(plugins=[SafeCheckpointIO()])``.

    Args:
        checksum: the payload checksum written into the integrity record: ``"crc32"`` (format 2, the default) or
            ``"sha256"`` (format 1, readable by ddp_strategy versions before format 2; about 3x the CPU time of a
            plain ``torch.save`` on top of it). Loading reads both.
    """

    def __init__(self, checksum: str = CHECKSUM_ALGORITHM) -> None:
        super().__init__()
        if checksum not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, not {checksum!r}")
        self.checksum = checksum

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically with its integrity record.

        Raises:
            CheckpointWriteError: the write failed (disk full, permission denied, file size limit, ...). The
                previous file at ``path``, if any, is unchanged.

        """
        path = str(path)
        try:
            if _is_local(path):
                self._save_local(checkpoint, _local_path(path))
            else:
                self._save_remote(checkpoint, path, storage_options)
        except CheckpointWriteError:
            raise
        except (OSError, RuntimeError, pickle.PicklingError) as err:
            raise CheckpointWriteError(
                f"Saving checkpoint '{path}' failed: {err}. The previous checkpoint at that path (if any) is "
                "unchanged. Check free space, permissions and file size limits of the checkpoint directory.",
                path=path,
            ) from err

    def _record(self, checkpoint: dict[str, Any], writer: HashingWriter) -> IntegrityRecord:
        ours = package_state(checkpoint)
        return IntegrityRecord(
            format_version=writer.format_version,
            payload_bytes=writer.bytes_written,
            checksum=writer.finish(),
            global_step=_optional_int(checkpoint.get("global_step")),
            epoch=_optional_int(checkpoint.get("epoch")),
            world_size=_optional_int(ours.get(WORLD_SIZE_KEY)),
            writer=_writer_tag(),
        )

    def _write_stream(self, checkpoint: dict[str, Any], file: Any, writeback: bool = False) -> IntegrityRecord:
        early = EarlyWriteback(file.fileno(), file.tell()) if writeback else None
        algorithm = getattr(self, "checksum", CHECKSUM_ALGORITHM)  # subclasses may skip __init__
        parallel = algorithm == "crc32" and _CAN_SKIP_ZIP_CRCS
        writer = HashingWriter(
            file,
            algorithm=algorithm,
            on_written=early.advance if early is not None else None,
            piece_bytes=WRITEBACK_PIECE_BYTES,
            parallel=parallel,
        )
        try:
            with _zip_crcs_off() if parallel else contextlib.nullcontext():
                torch.save(checkpoint, writer)  # type: ignore[arg-type]  # any object with write() works
            record = self._record(checkpoint, writer)
        except RuntimeError as err:
            if writer.error is not None:  # report the OS's reason (e.g. "No space left on device")
                raise writer.error from err
            raise
        finally:
            writer.close()
            if early is not None:
                early.close()  # before the file (and its descriptor) is closed
        write_footer(file, record)
        return record

    def _save_local(self, checkpoint: dict[str, Any], path: str) -> None:
        with atomic_file(path) as file:
            self._write_stream(checkpoint, file, writeback=True)

    def _save_remote(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None) -> None:
        fs = filesystem(path, **(storage_options or {}))
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".ckpt") as local:
            record = self._write_stream(checkpoint, local)
            local.flush()
            fs.put_file(local.name, path)
            size = int(fs.size(path))
            local_size = os.path.getsize(local.name)
        if size != local_size:
            raise CheckpointWriteError(
                f"Uploading checkpoint '{path}' left {size} bytes instead of {local_size}.", path=path
            )
        if verify(path, storage_options) != record:
            raise CheckpointWriteError(f"Uploaded checkpoint '{path}' does not verify.", path=path)

    @override
    def load_checkpoint(
        self,
        path: CheckpointPath,
        map_location: Callable[..., Any] | torch.device | str | dict[str, str] | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify, then load a checkpoint.

        Args:
            path: local path or fsspec URL.
            map_location: passed to ``torch.load``; ``SafeDDPStrategy`` passes each rank's own device.
            weights_only: ``None`` or ``True`` loads only tensors and primitive containers; a checkpoint carrying
                other pickled objects is refused before anything in it runs. Pass ``False`` explicitly to allow
                arbitrary pickled objects from a checkpoint you trust. torch's environment variables apply as in
                ``torch.load`` (see :func:`resolve_weights_only`); when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is what
                lets pickled objects load, a warning names it.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointIntegrityError: the file is truncated, altered, a directory, or not a checkpoint.
            UnsafeCheckpointError: the file needs arbitrary unpickling and ``weights_only`` was not ``False`` (or
                ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` is set).
            RuntimeError: both of torch's weights-only environment variables are set.

        """
        path = str(path)
        record = verify(path)
        if record is None:
            log.warning(
                "ddp_strategy: checkpoint '%s' has no integrity record (it was not written by ddp_strategy), so it "
                "cannot be verified; loading it as is.",
                path,
            )
        safe, variable = resolve_weights_only(weights_only)
        # Under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, try weights-only first: a file without pickled objects loads the
        # same either way, and only a file that needs the variable is read again, with a warning naming it.
        trial = safe or variable is not None
        fs = filesystem(path)
        with fs.open(path, "rb") as file:
            try:
                return self._checked(_torch_load(file, map_location, weights_only=trial, path=path), path)
            except pickle.UnpicklingError as err:
                if safe:
                    raise self._refusal(path, err, variable) from err
            warnings.warn(
                f"ddp_strategy: checkpoint '{path}' contains pickled Python objects that are not plain tensors or "
                f"containers; they are loaded (which runs code from the file) because {FORCE_NO_WEIGHTS_ONLY} is "
                f"set and weights_only was not passed, as torch.load does. Unset {FORCE_NO_WEIGHTS_ONLY} to refuse "
                "such files again.",
                UserWarning,
                stacklevel=2,
            )
            file.seek(0)
            return self._checked(_torch_load(file, map_location, weights_only=False, path=path), path)

    @staticmethod
    def _refusal(path: str, err: pickle.UnpicklingError, variable: str | None) -> UnsafeCheckpointError:
        forced = (
            f" {FORCE_WEIGHTS_ONLY} is set, which makes every load weights-only, even with weights_only=False (as "
            "in torch.load); unset it to load this file."
            if variable == FORCE_WEIGHTS_ONLY
            else ""
        )
        return UnsafeCheckpointError(
            f"Checkpoint '{path}' contains pickled Python objects that are not plain tensors or containers, so it "
            f"was refused and nothing in it was run ({str(err).splitlines()[0]}).{forced} If you trust its source, "
            f"load it with {_ALLOW_PICKLES}; otherwise keep only tensors and primitives in hyperparameters and "
            "callback/module state.",
            path=path,
        )

    @staticmethod
    def _checked(loaded: Any, path: str) -> dict[str, Any]:
        """``loaded`` when it is a checkpoint dict."""
        if not isinstance(loaded, dict):
            raise CheckpointIntegrityError(
                f"'{path}' holds a {type(loaded).__name__}, not a Lightning checkpoint dict.", path=path
            )
        return loaded

    @override
    def remove_checkpoint(self, path: CheckpointPath) -> None:
        """Remove a checkpoint file if it exists."""
        fs = filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
