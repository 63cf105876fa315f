"""``tiered-offload train``: fine-tune a local Hugging Face model directory through the engine.

One function, :func:`train`, does the whole job: build the model without materialising it
(``empty_init``), stream its weights in (``init_from``) or resume the storage directory's
committed state (the default: the same command again continues), train with AdamW, a schedule,
clipping and gradient accumulation, evaluate, write metrics, and export Hugging Face directories
that ``from_pretrained`` loads as they are. SIGINT / SIGTERM finish the current step, commit it,
and return; the data position is the step count (a fixed, seeded order), saved with every step.
Under torchrun the ranks share the run (:mod:`tiered_offload.train.ranks`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
import re
import signal
import time
import warnings
from pathlib import Path

import torch

from offload_core.buffers import PAGE
from offload_core.errors import (CheckpointError, ClipTornError, ConfigError, NonFiniteError, StepFailedError,
                                 TieredOffloadError)
from offload_core.sizes import format_size
from tiered_offload.checkpoint import quantized
from tiered_offload.checkpoint.durable import StateFiles, state_directory
from tiered_offload.checkpoint.lock import DirectoryLock, kind_of
from tiered_offload.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, pick_weights
from tiered_offload.checkpoint.schema import check_index, parse_json
from tiered_offload.checkpoint.torch_bin import BIN_INDEX_NAME, BIN_SINGLE_NAME
from tiered_offload.engine.step_in_backward import StepInBackward
from tiered_offload.engine.train_state import KEPT_HYPERPARAMETERS
from tiered_offload.store.tiers import Tier
from tiered_offload.train.config import RunConfig, load_config, lr_factor
from tiered_offload.train.data import loss_tokens, micro_batch_rows, prepare_data
from tiered_offload.train.outputs import (check_export_space, export, export_step, metrics_from, refuse_earlier_run,
                                          refuse_inside_exports)
from tiered_offload.train.sources import first_line
from tiered_offload.train.packing import DOCUMENTS, documents_seen
from tiered_offload.train.ranks import Ranks
from tiered_offload.train.steps import ClipSpeculation, loss_average, token_weights, train_step

__all__ = ["train", "lr_factor", "hub_model"]

log = logging.getLogger("tiered_offload")

HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a Hub id's repository gives ``train`` first: the config, the weights' index, the tokenizer's
files (top level only: no ``original/`` checkpoint, no ONNX); then the weights ``from_pretrained``
reads (:func:`_hub_weights`), nothing more (not Mistral's ``consolidated.safetensors`` beside its
shards, nor ``.bin`` copies beside safetensors)."""


def _hub_weights(directory: Path) -> list[list[str]]:
    """The weight files to fetch into a Hub snapshot holding the config and the indexes, in the
    order ``from_pretrained`` tries them (the next only where the one before is not there):
    ``model.safetensors``, the shards its index names; PyTorch's likewise."""
    tries = []
    for index, single in ((INDEX_NAME, SINGLE_NAME), (BIN_INDEX_NAME, BIN_SINGLE_NAME)):
        tries.append([single])
        if (directory / index).is_file():
            data = (directory / index).read_bytes()
            weight_map = check_index(parse_json(data, directory / index), directory / index)["weight_map"]
            shards = sorted(set(weight_map.values()))
            bad = [s for s in shards if Path(s).name != s or s.startswith(".") or any(c in s for c in "*?[")]
            if bad:
                raise CheckpointError(f"{directory / index}: shard name {bad[0]!r} is not a plain file name in that "
                                      f"directory; refusing to fetch or read outside it")
            tries.append(shards)
    return tries


def _has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds the weights ``init_from`` reads: safetensors, else PyTorch's."""
    return pick_weights(directory) is not None


HUB_MODEL = re.compile(r"(?:hf://)?([\w.-]+/[\w.-]+)(?:@([\w./-]+))?")
"""A Hub model ``model.path`` names (one that is no local path): ``owner/name`` or ``hf://owner/name``,
either with ``@REVISION`` (a commit, branch or tag)."""


def hub_model(path: str) -> tuple[str, str | None] | None:
    """``(repository id, revision or None)`` of a ``model.path`` that is no local path and names a
    Hub model (:data:`HUB_MODEL`); None otherwise."""
    if Path(path).expanduser().exists():
        return None
    match = HUB_MODEL.fullmatch(str(path))
    return (match[1], match[2]) if match else None


