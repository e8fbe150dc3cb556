"""Two ranks close their control planes while rank 0's heartbeat still beats: nothing it reads is gone yet.

python -m torch.distributed.run --nproc-per-node 2 tests/scripts/close_order.py OUT_DIR

Each rank makes a control plane with a desync monitor (its beats read the next rank's position in their
``multi_get``) and beats for a moment; rank 0's heartbeat then goes on beating for 1 s into ``close``, as a rank
that is slow to stop it. A rank that deleted its position before every heartbeat had stopped would leave rank 0's
beat waiting for the store's timeout in that read. Each rank writes ``OUT_DIR/rank<r>.json``: the seconds its
``close`` took, the beats of its monitor, and whether its heartbeat thread still runs after ``close``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ddp_strategy.collective_record import CallNotes
from ddp_strategy.control import ControlPlane
from ddp_strategy.desync import DesyncMonitor

INTERVAL = 0.05


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    control = ControlPlane.create(timeout=timedelta(seconds=30), heartbeat_interval=INTERVAL)
    monitor = DesyncMonitor(control, CallNotes())
    beats = 0
    beat = monitor.beat

    def counted(store: object) -> None:
        nonlocal beats
        beat(store)  # type: ignore[arg-type]
        beats += 1

    control.heartbeat._hooks = [counted]  # the monitor's hook, counted
    dist.barrier()
    time.sleep(20 * INTERVAL)  # every rank's position published and seen by the rank before it
    stop = control.heartbeat.stop
    if rank == 0:
        control.heartbeat.stop = lambda timeout=None: (time.sleep(1.0), stop(timeout))  # type: ignore[method-assign]
    beats_before = beats
    started = time.monotonic()
    control.close()
    seconds = time.monotonic() - started
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ddp_strategy-heartbeat")]
    result = {"rank": rank, "close_seconds": seconds, "beats": beats_before, "beats_in_close": beats - beats_before}
    (out / f"rank{rank}.json").write_text(json.dumps({**result, "heartbeat_alive": alive}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
