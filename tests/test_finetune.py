"""Fine-tuning semantics exactly as PyTorch: parameter groups, frozen and adapter weights,
parameters outside the optimizer, experts that get no tokens; bitwise against in-memory training
with the state on disk and a host budget below the state."""

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import logging
import math
import random
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_core.errors import CheckpointError, ConfigError, ModelStructureError, TensorStateError, TierCapacityError
from tiered_offload import Engine, EngineConfig, Tier, empty_init

VOCAB = 64


# ---- small models ---------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter, as PEFT's LoRA builds it."""

    def __init__(self, d_in, d_out, rank=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(d_out, rank) * 0.01)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


class MLP(nn.Module):
    def __init__(self, d, linear=nn.Linear):
        super().__init__()
        self.up, self.down = linear(d, 2 * d), linear(2 * d, d)

    def forward(self, x, route=None):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 mixture of experts; ``route`` says which expert each token goes to. An expert that
    receives no token is not run at all, so its parameters get no gradient (as in real MoE code)."""

    def __init__(self, d, experts=4):
        super().__init__()
        self.experts = nn.ModuleList(MLP(d) for _ in range(experts))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if bool(mask.any()):
                out[mask] = expert(x[mask])
        return out


class Block(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ffn = ffn

    def forward(self, x, route=None):
        return x + self.ffn(self.norm(x), route)


class TinyLM(nn.Module):
    def __init__(self, ffn, d=16, layers=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, ffn(d)) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, route)
        return self.head(self.norm(h))


class BlocksOnlyLM(TinyLM):
    """Every parameter in a block: a fixed (buffer) projection in and out, so the engine's rest unit
    holds none (its 0-byte tensor has no file: a resume of such a state once failed on it)."""

    def __init__(self, d=32):
        super().__init__(lambda d: MLP(d), d=d)
        del self.emb, self.norm, self.head
        self.register_buffer("project", torch.randn(VOCAB, d) / 6)

    def forward(self, ids, route=None):
        h = self.project[ids]
        for block in self.blocks:
            h = block(h)
        return h @ self.project.T


def make_blocks_only():
    torch.manual_seed(0)
    return BlocksOnlyLM()


def lm_loss(model, ids, route=None):
    logits = model(ids, route) if route is not None else model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def make_lora(d=16):
    torch.manual_seed(0)
    return TinyLM(lambda d: MLP(d, LoRALinear), d=d)


def make_moe():
    torch.manual_seed(0)
    return TinyLM(MoE)


def make_gpt2(frozen=False, dropout=0.0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False  # as the engine sets it: a key/value cache changes attention's memory layout
    if frozen:
        model.transformer.wpe.weight.requires_grad_(False)
        model.transformer.h[0].requires_grad_(False)
    return model


def make_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def make_albert(dropout=0.0):
    """ALBERT with 4 layer groups over 8 layers: each group's layer called twice in a forward (its
    weights shared across depth), 92% of the parameters in the groups."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_hidden_groups=4, inner_group_num=1, max_position_embeddings=32,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout))


def make_deberta():
    """DeBERTa-v2 with relative attention: the encoder gives its relative-position embedding
    weight, a parameter outside the blocks, to every block as an input."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        max_position_embeddings=32, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def hf_loss(model, ids, route=None):
    return model(input_ids=ids, labels=ids).loss


def hf_groups(model, lr=1e-3, head_lr=3e-3, weight_decay=0.1):
    """The Hugging Face Trainer recipe: decay on matrices, none on biases and norms; plus the head on its own lr."""
    decay, no_decay, head = [], [], []
    for name, p in model.named_parameters():
        if name.startswith("lm_head"):
            head.append(p)
        elif p.ndim < 2 or "norm" in name or "ln_" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": head, "lr": head_lr, "weight_decay": 0.0}]


# ---- the harness ------------------------------------------------------------------------------
def batches(steps, accumulate, *, routes=None, seed=1, shapes=None):
    """``steps`` lists of ``accumulate`` micro-batches ``(ids, route)``, each ids of 2 sequences of 9
    tokens; ``shapes``: per step, each micro-batch's (sequences, tokens) instead (dynamic padding,
    an epoch's short last batch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        step = []
        for m in range(accumulate):
            ids = torch.randint(0, VOCAB, shapes[s][m] if shapes else (2, 9), generator=g)
            route = None
            if routes is not None:  # step s sends its tokens only to the experts routes[s] names
                choice = torch.tensor(routes[s])
                route = choice[torch.randint(0, len(choice), ids.shape, generator=g)]
            step.append((ids, route))
        out.append(step)
    return out


def train(model, optimizer, data, loss_fn, clip, habits=None):
    """Plain PyTorch, in memory; ``habits``: see :class:`Habits`."""
    habits = habits or Habits()
    sched = habits.scheduler(optimizer)
    # the random state and persistent buffers the engine's last commit before the resume holds
    # (as the step found them): its construction's where no step was taken before it (a skipped
    # step commits nothing)
    losses, at_step, buffers = [], torch.get_rng_state(), _buffers(model)
    for s, step in enumerate(data):
        if s == habits.resume_at:  # what the engine's resume restores
            torch.set_rng_state(at_step)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
        habits.freeze(model, s)
        for m, (ids, route) in enumerate(step):
            habits.switch(model, (s, m), "forward")
            with habits.forward():
                loss = habits.loss(loss_fn, model, ids, route) / len(step)
            habits.switch(model, (s, m), "backward")
            loss.backward()
            habits.switch(model, (s, m), "after")
            losses.append(loss.item())
        losses += habits.logged(model, loss_fn, s, "before-step", model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if habits.clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), habits.clip_value)
        # (on_nonfinite="skip": the step and the scheduler's skipped)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        taken = not habits.skips or all(bool(torch.isfinite(g).all()) for g in grads)
        if taken:
            if habits.resume_at is not None and s < habits.resume_at:  # the last step taken: its commit's
                at_step, buffers = torch.get_rng_state(), _buffers(model)
            optimizer.step()
            if sched is not None:
                sched.step()
        if not taken or habits.zeroes_after(s):
            model.zero_grad()  # every parameter's gradient, as engine.zero_grad() and HF Trainer do
        losses += habits.logged(model, loss_fn, s, "after-step", model)
        habits.exported(model, s)
    return losses


def _buffers(model) -> dict[str, torch.Tensor]:
    """The persistent buffers, as a commit holds them (a training forward's may change: BatchNorm's
    statistics, spectral_norm's power iteration)."""
    saved = model.state_dict()
    return {name: b.detach().clone() for name, b in model.named_buffers() if name in saved}


def train_engine(engine, data, loss_fn, clip, fused=False, habits=None, start=0, in_backward=False):
    """The loop of ``train`` through the engine (``start``: the index of ``data``'s first step);
    ``fused``: each step's micro-batches through ``engine.forward_backward`` instead of a backward each;
    ``in_backward``: the step (and ``zero_grad``) run in the last backward, ``step=True`` (clipped by
    ``clip_norm=clip``; nothing logged before the step, the gradients zeroed every step)."""
    habits = habits or Habits()
    assert not in_backward or habits.steps_in_backward(), "no step() of its own to precede"
    clipped = {"clip_norm": clip} if in_backward and clip is not None else {}
    losses = []
    for s, step in enumerate(data, start):
        habits.freeze(engine.model, s)
        if fused:
            with habits.forward():
                losses += [loss.item() for loss in fused_step(engine, step, functools.partial(habits.loss, loss_fn),
                                                              in_backward, clipped)]
        else:
            for m, (ids, route) in enumerate(step):
                habits.switch(engine.model, (s, m), "forward")
                with habits.forward():
                    loss = habits.loss(loss_fn, engine, ids, route) / len(step)
                habits.switch(engine.model, (s, m), "backward")
                last = in_backward and m == len(step) - 1
                engine.backward(loss, step=last, **(clipped if last else {}))
                habits.switch(engine.model, (s, m), "after")
                losses.append(loss.item())
        if in_backward:
            losses += habits.logged(engine, loss_fn, s, "after-step", engine.model)
            habits.exported(engine.model, s, engine)
            continue
        losses += habits.logged(engine, loss_fn, s, "before-step", engine.model)
        if clip is not None:
            engine.clip_grad_norm_(clip)
        if habits.clip_value is not None:
            engine.clip_grad_value_(habits.clip_value)
        (engine.optimizer if habits.optimizer_calls else engine).step()
        if habits.zeroes_after(s):
            (engine.optimizer if habits.optimizer_calls else engine).zero_grad()
        losses += habits.logged(engine, loss_fn, s, "after-step", engine.model)
        habits.exported(engine.model, s, engine)
    return losses


@dataclasses.dataclass
class Habits:
    """What training loops do besides training, the same in ``train`` and ``train_engine``:
    ``poisoned``, ``(step, micro-batch)`` whose loss is NaN (the step skipped: ``on_nonfinite="skip"``);
    ``lr_decay``: a ``LambdaLR`` of ``1 / (1 + lr_decay * step)`` (attached to the engine);
    ``logs``: per step index, ``(when, how)``: a loss on a held-out batch, ``when`` ``"before-step"``
    (between the last backward and the step) or ``"after-step"``; ``how`` ``"eval"`` (``eval()`` and
    ``no_grad``), ``"no-grad"`` (training mode), ``"with-grad"`` (a graph dropped) or ``"generate"``
    (a Hugging Face model's greedy ``generate()``, its tokens compared); ``exports``:
    the steps after which the engine's ``export_safetensors`` and ``named_parameters`` are read,
    each PyTorch's weights then, bitwise (the export as ``save_pretrained`` writes a transformers
    model, with its persistent buffers and in its checkpoint layout); ``resume_at`` (set by
    ``check_parity``): the step a resume starts at, where the reference restores the random state
    and the persistent buffers of the last step taken before it (a skipped one commits nothing), as
    the resume does: what the loop drew or changed after that step (a loss logged in training mode
    with dropout, or with spectral_norm's power iteration) is drawn or changed again;
    ``autocast``: the forwards and
    losses under bf16 ``torch.autocast``; ``optimizer_calls``: the loop calls
    ``engine.optimizer.step()`` and ``.zero_grad()`` (the optimizer the engine was built from), not
    the engine's; ``modes``: per ``(step, micro-batch)`` of the loop of backwards, ``"eval-forward"``
    (its forward in ``eval()`` mode with gradients, ``train()`` again before its backward) or
    ``"eval-backward"`` (``eval()`` between its forward and its backward); ``clip_value``:
    ``clip_grad_value_`` after the norm's clipping (the engine's own); ``twice``: each loss the
    mean of two forwards (the batch and its sequences in reverse order) before one backward;
    ``zero_grad_every``: the gradients are zeroed after every this many steps (and before a
    resume, and after a skipped step, which forgets them), so the next steps' backwards add to
    what the last step's clipping left; ``freezes``: per step index, ``{name: requires_grad}`` set
    before that step's forwards (and again after a resume, as a loop's ``if step >= k: freeze``
    does) on a parameter or on a module's parameters (gradual freezing and unfreezing)."""
    poisoned: tuple = ()
    lr_decay: float | None = None
    logs: dict = dataclasses.field(default_factory=dict)
    exports: tuple = ()
    autocast: bool = False
    optimizer_calls: bool = False
    resume_at: int | None = None
    modes: dict = dataclasses.field(default_factory=dict)
    clip_value: float | None = None
    twice: bool = False
    zero_grad_every: int = 1
    freezes: dict = dataclasses.field(default_factory=dict)
    _poisoned_ids: list = dataclasses.field(default_factory=list)

    def switch(self, module, at: tuple, stage: str) -> None:
        """The mode :attr:`modes` gives micro-batch ``at`` before its ``"forward"``, before its
        ``"backward"``, and ``"after"`` it (training again)."""
        how = self.modes.get(at)
        if how is not None:
            module.train(stage == "after" or (how == "eval-forward") == (stage == "backward"))

    def forward(self):
        """Where the loop's forwards and losses run (bf16 autocast with :attr:`autocast`)."""
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def freeze(self, model, step: int) -> None:
        """Sets what :attr:`freezes` says up to ``step`` (each name's last setting)."""
        wanted = {}
        for s in sorted(k for k in self.freezes if k <= step):
            wanted.update(self.freezes[s])
        for name, flag in wanted.items():
            try:
                model.get_parameter(name).requires_grad_(flag)
            except AttributeError:
                model.get_submodule(name).requires_grad_(flag)

    def steps_in_backward(self) -> bool:
        """Whether a loop of these habits can run its step in the backward (``step=True``): nothing
        between its last backward and its step (no ``clip_value``, no log before the step), and the
        gradients zeroed after every step."""
        return (self.clip_value is None and self.zero_grad_every == 1
                and all(when != "before-step" for when, _ in self.logs.values()))

    def zeroes_after(self, step: int) -> bool:
        """Whether the loop zeroes the gradients after step ``step`` (see ``zero_grad_every``)."""
        return (step + 1) % self.zero_grad_every == 0 or step + 1 == self.resume_at

    @property
    def skips(self) -> bool:
        return bool(self.poisoned)

    def loss(self, loss_fn, model, ids, route):
        loss = loss_fn(model, ids, route)
        if self.twice:  # a second forward before the backward (DPO's chosen and rejected)
            loss = (loss + loss_fn(model, ids.flip(0), None if route is None else route.flip(0))) / 2
        return loss * float("nan") if any(ids is p for p in self._poisoned_ids) else loss

    def bind(self, data, directory=None) -> "Habits":
        """Names the poisoned micro-batches by their tensors in ``data`` (the same in both loops);
        ``directory``: where the exports go."""
        self._directory, self._weights, self._exports = directory, {}, {}
        self._poisoned_ids = [data[s][m][0] for s, m in self.poisoned]
        ids = batches(1, 1, seed=7)[0][0][0]
        routed = bool(data) and data[0][0][1] is not None  # (a MoE: its tokens spread over 4 experts)
        self._held_out = ids, ids % 4 if routed else None
        return self

    def exported(self, model, step: int, engine=None) -> None:
        """After ``step``: the reference's weights kept (``engine`` None), or the engine's exported
        and read, each compared with them."""
        if step not in self.exports:
            return
        from safetensors.torch import load_file
        if engine is None:
            self._weights[step] = {k: v.detach().clone() for k, v in model.named_parameters()}
            if _is_transformers_model(model):  # what save_pretrained writes (Mixtral: one tensor an expert)
                model.save_pretrained(Path(self._directory) / f"saved-{step}")
                self._exports[step] = load_file(Path(self._directory) / f"saved-{step}" / "model.safetensors")
            else:
                saved = model.state_dict()  # (a buffer the state dict holds is exported, as save_pretrained does)
                self._exports[step] = {**self._weights[step],
                                       **{k: v.detach().clone() for k, v in model.named_buffers() if k in saved}}
            return
        out = Path(self._directory) / f"export-{step}"
        engine.export_safetensors(out)
        params = self._weights[step]
        for name, got, want in (("export", load_file(out / "model.safetensors"), self._exports[step]),
                                ("named_parameters", dict(engine.named_parameters()), params)):
            assert set(got) == set(want), f"{name} after step {step}: other names"
            different = [k for k in want if not torch.equal(got[k].cpu(), want[k].cpu())]
            assert not different, f"{name} after step {step}: not PyTorch's weights then: {different[:3]}"

    def scheduler(self, optimizer):
        if self.lr_decay is None:
            return None
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, k=self.lr_decay: 1 / (1 + k * s))

    def logged(self, model, loss_fn, step, when, module) -> list[float]:
        if self.logs.get(step, (None,))[0] != when:
            return []
        how = self.logs[step][1]
        device = next(module.parameters()).device
        ids, route = (None if t is None else t.to(device) for t in self._held_out)
        if how == "generate":  # a few greedy tokens, as a loop shows samples while it trains
            module.eval()
            with torch.no_grad():
                out = module.generate(input_ids=ids[:2, :4], attention_mask=torch.ones_like(ids[:2, :4]),
                                      max_new_tokens=3, do_sample=False, pad_token_id=0)
            module.train()
            return [float(t) for t in out.flatten()]
        if how == "eval":
            module.eval()
        with torch.no_grad() if how != "with-grad" else contextlib.nullcontext():
            loss = loss_fn(model, ids, route).item()
        module.train()
        return [loss]


def _is_transformers_model(model) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def same_losses(a, b) -> bool:
    """Lists of losses equal, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


class _Called(Exception):
    pass


def fused_step(engine, step, loss_fn, in_backward=False, clipped=None):
    """One step's micro-batches through ``engine.forward_backward``: each given as the arguments
    ``loss_fn`` calls the model with (by name), its loss ``loss_fn``'s on the engine's output
    (``in_backward``: with ``step=True``, and ``clipped``'s ``clip_norm``)."""
    def capture(*args, **kwargs):
        raise _Called(args, kwargs)
    signature = inspect.signature(engine.model.forward)
    micro_batches = []
    for ids, route in step:
        try:
            loss_fn(capture, ids, route)
        except _Called as called:
            bound = signature.bind(*called.args[0], **called.args[1]).arguments
            var = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
            micro_batches.append({**{k: v for k, v in bound.items() if k not in var},
                                  **{k: v for n in var for k, v in bound.get(n, {}).items()}})  # **kwargs by name

    def loss_of(out, b):
        ids, route = step[next(i for i, x in enumerate(micro_batches) if x is b)]
        return loss_fn(lambda *_, **__: out, ids, route) / len(step)
    return engine.forward_backward(micro_batches, loss_of, step=in_backward, **(clipped or {}))


def _storage(storage, path: Path):
    """``check_parity``'s ``storage=``: ``"dir"`` (``path``), ``"striped"`` (two directories),
    ``"weighted"`` (two, 3 of every 4 stripes of 16 KiB in the first), ``"zarr"`` or ``"aiofiles"`` (that
    backend at ``path``), None (a temporary directory)."""
    if storage is None:
        return None
    if storage == "striped":
        return [path.with_name(path.name + "-a"), path.with_name(path.name + "-b")]
    if storage == "weighted":
        return f"posix:{path.with_name(path.name + '-a')},{path.with_name(path.name + '-b')}?stripe_bytes=16KiB" \
               f"&stripe_weights=3:1"
    return path if storage == "dir" else f"{storage}:{path}"


def check_parity(make, make_optimizer, tmp_path, *, loss_fn=lm_loss, steps=3, accumulate=1, clip=None,
                 routes=None, shapes=None, resume_at=None, host_fraction=0.4, host=None, config=None, storage="dir",
                 inspect=None, fused=False, device="cpu", habits=None, in_backward=False, **engine_kwargs):
    """Train ``make()`` in memory and through the engine (state on disk, host budget below it);
    ``shapes``: the micro-batches' (see :func:`batches`);
    with ``resume_at``, the engine is closed after that many steps and a new one resumes; ``fused``:
    the micro-batches through ``forward_backward``; both on ``device``; ``habits``: :class:`Habits`
    in both loops; ``in_backward``: the engine's step run in its last backward (``step=True``, clipped
    by ``clip_norm=clip``: a norm over it found after an update raises ``ClipTornError``). Returns
    the engine's final weights, the reference model and the engine's state bytes."""
    ref = make()
    start = copy.deepcopy(ref.state_dict())
    order = [n for n, _ in ref.named_parameters()]  # (PEFT's LoRA on a parameter moves it last in a forward)
    data = [[(ids.to(device), None if r is None else r.to(device)) for ids, r in step]
            for step in batches(steps, accumulate, routes=routes, shapes=shapes)]
    ref.to(device)
    habits = (habits or Habits()).bind(data, tmp_path)
    habits.resume_at = resume_at
    losses_ref = train(ref, make_optimizer(ref), data, loss_fn, clip, habits)

    def build(resume):
        model = make()
        model.load_state_dict(start)
        engine = Engine(model, make_optimizer(model), storage=_storage(storage, tmp_path / "state"),
                        host_memory=host, config=config, resume=resume, device=device,
                        **({"on_nonfinite": "skip"} if habits.skips else {}), **engine_kwargs)
        assert engine.state_bytes() > engine.store.capacity("host"), "the state must not fit the host budget"
        if habits.lr_decay is not None:
            engine.attach_scheduler(habits.scheduler(engine.optimizer))
        return engine

    if host is None:
        host = int(16 * sum(p.numel() for p in ref.parameters()) * host_fraction)
    engine = build(False)
    split = steps if resume_at is None else resume_at
    losses = train_engine(engine, data[:split], loss_fn, clip, fused, habits, in_backward=in_backward)
    if resume_at is not None:
        engine.close()
        engine = build(True)
        assert engine.step_count == resume_at - sum(s < resume_at for s, _ in habits.poisoned)
        losses += train_engine(engine, data[split:], loss_fn, clip, fused, habits, start=split, in_backward=in_backward)
    assert same_losses(losses, losses_ref), "losses differ from PyTorch's"
    weights = dict(engine.named_parameters())
    reference = dict(ref.named_parameters())
    assert list(weights) == order and set(reference) == set(order)
    different = [k for k, w in weights.items() if not torch.equal(w.cpu(), reference[k].detach().cpu())]
    assert not different, f"not bitwise equal to PyTorch: {different[:5]}"
    state = engine.state_bytes()
    if inspect is not None:
        inspect(engine)
    engine.close()
    return weights, ref, start, state


# ---- frozen parameters ------------------------------------------------------------------------
def _llama8(tied: bool = False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied, use_cache=False))


