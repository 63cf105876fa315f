"""The autograd nodes a streamed block runs as: one node per block call, whose forward fetches the
block's weights from the store and whose backward fetches them again.

* :class:`StreamedBlock` (*recompute*): the block's graph is dropped after the forward; only its
  inputs go into the store, with the RNG state, buffers and attributes its forward saw; the
  backward recomputes it from them.
* :class:`StashedBlock` (*keep* / *offload*): the block's graph is kept, what it saved moved into
  the store (:class:`~tiered_offload.engine.activations.SavedActivations`); the backward points the
  graph's leaves at the weights fetched again and runs it.

Both take the :class:`~tiered_offload.engine.streaming.BlockStreamer` as ``engine`` and leave the
work to it (fetching, the backward, the bookkeeping): what lives here is the node's own part,
what it saves on its ``ctx`` and what it returns.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload_core.errors import ConfigError, TensorStateError
from tiered_offload.engine.activations import SavedAliases, autocast_state, graph_findings
from tiered_offload.engine.binding import call_block, placeholder
from tiered_offload.engine.block_attributes import (changed_attributes, modes_of, set_tensors, snapshot_attributes,
                                                   tensor_attributes)
from tiered_offload.engine.shared_inputs import awaited, keep_non_differentiable
from tiered_offload.trace import span

__all__ = ["LET_GO", "SECOND_BACKWARD", "StashedBlock", "StreamedBlock", "placeholder_of", "rebuild", "slotted"]


def rng_state(engine, index: int) -> dict:
    """What block ``index``'s recompute replays: the RNG states (CPU, and CUDA on a GPU), those of
    the generators of the model's own it draws from (``engine.own``), and autocast's."""
    state = {"cpu": torch.get_rng_state(), "autocast": autocast_state(engine.device), "own": engine.own.before(index)}
    if engine.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(engine.device)
    return state


class StreamedBlock(torch.autograd.Function):
    """A block as one autograd node: its graph dropped after the forward, rebuilt by
    recomputation in backward. Its inputs (the checkpoint) go into the store, like saved
    activations."""

    @staticmethod
    def forward(ctx, engine, index, spec, leaves, box, anchor, *tensors):
        ctx.engine, ctx.index, ctx.spec, ctx.leaves = engine, index, spec, leaves
        ctx.binding = engine.rest_binding
        ctx.shared = box.pop("shared")
        # (made first: a forward that raises uncounts its call and its shared inputs' uses)
        ctx.stash = engine.new_stash(None, box["call"], awaited(ctx.shared, ctx.needs_input_grad[6:]))
        ctx.rng = rng_state(engine, index)
        ctx.rng["trains"] = {s_.local_name for s_ in engine.binding.blocks[index].training()}  # (this call's)
        # run as in-memory training runs it: inputs and trainable weights requiring gradients, with
        # grad mode on. Kernels choose their algorithm by that (attention with dropout does), so
        # the forward computes exactly what PyTorch's does and what the recompute will; the
        # block's graph is let go as soon as its outputs are detached.
        needs = ctx.needs_input_grad[6:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(tensors, needs)]
        with torch.enable_grad():
            given = as_layer_outputs(inputs)
        args, kwargs = rebuild(spec, leaves, given)
        unit = engine.binding.blocks[index]
        snapshot = engine.binding.snapshot_buffers(unit)
        attributes = snapshot_attributes(unit.module, engine.binding.rest_modules())
        held = tensor_attributes(unit.module)
        saved: set[tuple] = set()
        with (inputs_unchanged(unit.name, tensors, given), torch.enable_grad(),
              engine.own.forward(index, ctx.rng["own"]), engine.binding.recorded.record(box["wanted"]) as extras):
            out = engine.run_block(index, args, kwargs, as_trained=ctx.rng["trains"], saved=saved, inputs=inputs)
        extras = [*extras, *set_tensors(unit.module, held)]
        box["extras"] = ctx.rng["recorded"] = [k for k, _ in extras]  # (their gradients join the backward)
        # a block that updates buffers (BatchNorm's running statistics, a counter) or plain
        # attributes sees them in the recompute as its forward saw them, and the recompute's updates
        # are discarded
        ctx.buffers_before = engine.binding.changed_buffers(snapshot)
        ctx.rng["attributes"], ctx.rng["modes"] = changed_attributes(attributes), modes_of(attributes)
        engine.updates_rest |= updates_rest(engine, [*ctx.buffers_before, *ctx.rng["attributes"]])
        del snapshot
        box["spec"], box["leaves"], distinct, returned = node_outputs(out, [*inputs, *given])
        keep_non_differentiable(ctx, distinct, returned)
        del out, distinct
        box["outputs"] = len(returned)
        outputs = tuple(returned) + tuple(t.detach() for _, t in extras)
        ctx.aliases = watch_aliases(unit.name, tensors, given, outputs, saved)
        # a call with no input and no weight requiring a gradient has no backward to run: its inputs
        # are not kept. Sharded ranks still reduce together a block that has a gradient (frozen
        # since the build); one without (frozen at it, on every rank: the build is checked the same)
        # has no reduce to join
        ctx.inert = not any(needs) and not ctx.rng["trains"] and (engine.sharding is None or not unit.grad_key)
        ctx.handles = [] if ctx.inert else [ctx.stash.pack(t) for t in tensors]
        engine.seal(index, ctx.stash)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        backward_once(ctx)
        ctx.aliases.check()
        ctx.engine.check_whole(ctx.binding)
        ctx.engine.take_turn(("backward", ctx.index))
        needs = ctx.needs_input_grad[6:]
        if ctx.inert:  # (it kept no inputs and adds into no gradient)
            ctx.engine.discard(ctx.stash)
            return (None,) * 6 + tuple(ctx.engine.no_gradients(ctx.engine.binding.blocks[ctx.index], False, len(needs)))
        input_grads = ctx.engine.block_backward(ctx.index, ctx.spec, ctx.leaves, ctx.stash, ctx.handles, needs,
                                                grad_outputs, ctx.rng, ctx.buffers_before, ctx.shared)
        return (None,) * 6 + tuple(input_grads)


class StashedBlock(torch.autograd.Function):
    """A block as one autograd node that keeps its graph: what the graph saved for backward is
    moved into the store (:class:`SavedActivations`), and the weights it saved are resolved
    against the weight buffer fetched again for the backward. No recomputation."""

    @staticmethod
    def forward(ctx, engine, index, spec, leaves, box, anchor, *tensors):
        ctx.engine, ctx.index, ctx.shared = engine, index, box.pop("shared")
        ctx.binding = engine.rest_binding
        needs = ctx.needs_input_grad[6:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(tensors, needs)]
        with torch.enable_grad():
            given = as_layer_outputs(inputs)
        args, kwargs = rebuild(spec, leaves, given)
        unit = engine.binding.blocks[index]
        flat = engine.fetch_for_forward(unit)
        try:
            params = {s_.local_name: flat[s_.offset:s_.offset + s_.numel].view(s_.shape).detach()
                      .requires_grad_(s_.requires_grad and s_.param.requires_grad) for s_ in unit.params}
            for s_ in unit.training():
                params[s_.local_name].register_post_accumulate_grad_hook(engine.grad_arrived_hook(s_))
            stash = engine.new_stash(flat, box["call"], awaited(ctx.shared, needs))
            held, outside = tensor_attributes(unit.module), engine.binding.snapshot_buffers(None)
            attributes = snapshot_attributes(None, engine.binding.rest_modules())
            t0 = time.perf_counter()
            with (inputs_unchanged(unit.name, tensors, given), torch.enable_grad(), stash.hooks(),
                  engine.own.forward(index, {}), engine.binding.recorded.record(box["wanted"]) as extras,
                  span(engine.tracer, f"forward {unit.name}", "compute")):
                out = call_block(unit.module, params, args, kwargs)
            engine.count_forward(index, time.perf_counter() - t0)
        finally:
            engine.release_weights(unit)
        box["spec"], box["leaves"], distinct, returned = node_outputs(out, [*inputs, *given])
        del out
        engine.updates_rest |= updates_rest(engine, [*engine.binding.changed_buffers(outside),
                                                     *changed_attributes(attributes)])
        keep_non_differentiable(ctx, distinct, returned)
        extras = [*extras, *set_tensors(unit.module, held)]
        outs = [*distinct, *(t for _, t in extras)]
        on_ctx, outside = graph_findings(unit.name, outs, [*params.values(), *inputs, *given], flat, inputs,
                                         engine.binding.param_names)
        if on_ctx or outside:
            engine.discard(stash)
            raise ConfigError(on_ctx or outside)
        box["outputs"], box["extras"] = len(returned), [k for k, _ in extras]
        outputs = tuple(returned) + tuple(t.detach() for _, t in extras)
        ctx.aliases = watch_aliases(unit.name, tensors, given, outputs, stash.storages())
        engine.seal(index, stash)
        # the graph keeps its nodes, not the bytes: the leaves and outputs it holds are emptied
        # (their values are in the store, or in the tensors returned)
        ctx.outs = [x if x.requires_grad else None for x in outs]
        ctx.params, ctx.inputs, ctx.given, ctx.needs, ctx.stash = params, inputs, given, needs, stash
        copies = [g for g, x in zip(given, inputs) if g is not x]  # (autocast's: as_layer_outputs)
        for t in [*params.values(), *inputs, *copies, *(o for o in ctx.outs if o is not None)]:
            if not stash.holds(t):  # a tensor autograd saved by reference keeps its bytes
                t.data = placeholder_of(t)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        backward_once(ctx)
        ctx.aliases.check()
        ctx.engine.check_whole(ctx.binding)
        ctx.engine.take_turn(("backward", ctx.index))
        pairs = [(o, g) for o, g in zip(ctx.outs, grad_outputs) if o is not None and g is not None]
        input_grads = ctx.engine.stashed_backward(ctx.index, ctx.stash, ctx.params, ctx.inputs, ctx.given, ctx.needs,
                                                  pairs, ctx.shared)
        ctx.outs = ctx.params = ctx.inputs = ctx.given = None
        return (None,) * 6 + tuple(input_grads)


SECOND_BACKWARD = (
    "a second backward through one forward: the engine keeps a forward's graph for one backward (it has no "
    "retain_graph). Add the losses and call engine.backward(loss1 + loss2) once; for an input's gradient "
    "(torch.autograd.grad) and then the training backward, run the forward again for the second; what a "
    "backward added so far stays until engine.zero_grad()")


LET_GO = (
    "a second backward through one forward, or a backward through a forward whose weights outside the blocks "
    "(embeddings, head) the engine has let go of since (engine.backward of another forward, clip_grad_norm_, step, "
    "commit or export_safetensors between the forward and its backward): its graph would read placeholders for "
    "them. Add the losses and call engine.backward(loss1 + loss2) once, or run the forward again after them; what "
    "a backward added so far stays until engine.zero_grad()")


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # (an inference tensor keeps no version)
        return None


@contextlib.contextmanager
def inputs_unchanged(name: str, tensors, given):
    """Around a block's forward: refuse one that changes its input in place (``x.mul_(0.5)`` before
    anything reads ``x``; PyTorch trains that, the input being an earlier layer's output). The
    node gives the block its inputs as leaves of their own, and its recompute or ``forward_backward``
    would run it on the changed input again: an input that requires grad made PyTorch raise
    (blaming nothing of the block), one that needs none trained something else, silently."""
    watched = [*tensors, *given]
    before = [_version(t) for t in watched]
    message = (f"block {name}'s forward changes a tensor in place that the engine gives it as an input of its own "
               f"(its input, an earlier layer's output in PyTorch's model, or a parameter): the engine cannot rerun "
               f"such a block on the input it read. Change it out of place (x = x * 0.5, not x.mul_(0.5))")
    try:
        yield
    except RuntimeError as e:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(e):
            raise
        raise ConfigError(message) from e
    if [_version(t) for t in watched] != before:
        raise ConfigError(message)


def updates_rest(engine, changed) -> bool:
    """Whether of a block forward's ``changed`` buffers and attributes one is outside the blocks."""
    if not changed:  # (most forwards: no set built)
        return False
    rest = {id(m) for m in engine.binding.rest_modules()}
    return any(id(mod) in rest for mod, _, _ in changed)


