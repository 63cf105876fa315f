#!/usr/bin/env python
"""Step time of the engine against plain in-memory PyTorch, and against the I/O lower bound.

Measured in one run, same model, batch and optimizer (AdamW, clipping at 1.0):

1. plain PyTorch, everything in memory: the reference step time;
2. the engine with a host budget that holds the whole training state (no disk traffic after
   the first step);
3. the engine with the same arithmetic (blocks recomputed in backward) and everything in memory:
   the compute time of the disk run;
4. the engine with the state on disk and a host budget of a quarter of it (``--host-fraction``).

For the disk run it prints the bytes moved per step per tier, the disk throughput measured
here (raw posix reads and writes of the same directory, interleaved with nothing else), the I/O
lower bound (bytes read / read rate + bytes written / write rate: what the disk needs even with
perfect overlap; reads and writes share the device) and the compute time (3.), and the ratio step / max(compute, I/O bound): 1.0 means I/O fully
hidden behind compute, or compute fully hidden behind I/O.

    python tools/bench_train.py --d-model 512 --layers 8 --batch 8 --context 128 --steps 5
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from storage_backends.posix import PosixBackend
from tiered_offload import Engine, Tier
from tiered_offload.buffers import aligned_empty
from tiered_offload.models import GPT, GPTConfig
from tiered_offload.units import format_size


def loss_of(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def time_steps(step, batches):
    """Median time of ``step`` over ``batches[1:]``, after a warm-up on ``batches[0]``."""
    step(batches[0])
    times = []
    for x in batches[1:]:
        t0 = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def disk_rates(directory: str, nbytes: int = 512 << 20) -> tuple[float, float]:
    """Sequential write (to fsync) and O_DIRECT read rates of ``directory``, bytes/s."""
    b = PosixBackend(directory).open()
    buf = aligned_empty(nbytes)
    buf.fill_(7)
    try:
        t0 = time.perf_counter()
        b.write_from("rate-probe", buf).get()
        b.flush()
        w = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.read_into("rate-probe", buf).get()
        r = nbytes / (time.perf_counter() - t0)
        b.delete("rate-probe")
    finally:
        b.close()
    return w, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after one warm-up)")
    ap.add_argument("--path", default=None, help="storage directory (default: a temp dir under cwd)")
    ap.add_argument("--host-fraction", type=float, default=0.25, help="host budget of the disk run, as a fraction of the state")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    base = GPT(cfg)
    batches = [torch.randint(0, 256, (args.batch, args.context + 1)) for _ in range(args.steps + 1)]
    directory = args.path or tempfile.mkdtemp(prefix=".bench-train-", dir=os.getcwd())
    opt_kwargs = dict(lr=1e-4, weight_decay=0.01)
    try:
        # 1. plain PyTorch
        ref = copy.deepcopy(base)
        opt = torch.optim.AdamW(ref.parameters(), **opt_kwargs)

        def ref_step(x):
            loss_of(ref, x).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        t_ref = time_steps(ref_step, batches)


        def run_engine(host_budget, sub, recompute="auto"):
            engine = Engine(copy.deepcopy(base), torch.optim.AdamW, opt_kwargs,
                            storage=os.path.join(directory, sub), host_memory=host_budget, recompute=recompute)
            flags = f"recompute={engine.recompute}, overlapped step={engine.overlap_step}"

            def step(x):
                engine.backward(loss_of(engine, x))
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
            step(batches[0])  # warm-up: the first step initialises the optimizer states
            s0 = engine.stats
            times = []
            for x in batches[1:]:
                t0 = time.perf_counter()
                step(x)
                times.append(time.perf_counter() - t0)
            s1 = engine.stats
            n = len(times)
            moved = {k: {t.name.lower(): (getattr(s1, k)[t] - getattr(s0, k)[t]) / n for t in Tier}
                     for k in ("bytes_read", "bytes_written")}
            state = engine.state_bytes()
            engine.close()
            return statistics.median(times), moved, state, s1.io_wait_seconds - s0.io_wait_seconds, flags

        state_bytes = 16 * cfg.n_params()
        roomy = int(state_bytes * 1.6) + (64 << 20)
        t_host, _, state, _, flags_host = run_engine(roomy, "host")
        # the disk run recomputes blocks in backward: its compute time is the same arithmetic in memory
        t_compute, _, _, _, _ = run_engine(roomy, "compute", recompute=True)
        t_disk, moved_disk, _, wait, flags_disk = run_engine(int(state * args.host_fraction), "disk")
        w_rate, r_rate = disk_rates(directory)
    finally:
        if args.path is None:
            shutil.rmtree(directory, ignore_errors=True)
    rd, wr = moved_disk["bytes_read"]["disk"], moved_disk["bytes_written"]["disk"]
    io_bound = rd / r_rate + wr / w_rate
    compute = t_compute
    print(f"model: {cfg.n_params() / 1e6:.1f}M params, training state {format_size(state)}; batch {args.batch} x "
          f"{args.context} tokens; AdamW + clipping; median of {args.steps} steps after a warm-up")
    print(f"plain PyTorch in memory         {t_ref:8.3f} s/step")
    print(f"engine, state fits host tier     {t_host:8.3f} s/step   engine/in-memory = {t_host / t_ref:.2f}   ({flags_host})")
    print(f"engine, in memory, recomputing   {t_compute:8.3f} s/step   (the disk run's compute)")
    print(f"engine, state on disk (host={args.host_fraction:.2f}x state) {t_disk:8.3f} s/step   engine/in-memory = "
          f"{t_disk / t_ref:.2f}   ({flags_disk})")
    print(f"disk run, per step: read {format_size(rd)} from disk, wrote {format_size(wr)}; "
          f"host tier in {format_size(moved_disk['bytes_written']['host'])}")
    print(f"disk rates here: read {r_rate / 1e9:.2f} GB/s, write {w_rate / 1e9:.2f} GB/s -> I/O lower bound "
          f"{io_bound:.3f} s/step; compute (same arithmetic in memory) {compute:.3f} s/step")
    print(f"disk step / max(compute, I/O bound) = {t_disk / max(compute, io_bound):.2f}; time blocked waiting for I/O "
          f"{wait / args.steps:.3f} s/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
