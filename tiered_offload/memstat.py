"""Resident memory of this process, for progress bars, benchmarks and tests."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import resource

import psutil

__all__ = ["rss_bytes", "peak_rss_bytes", "tune_allocator"]

log = logging.getLogger(__name__)
_M_MMAP_THRESHOLD = -3
_tuned = False


def rss_bytes() -> int:
    """Current resident set size."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Highest resident set size of this process so far.

    Read from ``VmHWM`` in ``/proc/self/status`` where it exists: ``getrusage``'s ``ru_maxrss``
    can carry over the parent's peak into a child process on Linux, which would make a small
    process look as large as the test runner that started it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tune_allocator(mmap_threshold: int = 8 << 20) -> bool:
    """Make glibc return large freed blocks to the system at once. Returns whether it was applied.

    Training a large model allocates many short-lived temporaries of 10-40 MiB (a parameter's
    gradient before it is added into the store). glibc serves blocks below its mmap threshold
    (dynamic, rising up to 32 MiB) from per-thread heaps and keeps them after they are freed, so a
    process's resident memory drifts far above what it uses: in a run of a 0.37B-parameter model
    (d_model 1600) with a 1 GiB budget, peak RSS was 1718 MiB by default, 1435 MiB with this
    setting. Fixing the threshold at 8 MiB makes those blocks mmaps that ``free`` unmaps, while
    the many small activation buffers stay on the heap (a 1 MiB threshold saved a little more
    memory but slowed plain training steps by ~25% with page faults). It is process-wide: set
    ``TIERED_OFFLOAD_MALLOC_TUNING=0`` to leave the allocator alone.
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("TIERED_OFFLOAD_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    except (OSError, AttributeError) as e:
        log.info("could not tune the allocator: %s", e)
        return False
    return _tuned
