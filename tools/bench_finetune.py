"""Step time of ``tiered-offload train`` against the same training written by hand on the engine.

Both train the same local model (a small Llama and tokenizer built here, saved with
``save_pretrained``) on the same sequences with the same engine settings (state on disk, a host
budget below the state); rounds alternate the two so the machine's noise hits them alike. Each
step is timed from the end of the one before (for the command: everything it does per step,
metrics and progress included), the hand-written loop's the same way. Prints the medians of
steady-state steps and their ratio (target <= 1.05).

    python tools/bench_finetune.py --rounds 3 --steps 6
    python tools/bench_finetune.py --rounds 3 --steps 6 --without-clipping

``--without-clipping``: instead, the command against itself with ``train.clip: null``, which runs
each step in the backward (both with ``offload.commit_every: 2``, snapshot commits): step time and
disk bytes per step (from ``metrics.jsonl``'s records), and their ratios. ``--clip-in-backward``:
the command with ``train.clip: CLIP`` (``--clip``) trying its steps in the backward
(``train.clip_in_backward``: true, the default, each step tried and the engine's prediction of its
norm deciding; or ``--share``, a share of the limit) against never (0), or against the
default ``offload.commit_every: 1`` (journal commits; ``--against-journal``); also how many steps ran
there and how many were torn (run again after the backward).

    python tools/bench_finetune.py --rounds 3 --steps 6 --clip-in-backward --clip 5.0 --disk-rate 150

``--disk-rate MB/S``: the storage no faster than that, reads and writes together
(``tools/slow_disk.py``): a disk-bound machine on this compute-bound one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(directory: Path, layers: int, width: int) -> Path:
    import tokenizers
    import transformers
    words = "the cat sat on a mat while dogs ran around big red houses near green trees every day".split()
    g = torch.Generator().manual_seed(0)
    corpus = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g)) for _ in range(2000)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    model_dir = directory / "model"
    fast.save_pretrained(model_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=width, intermediate_size=4 * width,
                                   num_hidden_layers=layers, num_attention_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    (directory / "train.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in corpus))
    return model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steps per round and per way (the first is warm-up)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--host-fraction", type=float, default=0.5)
    ap.add_argument("--without-clipping", action="store_true",
                    help="the command with train.clip 1.0 against null (the step in the backward) instead")
    ap.add_argument("--clip-in-backward", action="store_true",
                    help="the command with train.clip_in_backward true against 0 (clipped steps tried in the backward)")
    ap.add_argument("--clip", type=float, default=1.0, help="train.clip of --clip-in-backward")
    ap.add_argument("--share", default="true",
                    help="train.clip_in_backward of --clip-in-backward's tries (true: each; a share of --clip)")
    ap.add_argument("--against-journal", action="store_true",
                    help="with --clip-in-backward: against the default offload.commit_every 1 (journal commits)")
    ap.add_argument("--disk-rate", type=float, default=0, metavar="MB/S", help="the storage held to this rate")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (its models, data and runs)")
    args = ap.parse_args()
    if args.disk_rate:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from slow_disk import slow_file_backends
        slow_file_backends(args.disk_rate * 1e6)
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    try:
        _bench(args, work)
    finally:  # (each run wrote 0.1-0.6 GB there)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _bench(args, work: Path) -> None:
    import transformers

    from tiered_offload import Engine, empty_init
    from tiered_offload.train import load_config, train
    from tiered_offload.train.data import micro_batch_rows, prepare_data
    from tiered_offload.train.run import lr_factor
    model_dir = build(work, args.layers, args.width)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    n = transformers.LlamaForCausalLM(hf).num_parameters()
    host = int(16 * n * args.host_fraction)
    command, by_hand = [], []
    if args.without_clipping:
        return _ways(args, work, model_dir, n, host, {"clip 1.0": ["train.clip=1.0"], "clip null": ["train.clip=null"]})
    if args.clip_in_backward:  # (a way's settings come after the common ones: offload.commit_every 2)
        first = (("journal, clipped after", ["offload.commit_every=1"]) if args.against_journal else
                 ("clipped after", ["train.clip_in_backward=0"]))
        return _ways(args, work, model_dir, n, host, {
            first[0]: [f"train.clip={args.clip}", *first[1]],
            "clipped, tried in the backward": [f"train.clip={args.clip}", f"train.clip_in_backward={args.share}"]})
    for r in range(args.rounds):
        total = args.steps
        overrides = [f"model.path={model_dir}", f"data.path={work / 'train.jsonl'}", "data.max_seq_len=128",
                     "train.micro_batch=4", "train.grad_accum=2", f"train.max_steps={total}", "train.lr=1.0e-3",
                     "train.warmup_steps=1", f"offload.storage={work / f'cmd{r}'}", f"offload.host_memory={host}",
                     f"output.dir={work / f'out{r}'}", "output.export_every=0"]
        marks = []  # the time between two steps' ends: everything the command does per step
        train(load_config(None, overrides), progress=False, on_step=lambda s, rec: marks.append(time.perf_counter()))
        command += [b - a for a, b in zip(marks, marks[1:])]
        # the same training, written by hand against the engine
        cfg = load_config(None, overrides)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        data, _ = prepare_data(cfg.data, tokenizer, model_dir, work / f"out{r}" / ".cache", 256)
        torch.manual_seed(0)
        with empty_init():
            model = transformers.AutoModelForCausalLM.from_config(hf)
        groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.0},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
        with Engine(model, torch.optim.AdamW(groups, lr=1e-3), storage=work / f"hand{r}", host_memory=host,
                    init_from=model_dir) as engine:
            engine.attach_scheduler(torch.optim.lr_scheduler.LambdaLR(
                engine.optimizer, lambda s: lr_factor(s, total, 1, "cosine")))
            last = None
            for step in range(total):
                batches = [data.batch(micro_batch_rows(len(data), 0, step * 2 + micro, 4)) for micro in range(2)]
                engine.forward_backward(batches, lambda out, _: out.loss / 2)  # as the command runs them
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
                now = time.perf_counter()
                if last is not None:
                    by_hand.append(now - last)
                last = now
    a, b = statistics.median(command), statistics.median(by_hand)
    print(json.dumps({"parameters": n, "state_bytes": 16 * n, "host_budget": host, "steps_each": len(command),
                      "command_s_per_step": round(a, 4), "by_hand_s_per_step": round(b, 4),
                      "ratio": round(a / b, 3)}, indent=1))
    print(f"tiered-offload train: {a:.3f} s/step; the same loop by hand: {b:.3f} s/step; ratio {a / b:.3f} "
          f"(target <= 1.05)")


def _ways(args, work: Path, model_dir: Path, n: int, host: int, ways: dict[str, list[str]]) -> None:
    """The command in two ways (settings over the common ones; the second against the first),
    alternating by round: seconds and disk bytes per steady step (the first step of each run left
    out), and how many steps were tried in the backward, ran there (a unit updated there) and were
    torn there (run again after it)."""
    import logging

    from tiered_offload.train import load_config, run, train
    runs = {name: [] for name in ways}
    counts = {name: {"in_backward": 0, "ran_there": 0, "steps": 0, "torn": 0, "runs_s": 0.0} for name in ways}
    step_fn = run.train_step

    class Torn(logging.Handler):
        def emit(self, record):
            if "over train.clip" in record.getMessage():
                counts[current]["torn"] += 1
    logging.getLogger("tiered_offload").addHandler(Torn())
    for r in range(args.rounds):
        for name, settings in list(ways.items())[::1 if r % 2 == 0 else -1]:
            current, tag = name, f"{list(ways).index(name)}-{r}"
            overrides = [f"model.path={model_dir}", f"data.path={work / 'train.jsonl'}", "data.max_seq_len=128",
                         "train.micro_batch=4", "train.grad_accum=2", f"train.max_steps={args.steps}",
                         "train.lr=1.0e-3", "train.warmup_steps=1", f"offload.storage={work / tag}",
                         f"offload.host_memory={host}", "offload.commit_every=2", *settings,
                         f"output.dir={work / f'out-{tag}'}", "output.export_every=0"]
            marks, records = [], []

            def counted(engine, batches, t, tokens, in_backward, *rest, name=name):
                counts[name]["steps"] += 1
                counts[name]["in_backward"] += bool(in_backward)
                before = engine.stats().updates_in_backward
                try:
                    return step_fn(engine, batches, t, tokens, in_backward, *rest)
                finally:  # (a step tried there that the engine kept after it updated none there)
                    counts[name]["ran_there"] += engine.stats().updates_in_backward > before
            run.train_step = counted
            t0 = time.perf_counter()
            try:
                train(load_config(None, overrides), progress=False,
                      on_step=lambda s, rec: (marks.append(time.perf_counter()), records.append(rec)))
            finally:
                run.train_step = step_fn
            counts[name]["runs_s"] += time.perf_counter() - t0  # (the whole command: a tear's replay too)
            runs[name] += [(b - a, rec["disk_read_bytes"] + rec["disk_written_bytes"])
                           for a, b, rec in zip(marks, marks[1:], records[1:])]
    med = {name: (statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows))
           for name, rows in runs.items()}
    first, second = ways
    (b, db), (a, da) = med[first], med[second]
    print(json.dumps({"parameters": n, "state_bytes": 16 * n, "host_budget": host, "steps_each": len(runs[second]),
                      "disk_rate_MBps": args.disk_rate or None,
                      **{f"{k}_s_per_step": round(v[0], 4) for k, v in med.items()},
                      **{f"{k}_disk_bytes_per_step": v[1] for k, v in med.items()},
                      "step_calls": counts, "step_ratio": round(a / b, 3), "disk_ratio": round(da / db, 3)}, indent=1))
    print(f"tiered-offload train, {second} / {first}: step {a:.3f} / {b:.3f} s = {a / b:.3f}; disk bytes per step "
          f"{da / 2**20:.1f} / {db / 2**20:.1f} MiB = {da / db:.3f}; steps tried in the backward (of those run, "
          f"a torn one counted twice): {counts[second]['in_backward']} of {counts[second]['steps']}, "
          f"{counts[second]['ran_there']} ran there, {counts[second]['torn']} torn; whole runs "
          f"{counts[second]['runs_s']:.1f} / {counts[first]['runs_s']:.1f} s")


if __name__ == "__main__":
    main()