def _peft_llama(modules_to_save=None, **options):
    """An 8-layer Llama with PEFT's LoRA on q and v (its adapter initialised at random); ``options``:
    more of ``LoraConfig``'s."""
    peft = pytest.importorskip("peft")
    base = _llama8()
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False, modules_to_save=modules_to_save,
                                                     **options))


def _peft_llama_norm_trained():
    """``_peft_llama`` with the final norm unfrozen by hand: trained, in the export's weights, not
    in its adapter file."""
    model = _peft_llama()
    model.base_model.model.model.norm.weight.requires_grad_(True)
    return model


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"], "norm"], ids=["lora", "lora-and-head", "lora-and-norm"])
def test_a_peft_models_export_resumes_bitwise_and_is_not_taken_for_a_plain_model(tmp_path, modules_to_save):
    """A PEFT model (LoRA on q and v; and with the head in ``modules_to_save``): its export has
    PEFT's module names. With the base model's ``config.json`` beside them, ``from_pretrained``
    took it for a plain model and returned a new, randomly initialised one (every weight reported
    "MISSING"). The export now has no ``config.json`` for a PEFT model, so ``from_pretrained``
    fails loudly, and ``init_from`` into the same PEFT model (the way to change what trains)
    gives the trained weights bitwise."""
    transformers = pytest.importorskip("transformers")
    make = _peft_llama_norm_trained if modules_to_save == "norm" else functools.partial(_peft_llama, modules_to_save)
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    out = tmp_path / "export"
    weights, _, _, _ = check_parity(make, optimizer, tmp_path, loss_fn=hf_loss, host=200_000,
                                    inspect=lambda engine: engine.export_safetensors(out))
    assert "config.json" not in {f.name for f in out.iterdir()}
    with pytest.raises((OSError, ValueError)):  # no config; the adapter's base model is not named
        transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    model = make()
    with Engine(model, optimizer(model), storage=tmp_path / "again", host_memory=200_000, init_from=out) as engine:
        again = dict(engine.named_parameters())
    assert list(again) == list(weights) and all(torch.equal(again[k], weights[k]) for k in weights)


def _trains_as(engine, ref) -> None:
    """Three steps of two micro-batches through ``engine`` and PyTorch's AdamW on ``ref`` in memory:
    the engine's weights after them are ``ref``'s, bitwise. Closes the engine."""
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in batches(3, 2):
        for ids, _ in step:
            engine.backward(hf_loss(engine, ids) / 2)
            (hf_loss(ref, ids) / 2).backward()
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
    trained = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(trained[n], p) for n, p in ref.named_parameters()), "not PyTorch's training"


@pytest.mark.parametrize("options, on_meta", [({}, True), ({}, False), ({"modules_to_save": ["lm_head"]}, True),
                                              ({"use_dora": True}, True), ({"use_dora": True}, False),
                                              ({"modules_to_save": ["lm_head"], "tied": True}, True)],
                         ids=["lora-empty_init", "lora-on the CPU", "lora-and-head-empty_init", "dora-empty_init",
                              "dora-on the CPU", "lora-and-tied-head-empty_init"])
def test_init_from_reads_the_base_checkpoint_into_a_peft_model(tmp_path, on_meta, options):
    """LoRA on a pretrained model too large for memory: the base built under ``empty_init()``,
    wrapped by ``get_peft_model``, its weights read from the pretrained directory with ``init_from``.
    That was refused ("55 parameter(s) missing (base_model.model.model.embed_tokens.weight, ...)"):
    PEFT renames the base's parameters (``base_model.model.`` before, ``.base_layer`` inside a
    wrapped layer, ``modules_to_save`` copies) and adds the adapter's. The base's are now read
    under their names in the file, the adapter's start as PEFT makes them (as the model holds them,
    built on the CPU), and training is PyTorch's PEFT model's, bitwise. DoRA's magnitude, which PEFT
    computes from the base weights, is computed from the checkpoint's (it was the norm of the
    weights the model was built with, silently; under ``empty_init`` it was refused). A head tied to
    the embeddings (Llama 3.2, Qwen 2.5) and trained as a ``modules_to_save`` copy was refused
    ("1 parameter(s) missing (base_model.model.lm_head.modules_to_save.default.weight)": the file
    holds the tied tensor once, as the embeddings); the copy starts from them, as PEFT's does."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    pretrained = tmp_path / "pretrained"
    options = dict(options)
    _llama8(tied=options.pop("tied", False)).save_pretrained(pretrained)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **options)

    def build():
        config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)
        with empty_init() if on_meta else contextlib.nullcontext():
            base = transformers.LlamaForCausalLM(config)
        return peft.get_peft_model(base, peft.LoraConfig(**lora))
    model = build()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = Engine(model, optimizer, storage=tmp_path / "s", host_memory=200_000, init_from=pretrained)
    start = dict(engine.named_parameters())
    ref = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(pretrained, local_files_only=True),
                              peft.LoraConfig(**lora))
    with torch.no_grad():  # the adapter's random start, the engine's (its base weights are read, not drawn)
        for name, p in ref.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(start[name])
    assert list(start) == [n for n, _ in ref.named_parameters()]
    assert all(torch.equal(start[n], p) for n, p in ref.named_parameters()), "not the pretrained weights"
    assert all(torch.count_nonzero(w) == 0 for n, w in start.items() if ".lora_B." in n)
    _trains_as(engine, ref)


@pytest.mark.parametrize("method", ["prompt-tuning", "ia3", "loha"])
def test_init_from_reads_the_base_and_a_saved_adapter_into_peft_models_beyond_lora(tmp_path, method):
    """``init_from=BASE`` and ``init_from=[BASE, ADAPTER]`` into PEFT's other adapters, the base built
    under ``empty_init`` and wrapped as the saved adapter's config says: the base's weights and
    the adapter's are the saved ones, bitwise. A prompt-tuning model (``base_model.`` wraps the
    transformers model itself) read none of the base: every weight started at random, with a
    warning taking them for a new task head; its saved adapter stopped with "Cannot copy out of
    meta tensor". IA3 and LoHa read as saved; without their saved adapter they are refused by name:
    only LoRA's start on the meta device is known (PEFT makes theirs on the base's device)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = _llama8()
    base.save_pretrained(tmp_path / "base")
    tuned = _peft_method(method)
    with torch.no_grad():  # (trained: not where PEFT starts it)
        for p in tuned.parameters():
            if p.requires_grad:
                p.add_(0.01)
    tuned.save_pretrained(tmp_path / "adapter")
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    config.inference_mode = False
    expected = dict(tuned.named_parameters())
    for i, sources in enumerate([tmp_path / "base", [tmp_path / "base", tmp_path / "adapter"]]):
        with empty_init():
            model = peft.get_peft_model(transformers.LlamaForCausalLM(base.config), config)
        if i == 0 and method != "prompt-tuning":  # (an adapter on the meta device: only LoRA's start is known)
            with pytest.raises(ModelStructureError, match=r"PEFT.*init_from=\[BASE, ADAPTER\]"):
                Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"s{i}", host_memory="8MiB",
                       init_from=sources)
            continue
        with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"s{i}", host_memory="8MiB",
                    init_from=sources) as engine:
            weights = dict(engine.named_parameters())
        assert list(weights) == list(expected)
        differ = [k for k, w in weights.items() if not torch.equal(w, expected[k].detach())]
        trained = {k for k, p in tuned.named_parameters() if p.requires_grad}
        assert set(differ) == (trained if i == 0 else set()), differ[:4]


@pytest.mark.parametrize("options", [{}, {"modules_to_save": ["lm_head"]}, {"use_dora": True}, "pytorch files"],
                         ids=["lora", "lora-and-head", "dora", "lora-pytorch-files"])
def test_init_from_a_base_and_a_saved_adapter_continues_training_the_adapter(tmp_path, options):
    """The second stage of a LoRA recipe (SFT's adapter, then DPO or more data on it), or a run
    whose storage directory is gone: the base too large for memory, the adapter a directory PEFT's
    ``save_pretrained`` wrote. ``init_from=[BASE, ADAPTER]`` reads the base's weights from the
    checkpoint and the adapter's (DoRA's magnitudes, a ``modules_to_save`` copy) from the adapter
    file, under PEFT's keys: training is PyTorch's ``PeftModel.from_pretrained(base, ADAPTER,
    is_trainable=True)``, bitwise. Before, only the base could be read (the adapter started fresh).
    Also from PyTorch's files, as older transformers and PEFT wrote them (``pytorch_model.bin``,
    ``adapter_model.bin``): they were refused, "save it again with safe_serialization"."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    pytorch_files = options == "pytorch files"
    options = {} if pytorch_files else options
    pretrained, adapter = tmp_path / "pretrained", tmp_path / "adapter"
    _llama8().save_pretrained(pretrained)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **options)
    first = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(pretrained, local_files_only=True),
                                peft.LoraConfig(**lora))
    opt = torch.optim.AdamW([p for p in first.parameters() if p.requires_grad], lr=1e-2)
    for step in batches(2, 1, seed=5):  # the first stage, in memory
        for ids, _ in step:
            hf_loss(first, ids).backward()
        opt.step(), opt.zero_grad()
    first.save_pretrained(adapter)
    if pytorch_files:
        from safetensors.torch import load_file

        from test_conformance import as_pytorch_files
        as_pytorch_files(pretrained)
        torch.save(load_file(adapter / "adapter_model.safetensors"), adapter / "adapter_model.bin")
        (adapter / "adapter_model.safetensors").unlink()

    config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)
    with empty_init():
        base = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = Engine(model, optimizer, storage=tmp_path / "s", host_memory=200_000, init_from=[pretrained, adapter])
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(pretrained, local_files_only=True),
                                         adapter, is_trainable=True)
    start = dict(engine.named_parameters())
    assert list(start) == [n for n, _ in ref.named_parameters()]
    assert all(torch.equal(start[n], p) for n, p in ref.named_parameters()), "not the base and the adapter saved"
    assert any(torch.count_nonzero(w) for n, w in start.items() if ".lora_B." in n)  # the trained adapter
    _trains_as(engine, ref)


def test_init_from_an_adapter_that_does_not_match_the_model_is_refused(tmp_path):
    """An adapter saved with another configuration (a LoRA alpha that scales it otherwise: its
    tensors fit, the training would not be the adapter's), one missing a layer the model has, or
    an adapter alone into a model whose base weights are not there (built under ``empty_init``):
    refused naming what differs, before anything is written."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    pretrained, adapter = tmp_path / "pretrained", tmp_path / "adapter"
    _llama8().save_pretrained(pretrained)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(_llama8(), peft.LoraConfig(**lora)).save_pretrained(adapter)
    config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)

    def build(**over):
        with empty_init():
            return peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**dict(lora, **over)))
    cases = [(dict(lora_alpha=16), [pretrained, adapter],
              r"lora_alpha: 8 in the file, 16 in the model.*config.inference_mode = False; model = peft.get_peft_model"),
             (dict(target_modules=["q_proj", "v_proj", "k_proj"]), [pretrained, adapter], r"target_modules"),
             ({}, [adapter], r"only an adapter.*base.*init_from=\[BASE, "),
             ({}, [adapter, adapter], r"two adapters")]
    for i, (over, init_from, message) in enumerate(cases):
        with pytest.raises(ConfigError, match=message):
            Engine(build(**over), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"s{i}", host_memory="8MiB",
                   init_from=init_from)
        assert not [f for f in (tmp_path / f"s{i}").rglob("*") if f.is_file() and f.parent.name != ".tiered-offload"]
    with empty_init():
        plain = transformers.LlamaForCausalLM(config)
    with pytest.raises(ConfigError, match=r"not a PEFT model: wrap it first, config = peft.PeftConfig.from_pretrained"):
        Engine(plain, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "plain", host_memory="8MiB",
               init_from=[pretrained, adapter])


def test_a_damaged_saved_adapter_is_a_typed_error_naming_its_file(tmp_path):
    """``init_from=[BASE, ADAPTER]`` with an adapter directory that is not what PEFT writes (its
    config not JSON, nested without end, not an object; its tensors cut short, a header that lies,
    missing): a typed error naming the file, before anything is written; no hang."""
    from offload_core.errors import CheckpointError, CorruptionError, TieredOffloadError
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    pretrained = tmp_path / "pretrained"
    _llama8().save_pretrained(pretrained)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    config = transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)

    def damaged(name, change):
        d = tmp_path / name
        peft.get_peft_model(_llama8(), peft.LoraConfig(**lora)).save_pretrained(d)
        change(d / "adapter_config.json", d / "adapter_model.safetensors")
        return d
    cases = {
        "config not JSON": (lambda c, w: c.write_text("{r: 4"), CorruptionError, "adapter_config.json"),
        "config nested": (lambda c, w: c.write_text("[" * 100_000 + "]" * 100_000), CorruptionError, "adapter_config.json"),
        "config a list": (lambda c, w: c.write_text("[]"), CheckpointError, "adapter_config.json"),
        "config huge": (lambda c, w: c.write_bytes(b" " * (17 << 20)), CheckpointError, "adapter_config.json"),
        "tensors cut short": (lambda c, w: w.write_bytes(w.read_bytes()[:-64]), CheckpointError, "adapter_model.safetensors"),
        "a header that lies": (lambda c, w: w.write_bytes((1 << 40).to_bytes(8, "little") + w.read_bytes()[8:]),
                               CheckpointError, "adapter_model.safetensors"),
        "tensors missing": (lambda c, w: w.unlink(), CheckpointError, "adapter_model.safetensors"),
    }
    for i, (name, (change, error, file)) in enumerate(cases.items()):
        adapter = damaged(f"a{i}", change)
        with empty_init():
            model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(**lora))
        with pytest.raises(TieredOffloadError, match=file) as got:
            Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"s{i}", host_memory="8MiB",
                   init_from=[pretrained, adapter])
        assert isinstance(got.value, error), (name, got.value)
        assert not [f for f in (tmp_path / f"s{i}").rglob("*") if f.is_file() and f.parent.name != ".tiered-offload"]


def test_init_from_into_an_adapter_computed_from_the_base_weights_is_refused(tmp_path):
    """PiSSA and OLoRA compute the adapter, and a residual the base weights are replaced by, from
    the base weights when ``get_peft_model`` builds the model: from the weights it was built with,
    not the checkpoint ``init_from`` reads after. Training started from neither, silently; refused
    naming the way round, before anything is written."""
    peft = pytest.importorskip("peft")
    pretrained = tmp_path / "pretrained"
    _llama8().save_pretrained(pretrained)
    model = peft.get_peft_model(_llama8(), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="olora"))
    with pytest.raises(ConfigError, match=r"init_lora_weights='olora'.*from_pretrained, then get_peft_model"):
        Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="8MiB", init_from=pretrained)
    assert not [f for f in (tmp_path / "s").rglob("*") if f.is_file() and f.parent.name != ".tiered-offload"]


def _peft_mixtral():
    """A 4-layer Mixtral (stacked experts, a router) with LoRA on ``all-linear``: PEFT puts it on the
    router and the experts too."""
    peft = pytest.importorskip("peft")
    model = _mixtral()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, init_lora_weights=False, target_modules="all-linear"))


def _mixtral():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False))


