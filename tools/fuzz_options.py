#!/usr/bin/env python
"""Random combinations of the engine's options, each trained against plain PyTorch, bitwise.

Each case draws a model (GPT-2 with and without dropout, Llama, DeBERTa-v2 with relative
attention, a routed MoE), an optimizer of ``torch.optim`` with some of its options, 3-4 steps of
1-3 micro-batches (the loop of ``engine.backward`` or ``engine.forward_backward``), clipping, a
resume, durability and ``commit_every``, host and device budgets (the device tier of CPU memory,
exclusive or inclusive caching), the update's placement, activation modes, the step's mode, its
lead, piece and chunk sizes and the prefetch depth; and what a loop does besides training
(``test_finetune.Habits``: a NaN loss, an LR schedule, held-out losses logged around the step,
exports and reads of the weights between steps, bf16 autocast, the optimizer's own calls). A quarter
of the cases run the step in the last backward (``step=True``), their loop made one that can
(``--in-backward``: every case).
``--wide`` adds T5 and BART, frozen parameters, LoRA layers, Trainer's parameter groups and
``generate()`` between steps; ``--stores`` the storage (striped, by weight too, zarr, aiofiles) and the store's
options (LRU, CRC32, reads unverified, no reservation); ``--loops`` Mixtral's load-balancing loss,
Hugging Face's gradient checkpointing, forwards in ``eval()`` mode or ``eval()`` before a backward,
``clip_grad_value_``, two forwards before a backward, micro-batches of other shapes and parameters
frozen mid-run (and unfrozen again; a block or the rest whole; from the first step on); ``--zoo``
models whose weights are shared or computed: ALBERT (its layers share weights), a model that calls
a block twice, and linear layers under ``weight_norm`` and ``spectral_norm`` (a weight computed from
parameters at each call, and buffers the training forward updates); ``--calls`` block calls that
take one tensor in two places (``block(h, h)``) or return one twice, and a block's input changed in
place after it ran, where it did not save it. Every case must end one of two ways:

* **ok**: PyTorch's losses and weights bit for bit (``tests/test_finetune.py::check_parity``);
* **refused**: a typed error raised while the engine is built (a budget that cannot hold one step's
  working set), with the numbers;
* **torn**: a step clipped in the backward (``clip_norm``) by a limit every norm here is over
  (1e-4), found so only once a block was updated (:class:`ClipTornError`: right).

Anything else is a failure: a different number, an error in the middle of training, or a hang
(the store's ``wait_timeout_s`` is 20 s here, and a case that runs ``--case-timeout`` seconds is
stopped with every thread's stack). A failure prints the case's options; ``--seed N --cases 1``
runs that case alone again. ``--sharded`` draws runs of ``tests/dist_worker.py`` over 2-3 ranks
instead (:func:`draw_sharded`), within 1e-6 of one process or refused.

    python tools/fuzz_options.py --cases 300            # about 10 minutes on a 2-core machine
    python tools/fuzz_options.py --seed 1343 --cases 1  # one case again
    python tools/fuzz_options.py --sharded --cases 120  # about 4 minutes
    python tools/fuzz_options.py --load 2 --cases 150   # beside two busy processes: other timings
    python tools/fuzz_options.py --wide --cases 300     # encoder-decoders, frozen, LoRA, groups too
    python tools/fuzz_options.py --stores --cases 300   # zarr, aiofiles, striping, LRU, CRC32 too
    python tools/fuzz_options.py --loops --cases 300    # what loops do besides: eval(), clip values
    python tools/fuzz_options.py --zoo --cases 300      # ALBERT, weight_norm, spectral_norm too
    python tools/fuzz_options.py --calls --cases 200    # block(h, h), return y, y, in-place changes too
    python tools/fuzz_options.py --bare --cases 100     # a model with no parameter outside its blocks too

``--load N`` runs N processes that only spin beside the cases: the store's threads then interleave
otherwise (seed 74049 failed 5 runs of 10 beside two busy processes, and never alone).

It found a hang (a prefetch that waited for room to stage a victim: its own load's operation), a
failure mid-step (an update on the host beside the forward, activations offloaded: see
``store/waits.py``), autocast's cached casts of a block's inputs (``block_nodes.as_layer_outputs``)
and two sharded budgets accepted then failed (``ShardLayout.grad_prefix``, ``Schedule.world``);
a host budget below a device tier too small to stage a load and a victim at once, wherever the
first landed (``preflight.STAGED_AT_ONCE``), and a test reference that resumed a run whose only
step was skipped from the wrong random state (``test_finetune.train``). ``--wide`` found an
encoder-decoder's ``generate()`` refused (``facade._hook_model_calls``), BART's encoder gradients
under autocast summed in another order (``SharedInputs.seeds``) and ``forward_backward``'s loop
sharing autocast's casts across micro-batches (``micro_batches._loop``). ``--loops`` found a block
recomputed in the mode (``train()`` / ``eval()``) of its backward, not its forward's
(``block_attributes.replay_modes``), and two calls of a block in one autocast region summed in
fp32, where PyTorch sums its shared cast's gradients in bf16 (``repeated_calls.autocast_region``).
``--zoo`` found a weight read twice in a call (``spectral_norm``'s) of a block called twice before a
backward summed a call's uses first, where PyTorch adds each use in turn
(``repeated_calls.first_arrivals``), and a test reference that resumed without restoring the
buffers a training forward after the step had changed (``test_finetune.train``), and the aiofiles
backend's tasks holding a forward's context variables, its graph with them (``storage_backends/_aio.py``).
``--calls`` came after the bugs it checks were found by probes (``block_nodes.slotted``); run on the
code before that fix, it failed its first two draws of each of those models. ``--sharded
--in-backward`` found a rank whose slice of a LoRA block holds no gradient forgetting one all the
same in its update in the backward (``step_in_backward._update``).
Exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

OPTIMIZERS = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
    "Adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1),
    "SGD-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    "RMSprop-centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
    "NAdam-decoupled": lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, decoupled_weight_decay=True,
                                                   weight_decay=0.1),
    "RAdam": lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "ASGD": lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2),
}
ONE_STATE = ("SGD-nesterov", "Adagrad", "ASGD", "Adadelta", "RMSprop-centered")
"""Optimizers with less state than Adam's: a smaller host budget keeps the state off memory."""


