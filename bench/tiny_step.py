"""Tiny-model step: a raw DDP loop, stock ``DDPStrategy`` and ``SafeDDPStrategy()`` side by side (issue 30, point 3).

    python bench/tiny_step.py              # full run: JSON + Markdown in bench/results/tiny_step.{json,md}
    python bench/tiny_step.py --quick      # smoke run (2 rounds, shorter fits): bench/results/tiny_step-quick.*
    python bench/tiny_step.py --report bench/results/tiny_step.json    # redo the analysis and Markdown of a JSON
    python bench/tiny_step.py --pool A.json B.json --out OUT   # several runs of one configuration, analysed as one

On a tiny model the step is almost all framework: that is how a fast GPU step looks to the CPU, and where a
strategy's per-step Python work shows. The model is a 2-layer MLP (32 -> 64 -> 10, cross-entropy, SGD) on small
random tensors, batch 32 per rank, 2 ranks on CPU over gloo. Variants:

* ``raw``: a plain PyTorch loop (``DistributedDataParallel``, ``DistributedSampler``, no Lightning);
* ``stock``: Lightning's ``DDPStrategy()``;
* ``safe``: ``SafeDDPStrategy()`` at its defaults;

and, for diagnosis (``--variants``, any of them in a group): ``stock_again`` (a second stock fit, as ``--aa`` runs),
``stock_recorder`` (stock with torch's Flight Recorder at the size ``SafeDDPStrategy`` gives it, ``TRACE_ENTRIES``;
stock runs it at torch's default, 2000), ``stock_no_sigterm`` (stock without Lightning's per-batch broadcast of rank
0's SIGTERM flag, which ``SafeDDPStrategy`` skips while its handler has SIGTERM: safe against it is what the
strategy's own work costs a step) and
``safe_bare`` (``SafeDDPStrategy`` without its background work, or with ``--bare-kwargs``; ``--bare-recorder``
gives its jobs torch's Flight Recorder at the strategy's size too, for a ``safe_bare`` without desync detection,
which would leave torch's default; ``--bare-without-step-hooks`` has it run ``DDPStrategy``'s ``on_train_batch_start``,
``post_backward`` and ``optimizer_step`` instead of its own: what is left of the strategy is its set-up);
each in two logging modes: ``nolog``, and ``sync_dist``: ``self.log("loss", loss, sync_dist=True)`` in every
training step (for ``raw``, what that does in Lightning's ``_sync_ddp``: a barrier and an all-reduce of the loss).

How it is run: every fit has its own pair of processes, started by ``torchrun --standalone`` (2 ranks, one thread
each, rank r pinned to core r as in ``bench/suite.py``; ``--no-pin`` leaves placement to the scheduler), so each
strategy creates the default process group as it does for a user (``SafeDDPStrategy`` sets the size of torch's
Flight Recorder for it; in a shared process every later fit would inherit that, or ``safe`` would lose it). A
*round* starts, per logging mode (modes in alternating order), the variants' jobs at once (three by default); once
every rank is at its first step, a baton (keys in a ``TCPStore`` this script hosts) lets one job at a time train a
*chunk* of steps while the others wait at a step boundary, in a new seeded order at every pass: an untimed warm-up
chunk, then ``chunks`` timed chunks of ``chunk`` steps each. So the fits of a round are measured in alternating
slices a fraction of a second long, and see the same machine load, which on a shared machine changes from second
to second; the process launches, imports and set-ups are never inside a measurement. ``--rounds`` rounds (default
10), each with fresh processes.

What is measured, per rank: at the start of every training step (after its batch is fetched; a callback's
``on_train_batch_start``, or the top of the raw loop) the wall clock, the training thread's CPU time
(``time.thread_time``) and the process's (``time.process_time``: gloo's and the strategy's threads too). A step's
time is the interval to the start of the next step: data fetch, forward, backward with the gradient all-reduce,
optimizer step, every hook. The first step of each chunk (the two ranks resuming together, caches refilling) is not
timed. Per fit: the mean over its timed steps (total / steps), the median step, CPU and process CPU per step; and
the CPU of each of the process's threads by OS name over the timed chunks' window, per second of it
(``threads_cpu_per_s``: gloo's threads name themselves); at each timed chunk's ends (outside the timed steps) the
training thread's scheduler counts (``thread_sched_counts``: time runnable but waiting for its core, context
switches), which split its mean step into CPU, waiting for a core, and asleep (``step_breakdown``).

Report: per (mode, variant) the median over rounds [min, max] of rank 0's figures (and rank 1's mean); per mode the
ratios safe/stock, stock/raw and safe/raw as the ratio of the medians and the per-round (paired) ratios' median
[min, max]; and the target safe/stock <= 1.02 per mode, judged on the mean step's ratio of medians and separately
on CPU. The exit code is 0 whatever the result (a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

IMPORT_START = time.time()
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from suite import job_processes, metadata, tail  # noqa: E402  (bench/suite.py: the same process handling)
from workloads.tiny import SHAPE, network, tiny_module  # noqa: E402  (the model, shared with other benchmarks)

VARIANTS = ("raw", "stock", "safe")
#: ``--aa``: a second stock fit takes the raw loop's place; its ratio to stock is the method's own noise (A/A)
AA_VARIANTS = ("stock_again", "stock", "safe")
#: every variant ``--variants`` may name (e.g. ``stock stock_recorder safe safe_bare``: diagnosis, paired)
ALL_VARIANTS = ("raw", "stock_again", "stock", "stock_recorder", "stock_no_sigterm", "safe", "safe_bare")
#: the ``safe_bare`` variant's keyword arguments: no heartbeat thread, no desync monitor, no preemption watch
BARE_KWARGS = {"heartbeat_interval": 0, "desync_detection": False, "preemption_signals": None}
MODES = ("nolog", "sync_dist")
LABELS = {
    "raw": "raw PyTorch DDP loop",
    "stock": "Lightning DDPStrategy()",
    "stock_again": "Lightning DDPStrategy(), again (A/A)",
    "safe": "SafeDDPStrategy()",
    "safe_bare": "SafeDDPStrategy(), the safe_bare variant",
    "stock_recorder": "Lightning DDPStrategy(), torch's Flight Recorder at the strategy's size",
    "stock_no_sigterm": "Lightning DDPStrategy(), without its per-batch SIGTERM broadcast",
}
#: the ``stock_recorder`` variant's environment: torch's Flight Recorder (on by default, 2000 entries) at the size
#: SafeDDPStrategy gives it
#: (``ddp_strategy.collective_record.TRACE_ENTRIES``, read when the jobs start)
RECORDER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
#: SafeDDPStrategy's own per-step methods, which ``--bare-without-step-hooks`` replaces by DDPStrategy's
STEP_HOOKS = ("on_train_batch_start", "post_backward", "optimizer_step")
RATIOS = (
    ("safe", "stock"),
    ("stock_again", "stock"),
    ("stock", "raw"),
    ("safe", "raw"),
    ("safe_bare", "stock"),
    ("safe", "safe_bare"),
    ("stock_recorder", "stock"),
    ("safe", "stock_recorder"),
    ("stock_no_sigterm", "stock"),
    ("safe", "stock_no_sigterm"),
)
TARGET = ("safe", "stock", 1.02)  # issue 30, point 3: safe / stock at most 1.02 in both modes
WORLD_SIZE = 2
FIGURES = ("step_mean_s", "step_median_s", "cpu_step_s", "process_cpu_step_s")


# ---------------------------------------------------------------------------------------------------- plan
def config_for(quick: bool, rounds: int | None) -> dict[str, Any]:
    if quick:
        return {"rounds": rounds or 2, "warmup": 20, "chunks": 9, "chunk": 10, "batch_size": 32, "seed": 1234}
    return {"rounds": rounds or 10, "warmup": 30, "chunks": 27, "chunk": 10, "batch_size": 32, "seed": 1234}


def variants_of(config: dict[str, Any]) -> tuple[str, ...]:
    """The variants each round runs: raw, stock, safe; with ``--aa`` a second stock fit instead of raw."""
    return tuple(config.get("variants", VARIANTS))


def total_steps(config: dict[str, Any]) -> int:
    """Warm-up, the timed chunks, and one more step whose start closes the last timed step."""
    return int(config["warmup"] + config["chunks"] * config["chunk"] + 1)


def chunk_starts(config: dict[str, Any]) -> list[int]:
    """The step index at which each chunk starts: 0 (warm-up), the timed chunks, and the closing step."""
    return [0] + [config["warmup"] + c * config["chunk"] for c in range(config["chunks"] + 1)]


def is_timed(step: int, config: dict[str, Any]) -> bool:
    """Steps of the timed chunks except the first of each (its ranks resume from the baton)."""
    offset = step - config["warmup"]
    return 0 <= offset < config["chunks"] * config["chunk"] and offset % config["chunk"] != 0


def groups(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per round, one group per logging mode (modes alternate); each group's pass orders, seeded."""
    out = []
    for r in range(config["rounds"]):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            rng = random.Random(f"{config['seed']}/{r}/{mode}")
            variants = variants_of(config)
            orders = [rng.sample(variants, len(variants)) for _ in range(config["chunks"] + 2)]
            out.append({"round": r, "mode": mode, "orders": orders})
    return out


