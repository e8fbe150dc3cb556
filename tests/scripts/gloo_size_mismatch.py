"""Two gloo ranks whose collectives differ in size: rank 0 reduces one float, rank 1 all-reduces 41.

Usage: python tests/scripts/gloo_size_mismatch.py all_reduce|all_reduce_value

``all_reduce``: rank 0 calls ``torch.distributed.all_reduce`` (what Lightning's ``reduce`` makes after its barrier).
``all_reduce_value``: rank 0 calls ``ddp_strategy.collective_calls.all_reduce_value`` (``SafeDDPStrategy.reduce``).
Rank 1 stands for DDP's gradient all-reduce. The group's timeout is 3 s. Each rank prints ``rank=R raised TYPE`` when
its call raised, and the parent prints ``rank=R exitcode=C`` per rank (a rank that returned exits with 0 at once:
torch 2.13 can abort at interpreter exit after a gloo timeout, which is not what is looked at here).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_strategy.collective_calls import all_reduce_value


def rank_main(rank: int, how: str, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=3)
    )
    try:
        if rank == 1:
            dist.all_reduce(torch.ones(41))
        elif how == "all_reduce":
            dist.all_reduce(torch.ones(1))
        else:
            all_reduce_value(torch.ones(1), None, "sum")
        print(f"rank={rank} returned", flush=True)
    except RuntimeError as err:
        print(f"rank={rank} raised {type(err).__name__}: {str(err)[:160]}", flush=True)
    os._exit(0)


def main() -> None:
    how = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, how, port)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for rank, process in enumerate(ranks):
        process.join(60)
        if process.is_alive():
            process.kill()
            process.join()
        print(f"rank={rank} exitcode={process.exitcode}", flush=True)


if __name__ == "__main__":
    main()
