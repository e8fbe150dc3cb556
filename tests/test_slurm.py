"""SafeDDPStrategy and stock DDPStrategy under a real one-node SLURM (``.ci/slurm-cluster.sh``, ``make test-slurm``).

Every job is a 2-task sbatch script (``--nodes=1 --ntasks-per-node=2``, ``srun --label python SCRIPT``, so each
line of ``job.out`` starts with its task number) running ``tests/scripts/slurm_train.py`` (or ``scenario.py`` for
the barrier) with ``Trainer(devices=2, num_nodes=1)``; Lightning's ``SLURMEnvironment`` gives each task its rank.
States and exit codes come from ``scontrol show job -o`` (``ExitCode=`` is the batch script's ``code:signal``), each
task's own exit from slurmd's log, and every test ends with no process of its job left (found by the job's
``SLURM_JOB_ID`` in their environment, and by the PIDs the script wrote). Jobs run one at a time (2 cores).

The cluster: ``KillWait=30`` (SIGTERM, then SIGKILL 30 s later), ``JobRequeue=1``, ``AuthInfo=cred_expire=5`` (a
requeued job may start again 6 s after the requeue instead of 121 s) and ``sched_interval=2``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from ddp_strategy.checkpoint.format import verify
from tests.slurm import SCRIPTS, CannotRun, Cluster, Job, start_cluster, stop_cluster

SKIP_OUTSIDE_MAKE_TEST_SLURM = pytest.mark.skipif(
    os.environ.get("DDP_STRATEGY_SLURM_TESTS") != "1",
    reason="SLURM tests run in `make test-slurm` (a one-node cluster on localhost, needs root; "
    "DDP_STRATEGY_SLURM_TESTS=1 runs them here)",
)

F = TypeVar("F", bound=Callable[..., Any])


def runs_jobs(test: F) -> F:
    """Mark a test that runs jobs on the cluster: marker ``slurm``; skipped (with the reason) outside
    ``make test-slurm``, so that ``make test`` does not run them a second time."""
    return pytest.mark.slurm(SKIP_OUTSIDE_MAKE_TEST_SLURM(test))


KILL_WAIT = 30.0  # the cluster's KillWait: seconds between scancel's SIGTERM and its SIGKILL
STRATEGIES = ["safe_ddp", "ddp"]  # SafeDDPStrategy, stock lightning.pytorch.strategies.DDPStrategy

#: the preemption line of ddp_strategy.preemption.stop_message when the rank itself received the signal
STOP = re.compile(
    r"ddp_strategy: preempted: rank (\d) received (SIG\w+) at step (\d+); all 2 rank\(s\) stopped after step "
    r"(\d+) \(([\d.]+) s after the signal\) and saved (\S+); resume with trainer\.fit\(\.\.\., ckpt_path=\"last\"\)\. "
    r"Exiting with code (\d+) \((SIG\w+)\)\."
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the session, state in a tmp dir; stopped at the end (also when a test failed)."""
    directory = tmp_path_factory.mktemp("slurm-cluster")
    try:
        started = start_cluster(directory)
    except CannotRun as e:
        pytest.skip(f"no SLURM cluster on this machine: {e}")
    try:
        yield started
    finally:
        stop_cluster(directory)


@pytest.fixture(autouse=True)
def no_job_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that runs jobs (passed or not), nothing of any job submitted so far still runs."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    cluster = request.getfixturevalue("cluster")
    yield
    for job in cluster.jobs:
        job.clean_up()


def train_args(directory: Path, strategy: str, *extra: str) -> list[str]:
    return [
        str(SCRIPTS / "slurm_train.py"),
        *("--strategy", strategy, "--progress-dir", str(directory / "progress")),
        *("--ckpt-dir", str(directory / "ckpt"), "--every-n-train-steps", "4"),
        *extra,
    ]


