"""Collective desync detection: a collective only some ranks reach, or uneven data, is named on every rank in seconds.

Each case runs ``tests/scripts/desync.py``, a user's LightningModule with the mistake at a line marked
``USER-LINE <case>``, on 2 CPU ranks with ``SafeDDPStrategy()`` and its defaults (in fit, validation, test or
predict). Asserted: the error type on every rank, the user's line in the message, the time from the divergence (the
script prints it) to the last rank's exit, a non-zero exit and no process left behind; also under torchrun, with the
spawn launcher and on 2 GPUs (NCCL). The correct-but-slow case must finish without any alarm, and stock Lightning's
own symptom on every case (a silent hang, silently mixed values, an unnamed crash) is asserted on the same script.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed

from ddp_strategy.desync import (
    CallLedger,
    CallNotes,
    CollectiveCall,
    DesyncMonitor,
    RankReport,
    calls_from_trace,
    find_divergence,
    stale_waits,
)
from ddp_strategy.errors import CollectiveMismatchError, UnevenInputsError
from ddp_strategy.positions import Position
from tests.proc import SCRIPTS, Run, run_script, run_script_until, stock_fit_finished

# each case is asserted to be named within seconds of the divergence: run alone (make test)
pytestmark = pytest.mark.serial

SCRIPT = SCRIPTS / "desync.py"
SOURCE = SCRIPT.read_text().splitlines()


def user_line(case: str) -> str:
    number = next(i for i, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"USER-LINE {case}"))
    return f"desync.py:{number}"


def diverged_at(output: str) -> float:
    return min(float(t) for t in re.findall(r"diverged-at=([\d.]+)", output))


def exits_at(output: str) -> list[float]:
    return [float(t) for t in re.findall(r"exits-at=([\d.]+)", output)]


CASES = {
    # case: (error type, the user's line the message must name)
    "log-in-rank-zero-branch": ("CollectiveMismatchError", "self.log('x', sync_dist=True) in on_train_epoch_end"),
    # a gloo all-reduce paired with a larger one of another rank aborts the process: the value must not be one
    "log-in-training-step-rank-zero": (
        "CollectiveMismatchError",
        "self.log('step_x', sync_dist=True) in training_step",
    ),
    "broadcast-on-rank-zero": ("CollectiveMismatchError", "strategy.broadcast"),
    "all-gather-on-rank-zero": ("CollectiveMismatchError", "self.all_gather"),
    "differing-keys": ("CollectiveMismatchError", "self.log('loss_rank0', sync_dist=True) in training_step"),
    "metric-compute-on-rank-zero": ("CollectiveMismatchError", "torchmetrics"),
    "all-gather-shapes": ("CollectiveMismatchError", "the ranks passed tensors of different shapes"),
    "validation-rank-zero": ("CollectiveMismatchError", "self.log('val_x', sync_dist=True) in on_validation_epoch_end"),
    "validation-step-rank-zero": ("CollectiveMismatchError", "Lightning's all_gather"),
    "test-rank-zero": ("CollectiveMismatchError", "self.log('test_x', sync_dist=True) in on_test_epoch_end"),
    "predict-rank-zero": ("CollectiveMismatchError", "Lightning's all_gather"),
    "uneven-iterable": ("UnevenInputsError", "rank(s) 1 ran out of training batches while rank(s) 0 still had one"),
}

#: where rank 1 waits when rank 0 is in its rank-0-only collective of an evaluation: one of the strategy's barriers
#: (exact evaluation's at the end of the loop; after predict's batches, the preemption stop's end-of-stage gather,
#: which comes before the prediction gather), so the message names a barrier
STRATEGY_BARRIER = {
    "validation-rank-zero": "exact-eval:logged-keys",
    "validation-step-rank-zero": "exact-eval:batches-run",
    "test-rank-zero": "exact-eval:logged-keys",
    "predict-rank-zero": "preemption:predict-end",
}
STAGE_DONE = re.compile(r"rank=\d (fit|test|predict)-done")


def assert_named_on_every_rank(run: Run, case: str, *, within: float, details: bool = True) -> None:
    """The case's named error on both ranks, naming the user's line, every rank gone ``within`` s of the divergence.

    ``details``: also the backend-specific parts of the message (which call differs, where rank 1 waits), as on gloo.
    """
    assert not run.timed_out and not run.orphans and run.returncode != 0, run.describe()
    error, what = CASES[case]
    for rank in (0, 1):  # each rank printed the error: raised, or printed before the blocked rank's exit
        assert re.search(rf"\[rank{rank}\]: (ddp_strategy\.errors\.)?{error}: ", run.output), run.describe()
    assert what in run.output, run.describe()
    if case != "uneven-iterable":
        assert f"{user_line(case)} in " in run.output, run.describe()
    ended = exits_at(run.output)
    assert ended, run.describe()  # the rank that raised reached the script's end (the other one may os._exit)
    assert max(ended) - diverged_at(run.output) <= within, run.describe()
    assert not STAGE_DONE.search(run.output), run.describe()
    if not details:
        return
    if case == "all-gather-shapes":
        assert "rank 0: shape [1]" in run.output and "rank 1: shape [2]" in run.output, run.describe()
    elif case in STRATEGY_BARRIER:
        barrier = f"Rank(s) 1 wait at barrier '{STRATEGY_BARRIER[case]}'"
        assert barrier in run.output and "but rank(s) 0 never arrived" in run.output, run.describe()
    elif case != "uneven-iterable":
        assert "is the first that differs" in run.output, run.describe()
    else:
        assert "rank 0: 7 (epoch 0), rank 1: 6 (epoch 0)" in run.output, run.describe()
        assert "rank 1: waits in the strategy's barrier 'weight-sync" in run.output, run.describe()


#: the cases' runs overlap, this many at a time: most of a run is start-up and waiting, so the suite saves time
PARALLEL_RUNS = 3


def run_cases(cases: list[str], check: Callable[[Run, str], None]) -> None:
    """Run ``desync.py CASE`` for every case, ``PARALLEL_RUNS`` at a time, and ``check`` each; report every failure."""
    with ThreadPoolExecutor(max_workers=PARALLEL_RUNS) as pool:
        runs = dict(zip(cases, pool.map(lambda case: run_script([str(SCRIPT), case], timeout=150), cases), strict=True))
    failures = []
    for case, run in runs.items():
        try:
            check(run, case)
        except AssertionError as err:
            failures.append(f"{case}: {err}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.multiprocess
@pytest.mark.compat
def test_a_rank_dependent_sync_is_named_on_every_rank_within_seconds():
    run = run_script([str(SCRIPT), "log-in-rank-zero-branch"], timeout=150)
    assert_named_on_every_rank(run, "log-in-rank-zero-branch", within=12.0)  # 10 s named + teardown on a loaded CI
    # rank 1 went on into its next batch: no per-batch SIGTERM broadcast of Lightning's (skipped, or Lightning 2.4),
    # so its collective beside rank 0's is the gradient all-reduce (docs/diagnostics.md's example)
    assert "rank 1: all_reduce of Float[161] from DDP's gradient all-reduce (backward)" in run.output, run.describe()


@pytest.mark.multiprocess
def test_every_rank_dependent_collective_is_named_on_every_rank_within_seconds():
    """Every other case of ``CASES``, each in its own 2-rank run (runs overlapping, see PARALLEL_RUNS)."""
    cases = sorted(c for c in CASES if c != "log-in-rank-zero-branch")
    run_cases(cases, lambda run, case: assert_named_on_every_rank(run, case, within=12.0))


@pytest.mark.multiprocess
def test_a_rank_dependent_sync_is_named_on_every_rank_under_torchrun():
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = run_script([*torchrun, str(SCRIPT), "log-in-rank-zero-branch"], timeout=150)
    assert not run.timed_out and not run.orphans and run.returncode != 0, run.describe()
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: (ddp_strategy\.errors\.)?CollectiveMismatchError: ", run.output), (
            run.describe()
        )
    assert f"{user_line('log-in-rank-zero-branch')} in on_train_epoch_end" in run.output, run.describe()


@pytest.mark.multiprocess
def test_a_rank_dependent_sync_is_named_on_every_rank_with_the_spawn_launcher():
    """``SafeDDPStrategy(start_method="spawn")``: the ranks are the main process's children (they import the script
    anew); each prints the named error, and the main process (which prints ``exits-at``) exits with 1."""
    run = run_script([str(SCRIPT), "log-in-rank-zero-branch", "--launcher", "spawn"], timeout=150)
    assert_named_on_every_rank(run, "log-in-rank-zero-branch", within=12.0)
    assert run.returncode == 1, run.describe()
    assert f"{user_line('log-in-rank-zero-branch')} in on_train_epoch_end" in run.output, run.describe()


@pytest.mark.gpu(devices=2)
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["log-in-rank-zero-branch", "uneven-iterable"])
def test_a_rank_dependent_collective_is_named_on_every_rank_over_nccl(case: str):
    """The same mistakes on 2 GPUs: the data plane is NCCL (whose collectives run asynchronously on the device), the
    strategy's control plane stays on gloo. NCCL's abort path is slower to tear down: a looser time bound."""
    run = run_script([str(SCRIPT), case, "--accelerator", "gpu"], timeout=240)
    assert "distributed_backend=nccl" in run.output, run.describe()
    assert_named_on_every_rank(run, case, within=30.0, details=False)


@pytest.mark.multiprocess
def test_a_slow_rank_is_no_desync():
    run = run_script([str(SCRIPT), "slow-rank-zero"], timeout=150)
    assert run.returncode == 0 and not run.timed_out and not run.orphans, run.describe()
    assert run.output.count("fit-done") == 2 and "CollectiveMismatchError" not in run.output, run.describe()


#: a stock run silent this long after its divergence (and still running) is a hang; gloo's own timeout is 30 min
STOCK_SILENCE = 15.0
GLOO_PEER_GONE = re.compile(
    r"RuntimeError: \[[^\]]*gloo[^\]]*\] (Connection closed by peer|Read error .*Connection reset)"
)


def stock_hang(run: Run) -> None:
    """Rank 0 took the branch and waits in its collective, rank 1 in the next one: no output, no error, nobody
    returns or exits, STOCK_SILENCE s after the divergence (the run was stopped, its group killed)."""
    assert run.stopped and run.returncode == -signal.SIGKILL, "not still running after the divergence"
    assert re.findall(r"rank=(\d) diverged-at=", run.output) == ["0"], "rank 0 alone took the branch"
    after = run.output.split("diverged-at=", 1)[1]
    for text in ("Error", "Traceback", "exits-at=", "-done"):
        assert text not in after, f"{text!r} after the divergence"


def stock_mixes_values(run: Run) -> None:
    """differing-keys: the backend pairs rank 0's ``loss_rank0`` with rank 1's ``loss_rank1``; fit returns on both
    ranks, no error, and each rank's logged value is the mean of both ranks' different metrics."""
    assert stock_fit_finished(run) and not run.stopped, "fit did not finish"
    assert "rank=0 fit-done" in run.output and "rank=1 fit-done" in run.output
    assert "Error" not in run.output and "Traceback" not in run.output
    values = {int(r): (float(synced), float(own)) for r, synced, own in LOGGED.findall(run.output)}
    (synced0, own0), (synced1, own1) = values[0], values[1]
    assert own0 != own1 and synced0 == pytest.approx(synced1, abs=2e-6), values
    assert synced0 == pytest.approx((own0 + own1) / 2, abs=2e-6), values


LOGGED = re.compile(r"rank=(\d) loss_rank\1=([-\d.]+) own=([-\d.]+)")


def stock_peer_gone(stage: str, case: str | None = None, *, in_traceback: bool = True) -> Callable[[Run], None]:
    """Rank 1 returns from ``stage`` as if all went well and exits; rank 0, still waiting in its collective, fails
    with gloo's unnamed "the peer went away" RuntimeError. Its traceback shows the ``case``'s user line when the
    collective ran there (``in_traceback``), not when Lightning deferred it (``self.log`` in an epoch-end hook is
    reduced later, by the loop)."""

    def check(run: Run) -> None:
        assert not run.stopped and not run.timed_out
        # rank 0 is the launcher's process: its exit code (an abort at interpreter exit happens, see stock_fit_finished)
        aborted_at_exit = "terminate called without an active exception" in run.output
        assert run.returncode == 1 or (run.returncode == -signal.SIGABRT and aborted_at_exit), "rank 0's exit"
        assert f"rank=1 {stage}-done" in run.output and f"rank=0 {stage}-done" not in run.output
        assert re.search(rf"\[rank0\]: {GLOO_PEER_GONE.pattern}", run.output), "rank 0's gloo error"
        assert "[rank1]:" not in run.output, "rank 1 reported an error"
        if case is not None:
            line = f'desync.py", line {user_line(case).split(":")[1]}, in '
            assert (line in run.output) == in_traceback, f"the user's line in rank 0's traceback: {not in_traceback}"
        assert "CollectiveMismatchError" not in run.output and "UnevenInputsError" not in run.output

    return check


def stock_gloo_abort(run: Run) -> None:
    """all-gather-shapes: gloo aborts rank 0 (the launcher's process: SIGABRT) on the size mismatch, with its own
    hint; rank 1 then fails with an unnamed RuntimeError (the peer went away)."""
    assert not run.stopped and run.returncode == -signal.SIGABRT
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in run.output
    assert "Received data size doesn't match expected size" in run.output
    assert re.search(rf"\[rank1\]: {GLOO_PEER_GONE.pattern}", run.output), "rank 1's gloo error"
    assert "[rank0]:" not in run.output and "rank=0 exits-at" not in run.output  # rank 0 died in the abort
    assert not STAGE_DONE.search(run.output) and "CollectiveMismatchError" not in run.output


def stock_silent_completion(run: Run) -> None:
    """silent-pairing-at-end: each rank all-reduced another tensor; gloo paired them, fit returns on both ranks."""
    assert stock_fit_finished(run) and not run.stopped, "fit did not finish"
    assert "rank=0 fit-done" in run.output and "rank=1 fit-done" in run.output
    assert "Error" not in run.output and "Traceback" not in run.output


STOCK_SYMPTOMS: dict[str, Callable[[Run], None]] = {
    "log-in-rank-zero-branch": stock_hang,
    "log-in-training-step-rank-zero": stock_hang,  # Lightning's barrier before the value waits for rank 1's
    "broadcast-on-rank-zero": stock_hang,
    "all-gather-on-rank-zero": stock_hang,
    "metric-compute-on-rank-zero": stock_hang,
    "validation-rank-zero": stock_hang,
    "validation-step-rank-zero": stock_hang,
    "differing-keys": stock_mixes_values,
    "all-gather-shapes": stock_gloo_abort,
    "uneven-iterable": stock_peer_gone("fit"),  # rank 1's 12 steps paired with rank 0's first 12; no user line
    "test-rank-zero": stock_peer_gone("test", "test-rank-zero", in_traceback=False),
    "predict-rank-zero": stock_peer_gone("predict", "predict-rank-zero"),
    "silent-pairing-at-end": stock_silent_completion,
}


def run_stock(case: str) -> Run:
    def hung(output: str, idle: float) -> bool:
        return "diverged-at=" in output and idle >= STOCK_SILENCE

    return run_script_until([str(SCRIPT), case, "--strategy", "ddp"], timeout=120, stop=hung)


@pytest.mark.multiprocess
def test_stock_lightning_on_every_scenario():
    """Stock ``DDPStrategy`` on every case of the same script, each run stopped once its symptom is clear: each
    case's own symptom, none of them a named error.

    The runs overlap: the hangs start first (9 at a time, 18 processes), so the other runs start while they sleep
    through STOCK_SILENCE; the start-up (imports, ~4 s of CPU per rank) is most of the time. 45-75 s here.
    """
    assert STOCK_SYMPTOMS.keys() == {*CASES, "silent-pairing-at-end"}
    with ThreadPoolExecutor(max_workers=9) as pool:
        runs = dict(zip(STOCK_SYMPTOMS, pool.map(run_stock, STOCK_SYMPTOMS), strict=True))
    failures = []
    for case, run in runs.items():
        assert not run.orphans and not run.timed_out, f"{case}: {run.describe()}"
        try:
            STOCK_SYMPTOMS[case](run)
        except AssertionError as err:
            failures.append(f"{case}: {err}\n{run.describe()}")
    assert not failures, "\n\n".join(failures)


def call(seq: int, op: str = "all_reduce", shape: tuple[int, ...] = (), site: str = "", what: str = "", done=True):
    return CollectiveCall("0", seq, op, (shape,), ("Float",), site=site, what=what, done=done)


def test_the_first_differing_call_is_named_even_when_the_backend_paired_them():
    same = [call(1), call(2)]
    reports = {
        0: RankReport(0, (*same, call(3, what="self.log('x', sync_dist=True) in on_train_epoch_end"),
                          call(4, done=False)), "collective 0#4", 1.0),
        1: RankReport(1, (*same, call(3, what="Lightning's reduce_boolean_decision"), call(4, "broadcast", (1,),
                          done=False)), "collective 0#4", 1.0),
    }  # fmt: skip
    error = find_divergence(reports)
    assert isinstance(error, CollectiveMismatchError) and not isinstance(error, UnevenInputsError)
    text = str(error)
    assert "call #3 of the default process group is the first that differs" in text
    assert "rank 0: all_reduce of Float[] from self.log('x', sync_dist=True)" in text
    assert "rank 1: all_reduce of Float[] from Lightning's reduce_boolean_decision" in text


def test_same_calls_and_one_rank_running_is_no_divergence():
    calls = (call(1), call(2, done=False))
    reports = {0: RankReport(0, calls, "collective 0#2", 1.0), 1: RankReport(1, calls[:1], "", 0.0)}
    assert find_divergence(reports) is None


def test_a_rank_waiting_in_backward_for_a_rank_out_of_data_is_uneven_inputs():
    backward = "DDP's gradient all-reduce (backward)"
    reports = {
        0: RankReport(0, (call(7, shape=(33,), what=backward, done=False),), "collective 0#7", 1.0, epoch=0,
                      epoch_batch=7),
        1: RankReport(1, (), "barrier 3 'weights:epoch-end'", 1.0, epoch=0, epoch_batch=6),
    }  # fmt: skip
    error = find_divergence(reports)
    assert isinstance(error, UnevenInputsError) and error.batches == (7.0, 6.0)
    assert "rank 0: 7 (epoch 0), rank 1: 6 (epoch 0)" in str(error)


def test_a_rank_ahead_in_the_next_epoch_is_not_uneven_inputs_when_the_one_behind_is_out_of_its_batch():
    # rank 0 called a barrier alone at its epoch's end; rank 1 went on into the next epoch's first backward
    backward = "DDP's gradient all-reduce (backward)"
    reports = {
        0: RankReport(0, (), "barrier 9 'only_rank0'", 1.0, epoch=0, epoch_batch=8),
        1: RankReport(1, (call(40, shape=(33,), what=backward, done=False),), "collective 0#40", 1.0, epoch=1,
                      epoch_batch=1),
    }  # fmt: skip
    error = find_divergence(reports)
    assert isinstance(error, CollectiveMismatchError) and not isinstance(error, UnevenInputsError)
    assert "Rank(s) 0 wait at barrier 'only_rank0', but rank(s) 1 never arrived" in str(error)


def test_ledger_digests_agree_for_the_same_calls_and_name_the_first_different_one():
    a, b = CallLedger(), CallLedger()
    for ledger, name in ((a, "loss_rank0"), (b, "loss_rank1")):
        ledger.add("reduce on_train_epoch_end.loss torch.float32[] mean")
        ledger.add(f"reduce training_step.{name} torch.float32[] mean")
    assert a.digest_at(1) == b.digest_at(1) != 0 and a.digest_at(2) != b.digest_at(2)
    assert a.state == (2, a.digest_at(2))
    reports = {
        0: RankReport(0, (), "", 0.0, ledger=tuple(a.texts)),
        1: RankReport(1, (), "", 0.0, ledger=tuple(b.texts)),
    }
    error = find_divergence(reports)
    assert isinstance(error, CollectiveMismatchError)
    assert "through the strategy: call #2 is the first that differs" in str(error)
    assert "rank 0: reduce training_step.loss_rank0" in str(error) and "rank 1: reduce training_step.loss_rank1" in str(
        error
    )


def test_recorder_entries_become_calls_with_the_user_frame_and_the_strategys_note():
    notes = CallNotes()
    note = notes.begin("self.log('x', sync_dist=True) in on_train_epoch_end")
    notes.end(note)
    inside = (note[0] + note[1]) // 2
    entry = {
        "pg_id": 0, "collective_seq_id": 7, "profiling_name": "gloo:all_reduce", "input_sizes": [[]],
        "input_dtypes": ["Float"], "retired": False, "time_created_ns": inside,
        "frames": [
            {"name": "all_reduce", "filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 1},
            {"name": "on_train_epoch_end", "filename": "/home/me/model.py", "line": 34},
        ],
    }  # fmt: skip
    (called,) = calls_from_trace([entry], notes)
    assert (called.group, called.seq, called.op, called.done) == ("0", 7, "all_reduce", False)
    assert called.site == "/home/me/model.py:34 in on_train_epoch_end"
    assert called.what == "self.log('x', sync_dist=True) in on_train_epoch_end"
    (outside,) = calls_from_trace([{**entry, "time_created_ns": note[1] + 1}], notes)
    assert outside.what == ""  # not inside the note, no library frame


def test_a_rank_pending_in_a_call_another_rank_is_past_is_not_stuck():
    # rank 0 runs user code (torch.save of a large checkpoint) with DDP's asynchronous buffer broadcast #37 still
    # pending in the recorder; rank 1 completed #37 and waits in #38: slow, not diverged
    reports = {
        0: RankReport(0, (call(36), call(37, "broadcast", (4,), done=False)), "collective 0#37", 1.0),
        1: RankReport(1, (call(36), call(37, "broadcast", (4,)), call(38, done=False)), "collective 0#38", 1.0),
    }
    assert find_divergence(reports) is None
    assert stale_waits({0: "collective 0#37", 1: "collective 0#38"}) == {0}
    assert stale_waits({0: "collective 0#37", 1: "collective 1#3"}) == set()  # other groups: both may be blocked
    assert stale_waits({0: "collective 0#5", 1: "collective 0#5", 2: "barrier 4 'save'"}) == set()
    assert stale_waits({0: "collective 0#5"}, {1: {("0", 5)}}) == {0}


def test_every_rank_blocked_in_different_groups_is_still_a_divergence():
    reports = {
        0: RankReport(0, (call(5, done=False),), "collective 0#5", 1.0),
        1: RankReport(1, (call(4),), "barrier 2 'save'", 1.0),
    }
    error = find_divergence(reports)
    assert isinstance(error, CollectiveMismatchError)
    assert "Rank(s) 1 wait at barrier 'save'" in str(error)


class _Rank0Beat:
    """What :meth:`DesyncMonitor.rank0_stopping` reads of rank 0's heartbeat: rank 1's published position."""

    interval = 1.0

    def __init__(self, rank1_heartbeat: float | None) -> None:
        self.rank1_heartbeat = rank1_heartbeat

    def add_beat(self, hook: Callable[..., None]) -> None:
        pass

    def read_positions(self, store: object, ranks: list[int]) -> dict[int, Position | None]:
        beat = self.rank1_heartbeat
        every = {0: None, 1: None if beat is None else Position("training step", "3", heartbeat=beat)}
        return {rank: every[rank] for rank in ranks}


class _Rank0Control:
    """What :meth:`DesyncMonitor.rank0_stopping` reads of rank 0's control plane: a real store, two ranks."""

    rank, world_size = 0, 2

    def __init__(self, rank1_heartbeat: float | None) -> None:
        self.store = torch.distributed.HashStore()
        self.heartbeat = _Rank0Beat(rank1_heartbeat)

    def forget_at_close(self, *keys: str, shared: bool = False) -> None:
        pass


def test_rank0_exits_only_once_every_rank_holds_the_verdict():
    # CI, under load: rank 0 raised the agreed error and exited (its store with it) while rank 1's heartbeat thread
    # had not read the inquiry's reports yet: rank 1 failed with gloo's unnamed "Connection reset by peer"
    control = _Rank0Control(rank1_heartbeat=time.time())
    monitor = DesyncMonitor(control, CallNotes())  # type: ignore[arg-type]
    control.store.append("desync/holding", "0\n")  # each rank appends itself once it holds the verdict
    threading.Timer(0.5, lambda: control.store.append("desync/holding", "1\n")).start()
    start = time.monotonic()
    monitor.rank0_stopping()
    assert 0.5 <= time.monotonic() - start < 3.0
    assert control.store.check(["desync/rank0-stopping"])


def test_rank0_does_not_wait_for_a_dead_rank_or_after_a_gathered_verdict():
    dead = _Rank0Control(rank1_heartbeat=time.time() - 60)  # rank 1's heartbeat stopped a minute ago: it died
    start = time.monotonic()
    DesyncMonitor(dead, CallNotes()).rank0_stopping()  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0
    alive = _Rank0Control(rank1_heartbeat=time.time())
    start = time.monotonic()
    DesyncMonitor(alive, CallNotes()).rank0_stopping(await_verdicts=False)  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0
    assert dead.store.check(["desync/rank0-stopping"]) and alive.store.check(["desync/rank0-stopping"])


def assert_silent_pairing_named(run: Run, case: str) -> None:
    assert not run.timed_out and not run.orphans and run.returncode != 0, run.describe()
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: (ddp_strategy\.errors\.)?CollectiveMismatchError: ", run.output), (
            run.describe()
        )
    assert "of the default process group is the first that differs" in run.output, run.describe()
    rank0, rank1 = user_line("silent-pairing-rank0"), user_line("silent-pairing-rank1")
    assert f"rank 0: all_reduce of Float[1] at tests/scripts/{rank0} in on_train_epoch_end" in run.output, (
        run.describe()
    )
    assert f"rank 1: all_reduce of Float[1] at tests/scripts/{rank1} in on_train_epoch_end" in run.output, (
        run.describe()
    )
    assert max(exits_at(run.output)) - diverged_at(run.output) <= 12.0, run.describe()
    assert "fit-done" not in run.output, run.describe()


@pytest.mark.multiprocess
def test_calls_the_backend_pairs_silently_are_named_while_the_ranks_run_or_at_the_end():
    """Each rank all-reduces a tensor of one shape at its own line: gloo pairs them, nothing waits, values mix.

    ``silent-pairing``: the ranks run on for seconds and the heartbeat's audit names it; ``-at-end``: fit ends right
    after, and the comparison at the stage's end names it.
    """
    run_cases(["silent-pairing", "silent-pairing-at-end"], assert_silent_pairing_named)