# ---------------------------------------------------------------------------------------------------- the baton
def key(prefix: str, *parts: object) -> str:
    return "/".join([prefix, *map(str, parts)])


class Runner:
    """Hosts the baton's store; starts a group's jobs and hands the chunks out."""

    def __init__(self, config: dict[str, Any], tmp: Path, timeout: float) -> None:
        import torch.distributed as dist

        self.config, self.tmp, self.timeout = config, tmp, timeout
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        self.address = f"127.0.0.1:{self.store.port}"

    def launch(self, prefix: str, variant: str, mode: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        config = self.config
        out, log = self.tmp / f"{prefix.replace('/', '-')}", self.tmp / f"{prefix.replace('/', '-')}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}"]
        cmd += [str(Path(__file__).resolve()), "--worker", "--variant", variant, "--mode", mode]
        cmd += ["--baton", self.address, "--prefix", prefix, "--out", str(out)]
        cmd += ["--worker-config", json.dumps(config)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONWARNINGS"] = "ignore"
        if variant == "stock_recorder" or (variant == "safe_bare" and config.get("bare_recorder")):
            from ddp_strategy.collective_record import TRACE_ENTRIES

            env[RECORDER_SIZE_ENV] = str(TRACE_ENTRIES)
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            env.pop(name, None)  # never inherit a rank from an outer launcher
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        return proc, out, log

    def wait_keys(self, keys: list[str], jobs: dict[str, Any], deadline: float) -> None:
        """Until every key is set; fails when a job exited or the deadline passed."""
        while not self.store.check(keys):
            for variant, (proc, _, log) in jobs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{variant} exited with code {proc.returncode}; log: {log}\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {keys}")
            time.sleep(0.2)

    def wait_ranks(self, prefix: str, what: str, jobs: dict[str, Any]) -> None:
        """Until both ranks of a job set ``what`` (the store wakes this up at once; a chunk takes milliseconds)."""
        keys = [key(prefix, what, r) for r in range(WORLD_SIZE)]
        try:
            self.store.wait(keys, timedelta(seconds=10))
        except RuntimeError:  # slow, or a job failed: poll, and name the job that exited
            self.wait_keys(keys, jobs, time.monotonic() + self.timeout)

    def run_group(self, group: dict[str, Any], log: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Start the group's jobs (one per variant), hand out the chunks; return its record and each fit's ranks."""
        r, mode = group["round"], group["mode"]
        variants = variants_of(self.config)
        prefixes = {v: f"r{r}/{mode}/{v}" for v in variants}
        started = time.monotonic()
        jobs: dict[str, Any] = {}
        try:
            for v in variants:
                jobs[v] = self.launch(prefixes[v], v, mode)
            ready = [key(p, "ready", rank) for p in prefixes.values() for rank in range(WORLD_SIZE)]
            self.wait_keys(ready, jobs, started + self.timeout)  # every rank at its first step: start-up is over
            ready_seconds = time.monotonic() - started
            log(f"round {r} {mode}: every rank at its first step after {ready_seconds:.1f} s")
            loads = [os.getloadavg()[0]]
            timed_start = time.monotonic()
            for c, order in enumerate(group["orders"]):  # warm-up, timed chunks, the closing step (then the fit ends)
                for v in order:
                    self.store.set(key(prefixes[v], "go", c), "1")
                    last = c == len(group["orders"]) - 1
                    self.wait_ranks(prefixes[v], "finished" if last else f"done/{c}", jobs)
            chunks_seconds = time.monotonic() - timed_start
            loads.append(os.getloadavg()[0])
            for v, (proc, _, log_path) in jobs.items():
                try:
                    proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{v} did not exit; log: {log_path}\n{tail(log_path)}") from None
                if proc.returncode != 0:
                    raise RuntimeError(f"{v} failed with code {proc.returncode}; log: {log_path}\n{tail(log_path)}")
        finally:
            for proc, out, _ in jobs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                for pid in job_processes(out):  # torchrun's workers, by the job's unique --out path
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        record = {
            **group,
            "ready_seconds": ready_seconds,
            "chunks_seconds": chunks_seconds,
            "group_seconds": time.monotonic() - started,
            "loadavg": loads,
        }
        fits = []
        for v in variants:
            ranks = [json.loads(Path(f"{jobs[v][1]}.rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
            fits.append({"round": r, "mode": mode, "variant": v, "ranks": ranks})
        return record, fits


class Baton:
    """A rank's side of the baton: at a chunk's start, report the last chunk done (or ready), then wait for the go."""

    def __init__(self, address: str, prefix: str, rank: int) -> None:
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), None, False, timedelta(minutes=15))
        self.prefix, self.rank = prefix, rank

    def turn(self, chunk: int) -> None:
        self.store.set(key(self.prefix, "ready" if chunk == 0 else f"done/{chunk - 1}", self.rank), "1")
        self.store.wait([key(self.prefix, "go", chunk)])

    def finished(self) -> None:
        self.store.set(key(self.prefix, "finished", self.rank), "1")


# ---------------------------------------------------------------------------------------------------- one rank
def without_step_hooks(strategy: Any, stock: type) -> None:
    """Diagnosis: ``strategy`` runs ``stock``'s (``DDPStrategy``'s) :data:`STEP_HOOKS` instead of its own.

    Lightning looks each method up on the strategy instance at every step, so an instance attribute takes the class's
    place: what is left of ``SafeDDPStrategy`` in a step is what its set-up changed.
    """
    for name in STEP_HOOKS:
        setattr(strategy, name, getattr(stock, name).__get__(strategy))


def fit_figures(steps: list[tuple[int, float, float, float]], config: dict[str, Any]) -> dict[str, Any]:
    """A fit's figures from its steps' (index, wall, thread CPU, process CPU) intervals: the timed steps only."""
    timed = [s for s in steps if is_timed(s[0], config)]
    expected = config["chunks"] * (config["chunk"] - 1)
    if len(timed) != expected:
        raise RuntimeError(f"{len(timed)} timed steps, expected {expected}")
    walls = [s[1] for s in timed]
    per_chunk = config["chunk"] - 1
    return {
        "timed_steps": len(timed),
        "step_mean_s": sum(walls) / len(timed),
        "step_median_s": float(statistics.median(walls)),
        "step_max_s": max(walls),
        "cpu_step_s": sum(s[2] for s in timed) / len(timed),
        "process_cpu_step_s": sum(s[3] for s in timed) / len(timed),
        "chunk_means_us": [
            round(statistics.fmean(walls[i : i + per_chunk]) * 1e6) for i in range(0, len(walls), per_chunk)
        ],
    }


def own_threads_cpu() -> float:
    """CPU seconds of the strategy's own threads (named ``ddp_strategy-...``) in this process, from ``/proc``."""
    import threading

    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("ddp_strategy") and thread.native_id is not None:
            with contextlib.suppress(OSError):  # it ended meanwhile
                total += task_cpu(Path(f"/proc/self/task/{thread.native_id}"))
    return total


def task_cpu(task: Path) -> float:
    """CPU seconds of one thread (``/proc/self/task/<tid>``), from its ``schedstat``."""
    return int((task / "schedstat").read_text().split()[0]) / 1e9


def thread_sched_counts() -> tuple[int, int, int, int]:
    """The calling thread's scheduler counts from ``/proc/thread-self``: nanoseconds runnable but waiting for a core
    (``schedstat``'s second field), time slices run, voluntary and involuntary context switches (``status``)."""
    _, waited, slices = (int(v) for v in Path("/proc/thread-self/schedstat").read_text().split()[:3])
    status = dict(
        line.split(":", 1) for line in Path("/proc/thread-self/status").read_text().splitlines() if ":" in line
    )
    return waited, slices, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])