def _gpt_oss():
    """gpt-oss (stacked experts with biases, sliding and full attention), 8 layers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 4, use_cache=False))


def _peft_gpt_oss():
    """gpt-oss with LoRA as its fine-tuning recipe puts it: every linear layer and the experts."""
    peft = pytest.importorskip("peft")
    model = _gpt_oss()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, init_lora_weights=False, target_modules="all-linear",
                                                      target_parameters=["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"]))


@pytest.mark.parametrize("model, activations, fused", [
    ("mixtral", "recompute", False), ("mixtral", "offload", True), ("gpt-oss", "recompute", True)],
    ids=["mixtral-recompute", "mixtral-offload-fused", "gpt-oss-recompute-fused"])
def test_lora_on_an_moes_router_and_experts_trains_as_pytorch(tmp_path, model, activations, fused):
    """PEFT puts LoRA on a parameter of a module that is not a linear layer (an MoE's router, its
    stacked experts: what ``all-linear`` picks on Mixtral, and ``target_parameters``, gpt-oss's
    recipe) with a ``ParamWrapper``. It registers a parametrization of that parameter in every
    forward and removes it after: PyTorch's ``set_`` of the weight onto itself (a new version) and
    the weight put back as a buffer. Through the engine a recompute stopped with PyTorch's "modified
    by an inplace operation" and ``forward_backward`` with "clone reads its values outside the
    engine's calls"; it was refused when the engine was built. Now bitwise PyTorch's, and the
    adapter exported is the one PEFT loads."""
    peft = pytest.importorskip("peft")
    out = tmp_path / "export"
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    make, base = {"mixtral": (_peft_mixtral, _mixtral), "gpt-oss": (_peft_gpt_oss, _gpt_oss)}[model]
    weights, ref, _, _ = check_parity(make, optimizer, tmp_path, loss_fn=hf_loss,
                                      accumulate=2, fused=fused, host=500_000 if model == "mixtral" else 300_000,
                                      config=EngineConfig(activations=activations),
                                      inspect=lambda engine: engine.export_safetensors(out, adapter_only=True))
    assert [n for n, m in ref.named_modules() if type(m).__name__ == "ParamWrapper"]
    assert all(n in dict(ref.named_parameters()) for n in weights), "a weight left the model's parameters"
    loaded = dict(peft.PeftModel.from_pretrained(base(), out, local_files_only=True).named_parameters())
    trained = [k for k, p in ref.named_parameters() if p.requires_grad]
    assert trained and all(torch.equal(loaded[k], weights[k]) for k in trained)


@pytest.mark.parametrize("init", [True, "gaussian", False, "dora"])
def test_a_peft_model_built_under_empty_init_starts_as_peft_initialises_it(tmp_path, init):
    """LoRA on a model too large to build in memory: the base under ``empty_init()``, then
    ``get_peft_model``. The engine initialised the adapter's ``lora_A`` / ``lora_B`` (``nn.Linear``s)
    with the model's ``_init_weights``, so ``lora_B`` was not zero: training started from a model
    other than the base, silently. The adapter now starts as PEFT's ``init_lora_weights`` makes it
    (``lora_B`` zero; ``lora_A`` Kaiming-uniform, or Gaussian of std 1/r; ``False``: ``nn.Linear``'s
    own). DoRA's magnitude, which PEFT computes from the base weights (was refused: not in memory),
    is computed from the base weights once they are initialised: their row norms (``lora_B`` is
    zero). PiSSA and OLoRA stop in ``get_peft_model`` itself, on the meta device."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = _llama8().config
    with empty_init():
        base = transformers.LlamaForCausalLM(config)
    options = {"use_dora": True} if init == "dora" else {"init_lora_weights": init}
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **options))
    with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="8MiB") as engine:
        weights = dict(engine.named_parameters())
    if init == "dora":
        magnitudes = {k: w for k, w in weights.items() if ".lora_magnitude_vector." in k}
        assert len(magnitudes) == 16
        for k, w in magnitudes.items():
            base = weights[k.split(".lora_magnitude_vector.")[0] + ".base_layer.weight"]
            assert torch.equal(w, torch.linalg.norm(base, dim=1)), k
        return
    a = [w for k, w in weights.items() if ".lora_A." in k]
    b = [w for k, w in weights.items() if ".lora_B." in k]
    assert len(a) == len(b) == 16
    def kaiming(w):  # kaiming_uniform_(a=sqrt(5)), nn.Linear's own: within 1/sqrt(fan-in), and near it
        bound = 1 / math.sqrt(w.shape[1])
        return bound / 2 < w.abs().max() <= bound
    if init is False:  # PEFT leaves both at nn.Linear's init
        assert all(kaiming(w) for w in a + b)
    else:
        assert all(torch.count_nonzero(w) == 0 for w in b)
        if init is True:
            assert all(kaiming(w) for w in a)
        else:  # normal of std 1/r
            spread = torch.cat([w.flatten() for w in a]).std().item()
            assert abs(spread - 1 / 4) < 0.03, spread


@pytest.mark.parametrize("options", [{}, {"modules_to_save": ["lm_head"]}, {"use_dora": True}],
                         ids=["lora", "lora-and-head", "dora"])
def test_a_peft_models_export_holds_its_adapter_as_peft_saves_it(tmp_path, options):
    """Beside the weights, a PEFT model's export holds its adapter as ``PeftModel.save_pretrained``
    writes it (``adapter_model.safetensors``, ``adapter_config.json``): the keys peft's own
    ``get_peft_model_state_dict`` gives, and ``PeftModel.from_pretrained`` on the base model gives
    the trained adapter bitwise (trained as PyTorch trains it)."""
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    make = functools.partial(_peft_llama, **options)
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    out = tmp_path / "export"
    weights, ref, _, _ = check_parity(make, optimizer, tmp_path, loss_fn=hf_loss, host=200_000,
                                      inspect=lambda engine: engine.export_safetensors(out))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {f.name for f in out.iterdir()}
    assert set(load_file(out / "adapter_model.safetensors")) == set(get_peft_model_state_dict(ref))
    loaded = dict(peft.PeftModel.from_pretrained(_llama8(), out, local_files_only=True).named_parameters())
    trained = [k for k, p in ref.named_parameters() if p.requires_grad]
    assert trained and all(torch.equal(loaded[k], weights[k]) for k in trained)
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in out.iterdir())


def _peft_method(method: str):
    """The 8-layer Llama with one of PEFT's other adapters on it, initialised at random."""
    peft = pytest.importorskip("peft")
    qv = ["q_proj", "v_proj"]
    config = {
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                                      init_ia3_weights=False),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=qv, init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=qv, init_weights=False),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=qv, init_weights=False, save_projection=True),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=qv, init_weights=False),
        "boft": lambda: peft.BOFTConfig(boft_block_size=8, target_modules=qv, init_weights=False),
        "fourierft": lambda: peft.FourierFTConfig(n_frequency=16, target_modules=qv, init_weights=False),
        "hra": lambda: peft.HRAConfig(r=4, target_modules=qv, init_weights=False),
        "ln-tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
        "prompt-tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }[method]
    base = _llama8()
    torch.manual_seed(1)
    return peft.get_peft_model(base, config())


@pytest.mark.parametrize("method", ["ia3", "loha", "lokr", "vera", "oft", "boft", "fourierft", "hra", "ln-tuning",
                                    "prompt-tuning"])
def test_peft_methods_beyond_lora_train_as_pytorch_and_export_what_peft_loads(tmp_path, method):
    """PEFT's other adapters (IA3, LoHa, LoKr, VeRA, OFT, BOFT, FourierFT, HRA, LayerNorm tuning,
    prompt tuning) train bitwise as PyTorch (recomputed, accumulating through ``forward_backward``),
    and the adapter exported is the one ``PeftModel.from_pretrained`` loads; a merged export is
    ``merge_and_unload()``'s where PEFT merges. The adapter export of VeRA (its shared projections
    are buffers that PEFT saves with it) stopped with PEFT's ``ValueError`` "Model was initialised
    to not save vera_A and vera_B"; prompt tuning's (PEFT runs the prompt encoder to save its
    output) with "embedding reads its values outside the engine's calls", and so did its
    ``generate()`` (PEFT embeds the tokens and computes the prompt outside the model's forward)."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    prompt = method == "prompt-tuning"

    generated = []

    def export(engine):
        engine.export_safetensors(out, adapter_only=True)
        if not prompt:  # (nothing to merge)
            engine.export_safetensors(merged, merged=True)
        engine.eval()
        generated.append(engine.model.generate(input_ids=torch.arange(8).view(1, 8), max_new_tokens=3, do_sample=False))
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    weights, ref, _, _ = check_parity(functools.partial(_peft_method, method), optimizer, tmp_path, loss_fn=hf_loss,
                                      accumulate=2, fused=True, host=150_000,
                                      config=EngineConfig(activations="recompute"), inspect=export)
    loaded = peft.PeftModel.from_pretrained(_llama8(), out, local_files_only=True)
    trained = [k for k, p in ref.named_parameters() if p.requires_grad]
    values = dict(loaded.named_parameters())
    assert trained and all(torch.equal(values[k], weights[k]) for k in trained)
    ids = torch.arange(8).view(1, 8)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, ref.eval()(ids).logits)
    assert torch.equal(generated[0], ref.generate(input_ids=ids, max_new_tokens=3, do_sample=False))
    if not prompt:
        ref.merge_and_unload().save_pretrained(tmp_path / "reference")
        expected, got = load_file(tmp_path / "reference" / "model.safetensors"), load_file(merged / "model.safetensors")
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_adaloras_rank_allocation_is_refused_naming_it_and_adalora_trains_without_it(tmp_path):
    """AdaLoRA without its rank allocation trains bitwise as PyTorch. Its allocation
    (``update_and_allocate`` between steps) reads every adapter's weights and gradients and masks
    them in place, outside the engine's calls: it stopped with "zeros_like reads its values outside
    the engine's calls ... Read weights with engine.named_parameters() (an EMA, a log)", advice that
    did not fit. It now names AdaLoRA's allocation and what the engine can do."""
    peft = pytest.importorskip("peft")

    def make():
        base = _llama8()
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.AdaLoraConfig(r=4, target_modules=["q_proj", "v_proj"], total_step=10,
                                                            init_lora_weights=False))
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731

    def allocate(engine):
        with pytest.raises(TensorStateError, match=r"lora_[AEB].*AdaLoRA's rank allocation \(update_and_allocate\)"):
            engine.model.base_model.update_and_allocate(3)
    check_parity(make, optimizer, tmp_path, loss_fn=hf_loss, host=200_000, inspect=allocate)


def test_prefix_tuning_is_refused_when_the_engine_is_built(tmp_path):
    """PEFT's prefix tuning gives every block its trained prefix as past keys and values (a cache
    object), not as a tensor input the engine streams the gradient of. It was refused at the first
    forward ("block block.0's forward reads prompt_encoder.default.embedding.weight, which requires
    grad and is neither one of the block's weights nor one of its inputs"). Now when the engine is
    built, naming the adapters that train (prompt tuning, P-tuning: the prefix as input embeddings)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama8(), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match=r"prefix tuning.*PromptTuningConfig"):
        Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="8MiB")


def _peft_gpt2():
    """GPT-2 (tied head) with LoRA on its fused attention projection: a ``Conv1D``, whose weight is
    stored transposed (PEFT's ``fan_in_fan_out``)."""
    peft = pytest.importorskip("peft")
    base = make_gpt2()
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                                     init_lora_weights=False))


@pytest.mark.parametrize("model", ["lora", "lora-and-head", "dora", "gpt2", "moe"])
def test_a_merged_export_is_peft_merge_and_unload_saved_bitwise(tmp_path, model):
    """A LoRA run's weights for ``from_pretrained`` without PEFT (what most serving takes):
    ``export_safetensors(out, merged=True)`` writes what ``model.merge_and_unload().save_pretrained(out)``
    writes of the same model trained in memory: the base model's names (no ``base_model.model.``,
    ``.base_layer``, adapter or ``original_module``; a trained ``modules_to_save`` copy in its
    module's place; a tied head once), PEFT's own merge of each layer (DoRA's too; GPT-2's
    transposed ``Conv1D``), bitwise, and ``config.json``, so ``from_pretrained`` loads it. It was not
    possible: only the adapter, or the whole PEFT model under PEFT's names, could be exported."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    options = {"lora-and-head": {"modules_to_save": ["lm_head"]}, "dora": {"use_dora": True}}.get(model, {})
    built = {"gpt2": _peft_gpt2, "moe": _peft_mixtral}.get(model, functools.partial(_peft_llama, **options))

    def make():  # the key/value cache on, as a pretrained model's config has it (the engine trains without)
        tuned = built()
        tuned.get_base_model().config.use_cache = True
        return tuned
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    out = tmp_path / "merged"
    ids = torch.arange(8).view(1, 8)

    def export(engine):  # the engine's model is left as it was: the same loss after as before
        with torch.no_grad():
            before = hf_loss(engine, ids)
            engine.export_safetensors(out, merged=True)
            assert torch.equal(hf_loss(engine, ids), before)
    _, ref, _, _ = check_parity(make, optimizer, tmp_path, loss_fn=hf_loss, host=500_000 if model == "moe" else 200_000,
                                inspect=export)
    merged = ref.merge_and_unload()
    merged.save_pretrained(tmp_path / "reference")
    expected, got = load_file(tmp_path / "reference" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected), [k for k in expected if not torch.equal(got[k], expected[k])]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, merged.eval()(ids).logits)
    config, reference = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "reference"))
    assert {k: (v, config.get(k)) for k, v in reference.items()  # (save_pretrained names float32; an export not)
            if config.get(k) != v and k != "dtype"} == {}, "not the model's config"
    # the same from the storage directory, without the engine (`tiered-offload export --merged`)
    from tiered_offload.checkpoint.state_dir import StateDirectory
    with StateDirectory(tmp_path / "state") as sd:
        sd.export(tmp_path / "offline", merged=True)
    offline = load_file(tmp_path / "offline" / "model.safetensors")
    assert list(offline) == list(got) and all(torch.equal(offline[k], got[k]) for k in got)
    assert (tmp_path / "offline" / "config.json").read_text() == (out / "config.json").read_text()


def test_a_merged_export_of_what_has_no_adapter_to_merge_is_refused(tmp_path):
    """``merged=True`` on a model that is not a PEFT model, or with ``adapter_only``, is refused
    naming the way (and PEFT's own ``save_pretrained`` names both); so are an adapter peft cannot merge (``lora_bias`` on a layer without a bias:
    peft's ``RuntimeError``) and LoRA on a head tied to the embeddings (the merge would change
    both), before anything is written."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, use_cache=False))
    for i, (lora, match) in enumerate((({"target_modules": ["q_proj"], "lora_bias": True}, r"self_attn\.q_proj: peft cannot merge"),
                                       ({"target_modules": ["lm_head"]}, r"lm_head, whose parameters are shared.*embed_tokens"))):
        model = peft.get_peft_model(copy.deepcopy(tied), peft.LoraConfig(r=4, **lora))
        with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / f"u{i}", host_memory="8MiB") as engine:
            with pytest.raises(ConfigError, match=match):
                engine.export_safetensors(tmp_path / "out", merged=True)
    with Engine(make_llama(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory="8MiB") as engine:
        with pytest.raises(ConfigError, match=r"not a PEFT model.*export_safetensors\(DIR\)"):
            engine.export_safetensors(tmp_path / "out", merged=True)
    model = peft.get_peft_model(_llama8(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "t", host_memory="8MiB") as engine:
        with pytest.raises(ConfigError, match="adapter_only.*merged"):
            engine.export_safetensors(tmp_path / "out", merged=True, adapter_only=True)
        with pytest.raises(TensorStateError, match=r"save_pretrained.*adapter_only=True.*merged=True"):
            model.save_pretrained(tmp_path / "peft")  # (PEFT's: the adapter) names the engine's two ways
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_an_export_in_a_lower_precision_is_save_pretrained_of_the_model_cast(tmp_path, dtype):
    """The state trains in fp32; what is served is mostly bf16 (half the files). An export took fp32
    only: a user converted after, reading every tensor again. ``export_safetensors(DIR, dtype=...)``
    (and ``tiered-offload export --dtype``) writes what ``model.to(dtype).save_pretrained(DIR)``
    writes of the same model trained in memory: every tensor cast as PyTorch casts it, bitwise, and
    the config's dtype."""
    import json

    from safetensors.torch import load_file

    from tiered_offload.cli import main as cli_main
    out = tmp_path / "export"

    def export(engine):
        with pytest.raises(ConfigError, match=r"dtype torch\.int8.*bfloat16, float16 or float32"):
            engine.export_safetensors(tmp_path / "bad", dtype=torch.int8)
        engine.export_safetensors(out, dtype=dtype)
    _, ref, _, _ = check_parity(make_llama, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path,
                                loss_fn=hf_loss, inspect=export)
    ref.to(dtype).save_pretrained(tmp_path / "reference")
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert cli_main(["export", str(tmp_path / "state"), str(tmp_path / "offline"), "--dtype", name]) == 0
    expected = load_file(tmp_path / "reference" / "model.safetensors")
    config = json.loads((tmp_path / "reference" / "config.json").read_text())
    for export in (out, tmp_path / "offline"):
        got = load_file(export / "model.safetensors")
        assert set(got) == set(expected), export
        assert all(got[k].dtype == dtype and torch.equal(got[k], expected[k]) for k in expected), export
        assert json.loads((export / "config.json").read_text())["dtype"] == config["dtype"] == str(dtype)[6:]
    with pytest.raises(SystemExit):  # argparse's choices
        cli_main(["export", str(tmp_path / "state"), str(tmp_path / "bad"), "--dtype", "int8"])
    assert not (tmp_path / "bad").exists()


def test_frozen_embeddings_and_block_are_never_modified_and_cost_4_bytes(tmp_path):
    weights, ref, start, state = check_parity(
        lambda: make_gpt2(frozen=True), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        tmp_path, loss_fn=hf_loss, clip=1.0, accumulate=2)
    frozen = [k for k, p in ref.named_parameters() if not p.requires_grad]
    assert "transformer.wpe.weight" in frozen and any(k.startswith("transformer.h.0.") for k in frozen)
    for k in frozen:
        assert torch.equal(weights[k], start[k]), f"{k} is frozen but changed"
    trained = [k for k, p in ref.named_parameters() if p.requires_grad]
    assert all(not torch.equal(weights[k], start[k]) for k in trained if k.endswith("weight"))
    n_frozen = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    n_trained = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert state == 4 * n_frozen + 16 * n_trained  # weights only for a frozen parameter


def test_lora_adapters_on_frozen_linears(tmp_path):
    def adapters_only(model):
        return torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-2)

    def make():
        model = make_lora()
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.requires_grad_(False)
        return model
    weights, ref, start, state = check_parity(make, adapters_only, tmp_path, clip=0.5, accumulate=2, resume_at=2,
                                              steps=4)
    for k in weights:
        assert torch.equal(weights[k], start[k]) == ("lora_" not in k), k
    n_lora = sum(p.numel() for n, p in ref.named_parameters() if "lora_" in n)
    n_all = sum(p.numel() for p in ref.parameters())
    assert state == 4 * n_all + 12 * n_lora


# ---- parameter groups ---------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_three_groups_with_their_own_lr_and_weight_decay(optimizer, tmp_path):
    def make_optimizer(model):
        groups = hf_groups(model)
        if optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1)
    check_parity(make_llama, make_optimizer, tmp_path, loss_fn=hf_loss, clip=1.0, accumulate=2, steps=4, resume_at=2)


def test_param_groups_drive_schedulers_and_per_group_changes(tmp_path):
    model = make_llama()
    ref = copy.deepcopy(model)
    engine = Engine(model, torch.optim.AdamW(hf_groups(model), lr=1e-3), storage=tmp_path / "s", host_memory="1MiB")
    opt = torch.optim.AdamW(hf_groups(ref), lr=1e-3)
    assert [g["weight_decay"] for g in engine.param_groups] == [0.1, 0.0, 0.0]
    assert [g["lr"] for g in engine.param_groups] == [1e-3, 1e-3, 3e-3]
    sched_e = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.5 ** s)
    sched_r = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in batches(3, 1):
        ids = step[0][0]
        engine.backward(hf_loss(engine, ids))
        hf_loss(ref, ids).backward()
        engine.param_groups[1]["weight_decay"] = opt.param_groups[1]["weight_decay"] = 0.05
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
        sched_e.step(), sched_r.step()
        assert [g["lr"] for g in engine.param_groups] == [g["lr"] for g in opt.param_groups]
    reference = dict(ref.named_parameters())
    assert all(torch.equal(w, reference[k]) for k, w in engine.named_parameters())
    engine.close()