def _model_dir(path: str, dry_run: bool = False) -> Path:
    """The local directory ``model.path`` names: a directory, or a Hugging Face Hub model
    (:data:`HUB_MODEL`) resolved through huggingface_hub's cache as ``from_pretrained`` resolves it
    (for a dry run without the weights: it reads the config and the tokenizer only)."""
    directory = Path(path).expanduser()
    hub = not directory.exists()
    if hub:
        named = hub_model(path)
        if named is None:
            raise ConfigError(f"model.path {directory} does not exist")
        repo, revision = named
        try:
            import huggingface_hub
            directory = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES,
                                                               ignore_patterns=["*/*"]))
            for files in [] if dry_run else _hub_weights(directory):  # (a dry run reads no weights)
                if not all((directory / f).is_file() for f in files):
                    directory = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=files,
                                                                       ignore_patterns=["*/*"]))
                if all((directory / f).is_file() for f in files):
                    break
        except TieredOffloadError:  # (the repository's index is damaged: named as such)
            raise
        except Exception as e:  # (no network, not cached, no such repository or revision, gated, no huggingface_hub)
            at = f" at revision {revision}" if revision else ""
            raise ConfigError(f"model.path {path} is not a local directory, and the Hugging Face Hub gave no model of "
                              f"that id{at} ({type(e).__name__}: {first_line(e)}): download it (hf download {repo}"
                              f"{f' --revision {revision}' if revision else ''}; a gated model: hf auth login first), "
                              f"or name its directory") from None
    # A file that is no file (transformers skips it: another tokenizer trained, silently; or "no config.json")
    for entry in directory.iterdir() if directory.is_dir() else ():
        if entry.is_symlink() and not entry.exists():
            raise ConfigError(f"model.path {directory}: {entry.name} is a link to {os.readlink(entry)}, which does not "
                              f"exist (a download cut short, a cache cleaned); download the model again")
        if entry.exists() and not (entry.is_file() or entry.is_dir()):
            raise ConfigError(f"model.path {directory}: {entry.name} is {kind_of(entry.stat().st_mode)}, not a file: "
                              f"the model's files are read as files (one skipped would train another tokenizer or "
                              f"model); put the file there (save the model again)")
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model.path {directory} is not a Hugging Face model directory (no config.json)")
    if not _has_weights(directory) and not (hub and dry_run):
        raise ConfigError(f"model.path {directory} holds no weights ({SINGLE_NAME}, or shards with "
                          f"{INDEX_NAME}; else {BIN_SINGLE_NAME} or {BIN_INDEX_NAME}); save the model with "
                          f"save_pretrained")
    return directory


def _storage_location(storage) -> str:
    return ",".join(str(s) for s in storage) if isinstance(storage, (list, tuple)) else str(storage)


def _config_and_tokenizer(model_dir: Path):
    """The model's config and tokenizer, as transformers reads them; what it cannot read is a
    :class:`ConfigError` naming the directory and what to do."""
    import transformers
    try:
        raw = json.loads((model_dir / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"model.path {model_dir}: transformers {transformers.__version__} cannot read its config.json "
                          f"({e}); save the model again") from None
    quant = raw.get("quantization_config")  # (from_pretrained gives a quantized model: its scales, its kernels)
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if quant is not None and method not in quantized.READABLE:  # (MXFP4, FP8: dequantized as from_pretrained does)
        raise ConfigError(f"model.path {model_dir} is a quantized checkpoint (quantization_config: {method}), and "
                          f"train trains fp32 weights from bf16, fp16 or fp32 ones; start from the unquantized model "
                          f"(its repository without the quantization, as a -FP8 or -AWQ repository names its source)")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=False)  # (never a prompt)
    except (OSError, ValueError, KeyError) as e:
        if raw.get("model_type") in transformers.CONFIG_MAPPING:
            advice = "save the model again"
        elif "auto_map" in raw:
            advice = ("its model is code of the repository's own (auto_map), which train does not run (no "
                      "trust_remote_code): train it through the API (tiered_offload.Engine), or use a transformers "
                      "that has the architecture")
        else:
            advice = "upgrade transformers (pip install -U transformers), or save the model with a transformers that knows it"
        raise ConfigError(f"model.path {model_dir}: transformers {transformers.__version__} cannot read its config.json "
                          f"(model_type {raw.get('model_type')!r}: {first_line(e)}); {advice}") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.path {model_dir} holds no tokenizer transformers can load ({first_line(e)}); save "
                          f"the tokenizer beside the model (tokenizer.save_pretrained(DIR))") from None
    return hf_config, tokenizer


