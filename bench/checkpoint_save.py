"""Cost of SafeCheckpointIO's crash-safe save next to torch.save and Lightning's TorchCheckpointIO (CPU, local disk).

Driver:  python bench/checkpoint_save.py [--quick] [--repeats N] [--params-mib N] [--optimizer adam|none]
                                        [--dir DIR] [--results-dir DIR]
Worker:  python bench/checkpoint_save.py --memory-worker VARIANT ...  (started by the driver, one fresh process per
         memory measurement)

What is measured, in one run, all variants interleaved (a new seeded shuffle of the order every round, so no variant
always runs first after the per-round cache drop or always follows the same other variant), one warm-up round,
then N timed rounds; medians with min/max:

1. Sync save time of ``SafeCheckpointIO.save_checkpoint`` (temp file in the same directory, CRC-32 while streaming,
   integrity footer, early write-back, fsync, ``os.replace``, directory fsync) against plain
   ``torch.save(ckpt, path)`` (target: ratio <= 1.05), and for fairness against ``torch.save`` + fsync of the file
   and its directory (the durability ``SafeCheckpointIO`` gives), Lightning's ``TorchCheckpointIO`` (whole
   checkpoint in a BytesIO first) and BEFORE, the save path as it was before format 2 (SHA-256 of every byte
   inline, no early write-back; reproduced in this file). Every save writes a new file (files are deleted between
   samples, untimed); the overwrite of an existing file is measured as two further variants. ``os.sync()`` runs
   before every sample (untimed) so write-back of the previous sample never lands in the next one; the page cache
   is dropped once per round when ``/proc/sys/vm/drop_caches`` is writable (followed by an untimed pass of every
   variant, on separate instances, on a tiny checkpoint so code pages are back in memory).
2. Peak extra memory during one save, as a fraction of the checkpoint's tensor bytes (target <= 0.10 for
   ``SafeCheckpointIO``), in a fresh process per measurement: build the checkpoint, warm the code path on a tiny
   checkpoint, ``malloc_trim``, read VmRSS as the baseline, reset the kernel's peak-RSS counter (write ``5`` to
   ``/proc/self/clear_refs``), save, read VmHWM. Peak minus baseline is the figure (VmHWM cannot miss a short peak;
   if the reset is refused the script falls back to ``ru_maxrss`` before/after). A 1 ms VmRSS sampler thread runs
   alongside as a cross-check.
3. Async save: the time training is blocked per save as a fraction of the sync ``SafeCheckpointIO`` save time
   (target <= 0.10). ``async overlap`` is ``async_snapshot="overlap"`` (``SafeDDPStrategy``'s default): a live model
   of the same size with Adam, ``submit(..., deferred=parameters and optimizer state)``, then the next forward and
   backward (batch 32) while the writer thread copies, then ``wait_for_snapshot()`` (the strategy's gate before the
   optimizer step), then the optimizer step; blocked = submit + that wait. The same round also times the
   forward+backward right after a blocking submit and with no save in flight (the CPU the background copy and write
   take from training on this 2-core machine, reported as info). ``async submit`` is ``async_snapshot="blocking"``:
   the time ``AsyncCheckpointWriter.submit`` blocks the caller (wait for the previous write, which has already
   finished; CPU snapshot of every tensor; thread start), steady state (one writer across all rounds, as in
   training: the snapshot is copied into the buffers of the previous one); ``async first`` is a writer's first save
   (a new writer per sample, so the snapshot buffers are allocated and page-faulted). ``.wait()`` is called outside
   the timed region. The snapshot's memory is ~100% of the checkpoint by design (it is a copy, so training can
   change the live tensors), held while the writer exists.

4. ``durable floor``: the checkpoint's raw tensor bytes written to a new file in 4 MiB pieces with the same early
   write-back as ``SafeCheckpointIO``, then fsynced (file and directory); no serialization, no checksum: what this
   disk needs to make these bytes durable, which bounds any crash-safe save.

``--quick`` (CI smoke, about 60 s): the same 384 MiB checkpoint, only the gated variants (torch.save, safe, async
submit, async first, async overlap), 5 rounds, one memory run; exits 1 if a gated figure misses its target by more
than twice the allowed overhead (sync ratio > 1.10, memory fraction > 0.20, async fraction > 0.20). The full mode
always exits 0 after writing its results. Both modes write checkpoint_save.json and checkpoint_save.md into
--results-dir (default bench/results; the JSON says which mode).

Reading the figures: this machine is shared, so wall times are bimodal when other tenants wake up. Besides the
ratio of medians (the gated figure), the table gives the median of per-round paired ratios (same round, same
background load), ratios of the minima (closest to the intrinsic cost), and the process CPU time of each call (all
threads; kernel write-back threads and fsync waits are not in it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import hashlib
import json
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
WIDTH = 2048  # nn.Linear(WIDTH, WIDTH): 4,196,352 parameters, 16.0 MiB in fp32
MIB = 1 << 20

# name -> description; the order is the order of the first round
TIMED = OrderedDict(
    [
        ("torch.save", "torch.save(ckpt, path), new file"),
        ("torch.save+fsync", "torch.save(ckpt, path), then fsync of the file and of its directory"),
        ("lightning", "lightning TorchCheckpointIO().save_checkpoint (BytesIO, fsspec transaction)"),
        ("safe", "SafeCheckpointIO().save_checkpoint, new file"),
        ("safe before", "BEFORE: SafeCheckpointIO as of 6487ced (SHA-256 of every byte inline, no early write-back)"),
        ("torch.save overwrite", "torch.save over an existing checkpoint file"),
        ("safe overwrite", "SafeCheckpointIO().save_checkpoint over an existing checkpoint file"),
        ("async submit", "AsyncCheckpointWriter(SafeCheckpointIO()).submit, steady state: time the caller is blocked"),
        ("async first", "the same on a new AsyncCheckpointWriter (first save: snapshot buffers allocated)"),
        (
            "async overlap",
            "training blocked per save with async_snapshot='overlap' (the default): submit() + the wait before the "
            "optimizer step, with the next forward and backward of the model running beside the copy",
        ),
        (
            "durable floor",
            "the checkpoint's raw tensor bytes written to a new file with os.write in 4 MiB pieces, write-back "
            "started early as in SafeCheckpointIO, then fsync of file and directory: no serialization, no "
            "checksum; what this disk needs to make these bytes durable",
        ),
    ]
)
QUICK_TIMED = ["torch.save", "safe", "async submit", "async first", "async overlap"]
TRAIN_BATCH = 32  # rows per forward/backward of the "async overlap" training step
MEMORY = ["torch.save", "lightning", "safe", "async submit"]
QUICK_MEMORY = ["safe"]


# --------------------------------------------------------------------------------------------------------------
# The checkpoint


def build_checkpoint(params_mib: int, optimizer: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Lightning-layout checkpoint dict of an nn.Sequential of Linear layers (optionally with Adam state)."""
    import lightning
    import torch
    from torch import nn

    torch.manual_seed(0)
    per_layer = WIDTH * WIDTH * 4
    layers = max(1, round(params_mib * MIB / per_layer))
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    optimizer_states = []
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(4, WIDTH)).square().mean().backward()
        opt.step()  # creates exp_avg and exp_avg_sq (fp32, one each per parameter) and a step counter
        opt.zero_grad(set_to_none=True)
        optimizer_states.append(opt.state_dict())
    checkpoint: dict[str, Any] = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": OrderedDict((f"model.{k}", v) for k, v in model.state_dict().items()),
        "loops": {},
        "callbacks": {},
        "optimizer_states": optimizer_states,
        "lr_schedulers": [],
        "hyper_parameters": {"width": WIDTH, "layers": layers},
    }
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "layers": layers,
        "params": n_params,
        "param_bytes": n_params * 4,
        "optimizer": optimizer,
        "tensor_bytes": sum(t.nbytes for t in tensors(checkpoint)),
    }
    return checkpoint, info


