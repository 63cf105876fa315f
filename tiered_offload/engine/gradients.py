"""``Gradients``: the gradients between backward and the optimizer step, as PyTorch keeps them.

Which parameters have a gradient (``.grad is not None`` in PyTorch: a slot's ``has_grad``),
whether each unit's gradient is finite, the clipping norm and the scale it implies (applied by the
step on the way through), and forgetting gradients: all of them (``model.zero_grad()``), or the
optimizer's parameters' only (``optimizer.zero_grad()``: a trainable parameter in no group keeps
accumulating, and clipping scales its kept gradient in place, as PyTorch's does).

The bytes are the store's; the streamer fills them in backward and caches each unit's norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload_core.errors import NonFiniteError

__all__ = ["Gradients", "GradientStatus"]


@dataclass(eq=False)
class GradientStatus:
    """What the engine tracks of one unit between calls (the store tracks its bytes)."""

    grads_finite: bool = True
    """False once a backward left a NaN or infinity in its gradient (checked before any update)."""
    norms: tuple[int, list[torch.Tensor]] | None = None
    """``(gradient version, L2 norm of each trainable parameter's gradient)`` from the backward
    that last changed the gradient: clipping reuses them while the version matches."""


class Gradients:
    """One engine's gradient bookkeeping.

    Args:
        store: the engine's store (the gradient buffers).
        binding: the model's units and parameter slots.
        streamer: the block streamer (per-unit finiteness and cached norms).
        placement: where this process's share of each buffer lives (its slice when sharded).
        pipeline: the step in flight (a unit is zeroed only after its update).
        schedule: the unit order clipping reads gradients in.
    """

    def __init__(self, store, binding, streamer, placement, pipeline, schedule):
        self.store, self.binding, self.streamer = store, binding, streamer
        self.placement, self.pipeline, self.schedule = placement, pipeline, schedule
        self.scale: torch.Tensor | None = None
        """The clipping scale of the step to come (None: no clipping)."""
        self.owed: torch.Tensor | None = None
        """The last step's clipping scale, owed to the optimized parameters' gradients the step kept
        (no ``zero_grad`` yet): the update applied it on the way through, PyTorch's clipping in place.
        :meth:`settle_owed` applies it before anything reads or adds to them; forgetting drops it."""
        self.skip_step = False
        """A non-finite loss was seen with ``on_nonfinite="skip"``: the step is skipped."""
        self.opened: bool | None = None
        """Whether the last step in the backward ran there (False: not, for its norm; None: no step yet)."""

    # ---- clipping ----------------------------------------------------------------------------------
    def clip(self, max_norm: float, norm_type: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        """The global norm over the parameters that have a gradient; the scale it implies is kept
        for the step. A second call sees the gradients as PyTorch's first in-place clipping left
        them: a pending scale other than 1 is applied to every gradient buffer first (a pass over
        them; a scale of 1, from a norm measured with ``inf`` or under the limit, changes no bit).
        ``error_if_nonfinite``: a non-finite norm raises, as PyTorch's, and nothing is clipped."""
        self.settle()
        total = self.total_norm(norm_type)
        if total is None:
            return torch.tensor(0.0)  # as torch: nothing to clip
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise NonFiniteError(
                f"the total norm of order {float(norm_type)} of the gradients is non-finite ({float(total)}), so it "
                f"cannot be clipped; nothing was clipped (clip_grad_norm_(..., error_if_nonfinite=True), as "
                f"PyTorch's). To scale the gradients by it anyway pass error_if_nonfinite=False (the step then "
                f"raises NonFiniteError, or skips with on_nonfinite='skip'); engine.zero_grad() drops them")
        self.scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def total_norm(self, norm_type: float = 2.0, taken: dict | None = None) -> torch.Tensor | None:
        """The global norm over the parameters that have a gradient (None: none has), with ``taken``
        (L2: unit name -> :meth:`Placement.norm_part`) for the units whose gradients an update in the
        backward forgot."""
        return self.placement.grad_norm(self.store, self.schedule, self.binding.param_order, self.norms, norm_type,
                                        taken)

    def norm_part(self, unit) -> tuple[object, float]:
        """:meth:`Placement.norm_part` of ``unit``'s gradient (taken before an update forgets it)."""
        return self.placement.norm_part(self.store, unit, self.norms)

    def norms(self, unit, norm_type: float) -> list[torch.Tensor]:
        """Norms of each trainable parameter's gradient in ``unit``: those the backward that last
        changed it computed (L2, :meth:`BlockStreamer.gradients_done`), else read back."""
        key = unit.grad_key
        cached = self.streamer.gradients[unit.name].norms
        if norm_type == 2.0 and cached is not None and cached[0] == self.store.record(key).version:
            return cached[1]
        flat = self.store.get(key)
        try:
            return [n.clone() for n in torch._foreach_norm(unit.grad_views(flat), norm_type)]
        finally:
            self.store.release(key)

    def clip_value(self, clip_value: float) -> None:
        """Clamp every gradient buffer to ``[-clip_value, clip_value]`` in place, after a pending
        norm clip's scale (PyTorch's would have scaled them already)."""
        self.settle()
        self._each_in_place(lambda grad: grad.clamp_(-clip_value, clip_value))

    def settle(self) -> None:
        """The last step's owed scale and a clip's pending one (other than 1) applied to the gradients
        now, as PyTorch's in-place clipping has left them for what comes next: a backward adding to
        them, a second clip (a scale of 1 changes no bit: dropped)."""
        self.settle_owed()
        scale, self.scale = self.scale, None
        if scale is not None and float(scale) != 1.0:
            self._each_in_place(lambda grad: grad.mul_(scale.to(grad.device)))

    def _each_in_place(self, change) -> None:
        """``change(grad)`` on every gradient buffer, in place (their cached norms go stale with them)."""
        for unit in self.binding.units:
            key = self.placement.grad_key(unit)
            if key:
                with self.store.hold(key, dirty=True) as grad:
                    change(grad)

    def take_scale(self) -> torch.Tensor | None:
        """The step's scale (and it is used up); the gradients of parameters in no group are scaled
        now, the optimized ones' owed (:attr:`owed`), as PyTorch leaves them."""
        self.settle_owed()
        scale, self.scale = self.scale, None
        if scale is not None:
            self._scale_kept(scale)
            self.owed = scale
        return scale

    def settle_owed(self) -> None:
        """Apply :attr:`owed` to the optimized prefix of every gradient buffer, each once its update
        in flight has read it (a buffer a pending forward holds: in place). A loop that accumulates
        across steps, or steps twice, reads the gradients PyTorch's clipping left."""
        owed, self.owed = self.owed, None
        if owed is None or float(owed) == 1.0:  # (a scale of 1 changes no bit)
            return
        bound = self.streamer.bound_gradients()
        for unit in self.binding.units:
            key = self.placement.grad_key(unit)
            upto = self.placement.layout(unit).state_numel if key else 0
            if upto and unit.name in bound:
                bound[unit.name][:upto].mul_(owed.to(bound[unit.name].device))
                self.store.mark_dirty(key)
            elif upto:
                self.pipeline.after_update(unit.name, lambda key=key, upto=upto: self._scale_prefix(key, upto, owed))

    def _scale_prefix(self, key: str, upto: int, scale: torch.Tensor) -> None:
        with self.store.hold(key, dirty=True) as grad:
            grad[:upto].mul_(scale.to(grad.device))

    def _scale_kept(self, scale: torch.Tensor) -> None:
        """A trainable parameter in no group keeps its gradient past the step: the suffix of its
        unit's gradient buffer after the optimized prefix is scaled in place."""
        for unit in self.binding.units:
            layout = self.placement.layout(unit)
            if layout.grad_key and layout.grad_numel > layout.state_numel and any(
                    s.has_grad and s.requires_grad and not s.optimized for s in unit.params):
                with self.store.hold(layout.grad_key, dirty=True) as grad:
                    grad[layout.state_numel:layout.grad_numel].mul_(scale.to(grad.device))

    # ---- finiteness ------------------------------------------------------------------------------------
    def usable(self, on_nonfinite: str) -> bool:
        """Whether this step may update: False (skipped, gradients forgotten), or
        :class:`NonFiniteError`, when a loss or a gradient was not finite (on any rank: a bad slice
        anywhere stops every rank)."""
        statuses = self.streamer.gradients
        finite = self.placement.all_agree_each([g.grads_finite for g in statuses.values()],
                                               "the gradients' finiteness")
        bad = [name for name, ok in zip(statuses, finite) if not ok]
        if not self.skip_step and not bad:
            return True
        for status in statuses.values():
            status.grads_finite = True
        self.scale = None
        if on_nonfinite == "skip" or self.skip_step:
            self.skip_step = False
            self.forget(optimized_only=False)
            return False
        raise NonFiniteError(f"non-finite gradients in {', '.join(bad)}; no weight or optimizer state was updated. "
                             f"Call zero_grad() and lower the learning rate, or pass on_nonfinite='skip'")

    # ---- forgetting ------------------------------------------------------------------------------------------
    def forget(self, *, optimized_only: bool, to_none: bool = True) -> None:
        """Zero the gradients of every trainable parameter, or (``optimized_only``) of those in an
        optimizer group: a unit lays those out first, so that is a prefix of its gradient buffer
        (zeroed in place; a whole buffer is forgotten without I/O). A unit the step in flight has
        not reached yet is zeroed right after its update. ``to_none`` (``zero_grad()``'s
        ``set_to_none``): no parameter has a gradient after; else those that had keep one (zeros).
        Between a forward and its backward (``loss = model(x); optimizer.zero_grad();
        loss.backward()``) the buffers that forward holds stay held, zeroed in place."""
        self.owed = None  # (what it was owed to is forgotten, or kept as zeros)
        if not optimized_only:
            self.scale = None  # (a clip's pending scale: every gradient it was measured on is gone)
        bound = self.streamer.bound_gradients()
        if not self.streamer.graph_pending:
            self.streamer.unbind_rest()
        for unit in self.binding.units:
            key = self.placement.grad_key(unit)
            if not key:
                continue
            layout = self.placement.layout(unit)
            upto = layout.state_numel if optimized_only else layout.grad_numel
            if unit.name in bound:
                if upto > 0:
                    bound[unit.name][:upto].zero_()
                    self.store.mark_dirty(key)
                if upto >= layout.grad_numel:
                    self.streamer.gradients[unit.name].grads_finite = True
            elif upto >= layout.grad_numel:
                self.pipeline.after_update(unit.name, lambda key=key: self.store.zero(key))
                self.streamer.gradients[unit.name].grads_finite = True
            elif upto > 0:
                self.pipeline.after_update(unit.name, lambda key=key, upto=upto: self._zero_prefix(key, upto))
        for _, slot in self.binding.param_order:
            if to_none and (slot.optimized or not optimized_only):
                slot.has_grad = False

    def _zero_prefix(self, key: str, upto: int) -> None:
        with self.store.hold(key, dirty=True) as grad:
            grad[:upto].zero_()
