"""One benchmark job: train every variant of a workload in the same processes, interleaved step by step.

Started by ``bench/suite.py`` (it works by hand too):

    torchrun --standalone --nproc-per-node W bench/workloads/run.py --plan PLAN.json --out OUT   # steady state
    python bench/workloads/run.py --plan PLAN.json --out OUT    # cold start: one Lightning fit, Lightning's launcher

Variants (the same model, data, batch size, seed and number of steps):

* ``raw``: a plain PyTorch loop: ``DistributedDataParallel`` over gloo, ``DistributedSampler``, no Lightning code
  in the loop (only under torchrun).
* ``stock``: Lightning's ``DDPStrategy``.
* ``safe``: ``SafeDDPStrategy()`` with its defaults (handshake, heartbeat thread, monitored barriers).
* ``safe_all``: ``SafeDDPStrategy()`` plus every callback at its defaults: ``WeightSyncCheck`` (every 100 steps),
  ``HangWatchdog``, ``StragglerMonitor`` (every 50 steps).
* ``safe_ws`` / ``safe_straggler``: ``SafeDDPStrategy()`` plus ``WeightSyncCheck()`` / ``StragglerMonitor()`` only.

Workloads:

* ``cifar``: the CIFAR-10 example's ``CIFAR10Classifier`` (its own ``training_step`` and ``configure_optimizers``:
  AdamW, one-cycle schedule, accuracy metric) on real CIFAR-10 when the example's data module finds it (else its
  synthetic stand-in; the JSON says which). The images are decoded and normalised once into an in-memory float
  tensor, without augmentation, so the data path is the same cheap tensor indexing for every variant.
* ``mlp``: a 25.6M-parameter MLP regressing its input (synthetic tensors), SGD with momentum: little compute per
  parameter, so the gradient all-reduce (102 MB per step) matters.

Lock-step interleaving (steady state, under torchrun): a group runs one thread per variant, and a baton lets
exactly one thread run at a time, in the group's order (the same on every rank): variant A trains one step, then
B one step, ..., then A its next step. Between two turns the ranks meet at a barrier on a separate gloo group
(untimed), so every turn starts on all ranks together, as a step of a real run does. A variant's step time is the
wall time of its own turn: from getting the baton to the end of its step (``on_train_batch_end`` of the last
callback, or after ``scheduler.step()`` in the raw loop). Adjacent steps of different variants therefore see the
same machine load, which a shared 2-core machine changes from second to second.

Per fit the JSON holds: the mean step time over the timed window (steps ``warmup + 1 .. warmup + timed``), the
thread CPU time per step, the median step, the start-up turn (thread start, i.e. the ``fit`` call, to the end of
the first step: strategy set-up, DDP wrap, handshake, first step), the handshake, and the periodic checks inside
the window with their measured cost. When the window holds fewer periodic checks than its length implies (a
window shorter than the period), ``amortized_step_s`` adds the missing ones at their measured cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

IMPORT_START = time.time()

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from ddp_strategy import SafeDDPStrategy  # noqa: E402
from ddp_strategy._compat.torch import collective_trace_enabled  # noqa: E402
from ddp_strategy.callbacks import HangWatchdog, StragglerMonitor, WeightSyncCheck  # noqa: E402
from ddp_strategy.desync import TRACE_ENTRIES  # noqa: E402
from examples.cifar10.data import CIFAR10_MEAN, CIFAR10_STD, DEFAULT_DATA_DIR, CIFAR10DataModule  # noqa: E402
from examples.cifar10.model import CIFAR10Classifier, one_cycle_factor  # noqa: E402

IMPORTED = time.time()

VARIANTS = ("raw", "stock", "safe", "safe_all", "safe_ws", "safe_straggler")
WORKLOADS = ("cifar", "mlp")
MLP_SHAPE = (1024, 2600, 4)  # input/output width, hidden width, hidden layers: 25.6M parameters
# WeightSyncCheck() with no exclusions stops the CIFAR example at step 100 with a false RankDivergenceError: DDP
# (broadcast_buffers=True) copies rank 0's BatchNorm statistics at the start of each forward, then every rank
# updates them with its own batch, so at a step's end they differ by design. The documented `exclude` option skips
# them; every other setting stays at its default.
WEIGHT_SYNC_EXCLUDE = {"cifar": ("*.running_mean", "*.running_var"), "mlp": ()}


# ---------------------------------------------------------------------------------------------------- workloads
class MLP(pl.LightningModule):
    """A plain MLP that regresses its input; a LightningModule so the Lightning variants can train it."""

    def __init__(self, width: int = MLP_SHAPE[0], hidden: int = MLP_SHAPE[1], layers: int = MLP_SHAPE[2]) -> None:
        super().__init__()
        mods: list[nn.Module] = [nn.Linear(width, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            mods += [nn.Linear(hidden, hidden), nn.ReLU()]
        mods.append(nn.Linear(hidden, width))
        self.net = nn.Sequential(*mods)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = (self(batch[0]) - batch[0]).pow(2).mean()
        self.log("loss_synced", loss.detach(), sync_dist=True)  # one synced value per step (issue 15's workload)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_mlp_optimizer(self)


class SyncedCIFAR10Classifier(CIFAR10Classifier):
    """The CIFAR-10 example, which also logs its loss with ``sync_dist=True`` every step (issue 15's workload)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss_synced", loss.detach(), sync_dist=True)
        return loss


def sync_like_lightning(loss: Tensor) -> None:
    """What ``self.log(..., sync_dist=True)`` does on every rank (Lightning's ``_sync_ddp``), for the raw loop."""
    value = loss.detach().clone()
    dist.barrier()
    dist.all_reduce(value)


def make_mlp_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def cifar_tensors(samples: int, seed: int) -> tuple[Tensor, Tensor, str]:
    """The first ``samples`` CIFAR-10 training images (the example's seeded subset), normalised once."""
    dm = CIFAR10DataModule(data_dir=DEFAULT_DATA_DIR, train_samples=samples, seed=seed)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None
    images = dm.train_set.images.float().div_(255)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    return images.sub_(mean).div_(std).contiguous(), dm.train_set.labels.clone(), dm.source


class Data:
    """The in-memory data sets of the plan's workloads, built once per process (the same on every rank)."""

    def __init__(self, plan: dict[str, Any], world: int) -> None:
        self.sets: dict[str, TensorDataset] = {}
        self.sources: dict[str, str] = {}
        for workload in sorted({group["workload"] for group in plan["groups"]}):
            steps = max(g["warmup"] + g["timed"] + 1 for g in plan["groups"] if g["workload"] == workload)
            samples = steps * plan["batch_size"][workload] * world
            if workload == "cifar":
                images, labels, source = cifar_tensors(max(samples, 1000), plan["seed"])
                self.sets[workload] = TensorDataset(images, labels)
                self.sources[workload] = source
            else:
                generator = torch.Generator().manual_seed(plan["seed"])
                self.sets[workload] = TensorDataset(torch.randn(samples, MLP_SHAPE[0], generator=generator))
                self.sources[workload] = "synthetic (random normal tensors)"


# ---------------------------------------------------------------------------------------------------- lock step
class Baton:
    """Lets one fit thread run at a time, round-robin in a fixed order; every rank follows the same order."""

    def __init__(self, names: list[str], group: Any) -> None:
        self.active = list(names)
        self.turn = 0
        self.cond = threading.Condition()
        self.group = group  # gloo group for the barrier between turns (None: one rank)
        self.failed: BaseException | None = None

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.failed is not None or self.active[self.turn] == name)
            if self.failed is not None:
                raise RuntimeError("another variant's thread failed") from self.failed

    def _sync(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def pass_on(self, name: str) -> None:
        self._sync()
        with self.cond:
            self.turn = (self.active.index(name) + 1) % len(self.active)
            self.cond.notify_all()

    def leave(self, name: str, error: BaseException | None = None) -> None:
        if error is None:
            self._sync()
        with self.cond:
            if error is not None:
                self.failed = error
            index = self.active.index(name)
            self.active.remove(name)
            if self.active:
                self.turn = index % len(self.active)
            self.cond.notify_all()


class Clock:
    """The turns of one variant's thread: when each started, and when each step ended (wall and thread CPU)."""

    def __init__(self, baton: Baton | None, name: str) -> None:
        self.baton = baton
        self.name = name
        self.turn_start = time.perf_counter()
        self.turn_cpu = time.thread_time()
        self.step_s: list[float] = []  # own wall time of each step (its turn)
        self.cpu_s: list[float] = []
        self.train_start: float | None = None  # perf_counter at on_train_start (before the handshake)
        self.fit_start = self.turn_start
        self.first_step_wall: float | None = None  # time.time() at the end of the first step

    def begin(self) -> None:
        if self.baton is not None:
            self.baton.wait(self.name)
        self.turn_start = self.fit_start = time.perf_counter()
        self.turn_cpu = time.thread_time()

    def step_end(self) -> None:
        self.step_s.append(time.perf_counter() - self.turn_start)
        self.cpu_s.append(time.thread_time() - self.turn_cpu)
        if self.first_step_wall is None:
            self.first_step_wall = time.time()
        if self.baton is not None:
            self.baton.pass_on(self.name)
            self.baton.wait(self.name)
        self.turn_start = time.perf_counter()
        self.turn_cpu = time.thread_time()

    def startup(self) -> dict[str, Any]:
        """The start-up figures alone (an untimed warm-up fit)."""
        return {
            "steps": len(self.step_s),
            "startup_turn_s": self.step_s[0] if self.step_s else None,
            "first_step_wall": self.first_step_wall,
        }

    def summary(self, warmup: int, timed: int) -> dict[str, Any]:
        steps = self.step_s
        if len(steps) < warmup + timed:
            raise RuntimeError(f"{self.name}: only {len(steps)} steps ran, expected {warmup + timed}")
        window = steps[warmup : warmup + timed]
        cpu = self.cpu_s[warmup : warmup + timed]
        ordered = sorted(window)
        return {
            "steps": len(steps),
            "mean_step_s": sum(window) / timed if timed else None,
            "cpu_step_s": sum(cpu) / timed if timed else None,
            "median_step_s": ordered[len(ordered) // 2] if ordered else None,
            "max_step_s": ordered[-1] if ordered else None,
            "startup_turn_s": steps[0],  # fit call (thread start) to the end of the first step
            "first_step_s": steps[0] - (self.train_start - self.fit_start) if self.train_start is not None else None,
            "first_step_wall": self.first_step_wall,
            "window_step_s": [round(x, 6) for x in window],
        }


class StepClock(Callback):
    """Ends a turn at every step's end; it must be the last callback so the others' batch-end work is inside."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.train_start = time.perf_counter()  # callbacks run before the strategy's hook (the handshake)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.clock.step_end()


class Timed:
    """Time a callback's ``on_train_batch_end`` (wall and thread CPU) at the steps where it does periodic work."""

    def __init__(self, callback: Callback, every: int, label: str) -> None:
        self.callback, self.every, self.label = callback, every, label
        self.costs: dict[int, tuple[float, float]] = {}  # global step -> (wall s, CPU s) of the hook at that step
        self.after_fit: tuple[float, float] | None = None
        original: Callable[..., None] = callback.on_train_batch_end

        def hook(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            start, cpu = time.perf_counter(), time.thread_time()
            original(trainer, *args, **kwargs)
            if trainer.global_step % every == 0:
                self.costs[trainer.global_step] = (time.perf_counter() - start, time.thread_time() - cpu)

        callback.on_train_batch_end = hook  # type: ignore[method-assign]

    def in_window(self, warmup: int, timed: int) -> int:
        return sum(1 for step in self.costs if warmup < step <= warmup + timed)

    def measure_once(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """One more periodic action, timed, after the last step (for a window shorter than the period)."""
        dist.barrier()  # start together on every rank, as inside training (the other ranks' tails are not counted)
        start, cpu = time.perf_counter(), time.thread_time()
        if isinstance(self.callback, WeightSyncCheck):
            self.callback.check(trainer, pl_module)
        elif isinstance(self.callback, StragglerMonitor):
            self.callback._compare(trainer, trainer.global_step)
        self.after_fit = (time.perf_counter() - start, time.thread_time() - cpu)


def periodic(timers: list[Timed], warmup: int, timed: int) -> dict[str, Any]:
    """The periodic actions inside the window, their measured cost, and how many the window length implies."""
    result: dict[str, Any] = {}
    for timer in timers:
        samples = list(timer.costs.values()) or ([timer.after_fit] if timer.after_fit is not None else [])
        result[timer.label] = {
            "every_n_steps": timer.every,
            "in_window": timer.in_window(warmup, timed),
            "expected_in_window": timed / timer.every,
            "cost_s": sum(s[0] for s in samples) / len(samples) if samples else None,
            "cpu_cost_s": sum(s[1] for s in samples) / len(samples) if samples else None,
            "costs_s": [round(s[0], 6) for s in timer.costs.values()],
            "after_fit_s": None if timer.after_fit is None else round(timer.after_fit[0], 6),
        }
    return result


def amortized(value: float, checks: dict[str, Any], timed: int, key: str = "cost_s") -> float:
    """``value`` (a window mean) plus the periodic actions the window is short of, at their measured cost."""
    for info in checks.values():
        missing = info["expected_in_window"] - info["in_window"]
        if missing > 0 and info[key] is not None:
            value += missing * info[key] / timed
    return value


# ---------------------------------------------------------------------------------------------------- variants
def seed_all(seed: int) -> None:
    pl.seed_everything(seed, workers=True, verbose=False)


def lightning_fit(group: dict[str, Any], variant: str, ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    workload, warmup, timed = group["workload"], group["warmup"], group["timed"]
    plan = ctx["plan"]
    seed_all(plan["seed"])
    model: pl.LightningModule = SyncedCIFAR10Classifier() if workload == "cifar" else MLP()
    loader = DataLoader(ctx["data"].sets[workload], batch_size=plan["batch_size"][workload], shuffle=True)
    strategy: DDPStrategy = DDPStrategy() if variant == "stock" else SafeDDPStrategy()
    exclude = WEIGHT_SYNC_EXCLUDE[workload]
    callbacks: list[Callback] = {
        "stock": [],
        "safe": [],
        "safe_all": [WeightSyncCheck(exclude=exclude), HangWatchdog(), StragglerMonitor()],
        "safe_ws": [WeightSyncCheck(exclude=exclude)],
        "safe_straggler": [StragglerMonitor()],
    }[variant]
    timers = [
        Timed(cb, cb.every_n_steps, "weight_sync" if isinstance(cb, WeightSyncCheck) else "straggler")
        for cb in callbacks
        if isinstance(cb, (WeightSyncCheck, StragglerMonitor))
    ]

    class AfterFit(Callback):
        """Before the other callbacks' on_train_end: time one periodic action the window is short of."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for timer in timers:
                if timed and timer.in_window(warmup, timed) < timed / timer.every:
                    timer.measure_once(trainer, pl_module)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ctx["devices"],
        num_nodes=1,
        strategy=strategy,
        max_steps=warmup + timed,
        max_epochs=1,
        callbacks=[AfterFit(), *callbacks, StepClock(clock)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(Path(ctx["tmp"]) / f"{group['workload']}-{group['round']}-{variant}"),
    )
    trainer.fit(model, loader)
    result = clock.summary(warmup, timed) if timed else clock.startup()
    result["handshake_s"] = getattr(trainer.strategy, "last_handshake_seconds", None)
    if timed:
        checks = periodic(timers, warmup, timed)
        result["periodic"] = checks
        result["amortized_step_s"] = amortized(result["mean_step_s"], checks, timed)
        result["amortized_cpu_step_s"] = amortized(result["cpu_step_s"], checks, timed, key="cpu_cost_s")
    return result


def raw_fit(group: dict[str, Any], ctx: dict[str, Any], clock: Clock) -> dict[str, Any]:
    """The floor: the same model, data, sampler, optimizer and schedule in a plain PyTorch DDP loop."""
    workload, warmup, timed = group["workload"], group["warmup"], group["timed"]
    plan = ctx["plan"]
    steps = warmup + timed
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_all(plan["seed"])
    if workload == "cifar":
        model: nn.Module = CIFAR10Classifier()
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-3,
            betas=(0.9, 0.999),
        )
        scheduler: Any = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: one_cycle_factor(step, steps, pct_start=0.25)
        )
    else:
        model = MLP()
        optimizer = make_mlp_optimizer(model)
        scheduler = None
    dataset = ctx["data"].sets[workload]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=plan["seed"])
    sampler.set_epoch(0)
    loader = DataLoader(dataset, batch_size=plan["batch_size"][workload], sampler=sampler)
    model.train()
    ddp = DistributedDataParallel(model)
    clock.train_start = time.perf_counter()
    for done, batch in enumerate(loader, start=1):
        if workload == "cifar":
            images, labels = batch
            logits = ddp(images)
            loss = F.cross_entropy(logits, labels)
            model.train_acc(logits, labels)  # the example's training_step updates its accuracy metric too
        else:
            loss = (ddp(batch[0]) - batch[0]).pow(2).mean()
        # Between forward and backward, as Lightning's automatic optimization does. (At the top of the loop it cost
        # the MLP 20-40 ms more per step here: page faults re-allocating the 102 MB of gradients after the forward.)
        optimizer.zero_grad(set_to_none=True)
        sync_like_lightning(loss)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        clock.step_end()
        if done >= steps:
            break
    result = clock.summary(warmup, timed) if timed else clock.startup()
    result["handshake_s"] = None
    if timed:
        result["periodic"] = {}
        result["amortized_step_s"] = result["mean_step_s"]
        result["amortized_cpu_step_s"] = result["cpu_step_s"]
    return result


def run_group(group: dict[str, Any], ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Train the group's variants in lock step (one thread each, one turn at a time)."""
    variants: list[str] = group["variants"]
    world = ctx["world"]
    baton = Baton(variants, ctx["baton_group"] if world > 1 else None)
    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def body(variant: str) -> None:
        clock = Clock(baton, variant)
        try:
            clock.begin()
            if variant == "raw":
                results[variant] = raw_fit(group, ctx, clock)
            else:
                results[variant] = lightning_fit(group, variant, ctx, clock)
        except BaseException as err:
            traceback.print_exc()
            errors.append(err)
            baton.leave(variant, err)
            return
        baton.leave(variant)

    threads = [threading.Thread(target=body, args=(v,), name=f"bench-{v}") for v in variants]
    # The cyclic garbage collector would make whichever variant happens to trigger it pay for every variant's
    # objects; it is paused during the group and run between groups (reference counting still frees the rest).
    gc.collect()
    gc.disable()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.enable()
        gc.collect()
    if errors:
        raise RuntimeError(f"group {group} failed") from errors[0]
    return [
        {"workload": group["workload"], "round": group["round"], "record": group["record"], "variant": v,
         "position": i, "warmup": group["warmup"], "timed": group["timed"], "world_size": world, **results[v]}
        for i, v in enumerate(variants)
    ]  # fmt: skip


def cold_start(plan: dict[str, Any], ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """One Lightning fit in the main thread, launched by Lightning's own launcher (no lock step)."""
    (group,) = plan["groups"]
    (variant,) = group["variants"]
    clock = Clock(None, variant)
    clock.begin()
    result = lightning_fit(group, variant, ctx, clock)
    result["first_step_wall"] = clock.first_step_wall
    return [{"workload": group["workload"], "round": group["round"], "record": True, "variant": variant, **result}]


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="JSON plan written by bench/suite.py")
    parser.add_argument("--out", required=True, help="each rank writes OUT.rank<R>.json")
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun and plan.get("pin_cores", True) and hasattr(os, "sched_setaffinity"):
        # One core per rank, as the scheduler places two busy single-threaded rank processes. Without it, the variant
        # thread that wakes up for its turn is sometimes placed on the core where the other rank is running, and
        # a whole fit runs slower for it. Threads started later (gloo, heartbeat) inherit the mask.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    if torchrun:
        # torch's Flight Recorder, as SafeDDPStrategy turns it on for its own group (its desync detection reads it);
        # it records every variant's collectives alike (measured: no cost per call above noise, docs/architecture.md)
        with collective_trace_enabled(TRACE_ENTRIES):
            dist.init_process_group("gloo")  # before any fit, so no timed fit pays for the default process group
        world = dist.get_world_size()
        ctx: dict[str, Any] = {"devices": int(os.environ["LOCAL_WORLD_SIZE"]), "world": world}
        ctx["baton_group"] = dist.new_group(backend="gloo") if world > 1 else None
    else:
        ctx = {"devices": plan["world_size"], "world": plan["world_size"], "baton_group": None}
    ctx["plan"] = plan
    pg_ready = time.time()
    ctx["data"] = Data(plan, ctx["world"])
    data_ready = time.time()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        ctx["tmp"] = tmp
        if torchrun:
            for group in plan["groups"]:
                results += run_group(group, ctx)
        else:
            results = cold_start(plan, ctx)
    rank = dist.get_rank() if dist.is_initialized() else 0
    payload = {
        "rank": rank,
        "launcher": "torchrun" if torchrun else "lightning-subprocess",
        "world_size": ctx["world"],
        "threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "launch_time": plan.get("launch_time"),
        "import_start": IMPORT_START,
        "imported": IMPORTED,
        "process_group_ready": pg_ready,
        "data_ready": data_ready,
        "data_sources": ctx["data"].sources,
        "fits": results,
    }
    out = Path(f"{args.out}.rank{rank}.json")
    out.with_suffix(".tmp").write_text(json.dumps(payload))
    out.with_suffix(".tmp").replace(out)
    if torchrun:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
