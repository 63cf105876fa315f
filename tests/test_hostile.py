"""Hostile and damaged state, a second process, interrupted exports: nothing lost, nothing read from
outside the directory, no hang, every error typed and naming the file.

Each test reproduces a failure found by trying (the issue "Nothing lost, nothing read from outside,
no hang"), then checks the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch

from offload_core.errors import (
    CheckpointError,
    CorruptionError,
    DiskFullError,
    StorageDirectoryError,
    StorageLockedError,
    TieredOffloadError,
)
from storage_backends.base import key_to_filename
from storage_backends.posix import PosixBackend
from storage_backends.testing import FaultInjectingBackend
from tiered_offload.checkpoint.durable import STATE_DIR, StateFiles
from tiered_offload.checkpoint.state_dir import StateDirectory
from tiered_offload.cli import main as cli_main

from test_durable import die_after_records, make_engine, same, train, uninterrupted, weights  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def extents(directory: Path) -> set[str]:
    return {f.name for f in directory.iterdir() if f.is_file()}


def rewrite_manifest(directory: Path, change) -> None:
    """Edit the manifest as a hostile user would: change it, then recompute its checksum."""
    path = directory / STATE_DIR / "manifest.json"
    crc, _, payload = path.read_text().partition(" ")
    manifest = json.loads(payload)
    out = change(manifest)
    text = out if isinstance(out, str) else json.dumps(manifest if out is None else out)
    path.write_text(f"{zlib.crc32(text.encode()):08x} {text}")


def within(seconds: float, fn):
    """Run ``fn`` on a thread; fail if it has not returned after ``seconds`` (a hang)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no answer after {seconds}s: a hang"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- 1. a second process -----------------------------------------------------------------------------
def test_a_second_engine_on_a_live_directory_is_refused_before_it_touches_a_file(tmp_path):
    live = make_engine(tmp_path / "s")
    torch.manual_seed(1)
    train(live, 1)
    live.wait_committed()  # the live run's own commit is done: any change now is the second engine's
    # what an offloading forward leaves on disk in the middle of a step
    planted = tmp_path / "s" / key_to_filename("block.1/activations")
    planted.write_bytes(b"\0" * 64)
    before = extents(tmp_path / "s")
    with pytest.raises(StorageLockedError, match=f"process {os.getpid()}"):
        make_engine(tmp_path / "s", resume=True)
    assert extents(tmp_path / "s") == before  # not one file of the live run deleted
    planted.unlink()
    train(live, 2)
    live.close()


def test_a_volatile_engine_locks_its_directory_too(tmp_path):
    first = make_engine(tmp_path / "v", durable=False)
    with pytest.raises(StorageLockedError):
        make_engine(tmp_path / "v", durable=False)
    with pytest.raises(StorageLockedError):
        make_engine(tmp_path / "v")
    train(first, 1)
    first.close()
    make_engine(tmp_path / "v", durable=False).close()  # free again once it is closed


