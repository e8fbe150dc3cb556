from __future__ import annotations

import dataclasses

from ddp_strategy.positions import Position, call_site, format_ranks


def test_format_ranks():
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert format_ranks([2, 1, 1]) == "1-2"


def test_position_roundtrip_and_describe():
    p = Position(kind="barrier", name="save", site="train.py:3 in main", seq=4, since=100.0, heartbeat=109.0)
    assert Position.from_json(p.to_json()) == p
    text = p.describe(now=110.0)
    assert text == "barrier 'save' at train.py:3 in main (entered 10.0 s ago, last heartbeat 1.0 s ago)"
    step = Position(kind="training step", name="12", since=109.0)
    assert step.describe(now=110.0).startswith("training step 12 (entered 1.0 s ago")
    failed = Position(kind="failed", name="ValueError: boom", since=109.5)
    assert failed.describe(now=110.0) == "failed with ValueError: boom (0.5 s ago)"


def helper_calling_call_site() -> str:
    return call_site(skip=1)


def test_call_site_points_at_user_code():
    site = helper_calling_call_site()
    assert "test_positions.py" in site and "helper_calling_call_site" in site


def test_a_training_steps_position_is_built_when_read_and_published_with_the_heartbeats_fields():
    """``Heartbeat.note_step`` (every step) stores a tuple; the position is built once per note when read (the
    desync monitor tells "moved on" by identity), and the published JSON carries progress, wait and ledger."""
    import json

    import torch.distributed as dist

    from ddp_strategy.heartbeat import Heartbeat
    from ddp_strategy.store_barrier import POSITION_KEY

    store = dist.HashStore()
    beat = Heartbeat(rank=1, world_size=2, interval=0, store=store, desync_agreed=lambda: False)
    beat.next_barrier = 10  # as the control plane sets it after each barrier
    beat.note_step(5, batch=6, epoch=0, epoch_batch=6)
    first = beat.position
    assert (first.kind, first.name, first.batch, first.seq) == ("training step", "5", 6, 10)
    assert beat.position is first  # no new step: the same object
    beat.next_barrier = 11
    beat.note_step(6, batch=7, epoch=0, epoch_batch=7)
    second = beat.position
    assert second is not first and (second.name, second.batch, second.seq) == ("6", 7, 11)
    barrier = Position(kind="barrier", name="save", seq=12, since=1.0)
    beat.position = barrier  # the control plane's positions replace the step's note
    assert beat.position is barrier
    beat.next_barrier = 12
    beat.note_step(7, batch=8, epoch=1, epoch_batch=1)
    beat.set_waiting("collective 0#9", 3.0)
    beat.set_ledger(4, 99)
    beat.publish(store)
    published = Position.from_json(store.get(POSITION_KEY.format(rank=1)))
    assert (published.kind, published.name, published.batch, published.epoch, published.epoch_batch) == (
        "training step",
        "7",
        8,
        1,
        1,
    )
    assert (published.waiting, published.waiting_since, published.calls, published.digest) == (
        "collective 0#9",
        3.0,
        4,
        99,
    )
    assert published.heartbeat > 0 and json.loads(store.get(POSITION_KEY.format(rank=1)))["seq"] == 12
    assert beat._built is None or beat._built[0] is not beat.mark  # published without building its Position
    built = beat.position  # built now, by a reader: the same fields as published, but the heartbeat
    published_fields = {"epoch": 1, "epoch_batch": 1, "waiting": "collective 0#9", "waiting_since": 3.0}
    published_fields.update(calls=4, digest=99, heartbeat=published.heartbeat)
    assert published == dataclasses.replace(built, **published_fields)
    mark = beat.mark
    assert beat.mark is mark  # no new position: the same mark, nothing built
    beat.note_step(8, batch=9, epoch=1, epoch_batch=2)
    assert beat.mark is not mark  # a new step


def test_the_epoch_of_a_training_step_is_read_once_per_epoch_and_again_after_a_new_stage():
    """``RunLifecycle.note_step`` reads ``trainer.current_epoch`` at an epoch's first batch noted (a batch index not
    above the last one) and keeps it for the epoch's other steps; the published progress stays right."""
    import types

    import torch.distributed as dist

    from ddp_strategy.collective_calls import CollectiveCalls
    from ddp_strategy.heartbeat import Heartbeat
    from ddp_strategy.lifecycle import RunLifecycle
    from ddp_strategy.options import StrategyOptions

    class Trainer:
        reads = 0
        epoch = 0

        @property
        def current_epoch(self) -> int:
            Trainer.reads += 1
            return Trainer.epoch

    store = dist.HashStore()
    beat = Heartbeat(rank=0, world_size=2, interval=0, store=store, desync_agreed=lambda: False)
    lifecycle = RunLifecycle(CollectiveCalls(), StrategyOptions.from_arguments())
    lifecycle.control = types.SimpleNamespace(heartbeat=beat)  # type: ignore[assignment]
    trainer = Trainer()
    seen = []
    for epoch, batches in ((0, range(3, 6)), (1, range(4)), (2, range(1))):  # resumed mid-epoch 0 at batch 3
        Trainer.epoch = epoch
        for batch_idx in batches:
            lifecycle.note_step(trainer, 0, 0, batch_idx)  # type: ignore[arg-type]
            seen.append(beat.progress)
    assert seen == [(0, 4), (0, 5), (0, 6), (1, 1), (1, 2), (1, 3), (1, 4), (2, 1)]
    assert Trainer.reads == 3  # once per epoch
    lifecycle._epoch = (-1, None)  # as `start` does for a new stage
    Trainer.epoch = 7
    lifecycle.note_step(trainer, 0, 0, 9)  # type: ignore[arg-type]
    assert beat.progress == (7, 10) and Trainer.reads == 4