def _causal_lm(hf_config, model_dir: Path):
    """The causal language model of ``hf_config`` under ``empty_init()`` (no memory for its weights)."""
    import transformers

    from tiered_offload import empty_init
    if type(hf_config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        raise ConfigError(f"model.path {model_dir} holds a {hf_config.model_type} model ({kind}), and train fine-tunes "
                          f"causal language models (AutoModelForCausalLM: GPT-2, Llama, Qwen, Mistral, Gemma...); train "
                          f"it through the API (tiered_offload.Engine) with a loop of your own")
    with empty_init():
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def _build_model(cfg, hf_config, model_dir: Path):
    """The model under ``empty_init()``; with ``lora.r``, PEFT's LoRA on it (the base frozen, the
    adapter as PEFT initialises it; ``init_from`` reads the base's weights into it; ``lora.parameters``:
    on those parameters too, PEFT's ``target_parameters``). The adapter's
    ``base_model_name_or_path`` is the directory, or the Hub id that named it (and its ``revision``
    the revision named)."""
    base, revision = hub_model(cfg.model.path) or (str(model_dir), None)
    model = _causal_lm(hf_config, model_dir)
    if not cfg.lora.r:
        return model
    try:
        import peft
    except ImportError:
        raise ConfigError("lora.r needs PEFT: pip install peft") from None
    model.config._name_or_path = model.name_or_path = base  # (PEFT's base_model_name_or_path is the latter)
    lora = cfg.lora
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    for name in lora.modules_to_save or ():  # (PEFT drops one the model does not have, without a word)
        if not any(n == name or n.endswith(f".{name}") for n, _ in model.named_modules()):
            raise ConfigError(f"lora.modules_to_save {name!r} matches no module of the model (a name such as lm_head)")
    def wrap(model, targets, parameters=None, dropout=lora.dropout, dora=lora.dora):
        try:
            with warnings.catch_warnings():  # (PEFT reads a name transformers 5 deprecates: not the user's to fix)
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                        category=FutureWarning)
                return peft.get_peft_model(model, peft.LoraConfig(
                    r=lora.r, lora_alpha=lora.alpha, lora_dropout=dropout, target_modules=targets,
                    target_parameters=parameters, task_type="CAUSAL_LM", modules_to_save=lora.modules_to_save,
                    use_dora=dora, revision=revision))
        except ValueError as e:  # (PEFT's NoMatchingPeftModuleError is one)
            if "ParamWrapper" in str(e):  # (LoRA on a parameter: no dropout, no DoRA)
                raise ConfigError(f"lora.parameters {lora.parameters!r}: {e} (PEFT's LoRA on a parameter); set "
                                  f"lora.dropout: 0 and lora.dora: false, or drop lora.parameters") from None
            named = f"lora.targets {lora.targets!r}" + (f" or lora.parameters {parameters!r}" if parameters else "")
            raise ConfigError(f"{named} matches no module of the model ({e}); its linear layers: {', '.join(linear)}, "
                              f"or all-linear") from None
    if lora.targets != "all-linear":
        return wrap(model, lora.targets, lora.parameters)
    # PEFT's all-linear also puts LoRA on an MoE's router and stacked experts (its ParamWrapper, LoRA
    # on a parameter, which takes no dropout or DoRA): all-linear here is the linear layers PEFT wraps
    # (the same in every version of this command: a run resumes as it started); lora.parameters adds the rest
    probe = wrap(copy.deepcopy(model), "all-linear", dropout=0.0, dora=False)  # (on the meta device: no weights)
    wrapped = [n.removeprefix("base_model.model.") for n, m in probe.named_modules()
               if type(m).__name__ == "ParamWrapper"]
    if not wrapped:
        return wrap(model, "all-linear", lora.parameters)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in probe.named_modules()
                    if hasattr(m, "lora_A") and type(m).__name__ != "ParamWrapper"})
    log.info("tiered-offload: lora.targets all-linear: the adapter goes on %s; %s %s", ", ".join(names),
             ", ".join(wrapped[:4]) + (" ..." if len(wrapped) > 4 else ""),
             f"(an MoE's router and stacked experts) get one where lora.parameters names them: {lora.parameters}"
             if lora.parameters else "(an MoE's router and stacked experts) get none: name them in lora.parameters, "
                                     "e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]")
    return wrap(model, names, lora.parameters)


_LORA_SETTINGS = {"r": "lora.r", "lora_alpha": "lora.alpha", "target_modules": "lora.targets",
                  "target_parameters": "lora.parameters", "modules_to_save": "lora.modules_to_save",
                  "use_dora": "lora.dora"}


def _check_adapter(model, adapter: str) -> None:
    """``lora.adapter`` was trained with this run's LoRA settings (else refused, naming them)."""
    from tiered_offload.checkpoint.adapter import adapter_differences
    differ = adapter_differences(model, Path(adapter).expanduser())
    if differ:
        raise ConfigError(f"lora.adapter {adapter} was trained with " + ", ".join(
            f"{_LORA_SETTINGS.get(k, k)} {saved!r} (this run: {own!r})" for k, saved, own in differ) +
            "; set lora's settings as it was trained (its adapter_config.json), or drop lora.adapter")


def _sizes(model) -> tuple[int, int]:
    """The model's parameters, and those that train."""
    return (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad))


def train(config: RunConfig | str | Path, overrides: list[str] = (), *, dry_run: bool = False,
          progress: bool = True, on_step=None) -> dict:
    """Run (or continue) the fine-tuning ``config`` describes; returns a summary (``step``,
    ``stopped``: a signal ended it early, ``final``: the final export's directory).
    ``on_step(step, record)`` is called after every step (tests, dashboards; under torchrun, on rank 0,
    with the ranks' record: :mod:`tiered_offload.train.ranks`; a step torn in the backward and the steps
    since the last commit run again, :mod:`tiered_offload.train.steps`, and are told again). ``progress``: a bar
    for the training and for the long steps before it (tokenising, placing the weights) and the
    exports."""
    from tiered_offload import progress as bars
    with Ranks() as ranks, bars.shown(progress and not dry_run and ranks.first):
        cfg = config if isinstance(config, RunConfig) else load_config(config, list(overrides))
        speculation = ClipSpeculation(cfg.train.clip, cfg.train.clip_in_backward, cfg.offload.commit_every)
        stop = {"signal": None}  # (SIGINT / SIGTERM: one during a torn step stops the run at the last commit)
        try:
            while True:
                try:
                    return _train(cfg, dry_run, progress and ranks.first, on_step, ranks, speculation, stop)
                except ClipTornError as e:  # (train.steps says why; the storage keeps the last commit)
                    step = speculation.torn()
                    held = speculation.held_until
                    log.warning("tiered-offload: step %d ran in the backward but its gradient norm is %s%.4g, over "
                                "train.clip %g: it runs again from the last commit, clipped after the backward (the "
                                "same numbers), %s", step, "at least " if e.bound else "", e.norm, e.clip_norm,
                                "as do the steps to %d" % held if held > step else "and the next in the backward")
        except StepFailedError as e:  # (the engine's advice is its API's: say the command's)
            raise StepFailedError(e.what, "Run the same command again: it resumes from the last step the storage "
                                          "recorded.") from e.__cause__