def _groups(m):
    """Hugging Face Trainer's two groups: weight decay on matrices only, another learning rate for
    the rest; frozen parameters left out, as the Trainer does."""
    trainable = [p for p in m.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3}],
                             lr=1e-2)


WIDE_OPTIMIZERS = {"AdamW-groups": _groups}
PARTLY_FROZEN = ("gpt2-frozen", "lora")
"""Models whose state is not 16 bytes for each parameter (a frozen one has its weights alone)."""


def state_bytes(model) -> int:
    """The training state of ``model`` under Adam: 16 bytes a trainable parameter, 4 a frozen one."""
    return sum((16 if p.requires_grad else 4) * p.numel() for p in model.parameters())


GENERATES = ("gpt2", "gpt2-dropout", "gpt2-frozen", "llama", "t5-dropout", "bart-dropout")
"""The models ``--wide`` also logs ``generate()`` from (Hugging Face's generative ones)."""


def _checkpointed_gpt2():
    """GPT-2 with dropout and Hugging Face's ``gradient_checkpointing_enable()`` (Trainer's
    ``gradient_checkpointing=True``)."""
    from test_finetune import make_gpt2
    model = make_gpt2(dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def models(wide: bool = False, loops: bool = False, zoo: bool = False, calls: bool = False, bare: bool = False) -> dict:
    """name: (make, loss, streamed blocks); ``wide``: encoder-decoders (their encoder's blocks
    streamed, then the decoder's), a model with frozen parameters and one with LoRA layers too;
    ``loops``: Mixtral with its load-balancing loss and GPT-2 with gradient checkpointing on;
    ``zoo``: models that call a block more than once a forward (ALBERT's layer groups, each over
    two layers; a model that calls every other block twice) and whose linear layers' weights are
    parametrizations (``weight_norm``, ``spectral_norm``); ``calls``: block calls that take one
    tensor in two places (``block(h, h)``) or return one twice, and a model that changes a block's
    input in place after the block ran, where the block did not save it; ``bare``: a model with no
    parameter outside its blocks."""
    from test_finetune import hf_loss, lm_loss, make_deberta, make_gpt2, make_llama, make_lora, make_moe
    table = {"gpt2": (make_gpt2, hf_loss, 4), "gpt2-dropout": (lambda: make_gpt2(dropout=0.1), hf_loss, 4),
             "llama": (make_llama, hf_loss, 4), "moe": (make_moe, lm_loss, 4), "deberta": (make_deberta, hf_loss, 6)}
    if wide:
        from test_conformance import bart, seq2seq_loss, t5
        table.update({"t5-dropout": (t5, seq2seq_loss, 6), "bart-dropout": (bart, seq2seq_loss, 6),
                      "gpt2-frozen": (lambda: make_gpt2(frozen=True), hf_loss, 4), "lora": (make_lora, lm_loss, 4)})
    if loops:
        from test_finetune import make_mixtral
        table.update({"mixtral-aux": (make_mixtral, hf_loss, 4), "gpt2-checkpointed": (_checkpointed_gpt2, hf_loss, 4)})
    if zoo:
        from test_conformance import RepeatingLM, parametrized_lm
        from test_finetune import make_albert
        table.update({"albert": (make_albert, hf_loss, 4), "albert-dropout": (lambda: make_albert(0.1), hf_loss, 4),
                      "repeats": (_seeded(RepeatingLM), lm_loss, 4),
                      "weight-norm": (lambda: parametrized_lm("weight_norm"), lm_loss, 4),
                      "spectral-norm": (lambda: parametrized_lm("spectral_norm"), lm_loss, 4)})
    if calls:
        from test_conformance import InPlaceLM, ShiftBlock, SameTensorTwiceLM, TwoOfOneOutputLM
        from test_finetune import MLP
        table.update({"same-input-twice": (_seeded(SameTensorTwiceLM), lm_loss, 4),
                      "output-twice": (_seeded(TwoOfOneOutputLM), lm_loss, 4),
                      "unsaved-in-place": (_seeded(lambda: InPlaceLM(lambda d: ShiftBlock(d, MLP(d)), "input")),
                                           lm_loss, 4)})
    if bare:
        from test_finetune import make_blocks_only
        table["blocks-only"] = (make_blocks_only, lm_loss, 4)
    return table


def _seeded(make):
    """``make`` from seed 0, as the zoo's other models are built."""
    def seeded():
        torch.manual_seed(0)
        return make()
    return seeded


def draw(rng: random.Random, zoo: dict, wide: bool = False, stores: random.Random | None = None,
         loops: random.Random | None = None, in_backward: bool = False) -> tuple[dict, dict]:
    """One case: what it is (printable) and ``check_parity``'s keyword arguments (``wide``: the
    optimizers of :data:`WIDE_OPTIMIZERS` too; pass ``models(wide=True)`` with it; ``stores``: a
    second generator the storage and the store's options are drawn from, :func:`draw_store`;
    ``loops``: a third one, :func:`loop_habits`; pass ``models(loops=True)`` with it; ``in_backward``:
    the step in the last backward whatever the draw)."""
    optimizers = {**OPTIMIZERS, **(WIDE_OPTIMIZERS if wide else {})}
    name = rng.choice(sorted(zoo))
    make, loss, blocks = zoo[name]
    opt = rng.choice(sorted(optimizers))
    steps, accumulate = rng.choice([3, 4]), rng.choice([1, 2, 3])
    kw = dict(loss_fn=loss, steps=steps, accumulate=accumulate, clip=rng.choice([None, 1.0, 0.01]),
              host_fraction=rng.choice([0.3, 0.45, 0.6, 0.8]) * (0.5 if opt in ONE_STATE else 1),
              fused=accumulate > 1 and rng.random() < 0.6)
    if name == "moe":  # each micro-batch routed to some of the 4 experts
        kw["routes"] = [[rng.randrange(4) for _ in range(accumulate)] for _ in range(steps)]
    if rng.random() < 0.4:
        kw["resume_at"] = rng.randint(1, steps - 1)
    acts = rng.choice(["auto", "keep", "offload", "recompute", "mixed"])
    config = dict(activations=[rng.choice(["keep", "offload", "recompute"]) for _ in range(blocks)] if acts == "mixed"
                  else acts,
                  optimizer_device=rng.choice(["auto", "host", "device"]), step_lead=rng.choice([1, 2, 3]),
                  state_piece_numel=rng.choice([1 << 10, 1 << 14, 4 << 20]),
                  optimizer_chunk_numel=rng.choice([1 << 9, 1 << 20]),
                  overlap_step=rng.choice([None, None, False, True]), defer_step=rng.choice([None, None, False, True]),
                  prefetch_depth=rng.choice([0, 2, 16]))
    store = {"wait_timeout_s": 20.0}
    if name in PARTLY_FROZEN:  # the budget a fraction of the state it trains with (frozen: weights only)
        kw["host"] = int(state_bytes(make()) * kw["host_fraction"])
    if rng.random() < 0.5:
        state = state_bytes(make())
        store["device_budget_bytes"] = int(state * rng.choice([0.3, 0.45, 0.6]))
        store["tier_caching"] = rng.choice(["exclusive", "inclusive"])
    kw["habits"] = habits(rng, steps, accumulate, name == "moe", generates=wide and name in GENERATES)
    if loops is not None:
        loop_habits(loops, kw["habits"], steps, accumulate, switches=not kw["fused"] and name != "gpt2-checkpointed")
        if loops.random() < 0.4:  # dynamic padding: micro-batches of other lengths, a short one
            kw["shapes"] = [[(loops.choice([1, 2]), loops.choice([5, 9, 13])) for _ in range(accumulate)]
                            for _ in range(steps)]
        if loops.random() < 0.25:
            kw["habits"].freezes = freezes(loops, make(), steps)
    kw["durable"] = True if "resume_at" in kw else rng.choice([True, False])
    if kw["durable"]:
        kw["commit_every"] = rng.choice([1, 2])
    if stores is not None:
        kw["storage"] = draw_store(stores, store, kw["durable"])
    # a quarter of the cases run the step in the last backward (drawn last: a seed draws the rest as before),
    # made a loop that can: nothing between the backward and the step (clipping by clip_norm: within the limit,
    # or over it, at the last block's own norm where the step then runs after the backward, else torn; no log
    # before the step, the gradients zeroed every step), snapshot commits where durable
    kw["in_backward"] = rng.random() < 0.25 or in_backward
    if kw["in_backward"]:
        kw["clip"] = rng.choice([None, 1e6, 1e-4])
        h = kw["habits"]
        h.clip_value, h.zero_grad_every = None, 1
        h.logs = {s: ("after-step", how) for s, (_, how) in h.logs.items()}
        if kw["durable"]:
            kw["commit_every"] = 2
    case = {"model": name, "optimizer": opt, **{k: v for k, v in kw.items() if k != "loss_fn"},
            "config": config, "store_config": store}
    return case, dict(kw, make=make, make_optimizer=optimizers[opt], config=config, store_config=store)


def draw_store(rng: random.Random, store: dict, durable: bool) -> str:
    """``--stores``: the storage (a directory, two striped, evenly or by weight, the aiofiles backend, or zarr's where
    not ``durable``, which it refuses) and, into ``store``, the eviction policy, the checksum,
    whether reads verify it and disk space is reserved up front, and the host tier's prefetch share
    below a device tier."""
    store.update(policy=rng.choice(["lookahead", "lookahead", "lru"]), checksum=rng.choice(["xxh3", "crc32"]),
                 verify_checksums=rng.random() < 0.8, preallocate=rng.random() < 0.7)
    if "device_budget_bytes" in store:
        store["host_prefetch_share"] = rng.choice([0.125, 0.5])
    kind = rng.choice(["dir", "dir", "striped", "aiofiles", *([] if durable else ["zarr"])])
    # half the striped by weight (drawn last: a seed draws the rest as before)
    return "weighted" if kind == "striped" and rng.random() < 0.5 else kind


def habits(rng: random.Random, steps: int, accumulate: int, moe: bool, generates: bool = False):
    """What a training loop does besides training (``test_finetune.Habits``): a NaN loss (the
    step skipped), an LR schedule, held-out losses logged before or after a step, exports and
    reads of the weights between steps (each PyTorch's then), bf16 autocast, the optimizer's own
    ``step()`` and ``zero_grad()``; ``generates``: a few tokens of ``generate()`` logged too."""
    from test_finetune import Habits
    h = Habits()
    if rng.random() < 0.25:
        h.poisoned = ((rng.randrange(steps), rng.randrange(accumulate)),)
    if rng.random() < 0.3:
        h.lr_decay = 0.5
    h.autocast = rng.random() < 0.2 and not moe  # (the test MoE's index_put mixes dtypes under autocast)
    h.optimizer_calls = rng.random() < 0.3
    if rng.random() < 0.25:
        h.exports = tuple(s for s in range(steps) if rng.random() < 0.5)
    if rng.random() < 0.4:
        hows = ["eval", "no-grad", "with-grad", *(["generate"] if generates else [])]
        h.logs = {s: (rng.choice(["before-step", "after-step"]), rng.choice(hows))
                  for s in range(steps) if rng.random() < 0.5}
    return h


def loop_habits(rng: random.Random, h, steps: int, accumulate: int, switches: bool) -> None:
    """``--loops``: into the habits ``h``, micro-batches whose forward runs in ``eval()`` mode with
    gradients, or that switch to ``eval()`` before their backward, where ``switches`` (not where
    ``forward_backward`` runs both in one call, nor under gradient checkpointing, where PyTorch's
    own recompute fails: "A different number of tensors was saved"); ``clip_grad_value_``
    after the clipping; where ``switches`` too, two forwards before a backward; the gradients
    zeroed every second step only (the next step's backwards add to the clipped ones). (Parameters
    frozen mid-run: :func:`freezes`, drawn after the shapes.)"""
    if switches and rng.random() < 0.5:
        h.modes = {(s, m): rng.choice(["eval-forward", "eval-backward"])
                   for s in range(steps) for m in range(accumulate) if rng.random() < 0.4}
    if rng.random() < 0.4:
        h.clip_value = rng.choice([1e-3, 0.05])
    h.twice = switches and rng.random() < 0.3
    if rng.random() < 0.3:
        h.zero_grad_every = 2


def freezes(rng: random.Random, model, steps: int) -> dict:
    """``--loops``: one or two trainable parameters frozen before a step after the first (gradual
    freezing), the first of them unfrozen again before a later step where there is one; in a third
    of the cases a streamed block frozen whole at that step too (progressive freezing of layers).
    Drawn after those: in a quarter of the cases every parameter outside the block sequence frozen
    at that step too (the rest frozen whole), and in a quarter the freezes moved to before the first
    step (gradual unfreezing: the engine built with them trainable)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    picked = rng.sample(names, min(len(names), rng.choice([1, 2])))
    at = rng.randrange(1, steps)
    out = {at: {n: False for n in picked}}
    if at + 1 < steps and rng.random() < 0.5:
        out[rng.randrange(at + 1, steps)] = {picked[0]: True}
    if rng.random() < 1 / 3:  # (drawn after the rest: a seed draws the parameters as before)
        from tiered_offload.engine.binding import find_block_sequence
        try:
            where, blocks = find_block_sequence(model)
        except Exception:  # (a model without one: the engine refuses it anyway)
            return out
        i = rng.randrange(len(blocks))
        if any(p.requires_grad for p in blocks[i].parameters()):
            out[at][f"{where}.{i}"] = False
    rest, first = rng.random() < 1 / 4, rng.random() < 1 / 4
    if rest:
        from tiered_offload.engine.binding import find_block_sequence
        try:
            where = find_block_sequence(model)[0]
        except Exception:
            return out
        out[at].update({n: False for n in names if not n.startswith(where + ".")})
    if first:
        out = {0: out.pop(at), **out}
    return out


def run(case_kw: dict, directory: pathlib.Path) -> str:
    """``"ok"``, ``"refused: ..."`` or ``"torn: ..."`` (a step clipped in the backward by a limit every
    norm here is over, found so after an update: right, and checked no further); raises what failed.
    Every engine built is closed."""
    import test_finetune
    from offload_core.errors import ClipTornError, ConfigError, TierCapacityError
    from tiered_offload import Engine, EngineConfig

    built: list = []

    class Refused(Exception):
        pass

    def engine(*args, **kwargs):
        try:
            e = Engine(*args, **kwargs)
        except (TierCapacityError, ConfigError) as err:
            raise Refused(str(err)) from err
        built.append(e)
        return e

    kw = dict(case_kw)
    make, make_optimizer = kw.pop("make"), kw.pop("make_optimizer")
    kw["config"] = EngineConfig(**kw["config"])
    real, test_finetune.Engine = test_finetune.Engine, engine
    try:
        test_finetune.check_parity(make, make_optimizer, directory, **kw)
        return "ok"
    except Refused as r:
        return f"refused: {str(r)[:100]}"
    except ClipTornError as e:
        if kw["clip"] is None or kw["clip"] >= 1:  # (1e6: within every norm here)
            raise
        return f"torn: {str(e)[:100]}"
    finally:
        test_finetune.Engine = real
        for e in built:
            try:
                e.close()
            except Exception:  # a failed run's engine: its error is the one reported
                pass


def draw_sharded(rng: random.Random, in_backward: bool = False) -> dict:
    """A sharded case: ``tests/dist_worker.py``'s configuration (2-3 ranks, each its slice of the
    state), checked against one process training plain PyTorch on every rank's batches
    (``tests/test_distributed.py::reference``) to 1e-6 of the largest weight: the ranks' gradients
    are summed in another order than one process's. A third of the cases that do not clip by value
    run the step in the last backward, those that clip by norm clipped there by ``clip_norm`` 50
    (within every norm here; ``in_backward``: every case, its clipping by value left out)."""
    model = rng.choice(["gpt", "gpt", "moe", "llama", "mixtral"])  # (mixtral: LoRA on its router and experts too)
    layers = 4 if model in ("moe", "mixtral") else rng.choice([3, 4, 6])
    fused = model != "moe" and rng.random() < 0.4  # (the worker's micro-batches carry no routes)
    cfg = {"layers": layers, "optimizer": rng.choice(["adamw", "sgd"]), "steps": 3, "accumulate": rng.choice([1, 2, 3]),
           "clip": rng.choice([None, 0.5]), "scheduler": rng.random() < 0.5, "fused": fused,
           "durable": rng.random() < 0.5, "timeout_s": 60, "world": rng.choice([2, 2, 3])}
    if cfg["durable"] and rng.random() < 0.5:  # the ranks stop after that step; a second launch resumes
        cfg["resume_at"] = rng.choice([1, 2])
    if model != "gpt":
        cfg["model"] = model
    elif rng.random() < 0.3:
        cfg["frozen"] = True
    if rng.random() < 0.2:
        cfg["clip_value"] = 0.01
    if not fused:
        cfg["dropped_forward"] = rng.random() < 0.2
        cfg["zero_grad_late"] = rng.random() < 0.2
    acts = rng.choice(["auto", "keep", "offload", "recompute", "mixed"])
    cfg["activations"] = ([rng.choice(["keep", "offload", "recompute"]) for _ in range(layers)] if acts == "mixed"
                          else acts)
    cfg["host_fraction"] = rng.choice([0.6, 0.9, 1.3, 2.0, 2.6])  # of the state / world (2.6: it may all fit)
    if rng.random() < 0.4:
        cfg["device_fraction"] = rng.choice([0.5, 0.8])  # of the host budget: each rank's device tier
    if rng.random() < 0.25:  # parameters frozen mid-run (drawn last: a seed draws the rest as before)
        from dist_worker import build
        cfg["freezes"] = {str(k): v for k, v in freezes(rng, build(cfg), cfg["steps"]).items()}
    if model == "gpt" and "freezes" not in cfg and rng.random() < 0.25:  # (drawn last too)
        cfg["frozen_below"] = rng.choice([1, 2])  # the embeddings and the lower blocks frozen at build
    if cfg["durable"] and rng.random() < 0.3:  # snapshot commits every 2-3 steps (drawn last too)
        cfg["commit_every"] = rng.choice([2, 3])
    if in_backward or ("clip_value" not in cfg and rng.random() < 0.35):  # (drawn last too)
        # clipped by clip_norm within the limit (50: above every norm here), where the case clips
        cfg.update(clip=50.0 if cfg["clip"] else None, in_backward=True)
        cfg.pop("clip_value", None)
        if cfg["durable"] and cfg.get("commit_every", 1) == 1:  # (a journal refuses it)
            cfg["commit_every"] = 2
    return cfg


def run_sharded(cfg: dict, directory: pathlib.Path, zygote) -> str:
    """``"ok"``, ``"refused: ..."`` (every failing rank's error raised while its engine was
    built) or raises what failed."""
    import test_distributed
    from test_distributed import build, launch, reference
    test_distributed._ZYGOTE = zygote
    cfg = dict(cfg)
    world, fraction = cfg.pop("world"), cfg.pop("host_fraction")
    model = build(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = 4 * (sum(p.numel() for p in model.parameters()) + trainable * (3 if cfg["optimizer"] == "adamw" else 2))
    cfg["host_memory"] = int(fraction * state / world)
    if "device_fraction" in cfg:
        cfg["device_budget"] = int(cfg.pop("device_fraction") * cfg["host_memory"])
    resume_at = cfg.pop("resume_at", None)
    got = launch(world, directory, dict(cfg, steps=resume_at or cfg["steps"]), timeout=120, check=False)
    if resume_at is not None and all(code == 0 for code, _ in got):
        got = launch(world, directory, cfg, timeout=120, check=False)
    failed = [log for code, log in got if code != 0]
    if failed:
        refused = [log for log in failed if "engine = Engine(" in log.split("Traceback")[-1]
                   and ("TierCapacityError" in log or "ConfigError" in log)]
        if len(refused) == len(failed):
            return "refused: " + refused[0].strip().splitlines()[-1][:100]
        first = [log for log in failed if "DistributedError" not in log] or failed  # (the others saw it stop)
        raise AssertionError("a rank failed:\n" + first[0][-6000:])
    import torch
    have = torch.load(directory / "rank-0.pt", weights_only=False)["weights"]
    expected = reference(world, cfg)
    want = torch.cat([w.detach().flatten() for w in expected.values()])
    have = torch.cat([have[k].flatten() for k in expected])
    error = ((have - want).abs().max() / want.abs().max()).item()
    if error > 1e-6:
        raise AssertionError(f"the weights differ from one process's by {error:.2e} of the largest")
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (case i draws from seed + i)")
    ap.add_argument("--case-timeout", type=float, default=120.0, help="seconds before a case counts as hung")
    ap.add_argument("--sharded", action="store_true",
                    help="sharded runs instead (2-3 ranks on gloo, against one process, to 1e-6)")
    ap.add_argument("--load", type=int, default=0, metavar="N", help="N busy processes beside the cases")
    ap.add_argument("--wide", action="store_true", help="T5, BART, frozen parameters, LoRA, parameter groups too "
                                                         "(a seed draws another case with it than without)")
    ap.add_argument("--loops", action="store_true", help="Mixtral's aux loss, gradient checkpointing, eval() "
                                                          "inside a step, clip_grad_value_, other shapes, freezing "
                                                          "mid-run too (a third generator)")
    ap.add_argument("--zoo", action="store_true", help="models whose weights are shared or computed too (ALBERT, "
                                                        "a block called twice, weight_norm, spectral_norm)")
    ap.add_argument("--bare", action="store_true", help="a model with no parameter outside its blocks too (the "
                                                         "engine's rest unit empty)")
    ap.add_argument("--calls", action="store_true", help="block calls that take one tensor twice or return one "
                                                          "twice, a block's unsaved input changed in place too")
    ap.add_argument("--stores", action="store_true", help="the storage backend, striping and the store's options "
                                                           "too (from a second generator: the rest as without it)")
    ap.add_argument("--in-backward", action="store_true", help="every case runs the step in its last backward")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # (save_pretrained's, in the export checks)
    zoo = models(args.wide, args.loops, args.zoo, args.calls, args.bare)
    counts = {"ok": 0, "refused": 0, "failed": 0, "torn": 0}
    with contextlib.ExitStack() as stack:
        for _ in range(args.load):  # each spins until this process is gone (a hang's dump exits it at once)
            spinner = subprocess.Popen([sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"])
            stack.callback(spinner.kill)
        zygote = None
        if args.sharded:  # the ranks fork from one interpreter that imported torch and the library
            sys.path.insert(0, str(ROOT / "tools"))
            from crash_loop import WORKER_ENV
            from zygote import Zygote
            zygote = stack.enter_context(Zygote(env=WORKER_ENV))
        for seed in range(args.seed, args.seed + args.cases):
            rng = random.Random(seed)
            if args.sharded:
                case = draw_sharded(rng, args.in_backward)
                attempt = functools.partial(run_sharded, case, zygote=zygote)
            else:
                case, kw = draw(rng, zoo, args.wide, random.Random(f"stores-{seed}") if args.stores else None,
                                random.Random(f"loops-{seed}") if args.loops else None, args.in_backward)
                attempt = functools.partial(run, kw)
            t0 = time.monotonic()
            faulthandler.dump_traceback_later(args.case_timeout, exit=True)  # a hang: every stack, then out
            with tempfile.TemporaryDirectory(prefix=".fuzz-", dir=ROOT, ignore_cleanup_errors=True) as d:
                try:
                    outcome = attempt(pathlib.Path(d))
                except Exception as e:
                    where = "".join(traceback.format_tb(e.__traceback__)[-14:])  # (the innermost frames)
                    outcome = f"FAILED: {type(e).__name__}: {str(e)[-6000:]}\n    {case}\n{where}"
            faulthandler.cancel_dump_traceback_later()
            counts[outcome.split(":")[0].lower()] += 1
            print(f"{seed:6d} {time.monotonic() - t0:5.1f}s {outcome}", flush=True)
    print(f"{args.cases} cases: {counts['ok']} {'within 1e-6' if args.sharded else 'bitwise'}, "
          f"{counts['refused']} refused at construction, "
          + (f"{counts['torn']} torn (clipped in the backward by a limit every norm is over), "
             if counts["torn"] else "")
          + f"{counts['failed']} failed")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
