"""What ``tiered-offload train`` writes into ``output.dir``: the exports (``step-N/``, rotated, and
``final/``, each a complete model directory: the weights and the tokenizer's files), and
``metrics.jsonl`` (a record a step, the run's history). Also the checks before a run that protect
them: the exports' room, what the run reads, or its storage, inside an export it would replace or
rotate away, and a fresh run over an earlier run's outputs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path

from offload_core.errors import CheckpointError, ConfigError, DiskFullError, TieredOffloadError
from offload_core.sizes import format_size
from tiered_offload.checkpoint.durable import fsync_directory
from tiered_offload.checkpoint.lock import read_own
from tiered_offload.checkpoint.safetensors_io import copy_tokenizer as copy_files, exporting, write_private
from tiered_offload.train.ranks import Ranks

__all__ = ["export", "export_step", "rotate_exports", "refuse_inside_exports", "refuse_earlier_run",
           "metrics_from", "Metrics", "write_failed", "check_export_space"]

log = logging.getLogger("tiered_offload")

def export(engine, model_dir: Path, out: Path, cfg, ranks: Ranks) -> None:
    """The weights (with LoRA: the adapter alone, or the model with it merged) in ``output.dtype``,
    and the tokenizer (every rank calls it: rank 0 writes)."""
    lora = cfg.lora
    with exporting(out) if ranks.first else contextlib.nullcontext():  # (the weights and the tokenizer: one hold)
        engine.export_safetensors(out, adapter_only=bool(lora.r) and not lora.merged,
                                  merged=bool(lora.r) and lora.merged, dtype=cfg.output.dtype)
        copy_tokenizer(model_dir, out, ranks)


def copy_tokenizer(model_dir: Path, out: Path, ranks: Ranks) -> None:
    """The tokenizer's files beside an export (rank 0 writes them)."""
    if ranks.first:
        try:
            copy_files(model_dir, out)
        except OSError as e:
            name = Path(e.filename or "").name
            raise write_failed(e, out / name, f"{out}: the weights are exported, and the tokenizer's {name} is "
                                f"not ({{why}}); free space there, then copy it from {model_dir}, or run the same "
                                f"command again (it writes the final export again)") from None


STEP_EXPORT = re.compile(r"step-(\d+)")
"""The name of a ``step-N`` export: no other entry of output.dir is the rotation's (``step-best/``)."""
PARTIAL = re.compile(r"\.step-(\d+)\.partial")
"""A ``step-N`` export being written (:func:`export_step`), removed where a kill left it."""


def export_step(engine, model_dir: Path, out: Path, step: int, cfg, ranks: Ranks) -> None:
    """``step-N/``: written whole beside it (``.step-N.partial``), renamed into place, then the rotation
    (every rank calls it: rank 0 writes). So a ``step-N`` is always a complete model directory: a kill
    mid-export left one with the weights and no tokenizer, which looked whole."""
    partial, into = out / f".step-{step}.partial", out / f"step-{step}"
    if ranks.first:
        shutil.rmtree(partial, ignore_errors=True)  # (a killed export's)
        if os.path.lexists(into) and (into.is_symlink() or not into.is_dir()):
            raise CheckpointError(f"{into} is not a directory, and this run exports step {step} there: move it away, "
                                  f"or give the run another output.dir")
    export(engine, model_dir, partial, cfg, ranks)
    if ranks.first:
        shutil.rmtree(into, ignore_errors=True)  # (an earlier run's export of this step, or this run's)
        try:
            os.rename(partial, into)
        except OSError as e:  # (what was there could not all be removed: a file this user may not delete)
            raise CheckpointError(f"{into}: cannot put step {step}'s export there ({e.strerror or e}); it is in "
                                  f"{partial}. Clear {into}, or give the run another output.dir") from None
        fsync_directory(out)
        rotate_exports(out, step, cfg.output.keep)