#: the fit of the requeue test and of its uninterrupted reference: 2 epochs of 16 steps; at step 8 (mid-epoch 0)
#: both ranks pause 3 s, where the requeue test sends SIGUSR1
FIT = ["--max-epochs", "2", "--train-size", "256", "--step-sleep", "0.05", "--pause-at-step", "8", "--pause", "3"]
FIT_STEPS = 32
#: SafeDDPStrategy's start-up line when every rank's global seed and training sampler seed agree
SEEDS_AGREE = "ddp_strategy: seeds agree on all 2 rank(s): global seed 1234, training DistributedSampler seed 1234."


def lines_of(output: str, task: int) -> list[str]:
    """The lines task ``task`` printed (``srun --label`` prefixes them with ``<task>: ``)."""
    prefix = f"{task}: "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def checkpoint_steps(directory: Path) -> dict[str, int]:
    return {p.name: int(torch.load(p, weights_only=False)["global_step"]) for p in directory.glob("*.ckpt")}


def max_abs_diff(a: Path, b: Path) -> float:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


#: what a task printed when it aborted at interpreter exit (SIGABRT) after its run: stock Lightning destroys its
#: process group at exit for NCCL only (tests/proc.py ``stock_fit_finished``); a stock task did it in CI on 2026-11-27
ABORT_AT_EXIT = "terminate called without an active exception"


def assert_ended_well(job: Job, record: dict[str, str], restarts: str, strategy: str, output: str) -> None:
    """The job's last run ended with every task's exit code 0: COMPLETED, 0:0, ``restarts`` restarts. For stock
    DDPStrategy a task may instead have aborted at interpreter exit after printing that it finished (the job is
    then FAILED with 134:0, that task "signal 6"): accepted for the stock baseline only, never for safe_ddp."""
    exits = job.task_exits()[-2:]
    if strategy == "ddp" and (record["JobState"], record["ExitCode"]) == ("FAILED", "134:0"):
        assert record["Restarts"] == restarts, job.describe()
        for e in exits:
            lines = "\n".join(lines_of(output, e.task))
            finished = lines.find(f"slurm_train: rank {e.task} finished at step {FIT_STEPS}")
            assert e.outcome == "exit code 0" or (
                e.outcome == "signal 6" and 0 <= finished < lines.find(ABORT_AT_EXIT)
            ), job.describe()
        print(f"stock: a task aborted at interpreter exit after finishing: {exits}")
        return
    state = (record["JobState"], record["ExitCode"], record["Restarts"])
    assert state == ("COMPLETED", "0:0", restarts), job.describe()
    assert sorted((e.task, e.outcome) for e in exits) == [(0, "exit code 0"), (1, "exit code 0")], exits


