"""Asynchronous copies between host and device memory.

On CUDA, host-to-device and device-to-host copies run on two dedicated streams, each copy
followed by an event; the returned future resolves when the event has fired (a helper thread
waits on it), so the caller's compute stream never stalls behind a copy it does not need.
Device-to-host copies first wait for the current stream, so they see every kernel that wrote
the source. On the CPU the same calls run ``copy_`` on a small thread pool (large copies release
the GIL), so the store's code is the same on both.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from offload_core.futures import IOFuture

__all__ = ["Copier"]


class Copier:
    """Copies between the host pool and the device tier, on streams where there are any."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._pool: ThreadPoolExecutor | None = None
        self.h2d_stream = self.d2h_stream = None

    def open(self) -> None:
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tiered-offload-copy")
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, description: str = "") -> IOFuture:
        """Copy ``src`` into ``dst`` (same number of bytes) asynchronously; the future gives the bytes."""
        nbytes = src.numel() * src.element_size()
        if not self.cuda or (dst.device.type == "cpu" and src.device.type == "cpu"):
            def run() -> int:
                dst.copy_(src)
                return nbytes
            return IOFuture(self._pool.submit(run), description)
        to_device = dst.device.type == "cuda"
        stream = self.h2d_stream if to_device else self.d2h_stream
        if not to_device:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)

        def wait() -> int:
            event.synchronize()
            return nbytes
        return IOFuture(self._pool.submit(wait), description)

    def fill_zero(self, dst: torch.Tensor) -> None:
        """Zero ``dst`` now (on the H2D stream on CUDA, synchronised before returning)."""
        if self.cuda and dst.device.type == "cuda":
            with torch.cuda.stream(self.h2d_stream):
                dst.zero_()
            self.h2d_stream.synchronize()
        else:
            dst.zero_()
