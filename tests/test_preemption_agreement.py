"""The stop-step agreement of ddp_strategy.preemption, one process: ranks simulated over one HashStore."""

from __future__ import annotations

import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ddp_strategy.errors import DDPStrategyError
from ddp_strategy.preemption import (
    NoticeWatch,
    Preempted,
    PreemptionAgreement,
    evaluation_position,
    exit_code,
    parse_signals,
    stop_message,
    train_position,
    validation_position,
)


def agreements_with_watches(store: dist.Store, world_size: int, *, timeout: float = 30.0) -> list[PreemptionAgreement]:
    """One agreement per simulated rank, each with its NoticeWatch (a thread) on ``store``, as PreemptionHandling."""
    return [
        PreemptionAgreement(
            rank=r,
            world_size=world_size,
            start=train_position(0),
            watch=NoticeWatch(store, rank=r, renew=3600),
            timeout=timeout,
        )
        for r in range(world_size)
    ]


def lockstep(agreements: list[PreemptionAgreement], store: dist.Store, *, lag: dict[int, int], steps: int) -> dict:
    """Step the ranks in DDP's lockstep (no rank completes step k+1 before every rank reached boundary k); rank r
    reaches each boundary ``lag[r]`` turns late (0 or 1). Return the step each rank stopped at."""
    stopped: dict[int, int] = {}
    for step in range(1, steps + 1):
        for turn in (0, 1):
            for a in agreements:
                if a.rank in stopped or lag.get(a.rank, 0) != turn:
                    continue
                if a.at_step_boundary(store, step):
                    stopped[a.rank] = step
        if len(stopped) == len(agreements):
            break
    return stopped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signalled", [[0], [1], [2], [0, 1, 2]])
@pytest.mark.parametrize("lag", [{}, {1: 1}, {0: 1}])
def test_every_rank_stops_at_the_same_step_whoever_got_the_signal(signalled, lag):
    store = dist.HashStore()
    agreements = agreements_with_watches(store, 3)
    for step in range(1, 4):
        assert not any(a.at_step_boundary(store, step) for a in agreements)
    for r in signalled:
        agreements[r].request(signal.SIGTERM)
    stopped = lockstep(agreements, store, lag=lag, steps=20)
    assert len(stopped) == 3 and len(set(stopped.values())) == 1, stopped
    assert all(a.stop_after == agreements[0].stop_after for a in agreements)
    for a in agreements:
        if a.received is None:  # learned it from the store: names a rank that got the signal
            assert re.fullmatch(r"SIGTERM on rank (\d) \(at step \d+\)", a.describe_cause()), a.describe_cause()
            assert a.notice is not None and a.notice.rank in signalled


