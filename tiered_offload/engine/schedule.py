"""The training step's schedule, as numbers: no torch, no model, no store.

What the engine streams is a list of units (each block of the block sequence, and the rest of the
model), each with flat buffers per kind of state. This module owns every decision that follows
from their sizes alone, so a test can drive it with numbers:

* :class:`UnitLayout`: one unit's buffer sizes and store keys (weights; gradients for its
  trainable prefix; optimizer states for the prefix the optimizer updates, in pieces);
* :class:`Phase` and :meth:`Schedule.access_sequence`: the order in which one iteration touches
  the keys, which the store's lookahead policy prefetches and evicts by;
* :meth:`Schedule.working_set`: the bytes one step needs resident at once (the budget check and
  the error that names the minimum budget);
* :meth:`Schedule.overlap_fits`, :meth:`Schedule.commit_admits`: whether the optimizer step may
  run in the background, and which updated units may wait for their commit record together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

__all__ = ["Phase", "UnitLayout", "WorkingSet", "Schedule", "FP32_BYTES", "DEFAULT_PIECE_NUMEL"]

FP32_BYTES = 4
DEFAULT_PIECE_NUMEL = 4 << 20
"""Elements per optimizer-state piece (16 MiB of fp32): the optimizer streams a unit's states
through memory one piece of each kind at a time."""


class Phase(enum.Enum):
    """What the caller does in an iteration, in the order a training loop does it."""

    FORWARD = "fwd"
    BACKWARD = "bwd"
    CLIP = "clip"
    STEP = "opt"


@dataclass(kw_only=True)
class UnitLayout:
    """One streamed unit's flat buffers.

    The unit's parameters are laid out trainable-and-optimized first (grouped by parameter
    group), then trainable parameters the optimizer does not update, then frozen ones. So the
    gradient buffer is the weights' first :attr:`grad_numel` elements and each optimizer-state
    buffer the first :attr:`state_numel`: a frozen parameter costs its weights only.
    """

    name: str
    """Unique, used in store keys (``block.3``, ``rest``)."""
    is_block: bool = False
    """Streamed one at a time (a member of the block sequence, or a large module outside it), or
    the rest of the model (bound for the whole forward and backward)."""
    in_sequence: bool = True
    """For a streamed unit: a member of the block sequence (False: an embedding or head streamed
    like a block)."""
    numel: int = 0
    """Elements of the weight buffer (every parameter of the unit)."""
    grad_numel: int = 0
    """Elements of the gradient buffer (the parameters that require a gradient)."""
    state_numel: int = 0
    """Elements each optimizer-state buffer covers (the parameters in an optimizer group)."""
    piece_numel: int = DEFAULT_PIECE_NUMEL
    """Elements per optimizer-state piece."""
    whole_pieces: tuple[tuple[int, int], ...] = ()
    """For a per-parameter optimizer: pieces that hold whole parameters (up to ``piece_numel`` of
    them, or one larger parameter); empty: pieces of ``piece_numel`` elements."""

    def key(self, kind: str) -> str:
        """Store key of this unit's buffer of ``kind`` (``weight``, ``grad``, ``state.exp_avg``...)."""
        return f"{self.name}/{kind}"

    @property
    def weight_key(self) -> str:
        return self.key("weight")

    @property
    def grad_key(self) -> str | None:
        """None when no parameter of the unit is trainable: it has no gradient buffer."""
        return self.key("grad") if self.grad_numel else None

    def pieces(self) -> list[tuple[int, int]]:
        """``(start, end)`` element ranges of the optimizer-state pieces."""
        if self.whole_pieces:
            return list(self.whole_pieces)
        step = max(1, self.piece_numel)
        return [(a, min(self.state_numel, a + step)) for a in range(0, self.state_numel, step)]

    def largest_piece(self) -> int:
        """Elements of the largest optimizer-state piece (what one piece of a kind costs in memory)."""
        if self.whole_pieces:
            return max(b - a for a, b in self.whole_pieces)
        return min(self.state_numel, self.piece_numel)

    def state_key(self, kind: str, piece: int) -> str:
        """Key of piece ``piece`` of optimizer state ``kind`` (a unit of one piece keeps the plain key)."""
        single = len(self.whole_pieces) <= 1 if self.whole_pieces else self.state_numel <= self.piece_numel
        return self.key(f"state.{kind}") if single else self.key(f"state.{kind}.{piece}")

    def piece_keys(self, kinds: Sequence[str], piece: int) -> list[str]:
        return [self.state_key(k, piece) for k in kinds]

    def state_keys(self, kinds: Sequence[str]) -> list[str]:
        """Every optimizer-state key, piece by piece."""
        return [k for i in range(len(self.pieces())) for k in self.piece_keys(kinds, i)]

    def durable_keys(self, kinds: Sequence[str]) -> list[str]:
        """What the committed training state holds of this unit: weights and optimizer states."""
        return [self.weight_key, *self.state_keys(kinds)]

    def all_keys(self, kinds: Sequence[str]) -> list[str]:
        return [self.weight_key, *([self.grad_key] if self.grad_key else []), *self.state_keys(kinds)]

    def shapes(self, kinds: Sequence[str]) -> dict[str, int]:
        """``{key: numel}`` of every buffer the unit registers."""
        return buffer_shapes(self, self.numel, kinds)