class TrainingStep:
    """A live model + Adam of the benchmark's size, its Lightning-layout checkpoint, and one training step."""

    def __init__(self, params_mib: int) -> None:
        import torch
        from torch import nn

        torch.manual_seed(1)
        layers = max(1, round(params_mib * MIB / (WIDTH * WIDTH * 4)))
        self.model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-6)
        self.batch = torch.randn(TRAIN_BATCH, WIDTH)
        self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self) -> None:
        self.model(self.batch).square().mean().backward()

    def checkpoint(self) -> dict[str, Any]:
        return {
            "epoch": 0,
            "global_step": 1,
            "state_dict": OrderedDict((f"model.{k}", v) for k, v in self.model.state_dict().items()),
            "optimizer_states": [self.optimizer.state_dict()],
            "lr_schedulers": [],
        }

    def deferred(self) -> Callable[[Any], bool]:
        """What SafeDDPStrategy defers during training: parameters and optimizer state."""
        from ddp_strategy.checkpoint.overlap import optimizer_owned_addresses

        addresses = optimizer_owned_addresses(self.model, [self.optimizer])
        return lambda t: t.data_ptr() in addresses


def tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def tiny_checkpoint() -> dict[str, Any]:
    import torch

    return {"epoch": 0, "global_step": 1, "state_dict": {"w": torch.zeros(16)}, "optimizer_states": []}


# --------------------------------------------------------------------------------------------------------------
# BEFORE: the save path as it was before format 2, reproduced for a side-by-side comparison in the same run


