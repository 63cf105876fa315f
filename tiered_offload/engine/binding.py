"""Split a model into streamed units: one per block of its block sequence, plus the rest.

A *unit* is what the engine moves through the tiers as one piece: a flat fp32 buffer per kind of
state (weights, gradients, each optimizer state) holding all of the unit's parameters back to
back. Blocks are the members of the model's block sequence (an ``nn.ModuleList`` or
``nn.Sequential``, found as the one holding the most parameters, or named by the user); the
``rest`` unit holds everything around them (embeddings, final norm, head, tied weights).
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from offload_core.errors import ConfigError, ModelStructureError, TensorStateError
from tiered_offload.checkpoint.adapter import peft_adapter_name
from tiered_offload.checkpoint.export import model_config
from tiered_offload.checkpoint.safetensors_io import config_json
from tiered_offload.engine.adapter_init import adapter_initialisers, prepare_peft_model
from tiered_offload.engine.parameter_guard import (GradInStore, bind, check_grad_hooks, check_no_new_parameters,
                                                  check_requires_grad, check_untouched, refuse_resizing,
                                                  state_dict_names_only, unbind, warn_of_forward_hooks,
                                                  weights_in_store, weights_into_store)
from tiered_offload.engine.recorded_outputs import RecordedOutputs
from tiered_offload.engine.schedule import UnitLayout

__all__ = ["ParamSlot", "Unit", "ModelBinding", "empty_init", "find_block_sequence", "plan_units"]


@dataclass(eq=False)
class ParamSlot:
    """One parameter: where it lives inside its unit's flat buffers, and its training record."""

    name: str
    """Its name in ``model.named_parameters()`` (the first name, for tied weights)."""
    local_name: str
    """Its name relative to the unit's module (what ``functional_call`` needs), for blocks."""
    param: nn.Parameter
    numel: int
    shape: tuple[int, ...]
    offset: int = 0
    """Start in the unit's buffers (weights; gradients and states too, where it has them)."""
    requires_grad: bool = True
    """Trainable when the engine was built: it has a gradient buffer (and optimizer states, in a
    group). Parameters frozen then are never modified, and cannot be unfrozen. One frozen since
    (``param.requires_grad`` False: gradual freezing) keeps its buffers and gets no gradient."""
    group: int | None = None
    """Index of its optimizer parameter group; None: the optimizer does not update it."""
    has_grad: bool = False
    """A backward since the last ``zero_grad()`` gave it a gradient (PyTorch: ``.grad is not None``)."""
    updates: int = 0
    """Optimizer steps applied to it so far (its ``step`` count in Adam's state)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Its optimizer's scalar state (NAdam's ``mu_product``...) after its last step ({}: none yet)."""
    version: int = 0
    """The parameter's autograd version when it last became a placeholder: an in-place change
    since (an init, a clamp) was made to nothing (:func:`~tiered_offload.engine.parameter_guard.check_untouched`)."""
    held: torch.Tensor | None = None
    """The placeholder it was last given (kept: new ``.data`` since is told by another address)."""

    @property
    def optimized(self) -> bool:
        return self.requires_grad and self.group is not None


