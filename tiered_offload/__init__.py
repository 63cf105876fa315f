"""tiered-offload: train PyTorch models whose fp32 training state exceeds GPU memory and host RAM.

The state streams through three tiers (device memory, a bounded host pool, NVMe files) managed
by a :class:`TieredStore` with a lookahead scheduler, on pluggable storage backends.
"""

from offload_core.errors import *  # noqa: F401,F403 - the typed errors are part of the public API
from offload_core.errors import __all__ as _error_names
from offload_core.futures import IOFuture
from offload_core.sizes import format_size, parse_size

from .config import EngineConfig, StoreConfig
from .engine import Engine, EngineStats, Plan, empty_init, recomputing
from .store import (
    CopyState,
    EvictionPolicy,
    LookaheadPolicy,
    LRUPolicy,
    StoreStats,
    TensorRecord,
    Tier,
    TieredStore,
)

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "empty_init",
    "recomputing",
    "Plan",
    "EngineStats",
    "TieredStore",
    "StoreConfig",
    "EngineConfig",
    "StoreStats",
    "TensorRecord",
    "Tier",
    "CopyState",
    "IOFuture",
    "EvictionPolicy",
    "LRUPolicy",
    "LookaheadPolicy",
    "parse_size",
    "format_size",
    "__version__",
    *_error_names,
]
