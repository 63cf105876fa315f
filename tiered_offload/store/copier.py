"""Asynchronous copies between host and device memory, and the ordering rules of the device tier.

On CUDA, host-to-device and device-to-host copies run on two dedicated streams, each copy
followed by an event; the returned future resolves when the event has fired (a helper thread
waits on it), so the caller's compute stream never stalls behind a copy it does not need.

The device tier is one allocation carved by the store's own arena, so the caching allocator's
``record_stream`` bookkeeping does not apply: the store orders reuse itself, against the
*compute stream* (the stream current when the store opened, where the model runs):

* a device-to-host copy, and a GPUDirect write of a device block, first wait for the compute
  stream (an event recorded on it now), so they see every kernel that wrote the source;
* when a device block is freed, an event is recorded on the compute stream (the *fence*): kernels
  queued before that point may still read the block. A copy into a device block waits for the
  latest fence on the device (``wait_event``, no host stall); a GPUDirect read into one, which no
  stream orders, waits for it on the host. Events on one stream complete in order, so the latest
  fence covers every block freed before it.
* a future resolves only after its copy's event fired, so a block is never freed or reused while a
  copy out of or into it is still running.

On the CPU the same calls run ``copy_`` on a small thread pool (large copies release the GIL), so
the store's code is the same on both.
"""

import threading
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
        self._fence = None
        self._fence_lock = threading.Lock()
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(self.device)
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)

    # ---- ordering against the compute stream (CUDA; no-ops on the CPU) ------------------------
    def freed(self) -> None:
        """A device block was freed: record the fence (kernels queued so far may still read it)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.compute_stream)
            with self._fence_lock:
                self._fence = event

    def _latest_fence(self):
        with self._fence_lock:
            return self._fence

    def before_device_read(self) -> None:
        """Before a transfer no stream orders (GPUDirect) writes into a device block: wait, on the host,
        until no queued kernel can still read a block freed before now."""
        fence = self._latest_fence() if self.cuda else None
        if fence is not None:
            fence.synchronize()

    def before_device_write(self) -> None:
        """Before a transfer no stream orders (GPUDirect) reads a device block: wait, on the host, for
        every kernel queued so far on the compute stream (the block's bytes are final)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.compute_stream)
            event.synchronize()

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
        if to_device:
            fence = self._latest_fence()
            if fence is not None:
                stream.wait_event(fence)
        else:
            stream.wait_stream(self.compute_stream)
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
            fence = self._latest_fence()
            if fence is not None:
                self.h2d_stream.wait_event(fence)
            with torch.cuda.stream(self.h2d_stream):
                dst.zero_()
            self.h2d_stream.synchronize()
        else:
            dst.zero_()
