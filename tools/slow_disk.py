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


class Drive:
    """One device serving transfers in turn, together no faster than ``rate`` bytes per second (the
    waits sleep, so the CPU stays free)."""

    def __init__(self, rate: float):
        self._rate, self._lock, self._free_at = rate, threading.Lock(), 0.0

    def run(self, length: int, transfer):
        """``transfer()`` of ``length`` bytes in its turn; returns what it returned."""
        with self._lock:  # this transfer's turn on the device
            start = max(time.monotonic(), self._free_at)
            self._free_at = done_at = start + length / self._rate
        n = transfer()
        time.sleep(max(0.0, done_at - time.monotonic()))
        return n


class SlowDisk(PosixBackend):
    """A file backend whose transfers, together, go no faster than ``rate`` bytes per second (one
    device serving reads and writes in turn; the waits sleep, so the CPU stays free): a disk-bound
    machine on a compute-bound one."""

    def __init__(self, location, rate: float):
        super().__init__(location)
        self._drive = Drive(rate)

    def _transfer_part(self, key, part, mv, *, read):
        return self._drive.run(part.length, lambda: super(SlowDisk, self)._transfer_part(key, part, mv, read=read))


def slow_file_backends(rate: float) -> None:
    """Every file backend this process opens, together, no faster than ``rate`` bytes per second:
    one :class:`Drive` for the process (a sharded rank's own drive; its engine takes ``storage=`` a
    directory, not a :class:`SlowDisk`, so the rule goes on the class it opens)."""
    drive, transfer = Drive(rate), PosixBackend._transfer_part
    PosixBackend._transfer_part = lambda self, key, part, mv, *, read: drive.run(
        part.length, lambda: transfer(self, key, part, mv, read=read))