def rotate_exports(out: Path, step: int, keep: int) -> None:
    """Remove all but the ``keep`` latest ``step-N`` exports of steps up to ``step`` (the run's own:
    later ones are another run's, this run writes them again when it gets there, and a user's
    ``step-best`` or ``step-2-copy`` is no export)."""
    ours = [(int(m.group(1)), p) for p in out.iterdir() if (m := STEP_EXPORT.fullmatch(p.name))
            and int(m.group(1)) <= step and p.is_dir() and not p.is_symlink()]
    for _, directory in sorted(ours)[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)
    for partial in [p for p in out.iterdir() if PARTIAL.fullmatch(p.name)]:  # (killed exports' remains)
        shutil.rmtree(partial, ignore_errors=True)


def refuse_inside_exports(reads: dict[str, str | Path | None], storage: list[str], out: Path,
                          export_every: int) -> None:
    """Refuse what the run reads (``model.path``, ``data.path``, ``lora.adapter``: ``reads``, by key)
    where this run's exports would replace it (``final/``; ``step-N/``, which the rotation also
    deletes: a run continued from an earlier run's export in the same output.dir, which the same
    command from scratch would then start from this run's weights, or from none), and an
    ``offload.storage`` directory inside one (the rotation deleted the training state mid-run)."""
    def export_holding(path) -> str | None:  # (the export of output.dir that path is or is inside)
        try:
            inside = Path(path).expanduser().resolve().relative_to(out.expanduser().resolve())
        except (OSError, ValueError):
            return None
        name = inside.parts[0] if inside.parts else None
        return name if name == "final" or (export_every and name and (
            STEP_EXPORT.fullmatch(name) or PARTIAL.fullmatch(name))) else None

    for key, path in reads.items():
        if path and (name := export_holding(path)):
            raise ConfigError(
                f"{key} {path} is in {name}/ of output.dir {out}, which this run's exports "
                f"{'replace at its end' if name == 'final' else 'replace and rotate away'}: copy it elsewhere "
                f"and point {key} there, or give the run another output.dir")
    for directory in storage:
        if name := export_holding(directory):
            raise ConfigError(
                f"offload.storage {directory} is inside {name}/ of output.dir {out}, which this run's exports "
                f"{'rewrite' if name == 'final' else 'replace and rotate away'} (with the training state in it); put "
                f"the storage elsewhere")


def refuse_earlier_run(out: Path, location: str) -> None:
    """Refuse a fresh run (``location`` holds no state to continue) in an output.dir holding an
    earlier run's outputs: its ``metrics.jsonl`` records, ``final/``, its ``step-N/`` exports. It
    would drop the records at its first step and replace the exports with its own (without
    ``output.overwrite``: what transformers' example scripts refuse too). Nothing is read but a
    listing and the records' file."""
    found = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        text = read_own(metrics, CheckpointError, "Remove it, or name another output.dir").decode(errors="replace")
        records = 0
        for line in text.splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                records += isinstance(json.loads(line)["step"], int)
        if records:
            found.append(f"metrics.jsonl with {records} record{'s' if records > 1 else ''}")
    exports = sorted((int(m.group(1)), p.name) for p in out.iterdir() if (m := STEP_EXPORT.fullmatch(p.name))
                     and p.is_dir())
    found += ["final/"] * (out / "final").is_dir() + [f"{name}/" for _, name in exports]
    if found:
        raise ConfigError(
            f"output.dir {out} holds an earlier run's outputs ({', '.join(found)}), and offload.storage {location} "
            f"holds no training state to continue: this run would start over, drop those records and replace the "
            f"exports. Name another output.dir, give offload.storage the earlier run's state to continue it, or set "
            f"output.overwrite=true to start over there")


