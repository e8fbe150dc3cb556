"""HangWatchdog: stack analysis and summary logic, two simulated ranks in one process, real multi-process hangs."""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy.callbacks import HangWatchdog
from ddp_strategy.callbacks import hang_watchdog as hw
from ddp_strategy.control import ControlPlane
from ddp_strategy.positions import Position
from tests.proc import SCRIPTS, Run, run_script

pytestmark = pytest.mark.serial  # timeouts of seconds, and no report for a merely slow rank: run alone (make test)

TORCH = os.sep + os.path.join("venv", "lib", "torch")
CONTROL = os.path.join(os.path.dirname(os.path.dirname(hw.__file__)), "control.py")
BARRIER_WAIT = os.path.join(os.path.dirname(CONTROL), "barrier_wait.py")


def test_locate_names_a_control_plane_barrier_from_the_position():
    stack = [
        (BARRIER_WAIT, 150, "await_outcome"),
        (BARRIER_WAIT, 110, "run"),
        (CONTROL, 250, "barrier"),
        ("/home/u/train.py", 12, "training_step"),
    ]
    position = Position(kind="barrier", name="save", site="train.py:12 in training_step")
    assert hw.locate(stack, position) == ("waiting", "barrier 'save' at train.py:12 in training_step")


def test_locate_names_a_torch_collective_and_the_user_code_that_called_it():
    stack = [
        (f"{TORCH}{os.sep}distributed{os.sep}c10d_logger.py", 80, "wrapper"),
        (f"{TORCH}{os.sep}distributed{os.sep}distributed_c10d.py", 2500, "all_reduce"),
        ("/home/u/train.py", 40, "on_validation_epoch_end"),
    ]
    state, where = hw.locate(stack, None)
    assert state == "waiting"
    assert where.startswith("collective torch.distributed.all_reduce from ") and "train.py:40" in where


def test_locate_backward_is_a_gradient_sync_and_user_code_is_running():
    backward = [(f"{TORCH}{os.sep}autograd{os.sep}graph.py", 800, "_engine_run_backward"), ("/u/t.py", 5, "main")]
    assert hw.locate(backward, None)[1].startswith("backward pass: DDP's gradient all-reduce")
    sleeping = [("/home/u/train.py", 7, "training_step"), (f"{TORCH}{os.sep}nn{os.sep}module.py", 1, "_call")]
    assert hw.locate(sleeping, None) == ("running", "its own code at /home/u/train.py:7 in training_step")


def report(rank: int, state: str, where: str, step: int = 3) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "state": state,
        "where": where,
        "progress": "on_train_batch_start (batch 3)",
        "idle": 5.0,
        "dump": f"/tmp/d/hang-rank{rank}.txt",
    }


def test_summary_names_a_dead_rank_and_a_rank_running_its_own_code():
    reports = {0: report(0, "waiting", "backward pass"), 1: report(1, "running", "its own code at t.py:9 in step")}
    positions = {2: Position(kind="training step", name="2", since=90.0, heartbeat=91.0)}
    text = hw.summarize(reports, positions, 3, trigger="rank 0 made no progress", exit_code=124, now=100.0)
    assert "rank 0: waiting in backward pass; training step 3" in text
    assert "rank 2: NO REPORT (dead, or frozen without running Python); last seen: training step 2" in text
    assert "last heartbeat 9.0 s ago" in text
    assert "rank 2: gone (no report, heartbeat stopped)" in text
    assert "rank 1: running its own code (not in any collective) while rank 0 waits for it" in text
    assert "Stack dumps (all threads): hang-rank0.txt, hang-rank1.txt in /tmp/d" in text
    assert text.endswith("Every rank now exits with code 124.")


def test_summary_groups_ranks_and_names_the_minority():
    reports = {r: report(r, "waiting", "backward pass") for r in (0, 1, 3)}
    reports[2] = report(2, "waiting", "barrier 'x' at t.py:3 in f")
    text = hw.summarize(reports, {}, 4, trigger="t", exit_code=9)
    assert "rank 0-1, 3: waiting in backward pass" in text
    assert "rank 2: at a different place than the others" in text
    tie = hw.summarize({0: reports[0], 1: reports[2]}, {}, 2, trigger="t", exit_code=9)
    assert "no majority: the ranks wait in different collectives" in tie


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0},
        {"timeout": "1"},
        {"grace_period": -1},
        {"exit_code": 0},
        {"exit_code": 256},
        {"poll_interval": 0},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        HangWatchdog(**kwargs)


