"""Training data for ``tiered-offload train``: read (:mod:`tiered_offload.train.sources`) and
tokenised once, a chunk at a time (the tokens spooled to files as they come), cached as
memory-mapped arrays beside the run (a large corpus never sits in RAM, as text or as tokens),
served in a fixed, seeded order so that a step number alone says which sequences it trains on (a
resume continues at the same one).

Each example becomes token ids and a loss mask: every token for ``text`` and ``completion``, the
response only for ``alpaca``, the assistant's turns only for ``chat`` (rendered with the
tokenizer's chat template). With packing, examples (each ended by EOS) are concatenated and cut
into sequences of ``max_seq_len`` (``documents``: placed whole, each attending to itself only:
:mod:`tiered_offload.train.packing`); without, each example is one sequence, truncated or padded
(padding is masked out of the loss and of attention).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from offload_core.errors import ConfigError, DiskFullError, StorageIOError
from tiered_offload.checkpoint.lock import open_own
from tiered_offload.progress import track
from tiered_offload.train import sources as source_files
from tiered_offload.train.packing import DOCUMENTS, write_documents
from tiered_offload.train.sources import ALPACA_PROMPT, Conversation, LastTurn, data_files
from tiered_offload.train.sources import examples as read_examples

log = logging.getLogger("tiered_offload")

__all__ = ["Dataset", "prepare_data", "ALPACA_PROMPT"]

IGNORE = -100
"""The label of a token that carries no loss (Hugging Face's ``ignore_index``)."""


@dataclass
class Dataset:
    """Sequences as memory-mapped arrays: ``ids`` and ``labels`` (``[n, max_seq_len]``), and the
    attention mask where sequences are padded."""

    ids: np.ndarray
    labels: np.ndarray
    attention: np.ndarray | None
    content: str | None = None
    """A hash of the tokenised data, training and evaluation sequences together (:func:`_content`):
    the same for the same sequences, whatever the files' names and times."""
    positions: np.ndarray | None = None
    """Each token's position in its example (``data.packing: documents``), given as ``position_ids``."""

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        out = {"input_ids": torch.from_numpy(np.asarray(self.ids[rows], dtype=np.int64)),
               "labels": torch.from_numpy(np.asarray(self.labels[rows], dtype=np.int64))}
        if self.attention is not None:
            out["attention_mask"] = torch.from_numpy(np.asarray(self.attention[rows], dtype=np.int64))
        if self.positions is not None:
            out["position_ids"] = torch.from_numpy(np.asarray(self.positions[rows], dtype=np.int64))
        return out



def loss_tokens(labels: torch.Tensor) -> tuple[int, int]:
    """Of a batch's ``labels``: the tokens that carry loss, and those the model's loss counts (past
    each row's first: the loss predicts each token from the ones before it)."""
    carry = labels != IGNORE
    return int(carry.sum()), int(carry[:, 1:].sum())


def _size(example) -> int:
    """An example's characters (what a batch is measured in)."""
    if isinstance(example, str):
        return len(example)
    if isinstance(example, tuple):
        return sum(map(len, example))
    return sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in example)