def make_before_io() -> Any:
    """SafeCheckpointIO writing as of commit 6487ced: SHA-256 of every byte inline, no early write-back."""
    import torch

    from ddp_strategy.checkpoint.format import write_footer
    from ddp_strategy.checkpoint.hashing import HashingWriter
    from ddp_strategy.checkpoint.io import SafeCheckpointIO

    class BeforeSafeCheckpointIO(SafeCheckpointIO):
        def _write_stream(self, checkpoint: dict[str, Any], file: Any, writeback: bool = False) -> Any:
            writer = HashingWriter(file, algorithm="sha256")  # hashes every byte in this thread, as before
            try:
                torch.save(checkpoint, writer)  # type: ignore[arg-type]
            except RuntimeError as err:
                if writer.error is not None:
                    raise writer.error from err
                raise
            record = self._record(checkpoint, writer)
            write_footer(file, record)
            return record

    return BeforeSafeCheckpointIO(checksum="sha256")


# --------------------------------------------------------------------------------------------------------------
# Variants: each returns a function save(checkpoint, path) -> seconds the caller was blocked


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_variant(name: str) -> Callable[[dict[str, Any], str], float]:
    import torch
    from lightning.fabric.plugins import TorchCheckpointIO

    from ddp_strategy.checkpoint.async_writer import AsyncCheckpointWriter
    from ddp_strategy.checkpoint.io import SafeCheckpointIO

    def timed(fn: Callable[[dict[str, Any], str], Any]) -> Callable[[dict[str, Any], str], float]:
        def run(checkpoint: dict[str, Any], path: str) -> float:
            start = time.perf_counter()
            fn(checkpoint, path)
            return time.perf_counter() - start

        return run

    def save_fsync(checkpoint: dict[str, Any], path: str) -> None:
        torch.save(checkpoint, path)
        _fsync_path(path)
        _fsync_path(os.path.dirname(os.path.abspath(path)))

    if name in ("torch.save", "torch.save overwrite"):
        return timed(torch.save)
    if name == "torch.save+fsync":
        return timed(save_fsync)
    if name == "lightning":
        return timed(TorchCheckpointIO().save_checkpoint)
    if name in ("safe", "safe overwrite"):
        return timed(SafeCheckpointIO().save_checkpoint)
    if name == "safe before":
        return timed(make_before_io().save_checkpoint)
    if name == "durable floor":
        from ddp_strategy.checkpoint.atomic import EarlyWriteback
        from ddp_strategy.checkpoint.hashing import WRITEBACK_PIECE_BYTES

        def write_raw(checkpoint: dict[str, Any], path: str) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            written = 0
            try:
                with EarlyWriteback(fd) as early:  # the disk works while the rest is copied, as in SafeCheckpointIO
                    for t in tensors(checkpoint):
                        data = memoryview(t.reshape(-1).contiguous().view(torch.uint8).numpy()) if t.numel() else b""
                        while data:
                            n = os.write(fd, data[:WRITEBACK_PIECE_BYTES])
                            data = data[n:]
                            written += n
                            early.advance(written)
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_path(os.path.dirname(os.path.abspath(path)))

        return timed(write_raw)
    if name == "async overlap":
        overlap_writer = AsyncCheckpointWriter(SafeCheckpointIO())
        holder: list[TrainingStep] = []

        def run_overlap(checkpoint: dict[str, Any], path: str) -> float:
            if not holder:
                holder.append(TrainingStep(run_overlap.params_mib))  # type: ignore[attr-defined]
            step = holder[0]
            overlap_writer.wait()
            start = time.perf_counter()
            error = overlap_writer.submit(step.checkpoint(), path, deferred=step.deferred())
            submitted = time.perf_counter()
            step.forward_backward()  # the next batch's forward and backward, beside the copy
            backward_done = time.perf_counter()
            overlap_writer.wait_for_snapshot()  # the strategy's gate in the optimizer closure
            gate_done = time.perf_counter()
            step.optimizer.step()
            step.optimizer.zero_grad(set_to_none=True)
            error = error or overlap_writer.wait()  # untimed: the background write
            if error is not None:
                raise RuntimeError(error)
            blocking_submit = overlap_writer.submit(step.checkpoint(), path)  # async_snapshot="blocking"
            blocking_start = time.perf_counter()
            step.forward_backward()  # the same work beside a write whose snapshot was copied up front
            run_overlap.beside_blocking = time.perf_counter() - blocking_start  # type: ignore[attr-defined]
            step.optimizer.zero_grad(set_to_none=True)
            error = blocking_submit or overlap_writer.wait()
            if error is not None:
                raise RuntimeError(error)
            reference_start = time.perf_counter()
            step.forward_backward()  # the same work with no save in flight
            run_overlap.reference = time.perf_counter() - reference_start  # type: ignore[attr-defined]
            step.optimizer.zero_grad(set_to_none=True)
            run_overlap.forward_backward = backward_done - submitted  # type: ignore[attr-defined]
            run_overlap.submit = submitted - start  # type: ignore[attr-defined]
            return (submitted - start) + (gate_done - backward_done)

        run_overlap.params_mib = 16  # type: ignore[attr-defined]  # set by run_timing; a small model warms up
        return run_overlap
    if name in ("async submit", "async first"):
        writers = [AsyncCheckpointWriter(SafeCheckpointIO())]

        def run_async(checkpoint: dict[str, Any], path: str) -> float:
            if name == "async first":
                writers[0] = AsyncCheckpointWriter(SafeCheckpointIO())  # no snapshot buffers yet
                gc.collect()
            writer = writers[0]
            writer.wait()  # nothing in flight: the previous sample already waited
            cpu_start = time.process_time()
            start = time.perf_counter()
            error = writer.submit(checkpoint, path)
            blocked = time.perf_counter() - start
            run_async.cpu = time.process_time() - cpu_start  # type: ignore[attr-defined]
            error = error or writer.wait()  # untimed: the background write
            run_async.total = time.perf_counter() - start  # type: ignore[attr-defined]
            if error is not None:
                raise RuntimeError(error)
            return blocked

        return run_async
    raise ValueError(name)