def _train(cfg, dry_run: bool, progress: bool, on_step, ranks: Ranks, speculation: ClipSpeculation,
           stop: dict) -> dict:
    model_dir = _model_dir(cfg.model.path, dry_run)
    out = Path(cfg.output.dir).expanduser()
    refuse_inside_exports({"model.path": model_dir, "data.path": cfg.data.path, "lora.adapter": cfg.lora.adapter},
                          _storage_location(cfg.offload.storage).split(","), out, cfg.output.export_every)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} is a file, not a directory; name a directory (for the exports and "
                          f"metrics.jsonl)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output.dir {out}: cannot create it ({e.strerror or e}); name a directory you can write") from None
    # One run at a time writes an output.dir (its metrics.jsonl, its exports); a dry run writes nothing there.
    held = None if dry_run or not ranks.first else DirectoryLock(
        out, path=out / ".cache" / "train.lock", what=f"output.dir {out}", advice="give this run another output.dir",
        required=False).acquire()
    try:
        return _run(cfg, model_dir, out, dry_run, progress, on_step, ranks, speculation, stop)
    finally:
        if held is not None:
            held.release()


def _run(cfg, model_dir: Path, out: Path, dry_run: bool, progress: bool, on_step, ranks: Ranks,
         speculation: ClipSpeculation, stop: dict) -> dict:
    from tiered_offload import Engine
    directories = _storage_location(cfg.offload.storage)
    location = directories if cfg.offload.backend is None else f"{cfg.offload.backend}:{directories}"
    if cfg.offload.stripe_weights:  # (drives of unequal speed: each its share of the stripes)
        location = (f"{cfg.offload.backend or 'auto'}:{directories}?stripe_weights="
                    f"{':'.join(map(str, cfg.offload.stripe_weights))}")
    own = directories if ranks.world == 1 else ",".join(  # (this rank's directories: engine/sharding.py)
        str(Path(d) / f"rank-{ranks.rank}-of-{ranks.world}") for d in directories.split(","))
    mine = StateFiles(state_directory(own))  # (a committed state: the same command continues it, on every rank)
    have, past_first = ranks.sums([float(mine.manifest_path.exists()), float(_past_first_commit(mine))])
    restarted = ranks.world > 1 and 0 < have < ranks.world and not past_first  # (engine/sharding.py reconcile_resume)
    resuming = have > 0 and not restarted
    root = Path(directories.split(",")[0]).expanduser()
    resuming |= ranks.world > 1 and any(  # (another number of ranks' state: the engine refuses it, naming them)
        p.name.split("-of-")[-1] != str(ranks.world) for p in root.glob("rank-*-of-*"))
    if not resuming and not cfg.output.overwrite:  # (every rank, before the data is tokenised)
        refuse_earlier_run(out, location)
    hf_config, tokenizer = _config_and_tokenizer(model_dir)
    train_data, eval_data = ranks.once_per_machine(lambda: prepare_data(
        cfg.data, tokenizer, model_dir, out / ".cache", getattr(hf_config, "max_position_embeddings", None)))
    t = cfg.train
    per_step = t.micro_batch * t.grad_accum * ranks.world
    total = t.max_steps or max(1, math.ceil(t.epochs * len(train_data) / per_step))
    if ranks.first and (unfinished := t.unfinished_warmup(total)):
        log.warning("tiered-offload: %s", unfinished)
    if ranks.first and per_step > len(train_data):
        log.warning("tiered-offload: a step's %d sequences (train.micro_batch x train.grad_accum%s) are more than the "
                    "data's %d: a step trains some of them twice or more; lower them, or give more data", per_step,
                    " x ranks" if ranks.world > 1 else "", len(train_data))
    if dry_run:
        with contextlib.redirect_stdout(io.StringIO()) if not ranks.first else contextlib.nullcontext():
            return _dry_run(cfg, hf_config, model_dir, tokenizer, train_data, eval_data, total, resuming, location)

    torch.manual_seed(t.seed)
    model = _build_model(cfg, hf_config, model_dir)
    check_export_space(cfg, out, *_sizes(model), directories, resuming)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=tuple(t.betas),
                                  eps=t.eps)
    if cfg.lora.adapter and not resuming:
        _check_adapter(model, cfg.lora.adapter)
    try:
        with _own_hyperparameters() if resuming else contextlib.nullcontext():
            engine = Engine(model, optimizer, storage=location, host_memory=cfg.offload.host_memory,
                            device_memory=cfg.offload.device_memory, blocks=cfg.model.blocks, durable=True,
                            commit_every=cfg.offload.commit_every, resume="auto" if restarted else resuming,
                            init_from=None if resuming else [model_dir, *([Path(cfg.lora.adapter).expanduser()]
                                                                          if cfg.lora.adapter else [])])
    except CheckpointError:
        if resuming:
            _refuse_another_layout(cfg, own, location)
        raise
    previous = {s: signal.signal(s, lambda n, _f: stop.update(signal=n)) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics = None
    bar = None
    try:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: lr_factor(s, total, t.warmup_steps, t.schedule, t.min_lr / t.lr))
        engine.attach_scheduler(scheduler)
        start = engine.step_count
        changed = _take_hyperparameters(engine, scheduler, t) if resuming else []  # (also at step 0)
        was = (engine.user_state.get("record") or [None] * 3)[2] if start else None
        if ranks.first and (rises := t.rewarmed(was, engine.param_groups[0]["lr"], start, total, changed)):
            log.warning("tiered-offload: %s", rises)
        metrics = metrics_from(out / "metrics.jsonl", start) if ranks.first else None
        if start and engine.user_state.get("micro_batches") != start * t.grad_accum:
            raise ConfigError(f"{location} was trained with another grad_accum or data position "
                              f"({engine.user_state}); resume with the same train.grad_accum")
        settings = _batch_settings(cfg, train_data)
        average = loss_average(t.average, (engine.user_state.get("settings") or {}) if start else None, location)
        if average == t.average:  # (a run begun before the setting: saved without it, as it began)
            settings["train.average"] = average
        if start:
            _say_other_settings(engine.user_state.get("settings"), settings, location, start, changed)

        def record_step(step: int, loss: float, tokens: float, own: list, seconds, read, written) -> dict:
            """A step's record in metrics.jsonl (``own``: this rank's part, committed with the step, whose
            learning rate and gradient norm are every rank's), with its evaluation where one is due."""
            record = {"step": step, "loss": loss, "lr": own[2], "grad_norm": own[3], "tokens": int(tokens),
                      "tokens_per_s": tokens / seconds if seconds else None, "seconds": seconds}
            if eval_data is not None and t.eval_every and step % t.eval_every == 0:
                record["eval_loss"] = _evaluate(engine, model, eval_data, t.micro_batch, t.precision, ranks)
            record["disk_read_bytes"], record["disk_written_bytes"] = read, written
            return record

        saved = engine.user_state.get("record") if start else None
        if saved is not None and ranks.sums([metrics is not None and metrics.last_step < start])[0]:
            loss, tokens = ranks.sums(saved[:2])  # (killed between the step's commit and its record)
            record = record_step(start, loss / ranks.world, tokens, saved, None, None, None)
            if metrics is not None:
                metrics.write(record)
            if on_step is not None and ranks.first:
                on_step(start, record)
        every, missing = cfg.output.export_every, ranks.first and not (out / f"step-{start}").is_dir()
        if start and every and start % every == 0 and ranks.sums([missing])[0]:
            export_step(engine, model_dir, out, start, cfg, ranks)  # (killed in it: the step was committed before)
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        moved, checked_documents = _disk_bytes(engine), False
        agreed = ranks.sums([stop["signal"] is not None])[0] > 0  # (a signal during a torn step: stop at its commit)
        in_backward = StepInBackward.refusal(engine) is None  # (train.steps: where the step runs)
        speculation.resumed(engine.user_state.get("record") if start else None)
        if in_backward and ranks.first and engine.activation_modes is None:  # (PyTorch's graphs, nothing streamed)
            log.info("tiered-offload: the whole state fits the memory budget: each step runs after the backward, in "
                     "memory (no gradient reaches the disk either way)")
        elif (in_backward and (not t.clip or t.clip_in_backward) and ranks.first
              and StepInBackward.short_of_room(engine) is None):  # (else the engine warns)
            log.info("tiered-offload: " + ("each step runs in the backward (no gradient reaches the disk)" if not t.clip
                     else f"a step runs in the backward (no gradient reaches the disk) {_tried(t.clip_in_backward)}; "
                          f"one found over train.clip there runs again from the last commit, after the backward (the "
                          f"same numbers)"))

        def stopping() -> bool:  # one process: now; ranks: as they agreed after the last step (below)
            return stop["signal"] is not None if ranks.world == 1 else agreed
        while engine.step_count < total and not stopping():
            t0 = time.perf_counter()
            step = engine.step_count
            batches, tokens, targets = [], 0, []
            for micro in range(t.grad_accum):
                rows = micro_batch_rows(len(train_data), t.seed, ranks.micro_batch(step, micro, t.grad_accum),
                                        t.micro_batch)
                batches.append(train_data.batch(rows))
                carry, counted = loss_tokens(batches[-1]["labels"])
                tokens, targets = tokens + carry, [*targets, counted]
            weights = None if average != "tokens" else token_weights(
                targets, ranks.sums([sum(targets)])[0], ranks.world, t.grad_accum)
            checked = documents_seen(model) if cfg.data.packing == DOCUMENTS and not checked_documents else None
            # (a check of the model's first forward in this process raises after it: a step after the backward)
            fused = in_backward and checked is None and speculation.allows(step + 1)
            try:
                own = train_step(engine, batches, t, tokens, fused,
                                 lambda checked=checked: _forwards(t.precision, engine, checked),
                                 {"micro_batches": (step + 1) * t.grad_accum, "settings": settings}, weights)
            except NonFiniteError as e:  # (the engine's advice names its own arguments)
                raise NonFiniteError(f"step {step + 1}: {str(e).split(';')[0]}; the training state is the last "
                                     f"commit's. Lower train.lr (or check the data) and run the same command again: "
                                     f"it resumes there with the new rate; where the weights had diverged already, "
                                     f"start a new run from an earlier export (model.path: {out}/step-N)") from None
            speculation.seen(own[3])
            checked_documents = True  # (the model's first step in this process: before it is taken)
            now = _disk_bytes(engine)
            loss, tokens, read, written, stops = ranks.sums([own[0], own[1], now[0] - moved[0], now[1] - moved[1],
                                                              stop["signal"] is not None])
            agreed, moved, seconds = stops > 0, now, time.perf_counter() - t0
            record = record_step(step + 1, loss / ranks.world, tokens, own, seconds, int(read), int(written))
            if metrics is not None:
                metrics.write(record)
            if on_step is not None and ranks.first:
                on_step(step + 1, record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                tok_s=f"{record['tokens_per_s'] or 0:.0f}")
            if cfg.output.export_every and (step + 1) % cfg.output.export_every == 0:
                export_step(engine, model_dir, out, step + 1, cfg, ranks)
        committed = engine.commit()
        summary = {"step": engine.step_count, "committed": committed, "stopped": stopping(),
                   "final": None, "state_bytes": engine.state_bytes()}
        if not summary["stopped"]:
            if eval_data is not None:
                summary["eval_loss"] = _evaluate(engine, model, eval_data, t.micro_batch, t.precision, ranks)
                if metrics is not None and not metrics.holds_final_evaluation(engine.step_count):
                    metrics.write({"step": engine.step_count, "eval_loss": summary["eval_loss"]})
            export(engine, model_dir, out / "final", cfg, ranks)
            summary["final"] = str(out / "final")
        return summary
    finally:  # (each part closed whatever the one before raised: the engine commits its steps and unlocks)
        try:
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
        finally:
            try:
                engine.close()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)


