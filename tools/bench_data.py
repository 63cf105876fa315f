"""Tokenising throughput of ``tiered-offload train``'s data preparation: batched (the fast
tokenizer's threads sharing each batch) against one example at a time with the tokenizer's
threads off (how it tokenised before the twenty-third session).

A byte-level BPE tokenizer (a vocabulary of 8,000) is trained here on generated text; the corpus
is JSON lines of ``--examples`` examples of 20-400 words (``completion``), or conversations of
four turns (``chat``). Rounds alternate the two ways, each preparing the data into a fresh cache
(tokenising, spooling, writing the sequences), so the machine's noise hits them alike. Prints
each way's median seconds and their ratio (the speedup), and checks that both made the same arrays;
then the seconds of a start that finds the cache made (its arrays read once, their hash checked
against the one kept when they were made), against tokenising.

    python tools/bench_data.py --examples 20000 --rounds 3

``--packing`` prepares the same corpus instead with ``data.packing`` false, true and ``documents``
and prints, for each, the sequences it makes (a step's compute is per sequence), the share of
their positions that are padding, the tokens that carry loss and the preparation time; and checks
that ``documents`` holds every example whole, as ``false`` does (up to its first token, no target there).

    python tools/bench_data.py --examples 20000 --packing --max-seq-len 2048
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def words(rng: random.Random, n: int) -> str:
    syllables = ["ka", "to", "ri", "mel", "ons", "tra", "vi", "du", "pe", "sal", "qu", "ex", "ar", "lin"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n))


def build(directory: Path, examples: int, fmt: str) -> tuple[Path, Path]:
    import tokenizers
    import transformers
    rng = random.Random(0)
    texts = [words(rng, rng.randint(20, 400)) for _ in range(examples)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], tokenizers.trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    model = directory / "tokenizer"
    fast.save_pretrained(model)
    path = directory / "train.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            if fmt == "chat":
                turns = [t, texts[i - 1], texts[i - 2][:200], texts[i - 3]]
                row = {"messages": [{"role": ("user", "assistant")[k % 2], "content": c} for k, c in enumerate(turns)]}
            else:
                row = {"text": t}
            f.write(json.dumps(row) + "\n")
    return model, path


def prepare(model: Path, path: Path, fmt: str, cache: Path, one_at_a_time: bool, packing: str = "true",
            length: int = 512):
    import transformers

    from tiered_offload.train import data as data_module
    from tiered_offload.train import load_config
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    cfg = load_config(None, [f"model.path={model}", f"data.path={path}", f"data.format={fmt}", f"data.max_seq_len={length}",
                             f"data.packing={packing}",
                             f"offload.storage={cache / 's'}", "train.max_steps=1"])
    with mock.patch.dict(os.environ):
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
        if one_at_a_time:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        alone = mock.patch.object(data_module, "_batches", lambda examples, chars: ([ex] for ex in examples))
        with alone if one_at_a_time else contextlib.nullcontext():
            start = time.perf_counter()
            train_data, _ = data_module.prepare_data(cfg.data, tokenizer, model, cache, None)
            return time.perf_counter() - start, train_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20000)
    ap.add_argument("--format", choices=["completion", "chat"], default="completion")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--packing", action="store_true", help="compare data.packing false, true and documents")
    args = ap.parse_args()
    if args.packing:
        return packings(args)
    with tempfile.TemporaryDirectory() as tmp:
        model, path = build(Path(tmp), args.examples, args.format)
        times: dict[str, list[float]] = {"batched": [], "one at a time": []}
        made = {}
        for r in range(args.rounds):
            for way in (("batched", "one at a time") if r % 2 == 0 else ("one at a time", "batched")):
                seconds, data = prepare(model, path, args.format, Path(tmp) / f"cache-{r}-{way[0]}",
                                        way == "one at a time")
                times[way].append(seconds)
                made[way] = (np.asarray(data.ids), np.asarray(data.labels))
        tokens = int((made["batched"][1] != -100).sum())
        same = all(np.array_equal(a, b) for a, b in zip(made["batched"], made["one at a time"]))
        result = {"examples": args.examples, "format": args.format, "cores": os.cpu_count(), "tokens_with_loss": tokens,
                  "same_arrays": same}
        for way, ts in times.items():
            result[f"{way} s"] = round(statistics.median(ts), 2)
        result["speedup"] = round(statistics.median(times["one at a time"]) / statistics.median(times["batched"]), 2)
        again = [prepare(model, path, args.format, Path(tmp) / "cache-0-b", False)[0] for _ in range(args.rounds)]
        result["a start that finds the cache s"] = round(statistics.median(again), 3)  # (its arrays' hash checked)
        result["cache bytes"] = sum(f.stat().st_size for f in (Path(tmp) / "cache-0-b").rglob("*.npy"))
        result["found / tokenised"] = round(statistics.median(again) / statistics.median(times["batched"]), 3)
        print(json.dumps(result, indent=1))
        if not same:
            sys.exit("the two ways made different arrays")


def _stretches(ids: np.ndarray, positions: np.ndarray, pad: int):
    """``(start, end, padding?)`` of each stretch of one ``documents`` sequence (positions from 0)."""
    starts = [int(i) for i in np.flatnonzero(positions == 0)] + [len(positions)]
    return [(a, b, bool((ids[a:b] == pad).all())) for a, b in zip(starts, starts[1:])]


def packings(args) -> None:
    import collections

    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        model, path = build(Path(tmp), args.examples, args.format)
        pad = transformers.AutoTokenizer.from_pretrained(model).pad_token_id
        result, made = {"examples": args.examples, "format": args.format, "max_seq_len": args.max_seq_len}, {}
        for packing in ("false", "true", "documents"):
            seconds, data = prepare(model, path, args.format, Path(tmp) / f"cache-{packing}", False, packing,
                                    args.max_seq_len)
            ids = np.asarray(data.ids)
            if data.attention is not None:
                padding = 1 - float(np.asarray(data.attention).mean())
            elif data.positions is not None:
                padding = sum(b - a for row, pos in zip(ids, np.asarray(data.positions))
                              for a, b, is_pad in _stretches(row, pos, pad) if is_pad) / ids.size
            else:
                padding = 0.0
            made[packing] = data
            result[packing] = {"sequences": len(data), "padding": round(padding, 4),
                               "tokens_with_loss": int((np.asarray(data.labels) != -100).sum()),
                               "seconds": round(seconds, 2)}
        alone, docs = made["false"], made["documents"]
        whole = collections.Counter(tuple(i[m == 1]) for i, m in zip(np.asarray(alone.ids), np.asarray(alone.attention)))
        found = collections.Counter(tuple(row[a:b]) for row, pos in zip(np.asarray(docs.ids), np.asarray(docs.positions))
                                    for a, b, is_pad in _stretches(row, pos, pad) if not is_pad)
        result["documents hold every example whole"] = found == whole
        result["sequences documents / false"] = round(len(docs) / len(alone), 3)
        print(json.dumps(result, indent=1))
        if found != whole:
            sys.exit("documents did not hold each example whole once")


if __name__ == "__main__":
    main()
