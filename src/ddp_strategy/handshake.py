"""The start-up handshake: every rank's facts, gathered once and compared on every rank.

:func:`collect_facts` describes this rank (host, device, versions, world size, seed, and a fingerprint of every
parameter and buffer). The strategy gathers the facts of all ranks in one small collective on the control plane
and calls :func:`check_facts` on every rank, so every rank raises the same error:

* :class:`~ddp_strategy.errors.DuplicateDeviceError` when two ranks share one accelerator;
* :class:`~ddp_strategy.errors.SetupMismatchError` when versions, world size, the strategy options every rank must
  be given alike, or tensor names/shapes differ;
* :class:`~ddp_strategy.errors.RankDivergenceError` when parameter or buffer values differ.

:func:`seed_report` then warns when the global seed (``PL_GLOBAL_SEED``) differs between ranks, when the training
``DistributedSampler`` seed differs between ranks (the shards overlap), or when the sampler seed differs from the
global seed; :func:`seed_summary` is the one info line for when they all agree.
"""

from __future__ import annotations

import math
import os
import platform
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ._compat.lightning import NAMESPACE, training_dataloaders
from ._compat.lightning import VERSION as LIGHTNING_VERSION
from .errors import DuplicateDeviceError, RankDivergenceError, SetupMismatchError
from .fingerprint import TensorFingerprint, fingerprint_module
from .options import default_option_text
from .positions import format_ranks

__all__ = [
    "RankFacts",
    "check_devices",
    "check_facts",
    "check_setup",
    "check_training_batches",
    "collect_facts",
    "compare_training_batches",
    "sampler_seeds",
    "seed_report",
    "seed_summary",
    "train_sampler_seeds",
]

_MAX_LISTED = 5  # differing tensors named in one message


@dataclass(frozen=True)
class RankFacts:
    """What one rank knows about its own set-up.

    Attributes:
        rank: global rank.
        local_rank: rank within the node.
        node_rank: index of the node.
        host: host name.
        pid: process id.
        device: the rank's root device, e.g. ``"cuda:0"`` or ``"cpu"``.
        device_id: a machine-wide identity of an accelerator (the CUDA UUID when available), used to find
            two ranks on one physical device even when ``CUDA_VISIBLE_DEVICES`` renumbers devices; ``None`` on
            the CPU, which ranks may share.
        versions: library versions (``python``, ``torch``, ``lightning``, ``ddp_strategy``).
        world_size: the world size this rank was configured with.
        seed: the global seed (``PL_GLOBAL_SEED``) or ``None`` when not seeded.
        tensors: fingerprints of every parameter and buffer, in registration order.
        sampler_seeds: the seeds of the shuffling ``DistributedSampler`` of each training dataloader; ``None`` when
            not known (no training dataloader yet, or none passed to :func:`collect_facts`), ``()`` when the
            training dataloaders have no shuffling ``DistributedSampler``.
        training_batches: the training batches this rank runs per epoch (after ``limit_train_batches``);
            ``inf`` for an iterable of unknown length, ``None`` when not training.
        options: the strategy options every rank must be given alike, as text
            (:func:`~ddp_strategy.options.options_to_agree`).

    """

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    device_id: str | None
    versions: dict[str, str]
    world_size: int
    seed: str | None
    tensors: tuple[TensorFingerprint, ...] = field(default=())
    sampler_seeds: tuple[int, ...] | None = None
    training_batches: float | None = None
    options: dict[str, str] = field(default_factory=dict)


def _package_version() -> str:
    try:
        return metadata.version("ddp_strategy")
    except metadata.PackageNotFoundError:  # running from a source tree without installation
        return "unknown"


