"""The run configuration of ``tiered-offload train``: flat sections (model, data, train, offload,
output, lora), each a keyword-only dataclass with a docstring under every field, read from YAML and
``section.key=value`` overrides; an unknown key or a bad value is a :class:`ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from offload_core.errors import ConfigError
from offload_core.sizes import parse_size
from tiered_offload.config import check_field_kinds

__all__ = ["ModelSection", "DataSection", "TrainSection", "OffloadSection", "OutputSection", "LoraSection",
           "RunConfig", "load_config", "lr_factor"]


def lr_factor(step: int, total: int, warmup: int, schedule: str, floor: float = 0.0) -> float:
    """The learning rate of step ``step`` (0-based) as a share of the peak: a linear warm-up from 0,
    then the schedule's decay from the peak to ``floor`` (``train.min_lr`` as a share of it)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        decay = max(0.0, 1.0 - progress)
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return floor + (1 - floor) * decay if floor else decay


@dataclass(kw_only=True)
class ModelSection:
    path: str = ""
    """A local Hugging Face directory: config.json, safetensors weights (one file or shards with an
    index; else PyTorch's ``pytorch_model.bin``, or its shards with an index), tokenizer files; or a
    Hugging Face Hub id (``owner/name``, or ``hf://owner/name``),
    read through huggingface_hub's cache as ``from_pretrained`` reads it (downloaded there if
    missing); ``owner/name@REVISION`` pins a commit, branch or tag (a LoRA adapter records it)."""
    blocks: str | None = None
    """Dotted name of the block sequence, where the engine cannot find it (``model.layers``)."""


@dataclass(kw_only=True)
class DataSection:
    path: str = ""
    """The training data: a ``.txt`` file (``format: text``), a ``.jsonl`` file (one JSON object a
    line), a ``.json`` file holding an array of them, or a ``.parquet`` file (a row an example, its
    columns the keys; needs ``pip install pyarrow``); or a directory of such files, or a glob (a
    dataset's shards, read in name order as one corpus); or ``hf://datasets/OWNER/NAME/PATH`` (a
    Hugging Face Hub dataset's files, PATH a file or a glob; ``NAME@REVISION``), read through
    huggingface_hub's cache."""
    format: str = "completion"
    """``text`` (plain text, the loss on every token), ``completion`` (.jsonl, the loss on ``field``'s
    tokens), ``prompt-completion`` (.jsonl with prompt / completion, TRL's layout without a
    template: the loss on the completion only), ``alpaca`` (.jsonl with instruction / input /
    output: the loss on the output only), ``chat`` (.jsonl with ``messages``: role / content, or
    ShareGPT's ``conversations``: from human / gpt / system, value; rendered with the tokenizer's
    chat template; the loss on the assistant's turns only, found by rendering each conversation up
    to them, or by the template's ``{% generation %}`` marks; an agent's turns too: ``tool_calls``,
    role ``tool``, and the row's ``tools`` schemas, passed to the template as they are)."""
    field: str = "text"
    """The JSON field holding the text (``completion``)."""
    chat_turns: str = "all"
    """``chat``: ``all`` (an example a conversation, the loss on every assistant turn) or ``each``
    (an example per assistant turn: the conversation up to it, the loss on that turn only, the
    earlier turns rendered as the template renders history; for a template that rewrites earlier
    turns, as Qwen3's drops their reasoning, and has no ``{% generation %}`` marks); ``eval_fraction``
    then holds out whole conversations."""
    max_seq_len: int = 512
    """Tokens per training sequence (at most the model's positions). A sequence left with no token
    the loss is on (a prompt longer than it, a chat example without an assistant turn) trains
    nothing and is left out, with a warning that says how many; data with none is refused."""
    packing: bool | str = True
    """Concatenate examples (each ended by the tokenizer's EOS) into full sequences, cut where full;
    ``documents``: each example whole in one sequence (best fit), attending to itself only (position
    ids from 0 per example; a model whose attention ignores them is refused); off: one example a
    sequence, truncated or padded."""
    eval_fraction: float = 0.0
    """The share of examples held out for evaluation (0: none), the last ones of the file(s)."""
    eval_path: str | None = None
    """Separate evaluation data (instead of ``eval_fraction``), in the same format: a file, a directory or a glob."""