def assert_no_process_left(job: Job) -> None:
    assert not job.processes(), f"processes of job {job.id} left: {job.processes()}\n{job.describe()}"


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run(strategy)``: the uninterrupted fit (once per module) -> (job, its record, the final weights)."""
    done: dict[str, tuple[Job, dict[str, str], Path]] = {}

    def run(strategy: str) -> tuple[Job, dict[str, str], Path]:
        if strategy not in done:
            directory = tmp_path_factory.mktemp(f"fit-{strategy}")
            weights = directory / "final.pt"
            args = train_args(directory, strategy, *FIT, "--save-weights", str(weights))
            job = cluster.submit(directory, f"fit-{strategy}", args, sbatch=("--requeue",))
            record = job.wait_until_gone(timeout=150)
            done[strategy] = (job, record, weights)
        return done[strategy]

    return run


@runs_jobs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fit_completes_under_srun_with_slurm_environment(uninterrupted: Any, strategy: str) -> None:
    """a. A plain fit: COMPLETED, exit code 0:0, every task exits 0; each rank got its rank from SLURM
    (SLURMEnvironment, SLURM_PROCID) and Lightning initialised 2 members; the weights are saved."""
    job, record, weights = uninterrupted(strategy)
    output = job.output()
    assert_ended_well(job, record, "0", strategy, output)
    name = "SafeDDPStrategy" if strategy == "safe_ddp" else "DDPStrategy"
    for rank in (0, 1):
        lines = "\n".join(lines_of(output, rank))
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in lines, job.describe()
        assert re.search(
            rf"slurm_train: rank {rank} of 2 \(local rank {rank}, node 0\), pid \d+, cluster environment "
            rf"SLURMEnvironment, SLURM_PROCID={rank}, SLURM_JOB_ID={job.id}, SLURM_RESTART_COUNT=0, strategy {name}$",
            lines,
            re.M,
        ), job.describe()
        assert f"slurm_train: rank {rank} finished at step {FIT_STEPS}" in lines, job.describe()
    assert torch.load(weights, weights_only=True).keys() >= {"net.0.weight", "net.3.weight"}
    assert checkpoint_steps(job.directory / "ckpt")["last.ckpt"] == FIT_STEPS
    if strategy == "safe_ddp":
        assert SEEDS_AGREE in output, job.describe()
    assert_no_process_left(job)


def cancel_mid_epoch(
    cluster: Cluster, tmp_path: Path, strategy: str, *, pause: bool
) -> tuple[Job, dict[str, str], int, float, float]:
    """Submit a 4-epoch fit (16 steps per epoch, 0.1 s per step, checkpoints every 4 steps) and ``scancel`` it
    once both ranks passed step 5 (``pause``: while both pause 3 s after step 6, so that the signal arrives
    there). Returns the job, its final record, the step reached at the cancel, its time, and when the job was
    gone (no process left)."""
    extra = ["--pause-at-step", "6", "--pause", "3"] if pause else []
    args = train_args(tmp_path, strategy, "--max-epochs", "4", "--train-size", "256", "--step-sleep", "0.1", *extra)
    job = cluster.submit(tmp_path, f"cancel-{strategy}", args)
    reached = job.wait_for_step(6 if pause else 5, timeout=150, paused=pause)
    sent = job.cancel()
    record = job.wait_until_gone(timeout=KILL_WAIT + 30)
    return job, record, reached, sent, time.time()


@runs_jobs
@pytest.mark.timeout(200)
def test_scancel_mid_epoch_stops_safe_ddp_at_one_step_with_a_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    """b. ``scancel`` mid-epoch, while the ranks train (SIGTERM to every task): each rank prints one stop line
    naming SIGTERM, no "failed" wording; both stop after one agreed step >= the step reached at the cancel, save
    a checkpoint there that verifies, exit 143 and are gone well before KillWait's SIGKILL; the job is CANCELLED
    (the batch shell was killed by the SIGTERM: ExitCode 0:15)."""
    job, record, reached, sent, gone = cancel_mid_epoch(cluster, tmp_path, "safe_ddp", pause=False)
    assert (record["JobState"], record["ExitCode"]) == ("CANCELLED", "0:15"), job.describe()
    exits = job.task_exits()
    assert sorted((e.task, e.outcome) for e in exits) == [(0, "exit code 143"), (1, "exit code 143")], exits
    print(f"safe_ddp: reached step {reached}; tasks out {[round(e.time - sent, 1) for e in exits]} s after scancel")
    assert all(e.time - sent < KILL_WAIT for e in exits), (sent, exits)
    assert gone - sent < KILL_WAIT, (sent, gone)
    output = job.output()
    stops = {}
    for rank in (0, 1):
        lines = [line for line in lines_of(output, rank) if line.startswith("ddp_strategy: preempted:")]
        assert len(lines) == 1, job.describe()
        assert "fail" not in lines[0].lower(), lines[0]
        m = STOP.fullmatch(lines[0])
        assert m, lines[0]
        assert (int(m[1]), m[2], m[7], m[8]) == (rank, "SIGTERM", "143", "SIGTERM"), lines[0]
        assert float(m[5]) < KILL_WAIT, lines[0]
        stops[rank] = (int(m[4]), m[6])
    assert stops[0] == stops[1], stops
    step, path = stops[0]
    assert step >= reached, (step, reached)
    assert Path(path) == tmp_path / "ckpt" / "last.ckpt"
    assert verify(path).global_step == step
    assert "Traceback" not in output, job.describe()
    assert_no_process_left(job)


@runs_jobs
@pytest.mark.timeout(200)
def test_scancel_mid_epoch_stock_ddp_saves_nothing_at_the_signal(cluster: Cluster, tmp_path: Path) -> None:
    """b, stock DDPStrategy; the signal arrives while both ranks pause after step 6 (so the step is exact). Both
    ranks print Lightning's ``Received SIGTERM`` (then ``Bypassing SIGTERM``: its SLURM auto-requeue handler),
    and nothing is saved at or after the signal: the newest checkpoint is the periodic one of step 4. What the
    tasks do then varies: here they ended with exit code 0 a few seconds later (Lightning's SIGTERMException, a
    SystemExit without a code); the issue's trial (signal while training) also saw them hang until KillWait's
    SIGKILL. Either is accepted; the job is CANCELLED."""
    job, record, reached, sent, gone = cancel_mid_epoch(cluster, tmp_path, "ddp", pause=True)
    assert (record["JobState"], record["ExitCode"]) == ("CANCELLED", "0:15"), job.describe()
    exits = job.task_exits()
    assert sorted(e.task for e in exits) == [0, 1], exits
    assert {e.outcome for e in exits} <= {"exit code 0", "signal 9"}, exits
    print(f"stock: reached step {reached}; tasks {[(e.task, e.outcome, round(e.time - sent, 1)) for e in exits]}")
    output = job.output()
    for rank in (0, 1):
        assert f"[rank: {rank}] Received SIGTERM: 15" in "\n".join(lines_of(output, rank)), job.describe()
    assert "ddp_strategy" not in output
    steps = checkpoint_steps(tmp_path / "ckpt")
    assert reached == 6 and steps == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4}, steps
    assert gone - sent < KILL_WAIT + 15, (sent, gone)
    assert_no_process_left(job)


def requeue_with_usr1(cluster: Cluster, tmp_path: Path, strategy: str) -> tuple[Job, dict[str, str], dict[str, str]]:
    """Submit the FIT with ``--requeue``; when both ranks pause at step 8, ``scancel --signal=USR1``: Lightning's
    SLURM handler saves ``hpc_ckpt_1.ckpt`` and runs ``scontrol requeue``, SLURM stops the tasks with SIGTERM and
    starts the job again. Returns the job, its record while it was pending for the restart, and its final one."""
    args = train_args(tmp_path, strategy, *FIT, "--save-weights", str(tmp_path / "final.pt"))
    job = cluster.submit(tmp_path, f"requeue-{strategy}", args, sbatch=("--requeue",))
    job.wait_for_step(8, timeout=150, paused=True)
    job.cancel("--signal=USR1")
    pending = job.wait_for_state({"PENDING"}, timeout=KILL_WAIT + 30)
    final = job.wait_until_gone(timeout=150)
    return job, pending, final


def assert_requeued_and_resumed(
    job: Job, pending: dict[str, str], final: dict[str, str], strategy: str
) -> tuple[str, str]:
    """Requeued once (Restarts=1), pending for its BeginTime, then ended well (``assert_ended_well``) from
    hpc_ckpt_1.ckpt at step 8; the output of the first and of the second run."""
    assert (pending["Restarts"], pending["Reason"]) == ("1", "BeginTime"), pending
    output = job.output()
    first, _, second = output.partition(f"job.sh: run 1 of job {job.id} starts")
    assert second, job.describe()
    assert_ended_well(job, final, "1", strategy, second)
    assert "Handling auto-requeue signal: 10" in first and f"Requeued SLURM job: {job.id}" in first, job.describe()
    hpc = job.directory / "hpc_ckpt_1.ckpt"
    assert f"Restored all states from the checkpoint at {hpc}" in second, job.describe()
    assert torch.load(hpc, weights_only=False)["global_step"] == 8
    for rank in (0, 1):
        lines = "\n".join(lines_of(second, rank))
        assert "SLURM_RESTART_COUNT=1" in lines and f"finished at step {FIT_STEPS}" in lines, job.describe()
    return first, second


@runs_jobs
@pytest.mark.timeout(360)
def test_usr1_requeue_resumes_safe_ddp_to_the_uninterrupted_weights(
    cluster: Cluster, uninterrupted: Any, tmp_path: Path
) -> None:
    """c. ``scancel --signal=USR1`` with Lightning's SLURM auto-requeue (its default): the hpc checkpoint at step 8
    verifies, the requeue's SIGTERM stops both ranks with the preemption line (exit 143), the job runs again
    (Restarts=1, after its BeginTime), resumes from ``hpc_ckpt_1.ckpt``, says the seeds agree (the training
    sampler seen through the resume), and ends with the uninterrupted run's weights: max difference 0.0."""
    _, _, reference = uninterrupted("safe_ddp")
    job, pending, final = requeue_with_usr1(cluster, tmp_path, "safe_ddp")
    first, second = assert_requeued_and_resumed(job, pending, final, "safe_ddp")
    assert verify(str(tmp_path / "hpc_ckpt_1.ckpt")).global_step == 8
    for rank in (0, 1):
        lines = [line for line in lines_of(first, rank) if line.startswith("ddp_strategy: preempted:")]
        assert len(lines) == 1 and (m := STOP.fullmatch(lines[0])), job.describe()
        assert (int(m[1]), m[2], m[7]) == (rank, "SIGTERM", "143"), lines[0]
        assert "fail" not in lines[0].lower()
    exits = [(e.task, e.outcome) for e in job.task_exits()]
    assert sorted(exits[:2]) == [(0, "exit code 143"), (1, "exit code 143")], exits
    assert sorted(exits[2:]) == [(0, "exit code 0"), (1, "exit code 0")], exits
    assert SEEDS_AGREE in second and "no shuffling DistributedSampler" not in job.output(), job.describe()
    assert max_abs_diff(reference, tmp_path / "final.pt") == 0.0
    assert "Traceback" not in job.output(), job.describe()
    assert_no_process_left(job)


