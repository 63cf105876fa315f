"""What the engine needs to know of the user's optimizer: its class, its parameter groups and the
per-parameter state it keeps, read from a ``torch.optim`` class plus keyword arguments or from an
optimizer instance built over the model's parameters the usual way (parameter groups included).

The engine never runs the user's instance: it runs fresh instances of the same class with each
group's hyperparameters, in one of two modes:

- **elementwise** (:data:`ELEMENTWISE`: Adam, AdamW, SGD, ...): over chunks of a unit's flat
  buffers, the same arithmetic as a step over whole parameters; its state is one tensor of the
  parameter's size per kind.
- **per parameter** (Adafactor, Muon, and any optimizer whose step is probed to treat each
  parameter on its own): over each whole parameter, with its real shape and the state tensors the
  optimizer makes for it (of any shape), packed into ``packed0``, ``packed1``... buffers of the
  parameter's size (as many as the largest state needs: one for Adafactor and Muon).

An optimizer that needs a closure, sparse gradients, or couples parameters is refused.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from offload_core.errors import CheckpointError, ConfigError
from storage_backends import resolve_storage
from tiered_offload.checkpoint.durable import StateFiles, state_directory
from tiered_offload.engine.train_state import saved_hyper

__all__ = ["OptimizerSpec", "PackedState", "read_optimizer", "optimizer_for_resume", "optimizer_mode"]


@dataclass
class OptimizerSpec:
    """The optimizer as the engine runs it."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    """The class's defaults with the user's overrides (what ``optimizer.defaults`` holds)."""
    groups: list[dict[str, Any]]
    """Each parameter group's hyperparameters (no ``params``), in the user's order."""
    members: list[list[int]]
    """``id()`` of each group's parameters, in the group's order."""
    kinds: list[str] = field(default_factory=list)
    """Per-parameter state tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``)."""
    scalars: dict[str, torch.dtype] = field(default_factory=dict)
    """Per-parameter scalar state besides ``step`` (NAdam's ``mu_product``, ASGD's ``eta`` and
    ``mu``) and its dtype: kept per parameter by the engine, saved with every step."""
    has_step: bool = False
    """Whether the state holds a per-parameter ``step`` count."""
    per_parameter: PackedState | None = None
    """Per-parameter mode: how each parameter's state tensors are packed (None: elementwise)."""
    zero_init_states: bool = False
    """Whether every state starts at zero (Adam, AdamW): the store's implicit zeros are exact and
    the first step allocates nothing; other optimizers create their state on a parameter's first
    step (SGD's momentum buffer is a copy of the gradient) and the engine copies it in."""

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    @property
    def ctor_keys(self) -> set[str]:
        return set(inspect.signature(self.cls).parameters) - {"params"}

    def hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """A group's hyperparameters as constructor arguments (a scheduler may have changed lr), a
        step's own: tensors (``lr=torch.tensor(...)``, which a scheduler sets in place; betas) copied."""
        def own(v):
            if isinstance(v, torch.Tensor):
                return v.clone()
            return type(v)(own(x) for x in v) if isinstance(v, (tuple, list)) else v
        keys = self.ctor_keys
        return {k: own(v) for k, v in group.items() if k in keys}

    def next_scalars(self, hyper: dict[str, Any], count: int, scalars: dict[str, float]) -> dict[str, float]:
        """A parameter's scalar state after its step ``count + 1`` (its scalars before it given):
        they depend on the step count and the hyperparameters alone, so a one-element probe step
        computes them exactly, before the update does (a commit records the state after a step
        when the step begins)."""
        if not self.scalars:  # (a per-parameter optimizer packs its 0-d state with the rest: none here)
            return {}
        p = torch.zeros(1, requires_grad=True)
        opt = self.cls([p], **hyper)
        if count:
            state: dict[str, Any] = {k: torch.zeros(1) for k in self.kinds}
            if self.has_step:
                state["step"] = torch.tensor(float(count))
            for k, dtype in self.scalars.items():
                state[k] = torch.tensor(scalars[k], dtype=dtype)
            opt.state[p] = state
        p.grad = torch.zeros(1)
        with torch.no_grad():
            opt.step()
        return {k: float(opt.state[p][k]) for k in self.scalars}

    def group_of(self) -> dict[int, int]:
        """``{id(param): group index}``."""
        return {pid: i for i, ids in enumerate(self.members) for pid in ids}


ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "ASGD",
                                                       "NAdam", "RAdam", "RMSprop", "Rprop", "SGD"))
