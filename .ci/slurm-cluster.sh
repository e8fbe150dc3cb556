#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for the tests marked slurm (tests/test_slurm.py, `make test-slurm`).
#
#   bash .ci/slurm-cluster.sh install     Debian packages slurmctld slurmd slurm-client munge (needs root)
#   bash .ci/slurm-cluster.sh start DIR   munged, slurmctld and slurmd with ALL config and state under DIR;
#                                         waits until the node is idle, then prints `export SLURM_CONF=DIR/slurm.conf`
#   bash .ci/slurm-cluster.sh stop DIR    cancels the cluster's jobs, SIGKILLs by PID what is left of them, stops
#                                         the daemons by their PID files, then SIGKILLs by PID any other process
#                                         whose environment names DIR/slurm.conf (a slurmstepd)
#
# Nothing under /etc is read or written: munged gets its key, socket, PID, log and seed files under DIR/munge, and
# every SLURM daemon and client finds DIR/slurm.conf through SLURM_CONF (clients) or -f (daemons). No systemd, no
# cgroups (proctrack/linuxproc, task/none), no accounting daemon (scontrol show job reports states and exit codes;
# MinJobAge keeps finished jobs for an hour). Ports: two free TCP ports picked at start.
#
# Exit codes: 0 ok; 2 usage; 3 not root; 4 apt-get missing; 5 packages not installed; 1 anything else (the daemon
# logs are printed).
set -euo pipefail

EXIT_USAGE=2
EXIT_NOT_ROOT=3
EXIT_NO_APT=4
EXIT_NOT_INSTALLED=5

PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(slurmctld slurmd sbatch srun scontrol scancel sinfo squeue munged mungekey munge unmunge)
START_TIMEOUT=${SLURM_CLUSTER_START_TIMEOUT:-30}  # seconds until the node must be idle
STOP_TIMEOUT=${SLURM_CLUSTER_STOP_TIMEOUT:-15}    # seconds each daemon gets after SIGTERM before SIGKILL

export PATH="$PATH:/usr/sbin:/sbin"

# Run without a caller's SLURM_CONF: `stop` finds the cluster's leftover processes by SLURM_CONF in their
# environment, which this script's own processes must not carry (start sets it for the daemons only).
if [ -n "${SLURM_CONF+set}" ]; then
    exec env -u SLURM_CONF bash "$0" "$@"
fi

usage() {
    echo "usage: $0 install | start DIR | stop DIR" >&2
    exit "$EXIT_USAGE"
}

missing_commands() {
    local cmd missing=()
    for cmd in "${COMMANDS[@]}"; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    echo "${missing[*]}"
}

require_root() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "slurm-cluster: $1 needs root (munged and slurmd run as root, SlurmUser=root); running as $(id -un)" >&2
        exit "$EXIT_NOT_ROOT"
    fi
}

cmd_install() {
    local missing
    missing=$(missing_commands)
    if [ -z "$missing" ]; then
        echo "slurm-cluster: ${PACKAGES[*]} already installed ($(slurmctld -V))"
        return 0
    fi
    require_root "installing the Debian packages ${PACKAGES[*]} (missing: $missing)"
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "slurm-cluster: apt-get not found: install ${PACKAGES[*]} (SLURM >= 22.05, MUNGE) by hand" >&2
        exit "$EXIT_NO_APT"
    fi
    # Keep the packages' maintainer scripts from starting their daemons (the cluster is started by `start`, with
    # its own config): a policy-rc.d that denies every start, present only for the install.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        own_policy=1
    fi
    local status=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}" || {
            apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}"
        }
    } || status=$?
    if [ "$own_policy" -eq 1 ]; then
        rm -f "$policy"
    fi
    if [ "$status" -ne 0 ]; then
        echo "slurm-cluster: apt-get install ${PACKAGES[*]} failed with exit code $status" >&2
        exit 1
    fi
    missing=$(missing_commands)
    if [ -n "$missing" ]; then
        echo "slurm-cluster: still missing after the install: $missing" >&2
        exit "$EXIT_NOT_INSTALLED"
    fi
    echo "slurm-cluster: installed ${PACKAGES[*]} ($(slurmctld -V))"
}

# The PID in FILE if that process is alive, else nothing.
pid_from() {
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(tr -dc '0-9' <"$file")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        echo "$pid"
    fi
}

