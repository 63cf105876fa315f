#!/usr/bin/env python
"""What the store adds on top of its backend: DISK->HOST prefetch of one tensor vs a raw backend read.

Both read the same bytes from the same file with the same backend settings into page-aligned
host memory: the raw side calls ``backend.read_into`` on a preallocated buffer; the store side
evicts the tensor from the host tier and times ``store.prefetch(key, "host").get()``, which adds
arena allocation, bookkeeping and completion handling. Rounds alternate; medians and their
ratio are printed (target: store / raw >= 0.9 for a 64 MiB tensor).

    python tools/bench_store.py --path /mnt/nvme/tmp --tensor 64MiB --rounds 15

``--bookkeeping N``: the store's own time per ``get`` in a full host tier, with N tensors
registered and room for half of them, so that about every other ``get`` evicts (the lookahead
keeps a stable half resident); an in-memory backend whose I/O runs in the caller's thread, so
what is timed is the store's Python: the victim rule, the lookahead, the copy. A 1B-parameter model has several hundred tensors (16 MiB state pieces); the training
thread pays this at every eviction.

    python tools/bench_store.py --bookkeeping 1000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from offload_core.buffers import aligned_empty
from offload_core.sizes import parse_size
from storage_backends.memory import MemoryBackend
from storage_backends.posix import PosixBackend
from tiered_offload import TieredStore


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=None)
    ap.add_argument("--tensor", default="64MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--request", default="8MiB")
    ap.add_argument("--bookkeeping", type=int, default=0, metavar="N",
                    help="instead: the store's time per get in a full host tier, N tensors registered, room for N/2")
    args = ap.parse_args()
    if args.bookkeeping:
        return bookkeeping(args.bookkeeping, args.rounds)
    nbytes = parse_size(args.tensor)
    directory = args.path or tempfile.mkdtemp(prefix=".bench-store-", dir=os.getcwd())
    backend = PosixBackend(directory, threads=args.threads, chunk_bytes=args.request, direct=True)
    store = TieredStore(backend, host_budget_bytes=2 * nbytes + (1 << 20), device="cpu", device_budget_bytes=0,
                        policy="lru").open()
    try:
        data = torch.randn(nbytes // 4)
        store.register("w", data.shape, data=data)
        store.flush()
        raw_buf = aligned_empty(nbytes)
        raw, ours = [], []
        for r in range(args.rounds):
            for side in (("raw", "store") if r % 2 == 0 else ("store", "raw")):
                if side == "raw":
                    t0 = time.perf_counter()
                    backend.read_into("w", raw_buf).get()
                    raw.append(nbytes / (time.perf_counter() - t0) / 1e9)
                else:
                    store.evict("w", "host").get()
                    t0 = time.perf_counter()
                    store.prefetch("w", "host").get()
                    ours.append(nbytes / (time.perf_counter() - t0) / 1e9)
        assert torch.equal(store.read("w"), data), "store returned wrong bytes"
        assert torch.equal(raw_buf.view(torch.float32), data), "backend returned wrong bytes"
    finally:
        store.close()
        backend.close()
        if args.path is None:
            shutil.rmtree(directory, ignore_errors=True)
    r, s = statistics.median(raw), statistics.median(ours)
    print(f"{args.tensor} tensor, posix O_DIRECT {args.threads} threads x {args.request}, {args.rounds} interleaved rounds (medians)")
    print(f"raw backend read   {r:.2f} GB/s")
    print(f"store prefetch     {s:.2f} GB/s")
    print(f"store / raw        {s / r:.2f}")
    return 0


def bookkeeping(n: int, rounds: int) -> int:
    """Median microseconds per ``get`` + ``release`` over a cyclic scan of ``n`` tensors of 4 KiB,
    the lookahead policy and a host tier of ``n / 2`` of them (the evictions are counted)."""
    numel = 1024
    backend = MemoryBackend(threads=0)
    store = TieredStore(backend, host_budget_bytes=(n // 2) * numel * 4, device="cpu", device_budget_bytes=0,
                        policy="lookahead").open()
    try:
        keys = [f"t{i}" for i in range(n)]
        for k in keys:
            store.register(k, (numel,))
        store.declare_access_sequence(keys)
        per_get = []
        for r in range(rounds + 1):  # the first pass fills the tier
            t0 = time.perf_counter()
            for k in keys:
                store.get(k)
                store.release(k)
            if r:
                per_get.append((time.perf_counter() - t0) / n * 1e6)
        evictions = store.stats.evictions
    finally:
        store.close(flush=False)
        backend.close()
    print(f"{n} tensors registered, {n // 2} resident in the host tier, lookahead, {rounds} passes")
    print(f"per get + release  {statistics.median(per_get):.1f} us (median of the passes)")
    print(f"evictions          {dict((t.name.lower(), c) for t, c in evictions.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