def run_ranks_freely(
    agreements: list[PreemptionAgreement],
    store: dist.Store,
    positions: dict[int, list],
    signal_at: tuple[int, int],
    pace: dict[int, float] | None = None,
) -> dict[int, tuple]:
    """Each rank a thread passing its own ``positions`` (no collective between them, as in validation), taking
    ``pace[r]`` seconds per batch; rank ``signal_at[0]`` gets SIGTERM after its ``signal_at[1]``-th boundary.
    Returns where each stopped, and checks that none passed a boundary after the agreed one."""
    stopped: dict[int, tuple] = {}
    passed: dict[int, list] = {r: [] for r in positions}

    def rank(r: int) -> None:
        for i, position in enumerate(positions[r]):
            passed[r].append(position)
            if agreements[r].at_boundary(store, position, f"batch {position[3]}"):
                stopped[r] = position
                return
            if (r, i) == signal_at:
                agreements[r].request(signal.SIGTERM)
            time.sleep((pace or {}).get(r, 0.0))

    threads = [threading.Thread(target=rank, args=(r,)) for r in positions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r, position in stopped.items():
        assert position == min(p for p in positions[r] if p > agreements[r].stop_after), (r, position)
        assert max(passed[r]) == position  # stopped at the first boundary after the agreed one, none later
    return stopped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signalled", [0, 1])
def test_ranks_without_a_collective_between_boundaries_stop_at_one_batch(signalled):
    """Validation batches: no collective keeps the ranks together, one rank runs far ahead (no waiting at all);
    whoever gets the signal, both stop at the same batch and neither passed it."""
    store = dist.HashStore()
    agreements = agreements_with_watches(store, 2)
    batches = [validation_position(4, 0, b, sanity=False) for b in range(1000)]
    pace = {0: 0.004, 1: 0.001}  # rank 1 runs four times as fast
    stopped = run_ranks_freely(agreements, store, {0: batches, 1: batches}, signal_at=(signalled, 30), pace=pace)
    assert stopped[0] == stopped[1], stopped


@pytest.mark.timeout(60)
def test_ranks_with_different_batch_counts_stop_at_the_same_point_of_the_sequence():
    """Exact evaluation: rank 1 has 3 batches, rank 0 has 400; the loop's end is a boundary of both. A signal on
    rank 1 after its first batch stops it at its loop end and rank 0 at its first batch after the agreed one (both
    before the loop's end collectives)."""
    store = dist.HashStore()
    agreements = agreements_with_watches(store, 2)
    end = evaluation_position(2**31 - 1, 0)
    positions = {
        0: [*(evaluation_position(0, b) for b in range(400)), end],
        1: [*(evaluation_position(0, b) for b in range(3)), end],
    }
    stopped = run_ranks_freely(agreements, store, positions, signal_at=(1, 0), pace={0: 0.001, 1: 0.02})
    assert stopped[1] == end and stopped[0] < end, stopped


@pytest.mark.timeout(30)
def test_a_rank_whose_peers_never_acknowledge_fails_naming_the_wait():
    store = dist.HashStore()
    watch = NoticeWatch(store, rank=0, renew=3600)  # rank 1 has no watch: it never acknowledges
    a = PreemptionAgreement(rank=0, world_size=2, start=train_position(0), watch=watch, timeout=0.5)
    a.request(signal.SIGTERM)
    assert not a.at_step_boundary(store, 3)  # publishes and acknowledges
    with pytest.raises(DDPStrategyError, match=r"Rank 0 waited 0 s .* SIGTERM on rank 0 \(at step 3\): 1 of 2 rank"):
        a.at_step_boundary(store, 4)
    watch.close()


def test_an_agreement_of_several_ranks_needs_a_watch():
    with pytest.raises(ValueError, match="needs a NoticeWatch"):
        PreemptionAgreement(rank=0, world_size=2, start=train_position(0))


def test_positions_order_the_boundaries_of_a_fit():
    sequence = [
        train_position(3),  # the start of a fit resumed at step 3
        validation_position(3, 0, 0, sanity=True),
        validation_position(3, 1, 5, sanity=True),
        train_position(4),
        validation_position(4, 0, 0, sanity=False),
        validation_position(4, 0, 2**31 - 1, sanity=False),
        train_position(5),
    ]
    assert sequence == sorted(sequence) and len(set(sequence)) == len(sequence)


def test_only_the_first_signal_counts():
    a = PreemptionAgreement(rank=0, world_size=1, start=train_position(0))
    a.request(signal.SIGUSR1)
    a.request(signal.SIGTERM)
    assert a.received == signal.SIGUSR1


def test_signals_are_parsed_and_bad_ones_named():
    assert parse_signals(["SIGTERM", "usr1", 15]) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals(None) == ()
    with pytest.raises(ValueError, match="'SIGNOPE', which is not a signal"):
        parse_signals(["SIGNOPE"])
    with pytest.raises(ValueError, match="SIGKILL, which cannot be handled"):
        parse_signals(["SIGKILL"])


def test_exit_code_and_message():
    assert exit_code(signal.SIGTERM) == 143
    store = dist.HashStore()
    a = PreemptionAgreement(rank=1, world_size=1, start=train_position(0))
    a.request(signal.SIGTERM)
    assert not a.at_step_boundary(store, 6) and a.at_step_boundary(store, 7)
    outcome = 'saved /ckpt/last.ckpt; resume with trainer.fit(..., ckpt_path="last")'
    text = stop_message(a, stopped="after step 7", outcome=outcome, world_size=2)
    assert text.startswith(
        "ddp_strategy: preempted: rank 1 received SIGTERM at step 6; all 2 rank(s) stopped after step 7 ("
    )
    assert text.endswith(
        'saved /ckpt/last.ckpt; resume with trainer.fit(..., ckpt_path="last"). Exiting with code 143 (SIGTERM).'
    )
    err = Preempted(text, signal_name="SIGTERM", code=143, step=7, path="/ckpt/last.ckpt")
    assert isinstance(err, SystemExit) and err.code == 143 and str(err) == text


def _fake_trainer(environment: object) -> SimpleNamespace:
    from ddp_strategy._compat.lightning import pl

    trainer = SimpleNamespace(
        _accelerator_connector=SimpleNamespace(cluster_environment=environment),
        strategy=SimpleNamespace(launcher=None, root_device="cpu"),
        world_size=1,
        local_rank=0,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()),  # a loop without Lightning's SIGTERM broadcast
    )
    trainer._signal_connector = pl.trainer.connectors.signal_connector._SignalConnector(trainer)
    return trainer