"""The optimizers whose step treats every element of every parameter alike and whose state is one
tensor of the parameter's shape per kind (plus a step count and scalars a parameter's steps alone
decide, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``): the engine runs them on pieces of
flat buffers, bitwise as PyTorch runs them on whole parameters (PyTorch's own ``optim_db``
configurations, tests/test_conformance.py)."""

_REFUSED = {
    "SparseAdam": "needs sparse gradients, which the engine's dense gradient buffers are not",
}
"""Why a known optimizer is refused (besides the generic reasons: a closure, coupled parameters)."""

MODE_ATTRIBUTE = "tiered_offload_mode"
"""A class attribute an optimizer may declare: ``"elementwise"`` (its step treats every element
alike and keeps one state tensor of the parameter's shape per kind) or ``"per_parameter"``
(its step treats each parameter on its own); without it, the engine probes."""

_PROBE_SHAPES = ((3, 5, 7, 11), (13, 2, 17, 19))
"""Two parameter shapes per rank (their first ``ndim`` sizes) a per-parameter probe steps: sizes
that differ, so that each dimension of a state tensor names the parameter dimension it follows."""


@dataclass
class PackedState:
    """Where a per-parameter optimizer keeps a parameter's state: each state tensor it makes (whose
    shape follows the parameter's, Adafactor's ``row_var`` of ``(rows, 1)``) one after another in
    the concatenation of ``slots`` buffers of the parameter's size (``packed0``, ``packed1``...)."""

    rules: dict[int, list[tuple[str, tuple[int | None, ...]]]]
    """For each parameter rank: each state tensor's name and shape, a dimension being the
    parameter's dimension ``i`` or ``None`` for a 1."""
    slots: int = 1

    def entries(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int]]:
        """``(name, shape, start)`` of each state tensor of a parameter of ``shape``."""
        out, start = [], 0
        for name, rule in self.rules[len(shape)]:
            dims = tuple(1 if i is None else shape[i] for i in rule)
            out.append((name, dims, start))
            start += math.prod(dims)
        return out

    def slots_for(self, shape: tuple[int, ...]) -> int:
        total = sum(math.prod(dims) for _, dims, _ in self.entries(shape))
        return max(1, -(-total // max(1, math.prod(shape))))


def _has_stepped(state: dict) -> bool:
    """Whether a parameter's optimizer state comes from a step (Adagrad makes its state at
    construction, with a step count of 0: that is a fresh optimizer's)."""
    step = state.get("step")
    return step is None or float(step) != 0


def optimizer_mode(cls: type) -> str:
    """``"elementwise"``, ``"per_parameter"`` (then :func:`read_optimizer` probes that its step
    treats each parameter on its own) or a ``ConfigError`` saying why the engine cannot run it."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__name__ in _REFUSED:
        raise ConfigError(f"{name} {_REFUSED[cls.__name__]}; use a dense optimizer (AdamW is the usual choice)")
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"{name} needs a closure that re-evaluates the loss (several forwards per step), which "
                          f"the engine's one forward and backward per step cannot give; use an optimizer that steps "
                          f"from the gradients (AdamW is the usual choice)")
    declared = getattr(cls, MODE_ATTRIBUTE, None)
    if declared is not None:
        if declared not in ("elementwise", "per_parameter"):
            raise ConfigError(f"{name}.{MODE_ATTRIBUTE} is {declared!r}; it must be 'elementwise' or 'per_parameter'")
        return declared
    if cls in ELEMENTWISE:
        return "elementwise"
    base = next((b for b in cls.__mro__ if b in ELEMENTWISE), None)  # the nearest one it derives from
    if base is not None and cls.step is base.step:
        return "elementwise"
    return "per_parameter"


def read_optimizer(optimizer, optimizer_kwargs: dict | None, parameters: Iterable[torch.nn.Parameter]) -> OptimizerSpec:
    """Read ``optimizer`` (a class with ``optimizer_kwargs``, or an instance over ``parameters``)."""
    mode = optimizer_mode(optimizer if isinstance(optimizer, type) else type(optimizer))
    params = list(parameters)
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer_kwargs:
            raise ConfigError("optimizer_kwargs is for an optimizer class; an optimizer instance already holds its "
                              "hyperparameters (pass them when building it)")
        if any(_has_stepped(state) for state in optimizer.state.values()):
            raise ConfigError(f"the {type(optimizer).__name__} passed as optimizer= has already stepped (it holds "
                              f"state for {len(optimizer.state)} parameter(s)); build a fresh one over the model's "
                              f"parameters, or resume the engine's own state with resume=True")
        known = {id(p) for p in params}
        groups, members = [], []
        for i, g in enumerate(optimizer.param_groups):
            ids = []
            for p in g["params"]:
                if id(p) not in known:
                    raise ConfigError(f"parameter group {i} of the optimizer holds a tensor of shape {list(p.shape)} "
                                      f"that is not a parameter of the model; build the optimizer over "
                                      f"model.parameters() (or named_parameters()) of the model given to the engine")
                ids.append(id(p))
            members.append(ids)
            groups.append({k: v for k, v in g.items() if k != "params"})
        spec = OptimizerSpec(type(optimizer), dict(optimizer.defaults), groups, members)
    else:
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer= must be a torch.optim.Optimizer class (torch.optim.AdamW) or an instance "
                              f"built over the model's parameters, got {optimizer!r}")
        kwargs = dict(optimizer_kwargs or {})
        probe = torch.zeros(1, 1, requires_grad=True)  # 2-D: Muon takes nothing else
        try:
            opt = optimizer([probe], **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{optimizer.__name__} rejected optimizer_kwargs {kwargs}: {e}") from e
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        # like torch.optim.X(model.parameters()): one group over every parameter; the frozen
        # ones never get a gradient, so the optimizer never touches them
        spec = OptimizerSpec(optimizer, dict(opt.defaults), [group], [[id(p) for p in params]])
    if mode == "elementwise":
        _probe_state(spec)
    else:
        by_id = {id(p): p for p in params}
        optimized = [[by_id[i] for i in ids if by_id[i].requires_grad] for ids in spec.members]
        _probe_per_parameter(spec, optimized)
    return spec


def _probe_state(spec: OptimizerSpec) -> None:
    """Step a 3-element parameter once per group to see which state the optimizer keeps."""
    seen = None
    for i, group in enumerate(spec.groups):
        p = torch.zeros(3, requires_grad=True)
        try:
            opt = spec.cls([p], **spec.hyper(group))
        except TypeError as e:
            raise ConfigError(f"{spec.cls.__name__} rejected the hyperparameters of group {i} ({group}): {e}") from e
        p.grad = torch.ones(3)
        try:
            opt.step()
        except (ValueError, RuntimeError, TypeError) as e:  # (PyTorch's own step on the model fails alike)
            raise ConfigError(f"{spec.cls.__name__} cannot take a step with the hyperparameters of group {i} "
                              f"({group}): {e}") from e
        state = opt.state[p]
        kinds = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape]
        if seen is not None and kinds != seen:
            raise ConfigError(f"parameter group {i} makes {spec.cls.__name__} keep state {kinds}, group 0 keeps {seen}; "
                              f"the engine needs the same per-parameter state in every group (e.g. the same "
                              f"amsgrad / momentum setting being on or off)")
        seen = kinds
        spec.has_step = "step" in state
        spec.scalars = {k: v.dtype for k, v in state.items()
                        if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 0}
    spec.kinds = seen or []
    spec.zero_init_states = issubclass(spec.cls, (torch.optim.Adam, torch.optim.AdamW))


def _probe_per_parameter(spec: OptimizerSpec, optimized: list[list[torch.nn.Parameter]]) -> None:
    """For each group and each rank of its parameters, step two parameters together and each on
    its own twice: the step must treat them independently (bitwise the same), and its state
    tensors' shapes must follow the parameter's; read how (the packing) from the state."""
    name = spec.cls.__name__
    rules: dict[int, list] = {}
    has_step = False
    for i, group in enumerate(spec.groups):
        for ndim in sorted({p.dim() for p in optimized[i]}):
            example = next(tuple(p.shape) for p in optimized[i] if p.dim() == ndim)
            shapes = [s[:ndim] for s in _PROBE_SHAPES]
            try:
                together, alone = _step_twice(spec, group, shapes, True), _step_twice(spec, group, shapes, False)
            except (ValueError, RuntimeError, TypeError) as e:
                raise ConfigError(f"{name} cannot step the model's {ndim}-D parameters (e.g. one of shape "
                                  f"{list(example)}) in parameter group {i}: {e}. Build it over the parameters it "
                                  f"supports") from e
            if not all(_same(a, b) for a, b in zip(together, alone)):
                raise ConfigError(f"{name} couples parameters (its step of two parameters together differs from "
                                  f"their steps alone), which the engine, streaming a parameter at a time, cannot "
                                  f"run; use an optimizer whose step treats each parameter on its own")
            rule = [_shape_rule(name, k, v, shapes) for k, v in together[0][1].items() if k != "step"]
            second = {k: tuple(v.shape) for k, v in together[1][1].items() if k != "step"}
            if second != {k: tuple(1 if d is None else shapes[1][d] for d in r) for k, r in rule}:
                raise ConfigError(f"{name} keeps state {second} for a parameter of shape {list(shapes[1])}: the engine "
                                  f"cannot tell how its sizes follow the parameter's")
            if ndim in rules and rules[ndim] != rule:
                raise ConfigError(f"parameter group {i} makes {name} keep state {[k for k, _ in rule]} for a "
                                  f"{ndim}-D parameter, another group {[k for k, _ in rules[ndim]]}; the engine needs "
                                  f"the same per-parameter state in every group")
            rules[ndim] = rule
            has_step = has_step or "step" in together[0][1]
    packed = PackedState(rules)
    packed.slots = max([packed.slots_for(tuple(p.shape)) for ps in optimized for p in ps] or [1])
    spec.per_parameter = packed
    spec.kinds = [f"packed{k}" for k in range(packed.slots)]
    spec.has_step = has_step


def _step_twice(spec: OptimizerSpec, group: dict, shapes: list[tuple], together: bool) -> list[tuple]:
    """``(weights, state)`` of one parameter of each shape after two steps of seeded gradients."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    opts = [spec.cls(params, **spec.hyper(group))] if together else [spec.cls([p], **spec.hyper(group)) for p in params]
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        for opt in opts:
            opt.step()
    return [(p.detach(), dict(opts[0 if together else k].state.get(p, {}))) for k, p in enumerate(params)]


def _same(a: tuple, b: tuple) -> bool:
    (wa, sa), (wb, sb) = a, b
    return torch.equal(wa, wb) and sa.keys() == sb.keys() and all(
        torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)


def _shape_rule(name: str, key: str, value, shapes: list[tuple]) -> tuple[str, tuple[int | None, ...]]:
    """How state ``key``'s shape follows the parameter's, read from the first probe's shape (the
    caller checks the rule on the second)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        raise ConfigError(f"{name} keeps {key!r} as {type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}"
                          f" per parameter; the engine keeps per-parameter state as float32 tensors (and a step count)")
    first = shapes[0]
    rule = tuple(None if d == 1 else (first.index(d) if d in first else -1) for d in value.shape)
    if -1 in rule:
        raise ConfigError(f"{name} keeps {key!r} of shape {list(value.shape)} for a parameter of shape {list(first)}: "
                          f"the engine cannot tell how its size follows the parameter's")
    return key, rule


def optimizer_for_resume(storage, model: torch.nn.Module, optimizer, optimizer_kwargs: dict | None):
    """The optimizer (and keyword arguments) to continue the training state in ``storage`` with:
    the given one, or the saved ``torch.optim`` class with its parameter groups rebuilt over
    ``model``'s parameters by name and its saved hyperparameters."""
    location = resolve_storage(storage).location
    files = StateFiles(state_directory(location))
    manifest = files.read_manifest()
    if manifest is None:
        raise CheckpointError(f"{location} holds no training state (no {files.manifest_path}); give the storage "
                              f"directory an engine trained in")
    saved = manifest["optimizer"]
    groups = manifest["meta"]["param_groups"]
    if optimizer is None:
        module, _, name = saved["class"].rpartition(".")
        if not module.startswith("torch.optim"):
            raise ConfigError(f"{storage} was trained with {saved['class']}; pass optimizer= that class to resume")
        optimizer = getattr(torch.optim, name, None)
        if optimizer is None:
            raise ConfigError(f"{saved['class']} is not a torch.optim optimizer of this torch; pass optimizer=")
    members = saved.get("groups")
    if isinstance(optimizer, type) and optimizer_kwargs is None and members is not None:
        # rebuild the saved parameter groups over this model's parameters, by name
        named = dict(model.named_parameters())
        missing = [n for names in members for n in names if n not in named]
        if missing:
            raise CheckpointError(f"{storage} was trained with parameter groups naming {missing[:3]}, which this "
                                  f"model does not have; build the same model")
        optimizer = optimizer([{"params": [named[n] for n in names], **saved_hyper(optimizer, g)}
                               for names, g in zip(members, groups)])
    elif optimizer_kwargs is None and isinstance(optimizer, type):
        optimizer_kwargs = saved_hyper(optimizer, groups[0])
    return optimizer, optimizer_kwargs