@contextlib.contextmanager
def _forwards(precision: str, engine, checked):
    """The context of a step's forwards and backwards: its precision, and the check of the model's
    first forward in this process (``checked``; None: none)."""
    with _precision(precision, engine), checked or contextlib.nullcontext():
        yield


_LAYOUT = ("r", "targets", "parameters", "dora", "modules_to_save")


def _layout_settings(cfg) -> dict:
    """The settings that decide which parameters train: the training state's layout."""
    return {f"lora.{key}": getattr(cfg.lora, key) for key in _LAYOUT}


def _refuse_another_layout(cfg, directories: str, location: str) -> None:
    """Where the engine refused to resume ``location``'s state for another layout, name the layout
    setting this command changed (from the settings the run saved; none saved: nothing to say)."""
    try:
        saved = StateFiles(state_directory(directories)).read_manifest()["meta"]["user_state"]["settings"]
    except (TieredOffloadError, KeyError, TypeError):  # (another error, which the engine's says)
        return
    differ = [(k, v, saved[k]) for k, v in _layout_settings(cfg).items() if k in saved and saved[k] != v]
    if differ:
        raise ConfigError(", ".join(f"{k} is {v!r}, and {location} was trained with {was!r}" for k, v, was in differ)
                          + ": which parameters train is the training state's layout; set it back, or train into "
                            "another offload.storage (a new run from the model)") from None