@pytest.mark.parametrize("attached", [False, True])
def test_a_tensor_learning_rate_moved_by_a_scheduler_updates_with_the_steps_own(tmp_path, attached):
    """``AdamW(params, lr=torch.tensor(1e-2))`` (PyTorch's form for a rate it may change without a
    recompile) and a scheduler: it sets the new rate in place (``lr.fill_``), and the engine's step,
    still running in the background or deferred to the next forward, read the tensor then: every
    parameter differed from the first step on. Now a step holds its own copy of its rates."""
    model = make_llama()
    ref = copy.deepcopy(model)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2)), storage=tmp_path / "s",
                    host_memory=16 * sum(p.numel() for p in ref.parameters()) * 4 // 10)
    opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2))
    sched_e = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.5 ** s)
    sched_r = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    if attached:
        engine.attach_scheduler(sched_e)
    for step in batches(3, 1):
        ids = step[0][0]
        engine.backward(hf_loss(engine, ids))
        hf_loss(ref, ids).backward()
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
        if not attached:
            sched_e.step()
        sched_r.step()
        assert float(engine.param_groups[0]["lr"]) == float(opt.param_groups[0]["lr"])
        reference = dict(ref.named_parameters())
        assert all(torch.equal(w, reference[k]) for k, w in engine.named_parameters())
    engine.close()


def test_parameters_left_out_of_the_optimizer_are_never_modified(tmp_path):
    left_out = ("norm.weight", "norm.bias", "blocks.1.ffn.up.weight")

    def make_optimizer(model):
        return torch.optim.AdamW([p for n, p in model.named_parameters() if n not in left_out], lr=1e-2)
    # they still get gradients (and so count in clipping, as torch.nn.utils.clip_grad_norm_ does)
    weights, ref, start, state = check_parity(lambda: TinyLM(MLP), make_optimizer, tmp_path, clip=0.1, steps=3,
                                              host_fraction=0.7)
    for k in left_out:
        assert torch.equal(weights[k], start[k]), k
    n_out = sum(dict(ref.named_parameters())[k].numel() for k in left_out)
    n_all = sum(p.numel() for p in ref.parameters())
    assert state == 16 * n_all - 8 * n_out  # weights and gradients, no optimizer state


# ---- parameters without a gradient --------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_expert_without_tokens_is_skipped_like_torch_optim(optimizer, tmp_path):
    """Expert 3 gets no token until step 3 and expert 0 none in step 2: each is skipped by the steps it
    missed (no decay, no moment update, its step count unchanged), across a resume."""
    routes = [[0, 1], [1, 2], [0, 1, 2], [3, 1], [0, 3]]

    def make_optimizer(model):
        if optimizer == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)
    weights, ref, start, _ = check_parity(make_moe, make_optimizer, tmp_path, routes=routes, steps=5, resume_at=3,
                                          clip=1.0)
    assert not torch.equal(weights["blocks.0.ffn.experts.3.up.weight"], start["blocks.0.ffn.experts.3.up.weight"])


def test_expert_never_routed_keeps_its_initial_weights(tmp_path):
    weights, _, start, _ = check_parity(make_moe, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.5),
                                        tmp_path, routes=[[0, 1, 2]] * 3, steps=3)
    for k in weights:
        if ".experts.3." in k:
            assert torch.equal(weights[k], start[k]), k


# ---- the rest of the parity coverage ------------------------------------------------------------------
def test_units_larger_than_the_optimizer_chunk_and_the_state_piece(tmp_path):
    config = EngineConfig(optimizer_chunk_numel=1000, state_piece_numel=2500)
    check_parity(make_llama, lambda m: torch.optim.AdamW(hf_groups(m), lr=1e-3), tmp_path, loss_fn=hf_loss,
                 clip=1.0, steps=4, resume_at=2, config=config)


def test_dropout_is_replayed_bitwise_by_the_recompute(tmp_path):
    check_parity(lambda: make_gpt2(dropout=0.1), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), tmp_path,
                 loss_fn=hf_loss, steps=3)


def test_background_step_overlapped_with_the_forward(tmp_path, monkeypatch):
    seen = {}

    def make_optimizer(model):
        return torch.optim.AdamW(hf_groups(model), lr=1e-3)
    original = Engine._update_unit

    def spy(self, *args):
        import threading
        seen["thread"] = threading.current_thread().name
        return original(self, *args)
    monkeypatch.setattr(Engine, "_update_unit", spy)
    # (0.6 of the state: the least budget at which the step may overlap the forward is 0.56 here;
    # below it overlap_step=True is refused, test_engine.py's
    # test_a_step_mode_forced_below_its_budget_is_refused_up_front)
    check_parity(make_llama, make_optimizer, tmp_path, loss_fn=hf_loss, steps=3, clip=1.0, host_fraction=0.6,
                 config=EngineConfig(overlap_step=True))
    assert seen["thread"] == "tiered-offload-step"


def test_storage_none_uses_a_temporary_directory(tmp_path):
    check_parity(make_lora, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), tmp_path, storage=None,
                 host_fraction=0.6)


def test_optimizer_instance_on_a_meta_model(tmp_path):
    """The optimizer built over empty_init() parameters, as a user does before the engine exists."""
    ref = make_llama()
    with empty_init():
        model = make_llama()
    engine = Engine(model, torch.optim.AdamW(hf_groups(model), lr=1e-3), storage=tmp_path / "s",
                    host_memory="1MiB", init_from=_save(ref, tmp_path))
    opt = torch.optim.AdamW(hf_groups(ref), lr=1e-3)
    for step in batches(2, 1):
        ids = step[0][0]
        engine.backward(hf_loss(engine, ids))
        hf_loss(ref, ids).backward()
        engine.step(), opt.step()
        engine.zero_grad(), opt.zero_grad()
    reference = dict(ref.named_parameters())
    assert all(torch.equal(w, reference[k]) for k, w in engine.named_parameters())
    engine.close()


def _save(model, tmp_path):
    from safetensors.torch import save_file
    path = tmp_path / "init.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.named_parameters()}, path)
    return path


# ---- what a loop does besides training ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["no-grad", "with-grad"])
@pytest.mark.parametrize("commit_every", [1, 2], ids=["journal", "snapshot"])
def test_a_resume_draws_from_the_random_state_of_its_last_step(tmp_path, commit_every, how):
    """A held-out loss logged in training mode after each step (dropout draws random numbers) and
    a resume: the resume restores the random state as it was at the last step, not as the loop left
    it at ``close()``, so a loop that failed in the middle of the next step (it drew for that step's
    forward, then closed) redoes the step as a run never stopped does. The numbers the loop drew
    after the step are drawn again: the reference does the same (``Habits.resume_at``), and is
    PyTorch's otherwise, bitwise. (``tools/fuzz_options.py`` drew this; a first fix that kept the
    random state at ``close()`` broke the resume after a refused step in ``test_train.py``.)"""
    check_parity(lambda: make_gpt2(dropout=0.1), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path,
                 loss_fn=hf_loss, steps=3, resume_at=1, host_fraction=0.6, durable=True, commit_every=commit_every,
                 habits=Habits(logs={0: ("after-step", how), 1: ("after-step", how)}))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_a_nan_loss_skips_its_step_and_the_schedule_as_pytorchs_loop_would(tmp_path, fused):
    """``on_nonfinite="skip"``: a step with a NaN micro-batch leaves the weights, the optimizer's
    state and the attached LR schedule as a PyTorch loop that skips ``step()`` on a non-finite
    gradient; a resume after it starts from the steps that ran; held-out losses logged around it;
    the weights exported and read after it are PyTorch's then."""
    check_parity(make_llama, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss,
                 steps=4, accumulate=2, clip=1.0, resume_at=2, fused=fused, durable=True,
                 habits=Habits(poisoned=((1, 1),), lr_decay=0.5, exports=(1, 3),
                               logs={1: ("before-step", "eval"), 2: ("after-step", "with-grad")}))


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_a_loop_that_zeroes_every_second_step_adds_to_the_clipped_gradients(tmp_path, fused):
    """Gradients kept past a clipped step (``zero_grad()`` every second step): the next backwards
    add to what PyTorch's clipping left in place, the next clip measures that, and a skipped step
    in between forgets them; across a resume (zeroed before it)."""
    check_parity(make_llama, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss,
                 steps=6, accumulate=2, clip=0.5, resume_at=2, fused=fused, durable=True,
                 habits=Habits(zero_grad_every=2, poisoned=((4, 1),)))


def test_a_resume_after_a_skipped_first_step_draws_from_the_random_state_the_engine_was_built_with(tmp_path):
    """A NaN in the first step (skipped: it commits nothing) with dropout, then a resume: the last
    commit is the engine's construction, so the resume restores the random state as it was then,
    and the loop redoes the next step's draws as a run started afresh does. (``tools/fuzz_options.py
    --seed 74119``: the reference kept the random state the skipped step's draws left, and the
    losses after the resume differed.)"""
    check_parity(lambda: make_gpt2(dropout=0.1), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
                 tmp_path, loss_fn=hf_loss, steps=3, accumulate=2, resume_at=1, host_fraction=0.3, fused=True,
                 durable=True, habits=Habits(poisoned=((0, 0),)))


# ---- resume with groups ---------------------------------------------------------------------------
def test_resume_restores_groups_and_refuses_other_groups(tmp_path):
    model = make_llama()
    engine = Engine(model, torch.optim.AdamW(hf_groups(model), lr=1e-3), storage=tmp_path / "s", host_memory="1MiB")
    ids = batches(1, 1)[0][0][0]
    engine.backward(hf_loss(engine, ids))
    engine.param_groups[2]["lr"] = 7e-4
    engine.step()
    engine.close()
    # Engine.resume with no optimizer rebuilds the saved groups by name, with their saved hyperparameters
    resumed = Engine.resume(tmp_path / "s", make_llama(), host_memory="1MiB")
    assert [g["lr"] for g in resumed.param_groups] == [1e-3, 1e-3, 7e-4]
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.0, 0.0]
    resumed.close()
    other = make_llama()
    groups = hf_groups(other)
    groups[0]["params"] = groups[0]["params"][1:]
    groups[1]["params"] = [*groups[1]["params"], hf_groups(other)[0]["params"][0]]
    with pytest.raises(CheckpointError, match=r"group 0 holds 'model\.embed_tokens\.weight' in the saved state but not now"):
        Engine(other, torch.optim.AdamW(groups, lr=1e-3), storage=tmp_path / "s", host_memory="1MiB", resume=True)


def test_an_optimizer_over_foreign_or_stepped_parameters_is_refused():
    model = TinyLM(MLP)
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        Engine(model, torch.optim.AdamW([nn.Parameter(torch.zeros(3))]), storage="memory", host_memory="4MiB")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lm_loss(model, torch.randint(0, VOCAB, (2, 9))).backward()
    opt.step()
    with pytest.raises(ConfigError, match="already stepped"):
        Engine(model, opt, storage="memory", host_memory="4MiB")
    with pytest.raises(ConfigError, match="optimizer_kwargs"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), dict(lr=0.2), storage="memory", host_memory="4MiB")


# ---- the minimum budget ---------------------------------------------------------------------------
def test_the_minimum_budget_named_by_the_error_is_accepted_and_trains(tmp_path):
    make = lambda: TinyLM(MLP, d=32, layers=4)  # noqa: E731
    with pytest.raises(TierCapacityError) as e:
        Engine(make(), torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "a", host_memory="64KiB")
    figure = re.search(r"Raise host_memory to at least ([0-9.]+ [KMG]iB)", str(e.value)).group(1)
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), tmp_path, host=figure, steps=3, clip=1.0)


def test_every_budget_the_engine_accepts_trains_where_its_tensors_are_small(tmp_path):
    """A LoRA model's adapter is many tensors of a few KiB (each block's gradients, Adam's m and v),
    each taking a 4 KiB-aligned block of the memory tier. The plan took the state for fitting by
    its bytes (189 KiB in a 192 KiB budget) and kept every block's graph as plain PyTorch; its
    aligned tensors needed 228 KiB, and the first forward died with ``TierCapacityError``. Every
    budget from the minimum up now trains, PyTorch's bitwise: the state is kept whole only where
    its tensors, as the tier stores them, fit."""
    make = functools.partial(_peft_llama, None)
    optimizer = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)  # noqa: E731
    ref = make()
    start = copy.deepcopy(ref.state_dict())
    data = batches(2, 1)
    train(ref, optimizer(ref), data, hf_loss, None)
    expected = dict(ref.named_parameters())
    probe = make()
    with Engine(probe, optimizer(probe), storage=tmp_path / "probe", host_memory="1MiB") as engine:
        low, state = engine.minimum_budget(), engine.state_bytes()
    # the minimum, between, and every 12 KiB from under the state's bytes past its aligned tensors' (1.2x here)
    for i, budget in enumerate(sorted({low, (low + state) // 2, *range(state - 8192, int(1.25 * state), 12 * 1024)})):
        model = make()
        model.load_state_dict(start)
        with Engine(model, optimizer(model), storage=tmp_path / str(i), host_memory=budget) as engine:
            train_engine(engine, data, hf_loss, None, False)
            weights = dict(engine.named_parameters())
        assert all(torch.equal(weights[k], w) for k, w in expected.items()), budget


# ---- module buffers ---------------------------------------------------------------------------------
class NormedMLP(nn.Module):
    """A block with BatchNorm (running statistics, num_batches_tracked) and a step counter that the
    output depends on: a recompute that saw the counter after its forward would compute another thing."""

    def __init__(self, d):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)
        self.mlp = MLP(d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(d), persistent=False)

    def forward(self, x, route=None):
        h = self.bn(x.transpose(1, 2)).transpose(1, 2) * (1.0 + 0.01 * self.calls)
        if self.training:
            self.calls += 1
        return self.mlp(h)


def test_buffers_end_each_step_as_pytorch_leaves_them_and_survive_resume_and_export(tmp_path):
    from safetensors.torch import load_file

    def make():
        torch.manual_seed(0)
        return TinyLM(NormedMLP)
    make_optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    ref = make()
    data = batches(4, 2)
    train(ref, make_optimizer(ref), data, lm_loss, clip=1.0)
    reference = dict(ref.named_buffers())
    assert int(reference["blocks.0.ffn.calls"]) == 8 and int(reference["blocks.0.ffn.bn.num_batches_tracked"]) == 8

    model = make()
    engine = Engine(model, make_optimizer(model), storage=tmp_path / "s", host_memory="96KiB")
    assert engine.state_bytes() > engine.store.capacity("host") and engine.recompute
    train_engine(engine, data[:2], lm_loss, 1.0)
    engine.close()
    model = make()
    engine = Engine(model, make_optimizer(model), storage=tmp_path / "s", host_memory="96KiB", resume=True)
    assert int(dict(engine.named_buffers())["blocks.0.ffn.calls"]) == 4  # restored with the step
    train_engine(engine, data[2:], lm_loss, 1.0)
    mine = dict(engine.named_buffers())
    assert list(mine) == list(reference)
    assert all(torch.equal(mine[k], reference[k]) for k in reference), [k for k in reference if not torch.equal(mine[k], reference[k])]
    weights = dict(ref.named_parameters())
    assert all(torch.equal(w, weights[k]) for k, w in engine.named_parameters())
    files = engine.export_safetensors(tmp_path / "out")
    engine.close()
    exported = load_file(next(f for f in files if f.suffix == ".safetensors"))
    assert torch.equal(exported["blocks.3.ffn.bn.running_var"], reference["blocks.3.ffn.bn.running_var"])
    assert int(exported["blocks.1.ffn.calls"]) == 8 and "blocks.1.ffn.scratch" not in exported  # persistent ones only
    assert set(exported) == set(ref.state_dict())
    from tiered_offload.checkpoint.state_dir import StateDirectory
    with StateDirectory(tmp_path / "s") as sd:  # the offline export (`tiered-offload export`) has them too
        offline = load_file(next(f for f in sd.export(tmp_path / "out2") if f.suffix == ".safetensors"))
    assert all(torch.equal(offline[k], exported[k]) for k in exported)


class BigTable(nn.Module):
    """An MLP block with a large persistent buffer it never changes (a registered lookup table)."""

    def __init__(self, d):
        super().__init__()
        self.mlp = MLP(d)
        self.register_buffer("table", torch.arange(64 * 1024, dtype=torch.float32))

    def forward(self, x, route=None):
        return self.mlp(x) + 1e-9 * self.table[:x.shape[-1]]


def _state_files(directory):
    from tiered_offload.checkpoint.durable import STATE_DIR, StateFiles
    files = StateFiles(directory / STATE_DIR)
    return files, files.read_manifest()


def _trained(block, directory, steps):
    """An engine on a TinyLM of ``block`` blocks, at a budget below its state, after ``steps`` steps."""
    torch.manual_seed(0)
    model = TinyLM(block)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=directory, host_memory="96KiB")
    train_engine(engine, batches(steps, 1), lm_loss, 1.0)
    return engine


def test_buffers_live_in_one_checksummed_extent_not_in_json(tmp_path):
    """Persistent buffers are a checksummed extent the meta names: a 1 MiB buffer costs no JSON, an
    unchanged one is written once, a changing one leaves no older extents behind."""
    _trained(BigTable, tmp_path / "s", 3).close()
    files, manifest = _state_files(tmp_path / "s")
    entry = manifest["meta"]["buffer_file"]
    assert "buffers" not in manifest["meta"] and entry["extent"] == "model.buffers@0"  # never changed: written once
    assert len(files.manifest_path.read_bytes()) < 64 * 1024 < entry["nbytes"]  # 4 x 256 KiB of buffers, not in JSON
    assert sorted(entry["tensors"]) == [f"blocks.{i}.ffn.table" for i in range(4)]

    engine = _trained(NormedMLP, tmp_path / "n", 4)  # running statistics change every step
    engine.wait_committed()
    files, manifest = _state_files(tmp_path / "n")
    assert manifest["meta"]["buffer_file"]["extent"] == "model.buffers@4"
    on_disk = [k for k in engine.store.backend.keys() if k.startswith("model.buffers@")]
    assert on_disk == ["model.buffers@4"] or sorted(on_disk) == ["model.buffers@3", "model.buffers@4"], on_disk
    engine.close()


def test_buffers_of_a_format2_state_in_json_still_load(tmp_path):
    """A state written before buffers had their extent (format 2: base64 JSON in the meta) resumes
    with them; its next commit moves them into an extent."""
    from tiered_offload.checkpoint.durable import encode_tensor

    def make():
        torch.manual_seed(0)
        return TinyLM(NormedMLP)
    data = batches(4, 1)
    ref = make()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, lm_loss, clip=1.0)
    model = make()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s", host_memory="96KiB")
    train_engine(engine, data[:2], lm_loss, 1.0)
    saved = dict(engine.named_buffers())
    engine.close()
    files, manifest = _state_files(tmp_path / "s")
    persistent = set(manifest["meta"].pop("buffer_file")["tensors"])
    manifest["meta"]["buffers"] = {k: encode_tensor(v) for k, v in saved.items() if k in persistent}
    manifest["format"] = "tiered-offload/2"
    files.write_manifest(manifest)
    from storage_backends.base import key_to_filename
    for extent in {"model.buffers@0", "model.buffers@1", "model.buffers@2"}:
        (tmp_path / "s" / key_to_filename(extent)).unlink(missing_ok=True)
    assert not any("buffers" in p.name for p in (tmp_path / "s").iterdir())
    model = make()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s", host_memory="96KiB",
                    resume=True)
    assert int(dict(engine.named_buffers())["blocks.0.ffn.calls"]) == 2
    train_engine(engine, data[2:], lm_loss, 1.0)
    mine, reference = dict(engine.named_buffers()), dict(ref.named_buffers())
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    engine.close()
    assert "buffer_file" in _state_files(tmp_path / "s")[1]["meta"]


