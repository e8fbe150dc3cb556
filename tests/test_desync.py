"""Collective desync detection: a collective only some ranks reach, or uneven data, is named on every rank in seconds.

Each case runs ``tests/scripts/desync.py``, a user's LightningModule with the mistake at a line marked
``USER-LINE <case>``, on 2 CPU ranks with ``SafeDDPStrategy()`` and its defaults. Asserted: the error type on every
rank, the user's line in the message, the time from the divergence (the script prints it) to the last rank's exit,
a non-zero exit and no process left behind. The correct-but-slow case must finish without any alarm, and stock
Lightning is shown to hang on the same script.
"""

from __future__ import annotations

import re

import pytest

from ddp_strategy.desync import CallLedger, CallNotes, CollectiveCall, RankReport, calls_from_trace, find_divergence
from ddp_strategy.errors import CollectiveMismatchError, UnevenInputsError
from tests.proc import SCRIPTS, run_script

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
    "broadcast-on-rank-zero": ("CollectiveMismatchError", "strategy.broadcast"),
    "all-gather-on-rank-zero": ("CollectiveMismatchError", "self.all_gather"),
    "differing-keys": ("CollectiveMismatchError", "self.log('loss_rank0', sync_dist=True) in training_step"),
    "metric-compute-on-rank-zero": ("CollectiveMismatchError", "torchmetrics"),
    "all-gather-shapes": ("CollectiveMismatchError", "the ranks passed tensors of different shapes"),
    "validation-rank-zero": ("CollectiveMismatchError", "self.log('val_x', sync_dist=True) in on_validation_epoch_end"),
    "uneven-iterable": ("UnevenInputsError", "rank(s) 1 ran out of training batches while rank(s) 0 still had one"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.compat) if c == "log-in-rank-zero-branch" else c for c in sorted(CASES)]
)
def test_a_rank_dependent_collective_is_named_on_every_rank_within_seconds(case: str):
    run = run_script([str(SCRIPT), case], timeout=150)
    assert not run.timed_out and not run.orphans and run.returncode != 0, run.describe()
    error, what = CASES[case]
    for rank in (0, 1):  # each rank printed the error: raised, or printed before the blocked rank's exit
        assert re.search(rf"\[rank{rank}\]: (ddp_strategy\.errors\.)?{error}: ", run.output), run.describe()
    assert what in run.output, run.describe()
    if case != "uneven-iterable":
        assert f"{user_line(case)} in " in run.output, run.describe()
    if case == "all-gather-shapes":
        assert "rank 0: shape [1]" in run.output and "rank 1: shape [2]" in run.output, run.describe()
    elif case == "validation-rank-zero":  # rank 1 went on to the strategy's barrier after validation
        assert "wait at barrier 'exact-eval:logged-keys'" in run.output, run.describe()
    elif case != "uneven-iterable":
        assert "is the first that differs" in run.output, run.describe()
    else:
        assert "rank 0: 7 (epoch 0), rank 1: 6 (epoch 0)" in run.output, run.describe()
        assert "rank 1: waits in the strategy's barrier 'weight-sync" in run.output, run.describe()
    ended = exits_at(run.output)
    assert ended, run.describe()  # the rank that raised reached the script's end (the other one may os._exit)
    assert max(ended) - diverged_at(run.output) <= 12.0, run.describe()  # 10 s named + teardown on a loaded CI
    assert "fit-done" not in run.output


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
def test_a_slow_rank_is_no_desync():
    run = run_script([str(SCRIPT), "slow-rank-zero"], timeout=150)
    assert run.returncode == 0 and not run.timed_out and not run.orphans, run.describe()
    assert run.output.count("fit-done") == 2 and "CollectiveMismatchError" not in run.output, run.describe()


@pytest.mark.multiprocess
def test_stock_lightning_hangs_silently_on_the_same_script():
    run = run_script([str(SCRIPT), "log-in-rank-zero-branch", "--strategy", "ddp"], timeout=45)
    assert run.timed_out and "fit-done" not in run.output, run.describe()
    assert "Error" not in run.output.split("diverged-at=")[-1], run.describe()  # nothing named: a silent hang


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
