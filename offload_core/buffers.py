"""Caller buffers as raw bytes, and page-aligned buffers for direct I/O.

Backends read into and write from whatever the caller hands them: a contiguous torch tensor of
any dtype, a numpy array, a ``bytearray``/``memoryview``/``mmap``. These helpers give one flat,
writable byte view of such a buffer without copying, and allocate buffers whose address is a
multiple of the page size, which O_DIRECT and GPUDirect Storage need to avoid bounce copies.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from offload_core.errors import TierCapacityError

__all__ = ["PAGE", "byte_view", "buffer_nbytes", "is_device_buffer", "aligned_empty", "tensor_bytes", "HostMemory"]

PAGE = 4096
"""Alignment, in bytes, of direct-I/O offsets, lengths and buffer addresses."""


def is_device_buffer(buf) -> bool:
    """True for a tensor that lives on an accelerator (CUDA), whose bytes the CPU cannot address."""
    return isinstance(buf, torch.Tensor) and buf.device.type != "cpu"


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy), on the tensor's device."""
    if not t.is_contiguous():
        raise ValueError("buffer tensor must be contiguous; call .contiguous() first")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(buf) -> memoryview:
    """A flat, writable ``memoryview`` of format ``B`` over a CPU buffer's bytes (no copy)."""
    if isinstance(buf, torch.Tensor):
        if is_device_buffer(buf):
            raise ValueError(f"buffer is on {buf.device}; this backend needs a CPU buffer")
        return memoryview(tensor_bytes(buf).numpy())
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("numpy buffer must be C-contiguous")
        return memoryview(buf.reshape(-1).view(np.uint8))
    mv = memoryview(buf)
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


def buffer_nbytes(buf) -> int:
    """Size in bytes of any buffer the backends accept, CPU or device."""
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    if isinstance(buf, np.ndarray):
        return buf.nbytes
    return memoryview(buf).nbytes


def aligned_empty(nbytes: int, *, device: str | torch.device = "cpu", pin_memory: bool = False,
                  alignment: int = PAGE) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose first byte sits at a multiple of ``alignment``.

    Allocates ``alignment`` spare bytes and slices, so it works for plain, pinned and device memory.
    The pages are not touched here: on the CPU they cost resident memory only once written.
    """
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    skew = (-raw.data_ptr()) % alignment
    return raw[skew:skew + nbytes]


class HostMemory:
    """Exactly ``nbytes`` of page-aligned host memory, page-locked for CUDA if asked.

    The memory is an anonymous mapping of ``nbytes`` (a multiple of the page size), so its backing
    allocation is the request, not more: ``torch.empty(..., pin_memory=True)`` goes through
    PyTorch's caching host allocator, which rounds a pinned block up to the next power of two
    (a 4 GiB budget +4 KiB of alignment slack pins 8 GiB). ``pin=True`` page-locks the mapping
    with ``cudaHostRegister``, so host<->device copies from it run by DMA and asynchronously, and
    the pinned bytes are the budget. :meth:`release` unregisters it (before the mapping goes).

    Pages are committed when first written (or all at once when pinned: the driver locks them).
    """

    def __init__(self, nbytes: int, *, pin: bool = False):
        if nbytes <= 0 or nbytes % PAGE:
            raise ValueError(f"host memory size must be a positive multiple of {PAGE}, got {nbytes}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        """The whole mapping as one uint8 tensor (its storage is exactly ``nbytes``)."""
        self.pinned = False
        if pin:
            code = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if code != 0:
                self.release()
                raise TierCapacityError(
                    f"page-locking {nbytes} bytes of host memory for CUDA failed (cudaError {code}); the system's "
                    f"locked-memory limit may be too low (ulimit -l), or the host budget too large for this machine")
            self.pinned = True

    def release(self) -> None:
        """Unpin (if pinned) and drop this object's reference to the memory.

        Tensors still viewing it keep the mapping alive (unpinned) until they go."""
        if self.pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        self._map = None

    def __del__(self):  # pragma: no cover - close() normally releases first
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
