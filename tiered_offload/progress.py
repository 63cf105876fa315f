"""Progress bars on the long steps outside training (placing the initial weights, tokenising,
exporting, verifying), shown only where a command asks for them (``tiered-offload train``,
``export``, ``verify``): the library itself stays silent.

    with progress.shown():
        engine = Engine(..., init_from=model_dir)     # "placing weights" bar, one tick per unit
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterable, Iterator, TypeVar

__all__ = ["shown", "track", "counter"]

T = TypeVar("T")
_state = threading.local()


@contextlib.contextmanager
def shown(enabled: bool = True) -> Iterator[None]:
    """Show the bars of the long steps run inside (on this thread), on standard error."""
    before = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = before


def track(items: Iterable[T], *, total: int | None = None, desc: str, unit: str = "it") -> Iterable[T]:
    """``items``, with a bar while :func:`shown` is on and there is more than one item."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    if not getattr(_state, "enabled", False) or (total is not None and total <= 1):
        return items
    from tqdm import tqdm
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


@contextlib.contextmanager
def counter(total: int | None, *, desc: str, unit: str = "B"):
    """``advance(n)`` for a step that reports its own progress (bytes checked, tensors written),
    with a bar while :func:`shown` is on."""
    if not getattr(_state, "enabled", False):
        yield lambda n=1: None
        return
    from tqdm import tqdm
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, dynamic_ncols=True,
              leave=False) as bar:
        yield bar.update
