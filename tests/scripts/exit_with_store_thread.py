"""A rank that exits (code 143) right after the store's host exited, with a thread blocked in a store wait.

python tests/scripts/exit_with_store_thread.py host PORT         the store's host: exits at once on "go"
python tests/scripts/exit_with_store_thread.py watch|plain PORT  the rank: a NoticeWatch (``watch``) or a bare
                                                                 daemon thread in store.wait (``plain``)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_strategy.preemption import NoticeWatch


def main() -> None:
    role, port = sys.argv[1], int(sys.argv[2])
    if role == "host":
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        store.wait(["go"])
        os._exit(0)  # the host is gone: every connection to it closes
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    if role == "watch":
        NoticeWatch(store.clone(), rank=1, renew=60.0, waker=store)
    else:
        blocked = store.clone()
        threading.Thread(target=lambda: blocked.wait(["never"], timedelta(seconds=60)), daemon=True).start()
    time.sleep(0.3)  # the wait is in place
    store.set("go", "1")
    sys.exit(143)  # as a rank leaving with Preempted


if __name__ == "__main__":
    main()
