"""One optimizer step of ``tiered-offload train``, and where it runs.

The step runs in the backward (``forward_backward(..., step=True)``: no gradient reaches the disk,
docs/RESULTS.md) where the engine allows it (snapshot commits, ``offload.commit_every >= 2``), else
after it. With clipping (``train.clip``, the default) a step in the backward runs unclipped,
``clip_norm=train.clip``: while the gradients' total norm is within the limit, PyTorch scales them
by exactly 1.0, so that is the clipped step, bitwise. A norm found over it once some unit was updated
tears the step (:class:`ClipTornError`): :func:`tiered_offload.train.run.train` then resumes from the
last commit and runs that step after the backward, clipped (the replay is the same numbers: the
data order is the step count). :class:`ClipSpeculation` decides when to try, so that tears stay rare
and cheap: each step (``train.clip_in_backward: true``, the default: the engine itself keeps a step
whose norm it predicts over the limit after the backward, and its first, to learn the prediction;
:mod:`tiered_offload.engine.step_in_backward`), or after a step whose norm was at most that share of
the limit; not for a while after a tear, and only where a tear would run few steps again.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("tiered_offload")

__all__ = ["ClipSpeculation", "loss_average", "token_weights", "train_step"]


class ClipSpeculation:
    """When a clipped step runs in the backward (see the module's docstring). Kept across the
    resumes a tear causes in one command."""

    HOLD = 16
    """Steps from a torn one on that run after the backward; doubled at each further tear."""
    REPLAY = 4
    """A step is tried only where a tear would run at most this many steps again (those since the
    last commit, itself included): with ``offload.commit_every`` above it, the first ones after each
    commit. A tear costs those steps and the engine built again."""

    def __init__(self, clip: float | None, margin: bool | float, every: int = 1):
        self.clip, self.margin, self.every = clip, margin, every
        """The limit, the share of it the last step's norm may reach for the next to be tried (True:
        any; False: never), and the steps between two commits (snapshot commits: at each multiple of
        ``every``)."""
        self.last_norm: float | None = None
        """The gradient norm of the step before the next (None: not known)."""
        self.held_until = 0
        """The last step (counted from 1) that runs after the backward because of a tear (the torn
        step and the :attr:`HOLD` - 1 after it)."""
        self.hold = self.HOLD
        self.tried: int | None = None
        """The step last run in the backward with clipping."""

    def resumed(self, record: list | None) -> None:
        """The run goes on from a committed step whose record is ``record`` (None: none)."""
        self.last_norm = None if not record else record[3]

    def allows(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) may run in the backward, as far as clipping goes."""
        if self.clip is None:
            return True
        ok = (step > self.held_until and (step - 1) % self.every < self.REPLAY and bool(self.margin) and (
            self.margin is True or self.last_norm is not None and self.last_norm <= self.margin * self.clip))
        self.tried = step if ok else None
        return ok

    def seen(self, norm: float | None) -> None:
        self.last_norm = norm

    def torn(self) -> int:
        """The step tried in the backward was torn: hold the next ones after it. Returns that step."""
        step, self.tried = self.tried, None
        self.held_until, self.hold = step + self.hold - 1, min(2 * self.hold, 1024)
        return step


def loss_average(average: str, saved: dict | None, location: str) -> str:
    """The step's loss (``train.average``): the command's ``average`` (a change named by
    ``train/run.py`` ``_say_other_settings``), but ``micro_batches`` for a run begun before the
    setting (``saved``: its settings; None: a fresh run): its steps go on as they began, at every
    resume."""
    if saved is None or "train.average" in saved:
        return average
    if average != "micro_batches":
        log.info("tiered-offload: %s began before train.average: its steps go on with the loss the mean of the "
                 "micro-batches' means (train.average micro_batches), as they began", location)
    return "micro_batches"


def token_weights(targets: list[int], total: float, world: int, grad_accum: int) -> list[float] | None:
    """Each micro-batch's weight in the step's loss under ``train.average: tokens``: its share of the
    ``total`` tokens the loss counts in the step's micro-batches on every rank, times ``world`` (the
    ranks' gradients are averaged), so that the gradient is the whole batch's token mean. None where
    every one is ``1 / grad_accum`` (each holds as many: the mean of means, the same numbers)."""
    if not total or all(n * world * grad_accum == total for n in targets):
        return None
    return [n * world / total for n in targets]


def train_step(engine, batches: list, t, tokens: int, in_backward: bool, around, state: dict,
               weights: list[float] | None = None) -> list:
    """One optimizer step over ``batches`` (the step's micro-batches), their forwards and backwards
    in the context ``around()`` makes; returns this rank's part of the step's record, ``[mean loss,
    tokens, lr, gradient norm]``. The record is committed with the step (``engine.user_state``:
    ``state`` and the record): a kill before the run writes it leaves the resume what to write it
    from. ``in_backward``: the step runs in the backward (``forward_backward(..., step=True)``,
    clipped by ``clip_norm``: the module's docstring); the record is set as the last micro-batch's
    loss is known, before any update, and its norm before the step's commit. ``weights``: each
    micro-batch's loss scaled by its own (:func:`token_weights`; the record's loss the losses so
    weighed, added: over the ranks, their mean is the step's token mean), else by ``1 / grad_accum``
    (the record's loss their mean)."""
    lr = engine.param_groups[0]["lr"]  # (the step's: the scheduler moves it as the step opens)
    seen: dict[int, torch.Tensor] = {}  # (each micro-batch's loss; read once all are known)

    def record() -> list:
        if weights is None:
            losses = [seen[i].item() * t.grad_accum for i in range(len(batches))]
            return [sum(losses) / len(losses), tokens, lr, None]
        # (the losses so weighed, added: over the ranks, their mean is the step's token mean)
        return [sum(seen[i].item() * w for i, w in enumerate(weights)), tokens, lr, None]

    def loss_fn(out, batch):
        i = next(i for i, b in enumerate(batches) if b is batch)
        loss = out.loss / t.grad_accum if weights is None else out.loss * weights[i]
        seen[i] = (loss if weights is None else out.loss).detach()
        if in_backward and len(seen) == len(batches):  # (a pass undone before its backward: the same values again)
            engine.user_state = {**state, "record": record()}
        return loss

    if not in_backward:
        with around():
            engine.forward_backward(batches, loss_fn)
        norm = engine.clip_grad_norm_(t.clip) if t.clip else None
        own = [*record()[:3], None if norm is None else float(norm)]
        engine.user_state = {**state, "record": own}
        engine.step()
        engine.zero_grad()
        return own

    def on_norm(norm) -> None:
        engine.user_state = {**engine.user_state, "record": [*engine.user_state["record"][:3], float(norm)]}
    with around():
        engine.forward_backward(batches, loss_fn, step=True, clip_norm=t.clip or None,
                                on_norm=on_norm if t.clip else None)
    return engine.user_state["record"]