def test_a_damaged_buffer_extent_is_refused_typed_and_verify_names_it(tmp_path):
    from offload_core.errors import CorruptionError
    from tiered_offload.checkpoint.state_dir import StateDirectory
    _trained(NormedMLP, tmp_path / "s", 2).close()
    files, manifest = _state_files(tmp_path / "s")
    from storage_backends.base import key_to_filename
    path = tmp_path / "s" / key_to_filename(manifest["meta"]["buffer_file"]["extent"])
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x10
    path.write_bytes(bytes(raw))
    with StateDirectory(tmp_path / "s") as sd:
        report = sd.verify()
    assert not report["ok"] and report["damaged"][0]["tensor"] == "model buffers"
    assert report["damaged"][0]["file"].endswith(key_to_filename("model.buffers@2"))
    torch.manual_seed(0)
    model = TinyLM(NormedMLP)
    with pytest.raises(CorruptionError, match=r"model\.buffers%402 \(the model's buffers\) does not match its checksum"):
        Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s", host_memory="96KiB",
               resume=True)
    assert path.exists()  # nothing committed was deleted
    manifest["meta"]["buffer_file"]["extent"] = "../../outside@1"  # a hostile name is refused before any read
    files.write_manifest(manifest)
    with pytest.raises(CorruptionError, match=r"buffer_file\.extent.*not a buffer extent"):
        StateDirectory(tmp_path / "s")


# ---- a large untied embedding and head stream like blocks -------------------------------------------
def test_untied_embedding_and_head_stream_like_blocks_bitwise(tmp_path):
    config = EngineConfig(stream_modules_numel=1)  # every untied Embedding / Linear outside the blocks

    def make_optimizer(model):
        return torch.optim.AdamW(hf_groups(model), lr=1e-3)
    check_parity(make_llama, make_optimizer, tmp_path, loss_fn=hf_loss, clip=1.0, accumulate=2, steps=4, resume_at=2,
                 config=config)
    model = make_llama()
    model.model.embed_tokens.requires_grad_(False)  # frozen: streamed for its forward, skipped in backward
    engine = Engine(model, make_optimizer(model), storage=tmp_path / "frozen", host_memory="1MiB", config=config)
    assert [u.name for u in engine.blocks][0] == "module.model.embed_tokens"
    assert [u.name for u in engine.blocks][-1] == "module.lm_head"
    engine.close()
    check_parity(lambda: _frozen(make_llama()), make_optimizer, tmp_path / "f", loss_fn=hf_loss, clip=1.0, steps=2,
                 config=config)


def _frozen(model):
    model.model.embed_tokens.requires_grad_(False)
    return model


def test_minimum_budget_follows_the_largest_parameter_not_the_sum_of_the_non_block_ones():
    """A Llama-style model with a 16K vocabulary, untied: embedding and head (2M parameters each)
    dwarf a block; streamed, only one of them is resident with its gradient at a time."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=16384, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)

    def need(config):
        with empty_init():
            model = transformers.LlamaForCausalLM(cfg)
        with pytest.raises(TierCapacityError) as e:
            Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage="memory", host_memory="64KiB", config=config)
        return int(re.search(r"\((\d+) bytes\) needed", str(e.value)).group(1))
    streamed, bound = need(EngineConfig()), need(EngineConfig(stream_modules_numel=None))
    big = 16384 * 128 * 4  # one vocabulary matrix, fp32
    block = 4 * 128 * 128 * 4 + 3 * 128 * 256 * 4  # attention (q, k, v, o with 2 kv heads: <= 4 d^2) + MLP, fp32
    assert bound >= 4 * big  # embedding and head weights and gradients, all at once
    # the rule: the largest parameter's weights and gradient, two blocks' weights, one block's
    # gradients, the small rest, plus a fixed amount: one 16 MiB piece of each of the 2 optimizer
    # states (the step streams them) and the slack (at most one piece here)
    mib = 1 << 20
    assert streamed <= 2 * big + 3 * block + 64 * 1024 + 2 * 16 * mib + 16 * mib, (streamed, big)
    assert streamed < bound


def test_engine_config_is_validated_and_its_layout_choices_are_checked_by_resume(tmp_path):
    with pytest.raises(ConfigError, match="state_piece_numel"):
        EngineConfig(state_piece_numel=0)
    model = make_lora()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), storage=tmp_path / "s", host_memory="1MiB",
                    config=EngineConfig(state_piece_numel=500))
    assert any(len(u.pieces()) > 1 for u in engine.units)
    engine.close()
    model = make_lora()
    with pytest.raises(CheckpointError, match="units differ"):
        Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), storage=tmp_path / "s", host_memory="1MiB",
               resume=True)


# ---- saved activations through the tiers (no recompute) ----------------------------------------------
def _normed():
    torch.manual_seed(0)
    return TinyLM(NormedMLP)


ACTIVATION_CASES = {
    # name: (make, optimizer, loss, streamed blocks, check_parity options)
    "gpt2-frozen-dropout": (lambda: make_gpt2(frozen=True, dropout=0.1),
                            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), hf_loss, 4,
                            dict(host_fraction=0.7)),
    "lora": (lambda: _adapters_only(make_lora(d=96)),  # wide enough that the weights outweigh the activations
             lambda m: torch.optim.AdamW([p for n, p in m.named_parameters() if "lora_" in n], lr=1e-2), lm_loss, 4,
             dict(host_fraction=0.25)),  # the state is 29% of 16 bytes per parameter
    "moe-idle-experts": (make_moe, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), lm_loss, 4,
                         dict(routes=[[0, 1], [1, 2], [0, 3]], host_fraction=0.7)),  # SGD: 12 bytes per parameter
    "llama-groups-streamed-head": (make_llama, lambda m: torch.optim.AdamW(hf_groups(m), lr=1e-3), hf_loss, 6,
                                   dict(stream_modules_numel=1)),
    "batchnorm-buffers": (_normed, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), lm_loss, 4, {}),
}


def _adapters_only(model):
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("case, mode", [(c, m) for c in ACTIVATION_CASES for m in ("keep", "offload", "mixed")
                                         if m != "keep" or c in ("gpt2-frozen-dropout", "batchnorm-buffers")],
                         ids=lambda v: v)  # ("mixed": keep, offload and recompute, a block each)
def test_saved_activations_through_the_store_are_bitwise(case, mode, tmp_path):
    """Each block's saved tensors go into the store (kept in the host tier, or offloaded to disk at
    once), and backward runs the graph the forward built: bitwise PyTorch, with accumulation,
    clipping and a resume; dropout without any RNG replay; buffers updated once per forward."""
    make, make_optimizer, loss_fn, n, options = ACTIVATION_CASES[case]
    options = {"host_fraction": 0.9, **options}  # of 16 bytes per parameter: most of the state (frozen ones: 4)
    stream = options.pop("stream_modules_numel", 0)
    modes = [mode] * n if mode != "mixed" else [("keep", "offload", "recompute")[i % 3] for i in range(n)]
    seen = {}

    def inspect(engine):
        seen["modes"] = engine.activation_modes
        seen["bytes"] = dict(engine._streamer.activation_bytes)
        seen["disk"] = engine.stats().bytes_written
        seen["left"] = [k for k in engine.store.keys() if "activations" in k]
    check_parity(make, make_optimizer, tmp_path, loss_fn=loss_fn, clip=1.0, accumulate=2, steps=3, resume_at=2,
                 config=EngineConfig(activations=modes, stream_modules_numel=stream),
                 inspect=inspect, **options)
    assert seen["modes"] == modes  # no block fell back to recomputation
    assert all(seen["bytes"][i] > 0 for i in range(n) if modes[i] != "recompute")
    assert seen["left"] == []  # every backward let go of its block's activations


@pytest.mark.parametrize("mode", ["offload", "mixed"])
def test_saved_activations_with_a_device_tier_are_bitwise(mode, tmp_path):
    """The same with the GPU's three tiers on the CPU (a device tier of CPU memory with its own
    budget): offloaded activations leave the device for the host tier, and the disk if it must."""
    make, make_optimizer, loss_fn, n, options = ACTIVATION_CASES["gpt2-frozen-dropout"]
    modes = [mode] * n if mode != "mixed" else [("keep", "offload", "recompute")[i % 3] for i in range(n)]
    state = 16 * sum(p.numel() for p in make().parameters())
    seen = {}

    def inspect(engine):
        seen["modes"] = engine.activation_modes
        seen["device"] = engine.stats().bytes_read[Tier.DEVICE]
    check_parity(make, make_optimizer, tmp_path, loss_fn=loss_fn, clip=1.0, accumulate=2, steps=3, resume_at=2,
                 config=EngineConfig(activations=modes), inspect=inspect, host_fraction=0.5,
                 store_config={"device_budget_bytes": state // 2})
    assert seen["modes"] == modes
    assert seen["device"] > 0  # copies left the device tier


# ---- forward_backward: the micro-batches through each block together ----------------------------------
FUSED_CASES = {
    "moe-routes-resume": (make_moe, dict(routes=[[0, 1], [2], [1, 3]], resume_at=2)),
    "buffers-changed-per-micro-batch": (_normed, dict(host_fraction=0.7)),
    "gpt2-frozen-keep-offload": (lambda: make_gpt2(frozen=True),
                                 dict(loss_fn=hf_loss, config=EngineConfig(activations=["keep", "offload"] * 2),
                                      host_fraction=0.7)),
    "llama-groups-device-tier": (make_llama, dict(loss_fn=hf_loss, make_optimizer=lambda m: torch.optim.AdamW(hf_groups(m), lr=1e-3),
                                                  host_fraction=0.6,
                                                  device_fraction=0.4)),
    "gpt2-dropout-replays-the-loops-draws": (lambda: make_gpt2(dropout=0.1), dict(loss_fn=hf_loss)),
    "gpt2-dropout-device-tier-resume": (lambda: make_gpt2(dropout=0.1), dict(loss_fn=hf_loss, host_fraction=0.6,
                                                                             device_fraction=0.4, resume_at=2)),
    # a parameter outside the blocks given to every block (DeBERTa's relative embeddings): each
    # micro-batch's blocks add their gradients in one sum of its own, as the loop's backwards do
    "deberta-a-parameter-given-to-every-block": (make_deberta, dict(loss_fn=hf_loss)),
    "deberta-kept-offloaded-recomputed": (make_deberta, dict(loss_fn=hf_loss, config=EngineConfig(
        activations=["keep", "offload", "recompute"] * 2), host_fraction=0.7)),
}


@pytest.mark.parametrize("activations, fused, host_fraction", [
    ("recompute", False, 0.4), ("offload", False, 0.4), ("keep", True, 0.6), ("recompute", True, 0.4),
    ("keep", False, 0.7)])
def test_hugging_face_gradient_checkpointing_trains_bitwise(tmp_path, activations, fused, host_fraction):
    """``model.gradient_checkpointing_enable()`` (what HF Trainer's ``gradient_checkpointing=True``
    does): each decoder layer wraps its own forward in ``torch.utils.checkpoint``, whose recompute
    runs in backward outside the engine's call of the block, on weights the engine had let go. It
    failed there ("weight of shape [0]"). Inside the engine a block runs with it off: the engine
    recomputes blocks itself, or keeps their graphs. PyTorch computes the same values with it on and
    off (checked on this model), so this is bitwise PyTorch's with it on, dropout included."""
    def make():
        model = make_gpt2(dropout=0.1)
        # Trainer's default kwargs for the fused case (use_reentrant=True, which autograd.grad refuses)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None if fused else {"use_reentrant": False})
        return model
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss, accumulate=2,
                 fused=fused, host_fraction=host_fraction, config=EngineConfig(activations=activations))


class CheckpointedMLP(nn.Module):
    """A block part that calls ``torch.utils.checkpoint`` on its MLP itself."""

    def __init__(self, d, reentrant):
        super().__init__()
        self.mlp, self.reentrant = MLP(d), reentrant

    def forward(self, x, route=None):
        return torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_checkpoint_inside_a_block_trains_bitwise_or_is_a_clear_error(tmp_path, activations):
    """``torch.utils.checkpoint`` inside a block recomputes its part in the backward, calling the
    block's modules: they hold the block's weights during the engine's backward of it (it failed
    with "mat2 must be a matrix"). The reentrant kind cannot give weights their gradients alone
    (autograd.grad with inputs): a ConfigError that names the block and the fix."""
    def make(reentrant):
        torch.manual_seed(0)
        return TinyLM(lambda d: CheckpointedMLP(d, reentrant), d=32, layers=4)
    config = EngineConfig(activations=activations)
    check_parity(lambda: make(False), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path / "a",
                 config=config)
    with pytest.raises(ConfigError, match="block.3 calls torch.utils.checkpoint with use_reentrant=True"):
        check_parity(lambda: make(True), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path / "b",
                     config=config)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_a_model_wider_than_float32_is_refused_at_construction(tmp_path, dtype):
    """A float64 (or complex) model was trained as float32 with an info line: other numbers than
    PyTorch's training of the same model, at half its precision, without a warning. The engine's
    state is fp32, so such a model is now refused when the engine is built, naming the parameters
    and ``model.float()`` (the training it would give)."""
    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    model.blocks[1].ffn.up.to(dtype)
    with pytest.raises(ConfigError, match=r"blocks\.1\.ffn\.up\.weight.*(float64|complex64).*model\.float\(\)"):
        Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=1 << 20)


def test_a_bfloat16_model_trains_as_pytorch_after_model_float(tmp_path, caplog):
    """A model built in bfloat16 (Hugging Face's ``from_config`` honours a config's ``torch_dtype``,
    as Llama's say) is trained as float32: the engine's state is fp32. That is PyTorch's training of
    ``model.float()``, bitwise, and the engine says so when it is built."""
    import logging
    caplog.set_level(logging.INFO, logger="tiered_offload")
    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4).to(torch.bfloat16)
    ref = copy.deepcopy(model).float()
    data = batches(3, 2)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, lm_loss, 1.0)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 2) as engine:
        assert engine.state_bytes() > engine.store.capacity("host")
        assert any("bfloat16 parameters are trained as float32" in r.getMessage() for r in caplog.records)
        assert train_engine(engine, data, lm_loss, 1.0) == expected
        weights = dict(engine.named_parameters())
    assert all(w.dtype == torch.float32 and torch.equal(w, ref.get_parameter(k).detach()) for k, w in weights.items())


def test_saving_the_models_own_state_dict_is_a_clear_error(tmp_path):
    """The weights live in the store: ``model.state_dict()`` held empty placeholders (and no
    streamed block at all), so ``torch.save(model.state_dict(), ...)`` and Hugging Face's
    ``save_pretrained`` silently saved nothing of the training. Now both raise, naming
    ``engine.export_safetensors``; that export loads back into a fresh model. Loading weights
    into it raises too, naming ``init_from``."""
    transformers = pytest.importorskip("transformers")
    model = make_gpt2()
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 3) as engine:
        engine.backward(hf_loss(engine, torch.randint(0, VOCAB, (2, 9))))
        engine.step()
        with pytest.raises(TensorStateError, match="engine.export_safetensors"):
            model.state_dict()
        with pytest.raises(TensorStateError, match="engine.export_safetensors"):
            model.save_pretrained(tmp_path / "hf")
        with pytest.raises(TensorStateError, match="init_from"):
            model.load_state_dict(make_gpt2().state_dict())
        engine.export_safetensors(tmp_path / "export")
        weights = dict(engine.named_parameters())
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    assert all(torch.equal(weights[k], p) for k, p in loaded.named_parameters())


def test_a_checkpoint_inside_a_block_trains_bitwise_where_the_state_fits(tmp_path):
    """The whole state in memory: the blocks keep their graphs as in PyTorch, and the recompute of a
    checkpoint inside one runs in the user's backward: the modules hold the weights until then."""
    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: CheckpointedMLP(d, False), d=32, layers=4)
    ref = make()
    model = make()
    data = batches(3, 2)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, lm_loss, 1.0)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=2 * state) as engine:
        assert engine.activation_modes is None  # nothing streams: PyTorch's graphs
        assert train_engine(engine, data, lm_loss, 1.0) == expected
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


def test_an_update_on_the_host_beside_the_forward_leaves_room_for_offloaded_activations(tmp_path):
    """The update on the host overlapping the next forward pins a unit's weights, gradients and
    state pieces in the host tier, where the forward moves its offloaded activations from the
    device tier. A fuzzed run failed mid-step: "cannot fit tensor 'block.0/activations' (75.69
    KiB) in the host tier: budget 252.00 KiB, in use 112.00 KiB, pinned 107.25 KiB, largest free
    block 68.00 KiB" (the room was there, split into holes by the update's pins). The forward now
    waits for the unit's update to let go (``TieredStore.brief``); bitwise PyTorch's."""
    state = 16 * sum(p.numel() for p in make_gpt2().parameters())
    check_parity(make_gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss,
                 steps=5, accumulate=2, clip=1.0, host_fraction=0.3, durable=False,
                 store_config={"device_budget_bytes": int(state * 0.6), "tier_caching": "inclusive"},
                 config=EngineConfig(activations="offload", optimizer_device="host", overlap_step=True,
                                     state_piece_numel=1024),
                 inspect=lambda engine: engine.overlap_step and engine._updater.in_lower_tier or pytest.fail())


def test_a_loss_computed_with_grad_and_dropped_leaves_a_shared_inputs_gradient_whole(tmp_path):
    """DeBERTa gives its relative embeddings (one tensor) to every block. A forward with grad whose
    loss is only logged and let go counted its blocks as users still to run their backward: the
    next backward's last block kept the running sum for them, and the step failed with "a tensor
    was given to several streamed blocks...". A dropped graph now uncounts its blocks
    (``SharedInputs.dropped``); training after it is PyTorch's, bitwise."""
    ref = make_deberta()
    start = copy.deepcopy(ref.state_dict())
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    hf_loss(ref, x).backward()
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    model = make_deberta()
    model.load_state_dict(start)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state * 2 // 5) as engine:
        logged = hf_loss(engine, x).item()  # with grad, never back-propagated
        loss = hf_loss(engine, x)
        assert loss.item() == logged
        engine.backward(loss)
        engine.step()
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