# Wait up to $2 seconds for the PID file $1 to name a live process; print the PID.
wait_for_pid_file() {
    local file=$1 limit=$2 waited=0 pid
    while :; do
        pid=$(pid_from "$file")
        if [ -n "$pid" ]; then
            echo "$pid"
            return 0
        fi
        if [ "$waited" -ge $((limit * 10)) ]; then
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

# SIGTERM the process of PID file $1 (named $2), SIGKILL it after STOP_TIMEOUT seconds; wait until it is gone.
stop_by_pid_file() {
    local file=$1 name=$2 pid waited=0
    pid=$(pid_from "$file")
    if [ -z "$pid" ]; then
        rm -f "$file"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$waited" -eq $((STOP_TIMEOUT * 10)) ]; then
            echo "slurm-cluster: $name (pid $pid) still running ${STOP_TIMEOUT}s after SIGTERM: SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    rm -f "$file"
    echo "slurm-cluster: stopped $name (pid $pid)"
}

# PIDs of the processes whose environment holds SLURM_CONF=$1: the daemons, slurmstepd, srun and the jobs' tasks of
# this cluster (the daemons are started with it, jobs inherit it), never another cluster's or the system's. With a
# second argument, only the jobs' processes (those that also carry SLURM_JOB_ID).
cluster_pids() {
    local conf=$1 jobs_only=${2:-} file pid
    # grep -z: the entries of /proc/PID/environ are NUL-separated
    for file in $(grep -slzxF "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null); do
        pid=${file#/proc/}
        pid=${pid%/environ}
        [ "$pid" -ne $$ ] && [ "$pid" -ne "$BASHPID" ] || continue
        if [ -z "$jobs_only" ] || grep -qz '^SLURM_JOB_ID=' "$file" 2>/dev/null; then
            echo "$pid"
        fi
    done
}

# SIGKILL the processes given as arguments (by PID), saying which, and wait up to 5 s until they are gone.
kill_pids() {
    local pid waited=0
    for pid in "$@"; do
        echo "slurm-cluster: killing leftover process $pid: $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" || true)"
        kill -KILL "$pid" 2>/dev/null || true
    done
    for pid in "$@"; do
        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 50 ]; do
            sleep 0.1
            waited=$((waited + 1))
        done
    done
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

print_logs() {
    local dir=$1 file
    for file in "$dir/munge/munged.log" "$dir/log/slurmctld.log" "$dir/log/slurmd.log"; do
        if [ -f "$file" ]; then
            echo "----- tail of $file -----" >&2
            tail -n 30 "$file" >&2
        fi
    done
}

cmd_start() {
    local dir=$1
    local missing
    missing=$(missing_commands)
    if [ -n "$missing" ]; then
        echo "slurm-cluster: not installed (missing: $missing); run: sudo bash $0 install" >&2
        exit "$EXIT_NOT_INSTALLED"
    fi
    require_root "starting the cluster"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd -P)
    if [ -n "$(pid_from "$dir/run/slurmctld.pid")$(pid_from "$dir/run/slurmd.pid")$(pid_from "$dir/munge/munged.pid")" ]
    then
        echo "slurm-cluster: a cluster is already running in $dir; stop it first" >&2
        exit 1
    fi
    local host
    host=$(hostname -s)
    # munged wants its socket directory searchable by all (0755) and its key readable by root only (0400)
    install -d -m 0755 -o root -g root "$dir/munge"
    install -d -m 0700 -o root -g root "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
    trap 'status=$?; if [ "$status" -ne 0 ]; then print_logs "'"$dir"'"; cmd_stop "'"$dir"'" >&2; fi' EXIT

    # MUNGE: its own key, socket, PID, log and seed files (munged checks that root owns them; key mode 0400)
    rm -f "$dir/munge/munge.key"
    mungekey --create --keyfile="$dir/munge/munge.key"
    chmod 0400 "$dir/munge/munge.key"
    local socket="$dir/munge/munge.socket"
    # --force: DIR may sit in a directory only root can search (pytest's tmp dirs are 0700); every client of the
    # socket runs as root here (SlurmUser=root, jobs submitted by root), so munged's "inaccessible" is only a warning
    munged --force --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    local munged_pid
    munged_pid=$(wait_for_pid_file "$dir/munge/munged.pid" 10) || {
        echo "slurm-cluster: munged did not start" >&2
        exit 1
    }
    munge --socket="$socket" -n | unmunge --socket="$socket" >/dev/null || {
        echo "slurm-cluster: munge credentials do not round-trip through $socket" >&2
        exit 1
    }

    local ctld_port slurmd_port
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done

    cat >"$dir/slurm.conf" <<EOF
# Written by .ci/slurm-cluster.sh: a one-node test cluster, everything under $dir
ClusterName=ddptest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
# verbose: slurmstepd logs how each task ended ("task 0 (PID) exited with exit code 143."); the tests read it
SlurmdDebug=verbose
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
MailProg=/bin/true
SchedulerType=sched/backfill
# the main scheduling loop every 2 s (default 60 s): a requeued job starts soon after its BeginTime
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
KillWait=30
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    chmod 0644 "$dir/slurm.conf"

    local conf="$dir/slurm.conf"
    # the daemons carry SLURM_CONF in their environment (and pass it to slurmstepd): `stop` finds leftovers by it
    SLURM_CONF="$conf" slurmctld -f "$conf" -c  # -c: no jobs from an earlier start in the same DIR
    wait_for_pid_file "$dir/run/slurmctld.pid" 15 >/dev/null || {
        echo "slurm-cluster: slurmctld did not start" >&2
        exit 1
    }
    SLURM_CONF="$conf" slurmd -f "$conf"
    wait_for_pid_file "$dir/run/slurmd.pid" 15 >/dev/null || {
        echo "slurm-cluster: slurmd did not start" >&2
        exit 1
    }
    local waited=0 state=""
    while :; do
        state=$(SLURM_CONF="$conf" sinfo -h -N -n "$host" -o %T 2>/dev/null || true)
        [ "$state" = "idle" ] && break
        if [ "$waited" -ge $((START_TIMEOUT * 5)) ]; then
            echo "slurm-cluster: node $host not idle after ${START_TIMEOUT}s (state: ${state:-none})" >&2
            exit 1
        fi
        sleep 0.2
        waited=$((waited + 1))
    done
    trap - EXIT
    echo "slurm-cluster: node $host idle (munged $munged_pid, slurmctld port $ctld_port, slurmd port $slurmd_port)"
    echo "export SLURM_CONF=$conf"
}

cmd_stop() {
    local dir=$1
    if [ ! -d "$dir" ]; then
        echo "slurm-cluster: no cluster directory $dir"
        return 0
    fi
    dir=$(cd "$dir" && pwd -P)
    local conf="$dir/slurm.conf" left
    if [ -f "$conf" ] && [ -n "$(pid_from "$dir/run/slurmctld.pid")" ]; then
        # cancel every job of this cluster (SIGTERM), and give them 5 s (SafeDDPStrategy stops in seconds)
        local jobs waited=0
        jobs=$(SLURM_CONF="$conf" squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            SLURM_CONF="$conf" scancel $jobs 2>/dev/null || true
            while [ -n "$(SLURM_CONF="$conf" squeue -h -o %i 2>/dev/null || true)" ] && [ "$waited" -lt 25 ]; do
                sleep 0.2
                waited=$((waited + 1))
            done
        fi
    fi
    # the jobs' processes still alive (batch shell, srun, tasks): SIGKILL by PID, so that slurmd stops at once
    left=$(cluster_pids "$conf" jobs)
    # shellcheck disable=SC2086
    [ -z "$left" ] || kill_pids $left
    stop_by_pid_file "$dir/run/slurmd.pid" slurmd
    stop_by_pid_file "$dir/run/slurmctld.pid" slurmctld
    # anything else of the cluster (a slurmstepd): SIGKILL by PID
    left=$(cluster_pids "$conf")
    # shellcheck disable=SC2086
    [ -z "$left" ] || kill_pids $left
    stop_by_pid_file "$dir/munge/munged.pid" munged
    rm -f "$dir/munge/munge.socket" "$dir/munge/munge.socket.lock"
    left=$(cluster_pids "$conf")
    if [ -n "$left" ]; then
        echo "slurm-cluster: processes of the cluster still alive: $left" >&2
        return 1
    fi
}

case "${1:-}" in
    install)
        [ $# -eq 1 ] || usage
        cmd_install
        ;;
    start)
        [ $# -eq 2 ] || usage
        cmd_start "$2"
        ;;
    stop)
        [ $# -eq 2 ] || usage
        cmd_stop "$2"
        ;;
    *)
        usage
        ;;
esac
