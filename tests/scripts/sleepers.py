"""A stand-in for a hung multi-process job: this process starts N children, and all of them sleep for an hour.

Usage: python tests/scripts/sleepers.py --pids FILE [--children N]

Each child writes its pid to FILE (one per line) once it runs; the parent then adds ``parent <pid>`` (the leader of
the process group, when started in a new session), so a test can look for survivors afterwards.
The children ignore SIGTERM and SIGINT, as a rank stuck in a C++ collective effectively does: only SIGKILL ends them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    f.write(f'{os.getpid()}\\n')\n"
    "time.sleep(3600)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pids", required=True)
    parser.add_argument("--children", type=int, default=2)
    args = parser.parse_args()
    children = [subprocess.Popen([sys.executable, "-c", CHILD, args.pids]) for _ in range(args.children)]
    while not os.path.exists(args.pids) or len(Path(args.pids).read_text().split()) < args.children:
        time.sleep(0.01)  # until every child runs
    with open(args.pids, "a") as f:
        f.write(f"parent {os.getpid()}\n")
    print(f"sleepers: parent {os.getpid()} started {len(children)} children", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
