"""Kill one rank of a sharded run with SIGKILL at random moments, start the job again, repeat; check
that every run ends bitwise where an uninterrupted one does.

    python tools/crash_loop_dist.py --kills 30 --seed 1 [--ranks 3]

Runs 2 (``--ranks``) ranks of ``tests/dist_worker.py`` (a small GPT, AdamW, an LR scheduler, clipping, each rank
its own micro-batches and directory, durable storage), forked from a zygote as the tests' ranks
are. Each configuration draws ``commit_every`` (1, 2 or 3) and the host budget (a share that fits
memory: snapshot commits; 0.9 of a share, at least 300 KiB: the state streams through the disk,
committed by the journal at ``commit_every=1``). The driver trains it once uninterrupted, then starts it in a fresh
directory and SIGKILLs a random rank after a random delay, so kills land in start-up, recovery, the
steps and the commits (the other rank stops on its next collective); it starts the job again until
a run finishes, whose final weights must equal the uninterrupted run's byte for byte. Then the
next configuration, until ``--kills`` kills have landed.

``--step-in-backward``: no clipping, each step run in its backward (``backward(loss, step=True)``),
6 blocks (at 0.6 of a share the state streams and a block's update fits beside the backward's pins;
at 0.9 it does not: the step runs after the backward), ``commit_every`` drawn where a journal does
not commit (a journal refuses it: 2 or 3, or 1 where the share fits memory). With ``--clip-in-backward C``
clipped by ``clip_norm=C``: a step whose norm turns out over ``C`` after some unit's update is torn
(``ClipTornError``, on every rank); the ranks record it and exit, and the job's next start resumes
from the last commit and runs the torn steps after the backward, clipped, as ``tiered-offload train``
does in-process. A torn start is started again, not counted as a kill; both runs tear alike.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--step-in-backward", action="store_true")
    ap.add_argument("--stripe-weights", default=None, metavar="W",
                    help="each rank's state striped over two directories by these weights (3:1)")
    ap.add_argument("--clip-in-backward", type=float, default=None, metavar="C",
                    help="with --step-in-backward: clip_norm=C in the backward (tears start the job again)")
    args = ap.parse_args()
    if args.clip_in_backward is not None and not args.step_in_backward:
        ap.error("--clip-in-backward needs --step-in-backward")
    import torch

    import test_distributed
    from dist_worker import build
    from zygote import Zygote
    rng = random.Random(args.seed)
    kills = runs = failures = back = dropped = tears = 0
    with tempfile.TemporaryDirectory(prefix="crash-loop-dist-") as tmp, Zygote() as zygote:
        test_distributed._ZYGOTE = zygote
        while kills < args.kills:
            cfg = {"layers": 4, "optimizer": "adamw", "steps": args.steps, "accumulate": 1, "clip": 1.0,
                   "durable": True, "timeout_s": 30, "scheduler": True, "commit_every": rng.choice([1, 2, 3]),
                   **({"striped": True, "stripe_weights": args.stripe_weights} if args.stripe_weights else {})}
            share = 16 * sum(p.numel() for p in build(cfg).parameters()) / args.ranks
            fraction = rng.choice([0.9, 3.0])
            if args.step_in_backward:  # 6 blocks: at 0.6 of a share a block's update fits beside the backward's pins
                cfg["layers"], fraction = 6, rng.choice([0.6, 0.6, 0.9, 3.0])
                share = 16 * sum(p.numel() for p in build(cfg).parameters()) / args.ranks
                # (a journal commits only at commit_every 1 with the state beyond memory: it refuses the step)
                cfg.update(clip=args.clip_in_backward, in_backward=True, retear=args.clip_in_backward is not None,
                           commit_every=rng.choice([2, 3] if fraction < 1 else [1, 2, 3]))
            cfg["host_memory"] = max(int(fraction * share), 300 << 10)  # (the least it trains in)
            base = Path(tmp) / f"run-{runs}"
            (base / "once").mkdir(parents=True)
            (base / "killed").mkdir()
            t0 = time.perf_counter()
            whole = test_distributed.launch(args.ranks, base / "once", cfg)[0]
            torn = 0
            while whole["torn"]:  # (a step torn in the backward: the job starts again, that step after it)
                torn += 1
                whole = test_distributed.launch(args.ranks, base / "once", cfg)[0]
            span = time.perf_counter() - t0
            tears += torn
            starts, landed = 0, 0
            while True:
                starts += 1
                victim, delay = rng.randrange(args.ranks), rng.uniform(0.05, span)
                got = test_distributed._launch(args.ranks, base / "killed", dict(cfg, kill_after=[victim, delay]), 180)
                back += any("going back from step" in log for _, log in got)  # (a rank a commit ahead)
                dropped += any("dropping step" in log for _, log in got)  # (an intent not every rank wrote)
                if any(code is None for code, _ in got):
                    print(f"run {runs}: start {starts} ({cfg}, rank {victim} killed after {delay:.2f} s) hung:\n" +
                          "\n".join(f"-- rank {r}:\n{log[-8000:]}" for r, (_, log) in enumerate(got)))
                    return 1
                if all(code == 0 for code, _ in got):
                    if not torch.load(base / "killed" / "rank-0.pt", weights_only=False)["torn"]:
                        break
                    continue  # (torn: start again)
                # the other rank stops typed, or the kill landed after training, in the worker's last barrier
                if got[victim][0] != -9 or any(code not in (0, -9) and "DistributedError" not in log
                                               and "in run\n    dist.barrier()" not in log for code, log in got):
                    print(f"run {runs}: a start failed otherwise than by the kill:\n" +
                          "\n".join(log[-3000:] for _, log in got))
                    return 1
                landed += 1
            kills += landed
            have = torch.load(base / "killed" / "rank-0.pt", weights_only=False)["weights"]
            same = all(torch.equal(have[k], whole["weights"][k]) for k in whole["weights"])
            failures += not same
            inside = (f", {sum(whole['updated_in_backward'])} of {len(whole['updated_in_backward'])} updates in the "
                      f"backward" if args.step_in_backward else "")  # (the uninterrupted run's last start, rank 0)
            inside += f", {torn} steps torn" if args.clip_in_backward is not None else ""
            print(f"run {runs}: commit_every {cfg['commit_every']}, {whole['commits']}{inside}, {landed} kills in "
                  f"{starts} starts: {'bitwise' if same else 'DIFFERENT'}", flush=True)
            runs += 1
    print(f"{kills} kills over {runs} runs: {runs - failures} of {runs} bitwise; starts where a rank went back a "
          f"commit: {back}, dropped a step's intent: {dropped}"
          + (f"; steps torn in the uninterrupted runs: {tears}" if args.clip_in_backward is not None else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
