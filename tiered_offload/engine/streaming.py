"""Forward and backward through the store, block by block.

The rest of the model (embeddings, final norm, head) is bound for a whole forward and backward:
its parameters point into the rest unit's buffers and their ``.grad`` into its gradient buffer.
Each block proxy fetches its block's weights, runs it as training runs it, keeps only its inputs
(the activation checkpoint) and the RNG state, and releases the weights; in backward the block is
fetched again, recomputed with that RNG state and the buffers its forward saw, and autograd adds
its weight gradients in place into the store's gradient buffer. Frozen parameters require no
gradient, so autograd skips them; a hook marks each parameter that received one, which is what
``.grad is not None`` means to ``torch.optim`` and to clipping. The autograd node each block call
runs as (recomputed, or its graph kept) is in :mod:`~tiered_offload.engine.block_nodes`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from offload_core.errors import ConfigError, TensorStateError, TierCapacityError
from offload_core.sizes import format_size
from tiered_offload.engine.activations import SavedActivations, graph_findings, recompute_context, replay_autocast
from tiered_offload.engine.block_attributes import replay_attributes, replay_modes, set_tensors, tensor_attributes
from tiered_offload.engine.binding import ModelBinding, ParamSlot, Unit, call_block
from tiered_offload.engine.block_nodes import (LET_GO, SECOND_BACKWARD, StashedBlock, StreamedBlock, as_layer_outputs,
                                                placeholder_of, rebuild, slotted)
from tiered_offload.engine.full_buffers import FullBuffers
from tiered_offload.engine.gradients import GradientStatus
from tiered_offload.engine.pipeline import UpdatePipeline
from tiered_offload.engine.planner import choose_activation_modes
from tiered_offload.engine.own_generators import OwnGenerators
from tiered_offload.engine.parameter_guard import check_untouched, hook_leaves
from tiered_offload.engine.repeated_calls import RepeatedCalls
from tiered_offload.engine.rng_script import RngScripts
from tiered_offload.engine.shared_inputs import SharedInputs
from tiered_offload.trace import span

__all__ = ["ACTIVATION_MODES", "BlockStreamer"]

log = logging.getLogger(__name__)


ACTIVATION_MODES = ("keep", "offload", "recompute")
"""What a streamed block does with what its forward saves for backward (see :class:`BlockStreamer`)."""

_IN_BACKWARD: "weakref.WeakSet[BlockStreamer]" = weakref.WeakSet()
"""The streamers whose engine runs a backward now, in any thread (changed under
:data:`_IN_BACKWARD_LOCK`): a gradient reaching another engine's parameters then came through a
graph that runs through two engines' forwards."""
_IN_BACKWARD_LOCK = threading.Lock()