def _batch_settings(cfg, train_data) -> dict:
    """What decides a run's batches and its step besides the optimizer's hyperparameters (saved with
    the state), saved in its user state so that a resume can tell a changed one; and its layout
    (:func:`_layout_settings`), so that a resume that changed it is told which."""
    d, t = cfg.data, cfg.train
    return {"data.path": str(d.path), "data.format": d.format, "data.field": d.field, "data.chat_turns": d.chat_turns,
            "data.max_seq_len": d.max_seq_len,
            "data.packing": d.packing, "data.eval_fraction": d.eval_fraction, "data: sequences": len(train_data),
            "data: content": train_data.content,
            "train.seed": t.seed, "train.micro_batch": t.micro_batch, "train.schedule": t.schedule,
            "train.warmup_steps": t.warmup_steps, "train.min_lr": t.min_lr, "train.clip": t.clip, "train.precision": t.precision,
            **({"lora.alpha": cfg.lora.alpha, "lora.dropout": cfg.lora.dropout} if cfg.lora.r else {}),
            **_layout_settings(cfg)}


@contextlib.contextmanager
def _own_hyperparameters():
    """Around a resume's construction: leave out the engine's warning that it keeps the saved
    hyperparameters over the ones given, since this command gives the groups its own after the
    resume (:func:`_take_hyperparameters`) and names what changed."""
    logger = logging.getLogger("tiered_offload")

    def keep(record) -> bool:
        return not getattr(record, KEPT_HYPERPARAMETERS, False)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _past_first_commit(files: StateFiles) -> bool:
    """Whether ``files`` hold a commit after the first (step 0, the starting weights), or one that
    cannot be read (the engine names its fault). Where no rank does and some hold none, a first start
    was killed between the ranks' first commits: every rank starts fresh, the engine forgetting those."""
    try:
        return files.manifest_path.exists() and files.read_manifest()["step"] > 0
    except (TieredOffloadError, KeyError, TypeError):
        return True