def _device_id(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            return f"cuda-uuid:{uuid}"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"cuda:{index}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    return str(device)


def collect_facts(
    *,
    rank: int,
    local_rank: int,
    node_rank: int,
    world_size: int,
    device: torch.device,
    module: nn.Module | None,
    sampler_seeds: Sequence[int] | None = None,
    training_batches: float | None = None,
    options: Mapping[str, str] | None = None,
) -> RankFacts:
    """Describe this rank. Fingerprints are computed on ``device``; only a few integers per tensor leave it.

    ``module=None`` collects everything but the tensor fingerprints (used for the early device check).
    ``sampler_seeds`` are the training ``DistributedSampler`` seeds (see :func:`train_sampler_seeds`), or ``None``
    when unknown; ``training_batches`` is ``trainer.num_training_batches`` when training starts; ``options`` are the
    strategy options every rank must be given alike (``SafeDDPStrategy.agreed_options``).
    """
    return RankFacts(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=str(device),
        device_id=_device_id(device),
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            NAMESPACE: LIGHTNING_VERSION,
            "ddp_strategy": _package_version(),
        },
        world_size=world_size,
        seed=os.environ.get("PL_GLOBAL_SEED"),
        tensors=tuple(fingerprint_module(module)) if module is not None else (),
        sampler_seeds=tuple(int(s) for s in sampler_seeds) if sampler_seeds is not None else None,
        training_batches=float(training_batches) if training_batches is not None else None,
        options=dict(options or {}),
    )


def sampler_seeds(dataloaders: Iterable[object]) -> tuple[int, ...]:
    """The seeds of the shuffling ``DistributedSampler`` of ``dataloaders``.

    Also under a custom batch sampler, or inside a sampler that keeps it as ``.sampler`` (the mid-epoch resume's
    ``ResumeSampler``). Samplers with ``shuffle=False`` are left out: their seed has no effect.
    """
    seeds: list[int] = []
    for dataloader in dataloaders:
        if not isinstance(dataloader, DataLoader):
            continue
        sampler = getattr(dataloader.batch_sampler, "sampler", None)
        if sampler is None:
            sampler = dataloader.sampler
        sampler = _unwrapped(sampler)
        if isinstance(sampler, DistributedSampler) and sampler.shuffle:
            seeds.append(int(sampler.seed))
    return tuple(seeds)


def _unwrapped(sampler: object, depth: int = 8) -> object:
    """The sampler inside wrappers that keep it as ``.sampler`` (``ResumeSampler`` on a mid-epoch resume)."""
    for _ in range(depth):
        inner = getattr(sampler, "sampler", None)
        if isinstance(sampler, DistributedSampler) or inner is None or inner is sampler:
            break
        sampler = inner
    return sampler


def train_sampler_seeds(trainer: object | None) -> tuple[int, ...] | None:
    """:func:`sampler_seeds` of ``trainer``'s training dataloaders, ``None`` before they are loaded (or no trainer).

    Args:
        trainer: a ``lightning.pytorch.Trainer`` (typed loosely so that a strategy can pass
            ``self.lightning_module._trainer`` as is).

    """
    dataloaders = training_dataloaders(trainer)
    if not dataloaders:
        return None
    return sampler_seeds(dataloaders)


def check_facts(facts: Sequence[RankFacts]) -> None:
    """Compare all ranks' facts; raise the first problem found, as the same error on every rank.

    Args:
        facts: one entry per rank, in rank order (as returned by an all-gather).

    Raises:
        DuplicateDeviceError: two ranks on the same accelerator device.
        SetupMismatchError: versions, world size, the strategy options, or tensor names/shapes/dtypes differ
            between ranks.
        RankDivergenceError: parameter or buffer values differ between ranks.

    """
    check_devices(facts)
    check_setup(facts)
    _check_tensor_signatures(facts)
    _check_tensor_values(facts)


def check_training_batches(facts: Sequence[RankFacts]) -> str | None:
    """Find ranks that would run different numbers of training steps per epoch (known lengths only).

    DDP all-reduces gradients at every step, so a rank with more batches than another waits forever in its extra
    step (or silently pairs it with the other rank's next epoch). Unknown lengths (an iterable dataset) are not
    compared here.

    Args:
        facts: one entry per rank, in rank order.

    Returns:
        The message of the :class:`~ddp_strategy.errors.UnevenInputsError` to raise (or warn with), or ``None``
        when the counts agree or are not all known.

    """
    return compare_training_batches([f.training_batches for f in facts])


