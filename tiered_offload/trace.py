"""A step timeline in the Chrome trace format (open it in Perfetto or ``chrome://tracing``).

``Engine(..., trace="step.json")`` or ``with engine.tracing("step.json"):`` records, on one
timeline, the compute of each block per phase (forward, recompute, backward) and of each unit's
optimizer update, every disk read and write and every copy between tiers (with its tensor, its
bytes, and whether the lookahead started it), the time compute waited for bytes, and the
commits. Compute spans also open :func:`torch.profiler.record_function` ranges, so a
``torch.profiler`` trace taken at the same time shows the calling thread's (forward, backward,
an inline step) among PyTorch's own operators; the background step's and the I/O threads' are in
the engine's trace.

Recording costs a few microseconds per event; nothing is recorded unless a tracer is attached.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from pathlib import Path

import torch

from offload_core.errors import StorageDirectoryError

__all__ = ["Tracer"]


class Tracer:
    """Collects trace events from every thread; :meth:`write` saves them as JSON."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:  # (now: a path it cannot write would fail only once the run is over)
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageDirectoryError(e.errno, f"trace {self.path}: cannot make the directory it goes in "
                                                 f"({e.strerror}); name a file in a directory you can write") from None
        if self.path.is_dir():
            raise StorageDirectoryError(errno.EISDIR, f"trace {self.path} is a directory; name a file (step.json)")
        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._named: set[int] = set()

    def now(self) -> float:
        return time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)

    def complete(self, name: str, cat: str, start: float, end: float | None = None, **args) -> None:
        """A span from ``start`` to ``end`` (default: now), on the calling thread's row."""
        end = self.now() if end is None else end
        tid = threading.get_ident()
        event = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start), "dur": round((end - start) * 1e6, 1),
                 "pid": self._pid, "tid": tid}
        if args:
            event["args"] = args
        with self._lock:
            if tid not in self._named:
                self._named.add(tid)
                self._events.append({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                                     "args": {"name": threading.current_thread().name}})
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args):
        """A span around a block of code; also a ``torch.profiler`` range."""
        start = self.now()
        with torch.profiler.record_function(f"tiered_offload::{name}"):
            try:
                yield
            finally:
                self.complete(name, cat, start, **args)

    def counter(self, name: str, **values) -> None:
        with self._lock:
            self._events.append({"name": name, "ph": "C", "ts": self._us(self.now()), "pid": self._pid,
                                 "args": values})

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def write(self) -> Path:
        """Save the events (``{"traceEvents": [...]}``) to :attr:`path`; returns it."""
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)
        return self.path


def span(tracer: Tracer | None, name: str, cat: str, **args):
    """``tracer.span(...)``, or nothing when no tracer is attached."""
    return tracer.span(name, cat, **args) if tracer is not None else contextlib.nullcontext()