def _take_hyperparameters(engine, scheduler, t) -> list[str]:
    """On a resume: the command's ``train.lr``, ``weight_decay``, ``betas`` and ``eps`` from the
    resumed step on (the optimizer's state kept), as a run with them from the start would have
    them there; the learning rate from the schedule at the resumed step, as this command draws it
    (a longer ``max_steps``: its cosine). Returns the changes, as :func:`_say_other_settings`
    names them."""
    changed = []
    for i, (group, decay) in enumerate(zip(engine.param_groups, (t.weight_decay, 0.0))):
        for name, now in (("initial_lr", t.lr), ("weight_decay", decay), ("betas", tuple(t.betas)), ("eps", t.eps)):
            if name in group and group[name] != now:
                if i == 0:  # (the no-decay group follows the first one, its weight decay 0 on both sides)
                    was, shown = (list(group[name]), list(now)) if name == "betas" else (group[name], now)
                    changed.append(f"train.{name.removeprefix('initial_')} {was} (now {shown})")
                group[name] = now
        if "initial_lr" in group:  # (the scheduler's base, which a resume restored)
            scheduler.base_lrs[i] = group["initial_lr"]
            group["lr"] = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in engine.param_groups]
    return changed


def _say_other_settings(saved: dict | None, now: dict, location: str, start: int, changed: list[str] = ()) -> None:
    """Log the settings of this command that differ from those ``location`` was trained with (none
    saved: a run from before they were), and the optimizer's ``changed`` ones: they apply from the
    resumed step on."""
    differ = [f"{k} {saved[k]} (now {v})" for k, v in now.items()  # (another layout does not resume)
              if saved and k in saved and saved[k] != v and k.removeprefix("lora.") not in _LAYOUT] + list(changed)
    if differ:
        log.warning("tiered-offload: %s was trained with other settings: %s. They apply from step %d on: the batches "
                    "and steps from here are not those of the run the first settings make (the same settings as "
                    "before continue it exactly)", location, ", ".join(differ), start + 1)


def _tried(share: bool | float) -> str:
    """Which clipped steps ``train.clip_in_backward`` tries in the backward, in words."""
    if share is True:
        return "unless the engine predicts its gradient norm over train.clip (the run's first learns it)"
    return f"after one whose gradient norm was at most {share:g} x train.clip"


def _disk_bytes(engine) -> tuple[int, int]:
    stats = engine.stats().store
    return stats.bytes_read[Tier.DISK], stats.bytes_written[Tier.DISK]