def _batches(examples, chars: int):
    """Lists of consecutive ``(example, where)`` of about ``chars`` characters each (an example
    longer than that alone)."""
    batch, size = [], 0
    for ex in examples:
        batch.append(ex)
        size += _size(ex[0])
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A chat template's mark around the assistant's text (transformers' ``return_assistant_tokens_mask``)."""


def _encode(tokenizer, batch: list) -> list[tuple[list[int], list[int]]]:
    """Token ids and a loss mask (1: the token carries loss) of each ``(example, where)`` of ``batch``
    (all of one kind), EOS-terminated; the tokenizer's calls take the whole batch (a fast
    tokenizer's threads share it), and give each example the tokens it has alone."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples = [ex for ex, _ in batch]
    for ex, where in batch:
        if isinstance(ex, Conversation) and ex.uses_tools and "tool" not in (tokenizer.chat_template or ""):
            raise ConfigError(f"{where}: the example has tools or tool calls, and the tokenizer's chat template renders "
                              f"no tool calls (it names no 'tool'); use the model's own template if it was trained "
                              f"for tools, or drop such examples")
    if isinstance(examples[0], list) and not isinstance(examples[0], LastTurn) \
            and GENERATION_MARK.search(tokenizer.chat_template or ""):
        out = [_render(tokenizer, ex, where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
               for ex, where in batch]  # the template's marks say where the assistant's text is
        return [(list(o["input_ids"]), [int(k) for k in o["assistant_masks"]]) for o in out]
    if isinstance(examples[0], list):  # conversations: the loss on the assistant's turns only
        texts = [_render(tokenizer, ex, where) for ex, where in batch]
        spans = [_assistant_spans(tokenizer, ex, text, where, last_only=isinstance(ex, LastTurn))
                 for (ex, where), text in zip(batch, texts)]
        # by characters: a token that straddles the prompt's end ("Ġsat") belongs to the reply
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(list(ids), [int(any(a < e and b > s for s, e in sp)) for a, b in offsets])
                for ids, offsets, sp in zip(encoded["input_ids"], encoded["offset_mapping"], spans)]
    if isinstance(examples[0], tuple):
        prompts = tokenizer([p for p, _ in examples], add_special_tokens=True)["input_ids"]
        responses = tokenizer([r for _, r in examples], add_special_tokens=False)["input_ids"]
        return [(p + r + eos, [0] * len(p) + [1] * (len(r) + len(eos))) for p, r in zip(prompts, responses)]
    return [(ids + eos, [1] * (len(ids) + len(eos))) for ids in tokenizer(examples, add_special_tokens=True)["input_ids"]]


def _render(tokenizer, messages: list, where: str, tools: list | None = None, **options):
    """``apply_chat_template`` (as text, unless ``options`` say otherwise), with ``tools`` (default:
    a :class:`Conversation`'s); a conversation the template refuses (it raises: roles that do not
    alternate, a system message it does not take) is a :class:`ConfigError` naming the example."""
    tools = tools if tools is not None else getattr(messages, "tools", None)
    try:
        return tokenizer.apply_chat_template(list(messages), **{"tokenize": False, "tools": tools, **options})
    except Exception as e:  # (jinja2's TemplateError from raise_exception, or what the template's code raised)
        raise ConfigError(f"{where}: the tokenizer's chat template refuses this conversation ({e}); change the "
                          f"example, or the template (tokenizer.chat_template)") from None


def _assistant_spans(tokenizer, messages: list, text: str, where: str, last_only: bool = False) -> list[tuple[int, int]]:
    """The characters of ``text`` (the whole conversation rendered) that are the assistant's turns:
    each from the end of the conversation rendered up to it with the generation prompt, to the end
    of it rendered up to and with the turn. Both renderings must begin ``text``: a template that
    renders a turn otherwise as the conversation's last (an end it gives the last turn only;
    earlier turns rewritten) is refused, as its lengths would point into other text (one that marks
    the assistant's text, :data:`GENERATION_MARK`, does not come here). ``last_only``: the last
    turn's (what the model says after the generation prompt), which any template renders as the last."""
    spans, tools = [], getattr(messages, "tools", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (last_only and i < len(messages) - 1):
            continue
        prompt = _render(tokenizer, messages[:i], where, tools, add_generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1], where, tools)
        if last_only and not text.startswith(prompt):  # (the turn's own rendering is the text)
            raise ConfigError(f"{where}: the tokenizer's chat template does not begin the conversation with turn {i + 1} "
                              f"(assistant) as it renders the conversation before it with the generation prompt, so "
                              f"the turn's tokens cannot be found for the loss; mark the assistant's text in the "
                              f"template ({{% generation %}} ... {{% endgeneration %}}) and set data.chat_turns: all")
        if not (text.startswith(prompt) and text.startswith(upto)):
            raise ConfigError(f"{where}: the tokenizer's chat template renders turn {i + 1} (assistant) otherwise inside "
                              f"the conversation than as its last (it ends the last turn its own way, or rewrites earlier "
                              f"turns, as Qwen3's drops their reasoning), so the turn's tokens cannot be found for the "
                              f"loss; mark the assistant's text in the template ({{% generation %}} ... "
                              f"{{% endgeneration %}}), or set data.chat_turns: each (an example per assistant turn, "
                              f"the loss on that turn)")
        spans.append((len(prompt), len(upto)))
    return spans


@contextlib.contextmanager
def _parallel_tokenizer():
    """A fast tokenizer's threads for the batches, unless the user set ``TOKENIZERS_PARALLELISM``;
    off again after (set: a process forked later is not warned that they ran)."""
    if "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


class _Spool:
    """The token ids (int32) and loss masks (int8) of a data file's examples, appended to two files
    as they are tokenised, and each example's length (8 bytes an example in memory): a corpus of
    hundreds of millions of tokens never sits in memory as lists of Python ints (~40 bytes a token)."""

    def __init__(self, stem: Path):
        self.paths = (stem.with_name(stem.name + ".ids"), stem.with_name(stem.name + ".mask"))
        self._files = [open(p, "wb") for p in self.paths]
        self.lengths: array | np.ndarray = array("q")
        self.continuing = set()
        """The examples that continue the one before (a conversation's later turns, ``data.chat_turns: each``)."""

    def add(self, encoded: tuple[list[int], list[int]], continues: bool = False) -> None:
        ids, mask = encoded
        self._files[0].write(np.asarray(ids, dtype=np.int32).tobytes())
        self._files[1].write(np.asarray(mask, dtype=np.int8).tobytes())
        if continues:
            self.continuing.add(len(self.lengths))
        self.lengths.append(len(ids))

    def boundary(self, i: int) -> int:
        """The first example from ``i`` on that continues none before it (an evaluation split there
        leaves no conversation on both sides)."""
        while i in self.continuing:
            i += 1
        return i

    def close(self) -> None:
        for f in self._files:
            f.close()
        self.lengths = np.frombuffer(self.lengths, dtype=np.int64) if len(self.lengths) else np.zeros(0, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.ids, self.mask = (np.memmap(p, dtype=d, mode="r") if self.offsets[-1] else np.zeros(0, d)
                               for p, d in zip(self.paths, (np.int32, np.int8)))

    def remove(self) -> None:
        for f in self._files:  # (still open where tokenising stopped at an error)
            f.close()
        self.ids = self.mask = None  # (the maps first)
        for p in self.paths:
            p.unlink(missing_ok=True)

    def tokens(self, a: int, b: int) -> int:
        return int(self.offsets[b] - self.offsets[a])


def _reserve(path: Path) -> None:
    """Give the (sparse) file ``path`` its disk blocks before it is written through a memory map: a
    write there that finds the disk full kills the process (``SIGBUS``), where this raises an
    ``OSError`` (ENOSPC). A file system that cannot reserve is left as it was."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


def _examples_with_loss(spool: _Spool, a: int, b: int, length: int) -> np.ndarray:
    """The examples of ``a:b`` whose first ``length`` tokens (what a sequence keeps of one) hold a
    token the loss is on past the first: a model's loss predicts each token from the ones before it,
    so the first is no target (``documents`` marks it so), and an example without one trains nothing."""
    starts, ends = spool.offsets[a:b], spool.offsets[a:b] + np.minimum(spool.lengths[a:b], length)
    return np.fromiter((a + k for k, (s, e) in enumerate(zip(starts, ends)) if spool.mask[s + 1:e].any()),
                       dtype=np.int64)  # (no list of the examples: 8 bytes each, as their lengths)


def _rows_with_loss(spool: _Spool, first: int, n: int, length: int) -> np.ndarray:
    """Which of the ``n`` packed rows from token ``first`` on hold a token the loss is on past their
    first (:func:`_examples_with_loss`)."""
    keep, step = np.empty(n, dtype=bool), max(1, source_files.CHUNK // length)
    for r in range(0, n, step):
        m = spool.mask[first + r * length:first + min(n, r + step) * length].reshape(-1, length)
        keep[r:r + len(m)] = m[:, 1:].any(axis=1)
    return keep


def _write_sequences(spool: _Spool, a: int, b: int, length: int, packing: bool | str, pad: int, out: Path
                     ) -> tuple[int, int]:
    """Examples ``a:b`` of ``spool`` as ``length``-token sequences, written to ``out``'s
    ``_ids.npy`` and ``_labels.npy`` (and ``_attention.npy`` without packing) a stretch at a time;
    returns the number of sequences made, and of those left out for holding no token the loss is on
    (a micro-batch of only such has a loss of 0/0: NaN). With packing the examples (each ended by
    EOS) are concatenated and cut (``documents``: placed whole, with ``_positions.npy``); without,
    each is one sequence, truncated or padded."""
    first, tokens = int(spool.offsets[a]), spool.tokens(a, b)
    if packing and packing != DOCUMENTS:
        keep = _rows_with_loss(spool, first, tokens // length, length)
        n, dropped = int(keep.sum()), int((~keep).sum())
    else:
        examples = _examples_with_loss(spool, a, b, length)
        n, dropped = len(examples), b - a - len(examples)

    def output(name: str, dtype, fill, count: int | None = None):
        count = n if count is None else count
        if count == 0:  # (a map of no bytes cannot be made)
            np.save(out.with_name(f"{out.name}_{name}.npy"), np.full((0, length), fill, dtype=dtype))
            return None
        path = out.with_name(f"{out.name}_{name}.npy")
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(count, length))
        _reserve(path)
        arr[:] = fill
        return arr

    if packing == DOCUMENTS:
        return write_documents(spool, examples, length, pad, output, IGNORE), dropped
    ids, labels = output("ids", np.int32, pad), output("labels", np.int32, IGNORE)
    attention = None if packing else output("attention", np.int8, 0)
    if n and packing:
        rows, w = max(1, source_files.CHUNK // length), 0
        for r in range(0, len(keep), rows):
            s, e = first + r * length, first + min(len(keep), r + rows) * length
            kept = keep[r:r + rows]
            t, m = spool.ids[s:e].reshape(-1, length)[kept], spool.mask[s:e].reshape(-1, length)[kept]
            ids[w:w + len(t)] = t
            labels[w:w + len(t)] = np.where(m == 1, t, IGNORE)
            w += len(t)
    elif n:
        for row, i in enumerate(examples):
            s = int(spool.offsets[i])
            e = s + min(int(spool.lengths[i]), length)
            t, m = spool.ids[s:e], spool.mask[s:e]
            ids[row, :e - s] = t
            labels[row, :e - s] = np.where(m == 1, t, IGNORE)
            attention[row, :e - s] = 1
    for arr in (ids, labels, attention):
        if arr is not None:
            arr.flush()
    return n, dropped


MADE = 2
"""How the cached sequences are made, in the cache's key: 2, without sequences that hold no token
the loss counts (a cache made before, which may hold them, is made again once)."""


def _fingerprint(*parts) -> str:
    """A key of ``parts``: a file by its path, size and time; a list by its items."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, list):
            h.update(f"[{_fingerprint(*p)}]".encode())
        elif isinstance(p, Path) and p.exists():
            st = p.stat()
            h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


def prepare_data(data, tokenizer, tokenizer_dir: Path, cache_root: Path, max_positions: int | None
                 ) -> tuple[Dataset, Dataset | None]:
    """The training (and evaluation) sequences of ``data`` (a :class:`DataSection`), tokenised with
    ``tokenizer`` once and cached under ``cache_root`` (keyed by the files, the tokenizer and the
    settings: a change re-tokenises). One process at a time prepares data under ``cache_root``
    (``cache_root/lock``): another one (the same command started twice, the machines of a torchrun
    job sharing an output.dir) waits for it, then uses what it made. A cache found there is checked
    against the hash its mark keeps (a read of it, ~9 bytes a token, at each start); one that differs
    is tokenised again."""
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        fd = open_own(cache_root / "lock", os.O_RDWR | os.O_CREAT, ConfigError, "Remove it")
    except OSError as e:  # (open_own's own refusal is a ConfigError, no OSError)
        raise ConfigError(f"output.dir: cannot create {cache_root / 'lock'} ({e.strerror or e}); name a directory you "
                          f"can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (released when the file closes)
        return _prepare(data, tokenizer, tokenizer_dir, cache_root, max_positions)
    finally:
        os.close(fd)


def _prepare(data, tokenizer, tokenizer_dir: Path, cache_root: Path, max_positions: int | None, *,
             again: bool = False) -> tuple[Dataset, Dataset | None]:
    path = data.path if str(data.path).startswith(source_files.HUB_DATASETS) else Path(data.path).expanduser()  # (as named)
    sources = [data_files(data.path, data.format)]
    if data.eval_path:
        sources.append(data_files(data.eval_path, data.format, "data.eval_path"))
    if max_positions is not None and data.max_seq_len > max_positions:
        raise ConfigError(f"data.max_seq_len {data.max_seq_len} is longer than the model's {max_positions} positions; "
                          f"lower data.max_seq_len to at most {max_positions}")
    if data.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.format chat needs a tokenizer with a chat template, and the one in {tokenizer_dir} "
                          f"has none; add one (tokenizer.chat_template, saved with save_pretrained) or use "
                          f"data.format completion")
    tokenizer_files = sorted(p for p in tokenizer_dir.glob("*token*") if p.is_file())
    tokenizer_files += sorted(tokenizer_dir.glob("*.jinja"))
    files = [f[0] if len(f) == 1 else f for f in sources]  # (one file: the key it had before shards were read)
    key = _fingerprint(files[0], data.format, data.field, data.max_seq_len, data.packing, data.eval_fraction,
                       files[1] if data.eval_path else None, *tokenizer_files,
                       *([f"chat_turns={data.chat_turns}"] if data.chat_turns != "all" else []),
                       *([f"made={MADE}"] if MADE > 1 else []))
    cache = cache_root / f"data-{key}"
    fresh = not _finished(cache)
    if fresh:
        try:
            _tokenise(data, tokenizer, sources, path, cache)
        except BaseException as e:  # (writing the cache: an OSError; reading the data: a ConfigError; Ctrl-C)
            shutil.rmtree(cache, ignore_errors=True)  # (its room given back; made again from the start)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"output.dir: the disk filled while the data was tokenised into {cache} (about 13 "
                                    f"bytes a token while it is made, 9 kept); free space there, or put output.dir "
                                    f"on a disk with more room", path=str(cache)) from None
            raise StorageIOError(f"output.dir: writing the tokenised data into {cache} failed ({e.strerror or e}); "
                                 f"what was written is removed") from e
    _remove_others(cache)
    try:
        content = json.loads((cache / "done").read_text())["content"]
    except (OSError, ValueError, KeyError, TypeError):  # (a cache from before the hash was kept)
        content = None
    if not fresh:  # (checked at each start: a byte changed on disk would train on other tokens, silently)
        now = _content(cache)
        if content is None:
            _write_done(cache, {"data": str(path), "content": now})
        elif now != content:
            _discard(cache, f"its arrays' hash is {now}, and they were made with {content} (kept in its mark done): "
                            f"a file there changed on disk")
            return _prepare(data, tokenizer, tokenizer_dir, cache_root, max_positions, again=True)
        content = now

    def load(name: str) -> Dataset | None:
        if not (cache / f"{name}_ids.npy").exists():
            return None
        attention, positions = cache / f"{name}_attention.npy", cache / f"{name}_positions.npy"
        if name == "eval" and not len(np.load(cache / f"{name}_ids.npy", mmap_mode="r")):
            held = "data.eval_path's examples" if data.eval_path else "the examples data.eval_fraction holds out"
            log.warning("tiered-offload: %s make no sequence of data.max_seq_len %d with a token the loss is on: the "
                        "run has no evaluation; hold out more, or give shorter ones", held, data.max_seq_len)
            return None
        return Dataset(np.load(cache / f"{name}_ids.npy", mmap_mode="r"), np.load(cache / f"{name}_labels.npy", mmap_mode="r"),
                       np.load(attention, mmap_mode="r") if attention.exists() else None, content,
                       np.load(positions, mmap_mode="r") if positions.exists() else None)
    try:
        return load("train"), load("eval")
    except (OSError, ValueError, EOFError) as e:  # (an array cut short or damaged: numpy's own errors)
        if again:
            raise
        _discard(cache, f"an array cannot be read ({e})")
        return _prepare(data, tokenizer, tokenizer_dir, cache_root, max_positions, again=True)


def _tokenise(data, tokenizer, sources: list[list[Path]], path, cache: Path) -> None:
    """Tokenise ``sources`` (the training files, and the evaluation ones) into ``cache``'s arrays,
    then write its mark ``done`` (with their hash)."""
    cache.mkdir(parents=True, exist_ok=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    spools = []
    try:
        for name, part in zip(("train", "eval"), sources):
            spool = _Spool(cache / name)
            spools.append(spool)
            examples = (ex for f in part for ex in read_examples(f, data.format, data.field, data.chat_turns))
            desc = f"tokenising {part[0].name}" + (f" and {len(part) - 1} more" if len(part) > 1 else "")
            tracked = track(examples, desc=desc, unit="example") if name == "train" else examples
            with _parallel_tokenizer():
                for batch in _batches(tracked, source_files.CHUNK):
                    for (ex, _), encoded in zip(batch, _encode(tokenizer, batch)):
                        spool.add(encoded, continues=isinstance(ex, LastTurn) and ex.continues)
            spool.close()
        count = len(spools[0].lengths)
        if not count:
            raise ConfigError(f"data.path {path} holds no example (it is empty, or blank lines only) for "
                              f"data.format {data.format}")
        if data.eval_path:
            parts = [("train", spools[0], 0, count), ("eval", spools[1], 0, len(spools[1].lengths))]
        else:
            cut = spools[0].boundary(count - int(math.floor(count * data.eval_fraction)))
            parts = [("train", spools[0], 0, cut), ("eval", spools[0], cut, count)]
        for name, spool, a, b in parts:
            if a == b:
                continue
            made, dropped = _write_sequences(spool, a, b, data.max_seq_len, data.packing, pad, cache / name)
            if name == "train" and made == 0 and dropped:
                raise ConfigError(f"data.path {path}: no sequence has a token the loss is on ({_loss_on(data)}) past "
                                  f"its first, of the {dropped} that data.max_seq_len {data.max_seq_len} makes; "
                                  f"{_what_to_do(data)}")
            if name == "train" and made == 0:
                raise ConfigError(f"data.path {path}: {spool.tokens(a, b)} tokens make no sequence of "
                                  f"data.max_seq_len {data.max_seq_len}; give more data or a shorter max_seq_len")
            if dropped:
                log.warning("tiered-offload: %d of %d %s sequences have no token the loss is on (%s) past their "
                            "first, within data.max_seq_len %d: left out, as they train nothing (a micro-batch of "
                            "only such has no loss); %s", dropped, made + dropped,
                            "training" if name == "train" else "evaluation", _loss_on(data), data.max_seq_len,
                            _what_to_do(data))
        examples = sum(len(sp.lengths) for sp in spools)
    finally:
        for spool in spools:
            spool.remove()
    _write_done(cache, {"data": str(path), "examples": examples, "content": _content(cache)})


LOSS_ON = {"text": "every token", "completion": "every token", "prompt-completion": "the completion",
           "alpaca": "the output", "chat": "the assistant's turns"}
"""What carries the loss in each ``data.format``."""


def _loss_on(data) -> str:
    return f"data.format {data.format}: {LOSS_ON[data.format]}"


def _what_to_do(data) -> str:
    """What gives sequences without a token the loss is on their loss back."""
    if data.format in ("text", "completion"):
        return "drop the empty examples"
    if data.format == "chat":
        return ("a chat example's loss is on its turns of role 'assistant', and one without any trains nothing; turns "
                "before an assistant's that fill data.max_seq_len leave it out: raise data.max_seq_len or shorten them")
    return (f"a prompt that fills data.max_seq_len leaves its {LOSS_ON[data.format].removeprefix('the ')} out: raise "
            f"data.max_seq_len or shorten the prompts")


def _finished(cache: Path) -> bool:
    """Whether ``cache`` holds tokenised data made to the end: its mark ``done`` and every file in it
    regular files. A cache cut short is made again from the start; one holding anything else (a
    FIFO there made the run wait forever) is removed, saying so, and made again: it is made from
    the data, which is not touched."""
    if not os.path.lexists(cache):
        return False
    if cache.is_dir() and not cache.is_symlink() and all(f.is_file() and not f.is_symlink() for f in cache.iterdir()):
        if (cache / "done").is_file():
            return True
        shutil.rmtree(cache)  # (a run stopped while it tokenised)
        return False
    _discard(cache, "it holds what the run does not write there (a FIFO, a link...)")
    return False


def _discard(cache: Path, why: str) -> None:
    """Remove ``cache`` (a directory, or what stands in its place), saying ``why`` it is made again."""
    log.warning("tiered-offload: the data is tokenised again into %s: %s", cache, why)
    if cache.is_dir() and not cache.is_symlink():
        shutil.rmtree(cache)
    else:
        cache.unlink()


def _content(cache: Path) -> str:
    """A hash of the tokenised sequences in ``cache`` (its arrays' files, read a stretch at a time)."""
    h = hashlib.sha256()
    for f in sorted(cache.glob("*.npy")):
        h.update(f.name.encode())
        with open(f, "rb") as stream:
            while block := stream.read(source_files.CHUNK * 16):
                h.update(block)
    return h.hexdigest()[:12]


def _write_done(cache: Path, record: dict) -> None:
    """The mark that ``cache`` holds finished data, written whole (a temporary file swapped in)."""
    temporary = cache / "done.tmp"
    temporary.write_text(json.dumps(record))
    os.replace(temporary, cache / "done")


def _remove_others(cache: Path) -> None:
    """The tokenised data of other settings beside ``cache`` (the data edited, another
    max_seq_len) goes: each is ~9 bytes a token, and a run reads only its current one."""
    freed = 0
    for other in cache.parent.glob("data-*"):
        if other != cache and other.is_dir():
            freed += sum(f.stat().st_size for f in other.iterdir() if f.is_file())
            shutil.rmtree(other, ignore_errors=True)
    if freed:
        log.info("removed the tokenised data of other settings from %s (%.1f MiB)", cache.parent, freed / 2**20)


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
