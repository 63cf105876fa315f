#!/usr/bin/env python
"""Scale check: train a model whose fp32 training state exceeds this machine's RAM, a few steps.

Default: a GPT-style byte-level decoder of 1.54B parameters (d_model 1600, 50 blocks): 24.6 GB
of weights, gradients and AdamW states, on disk, with a 4 GiB host budget. Prints, per step, the
time, the loss, the bytes read from and written to disk, and at the end the peak RSS.

    python tools/train_large.py --storage /mnt/nvme/large --steps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import psutil
import torch
import torch.nn.functional as F

from tiered_offload import Engine, Tier, empty_init, format_size
from tiered_offload.memstat import peak_rss_bytes
from tiered_offload_examples.demo import load_stdlib_bytes
from tiered_offload_examples.models import GPT, GPTConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1600)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--heads", type=int, default=25)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-memory", default="4GiB")
    ap.add_argument("--storage", default=None, help="default: a temp dir under cwd (removed afterwards)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    storage = args.storage or tempfile.mkdtemp(prefix=".train-large-", dir=os.getcwd())
    ram = psutil.virtual_memory().total
    print(f"model: {cfg.n_params() / 1e9:.3f}B parameters, fp32 training state with AdamW "
          f"{format_size(16 * cfg.n_params())}; machine RAM {format_size(ram)}; host budget {args.host_memory}", flush=True)
    data = load_stdlib_bytes()
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with empty_init():
        model = GPT(cfg)
    try:
        engine = Engine(model, torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01), storage=storage,
                        host_memory=args.host_memory)
        print(f"initialised {format_size(engine.state_bytes())} of state in {storage} in {time.perf_counter() - t0:.0f} s "
              f"(recompute={engine.recompute}, step={engine.step_mode})", flush=True)
        for step in range(args.steps):
            s0 = engine.stats()
            t = time.perf_counter()
            starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=g)
            x = torch.stack([data[s:s + args.context + 1] for s in starts.tolist()]).long()
            logits = engine(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            s1 = engine.stats()
            print(f"step {step}: {time.perf_counter() - t:.1f} s, loss {loss.item():.3f}, disk read "
                  f"{format_size(s1.bytes_read[Tier.DISK] - s0.bytes_read[Tier.DISK])}, written "
                  f"{format_size(s1.bytes_written[Tier.DISK] - s0.bytes_written[Tier.DISK])}, "
                  f"peak RSS so far {format_size(peak_rss_bytes())}", flush=True)
        t = time.perf_counter()
        engine.close()
        print(f"final write-back {time.perf_counter() - t:.1f} s; peak RSS "
              f"{format_size(peak_rss_bytes())}", flush=True)
    finally:
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