def threads_cpu_by_name() -> dict[str, float]:
    """CPU seconds of every thread of this process by its OS name (``comm``; torch's and gloo's threads name
    themselves, Python's threads are ``python``), from ``/proc``: which threads a variant's process CPU goes to."""
    total: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # it ended meanwhile
            name = (task / "comm").read_text().strip()
            total[name] = total.get(name, 0.0) + task_cpu(task)
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank of one fit (under torchrun): train in the baton's chunks; write this rank's ``OUT.rank<R>.json``."""
    config = json.loads(args.worker_config)
    if config.get("pin_cores", True) and hasattr(os, "sched_setaffinity"):
        # One core per rank (as bench/suite.py does), before any thread starts (they inherit the mask): left to the
        # scheduler of a loaded machine, both ranks of a job sometimes share a core and the whole fit runs slower.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    import threading

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddp_strategy import SafeDDPStrategy

    imported = time.time()
    variant, sync, values = args.variant, args.mode == "sync_dist", int(config.get("logs", 1))
    rank = int(os.environ["RANK"])
    baton = Baton(args.baton, args.prefix, rank)
    chunk_at = {step: c for c, step in enumerate(chunk_starts(config))}
    timed_from = {step + 1 for step in chunk_starts(config)[1:-1]}  # each timed chunk's first timed step
    steps = total_steps(config)

    class Clock:
        """At every step's start: close the previous step's interval; at a chunk's start, take the baton first."""

        def __init__(self) -> None:
            self.index = 0
            self.previous: tuple[float, float, float] | None = None
            self.steps: list[tuple[int, float, float, float]] = []
            self.threads_in_window: int | None = None
            self.own_threads_at = (0.0, 0.0)
            self.own_threads_cpu_per_s: float | None = None
            self.threads_at: dict[str, float] = {}
            self.threads_cpu_per_s: dict[str, float] = {}
            self.fit_to_first_step: float | None = None
            self.sched_at: tuple[int, int, int, int] | None = None
            self.sched_total = [0, 0, 0, 0]  # over the timed steps: see thread_sched_counts

        def step_start(self) -> None:
            if self.index in timed_from:  # read outside the timed steps: here in the chunk's untimed first step
                self.sched_at = thread_sched_counts()
            now = (time.perf_counter(), time.thread_time(), time.process_time())
            if self.previous is None:
                self.fit_to_first_step = now[0] - fit_start
            else:
                self.steps.append((self.index - 1, *(a - b for a, b in zip(now, self.previous, strict=True))))
            if self.index in chunk_at and self.sched_at is not None:  # a timed chunk's end, before the baton
                counts = thread_sched_counts()
                self.sched_total = [t + b - a for t, a, b in zip(self.sched_total, self.sched_at, counts, strict=True)]
                self.sched_at = None
            if self.index in chunk_at:
                baton.turn(chunk_at[self.index])
                now = (time.perf_counter(), time.thread_time(), time.process_time())
            if self.index == config["warmup"]:
                self.threads_in_window = threading.active_count()
                self.own_threads_at = (time.perf_counter(), own_threads_cpu())
                self.threads_at = threads_cpu_by_name()
            if self.index == steps - 1:  # the closing step: the window of the timed chunks is over
                wall, cpu = time.perf_counter() - self.own_threads_at[0], own_threads_cpu() - self.own_threads_at[1]
                self.own_threads_cpu_per_s = cpu / wall
                self.threads_cpu_per_s = {
                    name: (seconds - self.threads_at.get(name, 0.0)) / wall
                    for name, seconds in threads_cpu_by_name().items()
                }
            self.previous = now
            self.index += 1

    clock = Clock()

    class StepClock(Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            clock.step_start()

    generator = torch.Generator().manual_seed(config["seed"])
    samples = steps * config["batch_size"] * WORLD_SIZE  # one epoch holds every step: no epoch end in between
    dataset = TensorDataset(
        torch.randn(samples, SHAPE[0], generator=generator), torch.randint(0, SHAPE[2], (samples,), generator=generator)
    )
    fit_start = time.perf_counter()
    handshake = None
    if variant == "raw":
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        torch.manual_seed(config["seed"])
        model = network()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"])
        loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)
        model.train()
        for done, (x, y) in enumerate(loader, start=1):
            clock.step_start()
            loss = F.cross_entropy(ddp(x), y)
            for i in range(values if sync else 0):  # Lightning's _sync_ddp per sync_dist value: barrier, sum, mean
                value = loss.detach().clone() * (i or 1)
                dist.barrier()
                dist.all_reduce(value)
                value /= world
            optimizer.zero_grad(set_to_none=True)  # Lightning's order: forward, zero_grad, backward, step
            loss.backward()
            optimizer.step()
            if done >= steps:
                break
    else:
        pl.seed_everything(config["seed"], verbose=False)
        safe_kwargs = config.get("safe_kwargs") or {}
        strategy: DDPStrategy = DDPStrategy()
        if variant == "safe":
            strategy = SafeDDPStrategy(**safe_kwargs)
        elif variant == "safe_bare":
            if config.get("bare_unpinned"):  # diagnosis: gloo's worker threads left without a kept thread state
                import ddp_strategy.fork_safety

                ddp_strategy.fork_safety.affected = lambda python=None: False  # type: ignore[assignment]
            strategy = SafeDDPStrategy(**config.get("bare_kwargs", BARE_KWARGS))
            if config.get("bare_without_step_hooks"):
                without_step_hooks(strategy, DDPStrategy)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD_SIZE,
            strategy=strategy,
            max_steps=steps,
            max_epochs=1,
            callbacks=[StepClock()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=f"{args.out}-root",  # in the runner's temporary directory
        )
        if variant == "stock_no_sigterm":  # as SafeDDPStrategy skips it (no signal comes to a benchmark's fit)
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        trainer.fit(
            tiny_module(sync_dist=sync, values=values),
            DataLoader(dataset, batch_size=config["batch_size"], shuffle=True),
        )
        handshake = getattr(trainer.strategy, "last_handshake_seconds", None)
    payload = {
        "rank": rank,
        "variant": variant,
        "mode": args.mode,
        "threads_per_rank": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "import_seconds": imported - IMPORT_START,
        "fit_to_first_step_s": clock.fit_to_first_step,
        "handshake_s": handshake,
        "threads_in_window": clock.threads_in_window,
        "threads_after_fit": threading.active_count(),
        "own_threads_cpu_per_s": clock.own_threads_cpu_per_s,
        "threads_cpu_per_s": clock.threads_cpu_per_s,
        **fit_figures(clock.steps, config),
    }
    timed = payload["timed_steps"]
    waited, slices, voluntary, involuntary = clock.sched_total
    payload["sched_per_step"] = {
        "runqueue_wait_s": waited / 1e9 / timed,
        "timeslices": slices / timed,
        "voluntary_switches": voluntary / timed,
        "involuntary_switches": involuntary / timed,
    }
    out = Path(f"{args.out}.rank{rank}.json")
    out.with_suffix(".tmp").write_text(json.dumps(payload))
    out.with_suffix(".tmp").replace(out)
    if dist.is_initialized():  # a gloo group left to the interpreter's exit may abort the process
        dist.barrier()
        dist.destroy_process_group()
    baton.finished()


