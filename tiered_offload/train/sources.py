"""What ``tiered-offload train``'s data files hold: the files ``data.path`` names (a file, a
directory of shards, a glob, a Hub dataset's files: :func:`data_files`), read a chunk at a time
(JSON lines, a JSON array, Parquet, plain text) as the examples of ``data.format``
(:func:`examples`); :mod:`tiered_offload.train.data` tokenises them."""

from __future__ import annotations

import glob
import json
import os
import stat
from pathlib import Path

from offload_core.errors import ConfigError
from tiered_offload.checkpoint.lock import kind_of

__all__ = ["CHUNK", "ALPACA_PROMPT", "HUB_DATASETS", "Conversation", "LastTurn", "data_files", "examples",
           "first_line"]

ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


CHUNK = 1 << 20
"""Characters of a data file read at a time, of examples tokenised together, and tokens of packed
sequences written at a time."""


def _open(path: Path, binary: bool = False):
    """``path`` opened to read (text: UTF-8, a leading byte order mark dropped), without waiting:
    the files were checked when the run listed them (:func:`_files`), but what stands there when
    it is read may be something else by then (a FIFO, whose open would wait for a writer forever):
    that is a :class:`ConfigError` naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"data.path {path} is {kind_of(mode)}, not a file: the data is read as a file; save "
                          f"it to one and name that")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb") if binary else os.fdopen(fd, encoding="utf-8-sig")


def _chunks(path: Path, what: str):
    """The text of a UTF-8 file, :data:`CHUNK` characters at a time (newlines translated, as
    ``read_text``; a leading byte order mark dropped): a corpus is read as it is tokenised, never whole."""
    try:
        with _open(path) as f:
            while chunk := f.read(CHUNK):
                yield chunk
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.path {path}: cannot read it as UTF-8 {what} ({e})") from None


def _lines(path: Path):
    """``(line, number)`` of a JSON-lines file. A line ends at a newline only: JSON allows U+2028,
    U+2029 and U+0085 unescaped in a string, where ``str.splitlines`` would split it."""
    rest, n = "", 0
    for chunk in _chunks(path, "JSON lines"):
        *lines, rest = (rest + chunk).split("\n")
        for line in lines:
            n += 1
            yield line, n
    if rest:
        yield rest, n + 1


SUFFIXES = {"text": (".txt",)}
"""The data files a directory given as ``data.path`` holds, by ``data.format`` (the others: JSON
lines, a JSON array, Parquet)."""
ROWS = (".jsonl", ".json", ".parquet")


HUB_DATASETS = "hf://datasets/"


def first_line(e: BaseException) -> str:
    """An exception's message, its first line (its type's name where it has none)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _hub_dataset(spec: str, key: str) -> Path:
    """The local path of ``hf://datasets/OWNER/NAME[@REVISION]/PATH`` (PATH a file or a glob of the
    dataset): its files fetched through huggingface_hub's cache (only those PATH matches)."""
    owner, _, rest = spec[len(HUB_DATASETS):].partition("/")
    name, _, pattern = rest.partition("/")
    name, _, revision = name.partition("@")
    if not (owner and name and pattern):
        raise ConfigError(f"{key} {spec}: write hf://datasets/OWNER/NAME/PATH, PATH a file or a glob of the dataset "
                          f"(data/train-*.parquet)")
    repo = f"{owner}/{name}"
    try:
        import huggingface_hub
        local = huggingface_hub.snapshot_download(repo, repo_type="dataset", revision=revision or None,
                                                  allow_patterns=[pattern])
    except Exception as e:  # (no network, not cached, no such dataset, gated, no huggingface_hub)
        raise ConfigError(f"{key} {spec}: the Hugging Face Hub gave no dataset {repo} ({type(e).__name__}: {first_line(e)}); "
                          f"download it (hf download --repo-type dataset {repo}) and name its files, or check the "
                          f"id") from None
    return Path(local) / pattern


def data_files(spec: str, fmt: str, key: str = "data.path") -> list[Path]:
    """The files ``data.path`` (or ``data.eval_path``, named by ``key``) names: a file; a directory's
    data files (:data:`SUFFIXES`, not hidden); or a glob's matches; each in name order (a dataset's
    shards, ``train-00000-of-00003.jsonl`` ..., as one corpus); a Hub dataset's files
    (``hf://datasets/OWNER/NAME/PATH``) through huggingface_hub's cache."""
    hub = str(spec).startswith(HUB_DATASETS)
    path = _hub_dataset(spec, key) if hub else Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        suffixes = SUFFIXES.get(fmt, ROWS)
        files = _files(key, sorted(p for p in path.iterdir() if p.suffix in suffixes and not p.name.startswith(".")))
        if not files:
            raise ConfigError(f"{key} {path} holds no data file ({', '.join('*' + x for x in suffixes)}) for "
                              f"data.format {fmt}; name a file, a directory of them, or a glob")
        return files
    if glob.has_magic(str(path)):
        files = _files(key, sorted(Path(p) for p in glob.glob(str(path))))
        if not files:
            raise ConfigError(f"{key} {spec if hub else path} matches no file")
        return files
    if os.path.lexists(path):  # (a link to nothing, a FIFO, a device: named)
        _files(key, [path])
    raise ConfigError(f"{key} {spec if hub else path} does not exist")


