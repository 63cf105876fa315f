"""``tiered-offload demo``: train a byte-level GPT whose training state is several times the host budget.

The text is the Python standard library's own source files, which every machine with Python has.
The model is built with :func:`~tiered_offload.engine.facade.empty_init` (its parameters never exist
whole in memory), initialised unit by unit into the store, and trained with AdamW through the
engine with a host budget a fraction of its state. A progress bar shows the loss, tokens per
second, the disk's read and write rates and the peak host memory.
"""

from __future__ import annotations

import math
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload_core.errors import ConfigError
from offload_core.sizes import format_size, parse_size
from tiered_offload.engine.facade import Engine, empty_init
from tiered_offload.memstat import peak_rss_bytes
from tiered_offload.store.tiers import Tier
from tiered_offload_examples.models import GPT, GPTConfig

__all__ = ["load_stdlib_bytes", "run_demo"]


def load_stdlib_bytes(limit_bytes: int = 32 << 20) -> torch.Tensor:
    """The bytes of the standard library's ``.py`` files (sorted, so every run sees the same text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for parent, dirs, files in os.walk(root):  # (not into site-packages and the tests: the same files,
        dirs[:] = [d for d in dirs if d not in ("site-packages", "test")]  # without walking them)
        found += [Path(parent, f) for f in files if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(found):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    if total < 1 << 20:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def _check(*, d_model, layers, heads, context, batch, steps, lr) -> None:
    """The demo's arguments, each one the model and the training can take (else a
    :class:`ConfigError` naming its flag), before anything is built."""
    checks = [("--d-model", d_model, 1, ""), ("--layers", layers, 2, " (the engine streams the blocks)"),
              ("--heads", heads, 1, ""), ("--context", context, 2, " (a token and the next)"),
              ("--batch", batch, 1, ""), ("--steps", steps, 0, "")]
    for flag, value, least, why in checks:
        if not isinstance(value, int) or value < least:
            raise ConfigError(f"{flag} must be an integer >= {least}{why}, got {value!r}")
    if d_model % heads:
        raise ConfigError(f"--heads {heads} does not divide --d-model {d_model}; pick heads that do (6 for 384)")
    if not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ConfigError(f"--lr must be a finite number > 0, got {lr!r}")


def run_demo(*, d_model: int = 384, layers: int = 8, heads: int = 6, context: int = 128, batch: int = 8,
             steps: int = 60, lr: float = 2e-3, storage: str | None = None, host_memory: str | int | None = None,
             device: str = "auto", progress: bool = True, seed: int = 0) -> dict:
    """Train the demo model; return a summary (losses, throughput, bytes moved, peak memory)."""
    _check(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch, steps=steps, lr=lr)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, context=context, d_model=d_model, n_layers=layers, n_heads=heads)
    state_bytes = 16 * cfg.n_params()
    host = parse_size(host_memory) if host_memory is not None else state_bytes // 5
    data = load_stdlib_bytes()
    tmp = None
    if storage is None:
        tmp = tempfile.mkdtemp(prefix=".tiered-offload-demo-", dir=os.getcwd())
        storage = tmp
    rss0 = peak_rss_bytes()
    with empty_init():
        model = GPT(cfg)
    # a directory of the user's is a resumable training state: run the same command again to continue
    engine = Engine(model, torch.optim.AdamW, dict(lr=lr, weight_decay=0.1, betas=(0.9, 0.95)),
                    storage=storage, host_memory=host, device=device, resume="auto" if tmp is None else False)
    engine.attach_scheduler(torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: min(1.0, (s + 1) / 5)))
    first_step = engine.step_count
    losses, t_start = [], time.perf_counter()
    stats0 = engine.stats()
    from tqdm import tqdm
    bar = tqdm(range(first_step, steps), desc="demo", unit="step", initial=first_step, total=steps,
               disable=not progress)
    try:
        for step in bar:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # step i's batch, resumed or not
            starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
            window = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
            t0 = time.perf_counter()
            logits = engine(window[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].to(logits.device).flatten())
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()  # also steps the LR schedule; the step is committed to the storage directory
            engine.zero_grad()
            dt = time.perf_counter() - t0
            losses.append(loss.item())
            s = engine.stats()
            elapsed = time.perf_counter() - t_start
            bar.set_postfix_str(
                f"loss {loss.item():.3f} | {batch * context / dt:,.0f} tok/s | disk read "
                f"{(s.bytes_read[Tier.DISK] - stats0.bytes_read[Tier.DISK]) / elapsed / 1e9:.2f} GB/s write "
                f"{(s.bytes_written[Tier.DISK] - stats0.bytes_written[Tier.DISK]) / elapsed / 1e9:.2f} GB/s | "
                f"peak host {format_size(peak_rss_bytes())}")
    finally:
        bar.close()
        summary_stats = engine.stats()
        last_step = engine.step_count
        engine.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    done = last_step - first_step
    return {
        "params": cfg.n_params(),
        "state_bytes": engine.state_bytes(),
        "host_budget_bytes": host,
        "steps": done,
        "first_step": first_step,
        "storage": None if tmp is not None else str(storage),
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "loss_first5_mean": sum(losses[:5]) / min(5, len(losses)) if losses else math.nan,
        "loss_last5_mean": sum(losses[-5:]) / min(5, len(losses)) if losses else math.nan,
        "seconds": elapsed,
        "tokens_per_second": done * batch * context / elapsed,
        "disk_read_bytes": summary_stats.bytes_read[Tier.DISK],
        "disk_written_bytes": summary_stats.bytes_written[Tier.DISK],
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_bytes": rss0,
        "uniform_loss": math.log(256),
    }


def main(args) -> int:
    """The ``demo`` subcommand."""
    summary = run_demo(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context,
                       batch=args.batch, steps=args.steps, lr=args.lr, storage=args.storage,
                       host_memory=args.host_memory, device=args.device, progress=not args.no_progress)
    s = summary
    print(f"model: {s['params'] / 1e6:.1f}M parameters, training state {format_size(s['state_bytes'])} "
          f"= {s['state_bytes'] / s['host_budget_bytes']:.1f}x the host budget of {format_size(s['host_budget_bytes'])}")
    print(f"loss: {s['loss_first5_mean']:.3f} (mean of the first 5 steps) -> {s['loss_last5_mean']:.3f} (last 5); "
          f"uniform guessing is {s['uniform_loss']:.3f}")
    if s["first_step"]:
        print(f"resumed at step {s['first_step']} from {s['storage']}")
    print(f"{s['steps']} steps in {s['seconds']:.1f} s ({s['tokens_per_second']:,.0f} tokens/s); disk read "
          f"{format_size(s['disk_read_bytes'])}, written {format_size(s['disk_written_bytes'])}; "
          f"peak host memory {format_size(s['peak_rss_bytes'])} (before the model: {format_size(s['rss_before_bytes'])})")
    if s["storage"]:
        print(f"the training state after step {s['first_step'] + s['steps']} is committed in {s['storage']}: run the "
              f"same command with a larger --steps to continue, `tiered-offload inspect {s['storage']}` to look at it")
    return 0