@dataclass(kw_only=True)
class TrainSection:
    micro_batch: int = 4
    """Sequences per forward and backward (of each rank, under torchrun)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (of each rank, under torchrun: a step trains ``micro_batch *
    grad_accum * ranks`` sequences)."""
    average: str = "tokens"
    """The step's loss: ``tokens``, the mean over every token the loss is on in the step's
    micro-batches (and ranks), so that ``micro_batch x grad_accum`` trains the gradient of one batch
    of them all (Hugging Face's Trainer since 4.46); ``micro_batches``, the mean of the micro-batches'
    own means (a micro-batch of few such tokens weighs as much as one of many; a run begun before
    this setting keeps it). The same where every micro-batch holds as many (packed plain text)."""
    max_steps: int | None = None
    """Optimizer steps to train (or ``epochs``)."""
    epochs: float | None = None
    """Passes over the training data (when ``max_steps`` is not given)."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    schedule: str = "cosine"
    """``constant``, ``linear`` (to 0) or ``cosine`` (to 0), after ``warmup_steps`` of linear warm-up."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""
    min_lr: float = 0.0
    """The learning rate a ``linear`` or ``cosine`` schedule ends at (0: it decays to zero; a tenth of
    ``lr`` is a common floor)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on matrices only (biases and norms are not decayed)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's ``(beta1, beta2)``: the decay rates of its running mean of the gradients and of their
    squares (``[0.9, 0.95]`` is common for large language models)."""
    eps: float = 1e-8
    """AdamW's ``eps``, added to the denominator."""
    clip: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping). With snapshot commits
    (``offload.commit_every >= 2``, or a state the host budget holds) a step runs in the backward
    (``forward_backward(..., step=True)``, the same numbers, no gradient written to the disk):
    without clipping each one; with it, as ``clip_in_backward`` says."""
    clip_in_backward: bool | float = True
    """With clipping and snapshot commits: which steps are tried in the backward, clipped exactly
    (``clip_norm``). ``true``: each (the engine keeps one out of it where its norm, predicted at the
    top of the backward, would be over ``clip``; a run's first, to learn the prediction, which each
    commit keeps); a number: after a step whose gradient norm was at most this share of ``clip``;
    ``false`` or 0: never. Within the limit that is the clipped step, bitwise; a norm found over it
    there tears the step, which runs again from the last commit, after the backward
    (:mod:`tiered_offload.train.steps`: only steps a tear would run at most 4 again are tried, the
    first after each commit)."""
    seed: int = 0
    """Seeds the data order and everything random in training."""
    precision: str = "fp32"
    """``fp32``: the state and the compute in fp32. ``bf16-autocast``: the forward (and so the
    backward) computes under ``torch.autocast`` in bfloat16 where PyTorch's autocast does
    (matrix products), the state (weights, gradients, Adam moments) stays fp32; the engine
    recomputes a block in the autocast its forward ran in, so the run equals PyTorch's own
    autocast training bitwise."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end, when there is evaluation data)."""

    def unfinished_warmup(self, total: int) -> str | None:
        """What to warn of where the warm-up does not end inside the run's ``total`` steps (a
        warm-up set for a long run, kept for a short one): the learning rate never reaches ``lr``."""
        if self.warmup_steps < total:
            return None
        last = self.lr * lr_factor(total - 1, total, self.warmup_steps, self.schedule, self.min_lr / self.lr)
        return (f"train.warmup_steps {self.warmup_steps} is not below the run's {total} steps: the learning rate "
                f"never reaches train.lr {self.lr:g} (the last step's is {last:.3g}); lower train.warmup_steps")


    def rewarmed(self, was: float | None, now: float, start: int, total: int, changed: list[str]) -> str | None:
        """What to warn of where a resume's schedule, drawn over a longer run, raises the learning
        rate past twice the last step's ``was`` (a finished cosine warmed again): not in the
        warm-up, nor where the command changed ``train.lr`` itself (named already)."""
        if was is None or now <= 2 * was or start < self.warmup_steps or self.schedule == "constant" or any(
                c.startswith("train.lr ") for c in changed):
            return None
        return (f"the learning rate rises from {was:.3g} at step {start} to {now:.3g} at step {start + 1}: the "
                f"{self.schedule} schedule is drawn over the run's {total} steps, more than before; to go on at the "
                f"rate reached, set train.lr {was:.3g} and train.schedule constant")


