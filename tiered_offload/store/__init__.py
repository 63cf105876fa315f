"""The three-tier store: device memory, a bounded (pinned) host pool and storage, one record per
tensor, arenas of exactly the budget, LRU and lookahead policies, copy streams."""

from .policies import EvictionPolicy, LookaheadPolicy, LRUPolicy, make_policy
from .record import Operation, OpKind, StoreStats, TensorRecord
from .tiered_store import TieredStore
from .tiers import CopyState, Tier

__all__ = ["TieredStore", "StoreStats", "TensorRecord", "Tier", "CopyState", "EvictionPolicy", "LookaheadPolicy",
           "LRUPolicy", "make_policy", "Operation", "OpKind"]
