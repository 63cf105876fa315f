"""``engine.backward(loss, step=True)`` and ``engine.forward_backward(..., step=True)``: the
optimizer step run inside the backward, each unit updated right after its gradient is final.

The same numbers as ``backward(loss); step(); zero_grad()`` (and as ``forward_backward``, then
``step`` and ``zero_grad``): every elementwise or per-parameter optimizer updates each parameter
from its own gradient and state alone, so the order of the units does not change a bit, and
nothing the user could do between the backward and the step is possible here (clipping: below). What
changes is the order of the bytes. A deferred or inline step needs every gradient beside the
weights and states when it begins, so at a budget below the state the backward writes gradients
to disk and the update reads them back. Here a block's gradient lives from its backward to its
update, a moment later, while its weights are still in memory, and is then forgotten: gradients
never reach the disk, the update's state traffic falls in the backward (where the disk idled),
and a step moves what memory cannot hold of the weights and states, once each way
(``tools/bench_step_modes.py --fused-order`` bounds it; docs/RESULTS.md, fifty-sixth session).

Whatever a loop sets between its backward and ``step()`` to be committed with the step
(``engine.user_state``) it sets before the call: the step's record is taken at its end.

**When a block's gradient is final**: when its buffers are released after its backward
(:meth:`BlockStreamer.backward_buffers`), in the last backward of the step (the one called with
``step=True``; ``forward_backward``: its last micro-batch's, or the pass's last turn at the
block), unless the block was called more than once and another call's backward is still to come
(:meth:`RepeatedCalls.repeated`). Everything else (the rest: embeddings, final norm, head, whose
gradients the whole backward adds to; a block whose graph was kept pinned) is updated after the
backward, in the usual order.

**What is checked first.** The step opens at the first final block: if any gradient so far is
not finite (or a loss was, with ``on_nonfinite="skip"``), nothing is updated in the backward and
the step runs after it as :meth:`Engine.step` does (raising or skipping, nothing changed). A
gradient that turns non-finite later in the backward (a block below, or the rest), once some
block was updated, cannot be undone: the step is **torn**. The engine then raises
:class:`NonFiniteError` naming what was updated, refuses every later call, and commits nothing
(durable: the storage keeps the last commit; resume from it). Non-finite values nearly always
show first at the loss or in the last block's gradient, both checked before any update.

**Clipping** (``clip_norm=c``: ``clip_grad_norm_(c)`` before the step). PyTorch multiplies every
gradient by ``min(c / (norm + 1e-6), 1)``: by exactly 1.0 while the total norm is within the limit, so
the step run unclipped in the backward is then the clipped step, bitwise. Each unit's part of the
norm (:meth:`Placement.norm_part`: its parameters' norms, which its backward computed; ranks: the
sum of squares of their slice) is taken before its update forgets its gradient, and the total is
taken from those as :meth:`Engine.clip_grad_norm_` takes it, before the rest's update, and told
(``on_norm``) before the step's record is committed. The units so far bound the norm from below,
with the rest's parameters whose gradients are final (on one process: an untied head's and the
final norm's, final at the top of the backward; :meth:`StepInBackward._watch_rest`): where the
bound is over the limit before any update (the last block's own norm and those), nothing runs in
the backward and the step runs after it, clipped. So it does where that first bound, grown as the
last clipped step's total grew from its own (:attr:`TrainState.clip_growth`, committed with each
step), would be over 0.9 of the limit: a jump in the norm seen at the top of the backward costs the
step's gradients on disk, not a tear. A run's first clipped step (no growth known yet: none
committed) runs after the backward, to learn it (``TIERED_OFFLOAD_CLIP_PREDICT=0``: neither, the
bound alone decides). Once some unit was updated, a norm over the limit (its bound in the backward,
or the total at its end) tears the step (:class:`ClipTornError`, as a non-finite gradient below:
resume, then run the step clipped after the backward). ``tiered-offload train`` does that itself
(:mod:`tiered_offload.train.steps`), trying each step in the backward by default.

**With a device tier** the update runs where ``optimizer_device`` placed it, as ``step()``'s does.
In the host tier below it (ZeRO-Offload's arrangement), the host reads a block's gradient and
weights from the device right after its backward, and the device's copies go as they land
(:meth:`UnitUpdater.due`: both are rewritten now). The device's lookahead follows the rest of the
backward only (fetching the next forward's weights then took the room of the blocks below), and
from the step's end the next forward and backward. The host keeps its copy of each block's
weights while the device holds them too (:meth:`TieredStore.keep_twins`), so the update finds
them there instead of reading them back down the link. In the device tier, the order is the
host-only one.

**Several processes** (sharded): a block's gradient is final once the ranks reduced it, which
its backward does before its buffers are released, so each rank updates its slice there. The
ranks agree (one flag, one collective) whether the step runs in the backward at all, whether
every gradient is finite as it opens, and whether each unit's is before its update: a rank's
slice alone may hold the infinite value, and every rank must update a unit, or stop, alike.

**Refused** (``ConfigError`` at the call, nothing run): journal commits (a journal's intent names
every gradient before the update, which a step in the backward does not have: ``commit_every``
>= 2 commits by snapshots). Where the compute tier cannot hold a unit's update beside what the
backward pins (the rest's weights and gradients; :meth:`Schedule.defer_budget`; an update in the
host tier pins nothing of the backward's), the step runs after the backward, as ``step()`` (same
numbers; ranks: where any rank lacks the room), and the plan says so, naming the budget that runs
it in the backward (:meth:`StepInBackward.short_of_room`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from typing import Callable

import torch

from offload_core.errors import ClipTornError, ConfigError, NonFiniteError
from tiered_offload.engine.schedule import Phase

__all__ = ["StepInBackward", "open_step"]

log = logging.getLogger(__name__)

_MARGIN = 0.9
"""A step whose predicted norm is over this share of the limit runs after the backward: a tear
costs the steps since the last commit and the engine built again, a step after the backward its
gradients' trip through the disk (docs/RESULTS.md, sixtieth session)."""


