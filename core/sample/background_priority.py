"""Background grammar threads run at a lower OS priority than the step loop.

A slow grammar's masks are computed ahead on worker threads that release the GIL, so they no longer stall
the step by holding it; they still hold a core for as long as the mask runs (0.1 s and more for a 0.4 MB
literal, back to back while that request decodes). On a host with few cores, whenever a third thread wants
to run, the kernel takes a scheduler tick (~4 ms) from whichever of the two it picks: half the time the
step loop, and every other request's inter-token latency jumps by a tick. At a higher nice value the
kernel prefers to take the time from the mask thread: the attacker's own request slows, the others do
not. Raising one's own nice value needs no privilege; where the OS has no per-thread priority (macOS,
Windows) it is skipped and the masks merely run at the same priority as before.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10  # CFS weight 110 against the step loop's 1024: ~10% of a shared core when both want it


def lower_this_thread() -> None:
    """Raise the calling thread's nice value by ``BACKGROUND_NICE`` (Linux: per thread), if the OS allows."""
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + BACKGROUND_NICE))
    except (AttributeError, OSError):  # no per-thread priority here: run at the process's priority
        pass