@pytest.mark.parametrize("activations", ["offload", "recompute"])
@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_forward_backward_pass_an_error_undid_leaves_no_shared_input_counted(tmp_path, activations, failing_call):
    """An error in a micro-batch's forward undoes ``forward_backward``'s pass and the loop runs the
    micro-batches. The pass's blocks stayed counted as users of DeBERTa's relative embeddings, and
    a later step failed ("a tensor was given to several streamed blocks...": a fuzzed run, the
    error there a mid-step TierCapacityError). The pass's entries end with it, and a block whose
    forward raised uncounts its uses; bitwise PyTorch's."""
    calls = [0]

    def make():
        model = make_deberta()

        def fails_once(mod, args, out):
            calls[0] += 1
            if calls[0] == 4 + failing_call:  # (the reference's 4 forwards first) the engine's first pass
                raise RuntimeError("a transient error (test)")
        model.deberta.encoder.layer[2].intermediate.register_forward_hook(fails_once)
        return model
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss, steps=2,
                 accumulate=2, fused=True, config=EngineConfig(activations=activations))
    assert calls[0] > 4 + failing_call


def test_the_options_fuzz_tells_bitwise_from_refused_from_failed(tmp_path, monkeypatch):
    """``tools/fuzz_options.py`` (random combinations of the engine's options against PyTorch): a
    case that trains bitwise is ``ok``; a typed error while the engine is built is ``refused``; the
    same error once training runs is a failure (raised), and the engines it built are closed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    case = dict(make=make_gpt2, make_optimizer=fuzz_options.OPTIMIZERS["AdamW"], loss_fn=hf_loss, steps=2,
                accumulate=1, clip=1.0, host_fraction=0.4, durable=False, config={}, store_config={})
    assert fuzz_options.run(case, tmp_path / "a") == "ok"
    assert fuzz_options.run(dict(case, host_fraction=0.05), tmp_path / "b").startswith("refused: the host budget")
    built = []
    real_init = Engine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(Engine, "step", lambda self: (_ for _ in ()).throw(TierCapacityError("mid-step (test)")))
    with pytest.raises(TierCapacityError, match="mid-step"):
        fuzz_options.run(case, tmp_path / "c")
    assert built and all(e.store is None for e in built)  # closed
    for seed in range(20):  # every drawn configuration is one EngineConfig accepts
        EngineConfig(**fuzz_options.draw(random.Random(seed), fuzz_options.models())[1]["config"])


def test_the_wide_options_fuzz_draws_more_and_the_seeds_it_found_failures_with_draw_them_again(tmp_path):
    """``tools/fuzz_options.py --wide`` adds encoder-decoders, frozen parameters, LoRA and parameter
    groups, and leaves what a seed draws without it as it was (the docs name the seeds of its
    failures). Its seed 57 (BART, Hugging Face's two groups, an export after a step) failed: the
    test's reference compared the export with the model's parameters, and the export holds BART's
    ``final_logits_bias`` buffer too, as ``save_pretrained``'s does; the reference now keeps the
    buffers the state dict holds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    case = fuzz_options.draw(random.Random(74049), fuzz_options.models())[0]
    assert (case["model"], case["optimizer"], case["accumulate"]) == ("moe", "Adadelta", 3)
    wide = fuzz_options.models(wide=True)
    drawn = [fuzz_options.draw(random.Random(seed), wide, True) for seed in range(60)]
    assert {c["model"] for c, _ in drawn} == set(wide) and "AdamW-groups" in {c["optimizer"] for c, _ in drawn}
    case, kw = drawn[57]
    assert (case["model"], case["optimizer"], case["habits"].exports) == ("bart-dropout", "AdamW-groups", (1,))
    assert fuzz_options.run(kw, tmp_path) == "ok"
    # --stores: the storage and the store's options from a generator of their own, the rest as without it
    stored = [fuzz_options.draw(random.Random(seed), wide, True, random.Random(f"stores-{seed}"))[1]
              for seed in range(60)]
    assert {kw["storage"] for kw in stored} == {"dir", "striped", "weighted", "aiofiles", "zarr"}
    assert not any(kw["storage"] == "zarr" and kw["durable"] for kw in stored)  # (zarr's refused)
    assert all(kw["config"] == plain[1]["config"] for kw, plain in zip(stored, drawn))


def test_the_loops_fuzz_draws_what_loops_do_and_its_seeds_train_bitwise(tmp_path):
    """``tools/fuzz_options.py --loops`` adds Mixtral's load-balancing loss, Hugging Face's gradient
    checkpointing, micro-batches whose forward runs in ``eval()`` mode or that switch to it before
    their backward, ``clip_grad_value_``, two forwards before a backward and micro-batches of other
    shapes, from a third generator. Its seed 251 (GPT-2 with dropout, recomputed, a forward in
    ``eval()`` mode and an ``eval()`` before a backward) trained other weights: a recompute ran in
    the mode of the moment of its backward. Its seed 219
    (Mixtral, exports) failed the test's own check, which compared the export with the parameters:
    the export is ``save_pretrained``'s checkpoint layout, one tensor an expert."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    zoo = fuzz_options.models(loops=True)
    drawn = {seed: fuzz_options.draw(random.Random(seed), zoo, False, None, random.Random(f"loops-{seed}"))
             for seed in range(120)}
    assert {c["model"] for c, _ in drawn.values()} == set(zoo)
    assert {how for c, _ in drawn.values() for how in c["habits"].modes.values()} == {"eval-forward", "eval-backward"}
    assert all(any(getattr(c["habits"], what) for c, _ in drawn.values()) for what in ("clip_value", "twice"))
    assert any({b for step in c.get("shapes", ()) for b in step} - {(2, 9)} for c, _ in drawn.values())
    assert not any((c["habits"].modes or c["habits"].twice) and (c["fused"] or c["model"] == "gpt2-checkpointed")
                   for c, _ in drawn.values())  # (where the modes cannot switch, or PyTorch's own recompute fails)
    for seed, want in ((251, ("gpt2-dropout", "recompute")), (219, ("mixtral-aux", "offload"))):
        case, kw = fuzz_options.draw(random.Random(seed), zoo, False, None, random.Random(f"loops-{seed}"))
        assert (case["model"], case["config"]["activations"]) == want
        assert fuzz_options.run(kw, tmp_path / str(seed)) == "ok", seed


def test_the_calls_fuzz_draws_one_tensor_in_two_places_of_a_block_call_and_its_seeds_train_bitwise(tmp_path):
    """``tools/fuzz_options.py --calls`` adds block calls that take one tensor in two places
    (``block(h, h)``) or return one twice, and a block's unsaved input changed in place after it ran;
    a seed without the flag draws what it drew. On the code before ``block_nodes.slotted``, its seed
    119038 (one input twice) lost the first place's gradient and 119024 (one output twice, a resume)
    added each place's gradient apart. Its seed 121014 (the update beside the forward, no room for
    a recompute's checkpoint in the store) recomputed from the input the model had changed since:
    the checkpoint kept in memory was the caller's tensor (``SavedActivations.keep_as_read``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    every = fuzz_options.models(True, True, True, calls=True)
    assert set(every) - set(fuzz_options.models(True, True, True)) == {
        "same-input-twice", "output-twice", "unsaved-in-place"}
    before = fuzz_options.draw(random.Random(74049), fuzz_options.models())[0]
    assert (before["model"], before["optimizer"], before["accumulate"]) == ("moe", "Adadelta", 3)
    for seed, model in ((119038, "same-input-twice"), (119024, "output-twice"), (121014, "unsaved-in-place")):
        case, kw = fuzz_options.draw(random.Random(seed), every, True, random.Random(f"stores-{seed}"),
                                     random.Random(f"loops-{seed}"))
        assert case["model"] == model
        assert fuzz_options.run(kw, tmp_path / str(seed)) == "ok", seed


def test_the_zoo_fuzz_draws_shared_and_computed_weights_and_its_seeds_train_bitwise(tmp_path):
    """``tools/fuzz_options.py --zoo`` adds ALBERT (its layers share weights), a model that calls
    blocks twice, and linear layers under ``weight_norm`` and ``spectral_norm``, and leaves what a
    seed draws without it as it was. Its seeds 111079 and 111265 (spectral_norm, two forwards before
    a backward; kept and recomputed) trained other weights: the weight is read twice in a call, and
    the engine summed each call's two uses before adding the calls
    (``repeated_calls.first_arrivals``). Its seed 113144 (without the other flags: a held-out loss
    in training mode after the step a resume starts from) failed the test's reference: that forward
    advanced spectral_norm's buffers, and the resume restores the commit's, as the step found them;
    the reference now restores them too. Its seed 115101 (Mixtral's router logits, the aiofiles
    backend, a held-out loss with grad) was refused mid-step: the backend's I/O tasks held the
    forward's context, so the logged forward's graph outlived it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    zoo, plain = fuzz_options.models(True, True, zoo=True), fuzz_options.models(True, True)
    drawn = [fuzz_options.draw(random.Random(seed), zoo, True, None, random.Random(f"loops-{seed}"))[0]
             for seed in range(40)]
    assert {c["model"] for c in drawn} == set(zoo) and set(zoo) - set(plain) == {
        "albert", "albert-dropout", "repeats", "weight-norm", "spectral-norm"}
    before = fuzz_options.draw(random.Random(74049), fuzz_options.models())[0]
    assert (before["model"], before["optimizer"], before["accumulate"]) == ("moe", "Adadelta", 3)
    for seed, want in ((111079, "keep"), (111265, "auto")):
        case, kw = fuzz_options.draw(random.Random(seed), zoo, True, random.Random(f"stores-{seed}"),
                                     random.Random(f"loops-{seed}"))
        assert (case["model"], case["habits"].twice, case["config"]["activations"]) == ("spectral-norm", True, want)
        assert fuzz_options.run(kw, tmp_path / str(seed)) == "ok", seed
    case, kw = fuzz_options.draw(random.Random(115101), zoo, True, random.Random("stores-115101"),
                                 random.Random("loops-115101"))  # (test_backends.py: the asyncio context)
    assert (case["model"], case["storage"], case["config"]["activations"]) == ("mixtral-aux", "aiofiles", "offload")
    assert fuzz_options.run(kw, tmp_path / "115101") == "ok"
    case, kw = fuzz_options.draw(random.Random(113144), fuzz_options.models(zoo=True))
    assert (case["model"], case["resume_at"], case["habits"].logs[1]) == ("spectral-norm", 2, ("after-step", "with-grad"))
    assert fuzz_options.run(kw, tmp_path / "113144") == "ok"


def test_the_bare_fuzz_draws_a_model_of_blocks_only_whose_resumes_train_bitwise(tmp_path):
    """``tools/fuzz_options.py --bare`` adds a model whose every parameter is in a block (the engine's rest unit
    empty), and leaves what a seed draws without it as it was. Its seed 141554 (a resume at step 2) failed with
    an untyped ExtentNotFoundError on the rest unit's 0-byte tensor, which has no file
    (test_durable.py::test_a_model_with_no_parameter_outside_its_streamed_units_resumes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_options
    bare = fuzz_options.models(True, zoo=True, bare=True)
    assert set(bare) - set(fuzz_options.models(True, zoo=True)) == {"blocks-only"}
    case, kw = fuzz_options.draw(random.Random(141554), bare, True, random.Random("stores-141554"))
    assert (case["model"], case["resume_at"]) == ("blocks-only", 2)
    assert fuzz_options.run(kw, tmp_path) == "ok"


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_parity_with_several_intra_op_threads(tmp_path, fused):
    """The suite runs one intra-op thread (``conftest.SUITE_THREADS``); users run many. With two,
    and tensors large enough that PyTorch splits their kernels between them (the activations and
    the MLP's weights over 32768 elements, matrix products the BLAS splits), what the engine runs
    on threads of its own (each micro-batch's backward in ``forward_backward``, the update beside
    the forward) is bitwise PyTorch's on the same two threads, clipping included."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.get_num_threads() == 2

        def make():
            torch.manual_seed(0)
            return TinyLM(MLP, d=192, layers=3)
        check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), tmp_path, steps=2, accumulate=2,
                     clip=1.0, shapes=[[(8, 48), (8, 48)]] * 2, fused=fused, host_fraction=0.5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_forward_backward_gives_the_loops_gradients_bitwise(case, tmp_path, monkeypatch):
    """``engine.forward_backward`` over 3 micro-batches per step trains bitwise as PyTorch's loop of
    backwards: MoE routes, a resume, buffers each micro-batch's forward changes, kept and offloaded
    activations, a device tier, groups; dropout (random numbers drawn in the forward): the first
    step of an engine runs the loop and learns what each block draws, the next ones draw the loop's
    numbers through each block together."""
    make, options = FUSED_CASES[case]
    options = dict(options)
    make_optimizer = options.pop("make_optimizer", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    device_fraction = options.pop("device_fraction", 0)
    if device_fraction:
        state = 16 * sum(p.numel() for p in make().parameters())
        options["store_config"] = {"device_budget_bytes": int(state * device_fraction)}
    from tiered_offload.engine import micro_batches
    as_loop, loop = [], micro_batches._loop
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: as_loop.append(1) or loop(*a))
    loops = {}
    check_parity(make, make_optimizer, tmp_path, clip=1.0, accumulate=3, steps=3, fused=True,
                 inspect=lambda e: loops.update(e.stats().forward_backward_loops), **options)
    # with dropout, an engine's first step ran the loop (the resumed one's too); no other step did
    assert len(as_loop) == (("resume_at" in options) + 1 if "dropout" in case else 0)
    # and the engine says why (the last engine: its first call)
    assert list(loops.values()) == ([1] if "dropout" in case else []), loops
    assert all(w == "micro-batch 0 at block 0's forward drew other random numbers than none" for w in loops), loops


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["vertical", "loop-first"])
def test_forward_backward_under_autocast_casts_each_micro_batchs_weights_for_it(tmp_path, dropout):
    """BART uses its shared embedding three times (two embeddings, the tied head). Under one
    autocast region over several micro-batches, PyTorch reuses its cached bf16 cast of that weight
    across them, and the weight's gradient then adds its three parts in another order: other bits
    than the usual loop, whose autocast region holds one forward each. ``forward_backward``'s pass
    gave each micro-batch its own casts (each runs on a thread of its own); its loop (an engine's
    first step with dropout) did not, and trained other bits than PyTorch (``tools/fuzz_options.py
    --wide``, seed 85177). Both now cast for each micro-batch afresh: the usual loop's values."""
    from test_conformance import bart, seq2seq_loss
    check_parity(functools.partial(bart, dropout), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), tmp_path,
                 loss_fn=seq2seq_loss, steps=2, accumulate=2, fused=True, habits=Habits(autocast=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the GPU check runs it (tools/gpu_check.py)")
@pytest.mark.parametrize("make", [make_llama, lambda: make_gpt2(dropout=0.1)], ids=["llama", "gpt2-dropout"])
def test_forward_backward_on_cuda_gives_the_loops_gradients_bitwise(make, tmp_path, deterministic, monkeypatch):
    """On a GPU: each micro-batch's backward on its own thread with autograd's device threads off
    (the CPU runs a backward on the calling thread already), device and host budgets below the
    state; bitwise PyTorch's loop on the same GPU, with groups and clipping, and no hang. With
    dropout (CUDA's Philox offsets replayed) only the first step runs the loop."""
    from tiered_offload.engine import micro_batches
    as_loop, loop = [], micro_batches._loop
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: as_loop.append(1) or loop(*a))
    state, loops = 16 * sum(p.numel() for p in make().parameters()), {}
    check_parity(make, lambda m: torch.optim.AdamW(hf_groups(m), lr=1e-3), tmp_path, loss_fn=hf_loss, clip=1.0,
                 accumulate=3, steps=3, fused=True, host_fraction=0.6, device="cuda", device_memory=int(0.4 * state),
                 config=EngineConfig(optimizer_device="device"),  # the reference's optimizer runs on the GPU
                 inspect=lambda e: loops.update(e.stats().forward_backward_loops))
    assert len(as_loop) == (1 if make is not make_llama else 0), loops  # (the engine's reasons)
    assert list(loops.values()) == ([] if make is make_llama else [1]), loops


def _fused_paths(make, steps, loss_fn, monkeypatch, tmp_path, before_step=lambda s: None, host_fraction=0.5):
    """``steps`` (each a list of micro-batches: keyword arguments of the model) trained by PyTorch's
    loop and through ``engine.forward_backward``; asserts the losses, weights and the RNG after them
    are bitwise alike; returns each step's path: "u" a pass undone, "l" the loop, "p" a pass."""
    from tiered_offload.engine import micro_batches
    ref = make()
    start = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(5)
    expected = []
    for s, step in enumerate(steps):
        before_step(s)
        for b in step:
            loss = loss_fn(ref(**b), b) / len(step)
            loss.backward()
            expected.append(loss.item())
        opt.step()
        opt.zero_grad()
    ref_rng = torch.get_rng_state()
    model = make()
    model.load_state_dict(start)
    calls = []
    loop, vertical = micro_batches._loop, micro_batches._vertical
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: calls.append("l") or loop(*a))
    monkeypatch.setattr(micro_batches, "_vertical",
                        lambda *a: (lambda r: calls.append("p" if r is not None else "u") or r)(vertical(*a)))
    n = sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                host_memory=int(16 * n * host_fraction)) as engine:
        torch.manual_seed(5)
        losses = []
        for s, step in enumerate(steps):
            before_step(s)
            losses += [x.item() for x in engine.forward_backward(step, lambda out, b: loss_fn(out, b) / len(step))]
            engine.step()
            engine.zero_grad()
            calls.append("|")
        weights = dict(engine.named_parameters())
    assert losses == expected
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())
    assert torch.equal(torch.get_rng_state(), ref_rng)  # the passes leave the generator where the loop does
    return "".join(calls).split("|")[:-1]


def test_forward_backward_with_dropout_keeps_a_script_per_shape_of_micro_batches(tmp_path, monkeypatch):
    """Dropout draws as many numbers as a tensor has elements: micro-batches of another length draw
    another count. Each shape learns its script once, by a loop (the pass undone at its first turn),
    and runs passes from then on: the last step of an epoch, shorter, does not cost the others theirs."""
    g = torch.Generator().manual_seed(2)
    steps = [[{"input_ids": (ids := torch.randint(0, VOCAB, (2, n), generator=g)), "labels": ids} for _ in range(3)]
             for n in [9, 7, 9, 7, 9, 9, 7]]
    paths = _fused_paths(lambda: make_gpt2(dropout=0.1), steps, lambda out, b: out.loss, monkeypatch, tmp_path)
    assert paths == ["ul", "ul", "p", "p", "p", "p", "p"]


