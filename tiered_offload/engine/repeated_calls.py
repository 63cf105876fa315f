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
A later call's backward starts each weight's gradient from the sum so far (:func:`first_arrivals`):
a weight the block reads twice in a call then adds each use to the sum in turn, as in PyTorch's
one graph, not the call's two uses summed first.
A call whose node was freed before the backward began no longer counts
(:meth:`RepeatedCalls.dropped`). Where the whole state fits (PyTorch's graphs kept), a second call
reuses the first's weight leaves instead (``BlockStreamer.run_block_keeping_graph``), and autograd
sums them itself.

**Under autocast**, calls in one region share autocast's cast of each weight (its cache), and
PyTorch sums the calls' gradients of that cast in its dtype (bf16) before the cast's backward
converts the sum to fp32; calls in a region each have a cast each, summed in fp32. Each call of the
engine casts for itself, so where the calls were in one region (:func:`autocast_region`: the same
cast node of a sentinel; in a ``forward_backward`` pass, one micro-batch's forward), the sum of a
weight read only through the cast (:func:`read_through_casts`) is rounded to the cast's dtype
after each call's gradient is added, as PyTorch's sum is. (A weight a module casts itself,
``.to(torch.bfloat16)``, looks the same and is rounded too; PyTorch would not.) Calls some in one
region and some in another are refused, and so are calls in one region of a block that reads a
weight's cast more than once in a call (PyTorch adds each use in turn to the shared sum).
"""

from __future__ import annotations

import itertools

import torch

from offload_core.errors import ConfigError
from tiered_offload.engine.parameter_guard import grad_hooks, run_grad_hooks

__all__ = ["RepeatedCalls", "autocast_region", "first_arrivals", "read_through_casts"]


def autocast_region(sentinel: torch.Tensor) -> tuple[object, torch.dtype] | None:
    """Which autocast region (with its cache) a call runs in, and the dtype it casts to; None
    outside one. The node of autocast's cast of ``sentinel`` (a leaf requiring grad, on the compute
    device) is cached until the outermost region ends, so two calls are in one region where it is
    the same node (held here, it is not freed and its address not reused)."""
    kind = sentinel.device.type
    if not (torch.is_autocast_enabled(kind) and torch.is_autocast_cache_enabled()):
        return None
    with torch.enable_grad():
        node = torch.mm(sentinel, sentinel).grad_fn.next_functions[0][0]
    return node, torch.get_autocast_dtype(kind)


def read_through_casts(outputs: list[torch.Tensor], leaves: dict[str, torch.Tensor]) -> tuple[set[str], set[str]]:
    """Of ``leaves`` (name -> weight leaf), those whose every use in the graph of ``outputs`` is a
    dtype cast (autocast's: ``ToCopyBackward``); and of those, the ones whose cast is read more
    than once in the graph (a layer applied twice in the call)."""
    names = {id(t): n for n, t in leaves.items()}
    users: dict[str, set[str]] = {}
    reads: dict[object, int] = {}  # a node -> the edges into it
    casts: dict[str, list] = {}
    seen, stack = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            reads[child] = reads.get(child, 0) + 1
            if type(child).__name__ == "AccumulateGrad":
                name = names.get(id(child.variable))
                if name is not None:
                    users.setdefault(name, set()).add(type(node).__name__)
                    casts.setdefault(name, []).append(node)
            else:
                stack.append(child)
    through = {n for n, kinds in users.items() if all(k.startswith("ToCopyBackward") for k in kinds)}
    return through, {n for n in through if sum(reads.get(c, 0) for c in casts[n]) > 1}


def first_arrivals(leaves: dict[str, torch.Tensor], sums: dict[str, torch.Tensor], pairs: list[tuple]) -> list[tuple]:
    """``(output, gradient)`` pairs to back-propagate instead of a call's ``pairs`` so that each
    leaf's first gradient in that backward is its calls' sum so far: the outputs pass through one
    node (:class:`_StartFrom`) whose backward gives each leaf its sum and each output its gradient,
    so the sum reaches the leaf's gradient buffer before any of the call's uses (they run after that
    node), whatever order autograd would run independent nodes in. The uses then add to it one at a
    time, as they add to PyTorch's buffer of the whole graph, which sums the later call's uses
    first: ``((d + c) + b) + a`` for a weight read twice in each of two calls, where summing each
    call's uses first, then the calls, would give ``(d + c) + (b + a)``: other bits."""
    if not leaves:  # (the first call)
        return pairs
    with torch.enable_grad():  # (a backward runs without grad mode)
        if not pairs:  # (no output needs a gradient: the sums alone)
            return [(leaf.view_as(leaf), sums[name]) for name, leaf in leaves.items()]
        outs = _StartFrom.apply([sums[n] for n in leaves], len(leaves), *leaves.values(), *(o for o, _ in pairs))
    return list(zip(outs, (g for _, g in pairs)))


class _StartFrom(torch.autograd.Function):
    """Passes ``outputs`` through; its backward gives ``leaves`` the ``sums`` first (its edges to
    them come first), then the outputs their gradients."""

    @staticmethod
    def forward(ctx, sums, n, *tensors):
        ctx.sums = sums
        return tuple(t.view_as(t) for t in tensors[n:])

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.sums, *grads)


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
        self._regions: dict[int, tuple[object, torch.dtype] | None] = {}
        """The same -> the autocast region it ran in (:func:`autocast_region`)."""
        self._rounded: dict[tuple[int, int], tuple[set[str], torch.dtype]] = {}
        """A slot whose calls shared one region -> the weights whose sums are rounded, and to what."""
        self._sentinel: torch.Tensor | None = None
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
        if self._sentinel is None:
            self._sentinel = torch.ones(1, 1, device=self.streamer.device, requires_grad=True)
        region = autocast_region(self._sentinel)
        if region is not None and slot[0] >= 0:  # a forward_backward pass: a region per micro-batch's forward
            region = ("micro-batch", slot[0]), region[1]
        self._regions[number] = region
        return number

    def dropped(self, number: int) -> None:
        """Call ``number``'s node was freed without its backward (a loss logged without ``no_grad``,
        ``torch.autograd.grad`` of a hidden state in the middle of the stack): it no longer counts,
        unless the counts have started again since."""
        slot = self._tokens.pop(number, None)
        self._regions.pop(number, None)
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

    def before(self, unit, params: dict[str, torch.Tensor], pairs: list[tuple]) -> list[tuple]:
        """Before one call's backward (of ``pairs``, each an output and its gradient): the pairs to
        back-propagate instead, which give each leaf the sum so far as its first gradient (the
        call's own for the first call; see :func:`first_arrivals`); under one autocast region,
        which sums are rounded (see the module's doc)."""
        if self.streamer.sharding is not None:
            raise ConfigError(f"block {unit.name} was called more than once before a backward; sharded, its gradients "
                              f"would be reduced once per call, not summed first as PyTorch does: not supported")
        slot = (self._context(), unit.index)
        regions = [self._regions.get(n) for n, s in self._tokens.items() if s == slot]
        shared = len(regions) > 1 and regions[0] is not None and all(r is not None and r[0] == regions[0][0]
                                                                       for r in regions)
        if shared:
            through, reread = read_through_casts([o for o, _ in pairs], params)
            if reread:  # PyTorch adds each use in turn to the shared cast's sum; the engine, a call's uses first
                raise ConfigError(f"block {unit.name} was called {len(regions)} times before a backward in one "
                                  f"torch.autocast region and reads {sorted(reread)[0]} through autocast's cast "
                                  f"more than once in a call: PyTorch sums those uses' gradients in bf16 in an order "
                                  f"the engine does not follow. Put each forward in an autocast region of its own")
            self._rounded[slot] = through, regions[0][1]
        elif len({r[0] for r in regions if r is not None}) < sum(r is not None for r in regions):
            raise ConfigError(f"block {unit.name} was called {len(regions)} times before a backward under "
                              f"torch.autocast, some calls in one autocast region and some in another: PyTorch sums "
                              f"their gradients through autocast's casts in an order the engine does not follow. Put "
                              f"the forwards in one region, or each in a region of its own")
        total = self._sums.setdefault(slot, {})
        for s_ in unit.trainable():  # (not the store's buffer: the sum goes there after the last call)
            params[s_.local_name].grad = None
        return first_arrivals({n: params[n] for n in total}, total, pairs)

    def after(self, unit, params: dict[str, torch.Tensor], gflat: torch.Tensor) -> None:
        """After it: the sum kept; after the last call's, added to ``gflat`` (the block's pinned
        gradient buffer)."""
        slot = (self._context(), unit.index)
        total = self._sums[slot]
        rounded, dtype = self._rounded.pop(slot, ((), None))
        for s_ in unit.trainable():
            leaf = params[s_.local_name]
            if leaf.grad is not None:  # (one region: the sum in the casts' dtype, as PyTorch's)
                total[s_.local_name] = leaf.grad.to(dtype).float() if s_.local_name in rounded else leaf.grad
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
            self._regions.pop(number, None)

    def discard(self) -> None:
        """After a backward (every micro-batch's): forget the counts, and every sum not added (a
        failed backward's)."""
        self._calls.clear()
        self._done.clear()
        self._sums.clear()
        self._tokens.clear()
        self._regions.clear()
        self._rounded.clear()