@dataclass(kw_only=True, eq=False)
class Unit(UnitLayout):
    """A piece of the model streamed as one: a block, or the rest."""

    index: int | None = None
    """Position in the order the forward streams units (None for the rest unit)."""
    module: nn.Module | None = None
    """The streamed module (None for the rest unit, whose parameters stay in the model)."""
    qualname: str = ""
    """Where the module sits in the model (``transformer.h.3``, ``lm_head``)."""
    params: list[ParamSlot] = field(default_factory=list)

    def add(self, name: str, local_name: str, param: nn.Parameter) -> None:
        self.params.append(ParamSlot(name, local_name, param, param.numel(), tuple(param.shape),
                                     requires_grad=param.requires_grad))

    def arrange(self, group_of: dict[int, int], whole_params: bool = False) -> None:
        """Assign groups and lay the parameters out: optimized (by group), trainable, then frozen;
        with ``whole_params`` (a per-parameter optimizer), state pieces that hold whole parameters."""
        for s in self.params:
            s.group = group_of.get(id(s.param))
        rank = {id(s): i for i, s in enumerate(self.params)}

        def category(s: ParamSlot):
            if s.optimized:
                return (0, s.group, rank[id(s)])
            return (1 if s.requires_grad else 2, 0, rank[id(s)])
        self.params.sort(key=category)
        offset = 0
        for s in self.params:
            s.offset = offset
            offset += s.numel
        self.numel = offset
        self.grad_numel = sum(s.numel for s in self.params if s.requires_grad)
        self.state_numel = sum(s.numel for s in self.params if s.optimized)
        pieces: list[list[int]] = []
        for s in (s for s in self.params if s.optimized and whole_params):
            if pieces and pieces[-1][1] - pieces[-1][0] + s.numel <= self.piece_numel:
                pieces[-1][1] += s.numel
            else:
                pieces.append([s.offset, s.offset + s.numel])
        self.whole_pieces = tuple((a, b) for a, b in pieces)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{local_name: view}`` of each parameter inside the weight buffer ``flat``."""
        return {p.local_name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.params}

    def trainable(self) -> list[ParamSlot]:
        """The parameters with a gradient buffer, in buffer order."""
        return [p for p in self.params if p.requires_grad]

    def training(self) -> list[ParamSlot]:
        """The trainable parameters whose ``requires_grad`` is set now (not frozen since), in buffer
        order: a block call's leaves that require a gradient."""
        return [p for p in self.params if p.requires_grad and p.param.requires_grad]

    def idle(self) -> bool:
        """No parameter trains now nor holds a gradient (frozen whole mid-run, zeroed since)."""
        return not any(p.has_grad or p.param.requires_grad for p in self.trainable())

    def receiving(self, params: dict[str, torch.Tensor]) -> list[ParamSlot]:
        """Of a block call's leaves ``params``, the trainable ones a backward adds to: built requiring
        a gradient, their parameter still requiring one (PyTorch drops the gradient otherwise)."""
        return [p for p in self.trainable() if params[p.local_name].requires_grad and p.param.requires_grad]

    def grad_views(self, gflat: torch.Tensor) -> list[torch.Tensor]:
        """Views of each trainable parameter's gradient inside the gradient buffer ``gflat``."""
        return [gflat[p.offset:p.offset + p.numel].view(p.shape) for p in self.trainable()]


def find_block_sequence(model: nn.Module, hint: str | None = None) -> tuple[str, nn.Module]:
    """The dotted name and module of the model's block sequence.

    With ``hint`` (e.g. ``"transformer.h"``), that submodule; otherwise the ``ModuleList`` or
    ``Sequential`` of at least two children that holds the most parameters.
    """
    largest = sorted(((name, mod, n) for name, mod in model.named_modules()
                      if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2 and mod is not model
                      and (n := sum(p.numel() for p in mod.parameters()))), key=lambda s: -s[2])  # (stable)
    if hint is not None:
        have = "; its layer sequences: " + ", ".join(f"{name} ({len(mod)} layers, {n:,} parameters)"
                                                     for name, mod, n in largest[:6]) if largest else ""
        try:
            seq = model.get_submodule(hint)
        except AttributeError:
            raise ModelStructureError(f"the model has no submodule {hint!r} to use as its block sequence; pass "
                                      f"blocks= with the dotted name of its nn.ModuleList of layers{have}") from None
        if not isinstance(seq, (nn.ModuleList, nn.Sequential)):
            raise ModelStructureError(f"{hint!r} is a {type(seq).__name__}, not an nn.ModuleList or "
                                      f"nn.Sequential{have}")
        return hint, seq
    if not largest:
        raise ModelStructureError(
            f"{type(model).__name__} has no block sequence (an nn.ModuleList or nn.Sequential of two or more "
            f"layers holding parameters); pass blocks='<dotted name>' to say which submodule holds the layers")
    return largest[0][:2]  # (the first of the largest)


