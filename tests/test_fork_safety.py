"""DataLoaders that fork workers at every epoch are named on Pythons with CPython gh-112275; the strategy's own
collectives keep their tensors on the calling thread so that gloo's threads never free them (the trigger)."""

from __future__ import annotations

import ctypes
import multiprocessing
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy.fork_safety import FIXED_IN, fork_hazard
from ddp_strategy.object_collectives import KeepAlive
from tests.proc import free_port, run_scenario

AFFECTED = (3, 11, 7)
DATA = TensorDataset(torch.zeros(8, 2))


def loader(**kwargs: object) -> DataLoader:
    return DataLoader(DATA, batch_size=2, **kwargs)  # type: ignore[arg-type]


def test_fork_per_epoch_loader_is_named_with_the_fixes():
    message = fork_hazard([("training", loader(num_workers=2))], python=AFFECTED)
    assert message is not None
    assert "the training DataLoader (2 workers)" in message
    assert "Python 3.11.7" in message and "gh-112275" in message
    assert "persistent_workers=True" in message and "multiprocessing_context='forkserver'" in message
    assert "3.11.10" in message


def test_only_the_risky_loaders_are_named():
    loaders = [
        ("training", loader(num_workers=2, persistent_workers=True)),
        ("validation", loader(num_workers=3)),
        ("other", loader()),
    ]
    message = fork_hazard(loaders, python=AFFECTED)
    assert message is not None
    assert "the validation DataLoader (3 workers)" in message
    assert "training" not in message and "other" not in message


@pytest.mark.parametrize(
    ("kwargs", "python", "world_size"),
    [
        ({"num_workers": 2, "persistent_workers": True}, AFFECTED, 2),
        ({"num_workers": 2, "multiprocessing_context": "forkserver"}, AFFECTED, 2),
        ({"num_workers": 2, "multiprocessing_context": multiprocessing.get_context("spawn")}, AFFECTED, 2),
        ({"num_workers": 0}, AFFECTED, 2),
        ({"num_workers": 2}, FIXED_IN, 2),
        ({"num_workers": 2}, (3, 12, 1), 2),
        ({"num_workers": 2}, AFFECTED, 1),
    ],
    ids=["persistent", "forkserver", "spawn-context", "no-workers", "fixed-3.11", "python-3.12", "one-rank"],
)
def test_no_warning_without_the_hazard(kwargs, python, world_size):
    assert fork_hazard([("training", loader(**kwargs))], python=python, world_size=world_size) is None


def test_a_fork_context_object_counts_as_fork():
    ctx = multiprocessing.get_context("fork")
    assert fork_hazard([("training", loader(num_workers=1, multiprocessing_context=ctx))], python=AFFECTED)


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.version_info[:3] >= FIXED_IN, reason=f"Python {sys.version.split()[0]} has the fix")
def test_strategy_pins_the_collective_threads_so_fork_per_epoch_workers_are_safe(tmp_path: Path):
    run = run_scenario("fit_ok", tmp_path, "--max-epochs", "2", "--num-workers", "2")
    assert run.returncode == 0 and not run.orphans, run.describe()
    assert run.result is not None and run.result["collective_threads_pinned"] is True
    assert "gh-112275" not in run.output  # nothing left to warn about


def _thread_states() -> int:
    """How many Python thread states the interpreter holds (public C API, through ctypes)."""
    api = ctypes.pythonapi
    api.PyInterpreterState_Main.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
    api.PyThreadState_Next.restype = ctypes.c_void_p
    api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    count, state = 0, api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Main())
    while state:
        count, state = count + 1, api.PyThreadState_Next(state)
    return count


def _pinning_rank(rank: int, world_size: int, port: int, pin: bool, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    from ddp_strategy._compat.torch import gloo_worker_threads, pin_python_thread_states

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        threads = gloo_worker_threads(dist.group.WORLD)
        before = _thread_states()
        pinned = pin_python_thread_states(dist.group.WORLD, threads or 0) if pin else 0
        for _ in range(50):  # collectives whose Python-created tensors gloo's threads may free
            tensor = torch.randn(4)
            dist.all_reduce(tensor)
            del tensor
        dist.barrier()
        time.sleep(0.2)  # let the workers finish releasing
        queue.put((rank, threads, pinned, before, _thread_states()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "not-pinned"])
def test_pinned_gloo_threads_keep_their_python_thread_states(pin):
    # pinned: each of gloo's 2 worker threads keeps one thread state (and so never creates another, the instant a
    # fork must not hit); not pinned: the states they create to free tensors are gone again afterwards
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port, world_size = free_port(), 2
    procs = [ctx.Process(target=_pinning_rank, args=(r, world_size, port, pin, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        results = [queue.get(timeout=60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for _, threads, pinned, before, after in results:
        assert threads == 2
        if pin:
            assert pinned == 2 and after == before + 2
        else:
            assert after == before


# ------------------------------------------------------------------------------------------ object collectives
def _rank(rank: int, world_size: int, port: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    from ddp_strategy.object_collectives import all_gather_objects, broadcast_object, gather_objects

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        keep = KeepAlive(depth=4)
        mine = {"rank": rank, "payload": "x" * (10 + 1000 * rank)}  # different sizes: padding and trimming
        gathered = all_gather_objects(mine, group=None, world_size=world_size, keep=keep)
        held_after_gather = [t.numel() for tensors in keep._held for t in tensors]
        on_dst = gather_objects(mine, dst=1, rank=rank, group=None, world_size=world_size, keep=keep)
        sent = broadcast_object({"from": rank} if rank == 0 else None, src=0, rank=rank, group=None, keep=keep)
        queue.put((rank, gathered, on_dst, sent, held_after_gather, len(keep._held)))
    finally:
        dist.destroy_process_group()


def test_object_collectives_over_gloo_hold_their_tensors():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port, world_size = free_port(), 2
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        results = {r[0]: r[1:] for r in (queue.get(timeout=60) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    expected = [{"rank": r, "payload": "x" * (10 + 1000 * r)} for r in range(world_size)]
    for rank, (gathered, on_dst, sent, held_after_gather, held) in results.items():
        assert gathered == expected
        assert on_dst == (expected if rank == 1 else None)
        assert sent == {"from": 0}
        # the size exchange and the padded payloads (2 ranks: own bytes, padded copy, 2 received) stay referenced
        assert held_after_gather[:3] == [1, 1, 1]
        assert held_after_gather[-1] == held_after_gather[-2] >= 1010  # rank 1's pickled dict, the longest
        assert held == 4  # depth 4: the oldest were released on this thread as newer ones came