def _files(key: str, paths: list[Path]) -> list[Path]:
    """The files among ``paths`` (a directory's data files, a glob's matches), directories left out;
    one that is no file (a link to nothing: a Hub cache's blob deleted; a FIFO, a device) is a
    :class:`ConfigError` naming it: left out, it would train on the others, silently."""
    for p in paths:
        if p.is_symlink() and not p.exists():
            raise ConfigError(f"{key} {p} is a link to {os.readlink(p)}, which does not exist (a download cut short, "
                              f"a cache cleaned); fetch the data again, or remove the link")
        if not (p.is_file() or p.is_dir()):
            raise ConfigError(f"{key} {p} is {kind_of(p.stat().st_mode)}, not a file: the data is read more than "
                              f"once (a file's first bytes, then its examples), which a pipe cannot give; save the "
                              f"data to a file and name that")
    return [p for p in paths if p.is_file()]


def _starts_with(path: Path, marks: str) -> bool:
    """Whether ``path``'s first character that is not white space is one of ``marks``."""
    try:
        with _open(path) as f:
            return f.read(1 << 12).lstrip()[:1] in tuple(marks)
    except (OSError, UnicodeDecodeError):
        return False  # (read as JSON lines, whose reader names the fault)


def _json_array(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file holding one array (Alpaca's ``alpaca_data.json``)."""
    return path.suffix == ".json" and _starts_with(path, "[")


COLUMNS = {"completion": ((), ()), "prompt-completion": (("prompt", "completion"), ()),
           "alpaca": (("instruction", "output"), ("input",)), "chat": ((), ("messages", "conversations"))}
"""The columns each format reads from a Parquet file: (required, optional); ``completion`` reads
``data.field``, ``chat`` one of its two."""


def _parquet_rows(path: Path, fmt: str, field: str):
    """``(row, where)`` of each row of a Parquet file (a dict of the columns ``fmt`` reads), a row
    group at a time: the file is never read whole."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path} is a Parquet file, and reading one needs pyarrow: pip install pyarrow "
                          f"(or convert it to JSON lines)") from None
    required, optional = COLUMNS[fmt] if fmt != "completion" else ((field,), ())
    unreadable = (OSError, pyarrow.ArrowException, ValueError)
    try:
        source = _open(path, binary=True)  # (a file object given to it, ParquetFile leaves it open)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it as Parquet ({e}); download it again") from None
    try:
        parquet = pq.ParquetFile(source)
        names = parquet.schema_arrow.names
    except unreadable as e:
        source.close()
        raise ConfigError(f"{path}: cannot read it as Parquet ({e}); download it again") from None
    with source, parquet:
        missing = ", ".join(repr(c) for c in required if c not in names)
        if fmt == "completion" and missing:
            missing += " (data.field)"
        elif fmt == "chat" and not set(optional) & set(names):
            missing = "'messages' (or 'conversations')"
        if missing:
            raise ConfigError(f"{path}: no column {missing}; its columns are {', '.join(names) or 'none'}")
        columns = [c for c in (*required, *optional) if c in names]
        k = 0
        for i in range(parquet.num_row_groups):
            count = parquet.metadata.row_group(i).num_rows
            try:
                group = parquet.read_row_group(i, columns=columns)
            except unreadable as e:
                raise ConfigError(f"{path}: cannot read its row group {i + 1} of {parquet.num_row_groups} (rows {k + 1}-"
                                  f"{k + count}) as Parquet ({e}); download it again") from None
            for rows in group.to_batches(max_chunksize=1024):
                for row in rows.to_pylist():
                    k += 1
                    yield row, f"{path} row {k}"


def _rows(path: Path, fmt: str, field: str):
    """``(JSON value, where)`` of each example of a JSON-lines file, of a JSON array (read whole:
    a corpus larger than memory belongs in JSON lines) or of a Parquet file."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path, fmt, field)
        return
    if _json_array(path):
        try:
            with _open(path) as f:
                items = json.loads(f.read())
        except ConfigError:
            raise  # (what stands there is no file: named as such)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read it as a JSON array ({e})") from None
        for k, row in enumerate(items, 1):
            yield row, f"{path} item {k}"
        return
    first = True
    for line, n in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            hint = (f"; data.format {fmt} reads JSON lines (a JSON object a line), and plain text trains with "
                    f"data.format text") if first else ""
            raise ConfigError(f"{path} line {n}: not JSON ({e}){hint}") from None
        first = False
        yield row, f"{path} line {n}"


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""A ShareGPT turn's ``from`` -> the role of a message."""


def _sharegpt(turns, where: str) -> list:
    """ShareGPT's ``conversations`` (``{"from": ..., "value": ...}`` turns) as messages; other
    shapes are left to the messages' own check."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t for t in turns):
        return turns
    for i, turn in enumerate(turns, 1):
        if turn["from"] not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: turn {i} is from {turn['from']!r}; a ShareGPT turn is from human, gpt or "
                              f"system (or write the example as 'messages' with roles its chat template takes)")
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns]


class Conversation(list):
    """A chat example's messages, and the tool schemas its row gives its template (``tools``)."""

    def __init__(self, messages, tools: list | None = None):
        super().__init__(messages)
        self.tools = tools

    @property
    def uses_tools(self) -> bool:
        """Whether the template must render tools or tool calls for it."""
        return bool(self.tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in self)


class LastTurn(Conversation):
    """A conversation whose loss is on its last turn (an assistant's) only: ``data.chat_turns: each``."""

    @property
    def continues(self) -> bool:
        """Whether an assistant turn comes before the last (the example of that turn is this one's beginning)."""
        return any(m["role"] == "assistant" for m in self[:-1])


def examples(path: Path, fmt: str, field: str, turns: str = "all"):
    """``(text or (prompt, response) or messages, where)`` of every example of a data file, read as
    it goes; ``turns``: ``data.chat_turns`` (``each``: a :class:`LastTurn` per assistant turn)."""
    if fmt == "text" and path.suffix == ".parquet":
        raise ConfigError(f"{path} is a Parquet file: data.format text reads .txt files; its rows train with "
                          f"data.format completion (data.field: the column of the text)")
    if fmt == "text" and path.suffix in (".jsonl", ".json") and _starts_with(path, "{["):
        raise ConfigError(f"{path} is JSON: data.format text reads plain text, and would train on its braces, "
                          f"quotes and keys; its examples train with data.format completion (data.field: the key of "
                          f"the text), prompt-completion, alpaca or chat")
    if fmt == "text":  # paragraphs: what text.split("\n\n") gives, a chunk at a time
        rest, i = "", 0
        for chunk in _chunks(path, "text"):
            *paragraphs, rest = (rest + chunk).split("\n\n")
            for para in paragraphs:
                if para.strip():
                    i += 1
                    yield para, f"{path} paragraph {i}"
        if rest.strip():
            yield rest, f"{path} paragraph {i + 1}"
        return
    for row, where in _rows(path, fmt, field):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(row).__name__}")
        if fmt == "chat":
            messages = row.get("messages")
            if messages is None and row.get("conversations") is not None:
                messages = _sharegpt(row["conversations"], where)
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or (
                        m.get("content") is None and isinstance(m.get("tool_calls"), list) and m["tool_calls"]))
                    for m in messages)):
                raise ConfigError(f"{where}: a chat example needs 'messages': a list of "
                                  f"{{\"role\": ..., \"content\": ...}} objects (a null content only beside "
                                  f"'tool_calls')")
            tools = row.get("tools")
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise ConfigError(f"{where}: 'tools' must be a list of tool schemas (JSON objects), as the chat "
                                  f"template takes them")
            if turns == "each":
                for i, m in enumerate(messages):
                    if m["role"] == "assistant":
                        yield LastTurn(messages[:i + 1], tools), f"{where} turn {i + 1}"
            else:
                yield Conversation(messages, tools), where
        elif fmt == "completion":
            if field in row and row[field] is None:
                raise ConfigError(f"{where}: its field {field!r} is null; drop the example or give it a text")
            if field in row and not isinstance(row[field], str):
                raise ConfigError(f"{where}: its field {field!r} holds {str(row[field])[:40]} "
                                  f"({type(row[field]).__name__}), not a string")
            if not isinstance(row.get(field), str):
                raise ConfigError(f"{where}: no text field {field!r} (data.field); its keys are "
                                  f"{', '.join(sorted(row)) or 'none'}")
            yield row[field], where
        elif fmt == "prompt-completion":
            for key in ("prompt", "completion"):
                if not isinstance(row.get(key), str):
                    raise ConfigError(f"{where}: a prompt-completion example needs a text {key!r}; its keys are "
                                      f"{', '.join(sorted(row)) or 'none'}")
            yield (row["prompt"], row["completion"]), where
        else:  # alpaca
            for key in ("instruction", "output"):
                if not isinstance(row.get(key), str):
                    raise ConfigError(f"{where}: an alpaca example needs a text {key!r}; its keys are "
                                      f"{', '.join(sorted(row)) or 'none'}")
            extra = row.get("input") or ""
            prompt = ALPACA_PROMPT.format(with_input=", paired with an input that provides further context" if extra
                                          else "", instruction=row["instruction"],
                                          input_block=f"### Input:\n{extra}\n\n" if extra else "")
            yield (prompt, row["output"]), where
