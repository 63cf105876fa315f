"""Reusable tests for storage backends, and a fault-injecting wrapper backend.

Every backend, a third-party one included, proves its conformance by subclassing
:class:`BackendConformanceTests` in a pytest module and providing ``make_backend``::

    from storage_backends.testing import BackendConformanceTests

    class TestMyBackend(BackendConformanceTests):
        def make_backend(self, tmp_path):
            return MyBackend(tmp_path / "store")   # unopened; the suite opens and closes it

:class:`FaultInjectingBackend` wraps any backend and adds latency or fails chosen requests (ENOSPC
after a byte quota, I/O errors on chosen keys), to test the layers above without a broken disk.
"""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future
from typing import Callable

import numpy as np
import pytest
import torch

from offload_core.buffers import buffer_nbytes
from offload_core.errors import (
    BackendClosedError,
    DiskFullError,
    ExtentNotFoundError,
    ShortReadError,
    StorageIOError,
)
from offload_core.futures import IOFuture, failed

from .base import StorageBackend

__all__ = ["BackendConformanceTests", "FaultInjectingBackend"]

ODD_SIZES = [1, 7, 4095, 4096, 4097, 65536 + 13, (1 << 20), (1 << 20) + 4096 + 3, (9 << 20) + 17]


def _pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class BackendConformanceTests:
    """The behaviour every storage backend must have. Subclass and define :meth:`make_backend`."""

    large_bytes = 256 << 20
    """Size of the large-tensor round trip (the contract says at least 256 MiB)."""
    buffer_device = "cpu"
    """Where the round trips' tensors live: ``"cuda"`` runs them with device buffers (for a backend
    whose ``supports_device_buffers`` is true)."""

    def on(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on :attr:`buffer_device`."""
        return t.to(self.buffer_device)

    def empty(self, n: int, dtype=torch.uint8) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.buffer_device)

    def make_backend(self, tmp_path) -> StorageBackend:
        raise NotImplementedError

    @pytest.fixture
    def backend(self, tmp_path):
        b = self.make_backend(tmp_path)
        b.open()
        yield b
        b.close()

    # ---- round trips --------------------------------------------------------------------
    @pytest.mark.parametrize("nbytes", ODD_SIZES)
    def test_round_trip_sizes(self, backend, nbytes):
        data = self.on(_pattern(nbytes, nbytes))
        assert backend.write_from("k", data).get() == nbytes
        assert backend.exists("k")
        assert backend.size("k") == nbytes
        out = self.empty(nbytes)
        assert backend.read_into("k", out).get() == nbytes
        assert torch.equal(out, data)

    def test_typed_tensors_numpy_and_bytearray(self, backend):
        t = self.on(torch.randn(123, 45))
        backend.write_from("float", t).get()
        out = torch.empty_like(t)
        backend.read_into("float", out).get()
        assert torch.equal(out, t)
        arr = np.arange(1000, dtype=np.int64)
        backend.write_from("np", arr).get()
        back = np.zeros_like(arr)
        backend.read_into("np", back).get()
        assert np.array_equal(arr, back)
        raw = bytearray(b"tiered-offload" * 100)
        backend.write_from("bytes", raw).get()
        got = bytearray(len(raw))
        backend.read_into("bytes", got).get()
        assert got == raw

    def test_offsets_inside_an_extent(self, backend):
        whole = self.on(_pattern(3 * 4096 + 100, 1))
        backend.write_from("k", whole).get()
        # overwrite a middle range that starts and ends off page boundaries
        patch = self.on(_pattern(5000, 2))
        backend.write_from("k", patch, offset=4000).get()
        expected = whole.clone()
        expected[4000:9000] = patch
        out = self.empty(len(whole))
        backend.read_into("k", out).get()
        assert torch.equal(out, expected)
        part = self.empty(777)
        backend.read_into("k", part, offset=8191).get()
        assert torch.equal(part, expected[8191:8191 + 777])

    def test_write_at_offset_extends(self, backend):
        backend.write_from("k", self.on(_pattern(10, 3))).get()
        tail = self.on(_pattern(100, 4))
        backend.write_from("k", tail, offset=8192).get()
        assert backend.size("k") == 8192 + 100
        out = self.empty(100)
        backend.read_into("k", out, offset=8192).get()
        assert torch.equal(out, tail)

    def test_unaligned_caller_buffer(self, backend):
        base = self.empty(2 * 4096 * 3 + 1)
        view = base[1:1 + 4096 * 3]  # one byte past an aligned start: never page-aligned
        view.copy_(self.on(_pattern(len(view), 5)))
        backend.write_from("k", view).get()
        out_base = torch.empty_like(base)
        out = out_base[3:3 + len(view)]
        backend.read_into("k", out).get()
        assert torch.equal(out, view)

    def test_keys_with_slashes_and_odd_characters(self, backend):
        keys = ["layers.0.attn/exp_avg", "../../etc/passwd", ".hidden", "ünïcode key"]
        for i, k in enumerate(keys):
            backend.write_from(k, _pattern(100, i)).get()
        for i, k in enumerate(keys):
            out = torch.empty(100, dtype=torch.uint8)
            backend.read_into(k, out).get()
            assert torch.equal(out, _pattern(100, i))
        try:
            listed = backend.keys()
        except NotImplementedError:
            return
        assert set(keys) <= set(listed)

    # ---- concurrency and size -----------------------------------------------------------
    def test_many_concurrent_requests(self, backend):
        n, size = 64, 100_000
        datas = [self.on(_pattern(size, i)) for i in range(n)]
        writes = [backend.write_from(f"k{i}", d) for i, d in enumerate(datas)]
        assert [w.get() for w in writes] == [size] * n
        outs = [self.empty(size) for _ in range(n)]
        reads = [backend.read_into(f"k{i}", o) for i, o in enumerate(outs)]
        assert [r.get() for r in reads] == [size] * n
        for d, o in zip(datas, outs):
            assert torch.equal(d, o)

    def test_large_tensor(self, backend):
        data = self.empty(self.large_bytes // 4, torch.float32)
        data.view(torch.int32).copy_(torch.arange(len(data), dtype=torch.int32, device=data.device))
        backend.write_from("big", data).get()
        out = torch.empty_like(data)
        backend.read_into("big", out).get()
        assert torch.equal(out.view(torch.int32), data.view(torch.int32))

    # ---- errors -------------------------------------------------------------------------
    def test_read_never_written(self, backend):
        with pytest.raises(ExtentNotFoundError) as info:
            backend.read_into("nope", torch.empty(10, dtype=torch.uint8)).get()
        assert "nope" in str(info.value)
        assert not backend.exists("nope")
        with pytest.raises(ExtentNotFoundError):
            backend.size("nope")

    def test_read_past_end_is_short(self, backend):
        backend.write_from("k", self.on(_pattern(1000))).get()
        with pytest.raises(ShortReadError) as info:
            backend.read_into("k", self.empty(5000)).get()
        assert "k" in str(info.value)

    def test_delete(self, backend):
        backend.write_from("k", _pattern(100)).get()
        backend.delete("k")
        assert not backend.exists("k")
        backend.delete("k")  # idempotent
        with pytest.raises(ExtentNotFoundError):
            backend.read_into("k", torch.empty(100, dtype=torch.uint8)).get()

    def test_read_needs_writable_buffer(self, backend):
        backend.write_from("k", _pattern(10)).get()
        with pytest.raises(ValueError):
            backend.read_into("k", b"0123456789")

    def test_flush(self, backend):
        backend.write_from("k", _pattern(5000)).get()
        backend.flush()
        assert backend.size("k") == 5000

    def test_close_with_requests_in_flight(self, tmp_path):
        b = self.make_backend(tmp_path).open()
        datas = [_pattern(300_000, i) for i in range(32)]
        futures = [b.write_from(f"k{i}", d) for i, d in enumerate(datas)]
        b.close()  # must wait for, not abandon, what is in flight
        assert all(f.done() for f in futures)
        assert [f.get() for f in futures] == [300_000] * 32
        with pytest.raises(BackendClosedError):
            b.write_from("late", _pattern(10))
        with pytest.raises(BackendClosedError):
            b.exists("k0")


class FaultInjectingBackend(StorageBackend):
    """Wraps a backend: optional latency per request, ENOSPC after a write quota, failing keys.

    Args:
        inner: the wrapped backend (opened and closed with this one).
        latency_s: sleep before each request is handed on (on a helper thread; the caller is not blocked).
        write_quota_bytes: writes beyond this many bytes in total fail with :class:`DiskFullError`.
        fail_reads: predicate on the key; matching reads fail with :class:`StorageIOError`.
    """

    name = "faulty"

    def __init__(self, inner: StorageBackend, *, latency_s: float = 0.0, write_quota_bytes: int | None = None,
                 fail_reads: Callable[[str], bool] | None = None):
        super().__init__()
        self.inner = inner
        self.latency_s = latency_s
        self.write_quota_bytes = write_quota_bytes
        self.fail_reads = fail_reads
        self.written_bytes = 0
        self._lock = threading.Lock()

    @property
    def supports_direct_io(self) -> bool:
        return self.inner.supports_direct_io

    @property
    def location(self) -> str:
        return f"faulty({self.inner.location})"

    @property
    def directories(self) -> list:
        """The wrapped backend's directories (so a durable engine can keep its state files there)."""
        return list(self.inner.directories)

    @property
    def stripe_bytes(self):
        return self.inner.stripe_bytes

    @property
    def stripe_weights(self):
        return self.inner.stripe_weights

    @property
    def supports_rewrite(self) -> bool:
        return self.inner.supports_rewrite

    def describe(self, key: str) -> str:
        return self.inner.describe(key)

    def _sync(self, keys: list[str]) -> None:
        self.inner.sync(keys)

    def _open(self) -> None:
        self.inner.open()

    def _close(self) -> None:
        self.inner.close()

    def _delayed(self, start: Callable[[], IOFuture], description: str) -> IOFuture:
        if not self.latency_s:
            return start()
        out: Future = Future()

        def run() -> None:
            time.sleep(self.latency_s)
            try:
                inner = start()
                inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(f.get()))
            except BaseException as e:
                out.set_exception(e)
        threading.Thread(target=run, daemon=True).start()
        return IOFuture(out, description)

    def _read_into(self, key, buffer, offset) -> IOFuture:
        if self.fail_reads and self.fail_reads(key):
            return failed(StorageIOError(errno.EIO, f"injected read failure on {key!r}"))
        return self._delayed(lambda: self.inner.read_into(key, buffer, offset), f"read {key}")

    def _write_from(self, key, buffer, offset) -> IOFuture:
        n = buffer_nbytes(buffer)
        with self._lock:
            if self.write_quota_bytes is not None and self.written_bytes + n > self.write_quota_bytes:
                free = max(0, self.write_quota_bytes - self.written_bytes)
                return failed(DiskFullError(f"injected ENOSPC writing {key!r} (needed {n} bytes, {free} free)",
                                            path=self.inner.describe(key), needed_bytes=n, free_bytes=free))
            self.written_bytes += n
        return self._delayed(lambda: self.inner.write_from(key, buffer, offset), f"write {key}")

    def _allocate(self, key, nbytes, dtype, shape) -> None:
        self.inner.allocate(key, nbytes, dtype=dtype, shape=shape)

    def _delete(self, key) -> None:
        self.inner.delete(key)

    def _exists(self, key) -> bool:
        return self.inner.exists(key)

    def _size(self, key) -> int:
        return self.inner.size(key)

    def _keys(self) -> list[str]:
        return self.inner.keys()

    def _flush(self) -> None:
        self.inner.flush()

    def free_bytes(self) -> int | None:
        if self.write_quota_bytes is None:
            return self.inner.free_bytes()
        return max(0, self.write_quota_bytes - self.written_bytes)