def compare_training_batches(counts: Sequence[float | None], *, epoch: int | None = None) -> str | None:
    """Compare the ranks' training batch counts (``trainer.num_training_batches``), when all are known.

    Args:
        counts: one count per rank, in rank order; ``inf`` (an iterable of unknown length) or ``None`` (not
            training) on any rank skips the comparison.
        epoch: the epoch whose reloaded training dataloader gave these counts (the message then names it and the
            reload); ``None`` for the counts at the start of training.

    Returns:
        The message of the :class:`~ddp_strategy.errors.UnevenInputsError` to raise (or warn with), or ``None``
        when the counts agree or are not all known.

    """
    known = [c for c in counts if c is not None and not math.isinf(c)]
    if len(known) < len(counts) or len(set(known)) <= 1:
        return None
    table = "; ".join(
        f"{int(count)} on rank(s) {format_ranks(ranks)}"
        for count, ranks in sorted(_group_numbers(dict(enumerate(known))).items(), reverse=True)
    )
    fewest = int(min(known))
    if epoch is None:
        return (
            f"Ranks have different numbers of training batches per epoch: {table}. DDP all-reduces gradients at "
            f"every step, so the ranks with more batches would wait forever in step {fewest + 1} for the others "
            "(or pair it with their next epoch's first step). Give every rank the same number of batches: keep "
            "Lightning's DistributedSampler (Trainer(use_distributed_sampler=True), the default), or with your own "
            "sharding split the data evenly (DistributedSampler(drop_last=True) drops the remainder), or set "
            f"Trainer(limit_train_batches={fewest})."
        )
    return (
        f"Ranks have different numbers of training batches in epoch {epoch}, after the training dataloader was "
        f"reloaded (Trainer(reload_dataloaders_every_n_epochs=...)): {table}. DDP all-reduces gradients at every "
        f"step, so the ranks with more batches would wait forever in step {fewest + 1} of epoch {epoch} for the "
        "others (or pair it with their next epoch's first step). `train_dataloader()` ran again for this epoch and "
        "built shards of different sizes (for example from `self.current_epoch`, or from data that changed). "
        "Give every rank the same number of batches in every epoch: keep Lightning's DistributedSampler "
        "(Trainer(use_distributed_sampler=True), the default), or split each epoch's data evenly "
        "(DistributedSampler(drop_last=True) drops the remainder), or set Trainer(limit_train_batches=N) to at "
        f"most the smallest count of any epoch ({fewest} here)."
    )