def test_verify_and_export_beside_a_live_engine_are_refused_naming_it(tmp_path, capsys):
    """``tiered-offload verify`` run beside a training run reported its tensors DAMAGED (the engine
    had deleted the files of the steps it superseded) and said to restore them from a copy;
    ``export`` said a step was in flight and to open the directory with the engine (found by
    running them beside ``tiered-offload train``). Both are refused now, naming the engine's
    process, and change nothing; ``inspect`` still shows the run and who holds it (the lock's
    holder, not the last record in its file). Once the engine has closed, both work; a reader
    opened before an engine committed again says so instead of reading gone files."""
    live = make_engine(tmp_path / "s")
    torch.manual_seed(1)
    train(live, 2)
    live.wait_committed()
    before = extents(tmp_path / "s")
    for command in (["verify", str(tmp_path / "s")], ["export", str(tmp_path / "s"), str(tmp_path / "out")]):
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert f"in use by process {os.getpid()}" in err and "Stop it" in err and "DAMAGED" not in err, err
    assert extents(tmp_path / "s") == before and not (tmp_path / "out").exists()
    assert cli_main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "step            2" in out and f"in use by       pid {os.getpid()}" in out, out
    live.close()
    lock = tmp_path / "s" / STATE_DIR / "lock"  # what a killed engine leaves: its record, no holder
    lock.write_text(json.dumps({"pid": 2 ** 22 + 7, "host": "elsewhere", "since": "then", "command": "train.py"}))
    assert cli_main(["inspect", str(tmp_path / "s")]) == 0
    assert "in use by       nobody" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path / "s")]) == 0
    assert "OK: every tensor matches" in capsys.readouterr().out
    opened = StateDirectory(tmp_path / "s")
    again = make_engine(tmp_path / "s", resume=True)
    train(again, 3)
    again.close()
    with pytest.raises(CheckpointError, match=r"changed since it was opened.*cannot be verified as opened: open it again"):
        opened.verify()
    opened.close()
    assert cli_main(["export", str(tmp_path / "s"), str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("record", ["[1]", '"train.py"', "5", "null", '{"pid": "x", "host": 7}'])
def test_a_lock_file_whose_record_is_not_an_object_is_read_as_no_holder(tmp_path, capsys, record):
    """The lock file names its holder as a JSON object. One holding other JSON (a list, a string, a
    number: a damaged or hand-edited file) made the engine's start an untyped ``AttributeError``
    ('list' object has no attribute 'get'), and so ``inspect`` / ``verify`` beside a live holder.
    Such a record now reads as naming no one: the start takes the lock over, and a second process
    is refused, typed, as beside "another process"."""
    import fcntl
    first = make_engine(tmp_path / "s")
    train(first, 1)
    first.close()
    lock = tmp_path / "s" / STATE_DIR / "lock"
    lock.write_text(record)
    again = make_engine(tmp_path / "s", resume=True)  # (a dead holder's record: taken over)
    again.close()
    lock.write_text(record)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a live holder whose record is this)
        with pytest.raises(StorageLockedError, match=r"in use by (another process|process x on 7)"):
            make_engine(tmp_path / "s", resume=True)
        assert cli_main(["verify", str(tmp_path / "s")]) == 2
        assert "in use by" in capsys.readouterr().err
        assert cli_main(["inspect", str(tmp_path / "s")]) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("which", ["first", "stripe"])
def test_a_file_in_place_of_the_engines_own_directory_is_named(tmp_path, which):
    """``.tiered-offload`` a regular file (a stray `touch`, a copy gone wrong) made the engine's start an
    untyped FileExistsError from the lock's mkdir, in the first directory and in a stripe alike."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    stray = (a if which == "first" else b) / STATE_DIR
    stray.write_text("not a directory")
    with pytest.raises(StorageDirectoryError, match=rf"{stray} is not a directory"):
        make_engine(f"posix:{a},{b}?stripe_bytes=16KiB", resume="auto")
    assert stray.read_text() == "not a directory"


@pytest.mark.parametrize("damage", ["not json", "a list", "a place past the count", "a fifo"])
def test_a_damaged_stripe_record_is_a_typed_error_and_deletes_nothing(tmp_path, damage):
    """A striped state's other directories carry a record of their place (``.tiered-offload/stripe.json``): one
    damaged, of the wrong shape or no file is a CorruptionError naming it, for an engine and a reader alike."""
    a, b = tmp_path / "a", tmp_path / "b"
    spec = f"posix:{a},{b}?stripe_bytes=16KiB"
    engine = make_engine(spec)
    train(engine, 1)
    engine.close()
    record = b / STATE_DIR / "stripe.json"
    good = json.loads(record.read_text())
    record.unlink()
    if damage == "a fifo":
        os.mkfifo(record)
    else:
        record.write_text({"not json": "{", "a list": "[1, 2]",
                           "a place past the count": json.dumps({**good, "index": 2})}[damage])
    before = {p: p.read_bytes() for d in (a, b) for p in d.iterdir() if p.is_file()}
    with pytest.raises(CorruptionError, match=str(record)):
        make_engine(spec, resume=True)
    with pytest.raises(CorruptionError, match=str(record)):
        StateDirectory(a, stripes=[b])
    assert {p: p.read_bytes() for p in before} == before


def test_two_exports_into_one_directory_are_one_at_a_time(tmp_path, capsys):
    """Two ``tiered-offload export`` commands (or an export and a training script's) writing into
    one directory at once: each wrote its shards under the same temporary names, so one renamed
    the other's half-written file into place and the other stopped with an untyped
    ``FileNotFoundError`` (3 of 8 tries, 12 blocks, 4 shards); two states exported there at once
    could leave shards of both under one index. An export now holds the directory for its whole
    write (an ``flock`` on it): a second one is refused, typed, naming it, and what is there stays
    the first's, whole."""
    import fcntl
    from safetensors.torch import load_file
    engine = make_engine(tmp_path / "s", layers=12)
    train(engine, 2)
    engine.close()
    command = ["export", str(tmp_path / "s"), str(tmp_path / "out"), "--max-shard-size", "200KB"]
    assert cli_main(command) == 0
    capsys.readouterr()

    def exported():
        return {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    first = exported()
    fd = os.open(tmp_path / "out", os.O_RDONLY | os.O_DIRECTORY)  # (another export, writing there now)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert "is being written by another export" in err and "wait for it" in err, err
    finally:
        os.close(fd)
    assert same(exported(), first)
    runs = [subprocess.Popen([sys.executable, "-m", "tiered_offload", *command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in runs]
    assert all(rc == 0 or (rc == 2 and "is being written by another export" in err) for rc, err in outcomes), outcomes
    assert any(rc == 0 for rc, _ in outcomes) and same(exported(), first)


def test_a_killed_exports_half_written_shards_go_at_the_next_export(tmp_path, capsys):
    """An export killed while it wrote (SIGKILL, the OOM killer, a power cut) leaves its shards'
    temporary files, up to a shard's size each. The next export replaced those of the same names
    only: another shard plan (``--max-shard-size``, ``--dtype``) left them for good. An export
    holds its directory (no other export writes there meanwhile), so it removes every shard's
    temporary it finds; the user's other files stay."""
    engine = make_engine(tmp_path / "s", layers=12)
    train(engine, 2)
    engine.close()
    out = tmp_path / "out"
    out.mkdir()
    left = [out / ".model-00007-of-00009.safetensors.partial", out / ".model.safetensors.partial"]
    for f in left:
        f.write_bytes(b"\0" * 4096)
    mine = [out / "notes.partial", out / ".notes.txt", out / "README.md"]
    for f in mine:
        f.write_text("the user's")
    assert cli_main(["export", str(tmp_path / "s"), str(out), "--max-shard-size", "200KB"]) == 0
    assert not any(f.exists() for f in left) and all(f.read_text() == "the user's" for f in mine)


# ---- 2. a damaged journal ---------------------------------------------------------------------------
def _cut_short_in_step_3(path: Path, monkeypatch) -> None:
    """A journal holding step 3's intent and two unit records (the process died in the update)."""
    engine = make_engine(path)
    torch.manual_seed(123)
    train(engine, 2)
    engine.wait_committed()
    die_after_records(engine, 3, 2)


@pytest.mark.parametrize("line", [0, 1])
def test_damage_in_the_middle_of_the_journal_is_reported_and_nothing_is_deleted(tmp_path, monkeypatch, line):
    _cut_short_in_step_3(tmp_path / "s", monkeypatch)
    journal = tmp_path / "s" / STATE_DIR / "journal.jsonl"
    lines = journal.read_bytes().split(b"\n")
    assert len(lines) == 4  # intent, two units, the empty piece after the last newline
    damaged = bytearray(lines[line])
    damaged[len(damaged) // 2] ^= 0x04  # one flipped bit in a record that has records after it
    lines[line] = bytes(damaged)
    journal.write_bytes(b"\n".join(lines))
    before, text = extents(tmp_path / "s"), journal.read_bytes()
    with pytest.raises(CorruptionError, match=rf"journal.jsonl line {line + 1} is damaged"):
        make_engine(tmp_path / "s", resume=True)
    assert extents(tmp_path / "s") == before and journal.read_bytes() == text  # nothing "repaired"
    assert cli_main(["inspect", str(tmp_path / "s")]) == 2


def test_a_torn_last_line_is_still_a_crash_mid_append_and_resumes(tmp_path, monkeypatch, uninterrupted):
    per_step, _ = uninterrupted
    _cut_short_in_step_3(tmp_path / "s", monkeypatch)
    journal = tmp_path / "s" / STATE_DIR / "journal.jsonl"
    journal.write_bytes(journal.read_bytes() + b'0badc0de {"type": "unit", "st')  # an append cut short
    resumed = make_engine(tmp_path / "s", resume=True)
    assert resumed.step_count == 3 and same(weights(resumed), per_step[3])
    resumed.close()


# ---- 3. nothing read from outside ----------------------------------------------------------------------
def test_the_manifest_cannot_point_reads_at_another_directory(tmp_path):
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read" * 100)
    rewrite_manifest(tmp_path / "s", lambda m: m["storage"].update(directories=[str(tmp_path / "s"), str(outside)]))
    with pytest.raises(CheckpointError, match="striped over 2 directories"):
        StateDirectory(tmp_path / "s")
    for command in (["inspect"], ["verify"], ["export"]):
        args = [*command, str(tmp_path / "s")] + ([str(tmp_path / "out")] if command == ["export"] else [])
        assert cli_main(args) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("weights, match", [("3:1", r"expected a list"), ([3, 0], r"0 is outside"),
                                            ([3, 1, 2], r"3 weights for 2 directories"), ([2.5, 1], "an integer")])
def test_a_manifests_stripe_weights_of_the_wrong_kind_are_refused_naming_them(tmp_path, weights, match):
    """A state striped by weight records them in its manifest, and the readers lay out the stripes
    by them: an edited list is a typed error naming the field, from the engine and the readers,
    never a read of other bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    spec = f"posix:{a},{b}?stripe_bytes=16KiB&stripe_weights=3:1"
    engine = make_engine(spec)
    train(engine, 1)
    engine.close()
    rewrite_manifest(a, lambda m: m["storage"].update(stripe_weights=weights))
    with pytest.raises(CorruptionError, match=f"storage.stripe_weights.*{match}"):
        make_engine(spec, resume=True)
    with pytest.raises(CorruptionError, match=f"storage.stripe_weights.*{match}"):
        StateDirectory(a, stripes=[b])

def test_stripe_weights_a_manifest_gives_unreduced_are_the_layout_they_reduce_to(tmp_path):
    """The backend reduces its weights (6:2 is 3:1; 2:2 even) and the manifest keeps them reduced; a
    manifest that gives them unreduced (by hand) named a layout no storage could match: every
    resume was refused, asking for weights the backend then reduced again. Compared reduced, it
    resumes."""
    a, b = tmp_path / "a", tmp_path / "b"
    spec = f"posix:{a},{b}?stripe_bytes=16KiB&stripe_weights=3:1"
    engine = make_engine(spec)
    train(engine, 1)
    engine.close()
    rewrite_manifest(a, lambda m: m["storage"].update(stripe_weights=[6, 2]))
    with make_engine(spec, resume=True) as engine:
        train(engine, 2)
    rewrite_manifest(a, lambda m: m["storage"].update(stripe_weights=[2, 2]))  # (even: the bytes are not, now)
    with pytest.raises(CheckpointError, match=r"stripe weights even \(none\), and this storage's are 3:1"):
        make_engine(spec, resume=True)

@pytest.mark.parametrize("key, value", [("lr", "x"), ("betas", "nope"), ("betas", [0.9]), ("eps", True),
                                        ("initial_lr", [1]), ("amsgrad", 0.5)])
def test_a_saved_hyperparameter_of_the_wrong_kind_is_refused_naming_it(tmp_path, key, value):
    """A manifest whose checksum holds but whose optimizer hyperparameter is of another kind than
    the optimizer's (a rate that is a string, betas not a pair): the resume took it, and the first
    step failed part-way (``StepFailedError``) or with a bare ``TypeError``. It is now a
    ``CorruptionError`` at the resume naming the file and the value, the files left as they were."""
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    rewrite_manifest(tmp_path / "s", lambda m: m["meta"]["param_groups"][0].update({key: value}))
    before = extents(tmp_path / "s")
    with pytest.raises(CorruptionError, match=rf"manifest.json: the saved hyperparameter {key} of group 0 is "):
        make_engine(tmp_path / "s", resume=True)
    assert extents(tmp_path / "s") == before



def test_a_setting_changed_to_or_from_none_is_no_damage():
    """The kinds' rule: None is a default left unset (``foreach``; Adafactor's ``eps`` of
    ``(None, 1e-3)``), so a value changed to or from None is a change the resume names, not a
    damaged file; a number where a pair was, a string where a number was, are damage."""
    from tiered_offload.engine.train_state import check_saved_kinds
    given = [{"lr": torch.tensor(0.01), "eps": (None, 1e-3), "foreach": True, "maximize": False}]
    check_saved_kinds(given, [{"lr": 0.02, "eps": [1e-30, 1e-3], "foreach": None, "maximize": False,
                               "initial_lr": 0.02, "new_key": "x"}], "m")
    check_saved_kinds([{**given[0], "eps": (1e-30, 1e-3), "foreach": None}],
                      [{"eps": [None, 1e-3], "foreach": True}], "m")
    for bad in ({"eps": [1e-3]}, {"lr": "0.01"}, {"maximize": 0}, {"initial_lr": [0.01]}, {"eps": [None, "x"]}):
        with pytest.raises(CorruptionError, match=f"m: the saved hyperparameter {next(iter(bad))} of group 0"):
            check_saved_kinds(given, [bad], "m")

# ---- 4. no hang ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("crc", ["abc", 1.5, [1], -1, 2 ** 70])
def test_a_checksum_of_the_wrong_type_is_refused_not_a_hang(tmp_path, crc):
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    rewrite_manifest(tmp_path / "s", lambda m: m["tensors"]["block.0/weight"].update(crc=crc))
    with pytest.raises(CorruptionError, match=r"manifest.json: tensors\['block.0/weight'\].crc"):
        within(60, lambda: make_engine(tmp_path / "s", resume=True))
    assert cli_main(["verify", str(tmp_path / "s")]) == 2


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Put what is not a regular file where the engine keeps one of its own."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:  # a link to a file of the user's outside the directory
        path.symlink_to(outside)


def _unblock(path: Path) -> None:
    """Open a planted FIFO's other end, so that a reader stuck opening it returns (after a hang)."""
    if path.is_fifo():
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


@pytest.mark.parametrize("name,kind", [("manifest.json", "fifo"), ("journal.jsonl", "fifo"),
                                       ("journal.jsonl", "device"), ("manifest.json", "link"), ("lock", "fifo"),
                                       ("lock", "link"), ("extent", "fifo")])
def test_a_fifo_a_device_or_a_link_in_place_of_a_state_file_is_refused_naming_it(tmp_path, capsys, name, kind):
    """A FIFO where the engine keeps its manifest, journal, lock or a tensor's file made a resume,
    ``verify`` and ``export`` wait forever for a writer; a link to ``/dev/zero`` as the journal read
    without end; the lock a FIFO was an untyped ``OSError``; and the lock a link to a file of the
    user's was truncated by every start and every ``verify`` (its first 4 KiB written back after).
    Each is now refused at once, naming the file, and the file a link points to is not touched."""
    engine = make_engine(tmp_path / "s")
    train(engine, 2)
    engine.close()
    state = tmp_path / "s" / STATE_DIR
    if name == "extent":
        manifest = json.loads((state / "manifest.json").read_text().partition(" ")[2])
        path = tmp_path / "s" / key_to_filename(manifest["tensors"]["block.1/weight"]["extent"])
    else:
        path = state / name
    outside = tmp_path / "notes.txt"
    outside.write_bytes(b"the user's own file\n" * 1000)
    _plant(path, kind, outside)
    try:
        with pytest.raises(TieredOffloadError) as e:
            within(30, lambda: make_engine(tmp_path / "s", resume=True))
        assert path.name in str(e.value), e.value
        for command in (["verify", str(tmp_path / "s")], ["export", str(tmp_path / "s"), str(tmp_path / "out")]):
            assert within(30, lambda: cli_main(command)) != 0
            out = capsys.readouterr()
            assert path.name in out.out + out.err and "Traceback" not in out.err, (command, out)
    finally:
        _unblock(path)
    assert outside.read_bytes() == b"the user's own file\n" * 1000
    assert not (tmp_path / "out").exists()


def test_an_error_in_a_read_completion_reaches_the_waiter(tmp_path, monkeypatch):
    """Whatever goes wrong in the checksum check of a read (on an I/O thread) fails the read."""
    from tiered_offload.store import disk
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.wait_committed()

    def broken(*a, **k):
        raise TypeError("a checksum that is not a number")
    monkeypatch.setattr(disk, "matches", broken)
    with pytest.raises(TypeError, match="not a number"):
        within(60, lambda: dict(engine.named_parameters()))
    monkeypatch.undo()
    engine.close()


# ---- 5. a lying file, unbounded work -------------------------------------------------------------------
def test_an_export_of_a_lying_shape_is_refused_before_writing(tmp_path):
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()

    def lie(m):
        m["params"][0]["shape"] = [10 ** 6, 10 ** 6]
    rewrite_manifest(tmp_path / "s", lie)
    with pytest.raises(CorruptionError, match=r"params\[0\]"):
        StateDirectory(tmp_path / "s")

    def consistent_lie(m):  # the tensor lies too: the free space is checked before a byte is written
        t = m["tensors"]["block.0/weight"]
        t.update(extent=None, crc=None, shape=[10 ** 12], nbytes=4 * 10 ** 12)
        m["params"] = [dict(m["params"][0], tensor="block.0/weight", offset=0, shape=[10 ** 6, 10 ** 6])]
    rewrite_manifest(tmp_path / "s", consistent_lie)
    with pytest.raises(DiskFullError):
        StateDirectory(tmp_path / "s").export(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors"))


# ---- 6. and 7. every malformed file gives a typed error naming it -----------------------------------------
MANIFEST_MUTATIONS = {
    "a list": lambda m: [m],
    "missing tensors": lambda m: m.pop("tensors") and None,
    "step a string": lambda m: m.update(step="2"),
    "step huge": lambda m: m.update(step=10 ** 18),
    "step negative": lambda m: m.update(step=-7),
    "a tensor entry a string": lambda m: m["tensors"].update({"block.0/weight": "x"}),
    "tensors a list": lambda m: m.update(tensors=[]),
    "missing meta": lambda m: m.pop("meta") and None,
    "an integer extent": lambda m: m["tensors"]["block.0/weight"].update(extent=7),
    "a bad dtype": lambda m: m["tensors"]["block.0/weight"].update(dtype="complex512"),
    "an unknown optimizer placement": lambda m: m["meta"].update(update_tier="tpu"),
    "a clipped step's growth below 1": lambda m: m["meta"].update(clip_growth=0.5),
    "a clipped step's growth a string": lambda m: m["meta"].update(clip_growth="1.2"),
    "the model's generators a number": lambda m: m["meta"]["rng"].update(own=7),
    "a generator's state a list": lambda m: m["meta"]["rng"].update(own={"blocks.0.gen": [1, 2]}),
    "deep nesting": lambda m: json.dumps(m)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "duplicate keys": lambda m: json.dumps(m)[:-1] + ', "step": 1}',
    "an adapter's parameter that is not one": lambda m: m.update(peft={"adapter": "default", "config": {},
                                                                       "keys": [["nowhere.weight", "x.weight"]]}),
    "an adapter's keys a mapping": lambda m: m.update(peft={"adapter": "default", "config": {}, "keys": {"a": "b"}}),
    "an adapter's base config a list": lambda m: m.update(peft={"adapter": "default", "config": {}, "keys": [],
                                                                "base_config": ["LlamaForCausalLM"]}),
}


@pytest.mark.parametrize("name", list(MANIFEST_MUTATIONS))
def test_a_malformed_manifest_is_a_typed_error_everywhere(tmp_path, name):
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    rewrite_manifest(tmp_path / "s", MANIFEST_MUTATIONS[name])
    with pytest.raises(CorruptionError, match="manifest.json"):
        within(60, lambda: make_engine(tmp_path / "s", resume=True))
    for command in ("inspect", "verify"):
        assert cli_main([command, str(tmp_path / "s")]) == 2
    assert cli_main(["export", str(tmp_path / "s"), str(tmp_path / "out")]) == 2


@pytest.mark.parametrize("kept", ["damaged", "malformed", "whole"])
def test_the_commit_before_kept_beside_the_manifest_is_checked_as_one(tmp_path, kept):
    """A sharded run's ``previous.json`` (the commit before its last, kept for the other ranks) is
    read with the manifest: damage or a malformed one is a typed error naming it, from the engine and
    every command alike; a whole one that one process finds is forgotten at its start."""
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    state = tmp_path / "s" / STATE_DIR
    data = (state / "manifest.json").read_bytes()
    if kept == "damaged":
        data = data[:-3] + b"x" + data[-2:]
    elif kept == "malformed":
        crc, _, payload = data.partition(b" ")
        payload = payload.replace(b'"step":1', b'"step":"1"', 1)
        data = b"%08x %s" % (zlib.crc32(payload), payload)
    (state / "previous.json").write_bytes(data)
    if kept == "whole":
        engine = make_engine(tmp_path / "s", resume=True)
        assert not (state / "previous.json").exists()
        train(engine, 2)
        engine.close()
        return
    with pytest.raises(CorruptionError, match="previous.json"):
        within(60, lambda: make_engine(tmp_path / "s", resume=True))
    for command in ("inspect", "verify"):
        assert cli_main([command, str(tmp_path / "s")]) == 2
    assert (state / "previous.json").exists()  # (nothing deleted to "repair" it)


def test_a_manifest_that_is_not_utf8_is_a_typed_error(tmp_path):
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.close()
    path = tmp_path / "s" / STATE_DIR / "manifest.json"
    crc, _, payload = path.read_bytes().partition(b" ")
    payload = payload.replace(b'"step"', b'"st\xffep"', 1)
    path.write_bytes(b"%08x %s" % (zlib.crc32(payload), payload))
    with pytest.raises(CorruptionError, match="not UTF-8"):
        make_engine(tmp_path / "s", resume=True)


@pytest.mark.parametrize("change", ["scale", "unknown unit", "unknown type", "deep"])
def test_a_malformed_journal_record_is_a_typed_error(tmp_path, monkeypatch, change):
    _cut_short_in_step_3(tmp_path / "s", monkeypatch)
    journal = tmp_path / "s" / STATE_DIR / "journal.jsonl"
    lines = journal.read_bytes().split(b"\n")
    records = [json.loads(line.partition(b" ")[2]) for line in lines[:-1]]
    if change == "scale":
        records[0]["scale"] = "abc"
    elif change == "unknown unit":
        records[1]["unit"] = "block.99"
    elif change == "unknown type":
        records[1]["type"] = "surprise"
    texts = [json.dumps(r) for r in records]
    if change == "deep":
        texts[1] = texts[1][:-1] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    journal.write_bytes(b"".join(b"%08x %s\n" % (zlib.crc32(t.encode()), t.encode()) for t in texts))
    before = extents(tmp_path / "s")
    with pytest.raises(CorruptionError, match="journal.jsonl"):
        make_engine(tmp_path / "s", resume=True)
    assert extents(tmp_path / "s") == before


def test_safetensors_whose_tensors_overlap_are_refused(tmp_path):
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(24))
    with pytest.raises(CheckpointError, match="overlap"):
        PretrainedReader(tmp_path / "m.safetensors")


def test_a_deeply_nested_safetensors_header_or_index_is_a_typed_error(tmp_path):
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    raw = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(TieredOffloadError):
        PretrainedReader(tmp_path / "m.safetensors")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(CorruptionError, match="weight_map"):
        PretrainedReader(tmp_path / "d")


class _RunsCode:
    """An object whose unpickling runs a command (what a hostile pickle carries)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _hostile_pytorch_file(tmp_path: Path, case: str) -> Path:
    """A directory whose ``pytorch_model.bin`` (or index) is ``case``; see the test below."""
    import zipfile
    d = tmp_path / "model"
    d.mkdir()
    bin_path, good = d / "pytorch_model.bin", {"w": torch.arange(6.0).reshape(2, 3)}
    if case == "code":
        torch.save({"w": _RunsCode(tmp_path / "ran")}, bin_path)
    elif case == "legacy format":
        torch.save(good, bin_path, _use_new_zipfile_serialization=False)
    elif case in ("truncated", "compressed"):
        torch.save(good, bin_path)
        if case == "truncated":
            bin_path.write_bytes(bin_path.read_bytes()[:-200])
        else:
            with zipfile.ZipFile(bin_path) as z:
                members = [(i.filename, z.read(i)) for i in z.infolist()]
            with zipfile.ZipFile(bin_path, "w", compression=zipfile.ZIP_DEFLATED) as z:
                for name, data in members:
                    z.writestr(name, data)
    elif case == "a list":
        torch.save([good["w"]], bin_path)
    elif case == "a training checkpoint":
        torch.save({"model": good, "step": 3}, bin_path)
    elif case == "sparse":
        torch.save({"w": good["w"].to_sparse()}, bin_path)
    else:  # an index naming a shard outside the directory, or one that is not there
        torch.save(good, tmp_path / "outside.bin")
        shard = "../outside.bin" if case == "outside" else "pytorch_model-00001-of-00002.bin"
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    return d


@pytest.mark.parametrize("case,match", [
    ("code", "only tensors and plain containers are read from it, no code"),
    ("legacy format", "not a PyTorch checkpoint of the zip format"),
    ("truncated", "not a readable PyTorch checkpoint"),
    ("compressed", "is compressed or lies past the file's end"),
    ("a list", "holds a list, not a state dict"),
    ("a training checkpoint", "entry 'model' is a dict, not a tensor"),
    ("sparse", "only dense tensors"),
    ("outside", "refusing to read outside it"),
    ("missing shard", r"pytorch_model-00001-of-00002\.bin does not exist, and the index names it for 'w'"),
])
def test_a_hostile_or_damaged_pytorch_file_is_refused_naming_it_and_runs_nothing(tmp_path, case, match):
    """PyTorch's format is a pickle, and a pickle can carry code; ``init_from`` now reads it
    (``pytorch_model.bin``). It is read with PyTorch's restricted unpickler, over a memory map of an
    archive checked first: each way such a file can be hostile or damaged is a ``CheckpointError``
    naming the file and saying what to do, the code in it never runs, and nothing outside the
    directory is read."""
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    d = _hostile_pytorch_file(tmp_path, case)
    with pytest.raises(CheckpointError, match=match) as e:
        PretrainedReader(d)
    assert str(d) in str(e.value)
    assert not (tmp_path / "ran").exists()


# ---- 8. snapshot commits need room for two versions ---------------------------------------------------------
def test_a_checkpoints_config_is_read_for_its_quantization_without_a_hang_or_an_untyped_error(tmp_path):
    """``init_from`` reads a checkpoint directory's ``config.json`` (a ``quantization_config`` is
    refused): a FIFO there would wait for a writer forever, and JSON nested past Python's recursion
    limit raised ``RecursionError``. Neither concerns the weights: they are read as before."""
    from safetensors.torch import save_file
    from tiered_offload.checkpoint.safetensors_io import PretrainedReader
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "config.json")
    done = []
    reader = threading.Thread(target=lambda: done.append(PretrainedReader(tmp_path).names()), daemon=True)
    reader.start()
    reader.join(30)
    if not done:  # (unblock the reader: open the FIFO's other end)
        with open(tmp_path / "config.json", "wb"):
            pass
    assert done == [["w"]], "the read waited on the FIFO"
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert PretrainedReader(tmp_path).names() == ["w"]


def test_the_disk_preflight_counts_what_snapshot_commits_need(tmp_path):
    probe = make_engine(tmp_path / "probe", host_memory=1 << 22)  # the state fits in memory: snapshots
    assert probe.commit_mode == "snapshot"
    state, need = probe.state_bytes(), probe.state_bytes() + probe.extra_disk_bytes()
    assert need >= state + state // 2  # a second version of the weights and optimizer states
    probe.close()
    backend = FaultInjectingBackend(PosixBackend(tmp_path / "s"), write_quota_bytes=int(state * 1.25))
    with pytest.raises(DiskFullError, match="needs"):
        make_engine(backend, durable=True, host_memory=1 << 22)


# ---- 9. an interrupted export ---------------------------------------------------------------------------------
def test_an_export_killed_between_renames_is_recognisably_incomplete(tmp_path, monkeypatch):
    from tiered_offload.checkpoint import safetensors_io
    engine = make_engine(tmp_path / "s")
    train(engine, 1)
    engine.export_safetensors(tmp_path / "out", max_shard_size="20KB")  # step 1: several shards
    old_index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert old_index["metadata"]["step"] == "1" and len(set(old_index["weight_map"].values())) > 2
    train(engine, 2)
    real, calls = os.replace, {"n": 0}

    def dies_after_two(src, dst):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt("killed between renames")
        return real(src, dst)
    monkeypatch.setattr(safetensors_io.os, "replace", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        engine.export_safetensors(tmp_path / "out", max_shard_size="20KB")
    monkeypatch.undo()
    # half the shards are step 2's: no index names a mix, so nothing loads it as a model
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    files = engine.export_safetensors(tmp_path / "out", max_shard_size="20KB")  # again: complete, one step
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["step"] == "2" and {f.name for f in files} >= set(index["weight_map"].values())
    engine.close()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_export_into_a_path_that_is_no_directory_is_a_typed_error_naming_it(tmp_path, capsys, where):
    """``export_safetensors`` (and the ``export`` command) into a path that is a file, or under one:
    Python's ``FileExistsError`` / ``NotADirectoryError`` from ``mkdir``, untyped, naming no setting;
    the command printed a traceback. Now a ``StorageDirectoryError`` naming the path, before any
    byte is written; the engine trains on."""
    (tmp_path / "f").write_text("not a directory")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "out"
    engine = make_engine(tmp_path / "s", durable=True)
    train(engine, 1)
    with pytest.raises(StorageDirectoryError, match=rf"export.*{out}.*not a directory"):
        engine.export_safetensors(out)
    assert (tmp_path / "f").read_text() == "not a directory"
    train(engine, 2)
    engine.close()
    assert cli_main(["export", str(tmp_path / "s"), str(out)]) != 0
    assert "not a directory" in capsys.readouterr().err


def test_a_trace_path_that_cannot_be_written_is_refused_before_the_storage_is_locked(tmp_path):
    """``Engine(trace=...)`` under a file: the run trained to the end, then ``close()`` raised
    ``FileExistsError`` writing the trace (the state was safe). Refused when the engine is built
    instead, typed and naming the path; and the refusal took the directory's lock for good (the
    tracer was made after the store was open): a second engine found it in use."""
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(StorageDirectoryError, match=r"trace .*f/step\.json: cannot make the directory"):
        make_engine(tmp_path / "s", durable=True, trace=tmp_path / "f" / "step.json")
    engine = make_engine(tmp_path / "s", durable=True)  # (not locked by the refused one)
    engine.close()


# ---- 11. the end of a run -----------------------------------------------------------------------------------------
def test_a_normal_exit_commits_the_last_step_without_close(tmp_path):
    script = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_durable import make_engine, train
engine = make_engine(sys.argv[2])
torch.manual_seed(0)
train(engine, 4)
if sys.argv[1] == "raise":
    raise SystemExit(3)
"""
    runs = {how: subprocess.Popen([sys.executable, "-c", script, how, str(tmp_path / how)], stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            for how in ("return", "raise")}  # (side by side: most of each is the interpreter's start)
    for (how, run), code in zip(runs.items(), (0, 3)):
        _, err = run.communicate(timeout=300)
        assert run.returncode == code, err[-2000:]
        assert StateFiles(tmp_path / how / STATE_DIR).read_manifest()["step"] == 4, how


# ---- 12. the smaller findings ----------------------------------------------------------------------------------
def test_a_profile_saved_to_a_file_tunes_a_store_that_names_it(tmp_path, monkeypatch):
    from tiered_offload.profile import filesystem_id, save_profile
    from tiered_offload.store import TieredStore
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", "none")  # not through the environment: through the config
    (tmp_path / "s").mkdir()
    fs = filesystem_id(tmp_path / "s")
    where = save_profile({"filesystem": fs, "recommended": {"options": {"threads": 3}, "read_GBps": 1.5,
                                                            "write_GBps": 2.5}}, tmp_path / "profile.json")
    with TieredStore(str(tmp_path / "s"), host_budget_bytes=1 << 20, io_profile=str(where)) as store:
        assert store.backend.threads == 3
    with TieredStore(str(tmp_path / "s"), host_budget_bytes=1 << 20) as store:
        assert store.backend.threads != 3


@pytest.mark.parametrize("off", ["none", "off", "NONE"])
def test_a_store_told_io_profile_none_uses_no_profile_though_the_environment_names_one(tmp_path, monkeypatch, off):
    """``TIERED_OFFLOAD_PROFILE=none`` turns profiles off for a process; ``io_profile="none"`` did
    not for one store: it was taken for a file named ``none`` (absent, so no profile, but by
    accident, and a file of that name in the working directory would have been read). Now the
    store's own setting turns the profile off as the variable does, whatever the variable says:
    a benchmark compares an engine with the profile against one with the defaults."""
    from tiered_offload.engine.plan_monitor import profiled_disk_rates
    from tiered_offload.profile import filesystem_id, save_profile
    from tiered_offload.store import TieredStore
    (tmp_path / "s").mkdir()
    where = save_profile({"filesystem": filesystem_id(tmp_path / "s"), "recommended": {
        "options": {"threads": 3}, "read_GBps": 1.5, "write_GBps": 2.5}}, tmp_path / "profile.json")
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", str(where))
    monkeypatch.chdir(tmp_path)
    (tmp_path / off).write_text(where.read_text())  # (a file of that name here: not read)
    with TieredStore(str(tmp_path / "s"), host_budget_bytes=1 << 20) as store:
        assert store.backend.threads == 3 and profiled_disk_rates(store) is not None  # (the variable's)
    with TieredStore(str(tmp_path / "s"), host_budget_bytes=1 << 20, io_profile=off) as store:
        assert store.backend.threads != 3 and profiled_disk_rates(store) is None



def test_direct_io_measured_on_one_drive_is_not_forced_on_a_striped_drive_that_lacks_it(tmp_path, monkeypatch):
    """A bench-io profile that measured O_DIRECT best on the first drive recommends ``direct: true``.
    A store striped over it and a drive whose file system has no O_DIRECT (tmpfs on older kernels,
    a network file system) got that option as if the user had demanded it: the store would not
    open (``O_DIRECT required but unavailable``), though no one asked for direct I/O. Now a
    profile's direct I/O means "where the file system has it", so such a store opens, buffered, and
    logs why, as it does with no profile."""
    import storage_backends.posix as posix
    from tiered_offload.profile import filesystem_id, save_profile
    from tiered_offload.store import TieredStore
    a, b = tmp_path / "nvme", tmp_path / "nfs"
    a.mkdir()
    where = save_profile({"filesystem": filesystem_id(a), "recommended": {
        "options": {"threads": 3, "chunk_bytes": 1 << 20, "direct": True}, "read_GBps": 1.5, "write_GBps": 2.5}},
        tmp_path / "profile.json")
    probe = posix.probe_direct_io
    monkeypatch.setattr(posix, "probe_direct_io", lambda d: "no O_DIRECT here (EINVAL)" if Path(d) == b else probe(d))
    with TieredStore([str(a), str(b)], host_budget_bytes=1 << 20, io_profile=str(where)) as store:
        assert store.backend.threads == 3 and not store.backend.supports_direct_io  # (the profile's, buffered)
        assert f"{b}: no O_DIRECT here" in store.backend.direct_reason  # (logged as a warning)
    with TieredStore(str(a), host_budget_bytes=1 << 20, io_profile=str(where)) as store:
        assert store.backend.supports_direct_io == (probe(a) is None)  # (on its own drive: as measured)


def test_a_profile_never_sets_a_stores_layout(tmp_path):
    """A profile's options tune how bytes move (threads, request size, direct I/O); the stripe size
    and weights are the state's layout, which a resume must meet. A profile edited to give them
    would have laid out a fresh state by them, and a resume after the profile changed would be
    refused (or, before the manifest kept the weights, read by another layout). They are ignored."""
    from tiered_offload.profile import filesystem_id, save_profile
    from tiered_offload.store import TieredStore
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    where = save_profile({"filesystem": filesystem_id(a), "recommended": {
        "options": {"threads": 3, "stripe_bytes": 8192, "stripe_weights": [3, 1]}, "read_GBps": 1.0,
        "write_GBps": 1.0}}, tmp_path / "profile.json")
    with TieredStore([str(a), str(b)], host_budget_bytes=1 << 20, io_profile=str(where)) as store:
        assert store.backend.threads == 3  # (the profile's)
        assert store.backend.stripe_weights is None and store.backend.stripe_bytes == 4 << 20  # (the defaults)

DAMAGED_PROFILES = {
    "an entry that is not an object": lambda fs: "notadict",
    "a filesystem without its device number": lambda fs: {"filesystem": {"mount_point": "/"}, "recommended": {}},
    "a recommendation that is not an object": lambda fs: {"filesystem": fs, "recommended": [1, 2]},
    "a rate that is a word": lambda fs: {"filesystem": fs, "recommended": {"read_GBps": "fast", "write_GBps": 1.0}},
    "a negative rate": lambda fs: {"filesystem": fs, "recommended": {"read_GBps": -1.0, "write_GBps": 1.0}},
    "options that are not an object": lambda fs: {"filesystem": fs, "recommended": {"options": "threads=4"}},
    "a thread count the backend refuses": lambda fs: {"filesystem": fs, "recommended": {"options": {"threads": -3}}},
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_PROFILES))
def test_a_damaged_io_profile_is_named_in_a_warning_and_the_engine_trains_without_it(tmp_path, caplog, damage):
    """A bench-io profile edited by hand or cut short is advice the store and the planner read, not
    the state: an entry of the wrong shape crashed the store's opening (``AttributeError``,
    ``ValueError``), the first construction of an engine with a device tier (``TypeError``:
    ``optimizer_device="auto"`` reads the disk's rates), or the plan after the second step; a thread
    count the backend refuses stopped it with an error that did not name the file. Now each is a
    warning naming the file and what to do, and the engine trains without the profile."""
    import logging
    from tiered_offload.profile import PROFILE_VERSION, filesystem_id, measured_rates
    from test_durable import make_model
    fs = filesystem_id(tmp_path)
    where = tmp_path / "profile.json"
    where.write_text(json.dumps({"version": PROFILE_VERSION, "filesystems": {"/": DAMAGED_PROFILES[damage](fs)}}))
    assert measured_rates(tmp_path, where) is None
    n = sum(p.numel() for p in make_model(2).parameters())
    with caplog.at_level(logging.WARNING):
        engine = make_engine(tmp_path / "s", layers=2, durable=False, host_memory=16 * n,  # (a unit's update: 0.55)
                             store_config={"io_profile": str(where), "device_budget_bytes": 16 * n * 3 // 4})
        with engine:
            train(engine, 3)
            assert engine._updater.why.endswith("(tiered-offload bench-io --save-profile))")  # (not weighed)
            assert "(bench-io profile" not in engine.plan.summary()  # (the plan's disk rates: not from it)
            assert engine.store.backend.threads == PosixBackend(tmp_path / "x").threads  # the default
    said = [r.getMessage() for r in caplog.records if str(where) in r.getMessage()]
    assert said and all("tiered-offload bench-io --save-profile" in m for m in said), caplog.text


DAMAGED_STRIPED_SETS = {
    "sets that are not an object": lambda fss: ["x"],
    "a set without its file systems": lambda fss: {"1,1": {"recommended": {"read_GBps": 1.0, "write_GBps": 1.0}}},
    "a set of one file system": lambda fss: {"1": {"filesystems": fss[:1], "recommended": {}}},
    "a set filed under other file systems": lambda fss: {"1,2": {"filesystems": fss, "recommended": {}}},
    "a rate that is infinite": lambda fss: {",".join(str(f["st_dev"]) for f in fss): {
        "filesystems": fss, "recommended": {"read_GBps": float("inf"), "write_GBps": 1.0}}},
    "weights not one per directory": lambda fss: {",".join(str(f["st_dev"]) for f in fss): {
        "filesystems": fss, "recommended": {}, "weighted": {"stripe_weights": [3], "read_GBps": 1.0}}},
    "a weighted rate that is a word": lambda fss: {",".join(str(f["st_dev"]) for f in fss): {
        "filesystems": fss, "recommended": {}, "weighted": {"stripe_weights": [3, 1], "read_GBps": "fast"}}},
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_STRIPED_SETS))
def test_a_damaged_striped_set_in_an_io_profile_is_named_in_a_warning_and_ignored(tmp_path, caplog, damage):
    """The entry bench-io saves for directories measured together (a striped store's options and
    rates) is checked as each file system's is: a damaged one is a warning naming the file, and a
    store over those directories opens with the default options and plans without its rates."""
    import logging
    from tiered_offload.engine.plan_monitor import profiled_disk_rates
    from tiered_offload.profile import PROFILE_VERSION, filesystem_id
    from tiered_offload.store import TieredStore
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    fss = [filesystem_id(tmp_path)] * 2
    where = tmp_path / "profile.json"
    where.write_text(json.dumps({"version": PROFILE_VERSION, "filesystems": {},
                                 "striped": DAMAGED_STRIPED_SETS[damage](fss)}, allow_nan=True))
    with caplog.at_level(logging.WARNING):
        with TieredStore([str(a), str(b)], host_budget_bytes=1 << 20, io_profile=str(where)) as store:
            assert store.backend.threads == PosixBackend(tmp_path / "x").threads  # the default
            assert profiled_disk_rates(store) is None
    said = [r.getMessage() for r in caplog.records if str(where) in r.getMessage()]
    assert said and all("tiered-offload bench-io --save-profile" in m for m in said), caplog.text


@pytest.mark.parametrize("variable", ["TIERED_OFFLOAD_HOST_BUDGET", "TIERED_OFFLOAD_DEVICE_BUDGET"])
def test_a_budget_from_the_environment_that_is_no_size_names_the_variable(monkeypatch, variable):
    """``host_memory="auto"`` / ``device_memory="auto"`` read a budget from the environment: a value
    that is no size was refused as ``host_budget_bytes`` / ``device_budget_bytes``, which the user
    never wrote. The error names the variable."""
    from offload_core.errors import ConfigError
    from tiered_offload import StoreConfig
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(ConfigError, match=f"^{variable} .*cannot read 'lots' as a byte size"):
        StoreConfig(host_budget_bytes="auto", device="cpu", device_budget_bytes="auto").resolved()
    with pytest.raises(ConfigError, match="^host_budget_bytes: cannot read 'plenty'"):  # (the user's own, as before)
        StoreConfig(host_budget_bytes="plenty", device="cpu", device_budget_bytes=0).resolved()


def test_an_export_of_a_bf16_model_says_its_weights_are_fp32(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tiered_offload import Engine
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4)
    model = transformers.LlamaForCausalLM(config)
    model.config.torch_dtype = "bfloat16"  # what a bf16 checkpoint's config says
    with Engine(model, torch.optim.AdamW, dict(lr=1e-3), storage=tmp_path / "s", host_memory=1 << 22) as engine:
        engine.export_safetensors(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {saved.get(k) for k in ("torch_dtype", "dtype")} - {None} == {"float32"}
    assert transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.float32
    assert cli_main(["export", str(tmp_path / "s"), str(tmp_path / "out2")]) == 0
    saved = json.loads((tmp_path / "out2" / "config.json").read_text())
    assert {saved.get(k) for k in ("torch_dtype", "dtype")} - {None} == {"float32"}


def test_a_lock_a_dead_parent_left_to_its_child_says_so(tmp_path):
    from tiered_offload.checkpoint.durable import DirectoryLock
    script = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from tiered_offload.checkpoint.durable import DirectoryLock
DirectoryLock(Path({str(tmp_path / STATE_DIR)!r})).acquire()
if os.fork() == 0:   # the child inherits the locked descriptor and outlives its parent
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
"""
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(run.stdout.readline())
    run.wait(timeout=60)
    try:
        with pytest.raises(StorageLockedError, match="which has exited"):
            DirectoryLock(tmp_path / STATE_DIR).acquire()
    finally:
        os.kill(child, 9)


def test_a_damaged_last_record_whose_unit_was_rewritten_is_refused_and_nothing_deleted(tmp_path, monkeypatch):
    """A flipped bit in the last journal line looks like an append cut short. But when that line was
    a unit record, the unit's old files are already gone: the resume must refuse (naming what is
    missing), not delete the unit's new files and fail later."""
    _cut_short_in_step_3(tmp_path / "s", monkeypatch)
    journal = tmp_path / "s" / STATE_DIR / "journal.jsonl"
    lines = journal.read_bytes().split(b"\n")
    damaged = bytearray(lines[2])  # the second unit record, the last line
    damaged[len(damaged) // 2] ^= 0x10
    lines[2] = bytes(damaged)
    journal.write_bytes(b"\n".join(lines))
    before = extents(tmp_path / "s")
    with pytest.raises(CorruptionError, match="needs .* file"):
        make_engine(tmp_path / "s", resume=True)
    assert extents(tmp_path / "s") == before


# ---- the crash loop with flipped bits ----------------------------------------------------------------------------
def test_kill_loop_with_flipped_bits_resumes_bitwise_or_refuses_typed(tmp_path, zygote):
    """SIGKILL, then one flipped bit in the journal or a committed extent: the next start resumes
    bitwise or refuses with a typed error naming the file, and deletes no committed file."""
    sys.path.insert(0, str(ROOT / "tools"))
    from crash_loop import crash_loop
    summary = crash_loop(tmp_path, kills=4, steps=5, layers=4, seed=11, log=lambda *_: None, zygote=zygote,
                         flip_bits=1.0)
    flips = summary["bit_flips"]
    assert summary["identical"] and not flips["bad"], summary
    assert flips["flipped"] >= 1 and flips["refused_typed"] + flips["resumed_bitwise"] == flips["flipped"], summary


def test_an_unknown_storage_option_is_a_typed_error_naming_it(tmp_path):
    from offload_core.errors import ConfigError
    with pytest.raises(ConfigError, match="no option 'bogus'.*threads"):
        make_engine(f"posix:{tmp_path / 's'}?bogus=1")


@pytest.mark.parametrize("storage, match", [
    ("posix:{d}?threads=abc", "threads must be an integer >= 1, got 'abc'"),
    ("posix:{d}?threads=2.5", "threads must be an integer >= 1, got 2.5"),
    (["{d}", 5], r"storage directory 5 \(int\)"),
    (["{d}", None], r"storage directory None \(NoneType\)"),
    (["{d}", b"/x"], r"storage directory b'/x' \(bytes\)"),
    ("path {d}/run,1", "holds a comma"),
    (["{d}/a", "{d}/run,1"], "holds a comma"),
    ("{d}/lr=1e-4,bs=32", "names 2 striped directories .* some absolute and some relative"),
    ("posix:{d}/a,b?threads=2", "names 2 striped directories .* some absolute and some relative")])
def test_a_storage_option_or_directory_of_the_wrong_kind_is_a_typed_error_naming_it(tmp_path, storage, match,
                                                                                     monkeypatch):
    """threads=abc was an untyped ValueError from int(), a list with a number in it a TypeError from Path(); a
    pathlib.Path whose name holds a comma (the escape the docs give for a colon) trained in two directories. So
    did a string naming one (``/data/lr=1e-4,bs=32``: ``/data/lr=1e-4`` and ``./bs=32``, striped)."""
    from offload_core.errors import ConfigError
    d = tmp_path / "s"
    storage = storage.format(d=d) if isinstance(storage, str) else [s.format(d=d) if isinstance(s, str) else s
                                                                    for s in storage]
    if isinstance(storage, str) and storage.startswith("path "):  # (a comma in a path: split into two, silently)
        storage = Path(storage.removeprefix("path "))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        make_engine(storage)
    assert not any((tmp_path / name).exists() for name in ("bs=32", "b", "1"))  # (nothing made where it ran)


def test_a_storage_string_striped_over_relative_directories_says_so(caplog):
    """``runs/lr=1e-4,bs=32`` may be two relative stripes or one directory named with a comma: a warning says it is
    taken for stripes, naming them; stripes given as absolute paths (or a list) stripe without one."""
    import logging

    from storage_backends import resolve_storage
    with caplog.at_level(logging.WARNING, logger="storage_backends"):  # (conftest quiets it to errors)
        assert resolve_storage("runs/lr=1e-4,bs=32").location == "runs/lr=1e-4,bs=32"
    assert "stripes over 2 directories relative to the working directory (runs/lr=1e-4, bs=32)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage_backends"):
        resolve_storage("/mnt/a,/mnt/b")
        resolve_storage("posix:~/a,/mnt/b?threads=2")
        resolve_storage(["a", "b"])
    assert caplog.text == ""


def test_the_io_threads_variable_of_the_wrong_kind_is_named(tmp_path, monkeypatch):
    from offload_core.errors import ConfigError
    monkeypatch.setenv("TIERED_OFFLOAD_IO_THREADS", "many")
    with pytest.raises(ConfigError, match="TIERED_OFFLOAD_IO_THREADS.*'many'"):
        make_engine(tmp_path / "s")
