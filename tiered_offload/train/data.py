"""Training data for ``tiered-offload train``: read once, tokenised once, cached as memory-mapped
arrays beside the run (a large corpus does not sit in RAM), served in a fixed, seeded order so
that a step number alone says which sequences it trains on (a resume continues at the same one).

Each example becomes token ids and a loss mask: every token for ``text`` and ``completion``, the
response only for ``alpaca``, the assistant's turns only for ``chat`` (rendered with the
tokenizer's chat template). With packing, examples (each ended by EOS) are concatenated and cut
into sequences of ``max_seq_len``; without, each example is one sequence, truncated or padded
(padding is masked out of the loss and of attention).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from offload_core.errors import ConfigError
from tiered_offload.progress import track

__all__ = ["Dataset", "prepare_data", "ALPACA_PROMPT"]

ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")
IGNORE = -100
"""The label of a token that carries no loss (Hugging Face's ``ignore_index``)."""


@dataclass
class Dataset:
    """Sequences as memory-mapped arrays: ``ids`` and ``labels`` (``[n, max_seq_len]``), and the
    attention mask where sequences are padded."""

    ids: np.ndarray
    labels: np.ndarray
    attention: np.ndarray | None

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        out = {"input_ids": torch.from_numpy(np.asarray(self.ids[rows], dtype=np.int64)),
               "labels": torch.from_numpy(np.asarray(self.labels[rows], dtype=np.int64))}
        if self.attention is not None:
            out["attention_mask"] = torch.from_numpy(np.asarray(self.attention[rows], dtype=np.int64))
        return out

    def tokens(self, rows: list[int]) -> int:
        """Tokens that carry loss in ``rows``."""
        return int((np.asarray(self.labels[rows]) != IGNORE).sum())


def _examples(path: Path, fmt: str, field: str):
    """``(text or (prompt, response), line number)`` of every example of a data file."""
    if fmt == "text":
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"data.path {path}: cannot read it as UTF-8 text ({e})") from None
        for i, para in enumerate(p for p in text.split("\n\n") if p.strip()):
            yield para, i + 1
        return
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.path {path}: cannot read it as UTF-8 JSON lines ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path} line {n}: expected a JSON object, found {type(row).__name__}")
        if fmt == "chat":
            messages = row.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise ConfigError(f"{path} line {n}: a chat example needs 'messages': a list of "
                                  f"{{\"role\": ..., \"content\": ...}} objects")
            yield messages, n
        elif fmt == "completion":
            if field in row and not isinstance(row[field], str):
                raise ConfigError(f"{path} line {n}: its field {field!r} holds {str(row[field])[:40]} "
                                  f"({type(row[field]).__name__}), not a string")
            if not isinstance(row.get(field), str):
                raise ConfigError(f"{path} line {n}: no text field {field!r} (data.field); its keys are "
                                  f"{', '.join(sorted(row)) or 'none'}")
            yield row[field], n
        else:  # alpaca
            for key in ("instruction", "output"):
                if not isinstance(row.get(key), str):
                    raise ConfigError(f"{path} line {n}: an alpaca example needs a text {key!r}; its keys are "
                                      f"{', '.join(sorted(row)) or 'none'}")
            extra = row.get("input") or ""
            prompt = ALPACA_PROMPT.format(with_input=", paired with an input that provides further context" if extra
                                          else "", instruction=row["instruction"],
                                          input_block=f"### Input:\n{extra}\n\n" if extra else "")
            yield (prompt, row["output"]), n


def _encode(tokenizer, example) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1: the token carries loss) of one example, EOS-terminated."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if isinstance(example, list):  # a conversation: the loss on the assistant's turns only
        def render(messages, prompt=False):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        text = render(example)
        spans = [(len(render(example[:i], prompt=True)), len(render(example[:i + 1])))
                 for i, m in enumerate(example) if m["role"] == "assistant"]
        # by characters: a token that straddles the prompt's end ("Ġsat") belongs to the reply
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a < e and b > s for s, e in spans)) for a, b in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask
    if isinstance(example, tuple):
        prompt, response = example
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
        return p + r, [0] * len(p) + [1] * len(r)
    ids = tokenizer(example, add_special_tokens=True)["input_ids"] + eos
    return ids, [1] * len(ids)


