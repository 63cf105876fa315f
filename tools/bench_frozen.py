"""Parameters frozen (fine-tuning the top of a model, progressive freezing): what each forward
keeps of the blocks' inputs, and the disk bytes and time per step.

One engine, state on disk, AdamW, every block recomputed (``recompute=True``) or the planner's
choice (``--activations auto``). ``--freeze lower``: the embedding and the lower ``--frozen``
blocks frozen (the head untied, so that it trains); a frozen block whose input needs no gradient
has no backward to run, so its recompute needs no input kept. ``--freeze rest``: every parameter
outside the blocks (the embedding tied to the head, the final norm) frozen; then the rest has no
gradient buffer to write. ``--at 0`` freezes at build, ``--at N`` after step N (mid-run). Prints,
medians over the steps after ``--at`` + 3: the bytes of block inputs (or saved activations) each
forward put into the store, per block; disk MiB read and written per step; seconds per step; the
process's peak RSS. To compare two versions of the engine, run it against each
(``PYTHONPATH=<a worktree> python ...``).

    python tools/bench_frozen.py                       # 8 blocks of d 256, 4 frozen, host 1/2 of the state
    python tools/bench_frozen.py --freeze rest --at 2 --steps 12
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from tiered_offload import Engine, Tier
from tiered_offload_examples.models import GPT, GPTConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--frozen", type=int, default=4, help="lower blocks frozen with the embedding")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--host-fraction", type=float, default=0.5, help="host budget, of the training state")
    ap.add_argument("--activations", choices=["recompute", "auto"], default="recompute")
    ap.add_argument("--freeze", choices=["lower", "rest"], default="lower")
    ap.add_argument("--at", type=int, default=0, help="0: frozen at build; N: after step N")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    model = GPT(cfg)
    if args.freeze == "lower":
        model.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())

    def freeze(m) -> None:
        for name, p in m.named_parameters():
            block = int(name.split(".")[1]) if name.startswith("blocks.") else None
            lower = block is None and name.startswith(("tok.", "pos.")) or block is not None and block < args.frozen
            if (lower if args.freeze == "lower" else block is None):
                p.requires_grad_(False)
    if args.at == 0:
        freeze(model)
    state = sum((16 if p.requires_grad else 4) * p.numel() for p in model.parameters())
    directory = tempfile.TemporaryDirectory(prefix=".bench-frozen-", dir=".")
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=directory.name,
                    host_memory=int(args.host_fraction * state), recompute=args.activations == "recompute" or "auto")
    g = torch.Generator().manual_seed(1)
    rows, kept = [], []
    try:
        for step in range(args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, args.context + 1), generator=g)
            st = engine.store.stats
            r0, w0, t0 = st.bytes_read[Tier.DISK], st.bytes_written[Tier.DISK], time.perf_counter()
            loss = F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            st = engine.store.stats
            rows.append((st.bytes_read[Tier.DISK] - r0, st.bytes_written[Tier.DISK] - w0, time.perf_counter() - t0))
            kept.append(dict(engine._streamer.activation_bytes))
            if step + 1 == args.at:
                freeze(engine.model)
        mib = 2 ** 20
        steady = rows[args.at + 3:]
        read, written, seconds = (statistics.median(r[i] for r in steady) for i in range(3))
        what = f"the embedding and {args.frozen} of {args.layers} blocks" if args.freeze == "lower" else "the rest"
        print(f"state {state / mib:.1f} MiB ({what} frozen {f'after step {args.at}' if args.at else 'at build'}), host "
              f"budget {engine.store.capacity('host') / mib:.1f} MiB, activations {engine.activation_modes}")
        last = kept[-1]
        print(f"inputs kept per forward: {sum(last.values()) / mib:.1f} MiB; per block "
              f"{[round(last.get(i, 0) / mib, 1) for i in range(args.layers)]}")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"per step (median of steps {args.at + 4}-{args.steps}): disk {read / mib:.2f} MiB read + "
              f"{written / mib:.2f} MiB written, {seconds:.3f} s; peak RSS {rss:.0f} MiB")
    finally:
        engine.close()
        directory.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