def metrics_from(path: Path, start: int):
    """``metrics.jsonl`` opened to append the steps after ``start``: the records of later steps (a
    crash's after its last commit, trained again now; an earlier run's, when this one starts over)
    and a line a kill cut short are dropped first (the file rewritten and swapped in whole), so the
    file is the run's history, a record a step."""
    last = None
    if os.path.lexists(path):
        kept, dropped = [], 0
        text = read_own(path, CheckpointError, "Remove it, or name another output.dir").decode(errors="replace")
        for line in text.splitlines():
            try:
                record = json.loads(line)
                keep = record["step"] <= start
            except (ValueError, TypeError, KeyError):
                keep = False
            if keep:
                kept.append(line)
                last = record
            else:
                dropped += 1
        if dropped:
            log.warning("tiered-offload: %s: dropped %d record(s) after step %d (steps trained again from the last "
                        "commit, or an earlier run's)", path, dropped, start)
            try:
                write_private(path, "".join(line + "\n" for line in kept))
            except OSError as e:
                raise write_failed(e, path, f"{path}: {{why}} to drop the records after step {start}; free space "
                                             f"there, then run the same command again") from None
    return Metrics(path, last)


class Metrics:
    """``metrics.jsonl`` open to append, a record a line, each flushed as it is written. A write that
    fails (its disk full: something else filled it) stops the run with a typed error naming the
    file: the engine then closes, its steps committed, and the same command continues the run."""

    def __init__(self, path: Path, last: dict | None = None):
        self.path = path
        self.last = last
        """The last record in the file (None: none): where a resume finds the step it resumes at
        without its record (killed between the step's commit and its record), or the run's final
        evaluation there already."""
        self._file = open(path, "a")

    @property
    def last_step(self) -> int:
        return self.last["step"] if self.last else 0

    def holds_final_evaluation(self, step: int) -> bool:
        """Whether the last record is the final evaluation of ``step`` (killed after it: not again)."""
        return self.last is not None and set(self.last) == {"step", "eval_loss"} and self.last["step"] == step

    def write(self, record: dict) -> None:
        self.last = record
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            self._failed(e, f"step {record['step']}'s record")

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:  # (nothing is left to write: each record was flushed, or failed already)
            self._failed(e, "the file's close")

    def _failed(self, e: OSError, what: str) -> None:
        with contextlib.suppress(OSError):
            self._file.close()  # (its buffer dropped: a line cut short is dropped at the next start)
        raise write_failed(e, self.path, f"{self.path}: {{why}} for {what}; training stopped, and the steps taken "
                                          f"are committed: free space there, then run the same command again to "
                                          f"continue") from None


def write_failed(e: OSError, path: Path, message: str) -> TieredOffloadError:
    """The error a failed write ``e`` of ``path`` is: ``message`` (its ``{why}`` replaced, not
    formatted: a path may hold braces) as a :class:`DiskFullError` where the disk had no room, else
    a :class:`CheckpointError`."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    message = message.replace("{why}", "no room on its disk" if full else e.strerror or str(e))
    return DiskFullError(message, path=str(path)) if full else CheckpointError(message)


def check_export_space(cfg, out: Path, params: int, trained: int, directories: str, resuming: bool) -> None:
    """Refuse a run whose exports (the ones kept and the final one, fp32; with LoRA the adapter's
    alone) do not fit the output directory's disk, counting the training state too (16 bytes a
    trained parameter, 4 a frozen one) where it shares that disk and is new."""
    per_export = (4 if cfg.output.dtype == "fp32" else 2) * (trained if cfg.lora.r and not cfg.lora.merged else params)
    exports = per_export * ((cfg.output.keep if cfg.output.export_every else 0) + 1)
    free = shutil.disk_usage(out).free
    storage = Path(directories.split(",")[0]).expanduser()
    while not storage.exists():
        storage = storage.parent
    state = 4 * params + 12 * trained if not resuming and os.stat(storage).st_dev == os.stat(out).st_dev else 0
    if exports + state > free:
        raise DiskFullError(
            f"output.dir {out} needs {format_size(exports)} for the exports ({cfg.output.keep if cfg.output.export_every else 0}"
            f" kept and the final one)" + (f" and the training state {format_size(state)} on the same disk" if state else "")
            + f", but {format_size(free)} is free; free space, lower output.keep, or put the output elsewhere",
            path=str(out), needed_bytes=exports + state, free_bytes=free)