def _sequences(encoded, length: int, packing: bool, pad: int):
    """``(ids, labels, attention or None)`` arrays of ``length``-token sequences."""
    if packing:
        ids = np.fromiter((t for e, _ in encoded for t in e), dtype=np.int32)
        mask = np.fromiter((m for _, ms in encoded for m in ms), dtype=np.int8)
        n = len(ids) // length
        ids, mask = ids[:n * length].reshape(n, length), mask[:n * length].reshape(n, length)
        return ids, np.where(mask == 1, ids, IGNORE).astype(np.int32), None
    n = len(encoded)
    ids = np.full((n, length), pad, dtype=np.int32)
    labels = np.full((n, length), IGNORE, dtype=np.int32)
    attention = np.zeros((n, length), dtype=np.int8)
    for i, (e, m) in enumerate(encoded):
        e, m = e[:length], m[:length]
        ids[i, :len(e)] = e
        labels[i, :len(e)] = np.where(np.asarray(m) == 1, e, IGNORE)
        attention[i, :len(e)] = 1
    return ids, labels, attention


def _fingerprint(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path) and p.exists():
            st = p.stat()
            h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


def prepare_data(data, tokenizer, tokenizer_dir: Path, cache_root: Path, max_positions: int | None
                 ) -> tuple[Dataset, Dataset | None]:
    """The training (and evaluation) sequences of ``data`` (a :class:`DataSection`), tokenised with
    ``tokenizer`` once and cached under ``cache_root`` (keyed by the files, the tokenizer and the
    settings: a change re-tokenises)."""
    path = Path(data.path).expanduser()
    if path.is_dir():
        raise ConfigError(f"data.path {path} is a directory; name the data file in it (one file: JSON lines, or "
                          f"text for data.format text)")
    if not path.is_file():
        raise ConfigError(f"data.path {path} does not exist")
    if max_positions is not None and data.max_seq_len > max_positions:
        raise ConfigError(f"data.max_seq_len {data.max_seq_len} is longer than the model's {max_positions} positions; "
                          f"lower data.max_seq_len to at most {max_positions}")
    if data.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.format chat needs a tokenizer with a chat template, and the one in {tokenizer_dir} "
                          f"has none; add one (tokenizer.chat_template, saved with save_pretrained) or use "
                          f"data.format completion")
    tokenizer_files = sorted(p for p in tokenizer_dir.glob("*token*") if p.is_file())
    tokenizer_files += sorted(tokenizer_dir.glob("*.jinja"))
    key = _fingerprint(path, data.format, data.field, data.max_seq_len, data.packing, data.eval_fraction,
                       Path(data.eval_path) if data.eval_path else None, *tokenizer_files)
    cache = cache_root / f"data-{key}"
    if not (cache / "done").exists():
        cache.mkdir(parents=True, exist_ok=True)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        encoded = [_encode(tokenizer, ex) for ex, _ in track(_examples(path, data.format, data.field),
                                                              desc=f"tokenising {path.name}", unit="example")]
        if not encoded:
            raise ConfigError(f"data.path {path} holds no example (it is empty, or blank lines only) for "
                              f"data.format {data.format}")
        if data.eval_path:
            held = [_encode(tokenizer, ex) for ex, _ in _examples(Path(data.eval_path).expanduser(), data.format,
                                                                 data.field)]
        else:
            n_eval = int(math.floor(len(encoded) * data.eval_fraction))
            encoded, held = (encoded[:len(encoded) - n_eval], encoded[len(encoded) - n_eval:]) if n_eval else (encoded, [])
        for name, part in (("train", encoded), ("eval", held)):
            if not part:
                continue
            ids, labels, attention = _sequences(part, data.max_seq_len, data.packing, pad)
            if name == "train" and len(ids) == 0:
                raise ConfigError(f"data.path {path}: {sum(len(e) for e, _ in part)} tokens make no sequence of "
                                  f"data.max_seq_len {data.max_seq_len}; give more data or a shorter max_seq_len")
            np.save(cache / f"{name}_ids.npy", ids)
            np.save(cache / f"{name}_labels.npy", labels)
            if attention is not None:
                np.save(cache / f"{name}_attention.npy", attention)
        (cache / "done").write_text(json.dumps({"data": str(path), "examples": len(encoded) + len(held)}))

    def load(name: str) -> Dataset | None:
        if not (cache / f"{name}_ids.npy").exists():
            return None
        attention = cache / f"{name}_attention.npy"
        return Dataset(np.load(cache / f"{name}_ids.npy", mmap_mode="r"), np.load(cache / f"{name}_labels.npy", mmap_mode="r"),
                       np.load(attention, mmap_mode="r") if attention.exists() else None)
    return load("train"), load("eval")


@functools.lru_cache(maxsize=4)
def order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sequences of one epoch, in a fixed order for (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def micro_batch_rows(n: int, seed: int, index: int, size: int) -> list[int]:
    """The rows of micro-batch ``index`` (of ``size`` sequences) in the endless sequence of epochs."""
    rows = []
    for k in range(index * size, (index + 1) * size):
        epoch, at = divmod(k, n)
        rows.append(int(order(n, seed, epoch)[at]))
    return rows


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenising runs before any fork; keep the library quiet
