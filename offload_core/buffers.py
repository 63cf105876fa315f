"""Caller buffers as raw bytes, and page-aligned buffers for direct I/O.

Backends read into and write from whatever the caller hands them: a contiguous torch tensor of
any dtype, a numpy array, a ``bytearray``/``memoryview``/``mmap``. These helpers give one flat,
writable byte view of such a buffer without copying, and allocate buffers whose address is a
multiple of the page size, which O_DIRECT and GPUDirect Storage need to avoid bounce copies.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PAGE", "byte_view", "buffer_nbytes", "is_device_buffer", "aligned_empty", "tensor_bytes"]

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