def test_survives_pickling_for_the_spawn_launcher():
    dog = pickle.loads(pickle.dumps(HangWatchdog(5, dump_dir="/tmp/x")))
    assert dog.timeout == 5 and dog._thread is None and not dog._stop.is_set()


def test_two_simulated_ranks_dump_summarise_and_exit(tmp_path, monkeypatch):
    """Rank 1 stops making progress; rank 0 keeps going, sees the alarm, reports and prints the summary."""
    store = dist.HashStore()
    planes = [
        ControlPlane(
            rank=r, world_size=2, store=store, group=None, timeout=timedelta(seconds=5), heartbeat_interval=0.05
        )
        for r in range(2)
    ]
    exits: dict[str, int] = {}
    emitted: list[str] = []
    monkeypatch.setattr(hw.os, "_exit", lambda code: exits.__setitem__(threading.current_thread().name, code))
    monkeypatch.setattr(HangWatchdog, "_emit", staticmethod(emitted.append))
    dogs = [HangWatchdog(0.4, dump_dir=tmp_path, grace_period=2.0, exit_code=7, poll_interval=0.05) for _ in range(2)]
    for rank, (dog, plane) in enumerate(zip(dogs, planes, strict=True)):
        trainer = SimpleNamespace(
            strategy=SimpleNamespace(control_plane=plane),
            global_rank=rank,
            world_size=2,
            default_root_dir=str(tmp_path),
            global_step=4 + rank,
        )
        dog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    threads = [dog._thread for dog in dogs]
    deadline = time.monotonic() + 15
    while any(t is not None and t.is_alive() for t in threads) and time.monotonic() < deadline:
        dogs[0]._note("on_train_batch_end (batch 1)")  # rank 0 makes progress; rank 1 does not
        time.sleep(0.05)
    for plane in planes:
        plane.close()
    assert exits == {"ddp_strategy-hang-watchdog-rank0": 7, "ddp_strategy-hang-watchdog-rank1": 7}
    summaries = [e for e in emitted if e.startswith("===== HangWatchdog: training hung")]
    assert len(summaries) == 1, emitted
    assert "rank 1 made no progress for" in summaries[0]
    assert "Every rank now exits with code 7." in summaries[0]
    for rank in (0, 1):
        dump = (tmp_path / f"hang-rank{rank}.txt").read_text()
        assert f"rank {rank} of 2" in dump and "Thread MainThread" in dump


# ---------------------------------------------------------------------- real multi-process runs
def run_hang(scenario: str, tmp_path: Path, *extra: str) -> tuple[Run, Path]:
    dumps = tmp_path / "dumps"
    run = run_script(
        [
            str(SCRIPTS / "scenario.py"),
            scenario,
            "--out",
            str(tmp_path / "out.json"),
            "--hang-watchdog",
            "3",
            "--hang-grace",
            "3",
            "--hang-dir",
            str(dumps),
            *extra,
        ],
        timeout=90,
    )
    assert not run.timed_out and not run.orphans, run.describe()
    assert run.returncode != 0, run.describe()
    return run, dumps


