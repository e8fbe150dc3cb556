"""bench/call_count.py's analysis: calls per step and what safe adds per function, from fabricated counts."""

from __future__ import annotations

from pathlib import Path

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

calls = load_bench("bench_call_count", BENCH / "call_count.py")


def fit(steps: int, counts: dict[str, int]) -> dict[str, object]:
    return {"steps": steps, "calls": counts}


def test_calls_per_step_and_what_safe_adds_per_function():
    fits = {
        "stock-nolog": fit(100, {"getattr": 1000, "loop.py:10(advance)": 100, "stock_only": 50}),
        "safe-nolog": fit(
            200, {"getattr": 2600, "loop.py:10(advance)": 200, "strategy.py:5(on_train_batch_start)": 200}
        ),
        "stock-sync_dist": fit(100, {"getattr": 1000}),
        "safe-sync_dist": fit(100, {"getattr": 1000, "collective_calls.py:59(reduce)": 100}),
    }
    modes = calls.analyse(fits)
    nolog = modes["nolog"]
    assert nolog["calls_per_step"] == {"stock": 11.5, "safe": 15.0}  # per step: the fits' step counts differ
    # largest change first; unchanged functions are left out; stock's own calls count negative
    assert nolog["added_per_step"] == {"getattr": 3.0, "strategy.py:5(on_train_batch_start)": 1.0, "stock_only": -0.5}
    assert modes["sync_dist"]["added_per_step"] == {"collective_calls.py:59(reduce)": 1.0}
    lines = calls.render(
        {"steps": 100, "modes": modes, "date": "d", "machine": {"platform": "p", "torch": "t", "lightning": "l"}}
    )
    assert "| nolog | 12 | 15 | +4 |" in lines  # rounded: 11.5 -> 12, 15 - 11.5 = 3.5 -> +4
    assert "- `getattr` +3.00" in lines and "- `stock_only` -0.50" in lines


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _opcodes_of(*calls_made: tuple[int, ...]) -> int:
    counter = calls.OpcodeCounter()
    counter.start()
    try:
        for args in calls_made:
            _loop(*args)
    finally:
        counter.stop()
    return counter.counts[calls._code_name(_loop.__code__)]


def test_the_opcode_counter_counts_each_functions_bytecodes_on_its_thread_only():
    import threading

    once, twice, longer = _opcodes_of((10,)), _opcodes_of((10,), (10,)), _opcodes_of((20,))
    assert once > 10 and twice == 2 * once  # exact counts: the same call runs the same instructions
    assert longer - once == (_opcodes_of((30,)) - longer)  # ten more iterations, the same instructions each time
    counter = calls.OpcodeCounter()
    counter.start()
    try:
        other = threading.Thread(target=_loop, args=(10,))  # another thread is not traced
        other.start()
        other.join()
    finally:
        counter.stop()
    _loop(10)  # after stop: not counted
    assert counter.counts[calls._code_name(_loop.__code__)] == 0


def test_an_opcode_count_reads_as_bytecode_instructions():
    fits = {f"{v}-{m}": fit(10, {"call.py:203(_call_callback_hooks)": 2520 if v == "safe" else 0}) for v in
            ("stock", "safe") for m in ("nolog", "sync_dist")}  # fmt: skip
    lines = calls.render(
        {
            "steps": 10,
            "count": "opcodes",
            "modes": calls.analyse(fits),
            "date": "d",
            "machine": {"platform": "p", "torch": "t", "lightning": "l"},
        }
    )
    assert "traced (`sys.settrace`, opcode events)" in lines[0]
    assert "Python bytecode instructions per training step" in lines[0]
    assert "Bytecode instructions per step added by safe, nolog (largest 40; negative: fewer than stock):" in lines
    assert "- `call.py:203(_call_callback_hooks)` +252.00" in lines


def test_stocks_abort_at_exit_after_writing_its_counts_is_a_finished_fit_and_nothing_else_is():
    import signal

    abort = -signal.SIGABRT
    assert calls.fit_finished("stock", 0, True) and calls.fit_finished("safe", 0, True)
    assert calls.fit_finished("stock", abort, wrote=True)  # gloo's abort at interpreter exit (tests/proc.py)
    assert not calls.fit_finished("stock", abort, wrote=False)  # died before its counts
    assert not calls.fit_finished("safe", abort, wrote=True)  # SafeDDPStrategy destroys its group: no such abort
    assert not calls.fit_finished("stock", 1, wrote=True)