def _group_numbers(values: dict[int, float]) -> dict[float, list[int]]:
    groups: dict[float, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return groups


def check_devices(facts: Sequence[RankFacts]) -> None:
    """Raise :class:`DuplicateDeviceError` when two ranks of one host share an accelerator device."""
    owners: dict[tuple[str, str], list[RankFacts]] = {}
    for f in facts:
        if f.device_id is not None:
            owners.setdefault((f.host, f.device_id), []).append(f)
    for (host, _), sharing in owners.items():
        if len(sharing) > 1:
            ranks = [f.rank for f in sharing]
            who = ", ".join(f"rank {f.rank} (local rank {f.local_rank}, pid {f.pid})" for f in sharing)
            device = sharing[0].device
            raise DuplicateDeviceError(
                f"{len(sharing)} ranks were placed on the same device {device} of host '{host}': {who}. "
                "DDP needs one device per rank (NCCL reports this as 'Duplicate GPU detected'). Start one "
                "process per device: set Trainer(devices=N) to the number of GPUs per node and do not give two "
                "processes the same CUDA_VISIBLE_DEVICES or LOCAL_RANK. For model parallelism inside one rank, "
                "each rank needs its own set of devices.",
                device=device,
                host=host,
                ranks=ranks,
            )


def _group(values: dict[int, str]) -> list[tuple[str, list[int]]]:
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def _table(rows: list[tuple[str, list[tuple[str, list[int]]]]]) -> str:
    width_field = max([len("field")] + [len(name) for name, _ in rows])
    width_value = max([len("value")] + [len(v) for _, groups in rows for v, _ in groups])
    lines = [f"  {'field':<{width_field}}  {'value':<{width_value}}  ranks"]
    for name, groups in rows:
        for i, (value, ranks) in enumerate(groups):
            lines.append(f"  {name if i == 0 else '':<{width_field}}  {value:<{width_value}}  {format_ranks(ranks)}")
    return "\n".join(lines)


def check_setup(facts: Sequence[RankFacts]) -> None:
    """Raise :class:`SetupMismatchError`, a table of what differs, when versions, world size or options differ.

    The options (``RankFacts.options``) are those every rank must be given alike; one missing on a rank is at its
    default there.
    """
    columns: dict[str, dict[int, str]] = {"world_size": {f.rank: str(f.world_size) for f in facts}}
    for name in sorted({key for f in facts for key in f.versions}):
        columns[name] = {f.rank: f.versions.get(name, "missing") for f in facts}
    options = sorted({key for f in facts for key in f.options})
    for name in options:
        default = f"{default_option_text(name)} (default)"
        columns[f"option {name}"] = {f.rank: f.options.get(name, default) for f in facts}
    rows = [(name, _group(values)) for name, values in columns.items() if len(set(values.values())) > 1]
    if not rows:
        return
    fix = (
        "install identical versions on every node (use the project's constraints file) and launch every node with "
        "the same world size (Trainer num_nodes/devices, torchrun --nnodes/--nproc-per-node)"
    )
    if any(name.startswith("option ") for name, _ in rows):
        fix += (
            "; give every rank the same strategy arguments (SafeDDPStrategy(...) and DDP's keyword arguments decide "
            "which collectives a rank makes): look for a value read from the rank's environment"
        )
    raise SetupMismatchError(
        "Ranks disagree on their set-up:\n"
        + _table(rows)
        + f"\nEvery rank must run the same software with the same configuration: {fix}.",
        fields=[name for name, _ in rows],
    )


def _check_tensor_signatures(facts: Sequence[RankFacts]) -> None:
    reference = {t.name: t for t in facts[0].tensors}
    problems: list[str] = []
    for f in facts[1:]:
        mine = {t.name: t for t in f.tensors}
        missing = [n for n in reference if n not in mine]
        extra = [n for n in mine if n not in reference]
        changed = [n for n in reference if n in mine and reference[n].signature != mine[n].signature]
        if missing:
            problems.append(f"  rank {f.rank} lacks {len(missing)} tensor(s) of rank 0: {_names(missing)}")
        if extra:
            problems.append(f"  rank {f.rank} has {len(extra)} tensor(s) rank 0 lacks: {_names(extra)}")
        for n in changed[:_MAX_LISTED]:
            ref, other = reference[n], mine[n]
            problems.append(
                f"  '{n}': rank 0 has {ref.kind} {list(ref.shape)} {ref.dtype}, "
                f"rank {f.rank} has {other.kind} {list(other.shape)} {other.dtype}"
            )
    if problems:
        raise SetupMismatchError(
            "Ranks hold different models (parameter/buffer names, shapes or dtypes differ):\n"
            + "\n".join(problems)
            + "\nEvery rank must build the same model: look for rank-dependent code in __init__/configure_model "
            "(e.g. a layer size read from LOCAL_RANK, or a checkpoint of another model loaded on some ranks).",
            fields=["tensors"],
        )


def _names(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _check_tensor_values(facts: Sequence[RankFacts]) -> None:
    reference = facts[0].tensors
    differing: list[str] = []
    ranks: set[int] = set()
    for i, ref in enumerate(reference):
        bad = [f.rank for f in facts[1:] if f.tensors[i].digest != ref.digest]
        if bad:
            differing.append(ref.name)
            ranks.update(bad)
    if not differing:
        return
    kinds = {t.name: t.kind for t in reference}
    listed = ", ".join(f"{kinds[n]} '{n}'" for n in differing[:_MAX_LISTED])
    more = f" and {len(differing) - _MAX_LISTED} more" if len(differing) > _MAX_LISTED else ""
    raise RankDivergenceError(
        f"Model values differ between ranks before the first step: {listed}{more} differ on rank(s) "
        f"{format_ranks(sorted(ranks))} from rank 0. DDP copies rank 0's weights to every rank when it wraps "
        "the model, so something changed them on some ranks afterwards: a rank-dependent edit in a hook "
        "(on_fit_start, on_train_start, setup) or a checkpoint loaded on some ranks only. Make every rank do the "
        "same thing (load checkpoints through trainer.fit(ckpt_path=...) or on every rank).",
        tensors=differing,
        ranks=sorted(ranks),
    )


def _sampler_column(facts: Sequence[RankFacts]) -> dict[int, str] | None:
    """Each rank's training sampler seeds as text, ``None`` when no rank knows them."""
    if all(f.sampler_seeds is None for f in facts):
        return None
    return {
        f.rank: "unknown" if f.sampler_seeds is None else ", ".join(map(str, f.sampler_seeds)) or "none" for f in facts
    }


def seed_report(facts: Sequence[RankFacts]) -> str | None:
    """A warning text when seeds disagree, else ``None``.

    Warns when ranks were seeded differently (or only some were seeded), when the shuffling training
    ``DistributedSampler`` seeds differ between ranks, and when they agree between ranks but differ from the
    (agreed) global seed. The sampler part needs ``RankFacts.sampler_seeds`` (see :func:`collect_facts`).
    """
    problems: list[str] = []
    seeds = _group({f.rank: f.seed if f.seed is not None else "not set" for f in facts})
    if len(seeds) > 1:
        table = "; ".join(f"{seed} on rank(s) {format_ranks(ranks)}" for seed, ranks in seeds)
        problems.append(
            f"Ranks use different global seeds ({table}). Weights still start equal (DDP broadcasts rank 0's), but "
            "anything seeded from it differs per rank. Call lightning.seed_everything(seed) with the same seed on "
            "every rank, before building the model."
        )
    column = _sampler_column(facts)
    if column is not None:
        samplers = _group(column)
        if len(samplers) > 1:
            table = "; ".join(f"{seed} on rank(s) {format_ranks(ranks)}" for seed, ranks in samplers)
            problems.append(
                f"Ranks use different training DistributedSampler seeds ({table}): each rank shuffles the dataset "
                "differently, so the shards overlap and some samples are never seen in an epoch. Give every rank's "
                "DistributedSampler the same seed (Lightning's own uses the global seed), or leave it to Lightning "
                "(use_distributed_sampler=True)."
            )
        elif len(seeds) == 1 and seeds[0][0] != "not set" and samplers[0][0] not in ("none", "unknown"):
            global_seed, sampler_seed = seeds[0][0], samplers[0][0]
            if any(s != global_seed for s in sampler_seed.split(", ")):
                problems.append(
                    f"The training DistributedSampler seed ({sampler_seed}) differs from the global seed "
                    f"({global_seed}) on all {len(facts)} ranks, so the data order does not follow "
                    "lightning.seed_everything. If it should, build the sampler with "
                    "seed=int(os.environ['PL_GLOBAL_SEED']), as Lightning's own DistributedSampler does."
                )
    return " ".join(problems) if problems else None


def seed_summary(facts: Sequence[RankFacts]) -> str | None:
    """One info line when the training sampler seeds are known and :func:`seed_report` has nothing to warn about.

    ``None`` when the sampler seeds are not known (e.g. the handshake before the training dataloader is loaded)
    or when seeds disagree, so that a strategy calling it at every handshake shows the line once per fit.
    """
    column = _sampler_column(facts)
    if column is None or seed_report(facts) is not None:
        return None
    global_seed = facts[0].seed if facts[0].seed is not None else "not set"
    sampler_seed = column[facts[0].rank]
    sampler = "no shuffling DistributedSampler"
    if sampler_seed != "none":
        sampler = f"training DistributedSampler seed {sampler_seed}"
    return f"ddp_strategy: seeds agree on all {len(facts)} rank(s): global seed {global_seed}, {sampler}."