def _predicts() -> bool:
    """``TIERED_OFFLOAD_CLIP_PREDICT=0``: no clipped step is kept out of the backward on a prediction
    of its norm (the bound alone decides: to compare, and for the tests of tears)."""
    return os.environ.get("TIERED_OFFLOAD_CLIP_PREDICT", "1") != "0"

_TOLD: "weakref.WeakSet" = weakref.WeakSet()
"""Engines told once that their budget runs the step after the backward."""


def open_step(engine) -> list[dict]:
    """What every optimizer step does before its first update, once its checks passed: read the
    groups' hyperparameters, step the attached scheduler (a refusal leaves the step untaken), and
    record the phase. Returns the hyperparameters."""
    hypers = [engine._spec.hyper(g) for g in engine.param_groups]
    if engine._optimizer_view is not None:
        engine._optimizer_view._opt_called = True  # what an LR scheduler checks to know a step happened
        _warn_of_a_scheduler_not_saved(engine)
    engine.train_state.step_scheduler(saved=engine.durable)
    engine._phase(Phase.STEP)
    engine._monitor.iteration_boundary()
    return hypers


def _warn_of_a_scheduler_not_saved(engine) -> None:
    """Once: a scheduler built over ``engine.optimizer`` (its ``step`` wrapped) that a durable run
    does not save (not attached): a resume would start its schedule again."""
    view = engine._optimizer_view
    if (engine.durable and engine.train_state.scheduler is None and not getattr(view, "_told_of_scheduler", False)
            and hasattr(view.__dict__.get("step"), "_wrapped_by_lr_sched")):
        view._told_of_scheduler = True
        log.warning("a learning-rate scheduler is built over the engine's optimizer but not attached: the storage "
                    "directory saves the learning rates, not the scheduler's position, so a resume restarts its "
                    "schedule. engine.attach_scheduler(scheduler) saves it (then the engine steps it: call "
                    "engine.step() only)")


