#!/usr/bin/env python
"""The smallest host budget the engine accepts for a model, and proof that it trains there.

Builds a Hugging Face GPT-2 (default: 4 blocks of width 512, the 50257-token vocabulary tied to
the head: 38.9M parameters, 593 MiB of fp32 weights, gradients and AdamW states) with
``empty_init()``, asks the engine for its minimum compute-tier budget (the figure its
``TierCapacityError`` names), prints it against the training state, then trains ``--steps``
steps at exactly that budget with the state on disk, and checks that one byte less is refused.

    python tools/min_budget.py                      # GPT-2 4 x 512
    python tools/min_budget.py --layers 12 --d-model 768 --steps 0
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path
import time

import torch

from offload_core.sizes import format_size
from tiered_offload import Engine, EngineConfig, TierCapacityError, empty_init
from tiered_offload.memstat import peak_rss_bytes


def gpt2(layers: int, d_model: int, vocab: int, untied: bool = False):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=d_model, n_layer=layers,
                                  n_head=max(1, d_model // 64), tie_word_embeddings=not untied)
    with empty_init():
        model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=2, help="steps to train at the minimum budget (0: none)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--dir", default=None, help="storage directory (default: a temporary one)")
    ap.add_argument("--untied", action="store_true", help="a head of its own instead of the tied embedding")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = gpt2(args.layers, args.d_model, args.vocab, args.untied)
    n = sum(p.numel() for p in model.parameters())
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        try:
            Engine(model, torch.optim.AdamW, dict(lr=1e-4), storage=f"{tmp}/probe", host_memory="1MiB")
            raise SystemExit("a 1 MiB budget was accepted; nothing to measure")
        except TierCapacityError as e:
            message = str(e)
        figure = re.search(r"at least ([0-9.]+ [KMGT]iB)", message).group(1)
        need = int(re.search(r"\((\d+) bytes\) needed", message).group(1))
        model = gpt2(args.layers, args.d_model, args.vocab, args.untied)
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-4), storage=f"{tmp}/run", host_memory=figure.replace(" ", ""))
        state = engine.state_bytes()
        print(f"model: GPT-2, {args.layers} blocks x {args.d_model}, vocabulary {args.vocab}"
              f"{' (untied head)' if args.untied else ''}: {n / 1e6:.1f}M parameters")
        print(f"training state (weights, gradients, AdamW m and v): {format_size(state)} ({state} bytes)")
        print(f"minimum host budget: {figure} ({need} bytes) = {need / state:.1%} of the state")
        try:  # the same model with its large non-block modules held for the whole pass instead of streamed
            Engine(gpt2(args.layers, args.d_model, args.vocab, args.untied), torch.optim.AdamW, dict(lr=1e-4),
                   storage=f"{tmp}/bound", host_memory="1MiB", config=EngineConfig(stream_modules_numel=None))
        except TierCapacityError as e:
            bound = int(re.search(r"\((\d+) bytes\) needed", str(e)).group(1))
            print(f"  with EngineConfig(stream_modules_numel=None) (embedding and head not streamed): "
                  f"{format_size(bound)} = {bound / state:.1%}")
        print(f"  the error's figure passed back as host_memory={figure!r}: accepted "
              f"(host tier {format_size(engine.store.capacity('host'))})")
        g = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            t0 = time.perf_counter()
            x = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            engine.wait_committed()
            print(f"  step {step + 1} at the minimum budget: loss {loss.item():.4f}, {time.perf_counter() - t0:.1f} s, "
                  f"host tier peak {format_size(engine.store.arena(engine.store.compute_tier).peak_used)}")
        engine.close()
        try:
            Engine(gpt2(args.layers, args.d_model, args.vocab, args.untied), torch.optim.AdamW, dict(lr=1e-4),
                   storage=f"{tmp}/less", host_memory=need - 1)
            print(f"  {need - 1} bytes: accepted (the stated figure is not the minimum)")
        except TierCapacityError:
            print(f"  {need - 1} bytes (one less than the minimum): refused")
        print(f"peak RSS of this process: {format_size(peak_rss_bytes())}")


if __name__ == "__main__":
    main()
