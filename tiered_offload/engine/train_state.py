"""``TrainState``: what the training state is besides its tensors.

The step count, the optimizer's parameter groups (hyperparameters), the user's JSON state, the
learning-rate scheduler, each parameter's own step count, the RNG and the module buffers, as one
object with ``state_dict()`` / ``load_state_dict()`` (the dict a commit saves with every step as
the manifest's ``meta``, and a resume restores). torchtitan's ``TrainState`` is the model.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from dataclasses import dataclass, field

import torch

from offload_core.errors import CheckpointError, ConfigError, CorruptionError
from tiered_offload.checkpoint.buffer_file import load as load_buffers
from tiered_offload.checkpoint.durable import decode_rng, encode_rng, encode_tensor
from tiered_offload.checkpoint.schema import _REDO

__all__ = ["TrainState", "StepUpdates", "jsonable", "saved_hyper", "hyper_from_json"]


@dataclass
class StepUpdates:
    """Which parameters one optimizer step updates."""

    before: dict[int, int] = field(default_factory=dict)
    """``{id(slot): step count before the step}`` of every parameter the step updates."""
    no_grad: list[str] = field(default_factory=list)
    """Names of the optimized parameters without a gradient this step (left as they are)."""
    scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    """``{id(slot): optimizer scalar state before the step}`` (NAdam's ``mu_product``...), where the
    optimizer keeps any."""


class TrainState:
    """The non-tensor training state of one engine.

    Args:
        param_groups: the optimizer's parameter groups (hyperparameters only), in its order.
        param_order: ``(unit, slot)`` of every parameter; a slot's ``updates`` is its step count.
        buffers: the model's buffers as :meth:`ModelBinding.buffer_slots` lists them (set later:
            they are known once the blocks are bound).
        device: the compute device (its RNG is saved with the CPU's).
    """

    def __init__(self, param_groups: list[dict], param_order: list, device: torch.device):
        self.step_count = 0
        """Optimizer steps taken."""
        self.param_groups = param_groups
        """The optimizer's parameter groups (hyperparameters only): change ``lr`` here, or through a scheduler."""
        self.user_state: dict = {}
        """JSON-serialisable values saved with every step (a data loader's position...)."""
        self.scheduler = None
        """The learning-rate scheduler the engine steps after each optimizer step (attach_scheduler)."""
        self._scheduler_epoch = None
        """The attached scheduler's ``last_epoch`` where the engine left it (:meth:`check_scheduler`)."""
        self.param_order = param_order
        self.buffers: list = []
        self.generators: list[tuple[str, torch.Generator]] = []
        """The model's own generators by name (:meth:`ModelBinding.generator_slots`): saved with
        the RNG, so a resumed run draws from them where the uninterrupted one would."""
        self.buffer_file = None
        """Where a durable state's buffers are written (:class:`BufferFile`); None: JSON in the meta."""
        self.device = device
        self.update_tier: str | None = None
        """Where the optimizer step runs below a device tier (``"host"`` / ``"device"``), saved with
        every step: a resumed ``optimizer_device="auto"`` keeps it (see
        :func:`~tiered_offload.engine.preflight.optimizer_tier`)."""
        self.clip_growth: float | None = None
        """The last step clipped in the backward (``clip_norm``): its total norm over the norm's bound
        at its first unit (:meth:`StepInBackward._within_limit` predicts the next step's total with
        it), saved with every step: a resumed engine's first clipped step need not run after the
        backward to learn it."""
        self._resumed_scheduler_state = None
        self._resumed_param_groups = None
        self._resumed_tensors: list[dict] = []

    def bind(self, binding) -> None:
        """The model's buffers and generators, once the binding's proxies are in place."""
        binding.buffers = self.buffers = binding.buffer_slots()
        self.generators = binding.generator_slots()

    # ---- a step ------------------------------------------------------------------------------
    def advance(self, next_scalars=None) -> StepUpdates:
        """Count one optimizer step: every optimized parameter with a gradient gets one more update.
        ``next_scalars(group, count, scalars)``: its optimizer scalar state after the step (the slot
        holds that from now on, as the step count; the update starts from the one recorded here)."""
        updates = self.advance_slots([slot for _, slot in self.param_order], next_scalars)
        self.step_count += 1
        return updates

    def advance_slots(self, slots, next_scalars=None) -> StepUpdates:
        """:meth:`advance` for ``slots`` alone (one unit's, updated in the backward), the step
        count left as it is."""
        updates = StepUpdates()
        for slot in slots:
            if not slot.optimized:
                continue
            if slot.has_grad:
                updates.before[id(slot)] = slot.updates
                if next_scalars is not None:
                    updates.scalars[id(slot)] = slot.scalars
                    slot.scalars = next_scalars(slot.group, slot.updates, slot.scalars)
                slot.updates += 1
            else:
                updates.no_grad.append(slot.name)
        return updates

    def step_scheduler(self, saved: bool) -> None:
        """Step the attached scheduler: after the step's hyperparameters are read, before anything of
        the step is counted or used up. One whose ``step()`` raises is put back as it was (its state,
        the groups' values), and the step is refused untaken: the loop may step again once it can.
        ``saved``: the step's record saves the state (durable), so what JSON cannot hold is refused
        here too (the user state, the groups' values, the scheduler's state after it stepped)."""
        if saved:
            self._check_saveable(scheduler=False)
        if self.scheduler is None:
            return
        before = copy.deepcopy(self.scheduler.state_dict())
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        try:
            self.scheduler.step()
            if saved:
                self._check_saveable(scheduler=True)
        except Exception as e:
            self.scheduler.load_state_dict(before)
            for group, was in zip(self.param_groups, groups):
                group.update(was)
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"the attached {type(self.scheduler).__name__}'s step() raised {type(e).__name__}: {e}. "
                              f"The engine steps it after each optimizer step; this step was not taken (the weights, "
                              f"the optimizer's state and the step count are as before it), and engine.step() may "
                              f"be called again once the scheduler can step") from e
        self._scheduler_epoch = getattr(self.scheduler, "last_epoch", None)

    def _check_saveable(self, scheduler: bool) -> None:
        """Refuse, untaken, a step whose record could not be saved (see :meth:`step_scheduler`)."""
        try:
            try:
                json.dumps(self.user_state, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"engine.user_state must be JSON-serialisable (it is saved with every step): {e}"
                                  ) from e
            for g in self.param_groups:
                jsonable({k: v for k, v in g.items() if k != "params"}, "the optimizer's param_groups")
            if scheduler:
                jsonable(self.scheduler.state_dict(), f"the attached {type(self.scheduler).__name__}'s state_dict()")
        except ConfigError as e:
            raise ConfigError(f"{e}. This step was not taken (the weights, the optimizer's state and the step count "
                              f"are as before it): call engine.step() again once it can be saved") from e.__cause__

    def check_scheduler(self) -> None:
        """Refuse a step whose attached scheduler the caller stepped too (PyTorch's ``sched.step()``
        after ``optimizer.step()``): its schedule would run ahead without a word."""
        epoch = getattr(self.scheduler, "last_epoch", None)
        if self.scheduler is not None and epoch is not None and epoch != self._scheduler_epoch:
            raise ConfigError(f"the attached {type(self.scheduler).__name__} was stepped outside the engine (at "
                              f"{epoch}, the engine left it at {self._scheduler_epoch}): the engine steps an attached "
                              f"scheduler after each step, so its schedule would run ahead. Remove the "
                              f"scheduler.step() call and call engine.step() only")

    def replayed_updates(self, meta: dict, no_grad) -> StepUpdates:
        """For a step a resume finishes (its state after is ``meta``; the slots hold the state before
        it): the step counts and scalar state before it of the parameters it updated."""
        after = meta.get("param_updates", {})
        steps = meta["step_count"]
        skipped = set(no_grad)
        updated = [s for _, s in self.param_order if s.optimized and s.name not in skipped]
        return StepUpdates(before={id(s): after.get(s.name, steps) - 1 for s in updated},
                           scalars={id(s): s.scalars for s in updated})

    def hypers_to_json(self, hypers: list[dict]) -> list:
        """A step's hyperparameters (one dict per group) as the journal records them."""
        return [jsonable(h, "the optimizer's hyperparameters") for h in hypers]

    def hypers_from_json(self, saved: list[dict]) -> list[dict]:
        """A recorded step's hyperparameters back, with tuples where the groups have tuples."""
        return [hyper_from_json(h, g) for h, g in zip(saved, self.param_groups)]

    # ---- saving and restoring ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What, besides the tensors, the state after the last step is (JSON: the manifest's ``meta``)."""
        rng = {"cpu": encode_rng(torch.get_rng_state())}
        if self.device.type == "cuda":
            rng["cuda"] = encode_rng(torch.cuda.get_rng_state(self.device))
        if self.generators:
            rng["own"] = {name: encode_rng(g.get_state()) for name, g in self.generators}
        try:
            user = json.loads(json.dumps(self.user_state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"engine.user_state must be JSON-serialisable (it is saved with every step): {e}") from e
        scheduler = None
        if self.scheduler is not None:
            scheduler = jsonable(self.scheduler.state_dict(), "the scheduler's state_dict()")
        # per-parameter step counts, where a parameter missed steps (it had no gradient)
        updates = {s.name: s.updates for _, s in self.param_order if s.optimized and s.updates != self.step_count}
        persistent = [(name, mod._buffers[attr]) for name, mod, attr, keep in self.buffers if keep]
        if self.buffer_file is not None:
            buffers = {"buffer_file": self.buffer_file.entry(persistent, self.step_count)} if persistent else {}
        else:
            buffers = {"buffers": {name: encode_tensor(t) for name, t in persistent}}
        scalars = {s.name: s.scalars for _, s in self.param_order if s.scalars}
        return {"step_count": self.step_count, "rng": rng, "user_state": user, "scheduler": scheduler,
                "param_updates": updates, **buffers, **({"param_scalars": scalars} if scalars else {}),
                **({"update_tier": self.update_tier} if self.update_tier else {}),
                **({"clip_growth": self.clip_growth} if self.clip_growth is not None else {}),
                "param_groups": [jsonable({k: v for k, v in g.items() if k != "params"}, "the optimizer's param_groups")
                                 for g in self.param_groups], **_tensor_kinds(self.param_groups)}

    def load_state_dict(self, meta: dict, where: str = "the saved state") -> None:
        """Restore what :meth:`state_dict` saved (the scheduler's part waits for :meth:`attach_scheduler`);
        ``where`` names the state in errors."""
        self.step_count = meta["step_count"]
        check_saved_kinds(self.param_groups, meta["param_groups"], where)
        _say_other_hyperparameters(self.param_groups, meta["param_groups"], where)
        tensors = list(meta.get("tensor_hypers", []))  # (none before they were saved, nor where none was a tensor)
        self._resumed_tensors = tensors + [{}] * (len(meta["param_groups"]) - len(tensors))
        for group, saved, tensors in zip(self.param_groups, meta["param_groups"], self._resumed_tensors):
            group.update(hyper_from_json(saved, group, tensors))
        # a volatile engine's meta (never written) or format 2 holds them as JSON: no backend read
        saved = self.buffer_file.read(meta, where) if self.buffer_file is not None else load_buffers(meta, None, "", where)
        for name, mod, attr, persistent in self.buffers:
            if persistent and name in saved:
                value = saved[name]
                if value.shape != mod._buffers[attr].shape:
                    raise CheckpointError(f"buffer {name} was saved with shape {list(value.shape)}, the model has "
                                          f"{list(mod._buffers[attr].shape)}; build the same model")
                mod._buffers[attr] = value.to(device=mod._buffers[attr].device, dtype=mod._buffers[attr].dtype)
        updates = meta.get("param_updates", {})
        for _, slot in self.param_order:
            slot.updates = updates.get(slot.name, self.step_count) if slot.optimized else 0
        self.load_scalars(meta)
        torch.set_rng_state(decode_rng(meta["rng"]["cpu"]))
        if "cuda" in meta["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(decode_rng(meta["rng"]["cuda"]), self.device)
        self._load_generators(meta["rng"].get("own", {}), where)
        self.user_state = meta["user_state"]
        self.update_tier = meta.get("update_tier")
        self.clip_growth = meta.get("clip_growth")  # (None: saved before it was, or no step clipped in the backward)
        self._resumed_scheduler_state = meta["scheduler"]
        self._resumed_param_groups = meta["param_groups"]

    def _load_generators(self, saved: dict, where: str) -> None:
        """Set each of the model's own generators to its saved state (one the state does not name,
        as from a state saved before they were: left as the model's construction left it)."""
        for name, g in self.generators:
            if name in saved:
                try:
                    g.set_state(decode_rng(saved[name]))
                except (RuntimeError, ValueError, TypeError) as e:
                    raise CheckpointError(f"{where}: the saved state of the model's generator {name} does not fit "
                                          f"it ({e}); resume with the same model") from e

    def load_scalars(self, meta: dict) -> None:
        """Each parameter's optimizer scalar state as ``meta`` records it (a resume redoing a step
        starts from the state before it: the manifest's)."""
        saved = meta.get("param_scalars", {})
        for _, slot in self.param_order:
            slot.scalars = dict(saved.get(slot.name, {}))

    def attach_scheduler(self, scheduler) -> None:
        """Step ``scheduler`` after each optimizer step and save its state; a resumed one is restored.
        Refused: a scheduler whose ``step()`` needs an argument, one whose state cannot be saved."""
        _check_attachable(scheduler)
        self.scheduler = scheduler
        if self._resumed_scheduler_state is not None:
            scheduler.load_state_dict(like_kinds(self._resumed_scheduler_state, scheduler.state_dict()))
            self._resumed_scheduler_state = None
            # building the scheduler re-ran its first step, which set the learning rates from its
            # start (LambdaLR, warm-ups); loading its state does not undo that: the saved ones do
            for group, saved, tensors in zip(self.param_groups, self._resumed_param_groups, self._resumed_tensors):
                group.update(hyper_from_json(saved, group, tensors))
        self._scheduler_epoch = getattr(scheduler, "last_epoch", None)


def _check_attachable(scheduler) -> None:
    """Refuse, before it is attached, a scheduler the engine cannot step with no argument after each
    step (``ReduceLROnPlateau``'s metric) or whose state JSON cannot hold."""
    name = type(scheduler).__name__
    try:
        needs = [p.name for p in inspect.signature(scheduler.step).parameters.values()
                 if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # (no signature to read: it is tried at the first step)
        needs = []
    if needs:
        raise ConfigError(f"{name}.step() needs an argument ({', '.join(needs)}), and the engine steps an attached "
                          f"scheduler with none after each step: do not attach it; step it yourself after "
                          f"engine.step() (scheduler.step(val_loss)). The learning rates it sets are saved with "
                          f"each step; its own counters (patience, best) start again after a resume")
    jsonable(scheduler.state_dict(), f"{name}'s state_dict()")


def jsonable(value, what: str):
    """``value`` with tensors as numbers and tuples as lists, checked to survive JSON exactly."""
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise ConfigError(f"{what} holds a {type(v).__name__} ({v!r}), which cannot be saved with the training "
                          f"state; use numbers, strings, lists and dicts")
    out = conv(value)
    try:
        json.dumps(out, allow_nan=False)
    except ValueError as e:
        raise ConfigError(f"{what} cannot be saved with the training state: {e}") from e
    return out


def saved_hyper(optimizer: type[torch.optim.Optimizer], saved: dict) -> dict:
    """A saved group's hyperparameters as ``optimizer``'s constructor arguments (JSON lists back to tuples)."""
    ctor = set(inspect.signature(optimizer).parameters) - {"params"}
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in ctor}


_SCHEDULED = {"base_momentum": ("betas", "momentum"), "max_lr": ("lr",)}
"""A key a scheduler keeps in a group -> the hyperparameters it moves (OneCycleLR, CyclicLR)."""


def _kind_of(value) -> str:
    """What a hyperparameter is, as the error names it."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return "a number"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} ({', '.join(_kind_of(v) for v in value)})"
    return f"a {type(value).__name__}"


def _same_kind(given, saved) -> bool:
    """Whether ``saved`` (read from JSON) is of the kind ``given`` is; None on either side is a
    setting left to its default (``foreach``, Adafactor's ``eps``): a value, not a kind."""
    if given is None or saved is None:
        return True
    if isinstance(given, bool) or isinstance(saved, bool):
        return isinstance(given, bool) and isinstance(saved, bool)
    if isinstance(given, (int, float)) or (isinstance(given, torch.Tensor) and given.ndim == 0):
        return isinstance(saved, (int, float))
    if isinstance(given, (list, tuple)):
        return (isinstance(saved, list) and len(saved) == len(given)
                and all(_same_kind(g, s) for g, s in zip(given, saved)))
    if isinstance(given, str):
        return isinstance(saved, str)
    return True  # (a kind JSON does not keep as such: the resume's own reading judges it)


def check_saved_kinds(given: list[dict], saved: list[dict], where: str) -> None:
    """Refuse a saved hyperparameter of another kind than the optimizer's own (a rate that is a
    string, betas not a pair of numbers: a manifest edited with its checksum mended), which the
    first step would fail on part-way; the scheduler's base rate (``initial_lr``) is a number. A
    change to or from None is a value changed, which the resume names
    (:func:`_say_other_hyperparameters`)."""
    for i, (g, s) in enumerate(zip(given, saved)):
        for k, v in s.items():
            if k == "params" or (k not in g and k != "initial_lr"):
                continue
            like = g[k] if k in g else 0.0
            if not _same_kind(like, v):
                raise CorruptionError(f"{where}: the saved hyperparameter {k} of group {i} is {v!r}, where the "
                                      f"optimizer has {_kind_of(like)}; {_REDO}")


KEPT_HYPERPARAMETERS = "tiered_offload_kept_hyperparameters"
"""Set on the log record of :func:`_say_other_hyperparameters`: a caller that gives the groups its
own values after the resume (``tiered-offload train``) leaves it out, and names its changes."""


def _say_other_hyperparameters(given: list[dict], saved: list[dict], where: str) -> None:
    """Log where the optimizer given to a resume differs from the saved one, whose values the resume
    takes (as ``optimizer.load_state_dict`` does): a script run again with a new learning rate would
    otherwise train on with the old one without a word. A rate a scheduler moved is compared by its
    base (``initial_lr``)."""
    differ = []
    for i, (g, s) in enumerate(zip(given, saved)):
        s = hyper_from_json(s, g)
        moved = {k for key, keys in _SCHEDULED.items() if key in s for k in keys}
        for k, v in g.items():
            was = s.get("initial_lr", s.get("lr")) if k == "lr" else s.get(k, v)
            if k not in ("params", "initial_lr") and k not in moved and was != v:
                differ.append(f"group {i}: {k} {was} (given {v})" if len(given) > 1 else f"{k} {was} (given {v})")
    if differ:
        logging.getLogger("tiered_offload").warning(
            "tiered-offload: resuming %s with its saved hyperparameters, as optimizer.load_state_dict does, not the "
            "ones given: %s. To change one for the rest of the run, set engine.param_groups[i][name] after the "
            "resume (a scheduler's base rate: its base_lrs, as `tiered-offload train` does with a changed train.lr)",
            where, ", ".join(differ), extra={KEPT_HYPERPARAMETERS: True})


def hyper_from_json(saved: dict, like: dict, tensors: dict | None = None) -> dict:
    """Hyperparameters read back from JSON, of the kinds the optimizer's have (see :func:`like_kinds`);
    ``tensors``: ``{name: dtype}`` of those that were tensors when saved (a key a scheduler put in
    the group, ``initial_lr``, which the given group has not yet: a tensor where the run had one)."""
    out = {k: like_kinds(v, like.get(k)) for k, v in saved.items()}
    for k, dtype in (tensors or {}).items():
        if k in out and not isinstance(out[k], torch.Tensor):
            out[k] = torch.tensor(out[k], dtype=getattr(torch, dtype))
    return out


def _tensor_kinds(groups: list[dict]) -> dict:
    """``{"tensor_hypers": [{name: dtype}, ...]}`` of the groups' tensor values (none: nothing), so a
    resume gives them back as tensors (:func:`hyper_from_json`)."""
    kinds = [{k: str(v.dtype).removeprefix("torch.") for k, v in g.items() if isinstance(v, torch.Tensor)}
             for g in groups]
    return {"tensor_hypers": kinds} if any(kinds) else {}


def like_kinds(value, like):
    """``value`` read back from JSON with the kinds ``like`` has, recursively: tuples where it has
    tuples, tensors where it has tensors, of their dtype (``lr=torch.tensor(...)``: an optimizer
    rounds with a float32 rate otherwise than with a float; a scheduler multiplies its float32 base
    rates otherwise than floats)."""
    if isinstance(like, torch.Tensor) and isinstance(value, (int, float, list)):
        return torch.tensor(value, dtype=like.dtype, device=like.device)
    if isinstance(like, dict) and isinstance(value, dict):
        return {k: like_kinds(v, like.get(k)) for k, v in value.items()}
    if isinstance(like, (list, tuple)) and isinstance(value, list):
        items = [like_kinds(v, o) for v, o in zip(value, like)] if len(value) == len(like) else value
        return tuple(items) if isinstance(like, tuple) else list(items)
    return value