class BlockStreamer:
    """Runs the model's forward and backward with its units' bytes in the store.

    Each streamed block runs in one of the :data:`ACTIVATION_MODES`, set per block in
    :attr:`modes`:

    * ``keep``: the graph is kept, what it saves goes into the store (a scratch tensor per
      block) and stays in the compute tier unless the store needs the room;
    * ``offload``: the same, written out of the compute tier at once (to host or disk);
    * ``recompute``: only the block's inputs go into the store; backward runs the block again.

    Args:
        store: the tiered store; binding: the model split into units; pipeline: the step in flight (a unit is
        used only once its update is done); device: where compute runs; modes: a mode per block; None: keep
        every block's graph *and* its weights and gradients pinned until backward, as PyTorch does (all fits).
    """

    def __init__(self, store, binding: ModelBinding, pipeline: UpdatePipeline, device: torch.device,
                 modes: list[str] | None):
        self.store = store
        self.binding = binding
        self.pipeline = pipeline
        self.device = device
        self.modes = modes
        """Per block, its :data:`ACTIVATION_MODES` entry (None: everything kept pinned)."""
        self.activation_bytes: dict[int, int] = {}
        """Per block, the bytes its last forward put into the store (saved tensors or inputs)."""
        self.measure_graphs = True
        """Count what a recomputed block's graph would save (for the planner; a little Python per
        saved tensor, so the engine turns it off once it has planned)."""
        self.graph_bytes: dict[int, int] = {}
        """Per block, the bytes its saved tensors take when its graph is kept (measured by every
        forward: a recomputed block's too)."""
        self.held_on_ctx: dict[int, str] = {}
        """Per block whose graph a custom Function's ctx holds tensors of that keeping it would
        empty or move (:func:`kept_on_ctx`): why it must recompute."""
        self.forward_seconds: dict[int, float] = {}
        """Per block, the compute time of its forwards since the engine last cleared it (no waiting
        for bytes included)."""
        self.forward_calls: dict[int, int] = {}
        """Per block, its forwards since then (several micro-batches: several)."""
        self.step_pins: list[int] = []
        """Sizes the optimizer step pins while it overlaps the forward (set by the engine)."""
        self.activation_room: dict[int, int] = {}
        """Per block, the most bytes of saved activations the compute tier can pin in its backward
        beside its weights and gradients (set by the engine from its budget)."""
        self._orphans: list[str] = []
        self.full = FullBuffers(store, binding, pipeline, device)
        """The units' full buffers in use: the store's, or gathered from the ranks' slices."""
        self.gather_ahead = False
        """Sharded: start the all-gather of the next block's weights (the one above in forward, the
        one below in backward) while a block computes (the engine sets it, the same on every rank,
        where the budget has room for it)."""
        self.tracer = None
        """A :class:`~tiered_offload.trace.Tracer` for the compute spans, or None."""
        self.overlap_step = False
        """Whether the optimizer step runs beside the next forward (set by :meth:`for_budget`)."""
        self.defer_step = False
        """Whether, not overlapped, each unit's update runs on the next forward's thread just before
        it needs the unit (set by :meth:`for_budget`)."""
        self.rest = binding.rest
        self.gradients: dict[str, GradientStatus] = {u.name: GradientStatus() for u in binding.units}
        """Per unit, what is tracked of its gradient between calls."""
        self._rest_bound = False
        self.rest_binding = 0
        """How many times the rest has been let go of: a forward's graph is whole while the rest is
        bound and this number is the one its forward saw (:meth:`check_whole`)."""
        self.graph_pending = False
        """A forward with grad ran on the bound rest, and nothing has let go of the rest since (its
        backward, a step, zero_grad): a forward without grad then leaves the rest bound."""
        self._backward_ran = False
        self._rest_grad: torch.Tensor | None = None
        self._held: list[tuple[Unit, torch.Tensor | None, contextlib.ExitStack, dict]] = []
        self.shared = SharedInputs()
        """The block inputs whose gradients the blocks' backwards add up in PyTorch's order."""
        self.turns = None
        """In ``forward_backward``: the micro-batches' :class:`~.micro_batches.Turns`."""
        self.step_in_backward = None  # the StepInBackward of the backward running (:mod:`.step_in_backward`)
        self.micro_batches = 1
        """Micro-batches the last forward pass ran through each block together (``forward_backward``)."""
        self.rng_scripts = RngScripts()
        """``forward_backward``'s :class:`~.rng_script.RngScript` per shape of micro-batches: what
        the last loop of such micro-batches drew."""
        self.own = OwnGenerators([unit.module for unit in binding.blocks], binding.model,
                                 [g for _, g in binding.generator_slots()])
        """The generators of the model's own each block draws from (put back for a recompute)."""
        self._in_backward = False
        self.keeps_tensors = False
        """Whether a block's forward sets tensors as attributes: ``forward_backward`` then runs the
        loop (each micro-batch's loss reads what its own forward set); ``updates_rest``: whether one
        updates a buffer outside the blocks (it then would in another order)."""
        self.updates_rest = False
        self.calls = RepeatedCalls(self)
        """A block called more than once before a backward: its calls' gradients summed first."""
        # passed to every streamed block so autograd always records the block (and so calls its
        # backward for the weight gradients) even when none of its inputs requires grad
        self._anchor = torch.zeros((), requires_grad=True)
        self._anchor_node = torch.autograd.graph.get_gradient_edge(self._anchor).node
        self._grad_hooks = [slot.param.register_post_accumulate_grad_hook(self.grad_arrived_hook(slot))
                            for slot in self.rest.params if slot.requires_grad]

    @classmethod
    def for_budget(cls, store, binding: ModelBinding, pipeline: UpdatePipeline, device: torch.device, schedule,
                   placement, config, recompute) -> "BlockStreamer":
        """A streamer configured for the compute tier's budget: each block's activation mode,
        whether the step overlaps the next forward (:attr:`overlap_step`) or else is deferred to
        it (:attr:`defer_step`), the room for saved
        activations, gathering ahead (sharded) and what an overlapped step pins."""
        capacity = store.capacity(store.compute_tier)
        modes = choose_activation_modes(recompute, config.activations, [b.name for b in binding.blocks],
                                        schedule.graph_fits(capacity))
        streamer = cls(store, binding, pipeline, device, modes)
        streamer.full.sharding = placement.sharding
        overlap = config.overlap_step
        streamer.overlap_step = schedule.overlap_fits(capacity) if overlap is None else bool(overlap)
        defer = config.defer_step
        if defer is None and os.environ.get("TIERED_OFFLOAD_DEFER_STEP") == "0":  # off, to compare
            defer = False
        streamer.defer_step = not streamer.overlap_step and (schedule.defer_fits(capacity) if defer is None else bool(defer))
        streamer.activation_room = schedule.activation_room(capacity, streamer.overlap_step)
        wanted = os.environ.get("TIERED_OFFLOAD_GATHER_AHEAD", "1") != "0"  # =0: off, to compare
        streamer.gather_ahead = placement.gather_ahead(wanted and schedule.gather_ahead_fits(capacity))
        if streamer.overlap_step:  # the update of a unit runs beside the forward: room for its working set
            b, big = schedule.unit_bytes, max(schedule.units, key=lambda u: schedule.unit_bytes(u, "weight"))
            streamer.step_pins = [b(big, "weight"), b(big, "grad"), b(big, "piece")]
        return streamer

    def access_sequence(self, schedule, phases, inline: bool = False, fused: bool = False) -> list[str]:
        """The access order of one iteration made of ``phases`` as these passes run it (each block once per
        micro-batch, its activations in the store or not), with the step's units interleaved with the next
        forward where it overlaps it or is deferred to it (``inline``: a deferred step that runs whole before,
        as :meth:`UpdatePipeline.wait` for every unit does; ``fused``: in the backward, :mod:`.step_in_backward`)."""
        interleaved = not inline and not fused and (self.overlap_step or self.defer_step)
        # (sharded: the backward still reduces an idle unit's gradients with the ranks', alike on each)
        idle = frozenset(u.name for u in self.binding.units if u.idle())
        one = self.sharding is None
        return schedule.access_sequence(phases, overlap=interleaved, repeat=self.micro_batches,
                                        activations=self.modes is not None, idle=idle if one else frozenset(),
                                        stepless=frozenset() if one else idle, fused=fused)

    @property
    def in_backward(self) -> bool:
        """Whether the engine runs a backward (``engine.backward``, ``forward_backward``): gradients
        arriving outside one are refused (:meth:`grad_arrived_hook`)."""
        return self._in_backward

    @in_backward.setter
    def in_backward(self, value: bool) -> None:
        self._in_backward = value
        with _IN_BACKWARD_LOCK:
            (_IN_BACKWARD.add if value else _IN_BACKWARD.discard)(self)

    def close(self) -> None:
        """Remove the hooks put on the model's parameters."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

    @contextlib.contextmanager
    def backward_of(self, loss: torch.Tensor):
        """Around the autograd backward of ``loss``: the outside uses of the blocks' inputs in
        PyTorch's order (:meth:`SharedInputs.outside_uses`); a second backward through one forward
        is a :class:`TensorStateError` that says what to do instead."""
        self.check_whole()
        self.drop_orphans()  # (before the backward counts the blocks' calls)
        try:
            with self.shared.outside_uses(loss):
                yield
        except RuntimeError as e:
            if "backward through the graph a second time" not in str(e):
                raise
            raise TensorStateError(SECOND_BACKWARD) from e

    def backward_done(self) -> None:
        """A backward on this thread succeeded: the summed calls' gradients go in (see
        :meth:`RepeatedCalls.flush`), and the shared inputs' chains are checked."""
        self.calls.flush()
        self.shared.backward_done()

    def backward_ran(self) -> None:
        """A backward through the current forward has finished (its gradients are complete, or it
        failed: what a failed one summed is dropped)."""
        self._backward_ran = True
        self.in_backward = False
        self.calls.discard()

    def count_forward(self, index: int, seconds: float) -> None:
        """Block ``index`` ran a forward in ``seconds`` (for the plan)."""
        self.forward_seconds[index] = self.forward_seconds.get(index, 0.0) + seconds
        self.forward_calls[index] = self.forward_calls.get(index, 0) + 1

    def take_turn(self, where) -> None:
        """In ``forward_backward``: let the other micro-batches reach ``where`` first."""
        if self.turns is not None:
            self.turns.take_turn(where)

    @property
    def sharding(self):
        """A :class:`~tiered_offload.engine.sharding.Sharding` when the state is sharded over ranks
        (:meth:`for_budget` sets it): weights are all-gathered into full scratch buffers, gradients
        reduce-scattered out of them. None on one process."""
        return self.full.sharding

    @property
    def gathered_ahead(self) -> int:
        """Sharded: all-gathers started ahead of their block (counted for tests and benchmarks)."""
        return self.full.gathered_ahead

    def bind_rest(self) -> None:
        """Point the rest's parameters at its weight buffer, and the trainable ones' .grad at its
        gradient buffer: not bound where the rest is idle (frozen whole mid-run, no gradient kept;
        one process), until a forward finds it unfrozen."""
        rest = self.rest
        if self._rest_bound:
            if self._rest_grad is None and rest.grad_key and not rest.idle():  # unfrozen since it was bound
                self._rest_grad = self.full.add_grads(rest)
                self.point_rest_grads(self._rest_grad)
            return
        check_untouched(self.binding, [rest])
        self.micro_batches = 1
        self.pipeline.forward_reached(0)
        self.pipeline.wait(rest.name)
        flat, gflat, _ = self.full.acquire(rest, grad=self.sharding is not None or not rest.idle())
        for slot in rest.params:
            self.binding.hold_weights(slot, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        if gflat is not None:
            self.point_rest_grads(gflat)
        self._rest_grad = gflat
        self._rest_bound = True

    def check_whole(self, binding: int | None = None) -> None:
        """Refuse a backward through a forward whose rest the engine has let go of since (its
        parameters hold placeholders then, which the graph would read: silently other gradients
        where the rest is frozen); ``binding``: the :attr:`rest_binding` the forward saw."""
        if not self._rest_bound or (binding is not None and binding != self.rest_binding):
            raise TensorStateError(LET_GO)

    def forward_ended(self) -> None:
        """The model's forward returned: one without grad lets go of the rest, unless a forward with
        grad still waits for its backward on it (a target computed from the same model)."""
        if torch.is_grad_enabled():
            self.graph_pending = self._rest_bound
        elif not self.graph_pending:
            self.unbind_rest()

    def bound_gradients(self) -> dict[str, torch.Tensor]:
        """While a forward with grad waits for its backward (:attr:`graph_pending`): the store's
        gradient buffers it holds pinned, by unit name (the rest's; where the whole state fits, the
        blocks' kept for that backward), which ``zero_grad`` zeroes in place. Sharded: the stored
        slices pinned beside the full buffers (those are scratch, zeros until the backward)."""
        if not self.graph_pending:
            return {}
        if self.sharding is not None:
            return self.full.grad_slices()
        bound = {unit.name: g for unit, g, _, _ in self._held if g is not None}
        if self._rest_grad is not None:
            bound[self.rest.name] = self._rest_grad
        return bound

    def rest_grad_buffer(self) -> torch.Tensor:
        """Sharded, while bound: the rest's full (gathered) gradient buffer."""
        return self.full.grads(self.rest)

    def point_rest_grads(self, gfull: torch.Tensor) -> None:
        """Point the rest's trainable parameters' ``.grad`` into ``gfull`` (laid out as the rest)."""
        for slot in self.rest.params:
            if slot.requires_grad:
                slot.param.grad = gfull[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def unbind_rest(self, reduce: bool = True) -> None:
        """End of a forward/backward: release the rest (and any blocks kept for backward);
        ``reduce=False``: its gradients were reduced over ranks already."""
        self.full.drain_ahead()
        self.release_held(self._backward_ran)
        if not self._rest_bound:
            self._backward_ran = False
            return
        if self._backward_ran and self._rest_grad is not None and reduce:
            self.gradients_done(self.rest, self._rest_grad)
        self._backward_ran = False
        for slot in self.rest.params:
            self.binding.hold_placeholder(slot)
        self.full.release(self.rest, grad=self._rest_grad is not None)
        self._rest_bound = self.graph_pending = False
        self.rest_binding += 1
        self._rest_grad = None

    def adds_to_weights(self) -> bool:
        """Whether the backward running now adds into gradients: ``engine.backward`` does (and
        ``loss.backward()``, refused by :meth:`grad_arrived_hook`); ``torch.autograd.grad`` (an
        input's gradient: a saliency map, an adversarial example) and a backward whose ``inputs=``
        leave the weights out do not, as PyTorch adds into no ``.grad`` then. Told by whether
        autograd will run the anchor's accumulator (every block node's input) in this backward."""
        if self.in_backward:
            return True
        try:
            return bool(torch._C._will_engine_execute_node(self._anchor_node))
        except RuntimeError:  # (the anchor among autograd.grad's inputs: PyTorch does not say)
            return False

    def grad_arrived_hook(self, slot: ParamSlot):
        """A hook autograd runs after accumulating into ``slot``'s gradient: from now on the
        parameter "has a .grad" in PyTorch's sense (the step updates it, clipping counts it). A
        gradient outside the engine's backward (``loss.backward()``) is refused: what the engine
        does around a backward (the rest's gradients into the store, the commit's order) would not
        run, and the step would use other gradients."""
        def arrived(tensor) -> None:
            if not tensor.requires_grad:  # (frozen since its forward: autograd dropped it, and calls the hook)
                return
            if not self.in_backward:
                with _IN_BACKWARD_LOCK:
                    another = any(other is not self for other in _IN_BACKWARD)
                if another:
                    raise TensorStateError(
                        f"a gradient of {slot.name} arrived while another engine's backward ran: that loss depends "
                        f"on this engine's model through a forward taken with grad (a teacher's outputs in a "
                        f"student's loss, say), and one backward cannot run through two engines. Take those outputs "
                        f"under torch.no_grad() (or .detach() them); then engine.zero_grad() on both engines drops "
                        f"what this backward added")
                raise TensorStateError(
                    f"a gradient of {slot.name} arrived outside engine.backward(loss): call engine.backward(loss) "
                    f"(or engine.forward_backward) instead of loss.backward(), then engine.zero_grad() to drop "
                    f"what this backward added")
            slot.has_grad = True
        return arrived

    def fetch_for_forward(self, unit: Unit) -> torch.Tensor:
        """The unit's weight buffer, pinned, once the step in flight has updated it (release it
        with :meth:`release_weights`)."""
        index = self.binding.blocks.index(unit)
        self.pipeline.forward_reached(index + 1)
        self.pipeline.wait(unit.name)
        flat = self.full.acquire(unit, grad=False)[0]
        if self.gather_ahead and index + 1 < len(self.binding.blocks):
            self.full.gather_ahead(self.binding.blocks[index + 1])
        return flat

    def release_weights(self, unit: Unit) -> None:
        self.full.release(unit, grad=False)

    def run_block(self, index: int, args, kwargs, *, as_trained: set[str] | None = None, saved: set | None = None,
                  inputs=()):
        """Run block ``index`` on its weights; ``as_trained``: with those it names requiring grad,
        adding to ``saved`` where what its graph saved lies (:meth:`SavedActivations.storages`), and
        refusing a block that reads a tensor requiring grad besides them and its ``inputs``."""
        unit = self.binding.blocks[index]
        flat = self.fetch_for_forward(unit)
        try:
            params = unit.views(flat)
            if as_trained is None:
                return call_block(unit.module, params, args, kwargs)
            params = {n: p.detach().requires_grad_(n in as_trained) for n, p in params.items()}
            # what keeping this block's graph would store (the planner weighs it against recomputing)
            counter = SavedActivations(flat, [], count_only=True)
            t0 = time.perf_counter()
            with counter.hooks(), span(self.tracer, f"forward {unit.name}", "compute"):
                out = call_block(unit.module, params, args, kwargs)
            self.count_forward(index, time.perf_counter() - t0)
            if saved is not None:
                saved.update(counter.storages())
            if self.measure_graphs:  # (the graph walked once for both)
                self.graph_bytes[index] = counter.pending_bytes()
                outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
                on_ctx, outside = graph_findings(unit.name, outs, [*params.values(), *tree_flatten((args, kwargs))[0]],
                                                 flat, inputs, self.binding.param_names)
                if outside:
                    raise ConfigError(outside)
                if on_ctx:  # (the planner keeps it recomputing)
                    self.held_on_ctx[index] = on_ctx
            return out
        finally:
            self.release_weights(unit)

    def block_forward(self, index: int, args, kwargs):
        """What block ``index``'s proxy runs: plainly without grad, else as a recomputed autograd
        node (or keeping its graph, with ``recompute=False``)."""
        recorded = self.binding.recorded
        if not torch.is_grad_enabled():
            with recorded.record(recorded.wanted(), hand_out=True):
                return self.run_block(index, args, kwargs)
        self.take_turn(("forward", index))
        if self.modes is None:
            held = tensor_attributes(self.binding.blocks[index].module)
            with recorded.record(recorded.wanted(), hand_out=True):
                out = self.run_block_keeping_graph(index, args, kwargs)
            self.keeps_tensors |= bool(set_tensors(self.binding.blocks[index].module, held))
            return out
        self.drop_orphans()
        leaves, spec = tree_flatten((args, kwargs))
        leaves, tensors = slotted(leaves)
        micro_batch = self.turns.index() if self.turns is not None else None
        box: dict[str, Any] = {"shared": self.shared.take(tensors, micro_batch), "wanted": recorded.wanted()}
        node = StreamedBlock if self.modes[index] == "recompute" else StashedBlock
        box["call"] = self.calls.called(index)
        outs = node.apply(self, index, spec, leaves, box, self._anchor, *tensors)
        out = rebuild(box["spec"], box["leaves"], outs)
        recorded.hand_out(zip(box["extras"], outs[box["outputs"]:]))  # what the modules inside recorded
        self.keeps_tensors |= any(isinstance(k, tuple) for k in box["extras"])
        return out

    # ---- saved activations in the store ---------------------------------------------------
    def new_stash(self, weights: torch.Tensor | None, call: int | None = None, shared=()) -> SavedActivations:
        """A collector for what a block's forward saves (``weights``: its weight buffer; None: the
        block's inputs, for a recompute), for block call ``call``, whose backward settles ``shared``."""
        return SavedActivations(weights, self._orphans, call=call, shared=shared)

    def seal(self, index: int, stash: SavedActivations) -> None:
        """Move a block's saved tensors into a scratch tensor of the store (``offload``: out of the
        compute tier at once). A block whose saved tensors cannot fit the compute tier beside
        what is pinned keeps them in memory this time and is recomputed from the next forward."""
        unit = self.binding.blocks[index]
        need = stash.pending_bytes()
        self.activation_bytes[index] = need
        if not stash.inputs_only:
            self.graph_bytes[index] = need
        room = self.activation_room.get(index, 0)
        # the block's whole weight and gradient buffers (gathered ones when sharded), 4 bytes an element
        beside = [4 * unit.numel, *([4 * unit.grad_numel] if unit.grad_key else []), *self.step_pins]
        rest = self.rest
        bound = ([rest.key("weight.full"), *([rest.key("grad.full")] if rest.grad_key else [])]
                 if self.sharding is not None else [rest.weight_key, *([rest.grad_key] if rest.grad_key else [])])
        # forward_backward keeps every micro-batch's activations of a block until its backward
        if need * self.micro_batches > room or not self.store.fits_beside_pinned([need, *beside], bound):
            self._keep_in_memory(unit, index, need, room, stash)
            return
        key, n = unit.key("activations"), 1
        while key in self.store:  # another forward's graph (accumulating over several) holds the first
            key, n = f"{unit.key('activations')}.{n}", n + 1
        try:
            with span(self.tracer, f"save activations {unit.name}", "activations", bytes=need):
                stash.seal(self.store, key)
        except TierCapacityError:
            # the step in flight pins a unit's buffers beside the forward: let it finish, then retry
            self.pipeline.wait(None)
            try:
                stash.seal(self.store, key)
            except TierCapacityError:  # the tier is split into holes by what is pinned
                self._keep_in_memory(unit, index, need, room, stash)
        if stash.key is not None and self.modes[index] == "offload":
            self.store.evict(stash.key, self.store.compute_tier, to="below")

    def _keep_in_memory(self, unit: Unit, index: int, need: int, room: int, stash: SavedActivations) -> None:
        """A block's backward could not pin its saved tensors beside its weights and gradients:
        they stay in memory this once (as plain PyTorch keeps them; a recompute's inputs copied,
        :meth:`SavedActivations.keep_as_read`), and the block is recomputed from the next forward
        on, storing only its input."""
        stash.keep_as_read()
        if self.modes[index] != "recompute":
            log.info("block %s: its saved activations (%s) do not fit the %s budget beside its weights and gradients "
                     "(room %s, and the pinned rest of the model splits it); it is recomputed from now on", unit.name,
                     format_size(need), self.store.compute_tier.name.lower(), format_size(room))
            self.modes[index] = "recompute"

    @contextlib.contextmanager
    def backward_buffers(self, unit: Unit, stash: SavedActivations, grad: bool = True):
        """For a block's backward: its weight and gradient buffers and its saved activations,
        pinned together (one group, so a fragmented tier re-places them; where it has no hole for
        the activations beside them, those read apart), the activations resolvable through
        ``stash``. Yields ``(weights, gradients or None)`` (``grad=False``: no gradient buffer, a
        backward that adds into none); afterwards everything is released and the activations forgotten."""
        self.pipeline.wait(unit.name)
        extra, apart = ([stash.key] if stash.key else []), []
        try:
            # what is pinned can split the tier's free room into holes too small for the activations
            # beside the block's buffers: then those as a group, the activations read apart
            flat, gflat, got = self.full.acquire(unit, grad=grad, extra=extra, apart=apart)
            if apart:
                extra = []  # not pinned: nothing to release
        except BaseException:
            self.discard(stash)
            raise
        index = self.binding.blocks.index(unit)
        if self.gather_ahead and index > 0:  # backward goes down the blocks: gather the one below
            self.full.gather_ahead(self.binding.blocks[index - 1])
        try:
            stash.attach(got[0] if stash.key else None, flat)
            yield flat, gflat
        finally:
            self.full.release(unit, grad=grad, extra=extra)
            self.discard(stash)
        if grad and self.step_in_backward is not None:  # (after a backward that raised, nothing)
            self.step_in_backward.block_done(unit)

    def _adds_to_buffer(self, unit: Unit, leaves: list[ParamSlot]) -> bool:
        """Whether a block call's backward needs the unit's gradient buffer: not where no parameter of
        the call's ``leaves`` (built requiring a gradient) requires one still (frozen since: PyTorch's
        accumulator drops those). Sharded ranks reduce every block together, and a block called twice
        sums its calls first (:class:`RepeatedCalls`): those fetch it whatever the flags."""
        return bool(unit.grad_key) and (self.sharding is not None or self.calls.repeated(unit)
                                        or any(s_.param.requires_grad for s_ in leaves))

    def discard(self, stash: SavedActivations) -> None:
        """Forget a block's saved activations (its backward ran, or needs none)."""
        stash.release()
        if stash.key is not None and stash.key in self.store:
            self.store.unregister(stash.key)

    def no_gradients(self, unit: Unit, weights: bool, n: int) -> list[None]:
        """A block's backward with nothing to compute: ``n`` input gradients of None (a call
        whose backward adds into no gradient no longer counts as one of the block's calls: also
        ``weights=False`` for a call that required none, :class:`StreamedBlock`'s ``inert``)."""
        if not weights:
            self.calls.consumed(unit)
        return [None] * n

    def drop_orphans(self) -> None:
        """Unregister the scratch tensors of graphs dropped without a backward; their block calls no
        longer count."""
        while self._orphans:
            life = self._orphans.pop()
            if not life.released:
                if life.key is not None and life.key in self.store:
                    self.store.unregister(life.key)
                if life.call is not None:
                    self.calls.dropped(life.call)
            self.shared.dropped(life.shared)

    def stashed_backward(self, index: int, stash: SavedActivations, params: dict[str, torch.Tensor],
                         inputs: list[torch.Tensor], given: list[torch.Tensor], needs, pairs,
                         shared) -> list[torch.Tensor | None]:
        """Backward of a :class:`StashedBlock`: fetch its weights and gradient buffer, point the
        graph's leaves at them, and let autograd run the kept graph on the saved tensors
        (``given``: what the block read for ``inputs``, see :meth:`SharedInputs.seeds`)."""
        unit = self.binding.blocks[index]
        diff_inputs = [x for x, n in zip(inputs, needs) if n]
        weights = self.adds_to_weights()
        receiving = unit.receiving(params) if weights else []
        grad = weights and self._adds_to_buffer(unit, receiving)
        if not grad and not diff_inputs:
            self.discard(stash)
            return self.no_gradients(unit, weights, len(inputs))
        with self.backward_buffers(unit, stash, grad=grad) as (flat, gflat):
            try:
                for s_ in unit.params:
                    leaf = params[s_.local_name]
                    leaf.data = flat[s_.offset:s_.offset + s_.numel].view(s_.shape)
                    if s_ in receiving:
                        leaf.grad = gflat[s_.offset:s_.offset + s_.numel].view(s_.shape)
                seeds = SharedInputs.seeds(given, shared)
                self._backpropagate(unit, params, diff_inputs, pairs + seeds, gflat, weights)
            finally:
                for leaf in params.values():
                    leaf.grad = None
                    leaf.data = placeholder_of(leaf)
        stash.life.shared = []  # settled here, not by a dropped graph's finalizer
        return SharedInputs.settle(inputs, needs, shared)

    def param_leaves(self, unit: Unit, flat: torch.Tensor, gflat: torch.Tensor | None,
                     trains: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Each parameter as a leaf over the weight buffer, requiring a gradient if named in ``trains``
        (None: :meth:`Unit.training`). A trainable one's .grad is a view of the gradient buffer, with
        the hook marking it arrived, even where it requires none (set on the leaf later, as PEFT's
        ``disable_adapter()`` does between two forwards of a kept graph, it adds there). Autograd
        adds every weight gradient in place into the store's buffer, as PyTorch into ``param.grad``."""
        trains = {s_.local_name for s_ in unit.training()} if trains is None else trains
        params = {}
        for s_ in unit.params:
            leaf = params[s_.local_name] = flat[s_.offset:s_.offset + s_.numel].view(s_.shape).detach()
            if s_.requires_grad and gflat is not None:
                leaf.requires_grad_(True).grad = gflat[s_.offset:s_.offset + s_.numel].view(s_.shape)
                leaf.register_post_accumulate_grad_hook(self.grad_arrived_hook(s_))
            leaf.requires_grad_(s_.local_name in trains)
        return params

    def run_block_keeping_graph(self, index: int, args, kwargs):
        """Run a block with autograd as usual; its weights and gradients stay pinned until backward."""
        unit = self.binding.blocks[index]
        again = next((h for h in self._held if h[0] is unit), None)
        if again is not None:  # called again before the backward: the same leaves, so autograd sums
            return call_block(unit.module, again[3], args, kwargs)  # the calls' gradients first, as PyTorch does
        self.pipeline.forward_reached(index + 1)
        self.pipeline.wait(unit.name)
        flat, gflat, _ = self.full.acquire(unit, grad=True)
        # the block's modules hold the weights until the backward: a torch.utils.checkpoint inside
        # the block recomputes its part then, calling them
        params = hook_leaves(unit, self.param_leaves(unit, flat, gflat))
        bound = contextlib.ExitStack()
        bound.enter_context(_reparametrize_module(unit.module, params))
        self._held.append((unit, gflat, bound, params))
        if self.gather_ahead and index + 1 < len(self.binding.blocks):
            self.full.gather_ahead(self.binding.blocks[index + 1])
        return call_block(unit.module, params, args, kwargs)

    def release_held(self, backward_ran: bool) -> None:
        for _, _, bound, _ in reversed(self._held):  # the modules' own parameters back, innermost first
            bound.close()
        for unit, gflat, _, params in self._held:
            for s_ in unit.trainable():  # (a change made to the leaf its module held stays the parameter's)
                s_.param.requires_grad_(params[s_.local_name].requires_grad)
            if backward_ran and gflat is not None:
                self.gradients_done(unit, gflat)
            self.full.release(unit, grad=True)
        self._held = []

    # ---- backward -----------------------------------------------------------------------
    def block_backward(self, index, spec, leaves, stash, handles, needs, grad_outputs, rng, buffers_before, shared):
        """Backward of a :class:`StreamedBlock`: run the block again from its stored inputs, with
        the RNG state and buffers its forward saw, and back-propagate through that."""
        unit = self.binding.blocks[index]
        weights = self.adds_to_weights()
        grad = weights and self._adds_to_buffer(unit, [s_ for s_ in unit.trainable() if s_.local_name in rng["trains"]])
        if not grad and not any(needs):
            self.discard(stash)  # a frozen block whose input needs no gradient: nothing to do
            return self.no_gradients(unit, weights, len(needs))
        with self.backward_buffers(unit, stash, grad=grad) as (flat, gflat):
            inputs = [stash.unpack(h).detach().requires_grad_(n) for h, n in zip(handles, needs)]
            diff_inputs = [x for x, n in zip(inputs, needs) if n]
            params = self.param_leaves(unit, flat, gflat, rng["trains"])
            devices = [self.device] if self.device.type == "cuda" else []
            kept = [(mod, name, mod._buffers[name]) for mod, name, _ in buffers_before]
            attributes = [(mod, name, mod.__dict__[name]) for mod, name in
                          (k for k in rng.get("recorded", ()) if isinstance(k, tuple))]
            for mod, name, old in buffers_before:
                mod._buffers[name] = old.clone()
            try:
                with (torch.enable_grad(), torch.random.fork_rng(devices=devices), replay_autocast(rng["autocast"]),
                      OwnGenerators.replay(rng["own"]), replay_modes(rng["modes"]),
                      replay_attributes(rng["attributes"]), recompute_context(),
                      self.binding.recorded.record(rng.get("recorded", ())) as extras,
                      span(self.tracer, f"recompute {unit.name}", "compute")):
                    torch.set_rng_state(rng["cpu"])
                    if "cuda" in rng:
                        torch.cuda.set_rng_state(rng["cuda"], self.device)
                    given = as_layer_outputs(inputs)  # (in the forward's autocast)
                    args, kwargs = rebuild(spec, leaves, given)
                    out = call_block(unit.module, params, args, kwargs)
                extras = [t for _, t in extras] + [mod.__dict__[name] for mod, name, _ in attributes]
            finally:
                for mod, name, value in kept:
                    mod._buffers[name] = value
                for mod, name, value in attributes:  # as the forward left them: the node's outputs
                    mod.__dict__[name] = value
            outs = slotted(tree_flatten(out)[0])[1] + extras
            pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
            seeds = SharedInputs.seeds(given, shared)
            self._backpropagate(unit, params, diff_inputs, pairs + seeds, gflat, weights)
            stash.life.shared = []  # settled here, not by a dropped graph's finalizer
            return SharedInputs.settle(inputs, needs, shared)

    def _backpropagate(self, unit: Unit, params: dict[str, torch.Tensor], diff_inputs: list[torch.Tensor],
                       pairs: list, gflat: torch.Tensor | None, weights: bool) -> None:
        """Back-propagate ``(output, gradient)`` pairs through a block's graph into its trainable
        weights (their gradients accumulate into the store's buffer) and the inputs that need it
        (a pair may be an input and the gradient its other blocks gave it: see
        :mod:`~tiered_offload.engine.shared_inputs`); ``weights=False``: the inputs' alone
        (:meth:`adds_to_weights`)."""
        if not weights:  # a backward that adds into no gradient (torch.autograd.grad): the inputs' alone
            self.calls.consumed(unit)
        targets = ([params[s_.local_name] for s_ in unit.receiving(params)] if weights else []) + diff_inputs
        summed = gflat is not None and self.calls.repeated(unit)
        if summed:  # (the parameters' hooks then run on the calls' sum: RepeatedCalls)
            pairs = self.calls.before(unit, params, pairs)
        elif weights:
            hook_leaves(unit, params)
        if pairs and targets:
            # the block's modules hold its weights meanwhile: a torch.utils.checkpoint inside the
            # block recomputes its part in this backward, calling those modules
            with span(self.tracer, f"backward {unit.name}", "compute"), _reparametrize_module(unit.module, params):
                try:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=targets)
                except RuntimeError as e:
                    if "use_reentrant=True" not in str(e):
                        raise
                    raise ConfigError(f"block {unit.name} calls torch.utils.checkpoint with use_reentrant=True, "
                                      f"which cannot give a block's weights their gradients alone (PyTorch: {e}); pass "
                                      f"use_reentrant=False, or leave the checkpointing out: the engine recomputes "
                                      f"blocks itself (EngineConfig.activations)") from e
        if summed:
            self.calls.after(unit, params, gflat)
        elif gflat is not None:
            self.gradients_done(unit, gflat)

    def gradients_done(self, unit: Unit, gflat: torch.Tensor) -> None:
        """A backward finished adding into the unit's (pinned) gradient buffer.

        Marks it dirty, and computes its per-parameter L2 norms while the bytes are in memory: they
        tell whether the gradient is still finite (checked before any update), and
        :meth:`clip_grad_norm_` reuses them instead of reading every gradient back from disk, as
        long as the buffer has not changed since.
        """
        if self.sharding is not None:
            self.sharding.reduce_gradients(unit, self.full.grads(unit), self.store, self.gradients[unit.name])
            return
        key = unit.grad_key
        self.store.mark_dirty(key)
        norms = [n.clone() for n in torch._foreach_norm(unit.grad_views(gflat), 2.0)]
        status = self.gradients[unit.name]
        status.norms = (self.store.record(key).version, norms)
        if not all(bool(torch.isfinite(n)) for n in norms) and not bool(torch.isfinite(gflat).all()):
            status.grads_finite = False