def plan_units(model: nn.Module, hint: str | None = None, stream_modules_numel: int | None = 0
               ) -> tuple[str, list[Unit], Unit, list[tuple[Unit, ParamSlot]]]:
    """Units of ``model``: the streamed ones in forward order, the rest, and every parameter in
    ``model.parameters()`` order.

    The streamed units are the blocks of the block sequence and, with ``stream_modules_numel``
    not None, each block of another sequence (an encoder-decoder's other stack) and each
    ``nn.Embedding`` or ``nn.Linear`` outside them, whose parameters are their own (not tied to
    another module) and number at least ``stream_modules_numel`` (0: as many as the largest block;
    for a sequence, all its blocks together): a large untied embedding, head or other stack then
    streams like a block instead of staying bound for the whole forward and backward. Modules
    registered before the block sequence are taken to run before it, the others after it.

    Raises :class:`ModelStructureError` if a parameter is shared between a block and anything else.
    """
    seq_name, seq = find_block_sequence(model, hint)
    owner: dict[int, Unit] = {}
    blocks: list[Unit] = []
    for i, block in enumerate(seq):
        unit = Unit(name=f"block.{i}", is_block=True, module=block, qualname=f"{seq_name}.{i}")
        for local, p in block.named_parameters():
            if id(p) in owner:
                raise ModelStructureError(f"parameter {seq_name}.{i}.{local} is shared with {owner[id(p)].name}; "
                                          f"weights shared between blocks cannot be streamed")
            owner[id(p)] = unit
            unit.add(f"{seq_name}.{i}.{local}", local, p)
        blocks.append(unit)
    before, after = [], []
    if stream_modules_numel is not None:
        threshold = stream_modules_numel or max((sum(s.numel for s in u.params) for u in blocks), default=0)
        uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        claimed = {id(m) for m in seq.modules()}  # streamed already, or inside what is
        seen_seq = False

        def own_params(mod: nn.Module) -> list | None:
            """``mod``'s parameters if it can stream as a unit (none tied to another module)."""
            own = list(mod.named_parameters())
            return own if own and not any(uses[id(p)] > 1 or id(p) in owner for _, p in own) else None

        def stream(qual: str, mod: nn.Module, own: list) -> None:
            unit = Unit(name=f"module.{qual}", is_block=True, in_sequence=False, module=mod, qualname=qual)
            for local, p in own:
                owner[id(p)] = unit
                unit.add(f"{qual}.{local}", local, p)
            claimed.update(id(m) for m in mod.modules())
            (after if seen_seq else before).append(unit)
        for qual, mod in model.named_modules():
            if mod is seq:
                seen_seq = True
            if id(mod) in claimed or qual == "" or seq_name.startswith(f"{qual}."):  # the sequence or above it
                continue
            if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
                # another block sequence (an encoder-decoder's other stack): each block streams
                children = [(f"{qual}.{i}", child, own_params(child)) for i, child in enumerate(mod)]
                if all(own for _, _, own in children) and \
                        sum(p.numel() for _, _, own in children for _, p in own) >= max(1, threshold):
                    for child_qual, child, own in children:
                        stream(child_qual, child, own)
                    continue
            if not isinstance(mod, (nn.Embedding, nn.Linear)):
                continue
            own = own_params(mod)
            if own is not None and sum(p.numel() for _, p in own) >= max(1, threshold):
                stream(qual, mod, own)
    blocks = [*before, *blocks, *after]
    for i, unit in enumerate(blocks):
        unit.index = i
    rest = Unit(name="rest")
    order: list[tuple[Unit, ParamSlot]] = []
    block_slots = {id(s.param): (u, s) for u in blocks for s in u.params}
    for name, p in model.named_parameters():
        if id(p) in block_slots:
            order.append(block_slots[id(p)])
            continue
        rest.add(name, name, p)
        order.append((rest, rest.params[-1]))
    # a parameter tied between a block and the rest shows up only once in named_parameters();
    # make sure no rest parameter object is also a block parameter
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{name}.{pname}" if name else pname
            if id(p) in block_slots and not full.startswith(f"{block_slots[id(p)][0].qualname}."):
                raise ModelStructureError(f"{full} is the same tensor as {block_slots[id(p)][1].name}: weights tied "
                                          f"between a block and the rest of the model cannot be streamed")
    return seq_name, blocks, rest, order