def watch_aliases(name: str, tensors, given, outputs, saved: set[tuple]) -> SavedAliases:
    """What of a block call's inputs (``tensors``, read as ``given``) and ``outputs`` its graph
    saved (in ``saved``), watched until its backward (:class:`SavedAliases`)."""
    aliases = SavedAliases(name)
    aliases.watch("input", tensors, saved, given)
    aliases.watch("output", outputs, saved)
    return aliases


def backward_once(ctx) -> None:
    """Refuse a block node's second backward (a graph retained with ``retain_graph=True``): its
    saved activations went with the first. And a backward that builds a graph of its own
    (``create_graph=True``, a gradient penalty): autograd runs the node's backward with grad mode
    on then, and the blocks' input gradients would come back without one, silently leaving the
    penalty out of the weights' gradients."""
    if torch.is_grad_enabled():
        raise TensorStateError(
            f"a backward with create_graph=True through streamed block {ctx.index} (a gradient penalty: WGAN-GP, "
            f"R1): the engine's block nodes are not differentiable twice, so the penalty would not reach their "
            f"weights. Not supported; a penalty on what the blocks output, or outside them, trains as in PyTorch, "
            f"and so does this one where the whole state fits the budgets (PyTorch's graphs are kept)")
    if getattr(ctx, "backward_ran", False):
        raise TensorStateError(SECOND_BACKWARD)
    ctx.backward_ran = True


