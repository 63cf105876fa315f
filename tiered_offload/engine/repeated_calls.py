"""A streamed block called more than once before a backward (a weight-shared loop, a model that
runs some layers twice, two forwards whose losses are added): its calls' gradients summed first,
as PyTorch sums them.

Each call is an autograd node of its own, whose backward adds into the block's gradient buffer G.
PyTorch sums a parameter's uses first and then adds: ``G + (g_k + ... + g_1)``; the nodes would give
``((G + g_k) + ...) + g_1``, other bits once G holds an earlier micro-batch's gradient. So a block
called more than once since the last backward (of its micro-batch, in ``forward_backward``) keeps
its calls' gradients apart: the first call's land in fresh tensors (as autograd makes them, outside
the budgets like its other temporaries: one block's gradients), the next ones add into those, and
the sum goes into G when the last call's backward is done (or, where a forward's graph was dropped
without a backward and still held its node, when the backward ends: :meth:`RepeatedCalls.flush`).
A call whose node was freed before the backward began no longer counts
(:meth:`RepeatedCalls.dropped`). Where the whole state fits (PyTorch's graphs kept), a second call
reuses the first's weight leaves instead (``BlockStreamer.run_block_keeping_graph``), and autograd
sums them itself.
"""

from __future__ import annotations

import itertools

import torch

from offload_core.errors import ConfigError
from tiered_offload.engine.parameter_guard import grad_hooks, run_grad_hooks

__all__ = ["RepeatedCalls"]


class RepeatedCalls:
    """The counts and sums of one :class:`~tiered_offload.engine.streaming.BlockStreamer`'s calls,
    per micro-batch (-1 outside ``forward_backward``: a backward may run on autograd's device thread,
    so not per thread)."""

    def __init__(self, streamer):
        self.streamer = streamer
        self._calls: dict[tuple[int, int], int] = {}
        """(micro-batch or -1, block) -> times the block was called since the last backward."""
        self._done: dict[tuple[int, int], int] = {}
        """The same -> of those calls, the ones whose backward ran."""
        self._sums: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        """The same -> its calls' gradients summed so far, per parameter."""
        self._tokens: dict[int, tuple[int, int]] = {}
        """A call counted in ``_calls`` (its number) -> its slot, until the counts start again."""
        self._numbers = itertools.count()

    def _context(self) -> int:
        turns = self.streamer.turns
        k = turns.index() if turns is not None else None
        return -1 if k is None else k

    def called(self, index: int) -> int:
        """Block ``index``'s forward made a node (with autograd): the call's number, for
        :meth:`dropped`."""
        slot = (self._context(), index)
        self._calls[slot] = self._calls.get(slot, 0) + 1
        number = next(self._numbers)
        self._tokens[number] = slot
        return number

    def dropped(self, number: int) -> None:
        """Call ``number``'s node was freed without its backward (a loss logged without ``no_grad``,
        ``torch.autograd.grad`` of a hidden state in the middle of the stack): it no longer counts,
        unless the counts have started again since."""
        slot = self._tokens.pop(number, None)
        if slot is not None and self._calls.get(slot, 0) > 0:
            self._calls[slot] -= 1

    def repeated(self, unit) -> bool:
        """Whether ``unit`` was called more than once since the last backward (of this micro-batch)."""
        return self._calls.get((self._context(), unit.index), 0) > 1

    def consumed(self, unit) -> None:
        """One call's backward ran adding into no gradient (``torch.autograd.grad``): that call no
        longer counts."""
        slot = (self._context(), unit.index)
        if self._calls.get(slot, 0) > 0:
            self._calls[slot] -= 1

    def before(self, unit, params: dict[str, torch.Tensor]) -> None:
        """Before one call's backward: the leaves' ``.grad`` is the sum so far (None for the first)."""
        if self.streamer.sharding is not None:
            raise ConfigError(f"block {unit.name} was called more than once before a backward; sharded, its gradients "
                              f"would be reduced once per call, not summed first as PyTorch does: not supported")
        total = self._sums.setdefault((self._context(), unit.index), {})
        for s_ in unit.trainable():
            params[s_.local_name].grad = total.get(s_.local_name)

    def after(self, unit, params: dict[str, torch.Tensor], gflat: torch.Tensor) -> None:
        """After it: the sum kept; after the last call's, added to ``gflat`` (the block's pinned
        gradient buffer)."""
        slot = (self._context(), unit.index)
        total = self._sums[slot]
        for s_ in unit.trainable():
            leaf = params[s_.local_name]
            if leaf.grad is not None:
                total[s_.local_name] = leaf.grad
                leaf.grad = None
        self._done[slot] = self._done.get(slot, 0) + 1
        if self._done[slot] >= self._calls.get(slot, 0):
            self._add(unit, gflat, slot)

    def _add(self, unit, gflat: torch.Tensor, slot: tuple[int, int]) -> None:
        """G += the calls' sum, as PyTorch's ``.grad += sum``; the sum and the counts dropped."""
        total = self._sums.pop(slot)
        for s_, view in zip(unit.trainable(), unit.grad_views(gflat)):
            if s_.local_name in total:  # (the parameter's own hooks on the sum, as autograd's accumulator runs them)
                view += run_grad_hooks(total[s_.local_name], grad_hooks(s_))
        self.streamer.gradients_done(unit, gflat)
        self._calls.pop(slot, None)
        self._done.pop(slot, None)

    def flush(self) -> None:
        """A backward is over (a micro-batch's, in ``forward_backward``): the sums of blocks whose
        other calls' graphs were dropped go into their buffers; the counts start again."""
        me, store = self._context(), self.streamer.store
        for slot in sorted((k for k in self._sums if k[0] == me), key=lambda k: -k[1]):
            unit = self.streamer.binding.blocks[slot[1]]
            with store.hold(unit.grad_key) as g:
                self._add(unit, g, slot)
        for table in (self._calls, self._done):
            for slot in [k for k in table if k[0] == me]:
                del table[slot]
        for number in [n for n, slot in self._tokens.items() if slot[0] == me]:
            del self._tokens[number]

    def discard(self) -> None:
        """After a backward (every micro-batch's): forget the counts, and every sum not added (a
        failed backward's)."""
        self._calls.clear()
        self._done.clear()
        self._sums.clear()
        self._tokens.clear()