class _DrawsBy(nn.Module):
    """An MLP that draws ``count[0]`` numbers in training (normal ones with ``normal``) and adds
    them in (scaled small): draws that depend on something other than the micro-batches' shapes."""

    def __init__(self, d, count, normal=False):
        super().__init__()
        self.mlp, self.count, self.draw = MLP(d), count, torch.randn if normal else torch.rand

    def forward(self, x, route=None):
        out = self.mlp(x)
        return out + 1e-3 * self.draw(self.count[0]).sum() if self.training else out


@pytest.mark.parametrize("layers", [3, 4], ids=["odd-normal-samples", "even-normal-samples"])
def test_forward_backward_runs_the_loop_alone_where_no_script_can_replay_the_draws(layers, tmp_path, monkeypatch):
    """A small randn draws normal numbers in pairs and keeps the second in the CPU generator's state:
    after an odd count (one per block, three blocks) the state holds a sample that counted draws
    never reach: no script. The calls after it with micro-batches of that shape run the loop without
    trying a pass (and without counting again), bitwise PyTorch's loop. An even count (four blocks)
    ends with no sample kept and is replayed: its uniform draws are counted."""
    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: _DrawsBy(d, [1], normal=True), layers=layers)
    g = torch.Generator().manual_seed(3)
    steps = [[{"ids": torch.randint(0, VOCAB, (2, 9), generator=g)} for _ in range(3)] for _ in range(4)]
    paths = _fused_paths(make, steps, lambda out, b: F.cross_entropy(out[:, :-1].flatten(0, 1), b["ids"][:, 1:].flatten()),
                         monkeypatch, tmp_path, host_fraction=0.75)
    assert paths == (["ul", "l", "l", "l"] if layers % 2 else ["ul", "p", "p", "p"])


def test_forward_backward_stops_trying_passes_whose_draws_the_script_misses(tmp_path, monkeypatch):
    """Draws that change while the shapes stay: each such pass is undone where its first
    micro-batch's loss is checked, and the loop runs. After two misses in a row the loop runs alone
    until two loops in a row draw alike; then passes again. Every step bitwise PyTorch's loop."""
    count = [1]
    counts = [1, 2, 1, 2, 2, 2, 2]

    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: _DrawsBy(d, count))
    g = torch.Generator().manual_seed(3)
    steps = [[{"ids": torch.randint(0, VOCAB, (2, 9), generator=g)} for _ in range(3)] for _ in counts]
    paths = _fused_paths(make, steps, lambda out, b: F.cross_entropy(out[:, :-1].flatten(0, 1), b["ids"][:, 1:].flatten()),
                         monkeypatch, tmp_path, before_step=lambda s: count.__setitem__(0, counts[s]), host_fraction=0.75)
    assert paths == [
        "ul",  # nothing learned yet: undone at the first turn; the loop learns 1 draw per block
        "ul",  # 2 draws: the pass misses (a miss in a row); the loop learns 2
        "ul",  # 1 draw: the second miss in a row
        "l",   # 2: the loop alone, learning 2 again, unlike the 1 before
        "l",   # 2: as the loop before drew: passes again
        "p",
        "p"]


def test_forward_backward_reads_each_block_once_for_all_micro_batches(tmp_path):
    """4 micro-batches at a quarter of the state: the loop reads the blocks' weights and gradients
    from the disk 4-5 times per step, forward_backward about as often as for one micro-batch.

    How many units the lookahead finds still cached depends on when the background work finishes:
    on a loaded machine the reads vary by a few units either way (a total at 1.17x one
    micro-batch's failed an earlier form of this test on CI; 1.05-1.12x here, weights alone up to
    1.18x with the cores busy). So the test bounds the weights and gradients at 1.5x, which tells
    one pass from the loop's four; the issue's target on the total (<= 1.15x) is the benchmark's,
    from medians of several steps: ``python tools/bench_train.py --accumulate 4``."""
    def run(mode, accumulate, directory):
        torch.manual_seed(0)
        model = TinyLM(MLP, d=64, layers=6)
        engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=directory,
                        host_memory=4 * sum(p.numel() for p in model.parameters()))
        data = batches(3, accumulate)
        train_engine(engine, data[:1], lm_loss, 1.0, mode == "fused")  # the first step settles the plan
        before = engine.store.stats
        train_engine(engine, data[1:], lm_loss, 1.0, mode == "fused")
        read = engine.store.stats.by_kind(("disk->host", "disk->device"), since=before)
        engine.close()
        return {kind: n / 2 for kind, n in read.items()}
    one, loop = run("loop", 1, tmp_path / "one"), run("loop", 4, tmp_path / "loop")
    fused = run("fused", 4, tmp_path / "fused")
    runs = {"one": one, "loop": loop, "fused": fused}
    blocks = {name: r.get("weight", 0) + r.get("grad", 0) for name, r in runs.items()}
    assert blocks["loop"] > 3 * blocks["one"], (one, loop, fused)
    assert blocks["fused"] <= 1.5 * blocks["one"], (one, loop, fused)
    assert sum(fused.values()) < 0.5 * sum(loop.values()), (one, loop, fused)


class _FailsOffTheMainThread(nn.Module):
    """An MLP that raises on any thread but the main one (as ``torch.cuda.set_device("cuda")``, with
    no index, did on every micro-batch's thread on the GPU)."""

    def __init__(self, d):
        super().__init__()
        self.mlp = MLP(d)

    def forward(self, x, route=None):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("only the main thread may run this")
        return self.mlp(x)


def test_forward_backward_says_why_it_ran_the_loop(tmp_path, caplog):
    """An error only a pass's thread raises: the loop runs (the loop's gradients, bitwise, as
    PyTorch's loop) and the engine says so: a warning naming the error, and
    ``stats().forward_backward_loops`` counting the calls by reason (the GPU check ran every step
    as the loop, silently, until it did)."""
    def make():
        torch.manual_seed(0)
        return TinyLM(_FailsOffTheMainThread, layers=6)
    loops = {}
    with caplog.at_level(logging.INFO, logger="tiered_offload"):
        check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=3,
                     steps=3, fused=True, host_fraction=0.6, inspect=lambda e: loops.update(e.stats().forward_backward_loops))
    why = "micro-batch 0 raised RuntimeError"
    assert loops == {why: 3}, loops
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and f"{why} (only the main thread may run this)" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]  # once per reason


def test_forward_backward_stops_where_the_loop_stops(tmp_path):
    """A non-finite loss in the third micro-batch: the loop's error after the first two backwards
    (or, with on_nonfinite='skip', the step skipped); a model error: the loop's ModelInputError."""
    from offload_core.errors import ModelInputError, NonFiniteError
    data = [ids for ids, _ in batches(1, 3)[0]]

    def loss_fn(out, b):
        loss = F.cross_entropy(out[:, :-1].flatten(0, 1), b[:, 1:].flatten())
        return loss * float("inf") if b is data[2] else loss

    def build(name, **kwargs):
        torch.manual_seed(0)
        model = TinyLM(MLP)
        return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / name,
                      host_memory="96KiB", **kwargs)
    fused, loop = build("fused"), build("loop")
    with pytest.raises(NonFiniteError):
        fused.forward_backward(data, loss_fn)
    with pytest.raises(NonFiniteError):
        for b in data:
            loop.backward(loss_fn(loop(b), b))
    # the first two micro-batches' gradients, as the loop left them
    assert torch.equal(fused.clip_grad_norm_(1e9), loop.clip_grad_norm_(1e9))
    assert fused.step() and loop.step()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fused.named_parameters(), loop.named_parameters()))
    fused.zero_grad()
    with pytest.raises(ModelInputError):
        fused.forward_backward([data[0], data[1].float()], lambda out, b: out.sum())
    fused.close(), loop.close()
    skipping = build("skip", on_nonfinite="skip")
    assert not torch.isfinite(skipping.forward_backward(data, loss_fn)[2])  # as the loop: every loss returned
    assert not skipping.step() and skipping.step_count == 0
    skipping.close()


def test_two_forwards_alive_at_once_and_a_forward_never_backpropagated(tmp_path):
    """Accumulating by summing two forwards' losses keeps two graphs' activations in the store at
    once; a forward whose graph is dropped without a backward leaves nothing behind."""
    ref = make_lora(d=64)
    start = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(2, 2)
    for step in data:
        (lm_loss(ref, step[0][0]) + lm_loss(ref, step[1][0])).backward()
        opt.step()
        opt.zero_grad()
    model = make_lora(d=64)
    model.load_state_dict(start)
    n = sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s",
                    host_memory=int(16 * n * 0.3), config=EngineConfig(activations="keep"))
    assert engine.state_bytes() > engine.store.capacity("host")
    lm_loss(engine, data[0][0][0])  # a forward with grad whose graph is dropped at once
    import gc
    gc.collect()
    for step in data:
        a, b = lm_loss(engine, step[0][0]), lm_loss(engine, step[1][0])
        assert len([k for k in engine.store.keys() if "activations" in k]) == 8  # both graphs' (the orphans' gone)
        engine.backward(a + b)
        assert [k for k in engine.store.keys() if "activations" in k] == []
        engine.step()
        engine.zero_grad()
    assert engine.activation_modes == ["keep"] * 4
    assert all(torch.equal(w, dict(ref.named_parameters())[k]) for k, w in engine.named_parameters())
    engine.close()


# ---- evaluation -------------------------------------------------------------------------------------
def test_eval_mode_is_honoured_and_leaves_the_training_untouched(tmp_path):
    """``model.eval()`` turns dropout off in the streamed blocks as in PyTorch: a no-grad evaluation
    forward gives PyTorch's outputs bitwise (the same three times), and the next training step
    (its dropout RNG included) is the one PyTorch takes."""
    ref = make_gpt2(dropout=0.1)
    start = copy.deepcopy(ref.state_dict())
    model = make_gpt2(dropout=0.1)
    model.load_state_dict(start)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), storage=tmp_path / "s",
                    host_memory=int(16 * sum(p.numel() for p in ref.parameters()) * 0.4))
    assert engine.state_bytes() > engine.store.capacity("host")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))

    def train_step(forward, backward, step, zero):
        loss = forward(input_ids=ids, labels=ids).loss
        backward(loss)
        step()
        zero()
        return loss.item()

    def evaluate(forward):
        with torch.no_grad():
            return [forward(input_ids=ids).logits for _ in range(3)]
    torch.manual_seed(11)
    ref_losses = [train_step(ref, lambda l: l.backward(), opt.step, opt.zero_grad)]
    ref.eval()
    ref_eval = evaluate(ref)
    ref.train()
    ref_losses.append(train_step(ref, lambda l: l.backward(), opt.step, opt.zero_grad))

    torch.manual_seed(11)
    losses = [train_step(engine, engine.backward, engine.step, engine.zero_grad)]
    model.eval()
    outs = evaluate(engine)
    model.train()
    losses.append(train_step(engine, engine.backward, engine.step, engine.zero_grad))
    assert all(torch.equal(o, ref_eval[0]) for o in outs + ref_eval), "evaluation differs (dropout left on?)"
    assert losses == ref_losses and engine.step_count == 2
    weights, reference = dict(engine.named_parameters()), dict(ref.named_parameters())
    assert all(torch.equal(weights[k], reference[k].detach()) for k in reference)
    engine.close()


@pytest.mark.parametrize("mode", ["recompute", "offload", "fits"])
@pytest.mark.parametrize("grad_off", ["inference_mode", "no_grad"])
def test_an_evaluation_between_micro_batches_leaves_the_training_pytorchs(tmp_path, mode, grad_off):
    """An evaluation forward between two micro-batches of a step (a validation loss, a metric),
    under ``torch.no_grad()`` or ``torch.inference_mode()``: PyTorch's outputs bitwise, and the
    training after it PyTorch's. Under inference mode the store's views of the bytes it loaded were
    inference tensors, kept for reuse, and the next training forward stopped with "Setting
    requires_grad=True on inference tensor" (reported as the batch's fault)."""
    from tiered_offload import EngineConfig
    torch.manual_seed(0)
    ref = TinyLM(lambda d: MLP(d), d=32, layers=4)
    model = copy.deepcopy(ref)
    state = 16 * sum(p.numel() for p in ref.parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=2 * state if mode == "fits" else int(0.4 * state),
                    config=EngineConfig(activations="auto" if mode == "fits" else mode))
    assert (engine.activation_modes is None) == (mode == "fits")
    off = getattr(torch, grad_off)
    g = torch.Generator().manual_seed(1)
    for step in batches(3, 2):
        for ids, _ in step:
            lm_loss(ref, ids).backward()
            engine.backward(lm_loss(engine, ids))
            held_out = torch.randint(0, VOCAB, (2, 9), generator=g)
            for m in (ref, model):
                m.eval()
            with off():
                assert torch.equal(lm_loss(engine, held_out), lm_loss(ref, held_out))
            for m in (ref, model):
                m.train()
        opt.step()
        opt.zero_grad()
        engine.step()
        engine.zero_grad()
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("activations", ["recompute", "offload", "keep"])
@pytest.mark.parametrize("switch", ["eval-forward", "eval-backward"])
def test_a_mode_switched_between_a_forward_and_its_backward_is_the_forwards_in_the_recompute(tmp_path, activations,
                                                                                              switch):
    """A forward in ``eval()`` mode with gradients (dropout off: a loss some loops take so), the
    model switched back to ``train()`` before its backward; or a training forward, then ``eval()``
    (a held-out loss) before its backward. PyTorch's backward uses what the forward saved: the
    dropout masks the forward drew, or none. A recomputed block ran in the mode of the moment of
    its backward, so it drew masks the forward had not (other gradients, silently, and the losses
    after). It now runs in its forward's mode, bitwise PyTorch's."""
    def run(module, forward, backward, step, zero):
        torch.manual_seed(3)
        losses = []
        for s in batches(3, 2):
            for m, (ids, _) in enumerate(s):
                module.train(not (switch == "eval-forward" and m == 0))
                loss = hf_loss(forward, ids) / 2
                module.train(switch == "eval-forward" or m == 1)
                backward(loss)
                module.train()
                losses.append(loss.item())
            step()
            zero()
        return losses
    _trains_as_pytorch(make_gpt2(dropout=0.1), activations, tmp_path, run)


def _trains_as_pytorch(ref, activations: str, tmp_path, run) -> None:
    """``run(module, forward, backward, step, zero)``, a loop, gives the same losses and weights on an
    engine of a copy of ``ref`` (host 0.4 of the state, every block's activations ``activations``)
    as on ``ref`` with PyTorch's AdamW in memory, bitwise."""
    from tiered_offload import EngineConfig
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s",
                    host_memory=int(16 * sum(p.numel() for p in ref.parameters()) * 0.4),
                    config=EngineConfig(activations=activations))
    assert engine.activation_modes == [activations] * len(engine.binding.blocks)
    want = run(ref, ref, torch.Tensor.backward, opt.step, opt.zero_grad)
    got = run(model, engine, engine.backward, engine.step, engine.zero_grad)
    weights = dict(engine.named_parameters())
    engine.close()
    assert got == want, "losses differ from PyTorch's"
    different = [k for k, p in ref.named_parameters() if not torch.equal(weights[k], p)]
    assert not different, f"not PyTorch's weights: {different[:3]}"


@pytest.mark.parametrize("regions, activations", [("one", "recompute"), ("one", "offload"), ("one", "keep"),
                                                 ("each", "recompute")], ids=lambda v: v)
def test_two_forwards_under_one_autocast_region_sum_their_casts_gradients_as_pytorch(tmp_path, activations, regions):
    """Two forwards before one backward under bf16 autocast (DPO's chosen and rejected; Hugging
    Face's Trainer puts the whole loss in one region). In one region PyTorch casts each weight once
    (autocast's cache) and sums the two forwards' gradients of that cast in bf16 before adding them
    to ``.grad``; in a region each, it casts twice and sums in fp32. The engine casts per call and
    summed in fp32: other bits in one region (Llama: 2 weights of 4 blocks; found by
    ``tools/fuzz_options.py --loops --wide --seed 98111``). Now a block called more than once in
    one region rounds the calls' sum of a weight it reads only through autocast's cast as PyTorch's
    bf16 sum does: bitwise either way."""
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def run(module, forward, backward, step, zero):
        losses = []
        for s in batches(3, 2):
            for ids, _ in s:
                with autocast():
                    first = hf_loss(forward, ids)
                    if regions == "one":
                        second = hf_loss(forward, ids.flip(0))
                if regions == "each":
                    with autocast():
                        second = hf_loss(forward, ids.flip(0))
                loss = (first + second) / 4
                backward(loss)
                losses.append(loss.item())
            step()
            zero()
        return losses
    _trains_as_pytorch(make_llama(), activations, tmp_path, run)


def test_calls_of_a_block_some_in_one_autocast_region_some_in_another_are_refused(tmp_path):
    """Three forwards before a backward, two in one autocast region and the third in another:
    PyTorch sums the first two's gradients of a shared cast in bf16 and then the third's in fp32,
    an order the engine does not follow; refused at the backward, naming the block and the fix."""
    model = make_llama()
    ids = batches(1, 1)[0][0][0]
    with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s",
                host_memory=int(16 * sum(p.numel() for p in model.parameters()) * 0.4)) as engine:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [hf_loss(engine, ids), hf_loss(engine, ids.flip(0))]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(hf_loss(engine, ids))
        with pytest.raises(ConfigError, match=r"block block\.3 was called 3 times .* some calls in one "
                                              r"autocast region and some in another.*each in a region of its own"):
            engine.backward(sum(losses))


@pytest.mark.parametrize("loop", ["optimizer.zero_grad", "model.zero_grad"])
def test_zero_grad_clears_what_pytorch_clears(tmp_path, loop):
    """``optimizer.zero_grad()`` clears the optimizer's parameters only: a trainable parameter left
    out of every group keeps accumulating, and counts in the next clipping norm; ``zero_grad()`` on
    the engine (as ``model.zero_grad()``) clears every one. Both bitwise as PyTorch."""
    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: MLP(d), d=32)

    def grouped(model):  # every parameter but block 1's up-projection (inside a streamed unit)
        return torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("blocks.1.ffn.up")],
                                 lr=1e-2)
    ref = make()
    start = copy.deepcopy(ref.state_dict())
    data = batches(4, 1)
    opt = grouped(ref)
    zero_ref = opt.zero_grad if loop == "optimizer.zero_grad" else ref.zero_grad
    ref_losses = []
    for step in data:
        for ids, _ in step:
            loss = lm_loss(ref, ids)
            loss.backward()
            ref_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        zero_ref()
    model = make()
    model.load_state_dict(start)
    engine = Engine(model, grouped(model), storage=tmp_path / "s",
                    host_memory=int(16 * sum(p.numel() for p in ref.parameters()) * 0.4))
    assert engine.state_bytes() > engine.store.capacity("host")
    zero = engine.optimizer.zero_grad if loop == "optimizer.zero_grad" else engine.zero_grad
    losses = []
    for step in data:
        for ids, _ in step:
            loss = lm_loss(engine, ids)
            engine.backward(loss)
            losses.append(loss.item())
        engine.clip_grad_norm_(0.5)
        engine.step()
        zero()
    assert losses == ref_losses
    weights, reference = dict(engine.named_parameters()), dict(ref.named_parameters())
    assert all(torch.equal(weights[k], reference[k].detach()) for k in reference)
    engine.close()