@contextlib.contextmanager
def empty_init():
    """Build a model with its parameters on the meta device and its buffers real.

    ``with tiered_offload.empty_init(): model = MyModel(config)`` allocates no parameter memory;
    the engine then initialises the parameters unit by unit, straight into its store, with the
    modules' own initialisation. Buffers (rotary frequencies, masks) are computed normally.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


_CHECKPOINTING: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]]" = weakref.WeakKeyDictionary()


def call_block(module: torch.nn.Module, params, args, kwargs):
    """``functional_call`` of a streamed block on ``params``, with Hugging Face's gradient
    checkpointing (``model.gradient_checkpointing_enable()``) off inside it. A checkpointed layer's
    recompute runs in backward, outside this call, on weights the engine has let go by then; and
    the engine already recomputes the block itself, or keeps its graph. PyTorch computes the same
    values with it on and off (``tests/test_finetune.py``), so the result stays PyTorch's."""
    layers = _CHECKPOINTING.get(module)
    if layers is None:  # the modules that can be checkpointed, found once per block
        layers = _CHECKPOINTING[module] = [m for m in module.modules() if hasattr(m, "gradient_checkpointing")]
    layers = [m for m in layers if m.gradient_checkpointing is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        return functional_call(module, params, args, kwargs, strict=False)
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def compiled(modules) -> bool:
    """Whether any of ``modules`` runs compiled (``torch.compile(module)``, ``module.compile()``, a
    compiled ``forward``)."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               or hasattr(type(m).forward, "_torchdynamo_orig_callable")
               or hasattr(vars(m).get("forward"), "_torchdynamo_orig_callable") for m in modules)


def _refuse_compiled_holders(model: nn.Module, seq_name: str, blocks: list[Unit]) -> None:
    """A compiled module that holds the blocks (``torch.compile(model)``) would have dynamo trace
    the engine's streaming of them (it stopped on a stand-in's ``.grad``); compiled blocks work."""
    holders = dict.fromkeys(".".join(u.qualname.split(".")[:i]) for u in blocks for i in range(u.qualname.count(".") + 1))
    for name in holders:
        if compiled([model.get_submodule(name) if name else model]):
            seq = seq_name.removeprefix("_orig_mod.")
            raise ConfigError(
                f"{name or 'the model'} runs compiled (torch.compile) and holds the blocks: it would compile the "
                f"engine's streaming of them. Compile each block instead, before building the engine (for block in "
                f"model.{seq}: block.compile()), and pass the model itself (not torch.compile(model)): the blocks "
                f"then run compiled, bitwise as PyTorch runs them")


def closed_over(attr: str, value) -> list[tuple[str, Any]]:
    """``(attr.variable, value)`` of each variable the function ``value`` closes over."""
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return []
    out = []
    for var, cell in zip(value.__code__.co_freevars, value.__closure__):
        try:
            out.append((f"{attr}.{var}", cell.cell_contents))
        except ValueError:  # a cell not yet filled
            pass
    return out


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element (zero), expanded: its shape and ``numel()`` are
    a parameter's, its memory one element's."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _BlockProxy(nn.Module):
    """Stands in the model's block sequence for block ``index``; the real block is not a submodule,
    its parameters are listed as the stand-in's (by their names in the block)."""

    def __init__(self, forward: Callable[[int, tuple, dict], Any], index: int, real: nn.Module):
        super().__init__()
        self._streamed_forward = forward
        self.index = index
        self._set_real_mode = real.train  # a bound method: the real block stays out of the module tree
        self.__dict__["_real"] = real  # (not a submodule either)
        self.__dict__["_frozen"] = [n for n, p in real.named_parameters() if not p.requires_grad]  # (when built)
        self.training = real.training

    @property
    def __class__(self):
        """The real block's class: code that finds the blocks by class (``isinstance``; Hugging
        Face puts its ``output_hidden_states`` hooks on the decoder layers so) finds the stand-ins,
        whose inputs and outputs are the ones the model's forward sees. (``type()`` is the stand-in's.)"""
        real = self.__dict__.get("_real")
        return _BlockProxy if real is None else type(real)

    def __getattr__(self, name: str):
        """An attribute the stand-in does not have is the real block's: a model's forward may read
        its blocks' (``nn.TransformerEncoder`` reads ``layers[0].self_attn.batch_first``, Gemma a
        layer's ``self_attn.is_kv_shared_layer``). Its parameters read so are placeholders that
        refuse reads of their values: those live in the store (``engine.named_parameters()``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("_real")
            if real is None or name.startswith("__"):
                raise
            return getattr(real, name)

    def __reduce_ex__(self, protocol):
        """A copy (``copy.deepcopy(model)`` for an EMA or a frozen reference, ``torch.save(model)``)
        would hold stand-ins that run the engine's current weights: not a copy. Refused."""
        raise TensorStateError(
            f"copying or pickling a model the engine streams (block {self.index} is a stand-in that runs the engine's "
            f"current weights, so a copy would not be one): save the weights with engine.export_safetensors(DIR) and "
            f"load them into a model of its own (from_pretrained(DIR)), or build a second engine with init_from=DIR")

    def requires_grad_(self, requires_grad: bool = True) -> "_BlockProxy":
        """Freezing the block mid-run (and unfreezing it again) reaches its parameters, as PyTorch's
        does; unfreezing one frozen when the engine was built is refused at once (as at a forward:
        :func:`~tiered_offload.engine.parameter_guard.check_requires_grad`)."""
        frozen = self.__dict__["_frozen"]
        if requires_grad and frozen:
            raise ConfigError(f"requires_grad_(True) on streamed block {self.index}, whose {frozen[0]} was frozen when "
                              f"the engine was built: the engine laid out gradients and optimizer states without it. "
                              f"Freezing mid-run works: to unfreeze it later (gradual unfreezing), build the engine with it "
                              f"trainable and freeze it before the first step. Else export (engine.export_safetensors), "
                              f"set requires_grad on a new model, and build a new engine with init_from")
        self.__dict__["_real"].requires_grad_(requires_grad)
        return self

    def train(self, mode: bool = True) -> "_BlockProxy":
        """``model.train()`` / ``model.eval()`` reach the real block (dropout, batch norm), as in PyTorch."""
        super().train(mode)
        self._set_real_mode(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> "_BlockProxy":
        """``model.apply(fn)`` reaches the real block and its modules, in PyTorch's order (dropout
        turned off, an attribute set, for the block's next forward). The stand-in keeps the block
        out of the tree for walks like ``model.modules()``: Hugging Face hooks the modules found so."""
        self.__dict__["_real"].apply(fn)
        return self

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """The stand-in where the block is, then the modules inside the real block under their names
        in the model, as PyTorch's walk gives them: ``model.modules()`` reaches a block's dropout
        (TRL's ``disable_dropout_in_model``), its attention modules (a hook registered on each). The
        block stays out of ``children()`` (``state_dict``, ``to``), whose tensors live in the store."""
        yield from super().named_modules(memo, prefix, remove_duplicate)
        real = self.__dict__["_real"]
        for name, module in real.named_modules(memo, prefix, remove_duplicate):
            if module is not real:
                yield name, module

    def forward(self, *args, **kwargs):
        return self._streamed_forward(self.index, args, kwargs)

    def extra_repr(self) -> str:
        return f"streamed block {self.index}"


class ModelBinding:
    """The user's model as the engine streams it: split into units whose parameters are slots in
    flat buffers, meta parameters made real (and empty: their values live in the store), blocks
    replaced by proxies, buffers on the device. No store and no streaming here.

    Args:
        model: the user's model (possibly built with :func:`empty_init`).
        blocks: dotted name of the block sequence, or None to find it.
        device: where compute runs (buffers and placeholders live there).
    """

    def __init__(self, model: nn.Module, blocks: str | None, device: torch.device, stream_modules_numel: int | None = 0):
        if any(isinstance(m, _BlockProxy) for m in model.modules()):
            raise ConfigError(
                f"an engine already streams this {type(model).__name__} (its blocks are that engine's stand-ins, its "
                f"weights in that engine's store): build the new engine from a fresh model: the same class built "
                f"again (under empty_init) with init_from=DIR after engine.export_safetensors(DIR), or "
                f"Engine.resume(storage, fresh_model) to continue that engine's training state")
        self.model = model
        self.device = device
        self.seq_name, self.blocks, self.rest, self.param_order = plan_units(model, blocks, stream_modules_numel)
        _refuse_compiled_holders(model, self.seq_name, self.blocks)
        prepare_peft_model(model)
        check_grad_hooks(self)
        wide = [s for _, s in self.param_order if s.param.dtype == torch.float64 or s.param.dtype.is_complex]
        if wide:
            raise ConfigError(
                f"{wide[0].name} is {str(wide[0].param.dtype).removeprefix('torch.')}"
                + (f" (and {len(wide) - 1} more parameters)" if len(wide) > 1 else "")
                + ": the engine's training state is fp32, which would drop precision (or a complex number's imaginary "
                  "part) silently. Call model.float() before building the engine to train it in float32")
        others = sorted({str(s.param.dtype).removeprefix("torch.") for _, s in self.param_order
                         if s.param.dtype != torch.float32})
        if others:  # (a Hugging Face config with torch_dtype bfloat16 builds such a model)
            logging.getLogger("tiered_offload").info(
                "tiered-offload: the model's %s parameters are trained as float32 (the engine's training state is "
                "fp32): the same numbers as PyTorch trains after model.float()", "/".join(others))
        self.units: list[Unit] = [*self.blocks, self.rest]
        self._rest_modules: list[nn.Module] | None = None
        """The model's modules outside the blocks (see :meth:`snapshot_buffers`)."""
        self.model_config = model_config(model)
        """The model's Hugging Face configuration as JSON (for config.json beside an export), or None."""
        self.base_config = config_json(model.get_base_model()) if peft_adapter_name(model) is not None else None
        """A PEFT model's base model's configuration, as it was before the engine turned its key/value
        cache off (for a merged export's config.json), or None."""
        self.buffers: list[tuple[str, nn.Module, str, bool]] = []
        """``(name, module, attribute, persistent)`` of every buffer, once the proxies are in place."""
        self.recorded: RecordedOutputs | None = None
        """Hugging Face's outputs recorded inside the blocks (router logits...), once the proxies are in place."""

    def signature(self, spec, param_groups: list[dict]) -> dict:
        """What every rank must build alike (compared across ranks at start): units, parameters,
        the optimizer, its state kinds and groups, the device type."""
        return {"units": [(u.name, u.numel, u.grad_numel, u.state_numel) for u in self.units],
                "params": [(s.name, list(s.shape), s.requires_grad, s.group) for _, s in self.param_order],
                "optimizer": spec.cls.__name__, "kinds": list(spec.kinds),
                "groups": [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in param_groups],
                "device": self.device.type}

    def arrange(self, group_of: dict[int, int], piece_numel: int, whole_params: bool = False) -> None:
        """Lay every unit's parameters out for the optimizer's groups (see :meth:`Unit.arrange`)."""
        for unit in self.units:
            unit.piece_numel = piece_numel
            unit.arrange(group_of, whole_params)

    @property
    def on_meta(self) -> bool:
        return any(p.device.type == "meta" for p in self.model.parameters())

    def release_parameters(self) -> None:
        """The store holds the weights now: parameters become placeholders (real, not meta)."""
        if self.on_meta:
            self.replace_meta_parameters()
        for unit in self.units:
            for slot in unit.params:
                self.hold_placeholder(slot)
        self.move_buffers()

    def hold_placeholder(self, slot: ParamSlot) -> None:
        """``slot``'s parameter gives up its weights (they are in the store): it holds a placeholder
        of its shape, refuses reads of its values (:func:`~tiered_offload.engine.parameter_guard.unbind`),
        and its ``.grad`` is a :class:`GradInStore`."""
        slot.param.grad = None
        slot.param.data = slot.held = self.placeholder(slot.shape)
        slot.version = slot.param._version
        unbind(slot.param, slot.name)
        self.grad_in_store(slot)

    def param_names(self) -> dict[int, str]:
        """Each parameter's name by the ``id`` of its ``nn.Parameter`` (for messages)."""
        return {id(slot.param): slot.name for unit in self.units for slot in unit.params}

    def hold_weights(self, slot: ParamSlot, weights: torch.Tensor) -> None:
        """``slot``'s parameter holds ``weights`` (a view of its unit's buffer) until :meth:`hold_placeholder`."""
        bind(slot.param)
        slot.param.data = weights

    def check_call(self, *kwargs: dict) -> None:
        """Before a forward with keyword arguments ``kwargs`` (one dict per call): what user code
        did to the parameters since the last call is allowed (:mod:`~tiered_offload.engine.parameter_guard`:
        no parameter frozen at build unfrozen, no post-accumulate hook on a block's, no weight
        changed, no parameter added), and no output recorded inside the blocks is asked for that
        this transformers version records out of reach (:meth:`RecordedOutputs.check`)."""
        with torch._C.DisableTorchFunctionSubclass():  # (the placeholders' metadata read plainly: 4 ms a
            check_requires_grad(self)                   # forward on 32 layers through their __torch_function__)
            check_grad_hooks(self)
            check_untouched(self, self.blocks)
            check_no_new_parameters(self)
        for k in kwargs:
            self.recorded.check(k)

    def grad_in_store(self, slot: ParamSlot) -> None:
        """Between the engine's calls a trainable parameter's ``.grad`` is a :class:`GradInStore`
        (the parameter holds its placeholder): code that uses it (``clip_grad_norm_`` over
        ``model.parameters()``, a gradient norm for a log) gets an error that says where it is."""
        if slot.requires_grad:
            slot.param.grad = torch.Tensor._make_subclass(GradInStore, self.placeholder(slot.shape))

    def placeholder(self, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """What an unbound parameter holds (its real value lives in the store): :func:`placeholder`."""
        return placeholder(shape, torch.float32, self.device)

    def replace_meta_parameters(self) -> None:
        """Swap meta parameters for real (empty) ones: a meta tensor's data cannot be rebound later."""
        new: dict[int, nn.Parameter] = {}
        for unit in self.units:
            for slot in unit.params:
                p = new[id(slot.param)] = nn.Parameter(self.placeholder(slot.shape), requires_grad=slot.param.requires_grad)
                if slot.param._backward_hooks:  # the user's gradient hooks stay theirs (the same dict: their
                    p._backward_hooks = slot.param._backward_hooks  # handles still remove them)
        for module in [self.model, *(u.module for u in self.blocks)]:
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if p is not None and id(p) in new:
                        sub._parameters[name] = new[id(p)]
        for unit in self.units:
            for slot in unit.params:
                slot.param = new[id(slot.param)]

    def initialiser(self) -> Callable[[nn.Module], None]:
        """How a module of an ``empty_init()`` model is initialised: the model's own ``_init_weights``
        (Hugging Face) or each module's ``reset_parameters``; a PEFT adapter's as PEFT does."""
        hf_init = getattr(self.model, "_init_weights", None)

        def reset(module: nn.Module) -> None:
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        own = hf_init if callable(hf_init) else reset
        adapters = adapter_initialisers([self.model, *(u.module for u in self.blocks)],
                                        getattr(self.model, "peft_config", None))
        return (lambda module: adapters.get(id(module), own)(module)) if adapters else own

    def initialise_unit(self, unit: Unit, flat: torch.Tensor, init: Callable[[nn.Module], None],
                        only: set[str] | None = None) -> None:
        """Materialise the unit's modules on the CPU one at a time, initialise them, copy into ``flat``
        (``only``: the parameters of these names, the others read from a file)."""
        # A tied parameter is initialised by the module that registered it first (the name
        # named_parameters() reports), as when the model is built eagerly and then tied.
        by_name = {(s.local_name if unit.module is not None else s.name): s for s in unit.params
                   if only is None or s.name in only}
        root = unit.module if unit.module is not None else self.model
        inside = set()
        if unit.module is None:  # the rest: skip modules inside the block sequence
            inside = {id(m) for u in self.blocks for m in u.module.modules()}
        for qual, m in _post_order(root):
            if id(m) in inside:
                continue
            mine = [(n, by_name[f"{qual}.{n}" if qual else n]) for n, _ in m.named_parameters(recurse=False)
                    if (f"{qual}.{n}" if qual else n) in by_name]
            if not mine:
                continue
            for n, slot in mine:  # a real tensor for the initialiser to fill; NaN shows what it missed
                m._parameters[n] = nn.Parameter(torch.full(slot.shape, math.nan), requires_grad=slot.param.requires_grad)
            init(m)
            for n, slot in mine:
                value = m._parameters[n].detach()
                if torch.isnan(value).any():
                    raise ModelStructureError(
                        f"parameter {slot.name!r} ({type(m).__name__}) has no initialiser: neither reset_parameters() "
                        f"nor the model's _init_weights set it. " + ("A PEFT adapter's start on the meta device is "
                        "known for LoRA only: start this one from a saved adapter, init_from=[BASE, ADAPTER], or build "
                        "the model on the CPU" if hasattr(self.model, "peft_config") else "Build the model on the CPU "
                        "instead of the meta device, or give the module a reset_parameters()"))
                flat[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1))
                m._parameters[n] = slot.param  # back to the meta parameter the unit tracks

    def move_buffers(self) -> None:
        for module in [*(u.module for u in self.blocks), self.model]:
            for sub in module.modules():
                for name, buf in list(sub._buffers.items()):
                    if buf is not None and buf.device != self.device:
                        if buf.device.type == "meta":
                            raise ModelStructureError(
                                f"buffer {name!r} of {type(sub).__name__} is on the meta device, so its value is lost; "
                                f"build the model with tiered_offload.empty_init() (buffers stay real) instead of "
                                f"torch.device('meta')")
                        sub._buffers[name] = buf.to(self.device)

    def buffer_slots(self) -> list[tuple[str, nn.Module, str, bool]]:
        """``(name, module, attribute, persistent)`` of every module buffer, blocks included, under
        the name ``model.named_buffers()`` gives it (call once the proxies are in place)."""
        out, seen = [], set()
        roots = [("", self.model), *((u.qualname, u.module) for u in self.blocks)]
        for prefix, root in roots:
            for mname, mod in root.named_modules():
                for bname, buf in mod._buffers.items():
                    if buf is None or id(buf) in seen:
                        continue
                    seen.add(id(buf))
                    full = ".".join(x for x in (prefix, mname, bname) if x)
                    out.append((full, mod, bname, bname not in mod._non_persistent_buffers_set))
        return out

    def generator_slots(self) -> list[tuple[str, torch.Generator]]:
        """``(name, generator)`` of every ``torch.Generator`` the model holds: a module's attribute
        (``blocks.0.gen``), or a variable a function attribute closes over (``blocks.0.draw.g``),
        the module named as ``model.named_modules()`` names it; one held twice, by its first name
        (call once the proxies are in place)."""
        out, seen = [], set()
        roots = [("", self.model), *((u.qualname, u.module) for u in self.blocks)]
        for prefix, root in roots:
            for mname, mod in root.named_modules():
                for attr, value in vars(mod).items():
                    for name, g in [(attr, value), *closed_over(attr, value)]:
                        if isinstance(g, torch.Generator) and id(g) not in seen:
                            seen.add(id(g))
                            out.append((".".join(x for x in (prefix, mname, name) if x), g))
        return out

    def snapshot_buffers(self, unit: Unit | None) -> list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor]]:
        """The buffers a block's forward may change, before it (to replay the forward exactly in
        backward): its own (``unit``'s; None: none), and those of the modules outside the blocks (a
        module the block is given, whose running statistics it updates: its recompute must not
        update them again, and ``forward_backward`` runs the loop)."""
        own = [*unit.module.modules()] if unit is not None else []
        return [(mod, name, buf, buf._version, buf.clone()) for mod in [*own, *self.rest_modules()]
                for name, buf in mod._buffers.items() if buf is not None]

    def rest_modules(self) -> list[nn.Module]:
        """The model's modules outside the blocks (call once the proxies are in place)."""
        if self._rest_modules is None:
            inside = {id(m) for u in self.blocks for m in u.module.modules()}
            self._rest_modules = [m for m in self.model.modules() if id(m) not in inside]
        return self._rest_modules

    @staticmethod
    def changed_buffers(snapshot) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Of a snapshot, the buffers the forward changed (in place or by assignment), with their old values."""
        # kernels that update running statistics do not always bump the version counter: compare
        return [(mod, name, old) for mod, name, buf, version, old in snapshot
                if mod._buffers.get(name) is not buf or buf._version != version or not torch.equal(buf, old)]

    @contextlib.contextmanager
    def real_blocks(self):
        """The real blocks in the model's tree instead of their stand-ins, and ``state_dict()``
        names only (its values are placeholders), for code that walks the model's modules for
        their names: peft's ``get_peft_model_state_dict`` (``checkpoint/adapter.py``)."""
        swapped = []
        try:
            for unit in self.blocks:
                parent_name, _, attr = unit.qualname.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                swapped.append((parent, attr, parent._modules[attr]))
                parent._modules[attr] = unit.module
            with state_dict_names_only():
                yield
        finally:
            for parent, attr, proxy in reversed(swapped):
                parent._modules[attr] = proxy

    def install_proxies(self, forward: Callable[[int, tuple, dict], Any],
                        zero_grad: Callable[..., None] | None = None) -> None:
        """Replace each streamed module in the model by a proxy that calls ``forward(index, args, kwargs)``;
        the model's ``zero_grad`` becomes ``zero_grad`` (the engine's: the gradients live in the store, so
        the module's own would forget nothing)."""
        if zero_grad is not None:
            def model_zero_grad(set_to_none: bool = True) -> None:  # a function: a deep copy shares it
                zero_grad(set_to_none)
            self.model.zero_grad = model_zero_grad
        refuse_resizing(self.model)
        for module in self.model.modules():
            module.register_state_dict_pre_hook(weights_in_store)
            module.register_load_state_dict_pre_hook(weights_into_store)
        for unit in self.blocks:
            parent_name, _, attr = unit.qualname.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            proxy = parent._modules[attr] = _BlockProxy(forward, unit.index, unit.module)
            # the block's parameters, listed where the block was (model.parameters(), a count):
            # placeholders of their shapes whose values are the store's (parameter_guard.unbind)
            proxy._parameters.update(unit.module.named_parameters())
        _forget_output_capture(self.model, self.blocks)
        warn_of_forward_hooks(self.blocks)
        self.recorded = RecordedOutputs(self.model, [u.module for u in self.blocks])  # (hooks of its own)
        for module in self.model.modules():  # an encoder-decoder's stacks have configs of their own
            cfg = getattr(module, "config", None)
            if cfg is not None and getattr(cfg, "use_cache", False):
                cfg.use_cache = False  # key/value caches are for generation; training does not need them


def _forget_output_capture(model: nn.Module, blocks: list[Unit]) -> None:
    """Hugging Face's output-capturing hooks, where the model was asked for recorded outputs
    before the engine: those on the real blocks would record the engine's inner forward. They go,
    and the model is marked unhooked: its next such call puts them on the stand-ins."""
    for m in (*model.modules(), *(x for u in blocks for x in u.module.modules())):
        for hook_id, hook in list(m._forward_hooks.items()):
            if getattr(hook, "__name__", "") == "output_capturing_hook":
                del m._forward_hooks[hook_id]
        if getattr(m, "_output_capturing_hooks_installed", False):
            m._output_capturing_hooks_installed = False


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` children first: the order ``module.apply`` initialises in."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module