def summary_of(run: Run) -> str:
    start = run.output.index("===== HangWatchdog: training hung")
    end = run.output.index("Every rank now exits with code 124.", start)
    return run.output[start:end]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_sleeping_forever_in_training_step(tmp_path):
    run, dumps = run_hang("hang_sleep_rank1", tmp_path)
    assert run.returncode == hw.HANG_EXIT_CODE, run.describe()
    summary = summary_of(run)
    assert "rank 0: waiting in backward pass: DDP's gradient all-reduce" in summary, run.describe()
    assert "rank 1: running in its own code at tests/scripts/scenario.py" in summary
    assert "in hang_or_straggle; training step 2" in summary
    assert "rank 1: running its own code (not in any collective) while rank 0 waits for it" in summary
    for rank in (0, 1):
        dump = (dumps / f"hang-rank{rank}.txt").read_text()
        assert "Thread MainThread" in dump and f"ddp_strategy-heartbeat-rank{rank}" in dump
        assert f"[rank{rank}]: HangWatchdog stack dump: rank {rank} of 2" in run.output  # stderr too
    assert "time.sleep(3600)" in (dumps / "hang-rank1.txt").read_text()
    # docs/diagnostics.md: the alarm comes within seconds of `timeout` (3 s here; the watchdog polls every 0.75 s)
    stalled = re.search(r"training hung; rank \d made no progress for ([\d.]+) s \(timeout 3 s", summary)
    assert stalled and 3 <= float(stalled.group(1)) < 5, summary
    assert run.seconds < 60, run.describe()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_barrier_called_by_rank0_only_is_summarised_before_the_barrier_timeout(tmp_path):
    # the watchdog on its own: the desync detection (on by default) would name this divergence first
    run, dumps = run_hang("barrier_rank0_only", tmp_path, "--barrier-timeout", "60", "--no-desync")
    assert run.returncode == hw.HANG_EXIT_CODE, run.describe()
    summary = summary_of(run)
    assert "rank 0: waiting in barrier 'only_rank0' at tests/scripts/scenario.py" in summary, run.describe()
    assert "rank 1: waiting in backward pass: DDP's gradient all-reduce" in summary
    assert "no majority: the ranks wait in different collectives" in summary
    assert "CollectiveMismatchError" not in run.output  # the watchdog (3 s) acted long before barrier_timeout
    assert (dumps / "hang-rank0.txt").exists() and (dumps / "hang-rank1.txt").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank0_stuck_in_a_busy_loop_still_summarises(tmp_path):
    run, _ = run_hang("hang_busy_rank0", tmp_path)
    assert run.returncode == hw.HANG_EXIT_CODE, run.describe()
    summary = summary_of(run)
    assert "rank 0: running in its own code at tests/scripts/scenario.py" in summary, run.describe()
    assert "rank 0: running its own code (not in any collective) while rank 1 waits for it" in summary


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_that_exited_is_reported_gone(tmp_path):
    run, dumps = run_hang("die_rank1_at_barrier", tmp_path)
    assert run.returncode == hw.HANG_EXIT_CODE, run.describe()
    summary = summary_of(run)
    assert "rank 0: waiting in barrier 'after_step_2'" in summary, run.describe()
    assert "rank 1: NO REPORT (dead, or frozen without running Python); last seen:" in summary
    assert "rank 1: gone (no report, heartbeat stopped): it died or exited early" in summary
    assert (dumps / "hang-rank0.txt").exists() and not (dumps / "hang-rank1.txt").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_killed_rank0_is_named_by_the_surviving_rank(tmp_path):
    run, _ = run_hang("sigkill_rank0", tmp_path)
    assert "ddp_strategy: rank 1 stops after RuntimeError: " in run.output, run.describe()
    assert ", and the rendezvous store is unreachable (" in run.output
    assert "rank 0 (or, under torchrun, node 0's agent), which hosts it, has most likely died or exited" in run.output
    assert run.output.count("ddp_strategy: rank 1 stops after") == 1  # the watchdog and the strategy share it


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_that_exited_mid_training_is_named_after_the_backend_error(tmp_path):
    run, _ = run_hang("exit_rank1_mid_training", tmp_path)
    assert "[rank0]: RuntimeError: [" in run.output and "gloo" in run.output, run.describe()  # an address, no rank
    assert "ddp_strategy: rank 0 stops after RuntimeError: " in run.output
    assert "Rank(s) 1 stopped sending heartbeats" in run.output
    assert "or exited early. Last seen:\n  rank 1: " in run.output
    assert run.output.count("stopped sending heartbeats") == 1  # the watchdog and the strategy share one diagnosis


def test_summary_calls_a_rank_without_report_but_with_a_recent_heartbeat_alive_not_gone():
    # issue 15: a rank that left the training loop (its watchdog is off) and waits in teardown is alive
    reports = {0: report(0, "waiting", "backward pass")}
    positions = {1: Position(kind="barrier", name="teardown", site="t.py:9 in main", since=90.0, heartbeat=99.5)}
    text = hw.summarize(reports, positions, 2, trigger="t", exit_code=124, now=100.0, stale_after=3.0)
    assert "rank 1: alive, no report (its watchdog is off: it has left the training loop); barrier 'teardown'" in text
    assert "rank 1: alive but outside the training loop (see above) while rank 0 waits in it" in text
    assert "gone" not in text and "NO REPORT" not in text


# ---------------------------------------------------------------------- issue 15: uneven inputs, watchdog only
LIGHTNING = os.sep + os.path.join("venv", "lib", "lightning", "pytorch")


def test_locate_names_lightnings_per_batch_broadcast_from_the_innermost_user_frame():
    stack = [
        (f"{TORCH}{os.sep}distributed{os.sep}distributed_c10d.py", 3787, "broadcast"),
        (f"{TORCH}{os.sep}distributed{os.sep}c10d_logger.py", 83, "wrapper"),
        (f"{LIGHTNING}{os.sep}loops{os.sep}training_epoch_loop.py", 265, "_broadcast_sigterm_tensor"),
        (f"{LIGHTNING}{os.sep}loops{os.sep}training_epoch_loop.py", 300, "advance"),
        ("/home/u/train.py", 80, "fit_model"),
        ("/home/u/train.py", 95, "main"),
    ]
    state, where = hw.locate(stack, None)
    assert (state, where) == (
        "waiting",
        "collective torch.distributed.broadcast (Lightning's per-batch _broadcast_sigterm_tensor, before the next "
        "training batch) from /home/u/train.py:80 in fit_model",
    )