def _precision(precision: str, engine):
    """The context the forward runs in: nothing for fp32, bfloat16 autocast for ``bf16-autocast``."""
    if precision == "bf16-autocast":
        return torch.autocast(engine.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _evaluate(engine, model, data, micro_batch: int, precision: str, ranks: Ranks) -> float:
    """The mean loss over the evaluation sequences' tokens the loss counts, each micro-batch's mean
    weighed by its own (dropout off, no gradient, training untouched; the ranks split them:
    :meth:`Ranks.eval_rows`)."""
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad(), _precision(precision, engine):
            for rows in ranks.eval_rows(len(data), micro_batch):
                batch = data.batch(rows or [0])
                loss, n = float(engine(**batch).loss), loss_tokens(batch["labels"])[1] if rows else 0
                total, count = total + loss * n, count + n
    finally:
        model.train()
    total, count = ranks.sums([total, count])
    return total / max(1, count)


def _dry_run(cfg, hf_config, model_dir, tokenizer, train_data, eval_data, total, resuming, location) -> dict:
    """What the run would do, without building or training anything."""
    model = _build_model(cfg, hf_config, model_dir)
    if cfg.lora.adapter and not resuming:
        _check_adapter(model, cfg.lora.adapter)
    params, trained = _sizes(model)
    first = train_data.batch([0])
    info = {"model": type(model).__name__, "parameters": params, "trained": trained,
            "state_bytes": 4 * params + 12 * trained,
            "train_sequences": len(train_data), "eval_sequences": 0 if eval_data is None else len(eval_data),
            "steps": total, "resumes": resuming, "storage": location, "host_memory": cfg.offload.host_memory,
            "device_memory": cfg.offload.device_memory,
            "first_sequence": tokenizer.decode(first["input_ids"][0][:64])}
    start = f", from {cfg.lora.adapter}" if cfg.lora.adapter and not resuming else ""
    print(f"model          {info['model']}, {params:,} parameters" + (f" ({trained:,} trained: LoRA r={cfg.lora.r}"
                                                                      f"{start})" if cfg.lora.r else "")
          + f"; training state {format_size(info['state_bytes'])}")
    print(f"data           {info['train_sequences']} sequences of {cfg.data.max_seq_len} tokens"
          f" ({info['eval_sequences']} held out); {total} steps of {cfg.train.micro_batch} x {cfg.train.grad_accum}")
    print(f"storage        {location} ({'resumes its committed state' if resuming else 'a fresh run'}); host "
          f"budget {cfg.offload.host_memory}, device budget {cfg.offload.device_memory}")
    info["plan"] = _plan_preview(model, cfg)
    for line in info["plan"]["lines"]:
        print(f"plan           {line}")
    print(f"first batch    {info['first_sequence']!r}")
    return info


def _plan_preview(model, cfg) -> dict:
    """The engine's plan for this model and budget, from sizes alone (nothing allocated): the
    streamed units, the minimum budget, the commit mode, where the step runs and the least disk
    bytes a step moves (one process's, as the engine's own plan states it)."""
    from tiered_offload.config import EngineConfig, StoreConfig
    from tiered_offload.engine.binding import ModelBinding
    from tiered_offload.engine.optim_spec import read_optimizer
    from tiered_offload.engine.schedule import Schedule

    defaults = EngineConfig()  # what the engine the run builds uses
    binding = ModelBinding(model, cfg.model.blocks, torch.device("cpu"), defaults.stream_modules_numel)
    spec = read_optimizer(torch.optim.AdamW, {"lr": cfg.train.lr}, model.parameters())
    binding.arrange(spec.group_of(), defaults.state_piece_numel)
    schedule = Schedule(binding.units, tuple(spec.kinds), lambda n: -(-n // PAGE) * PAGE)  # as the host tier stores them
    host = StoreConfig(host_budget_bytes=cfg.offload.host_memory, device="cpu").resolved().host_budget_bytes
    state, need = schedule.state_bytes(), schedule.working_set().need
    resident = schedule.resident_bytes()
    beyond = 0 if schedule.fits(host // PAGE * PAGE) else resident - host
    # the engine's own floors (its plan shows the same): journal commits when the state exceeds the budget
    # and each step commits; without a journal, the step runs in the backward (train.steps: with clipping, where
    # the last norm was well within the limit, so its floors are the step's after the backward)
    every = cfg.offload.commit_every
    journal = beyond > 0 and every == 1
    # (and where a unit's update fits beside the backward's pins; on a GPU, the engine's placement decides)
    defer = -(-schedule.defer_budget() // PAGE) * PAGE  # (in whole pages, as the host tier counts its budget)
    room = torch.cuda.is_available() or host >= defer
    in_backward = not cfg.train.clip and not journal and room and beyond > 0  # (a state that fits: PyTorch's graphs)
    floors = (schedule.floors_in_backward(host) if in_backward else
              schedule.floors(host, 0, update_on_host=True, journal=journal))
    commits = "journal commits" if journal else "snapshot commits" + (f" every {every} steps" if every > 1 else "")
    step = "in the backward" if in_backward else "after the backward"
    lines = [f"{len(binding.blocks)} units streamed ({sum(u.in_sequence for u in binding.blocks)} of {binding.seq_name}, "
             f"{sum(not u.in_sequence for u in binding.blocks)} other stacks' blocks, embeddings and heads)",
             f"host budget {format_size(host)}: minimum {format_size(need)}"
             + ("" if host >= need else " -- too small: raise offload.host_memory"),
             f"state {format_size(state)} " + ("fits the host budget: commits are snapshots, the disk only "
                                               "receives them" if beyond == 0 else
                                               f"exceeds it by {format_size(beyond)} (its tensors as the host tier "
                                               f"stores them, aligned: {format_size(resident)}): a step reads at least "
                                               f"{format_size(floors['disk_read'])} and writes "
                                               f"{format_size(floors['disk_written'])} ({commits}; the step "
                                               f"{step}" + (", train.clip null: no gradient on the disk)"
                                                            if in_backward else ")")
                                               + ("" if in_backward or not (journal or not room) else
                                                  "; journal commits keep the step out of the backward: "
                                                  "offload.commit_every >= 2 runs it there (snapshot commits: up "
                                                  "to twice the state on disk)" if journal else
                                                  f"; a unit's update does not fit beside the backward's pins: "
                                                  f"offload.host_memory >= {format_size(defer)} ({defer} bytes) "
                                                  f"runs it in the backward")),
             "step time: measured and planned after the second step (engine.plan, logged)"]
    if beyond > 0 and cfg.train.clip and cfg.train.clip_in_backward and not journal and room:  # a step in the backward
        other = schedule.floors_in_backward(host)
        lines.insert(-1, f"a step runs in the backward {_tried(cfg.train.clip_in_backward)}"
                         + (f" (and among the first {ClipSpeculation.REPLAY} after each commit)"
                            if every > ClipSpeculation.REPLAY else "")
                         + f", clipped exactly (one over the limit there runs again after it): at "
                         f"least {format_size(other['disk_read'])} read and {format_size(other['disk_written'])} "
                         f"written, no gradient on the disk")
    return {"units": len(binding.blocks), "minimum_host_bytes": need, "host_bytes": host, "state_bytes": state,
            "disk_floor_read_bytes": floors["disk_read"], "disk_floor_written_bytes": floors["disk_written"],
            "step": step, "lines": lines}
