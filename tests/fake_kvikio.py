"""A stand-in for the ``kvikio`` package on machines without it (CI has no GPU): the same calls the
kvikio backend makes, served by POSIX I/O on CPU tensors, with counters the tests read.

It checks the backend's own logic (one CuFile per file, ranges merged per stripe, kvikio's pool
set from the backend's settings, handles closed on delete and close, errors classified), not
kvikio: the GPU check (tools/gpu_check.py) runs the real one.
"""

from __future__ import annotations

import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class _Future:
    def __init__(self, fut):
        self._fut = fut

    def get(self) -> int:
        return self._fut.result()


class FakeKvikio(types.ModuleType):
    def __init__(self, compat: bool = True):
        super().__init__("kvikio")
        self.settings: dict = {}
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.calls: list[tuple[str, str, int, int]] = []
        self._pool = ThreadPoolExecutor(4)
        fake = self

        class Defaults(types.ModuleType):
            def set(self, config):
                fake.settings.update(config)

            def is_compat_mode_preferred(self):
                return compat
        self.defaults = Defaults("kvikio.defaults")

        class CuFile:
            def __init__(self, path, flags="r"):
                self.path = str(path)
                self.fd = os.open(self.path, os.O_RDWR)
                fake.opened.append(self.path)

            def close(self):
                os.close(self.fd)
                fake.closed.append(self.path)

            def pread(self, buf, size, file_offset):
                fake.calls.append(("read", self.path, file_offset, size))

                def run():
                    data = os.pread(self.fd, size, file_offset)
                    buf.numpy()[:len(data)] = np.frombuffer(data, dtype=np.uint8)
                    return len(data)
                return _Future(fake._pool.submit(run))

            def pwrite(self, buf, size, file_offset):
                fake.calls.append(("write", self.path, file_offset, size))
                return _Future(fake._pool.submit(lambda: os.pwrite(self.fd, buf.numpy().tobytes(), file_offset)))
        self.CuFile = CuFile

    def install(self, monkeypatch) -> "FakeKvikio":
        """Put this module in place of kvikio and make CPU tensors take the backend's device path."""
        import storage_backends.kvikio_backend as kb
        monkeypatch.setitem(sys.modules, "kvikio", self)
        monkeypatch.setitem(sys.modules, "kvikio.defaults", self.defaults)
        monkeypatch.setattr(kb, "kvikio_status", lambda: None)
        monkeypatch.setattr(kb, "is_device_buffer", lambda b: hasattr(b, "numpy") and hasattr(b, "is_contiguous"))
        return self
