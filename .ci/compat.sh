#!/usr/bin/env bash
# Compatibility stage: the tests marked `compat` against the version boundaries pyproject.toml declares.
#
# One virtual environment per constraints file .ci/compat/ENV.txt (default: low and high), created from scratch
# with `python3 -m venv`; the project is installed editable with its dependencies under those constraints (torch
# first, so that pip never resolves a CUDA build), then `pytest -m compat` runs with that environment's python.
# The environments run in parallel, each in its own session under a hard overall timeout; on a timeout (or when
# this script is interrupted) pytest is aborted and every process of that environment's tree is killed, with the
# process groups the multi-process tests start. Logs: build/compat/ENV.log (versions, times),
# build/compat/ENV/install.log, build/compat/ENV/test.log; their tails are printed for a failed environment.
# Exits non-zero when any environment fails.
#
# Settings (environment variables):
#   COMPAT_ENVS     environments to run, in parallel (default "low high"; "mid" is Lightning 2.5)
#   COMPAT_TIMEOUT  hard limit per environment in seconds, install and tests together (default 900; 478 s in a fresh-clone run here, 2026-12-03)
#   COMPAT_DIR      where the environments and logs go (default build/compat)
#   COMPAT_PYTEST   extra pytest arguments (default none), e.g. "-x" or "-k resume"
#   PYTHON          the interpreter that creates the environments (default python3)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENVS=${COMPAT_ENVS:-low high}
TIMEOUT=${COMPAT_TIMEOUT:-900}
OUT=${COMPAT_DIR:-$ROOT/build/compat}
PYTHON=${PYTHON:-python3}
TAIL_LINES=${COMPAT_TAIL:-150}

say() { printf '[compat %s] %s\n' "$1" "$2"; }

# ---------------------------------------------------------------- one environment (runs in its own session)
run_one() {
    local env=$1
    local dir=$OUT/$env venv=$OUT/$env/venv constraints=$ROOT/.ci/compat/$env.txt
    local t0=$SECONDS rc
    rm -rf "$dir" && mkdir -p "$dir" || return 2
    say "$env" "constraints: .ci/compat/$env.txt"
    "$PYTHON" -m venv "$venv" >"$dir/install.log" 2>&1 || { say "$env" "FAILED: python3 -m venv"; return 3; }
    local py=$venv/bin/python
    {
        # torch first, from the constraints (the CPU wheel): the project's own `torch>=2.4` must find it installed
        "$py" -m pip install --no-input -c "$constraints" torch &&
            # the editable install writes src/*.egg-info: one environment at a time
            flock "$OUT/.editable.lock" "$py" -m pip install --no-input -c "$constraints" -e "$ROOT" pytest pytest-timeout
    } >>"$dir/install.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
        say "$env" "FAILED: pip install (exit $rc) after $((SECONDS - t0)) s; see $dir/install.log"
        return 4
    fi
    if ! "$py" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' >>"$dir/install.log" 2>&1; then
        say "$env" "FAILED: a CUDA build of torch was installed (or torch does not import); see $dir/install.log"
        return 5
    fi
    local install_s=$((SECONDS - t0))
    say "$env" "installed in ${install_s} s:"
    "$py" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE 'torch|lightning|metrics|fsspec' | sed 's/^/    /'
    local t1=$SECONDS files summary
    # Only the modules that mark tests compat are collected: the others may import what only the main environment
    # has (safetensors, torchvision). -v: after a timeout the log's last line names the test that was running.
    # --basetemp: the environments run at the same time and must not share pytest's numbered temporary folders.
    files=$(cd "$ROOT" && grep -l 'mark\.compat' tests/test_*.py | tr '\n' ' ')
    say "$env" "modules with compat tests: ${files:-none}"
    # shellcheck disable=SC2086  # $files and COMPAT_PYTEST are lists of arguments
    (ulimit -c 0 && cd "$ROOT" && exec "$py" -m pytest -m compat -v -p no:cacheprovider --basetemp "$dir/tmp" ${COMPAT_PYTEST:-} $files) \
        >"$dir/test.log" 2>&1 </dev/null
    rc=$?
    local test_s=$((SECONDS - t1))
    summary=$(grep -E '^=+ .*(passed|failed|error|no tests ran).* =+$' "$dir/test.log" | tail -n 1)
    say "$env" "pytest: ${summary:-no summary line (pytest did not finish)}"
    say "$env" "times: install ${install_s} s, tests ${test_s} s, total $((SECONDS - t0)) s"
    if [[ $rc -eq 5 ]]; then
        say "$env" "FAILED: no test is marked compat"
    elif [[ $rc -ne 0 ]]; then
        say "$env" "FAILED: pytest exit $rc"
    fi
    return "$rc"
}