def test_lightning_keeps_its_other_handlers_and_ours_restores_at_teardown(monkeypatch):
    from ddp_strategy._compat.lightning import fabric
    from ddp_strategy._compat.signals import handle_signals_during_run

    monkeypatch.setenv("SLURM_JOB_ID", "1")  # Lightning's auto-requeue handler for SIGUSR1 is registered
    seen: list[tuple[str, int]] = []

    def user(signum: int, frame: object) -> None:  # a handler the script had before fit
        seen.append(("user", signum))

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, user)
    try:
        environment = fabric.plugins.environments.SLURMEnvironment(auto_requeue=True)
        trainer = _fake_trainer(environment)
        connector, restored = trainer._signal_connector, []
        handle_signals_during_run(
            trainer, [signal.SIGTERM], lambda s: seen.append(("ours", s)), lambda: restored.append(1)
        )
        connector.register_signal_handlers()
        usr1 = signal.getsignal(signal.SIGUSR1)
        assert [h.__name__ for h in usr1.signal_handlers] == ["_slurm_sigusr_handler_fn"]  # Lightning's, untouched
        signal.raise_signal(signal.SIGTERM)
        assert seen == [("ours", signal.SIGTERM), ("user", signal.SIGTERM)]
        assert not connector.received_sigterm  # Lightning's notifier (and its broadcast) did not run
        connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is user and restored == [1]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("signals", "skipped"),
    [([signal.SIGTERM], True), ([signal.SIGUSR1], False), ([signal.SIGUSR1, signal.SIGTERM], True)],
)
def test_lightnings_per_batch_sigterm_broadcast_is_skipped_only_while_the_strategy_has_sigterm(signals, skipped):
    from ddp_strategy._compat.lightning import pl
    from ddp_strategy._compat.signals import handle_signals_during_run, sigterm_broadcast_skipped

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
    if not hasattr(type(loop), "_broadcast_sigterm_tensor"):
        pytest.skip(f"Lightning {pl.__version__} has no per-batch SIGTERM broadcast (added in 2.5)")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, lambda s, f: None)  # the script's own handler (pytest's would stop the test)
    handle_signals_during_run(trainer, signals, lambda s: None, lambda: None)
    try:
        assert not sigterm_broadcast_skipped(trainer)  # not before the run's handlers are registered
        connector.register_signal_handlers()
        assert sigterm_broadcast_skipped(trainer) is skipped
        assert ("_broadcast_sigterm_tensor" in vars(loop)) is skipped  # else the class's method, Lightning's
        if skipped:  # Lightning's handler, the only setter of the flag the loop broadcast, is not installed
            signal.raise_signal(signal.SIGTERM)
            assert not trainer.received_sigterm
            assert loop._broadcast_sigterm_tensor() is None  # and the call in its place does nothing
    finally:
        connector.teardown()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert not sigterm_broadcast_skipped(trainer) and "_broadcast_sigterm_tensor" not in vars(loop)  # restored