@runs_jobs
@pytest.mark.timeout(360)
def test_usr1_requeue_resumes_stock_ddp_to_other_weights(cluster: Cluster, uninterrupted: Any, tmp_path: Path) -> None:
    """c, stock DDPStrategy: also requeued (Restarts=1) and resumed from ``hpc_ckpt_1.ckpt`` at step 8, but its final
    weights differ from its uninterrupted run's (the rest of the epoch's data order and the dropout RNG are not
    restored; Lightning warns that the dataloader is not resumable). The requeue's SIGTERM: Lightning prints
    ``Received SIGTERM`` and ``Bypassing SIGTERM``; its tasks then ended with exit code 0 here."""
    _, _, reference = uninterrupted("ddp")
    job, pending, final = requeue_with_usr1(cluster, tmp_path, "ddp")
    first, second = assert_requeued_and_resumed(job, pending, final, "ddp")
    for rank in (0, 1):
        assert f"[rank: {rank}] Received SIGTERM: 15" in "\n".join(lines_of(first, rank)), job.describe()
    assert "dataloader is not resumable" in second
    exits = [(e.task, e.outcome) for e in job.task_exits()]
    print(f"stock: task exits of the first run, then of the second: {exits}")
    assert max_abs_diff(reference, tmp_path / "final.pt") > 0.0
    assert_no_process_left(job)