class StepInBackward:
    """One step run in a backward (see the module's docstring)."""

    def __init__(self, engine, clip_norm: float | None = None, on_norm: Callable | None = None):
        self.engine = engine
        self.clip_norm, self.on_norm = clip_norm, on_norm
        """The clipping limit (None: no clipping), and who is told the step's total norm before its commit."""
        self.taken: dict[str, object] = {}
        """``clip_norm``: each unit updated in the backward -> what the total norm needs of its gradient,
        taken before the update forgot it (:meth:`Placement.norm_part`)."""
        self.squares = 0.0
        """The sum of the squares of those units' gradients, and of the rest's parameters' whose gradients
        are final (:meth:`_watch_rest`): the total norm is at least its root."""
        self.final_rest: list[torch.Tensor] = []
        """The rest's parameters whose gradient turned final since the bound last took them."""
        self._hooks: list = []
        self.over: float | None = None
        """The total norm, where it is over ``clip_norm`` (a lower bound where found in the backward)."""
        self.first: float | None = None
        """The bound at the first unit's check (before any update)."""
        self.norm = None
        """The step's total norm (``clip_norm``), once known."""
        self.armed = False
        """The backward running is the step's last: a block's gradient is final at its release."""
        self.fuse = True
        """False: no more updates in the backward (the step runs after it, or it is torn)."""
        self.hypers: list[dict] | None = None
        """Set when the step opened (its first update): the hyperparameters of every update."""
        self.scale = None
        self.done: set[str] = set()
        self.updated: list[str] = []
        self.bad: list[str] = []
        """Units whose gradients were not finite, found after the step opened."""
        self.lazy = False
        """The fused order is declared only as the step opens (:meth:`arm`)."""
        self.timed = False
        """Whether the call it runs in counts its time as the engine's (``backward``; not ``forward_backward``)."""

    @staticmethod
    def refusal(engine) -> str | None:
        """Why a step cannot run in this engine's backward (None: it can)."""
        if engine.commit_mode != "journal":
            return None
        return ("backward(step=True) runs the optimizer step inside the backward, which this engine's journal commits "
                "(every step durable unit by unit) do not allow (tiered_offload/engine/step_in_backward.py says why). "
                "Call backward(loss), step() and zero_grad(): the same numbers, or pass commit_every=2 or more "
                "(snapshot commits)")

    @staticmethod
    def updating(engine) -> bool:
        """Whether a step run in ``engine``'s backward has opened: an update now is one of its (the
        forwards of ``forward_backward(..., step=True)`` run the last step's deferred updates first)."""
        fused = engine._streamer.step_in_backward
        return fused is not None and fused.hypers is not None

    @staticmethod
    def check_clip(step: bool, clip_norm, on_norm) -> None:
        """Refuse, before anything runs, a ``clip_norm`` that cannot be exact (see the module's docstring)."""
        if on_norm is not None and clip_norm is None:
            raise ConfigError("on_norm is told the total norm of a step clipped in the backward: pass clip_norm too")
        if clip_norm is None:
            return
        if not step:
            raise ConfigError("clip_norm clips a step run in the backward (step=True); to clip before step(), call "
                              "clip_grad_norm_(max_norm) between backward(loss) and step()")
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not 0 < clip_norm < float("inf"):
            raise ConfigError(f"clip_norm must be a positive finite number (the largest total gradient norm, as "
                              f"clip_grad_norm_'s max_norm), got {clip_norm!r}")

    @staticmethod
    def short_of_room(engine) -> int | None:
        """The compute-tier budget a unit's update needs beside what the backward pins
        (:meth:`Schedule.defer_budget`), where this engine's is less: the step then runs after the
        backward. None where it holds one (an update in the host tier below a device tier pins
        nothing of the backward's)."""
        if engine._updater.in_lower_tier:
            return None
        need = engine.schedule.defer_budget()
        return need if engine.store.capacity(engine.store.compute_tier) < need else None

    @classmethod
    def run(cls, engine, backward: Callable[[Callable[[], None]], object], arm_now: bool, step: bool = True,
            clip_norm: float | None = None, on_norm: Callable | None = None) -> tuple[object, bool]:
        """Run ``backward(arm)`` (a backward or ``forward_backward``, which calls ``arm`` as its
        last backward starts; ``arm_now``: it is one backward) with the step in it, then the step's
        end; returns what ``backward`` returned and whether the step was taken (as :meth:`Engine.step`).
        ``step``, ``clip_norm``, ``on_norm``: the call's (:meth:`check_clip`; the module's docstring)."""
        cls.check_clip(step, clip_norm, on_norm)
        why = cls.refusal(engine)
        if why is not None:
            raise ConfigError(why)
        fused = cls(engine, clip_norm, on_norm)
        fused.timed = arm_now
        if arm_now:
            fused.arm()
        try:
            engine._streamer.step_in_backward = fused
            try:
                result = backward(fused.arm)
            finally:
                engine._streamer.step_in_backward = None
                engine.store.keep_twins(())  # (the blocks' updates ran: see arm)
                for hook in fused._hooks:
                    hook.remove()
            return result, fused.finish()
        except BaseException as e:
            if fused.hypers is not None and engine._torn is None:  # some update ran: the step is half applied
                fused._tear(e)
            raise

    def arm(self) -> None:
        """The step's last backward starts: declare the access order with each unit's update after
        its backward (where the budget holds an update beside the backward's pins), once the last
        step's updates are done (``forward_backward``'s forwards waited for each unit's, so a step
        deferred to them overlapped them: waiting before them took that away, 15% of a step)."""
        engine = self.engine
        engine._await()
        # (an update in the host tier below a device tier: the backward pins nothing there, and the
        # engine's construction checked that the host holds a unit's update)
        short = self.short_of_room(engine)
        if not engine._placement.all_agree(short is None, "room for the step in the backward"):  # (ranks: all or none)
            if engine not in _TOLD:  # (once: the plan says it too)
                _TOLD.add(engine)
                tier = engine.store.compute_tier.name.lower()
                log.warning("backward(step=True): %s; the step runs after the backward (the same numbers, its "
                            "gradients through the disk where memory is short)",
                            f"the {tier} budget cannot hold a unit's update beside the backward's pins: {tier}_memory "
                            f">= {short} bytes runs it in the backward" if short else
                            "another rank's budget cannot hold a unit's update beside the backward's pins")
            self.fuse = False
            return
        self.armed = True
        if self.clip_norm is not None and engine._placement.sharding is None:
            self._watch_rest()
        # the last clipped step did not open for its norm: this one likely will not either, and the fused
        # order would load its updates' states into the backward for nothing (declared if it opens)
        self.lazy = self.clip_norm is not None and engine._gradients.opened is False
        if not self.lazy:
            self._declare_fused()

    def _declare_fused(self) -> None:
        """Tell the lookahead the backward's order with each unit's update after its backward, then
        the next forward."""
        engine, updater = self.engine, self.engine._updater
        order = functools.partial(engine._streamer.access_sequence, engine.schedule)
        engine.store.declare_access_sequence(order([Phase.BACKWARD, Phase.FORWARD], fused=True))
        if updater.in_lower_tier:  # the device tier's own order: the rest of the backward, then the next
            updater.device_sequence(order([Phase.BACKWARD, Phase.FORWARD]), [])  # forward (new weights: _offer_up)
            # and the host keeps its copy of a block's weights beside the device's until the update reads it
            engine.store.keep_twins(b.weight_key for b in engine.schedule.blocks if b.state_numel)

    def block_done(self, unit) -> None:
        """A block's buffers were released after a backward of it (the streamer calls this): update
        it if its gradient is final."""
        streamer = self.engine._streamer
        if not (self.armed and self.fuse) or unit.name in self.done or streamer.calls.repeated(unit):
            return
        if streamer.turns is not None and not streamer.turns.is_last():
            return
        if self.hypers is None and not self._open(unit):
            return
        self._update(unit)

    def _open(self, unit) -> bool:
        """The step's first update (of ``unit``) is due: check every gradient so far, then open the
        step as :meth:`Engine.step` does. False: a gradient or loss was not finite, or ``unit``'s norm
        is over ``clip_norm``; nothing runs in the backward (the step after it raises or skips,
        nothing updated; or clips)."""
        engine = self.engine
        usable = not engine._gradients.skip_step and all(s.grads_finite for s in engine._streamer.gradients.values())
        if not engine._placement.all_agree(usable, "the gradients' finiteness as the step in the backward opens") \
                or not self._within_limit(unit):
            self.fuse = False
            if self.clip_norm is not None and self.first is not None:
                engine._gradients.opened = False
            if not self.lazy:  # the usual order again: the fused one would load the updates' states for nothing
                engine._declare([Phase.FORWARD, Phase.BACKWARD, Phase.STEP])
            return False
        if self.lazy:
            self._declare_fused()
        engine._gradients.opened = True
        engine._commits.wait()  # the last commit has written what it snapshots before this step changes it
        engine.train_state.check_scheduler()
        self.hypers = open_step(engine)
        self.scale = engine._gradients.take_scale()
        return True

    def _update(self, unit) -> None:
        """Update ``unit`` (its optimized parameters with a gradient), then forget its gradient:
        nothing reads it again this step, so it is never written."""
        engine = self.engine
        self.done.add(unit.name)
        # (ranks: a rank's slice of it may be the one not finite; every rank updates it, or none does)
        if not engine._placement.all_agree(engine._streamer.gradients[unit.name].grads_finite,
                                           f"{unit.name}'s gradient finiteness before its update"):
            self.bad.append(unit.name)
            self.fuse = False
            return
        if not self._within_limit(unit):
            return
        spec, hypers = engine._spec, self.hypers
        scalars = (lambda group, count, s: spec.next_scalars(hypers[group], count, s)) if spec.scalars else None
        updates = engine.train_state.advance_slots(unit.params, scalars)
        if updates.before:
            if engine._updater.in_lower_tier:  # the device's copies go as the host reads them: both change now
                engine._updater.due(unit)
            engine._update_unit(unit, hypers, self.scale, updates)
            self.updated.append(unit.name)
            if engine._updater.in_lower_tier:
                self._offer_up(unit)
            if engine._streamer.step_in_backward is self:
                engine._monitor.updates_in_backward += 1
        key = engine._placement.grad_key(unit)  # (ranks: None where this rank's slice holds no gradient)
        if key and unit.is_block:
            engine.store.zero(key)

    def _offer_up(self, unit) -> None:
        """After ``unit``'s update in the host tier: its new weights go up to the device where it has
        room that nothing needed sooner holds, and the host's copy is the device's twin (the first to
        go) again. Otherwise the host held each updated block's weights, the only current copy, until
        the next forward, and gave up the optimizer states for them: a device tier twice as large
        saved no disk byte (docs/RESULTS.md, sixty-second session)."""
        store = self.engine.store
        if unit.weight_key in store:
            store.release_twin(unit.weight_key)
            store.offer(unit.weight_key, store.compute_tier)

    def _within_limit(self, unit) -> bool:
        """``clip_norm``: take what the total norm needs of ``unit``'s gradient before its update
        forgets it; False (no more updates in the backward) where the units so far already put the
        norm over the limit (ranks: where any rank's do). Once the total is known, True."""
        if self.clip_norm is None or self.norm is not None or unit.name in self.taken:
            return True
        engine = self.engine
        self.taken[unit.name], squares = engine._gradients.norm_part(unit)
        self.squares += squares + self._final_rest_squares()
        low = self.squares ** 0.5  # (a bound with room for rounding: over it, clipping surely scales)
        over = low > self.clip_norm * (1 + 1e-4) + 1e-5
        likely = False
        if self.first is None:  # the first unit, before any update: the total predicted from the last step's
            self.first, growth = low, engine.train_state.clip_growth  # (which grew from its bound so)
            likely = _predicts() and (growth is None or low * growth > _MARGIN * self.clip_norm)  # (no update: no tear)
        if engine._placement.all_agree(not (over or likely), "the gradient norm's bound"):
            return True
        self.over, self.fuse = low if over else None, False
        return False

    def _watch_rest(self) -> None:
        """On one process: a rest parameter's gradient is final once every backward of the step's
        last pass added its part (its AccumulateGrad runs once in a backward, as soon as its inputs
        are summed: one backward, or ``forward_backward``'s micro-batches, each at its turn, into the
        one buffer), so its norm joins the bound. An untied head's is known before the last block's
        update: a norm the head puts over the limit then tears nothing. (Not on ranks: each reduces
        its part of the rest's gradients at the end of its backward.)"""
        for hook in self._hooks:  # (armed again: only this backward's count)
            hook.remove()
        streamer, self.final_rest = self.engine._streamer, []
        backwards = streamer.micro_batches if streamer.turns is not None else 1  # (a pass: all its micro-batches')
        arrived: dict[int, int] = {}

        def final(param) -> None:
            arrived[id(param)] = arrived.get(id(param), 0) + 1
            if param.requires_grad and arrived[id(param)] == backwards:
                self.final_rest.append(param)
        self._hooks = [slot.param.register_post_accumulate_grad_hook(final)
                       for slot in streamer.rest.training()]  # (not those frozen since)

    def _final_rest_squares(self) -> float:
        """The sum of the squares of the gradients of the rest's parameters that turned final since
        the last call (each parameter's norm, as ``clip_grad_norm_`` takes it)."""
        grads, self.final_rest = [p.grad for p in self.final_rest if p.grad is not None], []
        return float(torch.stack(torch._foreach_norm(grads)).double().square().sum()) if grads else 0.0

    def _clip_at_the_end(self) -> None:
        """``clip_norm``, before the units not updated in the backward: the step's total norm, as
        ``clip_grad_norm_`` takes it; where clipping would scale, the step cannot be exact (:attr:`over`)."""
        if self.clip_norm is None or self.over is not None or self.bad:
            return
        engine = self.engine
        total = engine._gradients.total_norm(taken=self.taken)
        self.norm = torch.tensor(0.0) if total is None else total
        if not bool(torch.isfinite(self.norm)) and not engine._placement.all_agree(
                all(s.grads_finite for s in engine._streamer.gradients.values()), "the gradients' finiteness"):
            return  # (a gradient is not finite: its update below finds it, NonFiniteError)
        if not bool(torch.isfinite(self.norm)) or float(torch.clamp(self.clip_norm / (self.norm + 1e-6), max=1.0)) != 1:
            self.over = float(self.norm)  # (a norm that overflowed from finite gradients: clipping zeroes them)

    def _learn_growth(self) -> None:
        """The step's total norm over its bound at the first unit: how much the norm grows after that
        check (:attr:`TrainState.clip_growth`; kept where both are finite and the bound is not zero)."""
        total = float(self.norm)
        if self.first and math.isfinite(total) and math.isfinite(self.first):
            self.engine.train_state.clip_growth = max(total / self.first, 1.0)

    def finish(self) -> bool:
        """After the backward: the units not updated in it, the step counted and committed, the
        gradients forgotten (``zero_grad()``). Returns whether the step was taken."""
        engine = self.engine
        if self.hypers is None:  # nothing ran in the backward: the step as step() runs it
            if self.clip_norm is not None:
                clip = type(engine).clip_grad_norm_
                self.norm = (clip.__wrapped__ if self.timed else clip)(engine, self.clip_norm)  # (timed once)
                self._learn_growth()
                if self.on_norm is not None:
                    self.on_norm(self.norm)
            taken = type(engine).step.__wrapped__(engine) if self.timed else engine.step()  # (timed once)
            engine.zero_grad()
            return taken
        self._clip_at_the_end()
        if self.over is not None:
            error = ClipTornError(
                f"the gradients' total norm is {self.over:.6g}{' or more' if self.norm is None else ''}, over "
                f"clip_norm={self.clip_norm:g}, found in backward(step=True) after {len(self.updated)} unit(s) were "
                f"updated unclipped ({', '.join(self.updated[:4])}{', ...' if len(self.updated) > 4 else ''}): this "
                f"step is half applied and cannot be undone.",
                ("Build the engine again with resume=True (the storage keeps the last commit) and run this step "
                 "clipped after the backward: backward(loss), clip_grad_norm_(max_norm), step(), zero_grad()"
                 if engine.durable else "Start again from the last export")
                + " (tiered-offload train does this itself)", self.over, self.clip_norm, self.norm is None)
            self._tear(error)
            raise error
        if not self.bad:
            for layout in engine.schedule.update_order():
                if layout.name not in self.done and not self.bad:
                    self._update(engine._units_by_name[layout.name])
        if self.bad:
            error = NonFiniteError(
                f"non-finite gradients in {', '.join(self.bad)}, found in backward(step=True) after "
                f"{len(self.updated)} unit(s) were updated ({', '.join(self.updated[:4])}"
                f"{', ...' if len(self.updated) > 4 else ''}): this step is half applied and cannot be undone. "
                + ("Build the engine again with resume=True: the storage keeps the last commit"
                   if engine.durable else "Start again from the last export")
                + "; to keep a step whole when a gradient is not finite, call backward(loss), step(), zero_grad()")
            self._tear(error)
            raise error
        engine.train_state.step_count += 1
        if engine._updater.in_lower_tier:  # the device tier's order from here: the next forward and backward
            engine._updater.device_sequence(
                engine._streamer.access_sequence(engine.schedule, [Phase.FORWARD, Phase.BACKWARD]), [])
        if self.norm is not None:
            self._learn_growth()
            if self.on_norm is not None:
                self.on_norm(self.norm)
        then = engine._commits.begin_step(self.hypers, self.scale, None)  # (snapshots: the step's record now)
        if then is not None:
            then()
        engine._phases = []
        engine.zero_grad()
        return True

    def _tear(self, error: BaseException) -> None:
        """The step is half applied: no commit may record it, and the engine refuses every later call."""
        self.engine._commits.fail(error)
        self.engine._torn = (f"a step run in the backward was half applied ({type(error).__name__}: {error}); this "
                             f"engine's state mixes two steps. Close it"
                             + (", and build it again with resume=True" if self.engine.durable else ""))