if [[ ${1:-} == --one ]]; then
    run_one "$2"
    exit $?
fi

# ---------------------------------------------------------------- process trees
tree() { # PID and all its descendants, parents first
    local child
    echo "$1"
    for child in $(pgrep -P "$1" 2>/dev/null); do tree "$child"; done
}

kill_env() { # ENV PID WHY: make pytest print where it was, then kill the whole tree and every process group in it
    local env=$1 root=$2 why=$3 own_pgid pids pid pgid
    own_pgid=$(ps -o pgid= -p $$ | tr -d ' ')
    pids=$(tree "$root")
    say "$env" "$why; processes:"
    for pid in $pids; do ps -o pid=,pgid=,etimes=,args= -p "$pid" 2>/dev/null | cut -c1-160 | sed 's/^/    /'; done
    for pid in $pids; do
        # SIGABRT: pytest's faulthandler, where still enabled, writes the Python stacks to test.log (SIGINT would
        # not do: commands started with & ignore it)
        if ps -o args= -p "$pid" 2>/dev/null | grep -q -- '-m pytest'; then kill -ABRT "$pid" 2>/dev/null; fi
    done
    for _ in $(seq 10); do
        kill -0 "$root" 2>/dev/null || break
        sleep 0.5
    done
    pids="$pids $(tree "$root")" # processes started meanwhile; those orphaned by then are in the first list
    for pid in $pids; do
        pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')
        if [[ -n $pgid && $pgid != "$own_pgid" ]]; then kill -KILL -- "-$pgid" 2>/dev/null; fi
        kill -KILL "$pid" 2>/dev/null
    done
    say "$env" "killed every process of this environment"
}

# ---------------------------------------------------------------- all environments in parallel
mkdir -p "$OUT"
declare -A PID STATUS
start=$SECONDS
for env in $ENVS; do
    if [[ ! -f $ROOT/.ci/compat/$env.txt ]]; then
        echo "compat: no constraints file .ci/compat/$env.txt" >&2
        exit 2
    fi
done
for env in $ENVS; do
    # setsid: a session (and process group) of its own, so that a timeout can end exactly this environment
    : >"$OUT/$env.log" # appended to by this environment and, on a timeout, by kill_env
    setsid -w "$BASH" "${BASH_SOURCE[0]}" --one "$env" >>"$OUT/$env.log" 2>&1 </dev/null &
    PID[$env]=$!
done
interrupted() {
    trap - INT TERM
    for env in $ENVS; do
        if [[ -n ${PID[$env]:-} && -z ${STATUS[$env]:-} ]]; then
            kill_env "$env" "${PID[$env]}" "interrupted" >>"$OUT/$env.log" 2>&1
            cat "$OUT/$env.log"
        fi
    done
    exit 130
}
trap interrupted INT TERM
say all "running: $ENVS (in parallel; each at most ${TIMEOUT} s; logs in ${OUT#"$ROOT"/})"

deadline=$((SECONDS + TIMEOUT))
while :; do
    running=0
    for env in $ENVS; do
        [[ -n ${STATUS[$env]:-} ]] && continue
        if kill -0 "${PID[$env]}" 2>/dev/null && [[ $(ps -o stat= -p "${PID[$env]}" 2>/dev/null) != Z* ]]; then
            if ((SECONDS >= deadline)); then
                kill_env "$env" "${PID[$env]}" "timed out after ${TIMEOUT} s" >>"$OUT/$env.log" 2>&1
                wait "${PID[$env]}" 2>/dev/null
                STATUS[$env]=timeout
            else
                running=1
            fi
        else
            wait "${PID[$env]}"
            STATUS[$env]=$?
            say "$env" "finished (exit ${STATUS[$env]}) after $((SECONDS - start)) s"
        fi
    done
    ((running)) || break
    sleep 1
done

failed=()
for env in $ENVS; do
    echo
    echo "==================== compat environment: $env ===================="
    cat "$OUT/$env.log"
    if [[ ${STATUS[$env]} != 0 ]]; then
        failed+=("$env")
        for log in test install; do
            if [[ -s $OUT/$env/$log.log ]]; then
                echo "---- last $TAIL_LINES lines of ${OUT#"$ROOT"/}/$env/$log.log ----"
                tail -n "$TAIL_LINES" "$OUT/$env/$log.log"
                break
            fi
        done
    fi
done
echo
if ((${#failed[@]})); then
    say all "FAILED: ${failed[*]} (of: $ENVS) in $((SECONDS - start)) s"
    exit 1
fi
say all "passed: $ENVS in $((SECONDS - start)) s"