def buffer_shapes(layout, weight_numel: int, kinds: Sequence[str]) -> dict[str, int]:
    """``{key: numel}`` of a layout's buffers (a unit's, or one rank's slice of it: anything with
    ``weight_key``, ``grad_key``, ``grad_numel``, ``pieces()`` and ``piece_keys()``)."""
    out = {layout.weight_key: weight_numel}
    if layout.grad_key:
        out[layout.grad_key] = layout.grad_numel
    for i, (a, b) in enumerate(layout.pieces()):
        for key in layout.piece_keys(kinds, i):
            out[key] = b - a
    return out


@dataclass
class WorkingSet:
    """Bytes one training step needs resident in the compute tier at once, and why."""

    forward_backward: int
    """The rest's weights and gradients, plus a streamed unit's weights and gradients and its
    neighbour's weights (prefetched): two blocks' weights and one block's gradients."""
    optimizer: int
    """The largest unit's weights and gradients plus one piece of each optimizer state."""
    slack: int
    """A fixed margin against fragmentation of the tier by pinned tensors."""
    largest_block: str
    rest_bytes: int
    block_bytes: int

    @property
    def need(self) -> int:
        return max(self.forward_backward, self.optimizer) + self.slack


@dataclass
class Schedule:
    """Unit order, access sequence and budget arithmetic of one engine.

    Args:
        units: the blocks in order, then the rest unit (exactly one unit with ``is_block=False``).
        state_kinds: the optimizer's per-parameter state tensors (``exp_avg``, ``exp_avg_sq``).
        footprint: bytes a buffer of so many bytes occupies in the compute tier (alignment).
    """

    units: list[UnitLayout]
    state_kinds: tuple[str, ...]
    footprint: Callable[[int], int] = field(default=lambda n: n)
    world: int = 1
    """Ranks the state is sharded over (each stores a slice of every unit and gathers it whole)."""

    def __post_init__(self):
        rest = [u for u in self.units if not u.is_block]
        if len(rest) != 1:
            raise ValueError(f"a schedule needs exactly one rest unit, got {len(rest)}")
        self.rest = rest[0]
        self.blocks = [u for u in self.units if u.is_block]

    # ---- order ----------------------------------------------------------------------------
    def update_order(self) -> list[UnitLayout]:
        """Units in the order the forward needs them: the step updates them in this order."""
        return [self.rest, *self.blocks]

    def clip_order(self) -> list[UnitLayout]:
        """Gradients in the order backward last touched them (block 0 and the rest most recently)."""
        return [self.rest, *self.blocks]

    def _forward_keys(self, unit: UnitLayout) -> list[str]:
        # the rest's gradient buffer is bound (as .grad) for the whole forward and backward
        if unit is self.rest:
            return [unit.weight_key, *([unit.grad_key] if unit.grad_key else [])]
        return [unit.weight_key]

    def _step_keys(self, unit: UnitLayout) -> list[str]:
        if not unit.state_numel:
            return []
        return [unit.weight_key, unit.grad_key, *unit.state_keys(self.state_kinds)]

    def access_sequence(self, phases: Iterable[Phase], *, overlap: bool, activations: bool = False,
                        repeat: int = 1, idle: frozenset[str] = frozenset(),
                        stepless: frozenset[str] = frozenset(), fused: bool = False) -> list[str]:
        """The keys one iteration made of ``phases`` touches, in order, as the lookahead sees it.

        With the step overlapped, the cycle starts with the step's units (in forward order)
        interleaved with the next forward, since unit ``i`` is updated just before the forward
        needs its weights; otherwise the phases follow each other, starting with the step.
        ``activations``: each block's forward writes its saved activations (``block.i/activations``;
        micro-batch ``k`` > 0 of a pass ``block.i/activations.k``), which its backward reads.
        ``repeat``: each block is used that many times in a row (``forward_backward`` over that
        many micro-batches). ``idle``: units whose gradients and optimizer states this iteration
        leaves alone (frozen whole mid-run): their weights alone. ``stepless``: units the step
        leaves alone whose gradients the backward still adds to (sharded: reduced with the ranks').
        ``fused``: the step runs in the backward, each block's update after its last backward,
        the other units' after the backward (:mod:`~tiered_offload.engine.step_in_backward`).
        """
        phases = [Phase(p) for p in phases]
        order = self.update_order()
        times = lambda u: repeat if u.is_block else 1  # noqa: E731

        def act(u: UnitLayout, k: int) -> list[str]:  # micro-batch k's: "activations", "activations.1", ...
            if not (activations and u.is_block):
                return []
            return [u.key("activations") + (f".{k}" if k else "")]

        def forward(u: UnitLayout) -> list[str]:
            return [key for k in range(times(u)) for key in self._forward_keys(u) + act(u, k)]

        def step(u: UnitLayout) -> list[str]:
            return [] if u.name in idle or u.name in stepless else self._step_keys(u)

        def backward(b: UnitLayout) -> list[str]:  # a block's backward, each micro-batch's
            return [key for k in range(repeat) for key in [b.weight_key, b.grad_key if b.name not in idle else None,
                                                           *act(b, k)] if key]
        body = {
            Phase.FORWARD: [k for u in order for k in forward(u)],
            Phase.BACKWARD: [key for b in reversed(self.blocks) for key in backward(b)],
            Phase.CLIP: [],  # the norms come from backward: clipping reads nothing
            Phase.STEP: [k for u in order for k in step(u)],
        }
        if fused:  # each block's update after its backward, the other units' after the last block's
            blocks = {b.name for b in self.blocks}
            body[Phase.BACKWARD] = [key for b in reversed(self.blocks) for key in backward(b) + step(b)]
            body[Phase.BACKWARD] += [key for u in order if u.name not in blocks for key in step(u)]
            body[Phase.STEP] = []
        if not overlap or Phase.STEP not in phases:
            i = phases.index(Phase.STEP) if Phase.STEP in phases else 0
            return [k for p in phases[i:] + phases[:i] for k in body[p]]
        merged = [k for u in order for k in step(u) + forward(u)]
        rest = [p for p in phases if p != Phase.STEP]
        if rest and rest[0] == Phase.FORWARD:
            rest = rest[1:]  # it is part of ``merged``
        return merged + [k for p in rest for k in body[p]]

    # ---- sizes ----------------------------------------------------------------------------
    def _bytes(self, numel: int) -> int:
        return self.footprint(numel * FP32_BYTES) if numel else 0

    def unit_bytes(self, unit: UnitLayout, kind: str) -> int:
        """Compute-tier bytes of the unit's ``weight``, ``grad`` or one ``piece`` of every state kind."""
        if kind == "weight":
            return self._bytes(unit.numel)
        if kind == "grad":
            return self._bytes(unit.grad_numel)
        if kind == "piece":
            return len(self.state_kinds) * self._bytes(unit.largest_piece())
        raise ValueError(kind)

    def state_bytes(self) -> int:
        """Bytes of training state on disk: every unit's weights, gradients and optimizer states."""
        return sum((u.numel + u.grad_numel + len(self.state_kinds) * u.state_numel) * FP32_BYTES for u in self.units)

    def _part(self, numel: int) -> int:
        """Sharded: compute-tier bytes of one rank's slice of ``numel`` elements (0 on one process)."""
        return self._bytes(-(-numel // self.world)) if self.world > 1 and numel else 0

    def working_set(self) -> WorkingSet:
        """What one step needs resident at once (see :class:`WorkingSet`)."""
        b = self.unit_bytes
        blocks = self.blocks or [self.rest]
        biggest = max(blocks, key=lambda u: b(u, "weight"))
        block_w = max(b(u, "weight") for u in blocks)
        # sharded, the rest's gradient slice is pinned beside its full buffer for the whole pass
        rest = b(self.rest, "weight") + b(self.rest, "grad") + self._part(self.rest.grad_numel)
        # a streamed unit's weights and gradients, and its neighbour's weights (the next one in
        # forward or backward order, prefetched); sharded, the unit's gathered buffers beside its
        # weight and gradient slices, and the neighbour's slice (gathered ahead only with room beyond)
        near = (lambda n: self._part(n.numel)) if self.world > 1 else (lambda n: b(n, "weight"))
        streamed = max(b(u, "weight") + b(u, "grad") + self._part(u.numel) + self._part(u.grad_numel) +
                       max([near(n) for n in blocks[max(0, i - 1):i] + blocks[i + 1:i + 2]], default=0)
                       for i, u in enumerate(blocks))
        fwd_bwd = rest + streamed
        opt = max(b(u, "weight") + b(u, "grad") + b(u, "piece") for u in self.units)
        # pinned tensors can split the free space into holes: a fixed margin, the larger of a
        # block of the sequence and one state piece (not the largest unit); a group that does not
        # fit its holes is re-placed whole (TieredStore.get_group)
        one_state_piece = max(b(u, "piece") // max(1, len(self.state_kinds)) for u in self.units)
        sequence_w = max([b(u, "weight") for u in blocks if u.in_sequence], default=0)
        slack = max(sequence_w, one_state_piece)
        return WorkingSet(fwd_bwd, opt, slack, biggest.name, rest, block_w)

    def overlap_fits(self, capacity: int) -> bool:
        """Whether overlapping the step with the next forward pays: there is disk traffic to hide
        (the state does not fit ``capacity``) and the tier can hold a unit being updated while the
        forward holds the rest and a block. When everything fits, a background update would only
        compete for cores."""
        if self.fits(capacity):
            return False
        return capacity >= self.overlap_budget(0)

    def defer_fits(self, capacity: int) -> bool:
        """Whether the step can run deferred (each unit's update just before the forward needs
        it, on the forward's thread): there is disk traffic to save (the state does not fit
        ``capacity``) and the tier holds a unit's update beside what the forward pins then (the
        rest's weights and gradients)."""
        return not self.fits(capacity) and capacity >= self.defer_budget()

    def defer_budget(self) -> int:
        """The smallest compute-tier budget at which the step can be deferred to the next forward."""
        b, ws = self.unit_bytes, self.working_set()
        update = max(b(u, "weight") + b(u, "grad") + b(u, "piece") for u in self.blocks or [self.rest])
        return max(ws.need, ws.rest_bytes + update + ws.slack)

    def overlap_budget(self, activation_bytes: int) -> int:
        """The smallest compute-tier budget at which the step overlaps the next forward and a
        block's backward still has room for ``activation_bytes`` of saved activations beside the
        unit being updated (what the plan advises when the step runs inline)."""
        ws = self.working_set()
        return ws.optimizer + ws.forward_backward + ws.slack + activation_bytes

    def activation_room(self, capacity: int, overlap: bool) -> dict[int, int]:
        """Per block (by index), how many bytes of saved activations its backward can pin in a
        compute tier of ``capacity`` beside its weights and gradients, the rest's, the next block's
        weights (prefetched), the slack and (``overlap``) a unit's update running beside the forward."""
        ws = self.working_set()
        b = self.unit_bytes
        step = ws.optimizer if overlap else 0
        return {i: max(0, capacity - ws.slack - ws.rest_bytes - b(u, "weight") - b(u, "grad") - self._part(u.numel)
                       - self._part(u.grad_numel) - ws.block_bytes - step)
                for i, u in enumerate(self.blocks)}

    def gather_ahead_fits(self, capacity: int) -> bool:
        """Whether a compute tier of ``capacity`` holds the next block's gathered weights beside one
        step's working set (sharded: the forward may gather block i+1 while block i runs)."""
        if not self.blocks:
            return False
        largest = max(self.unit_bytes(u, "weight") for u in self.blocks)
        return capacity - self.working_set().need >= largest

    def floors(self, memory: int, device: int, *, update_on_host: bool, journal: bool) -> dict[str, int | None]:
        """The bytes a step cannot avoid moving, for memory tiers of ``memory`` bytes together
        (``device`` of them in a device tier; 0: none): ``disk_read``, the larger of what of the
        weights and optimizer states memory cannot hold (a step touches all of them: what was not
        in memory when it began is read) and what of the update's inputs (the weights, gradients
        and states of every unit with gradients: the gradients are all there before the step
        begins) memory cannot hold (what was not in memory when the update began is read); under
        an update on the host the device holds weights (and, at the update, gradients) only;
        ``disk_written``, what of the update's inputs memory cannot hold (each was written since
        the last update rewrote it or backward made it), or with ``journal`` every weight and state
        the step rewrites plus the gradients (a step is durable once they are on disk); ``link``
        (None without a device
        tier): to an update on the host, every weight it rewrites comes up again, what the device
        cannot keep beside a unit's gradients between a block's forward and its backward comes up
        a second time, and the gradients go down; to an update on the device, what of the weights
        and optimizer states it cannot keep (beside a unit's gradients) goes down and comes back
        up. Saved activations are not counted (recomputing them moves none)."""
        weights = sum(u.numel for u in self.units) * FP32_BYTES
        grads = sum(u.grad_numel for u in self.units) * FP32_BYTES
        states = sum(len(self.state_kinds) * u.state_numel for u in self.units) * FP32_BYTES
        # an update on the host keeps no optimizer state on the device: the device holds weights only
        held, held_at_update = memory, memory
        if device and update_on_host:
            held = memory - device + min(weights, device)
            held_at_update = memory - device + min(weights + grads, device)
        beyond = max(0, weights + states - held)
        update_reads = sum(u.numel for u in self.units if u.grad_numel) * FP32_BYTES + grads + states
        # each of them not in memory when the update begins was written since the last update
        # rewrote it (weights, states) or backward made it (gradients)
        missing = max(0, update_reads - held_at_update)
        read = max(beyond, missing)
        written = sum(self.rewrite_bytes(u) for u in self.units) + grads if journal else missing
        link = None
        if device:
            largest_grad = max(self._bytes(u.grad_numel) for u in self.units)
            if update_on_host:
                rewritten = sum(u.numel for u in self.units if u.state_numel) * FP32_BYTES
                link = rewritten + max(0, weights + largest_grad - device) + grads
            else:
                link = 2 * max(0, weights + states + largest_grad - device)
        return {"disk_read": read, "disk_written": written, "link": link}

    def floors_in_backward(self, memory: int, device: int = 0, *,
                           update_on_host: bool = False) -> dict[str, int | None]:
        """:meth:`floors` for a step run in the backward (:mod:`~tiered_offload.engine.step_in_backward`):
        each gradient is consumed by its unit's update as it is made, so a step reads what of the
        weights and optimizer states ``memory`` cannot hold (under an update on the host the device
        tier, ``device`` of it, holds weights only), and writes what of those it rewrites (a trained
        unit's weights, every state) memory cannot hold. The link moves what it moves for
        :meth:`floors`: the gradients' order changes, not their bytes."""
        weights = sum(u.numel for u in self.units) * FP32_BYTES
        rewritten = sum(u.numel for u in self.units if u.state_numel) * FP32_BYTES
        states = sum(len(self.state_kinds) * u.state_numel for u in self.units) * FP32_BYTES
        held = memory - device + min(weights, device) if device and update_on_host else memory
        link = self.floors(memory, device, update_on_host=update_on_host, journal=False)["link"]
        return {"disk_read": max(0, weights + states - held), "disk_written": max(0, rewritten + states - held),
                "link": link}

    def resident_bytes(self) -> int:
        """Compute-tier bytes of the whole training state held at once: each tensor (a unit's
        weights, gradients, each piece of each state kind) as the tier stores it (aligned). Beyond
        :meth:`state_bytes` by up to a block of alignment a tensor: much where the tensors are
        small (a LoRA adapter's gradients and states, a few KiB a block)."""
        kinds = len(self.state_kinds)
        return sum(self._bytes(u.numel) + self._bytes(u.grad_numel) + kinds * sum(self._bytes(b - a) for a, b in u.pieces())
                   for u in self.units)

    def fits(self, capacity: int) -> bool:
        """Whether the whole training state fits ``capacity`` (nothing needs to go to disk), each
        tensor as the tier stores it (:meth:`resident_bytes`)."""
        return self.resident_bytes() <= capacity

    def share_fits(self, capacity: int) -> bool:
        """Whether this process's share of the state fits ``capacity``: :meth:`fits` on one
        process; sharded, its slice of every tensor (about 1/world of the state)."""
        if self.world == 1:
            return self.fits(capacity)
        return self._share_bytes() <= capacity

    def _share_bytes(self) -> int:
        kinds = len(self.state_kinds)
        return sum(self._part(u.numel) + self._part(u.grad_numel) + kinds * self._part(u.state_numel)
                   for u in self.units)

    def graph_fits(self, capacity: int) -> bool:
        """Whether the step runs as plain PyTorch in ``capacity``: every block's graph, weights and
        gradients kept from its forward to its backward. On one process where the whole state
        fits (:meth:`fits`); sharded, where this rank's share fits beside every unit's gathered
        weights and gradients (and the slack against fragmentation)."""
        if self.world == 1:
            return self.fits(capacity)
        gathered = sum(self.unit_bytes(u, "weight") + self.unit_bytes(u, "grad") for u in self.units)
        return self._share_bytes() + gathered + self.working_set().slack <= capacity

    def commit_window(self) -> int:
        """Bytes of new weights and optimizer states that may coexist on disk with the committed
        ones (durable mode): a quarter of the state. See :meth:`commit_admits`."""
        return self.state_bytes() // 4

    def rewrite_bytes(self, unit: UnitLayout) -> int:
        """Disk bytes a unit's new weights and optimizer states take."""
        return (unit.numel + len(self.state_kinds) * unit.state_numel) * FP32_BYTES

    def commit_admits(self, in_flight: Iterable[int], size: int) -> bool:
        """Whether a unit whose rewrite takes ``size`` bytes may be updated while units of
        ``in_flight`` bytes are updated but not yet recorded: when they all fit the commit window,
        or when none is in flight (a unit larger than the window goes alone)."""
        in_flight = list(in_flight)
        return not in_flight or sum(in_flight) + size <= self.commit_window()

    def extra_disk_bytes(self, commits: str) -> int:
        """Most disk space beyond :meth:`state_bytes` a step can need, by commit mode: ``"journal"``
        the units in the commit window (or the largest unit alone when it is larger); ``"snapshot"``
        a second version of every committed tensor (weights and optimizer states) while a commit
        runs; ``"none"`` nothing."""
        sizes = [self.rewrite_bytes(u) for u in self.units]
        if commits == "snapshot":
            return sum(sizes)
        if commits == "journal":
            return max(max(sizes), min(self.commit_window(), sum(sizes)))
        return 0
