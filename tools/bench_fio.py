#!/usr/bin/env python
"""fio against the posix backend on the same disk, interleaved, medians and ratios.

Both sides move the same file size with the same request size and the same number of requests
in flight: fio with O_DIRECT, ``--ioengine`` (io_uring, else libaio) and ``--iodepth=THREADS``;
the posix backend with O_DIRECT and THREADS threads. Writes are timed to a completed fsync on
both sides (fio ``--end_fsync=1``). The rounds alternate fio and posix so drift in a shared,
noisy disk hits both alike; the medians and their ratio are printed (target: posix/fio >= 0.9).

    python tools/bench_fio.py --path /mnt/nvme/tmp --size 1GiB --request 16MiB --threads 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from offload_core.buffers import aligned_empty
from offload_core.sizes import parse_size
from storage_backends.posix import PosixBackend


def fio_run(path: str, rw: str, size: int, request: int, depth: int, engine: str) -> float:
    cmd = ["fio", "--name=t", f"--filename={path}", f"--rw={rw}", f"--bs={request}", f"--size={size}",
           "--direct=1", f"--ioengine={engine}", f"--iodepth={depth}", "--numjobs=1", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if rw == "read" else job["write"]
    if rw == "write":
        # fio's bandwidth excludes the final fsync; use the job's whole runtime, as we do.
        return side["io_bytes"] / (job["job_runtime"] / 1000) / 1e9
    return side["bw_bytes"] / 1e9


def posix_run(backend: PosixBackend, rw: str, buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    if rw == "write":
        backend.write_from("bench", buf).get()
        backend.flush()
    else:
        backend.read_into("bench", buf).get()
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def pick_engine(path: str) -> str:
    for engine in ("io_uring", "libaio"):
        r = subprocess.run(["fio", "--name=probe", f"--filename={path}", "--rw=read", "--bs=4k", "--size=4k",
                            "--direct=1", f"--ioengine={engine}", "--output-format=json"], capture_output=True, text=True)
        if r.returncode == 0:
            return engine
    raise SystemExit("fio can run neither io_uring nor libaio here")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=None, help="directory on the disk to test (default: a temp dir under cwd)")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--request", default="16MiB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (Debian/Ubuntu: apt-get install fio)", file=sys.stderr)
        return 2
    size, request = parse_size(args.size), parse_size(args.request)
    directory = args.path or tempfile.mkdtemp(prefix=".bench-fio-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    fio_file = os.path.join(directory, "fio-file")
    backend = PosixBackend(directory, threads=args.threads, chunk_bytes=request, direct=True).open()
    buf = aligned_empty(size)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    with open(fio_file, "wb") as f:  # fio reads need the file to exist at full size
        f.truncate(size)
    engine = pick_engine(fio_file)
    results = {(tool, rw): [] for tool in ("fio", "posix") for rw in ("write", "read")}
    try:
        for r in range(args.rounds):
            for rw in ("write", "read"):
                order = ("fio", "posix") if r % 2 == 0 else ("posix", "fio")
                for tool in order:
                    gbps = fio_run(fio_file, rw, size, request, args.threads, engine) if tool == "fio" \
                        else posix_run(backend, rw, buf)
                    results[(tool, rw)].append(gbps)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{t} {rw} {v[-1]:.2f}" for (t, rw), v in results.items()),
                  flush=True)
    finally:
        backend.close()
        if args.path is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for f in (fio_file, os.path.join(directory, "bench")):
                if os.path.exists(f):
                    os.unlink(f)
    print(f"\nfio {engine} direct, iodepth {args.threads} vs posix backend O_DIRECT, {args.threads} threads; "
          f"{args.size} file, {args.request} requests, {args.rounds} interleaved rounds (medians)")
    print(f"{'':>6} {'fio GB/s':>9} {'posix GB/s':>10} {'posix/fio':>9}")
    for rw in ("read", "write"):
        f, p = statistics.median(results[("fio", rw)]), statistics.median(results[("posix", rw)])
        print(f"{rw:>6} {f:>9.2f} {p:>10.2f} {p / f:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