def placeholder_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and device that holds one element."""
    return placeholder(t.shape, t.dtype, t.device)


def as_layer_outputs(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A block's inputs (leaf tensors here) as the block sees them in PyTorch's model, where they
    are an earlier layer's outputs. Under autocast the difference shows: autocast casts a leaf that
    requires grad once and caches the cast for every later use, so the gradients of those uses are
    added in bf16; a layer's output is cast at each use, their gradients added in fp32. So under
    autocast each such leaf is given as a copy (``clone``: the same bits, its gradient passed back
    unchanged), an output of a node as in PyTorch. Call with grad mode on (a block node's forward
    runs without it), or the copy would not lead back to the leaf."""
    if not any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")) or not torch.is_autocast_cache_enabled():
        return inputs
    return [x.clone() if x.requires_grad else x for x in inputs]


class _Slot:
    """A tensor's place in a flattened block call or output: which of its distinct tensors."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def slotted(leaves: list) -> tuple[list, list[torch.Tensor]]:
    """``leaves`` (flattened) with each tensor replaced by its :class:`_Slot`, and the distinct
    tensors. One tensor in two places (``block(h, h)``, ``return y, y``) is one input or output of
    the block's node, as it is one tensor in PyTorch's graph, where its uses' gradients add into
    one sum: two inputs dropped the first place's gradient, two outputs added each one's apart.
    The node keeps the slots, not the tensors (a recomputed block's inputs go when the model
    lets go of them: what its backward needs of them is in the store)."""
    index: dict[int, int] = {}
    tensors, out = [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            k = index.setdefault(id(x), len(tensors))
            if k == len(tensors):
                tensors.append(x)
            x = _Slot(k)
        out.append(x)
    return out, tensors


def rebuild(spec, leaves, tensors):
    """The call or output a :func:`slotted` ``spec`` and ``leaves`` stand for, with ``tensors``
    (one for each distinct tensor) in the tensors' places."""
    return tree_unflatten([tensors[x.k] if isinstance(x, _Slot) else x for x in leaves], spec)


def node_outputs(out, inputs: list[torch.Tensor]) -> tuple[object, list, list[torch.Tensor], list[torch.Tensor]]:
    """A block's output ``out`` as its node returns it: the spec and slots of its flattened leaves,
    its distinct tensors, and what the node returns for each (detached; a copy of one of the block's
    ``inputs`` returned unchanged, which would confuse autograd's bookkeeping)."""
    leaves, spec = tree_flatten(out)
    slots, distinct = slotted(leaves)
    ids = {id(t) for t in inputs}
    return spec, slots, distinct, [x.detach().clone() if id(x) in ids else x.detach() for x in distinct]