@dataclass(kw_only=True)
class OffloadSection:
    storage: str | list[str] = ""
    """The storage directory (or several, striped): it is the checkpoint; the same command again
    resumes from it."""
    host_memory: str | int = "auto"
    """Host budget (``4GiB``); ``auto``: a quarter of the available memory (cgroup-aware)."""
    device_memory: str | int = "auto"
    """Device budget on a GPU (``auto``: half the free memory)."""
    durable: bool = True
    """Keep the storage directory a committed, resumable state (required for resuming)."""
    commit_every: int = 1
    """Commit every this many steps (a crash loses at most this many - 1)."""
    backend: str | None = None
    """A storage backend name (``posix``, ``kvikio``, ``aiofiles``...; None: the default)."""
    stripe_weights: list[int] | None = None
    """With several ``storage`` directories on drives of unequal speed: the stripes each takes of
    every ``sum`` of them (``[3, 1]``: what ``tiered-offload bench-io`` advises); None: even. Part of
    the state's layout: the same on every resume."""


@dataclass(kw_only=True)
class LoraSection:
    r: int = 0
    """LoRA's rank (PEFT's ``LoraConfig.r``); 0: no LoRA, every parameter trains. With LoRA the
    model's weights stay frozen (4 bytes a parameter of state, streamed as the rest), only the
    adapter trains, and the exports hold the adapter alone, for ``PeftModel.from_pretrained``."""
    alpha: float = 16.0
    """LoRA's scaling numerator (``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (``lora_dropout``)."""
    targets: str | list[str] = "all-linear"
    """The modules that get an adapter (``target_modules``): names (``[q_proj, v_proj]``) or
    ``all-linear`` (every linear layer but the head; on an MoE not its router and stacked experts,
    which ``parameters`` names: the log names them)."""
    parameters: list[str] | None = None
    """Parameters that get an adapter of their own (PEFT's ``target_parameters``): an MoE's stacked
    experts, ``[mlp.experts.gate_up_proj, mlp.experts.down_proj]``. PEFT's LoRA on a parameter
    takes no ``dropout`` and no ``dora``."""
    modules_to_save: list[str] | None = None
    """Modules trained in full beside the adapter and saved with it (``[lm_head]``)."""
    dora: bool = False
    """DoRA (PEFT's ``use_dora``): a magnitude per output row beside the adapter, started from the
    pretrained weights' norms."""
    merged: bool = False
    """The exports hold the model with the adapter merged into its weights (PEFT's
    ``merge_and_unload()``: the base model's names and ``config.json``, for ``from_pretrained``
    without PEFT) instead of the adapter alone."""
    adapter: str | None = None
    """Start the adapter from one ``PeftModel.save_pretrained`` wrote (an earlier run's export:
    SFT's adapter for a second stage) instead of PEFT's initialisation; the settings above must be
    those it was trained with (its ``adapter_config.json``; a difference is refused, named)."""


@dataclass(kw_only=True)
class OutputSection:
    dir: str = "./out"
    """Where exports (``step-N/``, ``final/``) and ``metrics.jsonl`` go."""
    export_every: int = 0
    """Export every this many steps (0: only the final export)."""
    keep: int = 2
    """How many ``step-N`` exports to keep (the oldest go)."""
    dtype: str = "fp32"
    """The exported weights' dtype: ``fp32`` (as trained), ``bf16`` or ``fp16`` (half the files; what
    is mostly served), cast from the fp32 state as ``model.to(dtype)`` casts."""
    overwrite: bool = False
    """Start a new run in an output.dir that holds an earlier run's outputs (``metrics.jsonl``
    records, ``final/``, ``step-N/``) though ``offload.storage`` holds no state to continue: its
    records are dropped at the first step, and its exports replaced where this run writes the same
    (its other ``step-N/`` stay). Without it, refused."""


