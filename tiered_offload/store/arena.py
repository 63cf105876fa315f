"""A fixed-size memory arena with a first-fit allocator: the budget of the host and device tiers.

The whole budget is allocated once, in :meth:`Arena.open` (pinned on CUDA machines, so the engine
never pins memory per tensor, which is what makes other offload engines run out of pinned
memory), and handed out as page-aligned slices. Because every byte a tier uses comes out of its
arena, the tier can never use more than its budget, whatever the threads do. A host arena is one
anonymous mapping of exactly its capacity, page-locked with ``cudaHostRegister`` when pinned
(:class:`~offload_core.buffers.HostMemory`): PyTorch's pinned allocator would round it up to a
power of two.
"""

from __future__ import annotations

import bisect
import threading

import torch

from offload_core.buffers import PAGE, HostMemory, aligned_empty

__all__ = ["Arena"]


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class Arena:
    """``capacity`` bytes of memory on ``device``, carved into aligned blocks.

    Args:
        name: for messages (``"host"``, ``"device"``).
        capacity: bytes; the tier's budget.
        device: where the memory lives.
        pin_memory: page-lock it (CUDA machines' host tier), so copies to the GPU run by DMA.
        alignment: of every block's offset and size; 4096 suits O_DIRECT and GPUDirect Storage.
    """

    def __init__(self, name: str, capacity: int, device: torch.device, *, pin_memory: bool = False,
                 alignment: int = PAGE):
        self.name = name
        self.capacity = capacity // alignment * alignment  # round down: never more than the budget
        self.device = device
        self.pin_memory = pin_memory
        self.alignment = alignment
        self._buffer: torch.Tensor | None = None
        self._host: HostMemory | None = None
        self._free: list[tuple[int, int]] = []  # sorted (offset, size) holes
        self._lock = threading.Lock()
        self.used = 0
        self.peak_used = 0

    def open(self) -> None:
        """Allocate the backing memory (once)."""
        if self._buffer is None and self.capacity > 0:
            if self.device.type == "cpu" and PAGE % self.alignment == 0:
                self._host = HostMemory(self.capacity, pin=self.pin_memory)
                self._buffer = self._host.tensor
            else:
                self._buffer = aligned_empty(self.capacity, device=self.device, pin_memory=self.pin_memory,
                                             alignment=self.alignment)
            self._free = [(0, self.capacity)]

    @property
    def backing_bytes(self) -> int:
        """Bytes of the memory allocation behind the arena (its capacity, for a host arena)."""
        if self._buffer is None:
            return 0
        return self._buffer.untyped_storage().nbytes()

    @property
    def pinned(self) -> bool:
        """Whether the arena's memory is page-locked for CUDA."""
        return self._host is not None and self._host.pinned

    def close(self) -> None:
        if self._host is not None:
            self._host.release()
            self._host = None
        self._buffer = None
        self._free = []
        self.used = 0

    def block_size(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` occupies (rounded up to the alignment)."""
        return _round_up(max(nbytes, 1), self.alignment)

    def alloc(self, nbytes: int, *, at_end: bool = False) -> int | None:
        """Offset of a free block of ``nbytes`` (rounded up), or None if no hole is large enough.

        Best fit (the smallest hole that is large enough), which keeps large holes whole for
        large tensors when sizes are mixed. ``at_end``: the last bytes of the hole furthest into
        the arena instead, for a copy that stays pinned long (it then splits no hole others share).
        """
        size = self.block_size(nbytes)
        with self._lock:
            best = None
            for i, (off, hole) in enumerate(self._free):
                if hole >= size and (best is None or at_end or hole < self._free[best][1]):
                    best = i
                    if hole == size and not at_end:
                        break
            if best is None:
                return None
            off, hole = self._free[best]
            if hole == size:
                del self._free[best]
            elif at_end:
                self._free[best] = (off, hole - size)
                off += hole - size
            else:
                self._free[best] = (off + size, hole - size)
            self.used += size
            if self.used > self.capacity:  # pragma: no cover - impossible by construction
                raise RuntimeError(f"{self.name} arena accounting broken: {self.used} > {self.capacity}")
            self.peak_used = max(self.peak_used, self.used)
            return off

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block to the arena, merging it with neighbouring holes."""
        size = self.block_size(nbytes)
        with self._lock:
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # merge with the next, then the previous hole
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self.used -= size

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 tensor over a block's bytes.

        Built with ``set_`` rather than by slicing, so each block has its own autograd version
        counter: an in-place update of one tensor (a gradient accumulating) must not look like a
        modification of every other tensor in the arena to autograd.
        """
        if self._buffer is None:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        t = torch.empty(0, dtype=torch.uint8, device=self.device)
        return t.set_(self._buffer.untyped_storage(), self._buffer.storage_offset() + offset, (nbytes,))

    def holes(self) -> list[tuple[int, int]]:
        """The free blocks, ``(offset, bytes)`` in the order of their offsets."""
        with self._lock:
            return list(self._free)

    @property
    def largest_hole(self) -> int:
        with self._lock:
            return max((h for _, h in self._free), default=0)