#: the stop line of a task during ``trainer.test`` (tests/scripts/preempt_stages.py)
TEST_STOP = re.compile(
    r"ddp_strategy: preempted: rank (\d) (?:received SIGTERM at test batch \d+|stops for SIGTERM on rank \d \(at test "
    r"batch \d+\)); all 2 rank\(s\) stopped at test batch (\d+) \(([\d.]+) s after the signal\) and saved nothing: "
    r"trainer\.test did not finish; run it again\. Exiting with code 143 \(SIGTERM\)\."
)


@runs_jobs
@pytest.mark.timeout(200)
def test_scancel_during_trainer_test_ends_cancelled_with_143_and_one_line_per_task(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Issue 28: ``scancel`` while ``trainer.test`` runs (SIGTERM to every task, 200 test batches of 0.1 s): each
    task prints one stop line naming the test batch every task stopped at and that nothing was saved, exits 143
    well before KillWait, with no traceback; the job is CANCELLED (0:15), never a success."""
    args = [str(SCRIPTS / "preempt_stages.py"), "--stage", "test", "--eval-batches", "200", "--eval-sleep", "0.1"]
    job = cluster.submit(tmp_path, "test-stage", args)
    started = "ddp_strategy: test handshake passed on 2 rank(s)"  # rank 0's line as the test loop starts
    job.wait("the test loop to start", lambda: started in job.output(), timeout=150, poll=0.05)
    time.sleep(1.0)  # a few batches in
    sent = job.cancel()
    record = job.wait_until_gone(timeout=KILL_WAIT + 30)
    assert (record["JobState"], record["ExitCode"]) == ("CANCELLED", "0:15"), job.describe()
    exits = job.task_exits()
    assert sorted((e.task, e.outcome) for e in exits) == [(0, "exit code 143"), (1, "exit code 143")], exits
    assert all(e.time - sent < KILL_WAIT for e in exits), (sent, exits)
    output = job.output()
    lines = [TEST_STOP.fullmatch(line) for rank in (0, 1) for line in lines_of(output, rank) if "preempted" in line]
    assert len(lines) == 2 and all(lines), job.describe()
    assert len({m[2] for m in lines if m}) == 1, job.describe()  # one batch for both
    assert "Traceback" not in output and "finished test" not in output, job.describe()
    assert_no_process_left(job)


@runs_jobs
@pytest.mark.timeout(200)
def test_a_task_that_fails_before_fit_is_named_missing_with_slurms_causes(cluster: Cluster, tmp_path: Path) -> None:
    """Issue 29, point 1, under SLURM: task 1 fails before ``fit`` (exit 3); rank 0's rendezvous names rank 1 as
    missing with SLURM's likely causes (``--nodes``, ``--ntasks-per-node``, ``srun``, a task that failed) every 2 s,
    then raises ``RendezvousError`` at its 10 s timeout; the job FAILED, no process left."""
    args = [str(SCRIPTS / "rendezvous.py"), "--num-nodes", "1", "--devices", "2", "--interval", "2"]
    job = cluster.submit(tmp_path, "rendezvous-missing", [*args, "--timeout", "10", "--exit-on-rank", "1"])
    record = job.wait_until_gone(timeout=120)
    assert record["JobState"] == "FAILED", job.describe()
    assert sorted((e.task, e.outcome) for e in job.task_exits()) == [(0, "exit code 1"), (1, "exit code 3")]
    rank0 = "\n".join(lines_of(job.output(), 0))
    assert "cluster environment SLURMEnvironment). Joined: node 0 on " in rank0, job.describe()
    assert (
        "Missing: node 0: rank 1. Likely causes: SLURM started fewer than 2 tasks: the job needs --nodes=1 and "
        "--ntasks-per-node=2" in rank0
    ), job.describe()
    assert "or a task failed before this point" in rank0 and "RendezvousError" in rank0, job.describe()
    assert_no_process_left(job)


def barrier_job(cluster: Cluster, tmp_path: Path, strategy: str) -> tuple[Job, float]:
    """``scenario.py barrier_rank0_only --barrier-timeout 600``: rank 0 alone calls ``strategy.barrier("only_rank0")``
    at global step 2 (4 steps per epoch). Returns the job and when its training started (the first line of fit)."""
    args = [str(SCRIPTS / "scenario.py"), "barrier_rank0_only", "--out", str(tmp_path / "result.json")]
    job = cluster.submit(tmp_path, f"barrier-{strategy}", [*args, "--strategy", strategy, "--barrier-timeout", "600"])
    started = "SLURM auto-requeueing enabled. Setting signal handlers."  # Lightning's first line of fit, per rank
    job.wait("training to start", lambda: job.output().count(started) == 2, timeout=150, poll=0.05)
    return job, time.time()


def barrier_site() -> str:
    """Where scenario.py's rank-0-only barrier is called, as the package names call sites."""
    lines = (SCRIPTS / "scenario.py").read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if 'barrier("only_rank0")' in line)
    return f"scenario.py:{number} in training_step"