# ---------------------------------------------------------------------------------------------------- analysis
def spread(values: list[float]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "min": min(values), "max": max(values)}


def cells(fits: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Per (mode, variant): one record per round with rank 0's figures (``rank1_step_mean_s``: rank 1's mean)."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for fit in fits:
        rank0, rank1 = fit["ranks"][0], fit["ranks"][1]
        record = {"round": fit["round"], **{k: rank0[k] for k in FIGURES}, "rank1_step_mean_s": rank1["step_mean_s"]}
        record["own_threads_cpu_per_s"] = rank0.get("own_threads_cpu_per_s")  # None in runs before it was measured
        record["sched_per_step"] = rank0.get("sched_per_step")  # likewise
        out.setdefault((fit["mode"], fit["variant"]), []).append(record)
    return out


def summary(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        for variant in ALL_VARIANTS:
            records = by_cell.get((mode, variant))
            if not records:
                continue
            row: dict[str, Any] = {"mode": mode, "variant": variant, "rounds": len(records)}
            for name in (*FIGURES, "rank1_step_mean_s"):
                row[name] = spread([r[name] for r in records])
            rows.append(row)
    return rows


def median_interval(values: list[float], *, level: float = 0.9, resamples: int = 2000) -> list[float]:
    """A bootstrap interval (percentile, seeded) of the median of ``values``: how far the rounds pin it down."""
    rng = random.Random(1234)
    return percentiles([statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)], level)


