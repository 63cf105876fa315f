"""Resident memory of this process, for progress bars, benchmarks and tests."""

from __future__ import annotations

import resource

import psutil

__all__ = ["rss_bytes", "peak_rss_bytes"]


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
