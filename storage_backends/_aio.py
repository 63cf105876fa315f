"""The single asyncio event loop that asyncio-based backends run their coroutines on.

One daemon thread owns the loop; :func:`submit` schedules a coroutine from any thread and returns
a :class:`concurrent.futures.Future`, which is what the rest of the engine waits on. This is the
only sync/async bridge in the code base.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import Future
from typing import Coroutine

__all__ = ["submit", "loop"]

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():  # (its handles hold the context it is made in: an empty one)
            new = contextvars.Context().run(asyncio.new_event_loop)
            t = threading.Thread(target=new.run_forever, name="tiered-offload-asyncio", daemon=True)
            t.start()
            _loop = new
        return _loop


def submit(coro: Coroutine) -> Future:
    """Run ``coro`` on the shared loop; returns a thread-safe future of its result.

    It runs in an empty context, not a copy of the caller's (``run_coroutine_threadsafe`` takes
    the caller's): a forward keeps state in context variables (transformers records a MoE's
    router logits there), and a task holding that context would keep the forward's outputs, their
    graph and its saved activations alive in a cycle only the garbage collector frees."""
    return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, loop())
