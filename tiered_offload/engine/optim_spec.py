"""What the engine needs to know of the user's optimizer: its class, its parameter groups and the
per-parameter state it keeps, read from a ``torch.optim`` class plus keyword arguments or from an
optimizer instance built over the model's parameters the usual way (parameter groups included).

The engine never runs the user's instance: it runs a fresh instance of the same class over each
chunk of a unit's flat buffers with the chunk's group's hyperparameters, which for elementwise
optimizers (Adam, AdamW, SGD, ...) is the same arithmetic as a step over whole parameters.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from offload_core.errors import CheckpointError, ConfigError
from storage_backends import resolve_storage
from tiered_offload.checkpoint.durable import StateFiles, state_directory
from tiered_offload.engine.train_state import saved_hyper

__all__ = ["OptimizerSpec", "read_optimizer", "optimizer_for_resume"]


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
        """A group's hyperparameters as constructor arguments (a scheduler may have changed lr)."""
        keys = self.ctor_keys
        return {k: v for k, v in group.items() if k in keys}

    def next_scalars(self, hyper: dict[str, Any], count: int, scalars: dict[str, float]) -> dict[str, float]:
        """A parameter's scalar state after its step ``count + 1`` (its scalars before it given):
        they depend on the step count and the hyperparameters alone, so a one-element probe step
        computes them exactly, before the update does (a commit records the state after a step
        when the step begins)."""
        if not self.scalars:
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

_NOT_YET = {
    "LBFGS": "needs a closure that re-evaluates the loss, several times per step",
    "SparseAdam": "needs sparse gradients, which the engine's dense gradient buffers are not",
    "Adafactor": "keeps factored row and column moments of each 2-D parameter: it works on whole parameters, which "
                 "the engine's flat pieces are not",
    "Muon": "orthogonalises each 2-D parameter's update: it works on whole parameters, which the engine's flat "
            "pieces are not",
}
"""Why an optimizer outside :data:`ELEMENTWISE` is refused (an unlisted one: not known to be elementwise)."""


def _has_stepped(state: dict) -> bool:
    """Whether a parameter's optimizer state comes from a step (Adagrad makes its state at
    construction, with a step count of 0: that is a fresh optimizer's)."""
    step = state.get("step")
    return step is None or float(step) != 0


def check_supported(cls: type) -> None:
    """Refuse, at construction, an optimizer the engine would run wrong: it must be one of
    :data:`ELEMENTWISE` (or a subclass that keeps its ``step``)."""
    if cls in ELEMENTWISE:
        return
    base = next((b for b in cls.__mro__ if b in ELEMENTWISE), None)  # the nearest one it derives from
    if base is not None and cls.step is base.step:
        return
    if base is not None:
        why = f"is a subclass of {base.__name__} with its own step(), which the engine cannot tell is elementwise"
    else:
        why = _NOT_YET.get(cls.__name__, "is not one the engine knows to be elementwise")
    raise ConfigError(f"{cls.__module__}.{cls.__qualname__} {why}; the engine "
                      f"runs exactly {', '.join(b.__name__ for b in ELEMENTWISE)}. Use one of those (AdamW is the "
                      f"usual choice for fine-tuning)")


def read_optimizer(optimizer, optimizer_kwargs: dict | None, parameters: Iterable[torch.nn.Parameter]) -> OptimizerSpec:
    """Read ``optimizer`` (a class with ``optimizer_kwargs``, or an instance over ``parameters``)."""
    check_supported(optimizer if isinstance(optimizer, type) else type(optimizer))
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
        probe = torch.zeros(1, requires_grad=True)
        try:
            opt = optimizer([probe], **kwargs)
        except TypeError as e:
            raise ConfigError(f"{optimizer.__name__} rejected optimizer_kwargs {kwargs}: {e}") from e
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        # like torch.optim.X(model.parameters()): one group over every parameter; the frozen
        # ones never get a gradient, so the optimizer never touches them
        spec = OptimizerSpec(optimizer, dict(opt.defaults), [group], [[id(p) for p in params]])
    _probe_state(spec)
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
        opt.step()
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