@runs_jobs
@pytest.mark.timeout(200)
def test_rank0_only_barrier_fails_safe_ddp_job_naming_the_barrier_on_every_task(
    cluster: Cluster, tmp_path: Path
) -> None:
    """d. A barrier reached by rank 0 only (barrier_timeout=600): the desync detection ends the job FAILED within
    20 s of the start of training (the barrier is 2 steps later); both tasks print the CollectiveMismatchError
    naming barrier 'only_rank0', its call site in training_step and rank 1, which never arrived; both exit 1; the
    backend's ``[c10d]`` warnings are 5 lines at most."""
    job, started = barrier_job(cluster, tmp_path, "safe_ddp")
    record = job.wait_until_gone(timeout=60)
    exits = job.task_exits()
    assert sorted((e.task, e.outcome) for e in exits) == [(0, "exit code 1"), (1, "exit code 1")], exits
    ended = max(e.time for e in exits)
    print(f"safe_ddp: tasks out {ended - started:.1f} s after training started")
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "1:0"), job.describe()
    assert ended - started < 20, (started, ended)
    output = job.output()
    rank0, rank1 = "\n".join(lines_of(output, 0)), "\n".join(lines_of(output, 1))
    for text in (rank0, rank1):  # each task prints the agreed error, with the barrier's call site
        assert "CollectiveMismatchError: Rank(s) 0 wait at barrier 'only_rank0' (" in text, job.describe()
        assert f"{barrier_site()})" in text and "but rank(s) 1 never arrived" in text, job.describe()
    # the store's wait warnings do not flood the output (control.py, issue 20)
    assert sum("[c10d]" in line for line in output.splitlines()) <= 5, job.describe()
    assert_no_process_left(job)