@dataclass(kw_only=True)
class RunConfig:
    """A whole run: what each section holds is documented on its fields."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    offload: OffloadSection = field(default_factory=OffloadSection)
    output: OutputSection = field(default_factory=OutputSection)
    lora: LoraSection = field(default_factory=LoraSection)

    def validate(self) -> "RunConfig":
        """Check every value; a :class:`ConfigError` names the key and what to change."""
        need = [("model.path", self.model.path), ("data.path", self.data.path), ("offload.storage", self.offload.storage),
                ("output.dir", self.output.dir)]  # (output.dir= wrote final/ and metrics.jsonl where the command ran)
        for key, value in need:
            if not value:
                raise ConfigError(f"{key} is required")
        listed = self.offload.storage if isinstance(self.offload.storage, list) else []
        if any(not isinstance(d, str) or "," in d or not d for d in listed):  # (joined by commas: split again)
            raise ConfigError(f"offload.storage: each directory of the list must be a path without a comma (a comma "
                              f"separates striped directories), got {listed!r}")
        if isinstance(self.offload.storage, str):  # (a comma in one directory's name: refused before anything runs)
            from storage_backends import check_stripes_named, parse_spec
            try:
                check_stripes_named(self.offload.storage, parse_spec(self.offload.storage)[1] or self.offload.storage,
                                    warn=False)
            except ConfigError as e:
                raise ConfigError(f"offload.{e}") from None
        _check_stripe_weights_of(self.offload)
        _choice("data.format", self.data.format, ("text", "completion", "prompt-completion", "alpaca", "chat"))
        _choice("data.chat_turns", self.data.chat_turns, ("all", "each"))
        if self.data.chat_turns != "all" and self.data.format != "chat":
            raise ConfigError(f"data.chat_turns applies to data.format chat, not {self.data.format}; drop it")
        _choice("train.schedule", self.train.schedule, ("constant", "linear", "cosine"))
        _choice("train.average", self.train.average, ("tokens", "micro_batches"))
        _choice("train.precision", self.train.precision, ("fp32", "bf16-autocast"))
        _choice("output.dtype", self.output.dtype, ("fp32", "bf16", "fp16"))
        for key, value, lo in (("data.max_seq_len", self.data.max_seq_len, 2), ("train.micro_batch", self.train.micro_batch, 1),
                               ("train.grad_accum", self.train.grad_accum, 1), ("train.warmup_steps", self.train.warmup_steps, 0),
                               ("train.eval_every", self.train.eval_every, 0), ("offload.commit_every", self.offload.commit_every, 1),
                               ("output.export_every", self.output.export_every, 0), ("output.keep", self.output.keep, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ConfigError(f"{key} must be an integer >= {lo}, got {value!r}")
        if self.train.max_steps is None and self.train.epochs is None:
            raise ConfigError("train.max_steps or train.epochs is required")
        if self.train.max_steps is not None and (not isinstance(self.train.max_steps, int) or self.train.max_steps < 1):
            raise ConfigError(f"train.max_steps must be an integer >= 1, got {self.train.max_steps!r}")
        for key, value in (("train.lr", self.train.lr), ("train.weight_decay", self.train.weight_decay),
                           ("train.min_lr", self.train.min_lr), ("train.eps", self.train.eps),
                           ("data.eval_fraction", self.data.eval_fraction)):
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    raise ConfigError(f"{key} must be a number, got {value!r}") from None
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{key} must be a number, got {value!r}")
        t = self.train
        t.lr, t.weight_decay, t.min_lr, t.eps = float(t.lr), float(t.weight_decay), float(t.min_lr), float(t.eps)
        self.data.eval_fraction = float(self.data.eval_fraction)
        if not 0 < t.lr < math.inf:
            raise ConfigError(f"train.lr must be a finite number > 0, got {t.lr!r}")
        if not 0 <= t.weight_decay < math.inf:  # (torch's AdamW refuses one below 0 at the engine's construction)
            raise ConfigError(f"train.weight_decay must be a finite number >= 0, got {t.weight_decay!r}")
        if not 0 <= t.min_lr <= t.lr:
            raise ConfigError(f"train.min_lr must be in [0, train.lr {t.lr}], got {t.min_lr!r}")
        if not 0 < t.eps < math.inf:
            raise ConfigError(f"train.eps must be a finite number > 0, got {t.eps!r}")
        if not (isinstance(t.betas, list) and len(t.betas) == 2 and all(_number(b) and 0 <= b < 1 for b in t.betas)):
            raise ConfigError(f"train.betas must be two numbers in [0, 1) ([beta1, beta2]), got {t.betas!r}")
        t.betas = [float(b) for b in t.betas]
        if not 0 <= self.data.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction!r}")
        if self.train.clip is not None and not (_number(self.train.clip) and 0 < self.train.clip < math.inf):
            raise ConfigError(f"train.clip must be a finite number > 0 or null (no clipping), got {self.train.clip!r}")
        if not (isinstance(t.clip_in_backward, bool) or _number(t.clip_in_backward) and
                0 <= t.clip_in_backward < math.inf):
            raise ConfigError(f"train.clip_in_backward must be true (each clipped step tried in the backward), false "
                              f"(never) or a finite number >= 0 (a step tried after one whose norm was at most that "
                              f"share of train.clip; 0: never), got {t.clip_in_backward!r}")
        if not isinstance(self.lora.r, int) or isinstance(self.lora.r, bool) or self.lora.r < 0:
            raise ConfigError(f"lora.r must be an integer >= 0 (0: no LoRA), got {self.lora.r!r}")
        if not (isinstance(self.lora.dropout, (int, float)) and 0 <= self.lora.dropout < 1):
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.lora.dropout!r}")
        if not (_number(self.lora.alpha) and 0 < self.lora.alpha < math.inf):
            raise ConfigError(f"lora.alpha must be a finite number > 0, got {self.lora.alpha!r}")
        for key, value, none_ok in (("lora.targets", self.lora.targets, False),
                                    ("lora.modules_to_save", self.lora.modules_to_save, True)):
            names = [value] if isinstance(value, str) else value
            if not ((none_ok and value is None) or (isinstance(names, list) and names
                                                      and all(isinstance(n, str) and n for n in names))):
                raise ConfigError(f"{key} must be a module name, a list of them" + (" or null" if none_ok else
                                  " or all-linear") + f", got {value!r}")
        for key, budget in (("offload.host_memory", self.offload.host_memory),
                            ("offload.device_memory", self.offload.device_memory)):
            if budget != "auto":
                parse_size(budget, what=key)
        if not (isinstance(self.data.packing, bool) or self.data.packing == "documents"):
            raise ConfigError(f"data.packing must be true, false or documents, got {self.data.packing!r}")
        for key, value in (("offload.durable", self.offload.durable),
                           ("lora.merged", self.lora.merged), ("lora.dora", self.lora.dora)):
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
        if self.lora.adapter is not None:
            if not isinstance(self.lora.adapter, str) or not self.lora.adapter:
                raise ConfigError(f"lora.adapter must be a directory, got {self.lora.adapter!r}")
            if not self.lora.r:
                raise ConfigError("lora.adapter starts the adapter from a saved one, and lora.r is 0 (no LoRA): set "
                                  "lora's r, alpha and targets as that adapter was trained (its adapter_config.json)")
            if not (Path(self.lora.adapter).expanduser() / "adapter_config.json").is_file():
                raise ConfigError(f"lora.adapter {self.lora.adapter} holds no adapter_config.json: not a directory "
                                  f"PeftModel.save_pretrained wrote (a LoRA run's export with lora.merged false)")
        if self.lora.merged and not self.lora.r:
            raise ConfigError("lora.merged: true merges an adapter into the exports, and lora.r is 0 (no LoRA): set "
                              "lora.r, or drop lora.merged")
        if not self.offload.durable:
            raise ConfigError("offload.durable: false leaves nothing to resume from; the train command keeps it true")
        epochs = self.train.epochs
        if epochs is not None and not (_is_a("float", epochs) and 0 < epochs < math.inf):
            raise ConfigError(f"train.epochs must be a finite number > 0 (passes over the data), got {epochs!r}")
        if not (_is_a("int", self.train.seed) and self.train.seed >= 0):
            raise ConfigError(f"train.seed must be an integer >= 0, got {self.train.seed!r}")
        for section in dataclasses.fields(self):  # what the checks above leave: each value of its field's type
            check_field_kinds(getattr(self, section.name), _KINDS, section.name)
        if self.offload.backend is not None:  # (a spec of no backend's name is read as a directory with a colon)
            from storage_backends import available_backends
            names = available_backends()
            if self.offload.backend not in (*names, "auto"):
                raise ConfigError(f"offload.backend {self.offload.backend!r} is no storage backend here; they are "
                                  f"{', '.join(names)}, or auto (a plugin's package adds its own)")
        return self


def _check_stripe_weights_of(offload: "OffloadSection") -> None:
    """``offload.stripe_weights``: a list, one weight per directory of ``offload.storage`` (two or
    more), for a backend that stripes; a :class:`ConfigError` naming the key otherwise."""
    weights, storage = offload.stripe_weights, offload.storage
    if weights is None:
        return
    if not isinstance(weights, list):
        raise ConfigError(f"offload.stripe_weights: {weights!r} is not a list of weights, one per directory of "
                          f"offload.storage; write [3, 1] (YAML reads 3:1 unquoted as a number, base 60)")
    dirs = storage if isinstance(storage, list) else [d for d in str(storage).split(",") if d]
    if len(dirs) < 2:
        raise ConfigError(f"offload.stripe_weights: {weights} for offload.storage {storage!r}, one directory: the "
                          f"weights share each tensor's stripes among several directories; list them, or drop the key")
    if offload.backend not in (None, "posix", "kvikio", "auto"):
        raise ConfigError(f"offload.stripe_weights: offload.backend {offload.backend!r} does not stripe; use posix")
    from storage_backends.posix import stripe_weights_of
    try:
        stripe_weights_of(weights, len(dirs))
    except ConfigError as e:
        raise ConfigError(f"offload.stripe_weights: {e}") from None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS = {"str": (lambda v: isinstance(v, str), "a text"),
          "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
          "float": (_number, "a number"), "bool": (lambda v: isinstance(v, bool), "true or false"),
          "None": (lambda v: v is None, "null"),
          "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of texts"),
          "list[float]": (lambda v: isinstance(v, list) and all(_number(x) for x in v), "a list of numbers"),
          "list[int]": (lambda v: isinstance(v, list) and all(_is_a("int", x) for x in v), "a list of integers")}
"""A config field's type (its annotation's parts) -> (whether a value is of it, its name in an error)."""


def _is_a(kind: str, value) -> bool:
    return _KINDS[kind][0](value)


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(RunConfig)}


def _coerce(key: str, value: str, annotation: str):
    """A ``key=value`` override's text as the field's type: kept as text for a text field (a list
    for a field that takes one), else read as YAML (``8``, ``2.0e-5``, ``true``, ``null``)."""
    import yaml
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}={value}: not a value ({e})") from None
    if annotation.startswith("str") and not isinstance(parsed, list):
        return value
    if "float" in annotation and isinstance(parsed, str):
        try:
            return float(parsed)  # YAML 1.1 reads 2e-5 (no dot) as text
        except ValueError:
            pass
    return parsed


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """The run configuration of a YAML file (may be None: overrides only) and ``section.key=value`` overrides."""
    import yaml
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read the run configuration: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the run configuration must be a mapping of sections (model, data, train, ...)")
    sections = _section_types()
    values: dict[str, dict] = {name: {} for name in sections}
    for name, body in raw.items():
        if name not in sections:
            raise ConfigError(f"{path}: unknown section {name!r}; the sections are {', '.join(sections)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping of keys")
        values[name].update(body)
    for item in overrides:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not eq and Path(item).is_file():
            raise ConfigError(f"override {item!r} is a file, not section.key=value: give the run one YAML file, "
                              f"first or as --config")
        if not eq or not dot or section not in sections:
            raise ConfigError(f"override {item!r}: write section.key=value (sections: {', '.join(sections)})")
        annotation = {f.name: str(f.type) for f in dataclasses.fields(sections[section])}.get(name, "")
        values[section][name] = _coerce(key, value, annotation)
    built = {}
    for name, cls in sections.items():
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values[name]) - known)
        if unknown:
            raise ConfigError(f"unknown key {name}.{unknown[0]}; {name} has {', '.join(sorted(known))}")
        built[name] = cls(**values[name])
    return RunConfig(**built).validate()
