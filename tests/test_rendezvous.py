"""The rendezvous that reports (issue 29, point 1): missing ranks by node, set-ups that disagree, unreachable stores.

Simulated ranks (threads on one in-memory store, each through a counting view) show the protocol and its O(1) store
work per rank; the multi-process tests run two "nodes" on this host with Lightning's launcher (``NODE_RANK``) and
torchrun, beside stock ``DDPStrategy``.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.errors import RendezvousError, SetupMismatchError
from ddp_strategy.options import default_option_text
from ddp_strategy.rendezvous import PREFIX, Member, join
from tests.proc import ROOT, SCRIPTS, Run, at_once, free_port, run_script, run_script_until
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
        options=json.dumps(kw.get("options", {}), sort_keys=True),
        made_at=kw.get("made_at", "train.py:40 in main"),
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


def test_missing_ranks_are_named_by_node_by_the_first_rank_with_the_likely_causes(caplog):
    """World size 6 (3 nodes x 2): ranks 0-2 join; node 1 lacks rank 3, node 2 never starts."""
    members = [member(r, 6) for r in (0, 1, 2)]
    with caplog.at_level(logging.WARNING, logger="ddp_strategy.rendezvous"):
        errors, stores = join_all(members, interval=0.5, timeout=2.0, stagger=0.05)
    lines = [r.getMessage() for r in caplog.records]
    reports = [line for line in lines if "3 of 6 ranks joined after" in line]
    assert reports, caplog.text
    joined = "Joined: node 0 on host0: ranks 0-1; node 1 on host1: rank 2. Missing: node 1: rank 3; node 2: ranks 4-5."
    assert joined in reports[0]
    assert "NODE_RANK" in reports[0] and "MASTER_ADDR/MASTER_PORT" in reports[0] and "port 29500" in reports[0]
    # node 1's local rank 0 gives the count and who lists the missing ranks; rank 1 (local rank 1) prints nothing
    count = "rank 2 (node 1, local rank 0, host host1) waits for the other ranks: 3 of 6 joined after"
    assert any(
        count in line and "rank 0 (node 0, local rank 0, host host0), the first to join" in line for line in lines
    )
    assert not any("rank 1 (node 0, local rank 1" in line for line in lines)
    for err in errors:  # the timeout: the same error on every rank, naming the missing ranks
        assert isinstance(err, RendezvousError) and err.missing_ranks == (3, 4, 5), errors
        assert "The rendezvous at 10.0.0.1:29500 timed out" in str(err) and "node 2: ranks 4-5" in str(err)
    # only the reporter reads the announcements (multi_get); the others read one count per interval at most
    assert stores[0].by_key.get("multi_get", 0) >= 1
    assert stores[1].by_key.get("multi_get", 0) == 0 and stores[2].by_key.get("multi_get", 0) == 0


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_set_ups_that_disagree_raise_on_every_rank_that_joined(sizes):
    members = [member(0, sizes[0], 1), member(1, sizes[1], 1)]  # num_nodes=2 on one node, 3 on the other
    start = time.monotonic()
    errors, _ = join_all(members, interval=30.0, timeout=60.0, stagger=0.3)
    assert time.monotonic() - start < 10
    messages = {str(e) for e in errors}
    assert len(messages) == 1 and all(isinstance(e, SetupMismatchError) for e in errors), errors
    message = messages.pop()
    assert "world size 2 (num_nodes=2, devices=1)" in message and "world size 3 (num_nodes=3, devices=1)" in message
    assert errors[0] is not None and set(errors[0].fields) == {"world_size", "num_nodes"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("world_size", [4, 64])
def test_options_that_differ_raise_the_same_error_on_every_rank_with_the_same_store_work(world_size):
    """The first half of the ranks with the defaults, the other half with SIGUSR1 added and another DDP bucket size,
    as a per-node config would give them: every rank raises one SetupMismatchError naming both options, both
    values and both lines that made the strategy, within seconds. Store work per rank whatever the world size: at
    most the 6 operations of a rendezvous that agrees and the error's 2 (an ``add`` to ``seen``; the last reader's
    ``set`` of ``seen-all``)."""
    half = world_size // 2
    node1 = {"preemption_signals": "(SIGTERM, SIGUSR1)", "bucket_cap_mb": "1"}
    members = [
        member(r, world_size, 2, options=node1 if r >= half else {}, made_at=f"train.py:{40 + (r >= half)} in main")
        for r in range(world_size)
    ]
    start = time.monotonic()
    errors, stores = join_all(members, interval=30.0, timeout=60.0, stagger=0.8 / world_size)
    assert time.monotonic() - start < 10
    messages = {str(e) for e in errors}
    assert len(messages) == 1 and all(isinstance(e, SetupMismatchError) for e in errors), errors
    message = messages.pop()
    first_other = half if world_size == 4 else r"\d+"  # which later rank writes the error first: any of them
    assert re.match(
        rf"The ranks were started with different strategy options: rank {first_other} \(node \d+, local rank \d, "
        rf"host host\d+\) has bucket_cap_mb=1, preemption_signals=\(SIGTERM, SIGUSR1\) \(strategy made at "
        r"train.py:41 in main\), but rank 0 \(node 0, local rank 0, host host0\), the first of the \d+ rank\(s\) "
        rf"that joined before it, has bucket_cap_mb={re.escape(default_option_text('bucket_cap_mb'))} \(the default\), "
        r"preemption_signals=\(SIGTERM,\) \(the "
        r"default\) \(strategy made at train.py:40 in main\)\. These options decide which collectives a rank makes",
        message,
    ), message
    assert "Give every rank the same SafeDDPStrategy(...) arguments" in message
    assert errors[0] is not None and list(errors[0].fields) == ["bucket_cap_mb", "preemption_signals"]  # type: ignore[attr-defined]
    assert max(s.ops for s in stores) <= 8, [s.ops for s in stores]


def test_ranks_given_the_same_non_default_options_join():
    options = {"weight_check": "5", "process_group_backend": "gloo"}
    errors, _ = join_all([member(r, 4, 2, options=options) for r in range(4)])
    assert errors == [None] * 4


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
FIT_START = re.compile(r"script: fit starts at ([0-9.]+)")


def node_env(node_rank: int, port: int) -> dict[str, str]:
    """A "node" of Lightning's launcher on this host: what a user exports before ``python train.py``."""
    return {"NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def fit_start(run: Run) -> float:
    found = FIT_START.search(run.output)
    assert found is not None, run.describe()
    return float(found.group(1))


class Watch:
    """A ``run_script_until`` stop function that never stops a run, noting when each watched text first appeared."""

    def __init__(self, *texts: str) -> None:
        self.texts = texts
        self.seen: dict[str, float] = {}

    def __call__(self, output: str, idle: float) -> bool:
        for text in self.texts:
            if text not in self.seen and text in output:
                self.seen[text] = time.time()
        return False


@pytest.mark.multiprocess
@pytest.mark.serial  # asserts a bound of seconds
def test_a_node_that_never_starts_is_reported_by_node_and_the_timeout_names_it(tmp_path):
    """Lightning's launcher, num_nodes=2, devices=1, NODE_RANK=0 only: a line every 2 s naming node 1 / rank 1 and
    the likely causes, then at rendezvous_timeout=10 s a RendezvousError listing rank 1; exit code 1."""
    port = free_port()
    watch = Watch("Rendezvous at 127.0.0.1:", "RendezvousError")
    args = [SCRIPT, "--num-nodes", "2", "--interval", "2", "--timeout", "10"]
    run = run_script_until(args, timeout=120, stop=watch, env=node_env(0, port))
    assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    assert f"imports ddp_strategy from {SCRIPTS.parents[1]}" in run.output, run.describe()
    start = fit_start(run)
    assert watch.seen["Rendezvous at 127.0.0.1:"] - start < 2 + 15, run.describe()
    assert watch.seen["RendezvousError"] - start < 10 + 15, run.describe()
    report = f"Rendezvous at 127.0.0.1:{port}: 1 of 2 ranks joined after 2 s (started for world size 2 (num_nodes=2, "
    assert report + "devices=1), cluster environment LightningEnvironment). Joined: node 0 on " in run.output
    assert ": rank 0. Missing: node 1: rank 1. Likely causes: a node that was not started" in run.output
    for cause in (f"every node needs 127.0.0.1:{port}", "same NODE_RANK", "num_nodes/devices", f"port {port}"):
        assert cause in run.output, cause
    error = f"ddp_strategy.errors.RendezvousError: The rendezvous at 127.0.0.1:{port} timed out: 1 of 2 ranks joined"
    assert error in run.output and "Missing: node 1: rank 1." in run.output.split(error)[1], run.describe()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stock_lightning_waits_silently_for_a_node_that_never_starts():
    port = free_port()
    marker = "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2"
    run = run_script_until(
        [SCRIPT, "--num-nodes", "2", "--strategy", "ddp"],
        timeout=120,
        stop=lambda output, idle: marker in output and idle > 15,
        env=node_env(0, port),
    )
    assert run.stopped and not run.orphans, run.describe()  # still running, killed by the test
    assert run.output.rstrip().endswith(marker), run.describe()  # and nothing after that line for 15 s


def two_nodes(
    port: int, node0: list[str], node1: list[str], timeout: float = 120, configs: tuple[dict, dict] = ({}, {})
) -> list[tuple[Run, float]]:
    """Node 0 and node 1 of Lightning's launcher, started at once: each one's run and when it ended (``time.time``).

    ``configs``: each node's strategy arguments from its own environment (the script's ``NODE_STRATEGY_OPTIONS``).
    """

    def node(rank: int, args: list[str]) -> tuple[Run, float]:
        env = {**node_env(rank, port), "NODE_STRATEGY_OPTIONS": json.dumps(configs[rank])}
        run = run_script([SCRIPT, *args], timeout=timeout, env=env)
        return run, time.time()

    return at_once(lambda: node(0, node0), lambda: node(1, node1))


@pytest.mark.multiprocess
@pytest.mark.serial  # asserts a bound of seconds
def test_nodes_started_for_different_num_nodes_raise_on_both_within_seconds():
    """Node 0 with num_nodes=2, node 1 with num_nodes=3 (report interval 30 s, no rendezvous timeout): both raise
    the same SetupMismatchError naming both set-ups, within seconds of the second one's fit start."""
    ended = two_nodes(free_port(), ["--num-nodes", "2"], ["--num-nodes", "3"])
    errors = same_setup_mismatch_on_both(ended)
    assert "world size 2 (num_nodes=2, devices=1)" in errors[0] and "world size 3 (num_nodes=3, devices=1)" in errors[0]
    assert "The ranks were started for different set-ups: rank " in errors[0]
    assert "Start every node with the same Trainer(num_nodes=..., devices=...)" in errors[0]


def same_setup_mismatch_on_both(ended: list[tuple[Run, float]]) -> list[str]:
    """Both nodes' SetupMismatchError texts, asserted equal, each node's exit code 1 within 15 s of the later start."""
    runs = [run for run, _ in ended]
    errors = []
    for run in runs:
        assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
        found = re.search(r"ddp_strategy\.errors\.SetupMismatchError: (.*)", run.output)
        assert found is not None, run.describe()
        errors.append(found.group(1))
        assert "All distributed processes registered" not in run.output  # raised before init_process_group
    assert errors[0] == errors[1]
    second_start = max(fit_start(run) for run in runs)
    for run, end in ended:  # the process exit, after the error's traceback
        assert end - second_start < 15, run.describe()
    return errors


#: Node 1's job config turns DDP's buffer broadcast off; node 0's leaves it on (the script's model has a buffer)
BUFFERS_OFF_ON_NODE_1 = ({}, {"broadcast_buffers": False})


@pytest.mark.multiprocess
@pytest.mark.serial  # asserts a bound of seconds
def test_nodes_given_different_strategy_options_raise_on_both_naming_the_option_and_the_line():
    """Both nodes raise the same SetupMismatchError at the rendezvous, before ``init_process_group``: the option,
    both values and the script's line that made the strategy; exit code 1, within seconds of the second fit start.
    """
    ended = two_nodes(free_port(), ["--num-nodes", "2"], ["--num-nodes", "2"], configs=BUFFERS_OFF_ON_NODE_1)
    errors = same_setup_mismatch_on_both(ended)
    host = socket.gethostname()
    line = re.search(r"strategy = SafeDDPStrategy\(", Path(SCRIPT).read_text())
    assert line is not None
    number = Path(SCRIPT).read_text()[: line.start()].count("\n") + 1
    made_at = f"{Path(SCRIPT).relative_to(ROOT)}:{number} in main"  # the scripts run in the repository's root
    mine = f"broadcast_buffers=False (strategy made at {made_at})"
    theirs = f"broadcast_buffers={default_option_text('broadcast_buffers')} (the default) (strategy made at {made_at})"
    pair = {0: (theirs, mine), 1: (mine, theirs)}
    # the node that joined second writes the error: either may
    assert any(
        errors[0].startswith(
            f"The ranks were started with different strategy options: rank {second} (node {second}, local rank 0, "
            f"host {host}) has {pair[second][0]}, but rank {1 - second} (node {1 - second}, local rank 0, host "
            f"{host}), the first of the 1 rank(s) that joined before it, has {pair[second][1]}. These options decide"
        )
        for second in (0, 1)
    ), errors[0]


@pytest.mark.multiprocess
def test_a_later_stage_whose_strategy_options_differ_raises_the_handshake_table_on_both():
    """Both nodes fit alike; then each validates with a second Trainer whose strategy its own config builds (node 1
    without exact evaluation). The process group exists, so no rendezvous runs: the device check at the stage's
    ``setup_environment`` raises the same SetupMismatchError table on both, a row for the option, before any batch."""
    port = free_port()

    def node(rank: int) -> Run:
        env = {**node_env(rank, port), "NODE_VALIDATE_OPTIONS": json.dumps({"exact_evaluation": rank == 0})}
        return run_script([SCRIPT, "--num-nodes", "2", "--then-validate"], timeout=120, env=env)

    runs = at_once(lambda: node(0), lambda: node(1))
    tables = []
    for run in runs:
        assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
        assert "script: validate starts" in run.output, run.describe()
        validating = run.output.split("script: validate starts")[1]  # what passes when the options agree: not here
        assert "validate handshake passed" not in validating and "Validate metric" not in validating, run.describe()
        output = re.sub(r"^\[rank\d\]: ", "", run.output, flags=re.MULTILINE)  # torch's prefix of an error's lines
        found = re.search(
            r"ddp_strategy\.errors\.SetupMismatchError: (Ranks disagree on their set-up:\n(?:  .*\n)+)", output
        )
        assert found is not None, run.describe()
        tables.append(found.group(1))
    assert tables[0] == tables[1]
    assert re.search(r"option exact_evaluation +True \(default\) +0\n +False +1\n", tables[0]), tables[0]


@pytest.mark.multiprocess
def test_stock_lightning_aborts_in_gloo_when_nodes_are_given_different_ddp_options():
    """The same configs with stock ``DDPStrategy``: rank 0 broadcasts its buffers before each forward, rank 1 does
    not, so the ranks' collectives pair up wrongly: gloo aborts a process (C++ ``terminate``, SIGABRT: exit code -6)
    with its size mismatch, the other fails in its next collective; no output names the option."""
    ended = two_nodes(
        free_port(), ["--num-nodes", "2", "--strategy", "ddp"], ["--num-nodes", "2", "--strategy", "ddp"],
        configs=BUFFERS_OFF_ON_NODE_1,
    )  # fmt: skip
    runs = [run for run, _ in ended]
    for run in runs:
        assert not run.timed_out and not run.orphans and run.returncode != 0, run.describe()
        assert "SetupMismatchError" not in run.output, run.describe()
        # torch's deprecation warning of the argument (torch >= 2.14) is the only line that mentions it
        named = [line for line in run.output.splitlines() if "broadcast_buffers" in line]
        assert all("`broadcast_buffers` is deprecated" in line for line in named), named
    aborted = [run for run in runs if run.returncode == -signal.SIGABRT]
    assert aborted, [run.describe() for run in runs]
    assert all("Is there a distributed collective mismatch in your code?" in run.output for run in aborted)


STOCK_REGISTERED = (
    "-" * 100
    + "\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 2 processes\n"
    + "-" * 100
)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stock_lightning_waits_silently_when_nodes_disagree_on_num_nodes():
    """Both nodes are stopped together once both were silent for 15 s after their MEMBER line (stopping one first
    would end the other's wait with a gloo error); their outputs are taken at that moment."""
    port = free_port()
    markers = ["MEMBER: 1/2", "MEMBER: 2/3"]
    last: dict[int, tuple[str, float]] = {}  # each node's output and its silence after its marker, at the last look
    silent: list[dict[int, str]] = []  # both outputs when both had been silent for 15 s

    def stop_for(rank: int) -> Any:
        def stop(output: str, idle: float) -> bool:
            last[rank] = (output, idle if markers[rank] in output else 0.0)
            if not silent and len(last) == 2 and all(quiet > 15 for _, quiet in last.values()):
                silent.append({r: out for r, (out, _) in last.items()})
            return bool(silent)

        return stop

    def node(rank: int) -> Run:
        args = [SCRIPT, "--num-nodes", str(2 + rank), "--strategy", "ddp"]
        return run_script_until(args, timeout=120, stop=stop_for(rank), env=node_env(rank, port))

    runs = at_once(lambda: node(0), lambda: node(1))
    assert silent, [run.describe() for run in runs]
    for rank, (run, marker) in enumerate(zip(runs, markers, strict=True)):
        assert run.stopped and not run.orphans, run.describe()
        after = silent[0][rank].split(f"Initializing distributed: GLOBAL_RANK: {rank}, {marker}")[1]
        # node 0 sometimes pairs with node 1's rank 1 in init_process_group (gloo connects rank 0 to rank 1 only),
        # prints Lightning's "All distributed processes registered", and then waits in the first collective
        assert after.strip() in ("", STOCK_REGISTERED), run.describe()


@pytest.mark.multiprocess
@pytest.mark.serial  # asserts a bound of seconds
def test_a_node_that_cannot_reach_master_port_names_the_address():
    """Node 1 alone, MASTER_PORT a port nothing listens on: a line every 2 s naming MASTER_ADDR:MASTER_PORT and what
    to check, then a RendezvousError at rendezvous_timeout=8 s."""
    port = free_port()
    watch = Watch("cannot reach the rendezvous store", "RendezvousError")
    args = [SCRIPT, "--num-nodes", "2", "--interval", "2", "--timeout", "8"]
    run = run_script_until(args, timeout=120, stop=watch, env=node_env(1, port))
    assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    start = fit_start(run)
    assert watch.seen["cannot reach the rendezvous store"] - start < 2 + 15, run.describe()
    assert watch.seen["RendezvousError"] - start < 8 + 15, run.describe()
    who = f"rank 1 (node 1, local rank 0, host {socket.gethostname()})"
    line = f"{who} cannot reach the rendezvous store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT)"
    assert "Rendezvous: " + line in run.output, run.describe()
    assert f"ddp_strategy.errors.RendezvousError: Rendezvous: {line}" in run.output, run.describe()
    assert "Check that node 0 (NODE_RANK=0, global rank 0) is running" in run.output


@pytest.mark.multiprocess
def test_two_nodes_of_lightnings_launcher_fit_with_a_constant_number_of_store_operations(tmp_path):
    port = free_port()
    out = tmp_path / "result.json"
    args = ["--num-nodes", "2", "--count-store-ops"]
    runs = two_nodes(port, [*args, "--out", str(out)], args)
    for rank, (run, _) in enumerate(runs):
        assert run.returncode == 0 and not run.timed_out and not run.orphans, run.describe()
        ops = re.search(rf"script: rank {rank} rendezvous store ops: (\d+)", run.output)
        assert ops is not None and int(ops.group(1)) <= 7, run.describe()
    assert json.loads(out.read_text())["global_step"] == 2


def torchrun_node(node_rank: int, port: int, nnodes: int, *args: str, rdzv_timeout: int | None = None) -> list[str]:
    cmd = ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1", "--node-rank"]
    cmd += [str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["--rdzv-conf", f"timeout={rdzv_timeout}"] if rdzv_timeout is not None else []
    return [*cmd, SCRIPT, *args]


@pytest.mark.multiprocess
def test_torchrun_agent_waits_silently_for_a_missing_node_before_any_worker_starts():
    """torchrun's own (static) rendezvous waits for every node's agent before it starts a worker: silent until its
    timeout (600 s by default; 10 s here), then its error. The strategy never runs."""
    run = run_script(torchrun_node(0, free_port(), 2, "--num-nodes", "2", rdzv_timeout=10), timeout=120)
    assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    assert re.search(
        r"DistStoreError: Timed out after \d+ seconds waiting for clients. 1/2 clients joined.", run.output
    )
    assert "script:" not in run.output  # no worker was started


@pytest.mark.multiprocess
def test_torchrun_node_whose_trainer_disagrees_is_named_as_missing_by_the_other():
    """torchrun --nnodes 2 on both nodes; node 1's Trainer(num_nodes=3): Lightning's ValueError there, and node 0's
    rendezvous names node 1 / rank 1 as missing with torchrun's likely causes, then times out (8 s)."""
    port = free_port()

    def node(rank: int) -> Run:
        args = ["--num-nodes", str(2 + rank), "--interval", "2", "--timeout", "8"]
        return run_script(torchrun_node(rank, port, 2, *args), timeout=150)

    node0, node1 = at_once(lambda: node(0), lambda: node(1))
    for run in (node0, node1):
        assert run.returncode == 1 and not run.timed_out and not run.orphans, run.describe()
    assert "ValueError: You set `devices=1` and `num_nodes=3` in Lightning" in node1.output, node1.describe()
    assert "cluster environment TorchElasticEnvironment). Joined: node 0 on " in node0.output, node0.describe()
    assert ": rank 0. Missing: node 1: rank 1. Likely causes: torchrun's agents had all met" in node0.output
    assert f"RendezvousError: The rendezvous at 127.0.0.1:{port} timed out: 1 of 2 ranks joined" in node0.output