def test_resize_token_embeddings_after_the_engine_is_built_is_refused_naming_the_way(tmp_path):
    """Hugging Face's ``resize_token_embeddings`` after the engine was built (new tokens added to a
    tokenizer mid-script) failed inside transformers with "ValueError: not enough values to unpack"
    (it reads the embedding's placeholder). It is refused now, naming the way: resize first."""
    model = make_llama()
    with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s",
                host_memory=int(16 * sum(p.numel() for p in model.parameters()) * 0.4)) as engine:
        with pytest.raises(ConfigError, match=r"resize_token_embeddings.*before building the engine"):
            model.resize_token_embeddings(VOCAB + 8)
        ids = torch.randint(0, VOCAB, (2, 9))
        engine.backward(engine(input_ids=ids, labels=ids).loss)  # training goes on
        engine.step()


def _peft_on(make):
    """``make()``'s model with PEFT's LoRA on q and v (its adapter initialised at random)."""
    peft = pytest.importorskip("peft")
    base = make()
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


@pytest.mark.parametrize("kind", ["model", "peft", "t5", "bart"])
def test_generate_between_training_steps_gives_pytorchs_tokens(tmp_path, kind):
    """``model.generate()`` (greedy and sampled, with the key/value cache) on the engine's model gives
    the tokens PyTorch's gives on the same weights, and the training after it is PyTorch's. A PEFT
    model's ``generate`` calls its base model's, not its own forward, so the engine's hooks on the
    model did not bind the rest: it stopped with "embedding reads its values outside the engine's
    calls". The base model's calls are the engine's too. An encoder-decoder's ``generate`` calls
    its encoder alone first (``get_encoder()``), which stopped the same way (``tools/fuzz_options.py
    --wide``): the encoder's calls are the engine's too, and one inside the model's lets go of nothing."""
    from test_conformance import bart, t5
    wrapped = kind == "peft"
    make = {"model": make_llama, "peft": functools.partial(_peft_on, make_llama), "t5": functools.partial(t5, 0.0),
            "bart": functools.partial(bart, 0.0)}[kind]
    ref, model = make(), make()
    model.load_state_dict(ref.state_dict())
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    state = sum((16 if p.requires_grad else 4) * p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW(trained(model), lr=1e-2), storage=tmp_path / "s",
                    host_memory=int(state * (0.8 if wrapped else 0.4)))
    assert engine.state_bytes() > engine.store.capacity("host")
    opt = torch.optim.AdamW(trained(ref), lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids[:, :4])

    def step_both():
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mine = engine(input_ids=ids, labels=ids).loss
        engine.backward(mine)
        engine.step()
        engine.zero_grad()
        assert mine.item() == loss.item()
    step_both()
    for m in (ref, model):
        m.eval()
    kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(ref.generate(ids[:, :4], do_sample=False, **kw), model.generate(ids[:, :4], do_sample=False, **kw))
    torch.manual_seed(5)
    sampled = ref.generate(ids[:, :4], do_sample=True, top_k=10, **kw)
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(ids[:, :4], do_sample=True, top_k=10, **kw))
    for m in (ref, model):
        m.train()
    step_both()
    weights, reference = dict(engine.named_parameters()), dict(ref.named_parameters())
    assert all(torch.equal(weights[k], reference[k].detach()) for k in reference)
    engine.close()


@pytest.mark.parametrize("how", ["loop-kept-gradients", "fused-recompute-resumed"])
def test_parameters_frozen_and_unfrozen_mid_run_train_as_pytorch(tmp_path, how):
    """Freezing mid-run (``requires_grad_(False)`` between steps: a parameter, a streamed block
    whole) and unfreezing again: the parameter gets no more gradient, and the step updates it
    while it still has one (a gradient kept from before, as ``torch.optim`` steps any ``.grad``
    that is not None), as PyTorch. The engine refused any change before."""
    def make():
        torch.manual_seed(0)
        return TinyLM(MLP, d=16, layers=4)
    if how == "loop-kept-gradients":
        habits = Habits(zero_grad_every=2, freezes={1: {"blocks.1.ffn.up.weight": False, "emb.weight": False},
                                                    3: {"blocks.1.ffn.up.weight": True}})
        kwargs = dict(steps=5, accumulate=2)
    else:
        habits = Habits(freezes={1: {"blocks.2": False}, 2: {"blocks.2": True, "head.weight": False}})
        kwargs = dict(steps=4, accumulate=2, fused=True, resume_at=3, config=EngineConfig(activations="recompute"))
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, habits=habits,
                 host_fraction=0.6, **kwargs)


@pytest.mark.parametrize("how", ["loop", "fused-resumed"])
def test_gradual_unfreezing_from_the_top_trains_as_pytorch(tmp_path, how):
    """Gradual unfreezing (ULMFiT's recipe): the engine built with every parameter trainable, all
    but the top block and the head frozen before the first step, then one block more unfrozen at
    each step, the embedding last. A parameter frozen at build cannot be unfrozen (its gradient
    and optimizer state have no room), so this is the way the refusal names; bitwise PyTorch's,
    with a resume in the middle."""
    def make():
        torch.manual_seed(0)
        return TinyLM(MLP, d=16, layers=4)
    habits = Habits(freezes={0: {"blocks.0": False, "blocks.1": False, "blocks.2": False, "emb.weight": False},
                             1: {"blocks.2": True}, 2: {"blocks.1": True}, 3: {"blocks.0": True, "emb.weight": True}})
    kwargs = dict(fused=True, resume_at=2) if how == "fused-resumed" else {}
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, steps=5, accumulate=2,
                 habits=habits, host_fraction=0.65, **kwargs)


@pytest.mark.parametrize("when", ["build", "mid-run", "mid-run-fused"])
@pytest.mark.parametrize("repeats", [False, True], ids=["chain", "blocks-called-twice"])
def test_recomputed_blocks_that_need_no_backward_keep_no_inputs(tmp_path, when, repeats):
    """The embedding and the lower blocks frozen (at build, or mid-run): those blocks' calls need no
    backward (no input and no weight of theirs requires a gradient), so recomputing them keeps no
    input. They kept it before, every forward: a budget's room (or, where it had none, memory
    beside it) for each frozen block's input, for a backward that then did nothing. A block
    called twice (a weight-shared loop) counts its calls as PyTorch sums them; bitwise."""
    from test_conformance import RepeatingLM

    def make():
        torch.manual_seed(0)
        model = RepeatingLM() if repeats else TinyLM(MLP, d=16, layers=4)
        if when == "build":
            for p in [*model.emb.parameters(), *model.blocks[0].parameters(), *model.blocks[1].parameters()]:
                p.requires_grad_(False)
        return model
    frozen = {"emb": False, "blocks.0": False, "blocks.1": False}
    habits = Habits(freezes={1: frozen} if when != "build" else {})

    def inspect(engine):
        stashed = engine._streamer.activation_bytes
        assert stashed[0] == stashed[1] == 0 and stashed[2] > 0 and stashed[3] > 0, stashed
    check_parity(make, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2),
                 tmp_path, steps=3, accumulate=2, habits=habits, host_fraction=0.6, recompute=True,
                 fused=when.endswith("fused"), inspect=inspect)


def test_unfreezing_a_parameter_frozen_at_build_is_refused_naming_the_way(tmp_path):
    """Unfreezing a parameter frozen when the engine was built (it has no gradient or optimizer
    state) is refused at the next forward, or at once on a streamed block, naming the parameter and
    the way; after it, training goes on."""
    model = make_gpt2(frozen=True)  # wpe and block 0 frozen
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s", host_memory=1 << 22)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.zero_grad()
    model.transformer.wpe.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"transformer\.wpe\.weight\.requires_grad changed to True .*frozen then.*"
                                          r"build the engine with them trainable and freeze them before the first "
                                          r"step.*init_from"):
        engine(input_ids=ids, labels=ids)
    model.transformer.wpe.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="streamed block 0, whose .* was frozen when the engine was built.*"
                                          "build the engine with it trainable and freeze it before the first step"):
        model.transformer.h[0].requires_grad_(True)
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # as it was: trains on
    engine.step()
    engine.close()


@pytest.mark.parametrize("activations, rest", [("offload", False), ("recompute", False), ("offload", True)])
def test_blocks_frozen_whole_mid_run_cost_no_gradient_or_optimizer_state_io(tmp_path, activations, rest):
    """Blocks frozen whole mid-run (progressive freezing of the lower layers) and their gradients
    zeroed: their backward still gives the block below its input's gradient, but no gradient is
    added into their buffers and the step updates nothing of them, as in PyTorch. So nothing of
    their gradients or optimizer states is read or written: the backward adds into no buffer and
    the lookahead fetches no state the step will not use (before, each step wrote every frozen
    block's zeroed gradient buffer and read its optimizer states ahead). Bitwise PyTorch's.
    ``rest``: the parameters outside the blocks (embeddings, final norm, head) frozen too: their
    gradient buffer, bound for each forward, was still written every step."""
    from test_engine import plain_gpt, plain_loss
    torch.manual_seed(0)
    ref = plain_gpt(6)
    model = copy.deepcopy(ref)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 4,
                    config=EngineConfig(activations=activations))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    frozen = engine.schedule.blocks[:3]
    if rest:
        frozen += [u for u in engine.schedule.units if u not in engine.schedule.blocks]
    seen = {}

    def io(key):  # the version last written to the disk, and the reads from it
        rec = engine.store.record(key)
        return rec.disk_version, rec.disk_gen, rec.disk_reads

    for step in range(6):
        x = torch.randint(0, 128, (4, 17), generator=g)
        for m in (ref, engine):
            loss = plain_loss(m, x)
            (loss.backward if m is ref else lambda: engine.backward(loss))()
            (opt if m is ref else engine).step()
            (opt if m is ref else engine).zero_grad()
        if step == 1:  # after the step's zero_grad: the next steps give them no gradient
            for m in (ref, engine.model):
                for block in list(m.blocks)[:3]:
                    block.requires_grad_(False)
                for p in (p for n, p in m.named_parameters() if rest and not n.startswith("blocks.")):
                    p.requires_grad_(False)
        if step == 3:  # the plan and the lookahead know by now
            seen = {k: io(k) for u in frozen for k in (u.weight_key, u.grad_key, *u.state_keys(engine.schedule.state_kinds))}
    now = {k: io(k) for k in seen}
    grads = [k for k in seen if k.endswith("/grad")]
    assert all(now[k] == seen[k] for k in grads), {k: (seen[k], now[k]) for k in grads}
    states = [k for k in seen if "/state." in k]
    assert all(now[k] == seen[k] for k in states), {k: (seen[k], now[k]) for k in states}
    weights = [k for k in seen if k.endswith("/weight")]
    assert all(now[k][:2] == seen[k][:2] for k in weights)  # not updated: never written
    mine = dict(engine.named_parameters())
    assert all(torch.equal(mine[k], p.detach()) for k, p in ref.named_parameters())
    engine.close()


@pytest.mark.parametrize("activations, rest", [("fits", False), ("keep", False), ("recompute", False),
                                                ("keep", True), ("fits", True)])
def test_requires_grad_changed_inside_a_step_trains_as_pytorch(tmp_path, activations, rest):
    """PyTorch's graph follows ``requires_grad`` per forward, and its accumulator drops the gradient
    of a parameter frozen between a forward and its backward: a freeze there (a block's weight and
    the embedding), and an unfreeze between two forwards of one backward (PEFT's
    ``disable_adapter()`` does both), train as PyTorch, bitwise; the state fitting the budget (the
    blocks' graphs kept, their leaves held by the modules) or streamed. ``rest``: every parameter
    outside the blocks too, so that the first forward finds the rest frozen whole (its gradient
    buffer not bound) and the second needs it."""
    from test_engine import plain_gpt, plain_loss
    torch.manual_seed(0)
    ref = plain_gpt(4)
    model = copy.deepcopy(ref)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=2 * state if activations == "fits" else state // 3,
                    config=EngineConfig(activations="keep" if activations == "fits" else activations))
    assert (engine.activation_modes is None) == (activations == "fits")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    names = ["blocks.1.fc.weight", *(n for n, _ in ref.named_parameters() if rest and not n.startswith("blocks."))]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = (torch.randint(0, 128, (2, 17), generator=g) for _ in range(2))
        for m in (ref, engine.model):
            if step == 0:  # frozen between the forward and its backward
                loss = plain_loss(m if m is ref else engine, x)
                for n in names:
                    functools.reduce(getattr, n.split("."), m).requires_grad_(False)  # (a leaf, held)
            else:  # unfrozen between two forwards of one backward
                first = plain_loss(m if m is ref else engine, x)
                for n in names:
                    functools.reduce(getattr, n.split("."), m).requires_grad_(True)
                loss = first + plain_loss(m if m is ref else engine, y)
            if m is ref:
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
            if step == 1:
                for n in names:
                    m.get_parameter(n).requires_grad_(False)
    assert [p.requires_grad for p in engine.model.parameters()] == [p.requires_grad for p in ref.parameters()]
    weights = dict(engine.named_parameters())
    different = [k for k, p in ref.named_parameters() if not torch.equal(weights[k], p.detach())]
    assert not different
    engine.close()


# ---- Hugging Face's recorded outputs --------------------------------------------------------------
def hidden_states_loss(model, ids, route=None):
    """The language-model loss plus terms on two blocks' outputs (``output_hidden_states``: a
    distillation or a probe on inner layers)."""
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    return out.loss + 0.1 * out.hidden_states[2].pow(2).mean() + 0.05 * out.hidden_states[4].abs().mean()


@pytest.mark.parametrize("called_before", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_output_hidden_states_gives_the_blocks_outputs_and_their_gradients(tmp_path, fused, called_before):
    """transformers records ``output_hidden_states`` with forward hooks it puts on the modules of
    the decoder layer's class, found by ``isinstance`` when first asked. The engine's stand-ins
    were not of that class: the engine's model gave no hidden states (an IndexError in the loss).
    And where the model had been called with it before the engine was built, the hooks on the
    real layers recorded the engine's inner forward: tensors outside the engine's backward, whose
    loss terms gave no gradient. Now the stand-ins are found, they record what the model's forward
    sees, and the losses and weights are bitwise PyTorch's."""
    def make():
        model = make_llama()
        if called_before:
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), output_hidden_states=True)
        return model
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hidden_states_loss,
                 clip=1.0, accumulate=2, fused=fused)


def make_mixtral(router_logits=True):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
                                     output_router_logits=router_logits, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(cfg)
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_mixture_of_experts_load_balancing_loss_trains_bitwise(tmp_path, activations, fused):
    """``output_router_logits=True`` (Mixtral's load-balancing loss, ``router_aux_loss_coef``):
    transformers records the routers' logits with hooks on modules inside the blocks, which the
    stand-ins hide. The engine's model stopped with "rejected the batch: tuple index out of range".
    Now the engine hooks those modules itself; a block's node returns what they give as extra
    outputs, and their gradients join the block's backward: bitwise PyTorch's."""
    def loss(model, ids, route=None):
        out = model(input_ids=ids, labels=ids)
        assert out.aux_loss is not None and len(out.router_logits) == 4
        return out.loss
    check_parity(make_mixtral, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=loss,
                 clip=1.0, accumulate=2, fused=fused, config=EngineConfig(activations=activations))


@pytest.mark.parametrize("where", ["config", "call"])
def test_outputs_recorded_inside_the_blocks_are_refused_where_transformers_has_no_collector(tmp_path, where,
                                                                                         monkeypatch):
    """A transformers version without the collector the engine hands such outputs to: refused by
    name, when the engine is built where the model's config asks for them, else at the call."""
    from tiered_offload.engine import recorded_outputs
    monkeypatch.setattr(recorded_outputs, "_collector", lambda: None)
    model = make_mixtral(router_logits=where == "config")
    ids = torch.randint(0, VOCAB, (2, 9))
    flag = r"output_router_logits records the outputs of MixtralTopKRouter modules inside the blocks"
    if where == "config":
        with pytest.raises(ConfigError, match=flag + r".*config\.output_router_logits = False"):
            Engine(model, torch.optim.AdamW, storage=tmp_path, host_memory="64MiB")
        return
    with Engine(model, torch.optim.AdamW, storage=tmp_path, host_memory="64MiB") as engine:
        engine.backward(engine(input_ids=ids, labels=ids).loss)  # without it: trains
        with pytest.raises(ConfigError, match=flag):
            engine(input_ids=ids, labels=ids, output_router_logits=True)
        with pytest.raises(ConfigError, match="output_attentions records the outputs of MixtralAttention"):
            engine(input_ids=ids, output_attentions=True)


@pytest.mark.parametrize("with_grad", [False, True], ids=["reference-without-grad", "both-with-grad"])
@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_a_peft_models_disabled_adapter_forward_gives_pytorchs_values_between_steps(tmp_path, fits, with_grad):
    """DPO's reference log-probabilities with PEFT (TRL's way): the same model under ``with
    model.disable_adapter():`` (without grad), then the policy's forward with the adapter; or both
    with grad, in one loss. The losses and the trained weights are PyTorch's, bitwise."""
    from test_engine import one_step
    ref = _peft_llama()
    model = copy.deepcopy(ref)
    state = sum((16 if p.requires_grad else 4) * p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                    host_memory=int(state * (4 if fits else 0.6)))
    assert (engine.state_bytes() <= engine.store.capacity("host")) == fits
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, 9), generator=g)
        losses = []
        for m in (model, ref):
            with (torch.enable_grad() if with_grad else torch.no_grad()), m.disable_adapter():
                base = m(input_ids=x, labels=x).loss
            loss = m(input_ids=x, labels=x).loss - 0.5 * base
            losses.append((base.item(), loss.item()))
            if m is model:
                one_step(engine, loss)
            else:
                one_step(ref, loss, opt)
        assert losses[0] == losses[1]
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], v.detach()) for k, v in ref.named_parameters())
    engine.close()


@pytest.mark.parametrize("call", ["merge_adapter", "merge_and_unload"])
def test_peft_merge_on_the_engines_model_is_refused_naming_the_merged_export(tmp_path, call):
    """PEFT's ``merge_adapter()`` / ``merge_and_unload()`` on the engine's model would write merged
    weights into parameters that hold placeholders: refused (it was, as any read of a streamed
    weight, with a message about EMAs and penalties), naming ``export_safetensors(DIR,
    merged=True)``; nothing changed, training goes on as PyTorch's."""
    from test_engine import one_step
    ref = _peft_llama()
    model = copy.deepcopy(ref)
    state = sum((16 if p.requires_grad else 4) * p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(state * 0.6))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TensorStateError, match=r"PEFT's merge.*export_safetensors\(DIR, merged=True\)"):
        getattr(model, call)()
    for _ in range(2):
        one_step(engine, model(input_ids=x, labels=x).loss)
        one_step(ref, ref(input_ids=x, labels=x).loss, opt)
    weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], v.detach()) for k, v in ref.named_parameters())
    engine.close()
