"""Checksum throughput, and how much of it leaves the GIL free: the storage format's XXH3
against format 1's zlib CRC-32, on the same buffer in the same run.

    python tools/bench_checksum.py [--mib 256] [--repeat 5]

"GIL free" is how fast a pure-Python counter thread runs while the checksum runs on another
thread, as a share of its speed alone (1.0: the checksum never holds the GIL; near 0: it holds it
throughout; on a machine with fewer free cores than two it is lower for both).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from tiered_offload.store.checksum import checksum_function


def _spin_rate(seconds: float, work=None) -> float:
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    if work is None:
        time.sleep(seconds)
    else:
        work()
    c1, dt = count[0], time.perf_counter() - t0
    stop[0] = True
    t.join()
    return (c1 - c0) / dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    raw = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    alone = _spin_rate(0.5)
    out = {"mib": args.mib}
    for name in ("xxh3", "crc32"):
        fn = checksum_function(name)
        fn(raw)  # warm
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            fn(raw)
        dt = time.perf_counter() - t0
        shared = _spin_rate(0, lambda: [fn(raw) for _ in range(args.repeat)])
        out[name] = {"GB_per_s": round(args.repeat * raw.numel() / dt / 1e9, 2), "gil_free": round(shared / alone, 2)}
    out["xxh3_over_crc32_speed"] = round(out["xxh3"]["GB_per_s"] / out["crc32"]["GB_per_s"], 2)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