def test_a_signal_that_led_to_no_stop_is_delivered_again():
    from ddp_strategy import SafeDDPStrategy
    from ddp_strategy.callbacks.preemption_stop import PreemptionStop

    strategy = SafeDDPStrategy(preemption_signals=["SIGUSR1"])
    agreement = PreemptionAgreement(rank=0, world_size=1, start=train_position(0))
    agreement.request(signal.SIGUSR1)  # received after the ranks' last agreement: no stop happened
    strategy._preemption.stop = PreemptionStop(agreement, lambda: None, lambda: None)
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        strategy._preemption.deliver_unused_signal()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
        strategy._preemption.stop.stopped = (3, "x")  # after a stop: nothing is delivered again
        strategy._preemption.deliver_unused_signal()
        time.sleep(0.1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


_LATE_SIGNAL_AFTER_A_STOP = """
import os, signal, sys, time
from ddp_strategy import SafeDDPStrategy
from ddp_strategy.callbacks.preemption_stop import PreemptionStop
from ddp_strategy.preemption import PreemptionAgreement, train_position

strategy = SafeDDPStrategy(preemption_signals=["SIGUSR1"])
agreement = PreemptionAgreement(rank=0, world_size=1, start=train_position(0))
agreement.request(signal.SIGUSR1)
strategy._preemption.stop = PreemptionStop(agreement, lambda: None, lambda: None)
strategy._preemption.stop.stopped = ("at step 3", "x.ckpt")
strategy._preemption.after_run()
print("handlers set", flush=True)
os.kill(os.getpid(), signal.SIGUSR1)  # as torchrun's agent once another rank exited
time.sleep(10)
sys.exit(5)
"""


def test_a_signal_after_a_stop_ends_the_rank_with_the_stops_exit_code():
    """A stopped rank that gets the signal again while it tears down (torchrun's agent sends SIGTERM to the
    workers left once one exited) exits with the stop's code (128 + 10 for SIGUSR1), not "killed by a signal"."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _LATE_SIGNAL_AFTER_A_STOP], capture_output=True, text=True, timeout=60)
    assert run.returncode == 128 + signal.SIGUSR1, (run.returncode, run.stdout, run.stderr)
    assert run.stdout == "handlers set\n", run.stdout


_SIGNAL_AT_INTERPRETER_EXIT_AFTER_A_STOP = """
import atexit, os, signal, sys
from ddp_strategy._compat.signals import exit_with_code_on

def at_exit():  # registered first, so it runs after the strategy's own atexit callbacks (last in, first out)
    print("ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else "handled", flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)  # torchrun's agent, as the interpreter finalizes

atexit.register(at_exit)
exit_with_code_on([signal.SIGUSR1], 128 + signal.SIGUSR1)
sys.exit(128 + signal.SIGUSR1)
"""


def test_a_signal_while_a_stopped_rank_finalizes_is_ignored_and_the_rank_exits_with_the_stops_code():
    """The interpreter's finalization would put the default action back (exit -15 under torchrun, seen once): at
    exit, after the stop, the stop's signals are ignored and the process ends with its own code."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _SIGNAL_AT_INTERPRETER_EXIT_AFTER_A_STOP]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 128 + signal.SIGUSR1 and run.stdout == "ignored\n", (run.returncode, run.stdout)


def _stopped_rank_that_aborts_at_exit(out: str) -> None:
    """A spawn rank that stops for SIGTERM (``Preempted``) with something that aborts at interpreter exit, as the
    SIGABRT once seen after a correct stop ("terminate called without an active exception"); it has a child
    process of its own, as a DataLoader worker."""
    import atexit
    import multiprocessing
    import os
    import sys

    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()
    with open(out, "w") as f:
        f.write(str(worker.pid))
    atexit.register(os.abort)
    print("the stop line", flush=False)
    sys.stdout.write("unflushed tail")
    raise Preempted("stopped", signal_name="SIGTERM", code=exit_code(signal.SIGTERM), step=6, path=None)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_once", [True, False], ids=["exit_at_once_on_stop", "plain"])
def test_a_stopped_spawn_rank_exits_with_its_code_whatever_happens_at_interpreter_exit(tmp_path, capfd, at_once):
    """The spawn launcher runs each rank's function through exit_at_once_on_stop: a preemption stop ends the
    process with 143 before finalization (flushing output, ending its child processes), so an abort at exit cannot
    turn it into SIGABRT. The plain case shows the hazard the wrapper removes."""
    import functools
    import multiprocessing

    from ddp_strategy._compat.launchers import exit_at_once_on_stop

    out = tmp_path / "worker.pid"
    target = functools.partial(_stopped_rank_that_aborts_at_exit, str(out))
    if at_once:
        target = functools.partial(exit_at_once_on_stop, target, frozenset({143, 138}), None)
    rank = multiprocessing.get_context("spawn").Process(target=target)
    rank.start()
    rank.join(60)
    worker = int(out.read_text())
    if at_once:
        assert rank.exitcode == 143
        assert not _alive(worker), "the rank's own child process was left running"
        assert "the stop line\nunflushed tail" in capfd.readouterr().out
    else:
        assert rank.exitcode == -signal.SIGABRT
        if _alive(worker):
            import os

            os.kill(worker, signal.SIGKILL)


def test_exit_at_once_on_stop_passes_other_exits_and_errors_on():
    from ddp_strategy._compat.launchers import exit_at_once_on_stop

    def raising(error: BaseException) -> None:
        raise error

    with pytest.raises(SystemExit) as stop:
        exit_at_once_on_stop(raising, frozenset({143}), None, SystemExit(1))
    assert stop.value.code == 1
    with pytest.raises(ValueError, match="bad"):
        exit_at_once_on_stop(raising, frozenset({143}), None, ValueError("bad"))
    assert exit_at_once_on_stop(lambda x: x + 1, frozenset({143}), None, 1) == 2


class _CountingStore:
    """The training thread's store: counts its operations (the watch uses the store underneath directly)."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner, self.ops = inner, 0

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


def _await(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_with_watches_no_store_work_per_step_before_a_signal_and_every_rank_learns_at_once():
    """Issue 32: each rank's NoticeWatch blocks in one store wait; the training thread reads no store per step before
    a signal. After rank 1's signal, the watches of ranks 0 and 2 acknowledge for them at once (at step 50, the last
    boundary they passed): every rank stops at the first boundary after 51, with O(1) store work per rank."""
    inner = dist.HashStore()
    store = _CountingStore(inner)
    agreements = agreements_with_watches(inner, 3)
    watches = [a.watch for a in agreements]
    for step in range(1, 51):
        assert not any(a.at_step_boundary(store, step) for a in agreements)
    assert store.ops == 0  # 150 step boundaries, no store operation
    agreements[1].request(signal.SIGTERM)
    assert not agreements[1].at_step_boundary(store, 51)  # publishes the notice and acks
    _await(lambda: all(w is not None and w.notice is not None for w in watches))  # the store woke every watch
    stopped: dict[int, int] = {}
    for step in range(51, 60):  # ranks 0 and 2 reach 51 now; everyone stops at 52
        for a in agreements:
            if a.rank not in stopped and not (a.rank == 1 and step == 51) and a.at_step_boundary(store, step):
                stopped[a.rank] = step
    assert stopped == {0: 52, 1: 52, 2: 52}  # the first boundary after max(acks 50, 51, 50)
    # the training threads: rank 1 publishes and acks (3; 5 when its ack is the last and it writes the stop),
    # each rank waits for the stop and reads it (2); the watches' acks go through their own connections
    assert store.ops <= 5 + 2 * 3
    # each watch ends once its ack is written: it returns right after it (a CI run under load saw it still running)
    _await(lambda: all(w is not None and not w.thread.is_alive() for w in watches))


@pytest.mark.timeout(60)
def test_a_watch_ends_when_the_run_ends_without_a_notice():
    inner = dist.HashStore()
    watches = [NoticeWatch(inner, rank=r, renew=3600) for r in range(2)]
    for w in watches:
        w.start()
    NoticeWatch.close_for_all(inner)
    _await(lambda: not any(w.thread.is_alive() for w in watches))
    assert all(w.notice is None for w in watches)
    late = NoticeWatch(inner, rank=2, renew=3600)  # a watch started after the end sees the end at once
    late.start()
    _await(lambda: not late.thread.is_alive())
    assert late.notice is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signalled", [[0], [1], [0, 1, 2]])
@pytest.mark.parametrize("lag", [{}, {1: 1}])
def test_ranks_that_skip_the_step_boundaries_until_a_signal_stop_at_the_same_step(signalled, lag):
    """Issue 30: in fit's training a rank passes step ends without at_boundary before any signal (PreemptionStop's
    hook is skipped); the watch acks at the step it reads from the rank's source (global_step). Every rank still
    stops at one step, after passing no boundary beyond it, and each calls at_boundary only once it is requested."""
    store = dist.HashStore()
    agreements = agreements_with_watches(store, 3)
    global_step = dict.fromkeys(range(3), 0)
    checking = dict.fromkeys(range(3), False)
    for a in agreements:
        a.follow(lambda r=a.rank: train_position(global_step[r]))
        a.when_requested(lambda r=a.rank: checking.__setitem__(r, True))
    stopped: dict[int, int] = {}
    silent_steps = dict.fromkeys(range(3), 0)
    for step in range(1, 40):
        for turn in (0, 1):
            for a in agreements:
                if a.rank in stopped or lag.get(a.rank, 0) != turn:
                    continue
                global_step[a.rank] = step  # the optimizer step; then its end, through at_boundary only if requested
                if not checking[a.rank]:
                    silent_steps[a.rank] += 1
                elif a.at_step_boundary(store, step):
                    stopped[a.rank] = step
        if step == 10:
            for r in signalled:
                agreements[r].request(signal.SIGTERM)  # published at its next step end; the watches ack
        if len(stopped) == 3:
            break
    assert len(stopped) == 3 and len(set(stopped.values())) == 1, stopped
    assert stopped[0] == min(s for s in range(1, 40) if train_position(s) > agreements[0].stop_after)
    assert all(n >= 10 for n in silent_steps.values()), silent_steps  # no at_boundary call before the signal


@pytest.mark.timeout(30)
def test_the_watch_makes_the_rank_check_its_boundaries_before_it_reads_the_position():
    """The order that keeps a skipped boundary safe: ``when_requested``'s function runs before the watch reads the
    source, so every boundary the rank passes after that read goes through at_boundary."""
    store = dist.HashStore()
    events: list[str] = []
    a, b = agreements_with_watches(store, 2)
    b.follow(lambda: events.append("position read") or train_position(7))
    b.when_requested(lambda: events.append("boundaries checked"))
    a.request(signal.SIGTERM)
    assert not a.at_step_boundary(store, 3)  # publishes the notice: b's watch acks for b
    _await(lambda: b.notice is not None and "position read" in events)
    assert events == ["boundaries checked", "position read"]
    assert not b.at_step_boundary(store, 7)  # acked at 7 by the watch: passing it again is nothing new
    assert b.at_step_boundary(store, 8) and a.at_step_boundary(store, 4) is False
    assert a.at_step_boundary(store, 8) and b.stop_after == a.stop_after == train_position(7)


def test_when_requested_runs_at_once_for_a_rank_already_signalled():
    a = PreemptionAgreement(rank=0, world_size=1, start=train_position(0))
    calls: list[int] = []
    a.when_requested(lambda: calls.append(1))
    assert calls == []
    a.request(signal.SIGTERM)
    a.request(signal.SIGTERM)  # only the first signal counts
    assert calls == [1]
    late: list[int] = []
    a.when_requested(lambda: late.append(1))
    assert late == [1]


_WATCH_SCRIPT = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from ddp_strategy.preemption import NoticeWatch
host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", host.port, 1, False, timeout=timedelta(seconds=30))
renew = float(sys.argv[1])
watch = NoticeWatch(client, rank=0, waker=host, **({"renew": renew} if renew else {}))
watch.start()
time.sleep(2.6)
NoticeWatch.close_for_all(host)  # as rank 0 at a stage's end: every watch ends
watch.thread.join(5)
print("ended", not watch.thread.is_alive())
"""


@pytest.mark.parametrize("renew", [0.5, 0.0])
def test_a_watch_renewal_makes_torch_log_two_warnings_so_the_default_renews_once_a_week(renew: float):
    # each renewal is a store wait that timed out, and torch's client logs two warnings for it; renewed every 60 s
    # (before), a run of a day logged 2 x 1440 lines per rank (12M at 4096 ranks). The default now waits a week; the
    # watch still ends at once when the run ends (close_for_all)
    import subprocess
    import sys

    from ddp_strategy.preemption import WATCH_RENEWAL

    run = subprocess.run(
        [sys.executable, "-c", _WATCH_SCRIPT, str(renew)], capture_output=True, text=True, timeout=120, check=False
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ended True" in out, out[-3000:]
    warnings = out.count("[c10d] waitForInput")
    if renew:
        assert warnings >= 2 * 4, out[-3000:]  # 5 renewals in 2.6 s: two lines each (a loaded machine: fewer)
    else:
        assert warnings == 0, out[-3000:]
        assert WATCH_RENEWAL >= 7 * 24 * 3600
