#!/usr/bin/env python
"""What the store adds on top of its backend: DISK->HOST prefetch of one tensor vs a raw backend read.

Both read the same bytes from the same file with the same backend settings into page-aligned
host memory: the raw side calls ``backend.read_into`` on a preallocated buffer; the store side
evicts the tensor from the host tier and times ``store.prefetch(key, "host").get()``, which adds
arena allocation, bookkeeping and completion handling. Rounds alternate; medians and their
ratio are printed (target: store / raw >= 0.9 for a 64 MiB tensor).

    python tools/bench_store.py --path /mnt/nvme/tmp --tensor 64MiB --rounds 15
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
from storage_backends.posix import PosixBackend
from tiered_offload import TieredStore


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=None)
    ap.add_argument("--tensor", default="64MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--request", default="8MiB")
    args = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