def test_locate_names_the_innermost_user_frame_not_the_fit_line():
    # manual optimization: the user's training_step calls manual_backward; trainer.fit (line 90) is further out
    stack = [
        (f"{TORCH}{os.sep}autograd{os.sep}graph.py", 829, "_engine_run_backward"),
        (f"{TORCH}{os.sep}_tensor.py", 625, "backward"),
        (f"{LIGHTNING}{os.sep}core{os.sep}module.py", 1101, "manual_backward"),
        ("/home/u/train.py", 31, "training_step"),
        (f"{LIGHTNING}{os.sep}loops{os.sep}optimization{os.sep}manual.py", 130, "advance"),
        ("/home/u/train.py", 90, "main"),
    ]
    assert hw.locate(stack, None) == (
        "waiting",
        "backward pass: DDP's gradient all-reduce from /home/u/train.py:31 in training_step",
    )


def uneven_report(rank: int, state: str, where: str, batches: int, *, per_batch: bool) -> dict[str, Any]:
    return {**report(rank, state, where, step=6), "epoch": 0, "batches": batches, "per_batch": per_batch}


def test_summary_names_uneven_inputs_instead_of_a_rank_dependent_branch():
    reports = {
        0: uneven_report(0, "waiting", "collective torch.distributed.broadcast (...)", 7, per_batch=True),
        1: uneven_report(1, "waiting", "barrier 'weight-sync:step-6' at t.py:9 in main", 6, per_batch=False),
    }
    text = hw.summarize(reports, {}, 2, trigger="t", exit_code=124, now=100.0)
    assert "rank 1: ran out of training batches while rank 0 still had one (uneven inputs" in text
    assert "so rank 0 waits in a per-batch collective no other rank enters" in text
    assert "Batches started per rank in its epoch: rank 0: 7 (epoch 0), rank 1: 6 (epoch 0)." in text
    assert "no majority" not in text and "gone" not in text


def test_summary_names_uneven_inputs_when_the_rank_that_ran_out_left_the_training_loop():
    reports = {0: uneven_report(0, "waiting", "backward pass: DDP's gradient all-reduce", 7, per_batch=True)}
    left = Position(kind="barrier", name="teardown", since=90.0, heartbeat=99.5, epoch=0, epoch_batch=6)
    text = hw.summarize(reports, {1: left}, 2, trigger="t", exit_code=124, now=100.0, stale_after=3.0)
    assert "rank 1: ran out of training batches while rank 0 still had one" in text
    assert "rank 1: alive but outside the training loop (see above) while rank 0 waits in it" in text
    assert "gone" not in text and "NO REPORT" not in text


def test_summary_no_uneven_verdict_when_the_ranks_started_as_many_batches():
    # rank 1 is stuck in its own code in the batch rank 0 waits in: not uneven inputs
    reports = {
        0: uneven_report(0, "waiting", "backward pass: DDP's gradient all-reduce", 3, per_batch=True),
        1: uneven_report(1, "running", "its own code at t.py:9 in training_step", 3, per_batch=False),
    }
    text = hw.summarize(reports, {}, 2, trigger="t", exit_code=124, now=100.0)
    assert "uneven" not in text
    assert "rank 1: running its own code (not in any collective) while rank 0 waits for it" in text


