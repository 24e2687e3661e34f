"""Process bookkeeping shared by the launcher and failure tests."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from pathlib import Path

P = 3


def _children() -> set[int]:
    """Pids of the live direct children of this process."""
    me, kids = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == me and state != "Z":
                kids.add(int(d.name))
    return kids


def _is_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: a long-lived helper, not a rank."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@contextlib.contextmanager
def watch_children(nproc: int = P):
    """Record every child process seen (polled every 50 ms) while the block runs, then
    check that none of them is left: launch() must leave no process behind."""
    before, seen, stop = _children(), set(), threading.Event()

    def poll():
        while not stop.is_set():
            seen.update(_children() - before)
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()
    seen -= {pid for pid in seen if _is_tracker(pid)}
    assert len(seen) >= nproc, f"saw only {len(seen)} rank processes"
    assert multiprocessing.active_children() == []
    now = _children()
    left = {pid for pid in (seen | now) - before if pid in now and not _is_tracker(pid)}
    assert not left, f"processes outlived launch(): {left}"