def percentiles(draws: list[float], level: float) -> list[float]:
    """The central ``level`` interval of bootstrap draws: their (1 - level) / 2 and (1 + level) / 2 percentiles."""
    draws = sorted(draws)
    tail = (1.0 - level) / 2
    return [draws[int(tail * len(draws))], draws[min(len(draws) - 1, int((1.0 - tail) * len(draws)))]]


def ratio(num: list[dict[str, Any]], den: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Ratio of the medians over rounds; the per-round (paired) ratios' and differences' median [min, max].

    ``paired_interval``: a 90% bootstrap interval of the paired ratios' median.
    """
    of_medians = statistics.median(r[name] for r in num) / statistics.median(r[name] for r in den)
    by_round = {r["round"]: r[name] for r in den}
    pairs = [(r[name], by_round[r["round"]]) for r in num if r["round"] in by_round]
    return {
        "of_medians": of_medians,
        "paired": spread([a / b for a, b in pairs]) if pairs else None,
        "paired_interval": median_interval([a / b for a, b in pairs]) if pairs else None,
        "paired_difference_s": spread([a - b for a, b in pairs]) if pairs else None,
    }


def ratios(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        for a, b in RATIOS:
            num, den = by_cell.get((mode, a)), by_cell.get((mode, b))
            if not num or not den:
                continue
            row: dict[str, Any] = {"mode": mode, "ratio": f"{a} / {b}"}
            for name in (*FIGURES, "rank1_step_mean_s"):
                row[name] = ratio(num, den, name)
            out.append(row)
    return out


def targets(ratio_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``safe / stock <= 1.02`` per mode: on the mean step's ratio of medians (the target), and on thread CPU."""
    a, b, limit = TARGET
    out = []
    for row in ratio_rows:
        if row["ratio"] != f"{a} / {b}":
            continue
        wall, cpu = row["step_mean_s"], row["cpu_step_s"]
        out.append(
            {
                "mode": row["mode"],
                "target": f"{a} / {b} <= {limit:.2f}",
                "limit": limit,
                "wall": wall["of_medians"],
                "wall_paired": wall["paired"],
                "wall_paired_interval": wall.get("paired_interval"),
                "wall_added_s": wall["paired_difference_s"],
                "cpu_added_s": cpu["paired_difference_s"],
                "median_step": row["step_median_s"]["of_medians"],
                "cpu": cpu["of_medians"],
                "process_cpu": row["process_cpu_step_s"]["of_medians"],
                "met": wall["of_medians"] <= limit,
                "met_by_cpu": cpu["of_medians"] <= limit,
            }
        )
    return out


def per_value(by_cell: dict[tuple[str, str], list[dict[str, Any]]], logs: int) -> dict[str, Any] | None:
    """Training-thread CPU that safe adds per ``sync_dist`` value: per round, safe's paired CPU added over stock in
    ``sync_dist`` mode less that in ``nolog`` mode, over the values logged per step; median [min, max] of rounds."""
    added: dict[str, dict[int, float]] = {}
    for mode in MODES:
        stock = {r["round"]: r["cpu_step_s"] for r in by_cell.get((mode, "stock"), [])}
        added[mode] = {
            r["round"]: r["cpu_step_s"] - stock[r["round"]]
            for r in by_cell.get((mode, "safe"), [])
            if r["round"] in stock
        }
    rounds = sorted(set(added["sync_dist"]) & set(added["nolog"]))
    if not rounds:
        return None
    values = [(added["sync_dist"][r] - added["nolog"][r]) / logs for r in rounds]
    return {"logs": logs, "cpu_added_s": spread(values), "interval_s": median_interval(values)}


def own_cpu_per_step(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode, safe's own CPU per step without instrumentation: per round, its training thread's CPU added over
    stock's, plus its own threads' CPU per second times its mean step; median [min, max] of rounds (both parts too).
    """
    out: dict[str, Any] = {}
    for mode in MODES:
        stock = {r["round"]: r["cpu_step_s"] for r in by_cell.get((mode, "stock"), [])}
        safe = [r for r in by_cell.get((mode, "safe"), []) if r["round"] in stock]
        if not safe or any(r.get("own_threads_cpu_per_s") is None for r in safe):
            continue
        added = [r["cpu_step_s"] - stock[r["round"]] for r in safe]
        threads = [r["own_threads_cpu_per_s"] * r["step_mean_s"] for r in safe]
        out[mode] = {
            "total_s": spread([a + t for a, t in zip(added, threads, strict=True)]),
            "training_thread_added_s": spread(added),
            "own_threads_s": spread(threads),
        }
    return out


def step_breakdown(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (mode, variant), where rank 0's training thread spends a step: running (its CPU), runnable but waiting
    for its core (``runqueue_wait_s``), and asleep (the rest: waiting for gloo's peer, for the GIL, for a lock);
    its context switches per step. Median [min, max] over rounds; against stock, the paired difference of each."""
    rows = []
    for mode in MODES:
        stock = {r["round"]: r for r in by_cell.get((mode, "stock"), []) if r.get("sched_per_step")}
        for variant in ALL_VARIANTS:
            records = [r for r in by_cell.get((mode, variant), []) if r.get("sched_per_step")]
            if not records:
                continue
            parts = {r["round"]: breakdown_parts(r) for r in records}
            row: dict[str, Any] = {"mode": mode, "variant": variant}
            for name in BREAKDOWN:
                row[name] = spread([p[name] for p in parts.values()])
                pairs = [p[name] - breakdown_parts(stock[n])[name] for n, p in parts.items() if n in stock]
                row[f"{name}_added"] = spread(pairs) if pairs and variant != "stock" else None
            rows.append(row)
    return rows


BREAKDOWN = ("step_mean_s", "cpu_step_s", "runqueue_wait_s", "asleep_s", "voluntary_switches", "involuntary_switches")


def breakdown_parts(record: dict[str, Any]) -> dict[str, float]:
    """One fit's step by part (``step_breakdown``): the mean step = CPU + waiting for a core + asleep."""
    sched = record["sched_per_step"]
    return {
        "step_mean_s": record["step_mean_s"],
        "cpu_step_s": record["cpu_step_s"],
        "runqueue_wait_s": sched["runqueue_wait_s"],
        "asleep_s": record["step_mean_s"] - record["cpu_step_s"] - sched["runqueue_wait_s"],
        "voluntary_switches": sched["voluntary_switches"],
        "involuntary_switches": sched["involuntary_switches"],
    }


def by_run(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A pooled result's target ratio (safe / stock, mean step, ratio of medians) per mode in each of its runs.

    Rounds of one run share the machine's state of that hour, so the pooled rounds' interval understates the
    uncertainty: the runs' own ratios show the spread between runs.
    """
    out = []
    for index, source in enumerate(result.get("pooled_from") or [], start=1):
        fits = [f for f in result["fits"] if str(f["round"]).startswith(f"{index}.")]
        out.append({"run": source["run"], **{t["mode"]: t["wall"] for t in targets(ratios(cells(fits)))}})
    return out


def run_resampled_interval(
    result: dict[str, Any], mode: str, *, level: float = 0.9, resamples: int = 2000
) -> list[float] | None:
    """A pooled result's 90% interval of the paired safe / stock median (mean step) that resamples runs, then rounds
    within each drawn run (seeded): unlike ``paired_interval``, it lets the runs differ as they do.

    ``None`` unless the result pools two runs or more.
    """
    runs: dict[str, list[float]] = {}
    for index in range(1, len(result.get("pooled_from") or []) + 1):
        fits = [f for f in result["fits"] if str(f["round"]).startswith(f"{index}.") and f["mode"] == mode]
        by_cell = cells(fits)
        stock = {r["round"]: r["step_mean_s"] for r in by_cell.get((mode, "stock"), [])}
        runs[str(index)] = [
            r["step_mean_s"] / stock[r["round"]] for r in by_cell.get((mode, "safe"), []) if r["round"] in stock
        ]
    pairs = [ratios for ratios in runs.values() if ratios]
    if len(pairs) < 2:
        return None
    rng = random.Random(1234)
    medians = []
    for _ in range(resamples):
        drawn = [rng.choice(pairs) for _ in pairs]
        medians.append(statistics.median(v for run in drawn for v in rng.choices(run, k=len(run))))
    return percentiles(medians, level)


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    by_cell = cells(result["fits"])
    ratio_rows = ratios(by_cell)
    logs = int(result.get("config", {}).get("logs", 1))
    return {
        "by_run": by_run(result),
        "run_resampled_interval": {mode: run_resampled_interval(result, mode) for mode in MODES},
        "rows": summary(by_cell),
        "ratios": ratio_rows,
        "targets": targets(ratio_rows),
        "per_sync_dist_value": per_value(by_cell, logs),
        "own_cpu_per_step": own_cpu_per_step(by_cell),
        "step_breakdown": step_breakdown(by_cell),
    }


#: What a pooled run's parts must agree on: what each fit ran and how it was measured.
POOLED_CONFIG = ("variants", "warmup", "chunks", "chunk", "batch_size", "logs", "pin_cores", "safe_kwargs")


def pooled(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Several runs of one configuration as one result: their rounds side by side (round ``r`` of the ``i``-th run
    becomes ``"i.r"``, so every fit is still paired with the fits of its own round only).

    Args:
        runs: (name, results JSON) of each run, in order.

    Raises:
        ValueError: a run's configuration, safe_bare variant or environment differs from the first run's.
    """
    (first_name, first), out_fits, groups_all = runs[0], [], []

    def setting(result: dict[str, Any]) -> tuple[Any, ...]:
        config = result["config"]
        bare = config.get("bare_kwargs", BARE_KWARGS) if "safe_bare" in variants_of(config) else None
        return (
            *(config.get(name) for name in POOLED_CONFIG),
            bare,
            config.get("bare_unpinned", False),
            config.get("bare_recorder", False),
            config.get("bare_without_step_hooks", False),
            result["meta"].get("environment") or {},
        )

    for index, (name, result) in enumerate(runs):
        if setting(result) != setting(first):
            raise ValueError(
                f"{name} was not run as {first_name} was: {setting(result)} against {setting(first)}; pool only "
                "runs of one configuration"
            )
        out_fits += [{**fit, "round": f"{index + 1}.{fit['round']}"} for fit in result["fits"]]
        groups_all += result["groups"]
    return {
        "mode": "pooled",
        "pooled_from": [
            {"run": name, "date": r["meta"]["date"], "git": r["meta"]["git"], "rounds": r["config"]["rounds"]}
            for name, r in runs
        ],
        "meta": first["meta"],
        "config": {**first["config"], "rounds": sum(r["config"]["rounds"] for _, r in runs)},
        "groups": groups_all,
        "fits": out_fits,
    }


# ---------------------------------------------------------------------------------------------------- report
def us(value: float) -> str:
    return f"{value * 1e6:.0f}"


def us_spread(s: dict[str, float]) -> str:
    return f"{us(s['median'])} [{us(s['min'])}, {us(s['max'])}]"


def paired_text(p: dict[str, float] | None) -> str:
    return f"{p['median']:.3f} [{p['min']:.3f}, {p['max']:.3f}]" if p else "-"


def markdown(result: dict[str, Any], analysis: dict[str, Any]) -> str:
    meta, config = result["meta"], result["config"]
    ready = statistics.median(g["ready_seconds"] for g in result["groups"])
    chunks = statistics.median(g["chunks_seconds"] for g in result["groups"])
    loads = [load for g in result["groups"] for load in g["loadavg"]]
    timed = config["chunks"] * (config["chunk"] - 1)
    pinning = "rank r pinned to core r" if config.get("pin_cores", True) else "not pinned"
    sources = result.get("pooled_from")
    header = (
        f"Pooled: the {len(sources)} runs "
        + ", ".join(f"`{s['run']}` ({s['date']}, {s['git']}, {s['rounds']} rounds)" for s in sources)
        + f" side by side, each round paired within its own run; measured on {meta['machine']}; Python "
        f"{meta['python']}, torch {meta['torch']}, lightning {meta['lightning']}, ddp_strategy {meta['ddp_strategy']}; "
        f"1-minute load average {min(loads):.2f} to {max(loads):.2f} (median {statistics.median(loads):.2f}) at "
        "the start and end of the groups' timed chunks."
        if sources
        else f"Measured {meta['date']} ({result['mode']} mode, {meta['wall_seconds']:.0f} s) on {meta['machine']}; "
        f"Python {meta['python']}, torch {meta['torch']}, lightning {meta['lightning']}, ddp_strategy "
        f"{meta['ddp_strategy']} ({meta['git']}); 1-minute load average {meta['loadavg_start'][0]:.2f} at the start, "
        f"{meta['loadavg_end'][0]:.2f} at the end, {min(loads):.2f} to {max(loads):.2f} (median "
        f"{statistics.median(loads):.2f}) at the start and end of the groups' timed chunks."
    )
    lines = [
        header,
        "",
        f"{config['rounds']} rounds; per round and logging mode the {len(variants_of(config))} variants' "
        "`torchrun` jobs (2 ranks each, "
        f"gloo, CPU, one thread per rank, {pinning}) start together (median {ready:.1f} s until every rank is at "
        f"its first step, untimed), then take turns: a warm-up chunk of {config['warmup']} steps, "
        f"{config['chunks']} timed chunks of {config['chunk']} steps (the first step of each untimed: {timed} timed "
        f"steps per fit) and the closing step, in a new order at every pass (median {chunks:.1f} s per group). "
        f"Batch {config['batch_size']} per rank, MLP {SHAPE[0]}-{SHAPE[1]}-{SHAPE[2]}."
        + (f" The safe variant: `SafeDDPStrategy(**{config['safe_kwargs']!r})`." if config.get("safe_kwargs") else "")
        + (
            f" The safe_bare variant: `SafeDDPStrategy(**{config.get('bare_kwargs', BARE_KWARGS)!r})`"
            + (", gloo's worker threads without a kept Python thread state" if config.get("bare_unpinned") else "")
            + (", torch's Flight Recorder at the strategy's size" if config.get("bare_recorder") else "")
            + (
                ", `DDPStrategy`'s per-step methods instead of its own (`" + "`, `".join(STEP_HOOKS) + "`)"
                if config.get("bare_without_step_hooks")
                else ""
            )
            + "."
            if "safe_bare" in variants_of(config)
            else ""
        )
        + "".join(f" Every job ran with `{k}={v}`." for k, v in (result["meta"].get("environment") or {}).items()),
        "",
        "Per fit, rank 0: *mean* = time of the timed steps / their number, *median* = median step (a step's start "
        "to the next step's start), *CPU* = training thread CPU time per step, *process CPU* = all threads of the "
        "process per step; *rank 1 mean* = rank 1's mean. Cells: median over rounds [min, max], in microseconds.",
        "",
        "| mode | variant | mean (us) | median (us) | CPU (us) | process CPU (us) | rank 1 mean (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in analysis["rows"]:
        lines.append(
            f"| {row['mode']} | {LABELS[row['variant']]} | {us_spread(row['step_mean_s'])} | "
            f"{us_spread(row['step_median_s'])} | {us_spread(row['cpu_step_s'])} | "
            f"{us_spread(row['process_cpu_step_s'])} | {us(row['rank1_step_mean_s']['median'])} |"
        )
    lines += [
        "",
        "Ratios: *of medians* = median over rounds of one variant / the other's; *paired* = median [min, max] of "
        "the per-round ratios (fits of the same round, measured in alternating chunks).",
        "",
        "| mode | ratio | mean: of medians | mean: paired | median step: of medians | median step: paired "
        "| CPU: of medians | CPU: paired | process CPU | rank 1 mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in analysis["ratios"]:
        cols = [f"{r[n]['of_medians']:.3f} | {paired_text(r[n]['paired'])}" for n in FIGURES[:3]]
        lines.append(
            f"| {r['mode']} | {r['ratio']} | {' | '.join(cols)} | {r['process_cpu_step_s']['of_medians']:.3f} | "
            f"{r['rank1_step_mean_s']['of_medians']:.3f} |"
        )
    lines += [
        "",
        "Target (issue 30, point 3), judged on the mean step's ratio of medians; *by CPU*: the same on the "
        "training thread's CPU time; *added per step*: safe's figure minus stock's in the same round, median [min, "
        "max]:",
        "",
        "| mode | target | mean | mean: paired | mean: paired median, 90% interval | median step | CPU | process CPU "
        "| result | by CPU | added per step, paired (us): mean | CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in analysis["targets"]:
        interval = t.get("wall_paired_interval")
        lines.append(
            f"| {t['mode']} | {t['target']} | {t['wall']:.3f} | {paired_text(t['wall_paired'])} | "
            + (f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "-")
            + " | "
            f"{t['median_step']:.3f} | {t['cpu']:.3f} | {t['process_cpu']:.3f} | "
            f"{'met' if t['met'] else '**missed**'} | {'met' if t['met_by_cpu'] else '**missed**'} | "
            f"{us_spread(t['wall_added_s'])} | {us_spread(t['cpu_added_s'])} |"
        )
    runs = analysis.get("by_run") or []
    if runs:
        lines += ["", "The target's ratio in each run alone (rounds of one run share that hour's machine):", ""]
        for mode in MODES:
            values = [r[mode] for r in runs if mode in r]
            lines.append(
                f"- {mode}: " + ", ".join(f"{v:.3f}" for v in values) + f"; {sum(v <= TARGET[2] for v in values)} of "
                f"{len(values)} runs at most {TARGET[2]:.2f}, median {statistics.median(values):.3f}"
            )
        for mode, interval in (analysis.get("run_resampled_interval") or {}).items():
            if interval:
                lines.append(
                    f"- {mode}: the paired median's 90% interval resampling runs, then rounds within them: "
                    f"[{interval[0]:.3f}, {interval[1]:.3f}]"
                )
    own = analysis.get("own_cpu_per_step") or {}
    if own:
        lines += [
            "",
            "Safe's own CPU per step, uninstrumented (issue 30, point 1): per round, its training thread's CPU added "
            "over stock's (paired) plus its own threads' CPU (`ddp_strategy-*`, from `/proc`, over the timed chunks' "
            "window, per second of it) times its mean step; median [min, max] over rounds, in microseconds:",
            "",
            "| mode | own CPU per step | training thread, added | own threads |",
            "|---|---|---|---|",
        ]
        for mode, o in own.items():
            lines.append(
                f"| {mode} | {us_spread(o['total_s'])} | {us_spread(o['training_thread_added_s'])} | "
                f"{us_spread(o['own_threads_s'])} |"
            )
    breakdown = analysis.get("step_breakdown") or []
    if breakdown:
        lines += [
            "",
            "Where rank 0's training thread spends a step: *CPU* running, *waiting for a core* runnable but not "
            "running (its core busy with another thread), *asleep* the rest (waiting for gloo's peer, for the GIL, "
            "for a lock); its context switches per step; from `/proc/thread-self` at each timed chunk's ends. Cells: "
            "median over rounds [min, max], us; *vs stock*: the paired difference's median (same round).",
            "",
            "| mode | variant | mean (us) | CPU (us) | waiting for a core (us) | asleep (us) | voluntary switches "
            "| involuntary switches | vs stock: mean | CPU | waiting for a core | asleep | voluntary switches |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b in breakdown:
            added = [b[f"{n}_added"] for n in ("step_mean_s", "cpu_step_s", "runqueue_wait_s", "asleep_s")]
            switches = b["voluntary_switches_added"]
            lines.append(
                f"| {b['mode']} | {LABELS[b['variant']]} | "
                + " | ".join(us_spread(b[n]) for n in BREAKDOWN[:4])
                + " | "
                + " | ".join(f"{b[n]['median']:.2f} [{b[n]['min']:.2f}, {b[n]['max']:.2f}]" for n in BREAKDOWN[4:])
                + " | "
                + " | ".join(f"{a['median'] * 1e6:+.0f}" if a else "-" for a in added)
                + (f" | {switches['median']:+.2f} |" if switches else " | - |")
            )
    value = analysis.get("per_sync_dist_value")
    if value:
        (low, high), c = value["interval_s"], value["cpu_added_s"]
        lines += [
            "",
            f"Training-thread CPU safe adds per `sync_dist` value ({value['logs']} logged per step; per round, the "
            f"CPU added in sync_dist mode less that in nolog mode, over {value['logs']}): "
            f"{c['median'] * 1e6:.1f} [{c['min'] * 1e6:.1f}, {c['max'] * 1e6:.1f}] us, median [min, max]; "
            f"90% interval of the median [{low * 1e6:.1f}, {high * 1e6:.1f}] us.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of shorter fits")
    parser.add_argument("--rounds", type=int, help="rounds (default 10, quick 2)")
    parser.add_argument("--out", type=Path, help="results path, no suffix (default bench/results/tiny_step[-quick])")
    parser.add_argument("--chunks", type=int, help="timed chunks per fit (default 27, quick 9)")
    parser.add_argument("--chunk", type=int, help="steps per chunk, the first untimed (default 10)")
    parser.add_argument("--no-pin", action="store_true", help="leave the ranks' cores to the scheduler")
    parser.add_argument(
        "--logs", type=int, default=1, help="values each sync_dist step logs (default 1): > 1 gives the cost per value"
    )
    parser.add_argument(
        "--aa", action="store_true", help="a second stock fit instead of the raw loop: the method's noise (A/A)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=ALL_VARIANTS, help="the variants of each round (default raw stock safe)"
    )
    parser.add_argument(
        "--bare-kwargs",
        type=json.loads,
        help="diagnosis: JSON keyword arguments of the safe_bare variant (default: no background work)",
    )
    parser.add_argument(
        "--bare-unpinned",
        action="store_true",
        help="diagnosis: the safe_bare variant does not give gloo's worker threads a kept Python thread state",
    )
    parser.add_argument(
        "--bare-recorder",
        action="store_true",
        help="diagnosis: the safe_bare variant's jobs get torch's Flight Recorder at the strategy's size",
    )
    parser.add_argument(
        "--bare-without-step-hooks",
        action="store_true",
        help="diagnosis: the safe_bare variant runs DDPStrategy's per-step methods instead of its own (STEP_HOOKS)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds for a group's start-up, or one chunk")
    parser.add_argument("--report", type=Path, help="only redo the analysis and Markdown of this results JSON")
    parser.add_argument(
        "--pool", type=Path, nargs="+", help="analyse these results JSONs (one configuration) as one run, into --out"
    )
    parser.add_argument(
        "--safe-kwargs",
        type=json.loads,
        default={},
        help="diagnosis: JSON keyword arguments of the safe variant, e.g. '{\"heartbeat_interval\": 0}'",
    )
    worker_args = parser.add_argument_group("worker (one rank of one fit, started by torchrun)")
    worker_args.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_args.add_argument("--variant", choices=ALL_VARIANTS, help=argparse.SUPPRESS)
    worker_args.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    worker_args.add_argument("--baton", help=argparse.SUPPRESS)
    worker_args.add_argument("--prefix", help=argparse.SUPPRESS)
    worker_args.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report is not None:
        result = json.loads(args.report.read_text())
        result["analysis"] = analyse(result)
        args.report.write_text(json.dumps(result, indent=1))
        args.report.with_suffix(".md").write_text(markdown(result, result["analysis"]))
        return 0
    if args.pool:
        if args.out is None:
            parser.error("--pool needs --out")
        result = pooled([(path.stem, json.loads(path.read_text())) for path in args.pool])
        result["analysis"] = analyse(result)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result, result["analysis"]))
        return 0
    config = config_for(args.quick, args.rounds)
    config.update({name: getattr(args, name) for name in ("chunks", "chunk") if getattr(args, name) is not None})
    config["pin_cores"] = not args.no_pin
    if args.safe_kwargs:
        config["safe_kwargs"] = args.safe_kwargs
    if args.aa:
        config["variants"] = list(AA_VARIANTS)
    if args.variants:
        config["variants"] = list(args.variants)
    if args.bare_kwargs is not None:
        config["bare_kwargs"] = args.bare_kwargs
    if args.bare_unpinned:
        config["bare_unpinned"] = True
    if args.bare_recorder:
        config["bare_recorder"] = True
    if args.bare_without_step_hooks:
        config["bare_without_step_hooks"] = True
    if args.logs != 1:
        config["logs"] = args.logs
    out = args.out or RESULTS / ("tiny_step-quick" if args.quick else "tiny_step")
    started = time.monotonic()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {text}", flush=True)

    meta = metadata()
    # a recorder size set for the whole run (e.g. 0: torch's Flight Recorder off, and with it the desync monitor)
    meta["environment"] = {name: os.environ[name] for name in (RECORDER_SIZE_ENV,) if name in os.environ}
    records, fits = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tiny-step-") as tmp:
        runner = Runner(config, Path(tmp), args.timeout)
        for group in groups(config):
            starting = ", ".join(variants_of(config))
            log(f"round {group['round'] + 1}/{config['rounds']}, {group['mode']}: starting {starting}")
            record, group_fits = runner.run_group(group, log)
            records.append(record)
            fits += group_fits
    meta["loadavg_end"] = list(os.getloadavg())
    meta["wall_seconds"] = time.monotonic() - started
    result: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "meta": meta,
        "config": {**config, "world_size": WORLD_SIZE, "model": list(SHAPE), "launcher": "torchrun --standalone"},
        "groups": records,
        "fits": fits,
    }
    analysis = analyse(result)
    result["analysis"] = analysis
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result, analysis)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"Wrote {out}.json, .md in {meta['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
