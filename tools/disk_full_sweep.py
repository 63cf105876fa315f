"""Fill the disk at many moments of a durable run; every resume must find the last committed state whole.

    python tools/disk_full_sweep.py --runs 150 --seed 1     # about 2 minutes here
    python tools/disk_full_sweep.py --runs 150 --variants   # snapshot commits and a device tier too

Each run trains the small GPT of ``tests/test_durable.py`` (durable storage, a third of the state
in host memory, an LR scheduler) on a disk that is full after a quota drawn between the state's
preflight size and three more steps' writes, with a write latency drawn from none to 2 ms (it moves
the moment a write lands against the commit protocol's threads). The run stops with
``DiskFullError``, is closed, and resumed: the resumed weights must equal, byte for byte, those of
a run never stopped at the step the resume reports, and ``tiered-offload verify`` must pass.
``--variants`` also draws snapshot commits (``commit_every=2``, or a host budget the state fits in)
and a device tier (the CPU stand-in) of a third of the state.

The suite's ``test_disk_full_at_any_moment_keeps_the_last_committed_state`` tries five quotas; this
draws many, which is how a write that landed after ``close()`` and deleted a committed extent (1 run
in about 75) was found.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_durable as T  # noqa: E402 (tests/: the run, its engine and its reference)

from offload_core.errors import DiskFullError, TieredOffloadError  # noqa: E402
from storage_backends.posix import PosixBackend  # noqa: E402
from storage_backends.testing import FaultInjectingBackend  # noqa: E402
from tiered_offload.checkpoint.state_dir import StateDirectory  # noqa: E402


def one_run(directory: Path, quota: int, latency: float, per_step: dict, **engine_kw) -> str | None:
    """None when the resume found the committed state whole, else what went wrong."""
    engine = T.make_engine(FaultInjectingBackend(PosixBackend(directory), write_quota_bytes=quota, latency_s=latency),
                           durable=True, **engine_kw)
    torch.manual_seed(123)
    try:
        T.train(engine, 6)
        engine.wait_committed()
    except DiskFullError:
        pass
    try:
        engine.close()
    except TieredOffloadError:
        pass  # the failure reported again
    try:
        resumed = T.make_engine(directory, resume=True, **engine_kw)
    except TieredOffloadError as e:
        return f"the resume refused: {type(e).__name__}: {e}"
    step, same = resumed.step_count, T.same(T.weights(resumed), per_step[resumed.step_count])
    resumed.close()
    if not same:
        return f"resumed at step {step} with other weights than the run never stopped"
    if not StateDirectory(directory).verify()["ok"]:
        return f"resumed at step {step}, but verify finds the directory damaged"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", action="store_true", help="also snapshot commits (every 2nd step, or the state "
                    "in host memory) and a device tier of a third of the state (default: the journal, no device tier)")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="disk-full-sweep-"))
    try:
        per_step, _ = T.run_uninterrupted(base / "reference")
        n = sum(p.numel() for p in T.make_model().parameters())
        variants = [{}] + ([{"commit_every": 2}, {"host_memory": 1 << 20},  # snapshot commits
                            {"store_config": {"device_budget_bytes": 16 * n // 3}}] if args.variants else [])
        preflight = {}  # the disk each variant asks for when it is built: the state, plus its extra
        for n, kw in enumerate(variants):
            probe = T.make_engine(base / f"probe{n}", durable=True, **kw)
            preflight[n] = (probe.state_bytes(), probe.state_bytes() + probe.extra_disk_bytes())
            probe.close()
        rng, failures, start = random.Random(args.seed), 0, time.perf_counter()
        for i in range(args.runs):
            steps, latency = rng.uniform(0.0, 3.0), rng.choice([0.0, 0.0, 0.0005, 0.002])
            v = rng.randrange(len(variants)) if args.variants else 0
            kw, (state, need) = variants[v], preflight[v]
            problem = one_run(base / f"run{i}", int(need + steps * state), latency, per_step, **kw)
            if problem:
                failures += 1
                print(f"run {i} (quota: preflight + {steps:.4f} x the state, latency {latency} s, {kw}): {problem}",
                      flush=True)
            shutil.rmtree(base / f"run{i}", ignore_errors=True)
        print(f"{args.runs - failures}/{args.runs} runs resumed the last committed state whole "
              f"({time.perf_counter() - start:.0f} s)")
        return 1 if failures else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
