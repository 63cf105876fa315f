"""Property-based check of the store against a plain dict (Hypothesis rule-based state machine).

Any sequence of register / write / prefetch / get (and modify) / evict / write-back / release,
with the lookahead's orders and marks changing in between, must return exactly the bytes a dict
of tensors would, whatever the tiers did underneath.
"""

import os

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from offload_core.errors import TensorStateError
from storage_backends.kvikio_backend import kvikio_status
from storage_backends.memory import MemoryBackend
from storage_backends.posix import PosixBackend
from tiered_offload import TieredStore

KiB = 1024
TIERS = st.sampled_from(["device", "host"])
DEVICE = os.environ.get("TIERED_OFFLOAD_TEST_STORE_DEVICE", "cpu")
"""The device tier's device: ``cuda`` runs the machine with a GPU tier (the GPU check does)."""
BACKENDS = ["memory", "posix"] + (["kvikio"] if DEVICE == "cuda" and kvikio_status() is None else [])


class StoreMatchesDict(RuleBasedStateMachine):
    keys = Bundle("keys")
    pins = Bundle("pins")

    def __init__(self):
        super().__init__()
        self.model: dict[str, torch.Tensor] = {}
        self.pinned: dict[tuple[str, str], int] = {}
        self.counter = 0

    @initialize(backend=st.sampled_from(BACKENDS), policy=st.sampled_from(["lru", "lookahead"]),
                caching=st.sampled_from(["exclusive", "inclusive"]), share=st.sampled_from([0.0, 0.125, 1.0]))
    def open_store(self, backend, policy, caching, share):
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        if backend == "memory":
            b = MemoryBackend()
        elif backend == "kvikio":
            from storage_backends.kvikio_backend import KvikioBackend
            b = KvikioBackend(self.tmp.name, chunk_bytes="16KiB")
        else:
            b = PosixBackend(self.tmp.name, chunk_bytes="16KiB")
        self.store = TieredStore(b, host_budget_bytes=64 * KiB, device=DEVICE, device_budget_bytes=32 * KiB,
                                 policy=policy, prefetch_depth=3, tier_caching=caching,
                                 host_prefetch_share=share).open()

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close(flush=False)
            self.tmp.cleanup()

    @rule(target=keys, numel=st.integers(0, 3 * KiB), with_data=st.booleans(), seed=st.integers(0, 1000))
    def register(self, numel, with_data, seed):
        key = f"t{self.counter}"
        self.counter += 1
        data = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) if with_data else None
        self.store.register(key, (numel,), data=data)
        self.model[key] = data.clone() if with_data else torch.zeros(numel)
        self.store.declare_access_sequence(sorted(self.model))
        return key

    @rule(key=keys, seed=st.integers(0, 1000))
    def write(self, key, seed):
        if any(k == key for k, _ in self.pinned):
            return  # would leave the pinned copy stale: the store refuses to reload into it (tested elsewhere)
        data = torch.randn(self.model[key].shape, generator=torch.Generator().manual_seed(seed))
        self.store.write(key, data)
        self.model[key] = data

    @rule(key=keys, tier=TIERS)
    def prefetch(self, key, tier):
        self.store.prefetch(key, tier).get()

    @rule(key=keys, tier=TIERS)
    def get_and_check(self, key, tier):
        with self.store.hold(key, tier) as t:
            assert torch.equal(t.cpu(), self.model[key])

    @rule(key=keys, tier=TIERS, delta=st.floats(-4, 4, allow_nan=False))
    def modify(self, key, tier, delta):
        if any(k == key for k, _ in self.pinned):
            return  # the pinned copy would go stale; the contract says modify only what you hold
        with self.store.hold(key, tier, dirty=True) as t:
            t.add_(delta)
        self.model[key] = self.model[key] + delta

    @precondition(lambda self: len(self.pinned) < 1)
    @rule(target=pins, key=keys, tier=TIERS)
    def pin(self, key, tier):
        self.store.get(key, tier)
        self.pinned[(key, tier)] = self.pinned.get((key, tier), 0) + 1
        return (key, tier)

    @rule(pin=consumes(pins))
    def release(self, pin):
        self.store.release(*pin)
        self.pinned[pin] -= 1
        if not self.pinned[pin]:
            del self.pinned[pin]

    @rule(key=keys, tier=TIERS)
    def evict(self, key, tier):
        try:
            self.store.evict(key, tier).get()
        except TensorStateError:
            assert (key, tier) in self.pinned

    @rule(key=keys)
    def write_back(self, key):
        self.store.write_back(key).get()

    @rule(key=keys, cancel=st.booleans())
    def rewrite_due(self, key, cancel):
        """The update on the host's marks: the device's lookahead leaves the key alone, and a copy
        the host reads from the device then leaves the device."""
        self.store.rewrite_due([key], None if cancel else "device")

    @rule(backwards=st.booleans())
    def device_order(self, backwards):
        """The device tier's own order, not cyclic (an update in the host tier)."""
        self.store.declare_access_sequence(sorted(self.model, reverse=backwards), tier="device", cyclic=False)

    @invariant()
    def budgets(self):
        if hasattr(self, "store"):
            for tier in ("host", "device"):
                assert self.store.used(tier) <= self.store.capacity(tier)

    @invariant()
    def reads_match(self):
        if hasattr(self, "store") and not self.pinned:
            for key, t in self.model.items():
                assert torch.equal(self.store.read(key).cpu(), t), key


StoreMatchesDict.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERED_OFFLOAD_TEST_EXAMPLES", 100)), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestStoreMatchesDict = StoreMatchesDict.TestCase
