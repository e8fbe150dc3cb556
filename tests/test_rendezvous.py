"""The rendezvous that reports (issue 29, point 1): missing ranks named by node, set-ups that disagree, unreachable stores.

Simulated ranks (threads on one in-memory store, each through a counting view) show the protocol and its O(1) store
work per rank; the multi-process tests run two "nodes" on this host with Lightning's launcher (``NODE_RANK``) and
torchrun, beside stock ``DDPStrategy``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.errors import RendezvousError, SetupMismatchError
from ddp_strategy.rendezvous import PREFIX, Member, join
from tests.proc import SCRIPTS, Run, free_port, run_script, run_script_until
from tests.test_control_scale import CountingStore


def member(rank: int, world_size: int = 4, devices: int = 2, *, num_nodes: int | None = None, **kw: Any) -> Member:
    nodes = num_nodes if num_nodes is not None else world_size // devices
    return Member(
        rank=rank,
        world_size=world_size,
        num_nodes=nodes,
        devices=devices,
        node_rank=kw.get("node_rank", rank // devices),
        local_rank=rank % devices,
        host=kw.get("host", f"host{rank // devices}"),
        environment="LightningEnvironment",
    )


def join_all(
    members: list[Member], *, interval: float = 5.0, timeout: float = 30.0, stagger: float = 0.0
) -> tuple[list[BaseException | None], list[CountingStore]]:
    """Each member joins from its own thread through its own counting view of one store; what each one raised."""
    shared = dist.PrefixStore(PREFIX, dist.HashStore())
    stores = [CountingStore(shared) for _ in members]
    errors: list[BaseException | None] = [None] * len(members)

    def run(i: int) -> None:
        time.sleep(stagger * i)
        try:
            join(stores[i], members[i], where="10.0.0.1:29500", interval=interval, deadline=time.monotonic() + timeout)
        except BaseException as err:  # handed to the test
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 30)
    assert not any(t.is_alive() for t in threads)
    return errors, stores


@pytest.mark.parametrize("world_size", [4, 16, 64])
def test_every_rank_joins_with_the_same_store_work_whatever_the_world_size(world_size):
    errors, stores = join_all([member(r, world_size) for r in range(world_size)])
    assert errors == [None] * world_size
    # compare_set setup, compare_set rank/<r>, append, add, wait, get; the rank that completes: one compare_set more
    ops = sorted(s.ops for s in stores)
    assert ops[0] == 6 and ops[-1] == 7 and ops.count(7) == 1, ops
    assert max(s.keys for s in stores) == 7


def test_a_missing_node_is_named_by_the_first_rank_with_the_likely_causes(caplog):
    members = [member(r, 4) for r in (0, 1)]  # node 1 (ranks 2-3) never starts
    with caplog.at_level(logging.WARNING, logger="ddp_strategy.rendezvous"):
        errors, stores = join_all(members, interval=0.5, timeout=2.0)
    reports = [r.getMessage() for r in caplog.records if "2 of 4 ranks joined" in r.getMessage()]
    assert reports, caplog.text
    assert "Joined: node 0 on host0: ranks 0-1. Missing: node 1: ranks 2-3." in reports[0]
    assert "NODE_RANK" in reports[0] and "MASTER_ADDR/MASTER_PORT" in reports[0] and "port 29500" in reports[0]
    for err in errors:  # the timeout: the same error on both ranks, naming the missing ranks
        assert isinstance(err, RendezvousError) and err.missing_ranks == (2, 3), errors
        assert "The rendezvous at 10.0.0.1:29500 timed out" in str(err) and "Missing: node 1: ranks 2-3" in str(err)
    # the reporter reads the joined list and the announcements (one multi_get) per report; the other, a count
    assert stores[1].by_key.get("multi_get", 0) == 0


@pytest.mark.parametrize("second", ["bigger", "smaller"])
def test_set_ups_that_disagree_raise_on_every_rank_that_joined(second):
    two, three = member(0, 2, 1), member(1, 3, 1)  # node 0 for num_nodes=2, node 1 for num_nodes=3
    members = [two, three] if second == "bigger" else [three.__class__(**{**three.__dict__, "rank": 0}), two]
    start = time.monotonic()
    errors, _ = join_all(members, interval=30.0, timeout=60.0, stagger=0.3)
    assert time.monotonic() - start < 10
    messages = {str(e) for e in errors}
    assert len(messages) == 1 and all(isinstance(e, SetupMismatchError) for e in errors), errors
    message = messages.pop()
    assert "world size 2 (num_nodes=2, devices=1)" in message and "world size 3 (num_nodes=3, devices=1)" in message
    assert errors[0] is not None and set(errors[0].fields) == {"world_size", "num_nodes"}  # type: ignore[attr-defined]


def test_two_processes_claiming_one_rank_are_named():
    a, b = member(1, 2, 1, host="a"), member(1, 2, 1, host="b")  # two nodes started with NODE_RANK=1
    errors, _ = join_all([a, b, member(0, 2, 1)], interval=30.0, timeout=60.0, stagger=0.2)  # before node 0 joins
    assert all(isinstance(e, SetupMismatchError) for e in errors), errors
    assert "Two processes claim global rank 1" in str(errors[0]) and "host a" in str(errors[0])


def test_options_are_validated():
    with pytest.raises(ValueError, match="`rendezvous_report_interval` must be a number of seconds > 0, got 0"):
        SafeDDPStrategy(rendezvous_report_interval=0)
    with pytest.raises(ValueError, match="`rendezvous_timeout` must be positive, got -1"):
        SafeDDPStrategy(rendezvous_timeout=-1)
    strategy = SafeDDPStrategy(rendezvous_timeout=5)
    assert strategy.options.rendezvous_timeout == timedelta(seconds=5)
    assert strategy.options.rendezvous_report_interval == 30.0


# ---------------------------------------------------------------------------------------------- processes

SCRIPT = str(SCRIPTS / "rendezvous.py")


def lightning_node(node_rank: int, port: int, *args: str, addr: str = "127.0.0.1", **kw: Any) -> list[str]:
    return [SCRIPT, "--node-rank", str(node_rank), "--addr", addr, "--port", str(port), *args]