UNEVEN_SCRIPT = SCRIPTS / "uneven_watchdog.py"
FIT_LINE = next(n for n, line in enumerate(UNEVEN_SCRIPT.read_text().splitlines(), 1) if "trainer.fit(" in line)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("weight_check", [True, False], ids=["weight-check", "no-weight-check"])
def test_uneven_inputs_rank_that_ran_out_is_alive_and_the_other_waits_in_a_collective(tmp_path, weight_check):
    """Issue 15's report: rank 0 has 8 batches, rank 1 6; the watchdog alone (no desync detection, no count check).

    Rank 0 waits in a C++ collective (Lightning's per-batch broadcast, or DDP's gradient all-reduce before
    Lightning 2.5) at the innermost user frame; rank 1 ran out of batches and is alive: in the epoch-end weight
    check (its watchdog still on) or, without it, outside the training loop. It is never called gone nor killed.
    """
    dumps = tmp_path / "dumps"
    args = [str(UNEVEN_SCRIPT), "--timeout", "6", "--grace", "3", "--dump-dir", str(dumps)]
    run = run_script(args + ([] if weight_check else ["--no-weight-check"]), timeout=120)
    assert not run.timed_out and not run.orphans, run.describe()
    assert run.returncode == hw.HANG_EXIT_CODE, run.describe()
    assert "rank=1 step=6" in run.output and "rank=1 step=7" not in run.output, run.describe()
    summary = summary_of(run)
    user = f" from tests/scripts/uneven_watchdog.py:{FIT_LINE} in main;"  # no user code is deeper on the stack
    waits = (
        "rank 0: waiting in collective torch.distributed.broadcast (Lightning's per-batch _broadcast_sigterm_tensor",
        "rank 0: waiting in backward pass: DDP's gradient all-reduce",
    )
    line0 = next(line for line in summary.splitlines() if line.startswith("  rank 0: "))
    assert line0.strip().startswith(waits) and user in line0, summary
    if weight_check:
        assert "rank 1: waiting in barrier 'weight-sync:step-6'" in summary, summary
        assert "last progress: on_train_epoch_end (epoch 0)" in summary
    else:
        assert "rank 1: alive, no report (its watchdog is off: it has left the training loop); " in summary, summary
        assert "rank 1: alive but outside the training loop (see above) while rank 0 waits in it" in summary
    assert "rank 1: ran out of training batches while rank 0 still had one (uneven inputs" in summary
    assert "Batches started per rank in its epoch: rank 0: 7 (epoch 0), rank 1: 6 (epoch 0)." in summary
    for wrong in ("gone", "died", "dead", "NO REPORT", "no majority"):
        assert wrong not in summary, summary
    assert "HangWatchdog: killed rank" not in run.output and "unresponsive" not in run.output, run.describe()
    assert (dumps / "hang-rank0.txt").exists()
    assert run.seconds < 90, run.describe()


def test_the_report_exchange_costs_each_rank_the_same_few_store_operations_at_8_and_32_ranks(tmp_path):
    # before issue 32 every rank polled `check` of all W report keys every 50 ms and each summarising look read
    # them one by one: O(W) keys per poll and rank. Now each rank's polls read one counter, and only the lowest
    # reporting rank reads the reports, in batches
    from ddp_strategy.callbacks.hang_alarm import HangAlarm
    from tests.test_control_scale import CountingStore

    per_rank = {}
    for world_size in (8, 32):
        shared = dist.HashStore()
        stores = [CountingStore(shared) for _ in range(world_size)]
        emitted: list[str] = []
        alarms = [
            HangAlarm(
                rank=r,
                world_size=world_size,
                control=None,
                store=stores[r],  # type: ignore[arg-type]
                folder=tmp_path / str(world_size),
                exit_code=124,
                grace_period=20.0,
                step=lambda: 7,
                progress=lambda: (time.monotonic() - 30, "on_train_batch_end (batch 3)"),
                emit=emitted.append,
            )
            for r in range(world_size)
        ]
        reports = [a.report("rank 3 made no progress for 30 s") for a in alarms]
        emitted.clear()  # the stack dumps
        for store in stores:
            store.ops = store.keys = 0
        threads = [
            threading.Thread(target=a._coordinate, args=(s, rep, "rank 3 made no progress for 30 s"))
            for a, s, rep in zip(alarms, stores, reports, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a simulated rank hung"
        summaries = [e for e in emitted if e.startswith("===== HangWatchdog: training hung")]
        assert len(summaries) == 1, emitted  # one summary, by the lowest rank, naming every rank's report
        assert "Every rank now exits with code 124." in summaries[0]
        assert f"rank 0-{world_size - 1}: running" in summaries[0], summaries[0]  # every rank's report is in it
        readers = [s for s in stores if s.by_key.get("multi_get")]
        assert len(readers) == 1 and readers[0] is stores[0]  # rank 0 summarised, reading the reports in batches
        assert readers[0].by_key["multi_get"] == -(-world_size // 256)
        # every rank: set, append, add, then polls of one counter (paced at 50 ms: how many depends on the clock),
        # one read of who reported; the others a look at `done` per poll and one add; keys touched per op: one
        polls = [s.by_key.get("hang/reported-count", 0) + s.by_key.get("hang/done", 0) for s in stores]
        others = [s.keys - n for s, n in zip(stores[1:], polls[1:], strict=True)]
        assert max(others) <= 6, others
        per_rank[world_size] = max(others)
    assert per_rank[32] == per_rank[8]
