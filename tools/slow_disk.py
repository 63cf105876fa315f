"""A file backend no faster than a given rate: a disk-bound machine on a compute-bound one.

The benchmarks' ``--disk-rate MB/S``: every transfer takes its turn on one device (reads and
writes together, in the order they reach it) and sleeps out the rest of its share, so the CPU
stays free for the compute. On this project's 2-core CI machines the disk is the page cache and
the compute the bottleneck; a GPU box with NVMe is the other way round.
"""

from __future__ import annotations

import threading
import time

from storage_backends.posix import PosixBackend


class SlowDisk(PosixBackend):
    """A file backend whose transfers, together, go no faster than ``rate`` bytes per second (one
    device serving reads and writes in turn; the waits sleep, so the CPU stays free): a disk-bound
    machine on a compute-bound one."""

    def __init__(self, location, rate: float):
        super().__init__(location)
        self._rate, self._lock, self._free_at = rate, threading.Lock(), 0.0

    def _transfer_part(self, key, part, mv, *, read):
        with self._lock:  # this part's turn on the device
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + part.length / self._rate
            done_at = self._free_at
        n = super()._transfer_part(key, part, mv, read=read)
        time.sleep(max(0.0, done_at - time.monotonic()))
        return n