# --------------------------------------------------------------------------------------------------------------
# Machine facts and memory helpers


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else -1


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def _drop_caches() -> tuple[bool, str]:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as err:
        return False, f"{type(err).__name__}: {err}"
    return True, "ok"


def _mount_of(path: str) -> dict[str, str]:
    real = os.path.realpath(path)
    best = {"mount": "?", "device": "?", "fstype": "?"}
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best["mount"]):
                best = {"mount": mount, "device": device, "fstype": fstype}
    if best["mount"] == "?" and real.startswith("/"):
        best["mount"] = "/"
    return best


# the modules on the measured save path (a change elsewhere in src/ does not change these figures)
SAVE_PATH_SOURCES = [
    f"src/ddp_strategy/{name}.py"
    for name in (
        "checkpoint/io",
        "checkpoint/atomic",
        "checkpoint/format",
        "checkpoint/hashing",
        "checkpoint/async_writer",
        "checkpoint/keys",
    )
] + ["src/ddp_strategy/errors.py"]


def src_digest() -> str:
    """SHA-256 over the save-path source files, to tell whether they changed while the benchmark ran."""
    digest = hashlib.sha256()
    for name in SAVE_PATH_SOURCES:
        file = ROOT / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.exists() else b"<missing>"))
    return digest.hexdigest()[:16]


def git_facts() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        try:
            run = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
        except OSError:
            return "?"
        return run.stdout.strip() if run.returncode == 0 else "?"

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "src_dirty": git("status", "--porcelain", "--", *SAVE_PATH_SOURCES),
    }


def machine_facts(directory: str) -> dict[str, Any]:
    import lightning
    import torch

    import ddp_strategy

    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        cpu = match.group(1).strip() if match else cpu
    with open("/proc/meminfo") as f:
        mem_total = int(re.search(r"^MemTotal:\s+(\d+)", f.read(), re.M).group(1)) // 1024  # type: ignore[union-attr]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem_total} MiB RAM",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "ddp_strategy": ddp_strategy.__version__,
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "directory": directory,
        "filesystem": _mount_of(directory),
        "loadavg_start": os.getloadavg(),
        "git": git_facts(),
        "src_digest_start": src_digest(),
    }


# --------------------------------------------------------------------------------------------------------------
# Memory worker (fresh process per measurement)


