"""Gradients across a streamed block's boundary, as PyTorch computes them: a tensor that several
streamed blocks take as input gets its gradient added in PyTorch's order, and an output that
needs no gradient inside the block needs none outside it.

An encoder-decoder passes the encoder's output to every decoder block, and T5 passes its position
bias from block 0 to the others. In plain PyTorch each *use* inside each block adds its gradient
into one running sum, in the order backward reaches the uses: block 2's two uses, then block 1's,
and so on. A streamed block is one autograd node, so autograd would first add the uses inside each
block together and then add the blocks' sums: the same numbers, associated differently, not the
same bits.

So the blocks' backwards chain one running sum instead: each block's backward starts its input's
gradient from the sum so far (a root of the block's own backward, so it is added first, as
PyTorch's sum holds it when the block's uses arrive), and hands the new sum on; the last block to
run its backward returns it to autograd, the others return nothing for that input. A tensor used
by only one block (a hidden state passed from one block to the next) is returned as before. In
``forward_backward`` each micro-batch's blocks chain a sum of their own, also for a tensor that all
of them take (a parameter outside the blocks given to every block), as the loop's backwards do.

A block's input that code outside the streamed blocks also uses (a block's output the model adds
again further on, a loss on ``output_hidden_states``) gets gradients from those uses too. PyTorch
adds each as it arrives; one that arrives before a block's backward (its node was created after
the block's ops, as the model's later code is) is in the sum before the block's uses. Autograd
would add it to the block's whole sum instead. So around each backward
(:meth:`SharedInputs.outside_uses`) hooks on those outside nodes move such a gradient into the
running sum while blocks that take the tensor are still to run their backward (it seeds the next
one), and leave it to autograd once they all have, as PyTorch adds it then.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from offload_core.errors import TensorStateError
from tiered_offload.engine.activations import graph_nodes

__all__ = ["SharedInputs", "SharedInput", "awaited", "keep_non_differentiable"]


@dataclass(eq=False)
class SharedInput:
    """One tensor given to streamed blocks: how many of their backwards are still to run, and the
    sum of the gradients the others gave it so far."""

    tensor: weakref.ref
    users: int = 0
    grad: torch.Tensor | None = None


class SharedInputs:
    """The block inputs of the forwards whose backward has not run (see the module's docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[tuple[int | None, int], SharedInput] = {}

    PRUNE_AT = 1024
    """Entries held before those of tensors gone (and holding no sum) are dropped: forwards with
    no ``engine.backward`` after them (``torch.autograd.grad`` of an input, run again and again
    for saliency maps) leave theirs, which only :meth:`backward_done` clears."""

    def take(self, tensors: list[torch.Tensor], micro_batch: int | None = None) -> list[SharedInput | None]:
        """A block's forward takes ``tensors``: one entry per tensor that requires a gradient. In
        ``forward_backward`` each ``micro_batch`` has its own entries: a tensor every micro-batch's
        blocks take (a parameter outside the blocks given to each, DeBERTa's relative embeddings)
        gets a sum per micro-batch's backward, as the loop's backwards add them."""
        if len(self._by_id) > self.PRUNE_AT:
            self._by_id = {k: e for k, e in self._by_id.items() if e.tensor() is not None or e.grad is not None}
        out: list[SharedInput | None] = []
        for t in tensors:
            if not t.requires_grad:
                out.append(None)
                continue
            key = (micro_batch, id(t))
            entry = self._by_id.get(key)
            if entry is None or entry.tensor() is not t:
                entry = self._by_id[key] = SharedInput(weakref.ref(t))
            entry.users += 1
            out.append(entry)
        return out

    @staticmethod
    def seeds(given: list[torch.Tensor], shared: list[SharedInput | None]) -> list[tuple]:
        """``(input, sum so far)`` for a block's backward to start its inputs' gradients from:
        ``given``, the tensors the block's uses read (under autocast, copies of the input leaves:
        :func:`~.block_nodes.as_layer_outputs`), so that the sum is added before the first use's
        gradient, not to the uses' sum."""
        return [(x, e.grad) for x, e in zip(given, shared) if e is not None and e.grad is not None]

    @staticmethod
    def settle(inputs: list[torch.Tensor], needs, shared: list[SharedInput | None]) -> list[torch.Tensor | None]:
        """What a block's backward returns for its inputs: the running sum from the last user of
        a shared input, nothing from the others."""
        grads = []
        for x, n, e in zip(inputs, needs, shared):
            g = x.grad if n else None
            if e is not None and n:
                e.users -= 1
                e.grad, g = (g, None) if e.users > 0 else (None, g)
            grads.append(g)
        return grads

    @contextlib.contextmanager
    def outside_uses(self, loss: torch.Tensor):
        """Around the backward of ``loss``: gradients that nodes outside the streamed blocks give a
        block's input join the input's running sum while blocks that take it are still to run
        their backward (see the module's docstring)."""
        hooks = []
        if self._by_id and loss.grad_fn is not None:
            for node, uses in _outside_users(loss.grad_fn).items():
                hooks.append(node.register_hook(_capture(uses)))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def pass_ended(self) -> None:
        """A ``forward_backward`` pass ended (its backwards done, failed, or undone before any): the
        entries of its micro-batches are of no forward still to run its backward (those of a pass a
        forward's error undid came back as the next pass's, still counting its users)."""
        self._by_id = {k: e for k, e in self._by_id.items() if k[0] is None}

    @staticmethod
    def dropped(entries) -> None:
        """A block's forward that took ``entries`` (:func:`awaited`) had its graph dropped without
        its backward (a loss logged and let go, a ``forward_backward`` pass undone, a backward that
        failed before it): it no longer counts as a user, and a sum its last user would have handed
        on goes with it. Counted, the next backward's last user kept the sum for it: the input's
        gradient was never returned ("a tensor was given to several streamed blocks...", a fuzzed
        run and DeBERTa's relative embeddings after a loss computed with grad and dropped)."""
        for e in entries:
            e.users = max(0, e.users - 1)
            if e.users == 0:
                e.grad = None

    def backward_done(self) -> None:
        """A backward finished: a sum still held means a block that took the tensor had no
        backward (its output did not reach the loss), so its gradient could not be returned."""
        lost = [e for e in self._by_id.values() if e.grad is not None]
        self._by_id = {k: e for k, e in self._by_id.items() if e.tensor() is not None and e.users > 0}
        if lost:
            for e in lost:
                e.grad, e.users = None, 0
            raise TensorStateError(
                "a tensor was given to several streamed blocks and the output of at least one of them did not reach "
                "the loss, so the engine could not return that tensor's gradient in PyTorch's order; make every block "
                "that takes it contribute to the loss, or pass blocks= so that the tensor stays inside one block")


def awaited(shared: list[SharedInput | None], needs) -> list[SharedInput]:
    """The entries a block's backward will settle (:meth:`SharedInputs.settle`): those of inputs
    that need a gradient. Until it runs they travel with its saved activations' life, so a graph
    dropped without the backward uncounts them (:meth:`SharedInputs.dropped`)."""
    return [e for e, n in zip(shared, needs) if e is not None and n]


def _outside_users(root) -> dict:
    """``{node: [(edge index, entry), ...]}``: the nodes of ``root``'s graph outside the streamed
    blocks that use a tensor a streamed block takes (its :class:`SharedInput`), by edge. A block's
    node (:class:`~.block_nodes.StreamedBlock`, :class:`~.block_nodes.StashedBlock`) has the blocks'
    ``shared`` entries, its tensors' edges after the anchor's."""
    taken: dict[tuple[int, int], SharedInput] = {}
    edges: list[tuple[object, int, tuple[int, int]]] = []
    for node in graph_nodes([root]):  # (holds the nodes alive while walked: the ids below stay theirs)
        nexts = node.next_functions
        shared = getattr(node, "shared", None) if isinstance(node, torch.autograd.function.BackwardCFunction) else None
        if shared is not None:
            taken.update(((id(fn), k), e) for (fn, k), e in zip(nexts[1:], shared) if e is not None and fn is not None)
        else:
            edges.extend((node, j, (id(fn), k)) for j, (fn, k) in enumerate(nexts) if fn is not None)
    users: dict = {}
    for node, j, key in edges:
        if key in taken:
            users.setdefault(node, []).append((j, taken[key]))
    return users


def _capture(uses: list[tuple[int, SharedInput]]):
    """A node's post-hook: each gradient it gives a block's input joins the input's running sum
    (and goes no further) while a block that takes the input is still to run its backward."""
    def hook(grad_inputs, _grad_outputs):
        out = list(grad_inputs)
        for j, entry in uses:
            g = out[j]
            if g is None or entry.users == 0:  # (the entry, not the tensor, which may be gone: a skip's)
                continue
            entry.grad = g if entry.grad is None else entry.grad + g
            out[j] = None
        return tuple(out)
    return hook


def keep_non_differentiable(ctx, out_leaves: list, returned: list) -> None:
    """Outputs that did not require a gradient in the block (a mask, T5's cross-attention position
    bias of zeros) do not from the node either, as in PyTorch: kernels choose their algorithm by it
    (scaled-dot-product attention with a mask that requires grad takes another path)."""
    ctx.mark_non_differentiable(*(r for x, r in zip(out_leaves, returned)
                                  if isinstance(x, torch.Tensor) and not x.requires_grad))