@runs_jobs
@pytest.mark.timeout(200)
def test_rank0_only_barrier_hangs_stock_ddp_job(cluster: Cluster, tmp_path: Path) -> None:
    """d, stock DDPStrategy: the job does not end by itself. barrier_timeout + 15 s after training started it is
    still RUNNING and nothing names the barrier or an error (it would wait for the process group's 30-minute
    timeout or the job's time limit). The test then SIGKILLs its tasks by PID (scancel would add KillWait's 30 s:
    neither rank runs Lightning's SIGTERM handler while blocked in a collective; not asserted here)."""
    job, started = barrier_job(cluster, tmp_path, "ddp")
    time.sleep(max(0.0, started + 10 + 15 - time.time()))
    assert job.info()["JobState"] == "RUNNING", job.describe()
    assert len(job.processes()) >= 2, job.describe()
    output = job.output()
    assert "only_rank0" not in output and "Error" not in output, job.describe()
    job.clean_up()
    job.wait_until_gone(timeout=60)
    assert_no_process_left(job)


def test_slurm_page_names_every_test_of_this_file_and_only_those() -> None:
    """docs/slurm.md backs its statements with the tests of this file: each one it names exists, and each test
    that runs jobs is named there."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "slurm.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", page))
    job_tests = {name for name, f in globals().items() if name.startswith("test_") and hasattr(f, "pytestmark")}
    job_tests = {name for name in job_tests if any(m.name == "slurm" for m in globals()[name].pytestmark)}
    assert len(job_tests) == 9 and named <= job_tests | {"test_sigusr1_is_handled_when_listed"}, named - job_tests
    assert job_tests <= named, job_tests - named