def memory_worker(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (import before the baseline)

    checkpoint, info = build_checkpoint(args.params_mib, args.optimizer)
    variant = args.memory_worker
    save = make_variant(variant)
    path = os.path.join(args.dir, f"mem-{os.getpid()}.ckpt")
    save(tiny_checkpoint(), path)  # warm the code path (imports, first-use allocations)
    os.remove(path)
    gc.collect()
    _malloc_trim()
    os.sync()

    base_kib = _status_kib("VmRSS")
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024
    except OSError:
        hwm_reset = False

    peak = [base_kib]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kib("VmRSS"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    after_submit_kib = None
    if variant == "async submit":
        from ddp_strategy.checkpoint.async_writer import AsyncCheckpointWriter
        from ddp_strategy.checkpoint.io import SafeCheckpointIO

        writer = AsyncCheckpointWriter(SafeCheckpointIO())
        start = time.perf_counter()
        writer.submit(checkpoint, path)
        seconds = time.perf_counter() - start
        after_submit_kib = _status_kib("VmRSS")  # the snapshot is alive until the background write ends
        error = writer.wait()
        if error:
            raise RuntimeError(error)
    else:
        seconds = save(checkpoint, path)
    stop.set()
    sampler.join()
    hwm_kib = _status_kib("VmHWM")
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    file_bytes = os.path.getsize(path)
    os.remove(path)

    method = "VmHWM after clear_refs reset" if hwm_reset else "ru_maxrss after - before"
    extra_kib = hwm_kib - base_kib if hwm_reset else ru_after - max(ru_before, base_kib)
    Path(args.out).write_text(
        json.dumps(
            {
                "variant": variant,
                "method": method,
                "hwm_reset": hwm_reset,
                "baseline_kib": base_kib,
                "peak_kib": hwm_kib,
                "extra_bytes": extra_kib * 1024,
                "sampler_extra_bytes": (peak[0] - base_kib) * 1024,
                "ru_maxrss_before_kib": ru_before,
                "ru_maxrss_after_kib": ru_after,
                "after_submit_extra_bytes": None if after_submit_kib is None else (after_submit_kib - base_kib) * 1024,
                "seconds": seconds,
                "file_bytes": file_bytes,
                "tensor_bytes": info["tensor_bytes"],
            }
        )
    )


# --------------------------------------------------------------------------------------------------------------
# Driver


def summarize(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def run_timing(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    import torch

    from ddp_strategy.checkpoint.format import verify

    checkpoint, info = build_checkpoint(args.params_mib, args.optimizer)
    names = list(QUICK_TIMED if args.quick else TIMED)
    variants = {name: make_variant(name) for name in names}
    warmers = {name: make_variant(name) for name in names}  # the tiny pass must not replace the async buffers
    if "async overlap" in variants:
        variants["async overlap"].params_mib = args.params_mib  # type: ignore[attr-defined]
    tiny = tiny_checkpoint()

    # Correctness before timing: the file verifies and loads back equal.
    path = os.path.join(directory, "check.ckpt")
    variants["safe"](checkpoint, path)
    record = verify(path)
    same = all(
        torch.equal(a, b)
        for a, b in zip(tensors(torch.load(path, weights_only=True)), tensors(checkpoint), strict=True)
    )
    os.remove(path)
    if record is None or not same:
        raise SystemExit("SafeCheckpointIO wrote a file that does not verify or load back equal")
    checks = {"format_version": record.format_version, "checksum": record.checksum, "loads_equal": same}

    existing = os.path.join(directory, "existing.ckpt")  # copied into place before each overwrite sample
    torch.save(checkpoint, existing)
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # process CPU time (all threads) in the timed call
    async_total: list[float] = []
    overlap_steps: dict[str, list[float]] = {
        "submit": [],
        "forward_backward": [],
        "beside_blocking": [],
        "reference": [],
    }
    drop_log = []
    why = ""
    for rnd in range(args.warmup + args.repeats):
        warm = rnd < args.warmup
        dropped, why = _drop_caches()
        drop_log.append(dropped)
        for name in names:  # untimed pass on a tiny checkpoint: code pages back after the drop
            path = os.path.join(directory, "tiny.ckpt")
            warmers[name](tiny, path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        random.Random(rnd).shuffle(order)  # a rotation alone keeps every variant after the same predecessor
        for name in order:
            path = os.path.join(directory, "bench.ckpt")
            if name.endswith("overwrite"):
                shutil.copyfile(existing, path)
            gc.collect()
            os.sync()
            cpu_start = time.process_time()
            seconds = variants[name](checkpoint, path)
            cpu_seconds = time.process_time() - cpu_start
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            if not warm:
                samples[name].append(seconds)
                cpu[name].append(getattr(variants[name], "cpu", cpu_seconds))  # async: submit() only
                if name == "async submit":
                    async_total.append(variants[name].total)  # type: ignore[attr-defined]
                if name == "async overlap":
                    for key, values in overlap_steps.items():
                        values.append(getattr(variants[name], key))
        label = "warm-up" if warm else f"round {rnd - args.warmup + 1}/{args.repeats}"
        print(f"{label}: " + ", ".join(f"{n} {samples[n][-1]:.3f}s" for n in names if not warm), flush=True)
    os.remove(existing)
    # paired per-round ratios (same round, so the same background load)
    pairs = [("safe", "torch.save"), ("async submit", "safe"), ("async first", "safe"), ("async overlap", "safe")]
    if not args.quick:
        pairs += [("safe", "torch.save+fsync"), ("safe", "lightning"), ("safe", "safe before")]
        pairs += [("durable floor", "torch.save"), ("safe", "durable floor")]
        pairs += [("safe before", "torch.save"), ("safe overwrite", "torch.save overwrite")]
    paired = {f"{a}/{b}": [x / y for x, y in zip(samples[a], samples[b], strict=True)] for a, b in pairs}
    return {
        "checkpoint": info,
        "check": checks,
        "drop_caches": {"used": all(drop_log), "rounds_dropped": sum(drop_log), "last_message": why},
        "timing": {name: summarize(v) for name, v in samples.items()},
        "cpu": {name: summarize(v) for name, v in cpu.items()},
        "async_background_total": summarize(async_total),
        "async_overlap_steps": {key: summarize(values) for key, values in overlap_steps.items()},
        "paired_ratios": {k: summarize(v) for k, v in paired.items()},
    }


def run_memory(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    variants = QUICK_MEMORY if args.quick else MEMORY
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for rep in range(args.memory_repeats):
        for name in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            out = os.path.join(directory, "mem.json")
            cmd = [sys.executable, __file__, "--memory-worker", name, "--out", out, "--dir", directory]
            cmd += ["--params-mib", str(args.params_mib), "--optimizer", args.optimizer]
            subprocess.run(cmd, check=True, cwd=ROOT, timeout=900)
            runs[name].append(json.loads(Path(out).read_text()))
            r = runs[name][-1]
            print(f"memory {rep + 1}/{args.memory_repeats} {name}: +{r['extra_bytes'] / MIB:.1f} MiB", flush=True)
    summary = {}
    for name, rs in runs.items():
        tb = rs[0]["tensor_bytes"]
        summary[name] = {
            "method": rs[0]["method"],
            "extra_bytes": summarize([r["extra_bytes"] for r in rs]),
            "fraction": summarize([r["extra_bytes"] / tb for r in rs]),
            "sampler_fraction": summarize([r["sampler_extra_bytes"] / tb for r in rs]),
            "runs": rs,
        }
        if name == "async submit":
            summary[name]["after_submit_fraction"] = summarize([r["after_submit_extra_bytes"] / tb for r in rs])
    return summary


def fmt_s(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f}"


def build_report(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    t = result["timing"]
    m = result["memory"]
    med = {k: v["median"] for k, v in t.items()}
    info = result["checkpoint"]
    size_mib = info["tensor_bytes"] / MIB
    quick = result["mode"] == "quick"

    def ratio(a: str, b: str) -> float:
        return med[a] / med[b]

    def spread(key: str) -> str:
        p = result["paired_ratios"][key]
        a, b = key.split("/")
        return (
            f"paired per-round median {p['median']:.2f} (range {p['min']:.2f}-{p['max']:.2f}); ratio of minima "
            f"{t[a]['min'] / t[b]['min']:.2f}"
        )

    gates = [
        {
            "figure": "sync save time, SafeCheckpointIO / torch.save (ratio of medians)",
            "value": ratio("safe", "torch.save"),
            "detail": f"{med['safe']:.3f} s / {med['torch.save']:.3f} s; {spread('safe/torch.save')}",
            "target": 1.05,
            "fail_above": 1.10,
        },
        {
            "figure": "peak extra memory during save, SafeCheckpointIO / checkpoint size",
            "value": m["safe"]["fraction"]["median"],
            "detail": f"+{m['safe']['extra_bytes']['median'] / MIB:.1f} MiB of {size_mib:.0f} MiB",
            "target": 0.10,
            "fail_above": 0.20,
        },
        {
            "figure": "async (async_snapshot='overlap', the default): time training is blocked per save / sync "
            "SafeCheckpointIO save time",
            "value": ratio("async overlap", "safe"),
            "detail": f"{med['async overlap']:.4f} s / {med['safe']:.3f} s; {spread('async overlap/safe')}",
            "target": 0.10,
            "fail_above": 0.20,
        },
    ]
    for g in gates:
        g["pass"] = g["value"] <= g["target"]
        g["quick_gate_fail"] = g["value"] > g["fail_above"]
    steps = result["async_overlap_steps"]
    slowdown = {k: steps[k]["median"] - steps["reference"]["median"] for k in ("forward_backward", "beside_blocking")}
    lost_blocking = med["async submit"] + slowdown["beside_blocking"]
    lost_overlap = med["async overlap"] + slowdown["forward_backward"]
    info_rows = [
        (
            "async, async_snapshot='blocking': time submit() blocks per save (steady state) / sync save",
            f"{ratio('async submit', 'safe'):.3f}",
            f"{med['async submit']:.3f} s / {med['safe']:.3f} s; {spread('async submit/safe')}",
        ),
        (
            "async overlap: forward+backward right after submit() (beside the copy and the background write) / "
            "the same with no save in flight",
            f"{steps['forward_backward']['median'] / steps['reference']['median']:.2f}",
            f"{steps['forward_backward']['median']:.3f} s / {steps['reference']['median']:.3f} s (batch "
            f"{TRAIN_BATCH}); submit() alone {steps['submit']['median'] * 1000:.1f} ms",
        ),
        (
            "async blocking: forward+backward right after submit() (beside the background write) / the same with "
            "no save in flight",
            f"{steps['beside_blocking']['median'] / steps['reference']['median']:.2f}",
            f"{steps['beside_blocking']['median']:.3f} s / {steps['reference']['median']:.3f} s",
        ),
        (
            "training time lost per save (blocked + slowdown of the next forward+backward): sync / async blocking / "
            "async overlap",
            f"{med['safe']:.3f} / {lost_blocking:.3f} / {lost_overlap:.3f} s",
            "sync: the save itself; async: submit (+ the wait before the optimizer step) plus what the background "
            "copy and write took from the next forward+backward on this machine's cores",
        ),
        (
            "async: first save of a writer (allocates the snapshot buffers) / sync save",
            f"{ratio('async first', 'safe'):.2f}",
            f"{med['async first']:.3f} s / {med['safe']:.3f} s; {spread('async first/safe')}",
        ),
    ]
    if not quick:
        bg = result["async_background_total"]["median"]
        info_rows += [
            (
                "BEFORE (SHA-256 inline, no early write-back) / torch.save",
                f"{ratio('safe before', 'torch.save'):.2f}",
                f"{med['safe before']:.3f} s / {med['torch.save']:.3f} s; {spread('safe before/torch.save')}",
            ),
            (
                "sync, SafeCheckpointIO now / BEFORE",
                f"{ratio('safe', 'safe before'):.2f}",
                f"{med['safe']:.3f} s / {med['safe before']:.3f} s; {spread('safe/safe before')}",
            ),
            (
                "durable floor (raw bytes + fsync, no serialization) / torch.save",
                f"{ratio('durable floor', 'torch.save'):.2f}",
                f"{med['durable floor']:.3f} s / {med['torch.save']:.3f} s; {spread('durable floor/torch.save')}",
            ),
            (
                "sync, SafeCheckpointIO / durable floor",
                f"{ratio('safe', 'durable floor'):.2f}",
                f"{med['safe']:.3f} s / {med['durable floor']:.3f} s; {spread('safe/durable floor')}",
            ),
            (
                "sync, SafeCheckpointIO / (torch.save + fsync file and dir)",
                f"{ratio('safe', 'torch.save+fsync'):.2f}",
                f"{med['safe']:.3f} s / {med['torch.save+fsync']:.3f} s; {spread('safe/torch.save+fsync')}",
            ),
            (
                "sync, SafeCheckpointIO / Lightning TorchCheckpointIO",
                f"{ratio('safe', 'lightning'):.2f}",
                f"{med['safe']:.3f} s / {med['lightning']:.3f} s; {spread('safe/lightning')}",
            ),
            (
                "overwrite, SafeCheckpointIO / torch.save (existing file)",
                f"{ratio('safe overwrite', 'torch.save overwrite'):.2f}",
                f"{med['safe overwrite']:.3f} s / {med['torch.save overwrite']:.3f} s; "
                f"{spread('safe overwrite/torch.save overwrite')}",
            ),
        ]
        for name, label in (("torch.save", "torch.save"), ("lightning", "Lightning TorchCheckpointIO")):
            info_rows.append(
                (
                    f"peak extra memory, {label} / checkpoint size",
                    f"{m[name]['fraction']['median']:.3f}",
                    f"+{m[name]['extra_bytes']['median'] / MIB:.1f} MiB",
                )
            )
        info_rows += [
            (
                "async: snapshot extra memory when a writer's first submit() returns / size (~1.0 by design; "
                "kept for reuse while the writer exists)",
                f"{m['async submit']['after_submit_fraction']['median']:.3f}",
                f"peak during snapshot + background write {m['async submit']['fraction']['median']:.3f}",
            ),
            (
                "async: background write, submit to wait() done / sync save",
                f"{bg / med['safe']:.2f}",
                f"{bg:.3f} s",
            ),
        ]

    lines = ["| figure | value | target | result | detail |", "|---|---|---|---|---|"]
    for g in gates:
        verdict = "PASS" if g["pass"] else "MISS"
        lines.append(f"| {g['figure']} | {g['value']:.3f} | <= {g['target']:.2f} | {verdict} | {g['detail']} |")
    for figure, value, detail in info_rows:
        lines.append(f"| {figure} | {value} | (info) | - | {detail} |")
    lines += [
        "",
        "| variant | median (s) | min | max | MB/s (median) | CPU s (median) | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, desc in TIMED.items():
        if name not in t:
            continue
        mbps = info["tensor_bytes"] / t[name]["median"] / 1e6
        lines.append(f"| {name} | {fmt_s(t[name])} | {mbps:,.0f} | {result['cpu'][name]['median']:.3f} | {desc} |")
    lines += [
        "",
        "| memory variant | peak extra (MiB) median | min | max | fraction of size | 1 ms sampler fraction | method |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in m.items():
        e = s["extra_bytes"]
        lines.append(
            f"| {name} | {e['median'] / MIB:.1f} | {e['min'] / MIB:.1f} | {e['max'] / MIB:.1f} | "
            f"{s['fraction']['median']:.3f} | {s['sampler_fraction']['median']:.3f} | {s['method']} |"
        )
    return "\n".join(lines), gates


def driver(args: argparse.Namespace) -> int:
    wall_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as directory:
        meta = machine_facts(directory)
        timing = run_timing(args, directory)
        gc.collect()
        _malloc_trim()
        memory = run_memory(args, directory)
    meta["loadavg_end"] = os.getloadavg()
    meta["src_digest_end"] = src_digest()
    src_changed = meta["src_digest_start"] != meta["src_digest_end"]
    wall = time.perf_counter() - wall_start
    info = timing["checkpoint"]
    result = {
        "meta": meta,
        "mode": "quick" if args.quick else "full",
        "config": {
            "repeats": args.repeats,
            "warmup_rounds": args.warmup,
            "memory_repeats": args.memory_repeats,
            "params_mib": args.params_mib,
            "optimizer": args.optimizer,
        },
        **timing,
        "memory": memory,
        "wall_seconds": wall,
    }
    text, gates = build_report(result)
    result["gates"] = gates
    failed = [g["figure"] for g in gates if g["quick_gate_fail"]]
    exit_code = 1 if args.quick and failed else 0
    result["exit_code"] = exit_code
    drop = timing["drop_caches"]
    header = (
        f"Mode {result['mode']}, measured {meta['date']} on {meta['machine']}, {meta['platform']}; Python "
        f"{meta['python']}, torch {meta['torch']}, lightning {meta['lightning']}, ddp_strategy {meta['ddp_strategy']}, "
        f"{meta['openssl']}. Code: commit {meta['git']['commit']}"
        + (
            f" with uncommitted changes on the save path ({meta['git']['src_dirty']!r})"
            if meta["git"]["src_dirty"]
            else ""
        )
        + f", save-path source digest {meta['src_digest_start']}"
        + (" -- WARNING: save-path sources changed during the run, figures mix versions" if src_changed else "")
        + ".\n\n"
        f"Checkpoint: {info['layers']} x nn.Linear({WIDTH}, {WIDTH}) = {info['params']:,} parameters "
        f"({info['param_bytes'] / MIB:.0f} MiB fp32)"
        + (", plus Adam state (exp_avg, exp_avg_sq)" if info["optimizer"] == "adam" else "")
        + f": {info['tensor_bytes'] / MIB:.0f} MiB of tensors in a Lightning-layout dict. Files written to "
        f"{meta['directory']} ({meta['filesystem']['fstype']} on {meta['filesystem']['device']}). "
        f"{args.warmup} warm-up round(s) + {args.repeats} timed rounds, variants interleaved in a shuffled order; "
        f"os.sync() before every sample; page cache dropped per round: "
        f"{'yes' if drop['used'] else 'no (' + drop['last_message'] + ')'}. Memory: {args.memory_repeats} fresh "
        f"process(es) per variant. Load average start {meta['loadavg_start'][0]:.2f}, end "
        f"{meta['loadavg_end'][0]:.2f}. Wall time of the run {wall:.0f} s.\n\n"
    )
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "checkpoint_save.json").write_text(json.dumps(result, indent=2, default=str))
    (results / "checkpoint_save.md").write_text(header + text + "\n")
    print()
    print(header + text)
    if args.quick and failed:
        print(
            f"\nQuick gate failed (misses by more than twice the allowed overhead): {'; '.join(failed)}",
            file=sys.stderr,
        )
    print(f"\nwall time {wall:.1f} s; exit code {exit_code}", flush=True)
    return exit_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: gated variants only, 5 rounds")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 9, quick 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds")
    parser.add_argument("--memory-repeats", type=int, help="fresh processes per memory variant (default 3, quick 1)")
    parser.add_argument("--params-mib", type=int, help="MiB of fp32 parameters (default 128)")
    parser.add_argument("--optimizer", choices=["adam", "none"], default="adam", help="include Adam state")
    parser.add_argument("--dir", help="parent directory of the checkpoint files (default: the system temp dir)")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where checkpoint_save.{json,md} go")
    parser.add_argument("--memory-worker", choices=MEMORY, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args)
        return
    args.repeats = args.repeats or (5 if args.quick else 9)
    args.memory_repeats = args.memory_repeats or (1 if args.quick else 3)
    args.params_mib = args.params_mib or 128
    sys.exit(driver(args))


if __name__ == "__main__":
    main()
