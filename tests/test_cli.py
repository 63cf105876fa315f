"""The command line: bench-io end to end on a small size, profiles, errors."""

import json
import re
import subprocess
import sys

import pytest

from tiered_offload import TieredStore
from tiered_offload.cli import main
from tiered_offload.profile import load_profile, tuned_options


def test_bench_io_small_run_writes_json_plot_and_profile(tmp_path, capsys, monkeypatch):
    prof = tmp_path / "profile.json"
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", str(prof))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench-io", "--path", str(tmp_path / "disk"), "--size", "8MiB", "--request-sizes", "1MiB,2MiB",
               "--threads", "1,2", "--json", str(out_json), "--plot", str(out_png), "--save-profile", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "page cache:" in text and "posix-direct" in text
    report = json.loads(out_json.read_text())
    assert report["results"] and all(r["verified"] for r in report["results"])
    assert all(r["read_GBps"] > 0 and r["write_GBps"] > 0 for r in report["results"])
    modes = {r["backend"] for r in report["results"]}
    assert {"posix-direct", "posix-buffered", "aiofiles"} <= modes
    assert any("kvikio" in n for n in report["notes"]) or "kvikio" in modes
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the saved profile tunes a store on the same file system
    assert load_profile(prof)["filesystems"]
    opts = tuned_options(tmp_path / "elsewhere")
    rec = report["recommended"]["options"]  # (direct I/O measured best: "where the file system has it")
    assert opts == rec | ({"direct": "auto"} if rec.get("direct") is True else {})
    store = TieredStore(f"posix:{tmp_path / 'run'}", host_budget_bytes="1MiB", device="cpu", device_budget_bytes=0).open()
    assert store.backend.threads == opts["threads"] and store.backend.chunk_bytes == opts["chunk_bytes"]
    store.close()


def test_bench_io_measures_the_drives_of_a_striped_store_together_and_the_store_uses_it(tmp_path, capsys,
                                                                                         monkeypatch):
    """A store striped over several drives: ``--path`` given once per directory measures each alone,
    then all together through one backend striped as the store stripes (a shared controller or
    link takes its share there, which ``n`` x the least drive's rate cannot see; the thread
    counts tried include the sum of the drives' own). With ``--save-profile`` the set's entry tunes
    a store over those directories (its recommended threads) and gives the plan its rates.
    Before, the drives were measured one at a time only, and such a store took its first drive's
    options."""
    from tiered_offload.engine.plan_monitor import profiled_disk_rates
    prof = tmp_path / "profile.json"
    monkeypatch.setenv("TIERED_OFFLOAD_PROFILE", str(prof))
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    small = ["--size", "4MiB", "--request-sizes", "1MiB", "--threads", "1,2", "--backends", "posix-direct",
             "--no-progress"]
    assert main(["bench-io", "--path", str(a), "--path", str(b), "--plot", str(tmp_path / "p.png"), *small]) == 2
    assert "one --path" in capsys.readouterr().err and not a.exists()  # refused before measuring
    out_json = tmp_path / "r.json"
    assert main(["bench-io", "--path", str(a), "--path", str(b), "--json", str(out_json), "--save-profile",
                 *small]) == 0
    text = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert [r["path"] for r in data["reports"]] == [str(a), str(b)]
    assert f"bench-io: 4.00 MiB per test in {a}" in text and f"bench-io: 4.00 MiB per test in {b}" in text
    assert "on one file system" in text  # (tmp_path: both on it)
    together = data["striped"]
    assert together["directories"] == [str(a), str(b)] and together["size_bytes"] == 8 << 20
    own = sum(r["recommended"]["options"]["threads"] for r in data["reports"])
    assert sorted({r["threads"] for r in together["results"]}) == sorted({1, 2, own})
    assert all(r["verified"] for r in together["results"])
    rec = together["recommended"]
    assert rec["options"]["threads"] in {1, 2, own} and rec["backend"] == "posix"
    assert "measured together, 8.00 MiB per test" in text and "saved profile for the striped set" in text
    assert load_profile(prof)["striped"]  # (the entry, beside each directory's own)
    with TieredStore([str(a), str(b)], host_budget_bytes=1 << 20) as store:
        rates = profiled_disk_rates(store)
        assert store.backend.threads == rec["options"]["threads"]  # the set's options, not the first drive's
    assert (rates.read_Bps, rates.write_Bps) == (rec["read_GBps"] * 1e9, rec["write_GBps"] * 1e9)
    assert "measured striped together" in rates.source
    said = re.search(r"recommended for the striped store: .*\(read ([0-9.]+) GB/s, write ([0-9.]+) GB/s", text)
    assert said and (float(said[1]), float(said[2])) == (round(rec["read_GBps"], 2), round(rec["write_GBps"], 2))
    with TieredStore([str(b), str(a)], host_budget_bytes=1 << 20) as store:  # (the same file systems: its entry)
        assert profiled_disk_rates(store) == rates
    with TieredStore(str(a), host_budget_bytes=1 << 20) as store:  # one of them alone: its own entry
        assert profiled_disk_rates(store).read_Bps == data["reports"][1]["recommended"]["read_GBps"] * 1e9


def test_a_striped_set_whose_drives_recommend_different_modes_is_measured_in_each_it_can_run(tmp_path, monkeypatch):
    """A disk's recommendation is O_DIRECT and a tmpfs's buffered I/O: the set was measured only
    buffered (the mode they shared, as any buffered one made the whole set buffered), though with
    O_DIRECT it may be the faster. It is now measured in both, and the better is recommended; in
    the shared mode alone where the recommendations agree, and buffered alone where a directory
    cannot take O_DIRECT (the backend's direct I/O is the whole set's)."""
    import tiered_offload.bench_io as bench_io
    from tiered_offload.bench_io import BenchConfig, BenchResult, run_bench_striped
    a, b = tmp_path / "disk", tmp_path / "tmpfs"
    a.mkdir(), b.mkdir()
    lacks = {"dir": None}
    monkeypatch.setattr(bench_io, "probe_direct_io", lambda d: "EINVAL" if str(d) == lacks["dir"] else None)
    measured = []

    def fake_plan(plan, location, size, progress, weights=None):  # O_DIRECT the faster together
        measured.extend(plan)
        return [BenchResult(mode, req, t, 2.0 if mode == "posix-direct" else 1.0, 2.0, True, "-")
                for mode, req, t in plan]
    monkeypatch.setattr(bench_io, "_measure_plan", fake_plan)

    def report(path, direct):
        return {"path": str(path), "filesystem": {"st_dev": hash(str(path))},
                "recommended": {"backend": "posix", "options": {"threads": 2, "direct": direct}, "read_GBps": 1.0,
                                "write_GBps": 1.0}}
    cfg = BenchConfig(size_bytes=1 << 20, request_sizes=(1 << 20,), thread_counts=(1,))

    def modes(direct_a, direct_b):
        measured.clear()
        out = run_bench_striped(cfg, [report(a, direct_a), report(b, direct_b)], progress=False)
        return sorted({m for m, _, _ in measured}), out["recommended"]["options"]["direct"]
    assert modes(True, False) == (["posix-buffered", "posix-direct"], True)
    assert modes(False, False) == (["posix-buffered"], False) and modes(True, True) == (["posix-direct"], True)
    lacks["dir"] = str(b)
    assert modes(True, False) == (["posix-buffered"], False)


def test_bench_io_says_when_one_drive_alone_is_faster_than_the_striped_set(capsys):
    """Stripes are even, so a set runs at ``n`` x about its slowest drive's rate: an NVMe drive
    striped with a SATA one is slower than the NVMe alone. The striped measurement says so, naming
    the faster drive, and says nothing where the set is the faster."""
    from types import SimpleNamespace

    from tiered_offload.bench_io import _say_striped

    def report(path, read, write):
        return {"path": path, "filesystem": {"st_dev": hash(path)}, "recommended": {"read_GBps": read,
                                                                                   "write_GBps": write}}
    reports = [report("/mnt/nvme", 7.0, 6.0), report("/mnt/sata", 0.5, 0.45)]
    striped = {"results": [], "size_bytes": 1 << 30, "one_at_a_time": {"read_GBps": 1.0, "write_GBps": 0.9},
               "recommended": {"backend": "posix", "options": {"threads": 8}, "read_GBps": 1.0, "write_GBps": 0.9}}
    _say_striped(striped, reports, SimpleNamespace(save_profile=None))
    said = capsys.readouterr().out
    assert "note: /mnt/nvme alone (read 7.00 GB/s, write 6.00 GB/s) is faster than the set" in said, said
    reports[1] = report("/mnt/nvme1", 6.5, 5.5)
    striped["recommended"] |= {"read_GBps": 13.0, "write_GBps": 11.0}
    _say_striped(striped, reports, SimpleNamespace(save_profile=None))
    assert "faster than the set" not in capsys.readouterr().out


def test_bench_io_advises_stripe_weights_for_drives_of_unequal_speed_and_the_plan_takes_their_rates(
        tmp_path, capsys, monkeypatch):
    """With even stripes an NVMe drive striped with one half as fast runs at twice the slower's
    rate; by weight (2:1) at the sum of both. bench-io advises the weights (the plan's rule, small
    integers), measures the set by them, prints the storage spec that takes them, and saves the
    measurement: a store given those weights is planned at it, one with even stripes at the even
    measurement, one with other weights by the rule."""
    from types import SimpleNamespace

    import tiered_offload.profile as profile
    from tiered_offload.bench_io import _say_striped, advised_weights
    assert advised_weights([(1, 7.0, 6.0), (2, 3.5, 3.0)]) == [2, 1]
    assert advised_weights([(1, 7.0, 6.0), (2, 7.0, 6.0)]) is None  # (equal drives: even)
    assert advised_weights([(1, 7.0, 6.0), (1, 7.0, 6.0)]) is None  # (one drive: shared, whatever the weights)
    assert advised_weights([(1, 6.0, 6.0), (2, 2.0, 2.0), (3, 4.0, 4.0)]) == [3, 1, 2]
    a, b = tmp_path / "nvme", tmp_path / "sata"
    fss = [{"st_dev": 101, "mount_point": str(a)}, {"st_dev": 102, "mount_point": str(b)}]
    reports = [{"path": str(d), "filesystem": fs, "recommended": {"read_GBps": r, "write_GBps": w}}
               for d, fs, (r, w) in zip((a, b), fss, ((7.0, 6.0), (3.5, 3.0)))]
    striped = {"tool": "tiered-offload bench-io", "directories": [str(a), str(b)], "filesystems": fss, "results": [],
               "size_bytes": 1 << 30, "one_at_a_time": {"read_GBps": 7.0, "write_GBps": 6.0},
               "recommended": {"backend": "posix", "options": {"threads": 8}, "read_GBps": 6.8, "write_GBps": 5.9},
               "weighted": {"stripe_weights": [2, 1], "read_GBps": 10.1, "write_GBps": 8.7, "verified": True,
                            "rule": {"read_GBps": 10.5, "write_GBps": 9.0}}}
    where = tmp_path / "profile.json"
    _say_striped(striped, reports, SimpleNamespace(save_profile=str(where)))
    said = capsys.readouterr().out
    assert f'storage="posix:{a},{b}?stripe_weights=2:1"' in said and "read 10.10 GB/s, write 8.70 GB/s" in said
    assert "faster than the set" not in said  # (by weight the set beats the NVMe alone)
    wrong = {**striped, "weighted": {**striped["weighted"], "verified": False}}
    _say_striped(wrong, reports, SimpleNamespace(save_profile=None))
    said = capsys.readouterr().out
    assert "bytes read back differed from those written; not advised" in said and "stripe_weights=2:1" not in said

    import tiered_offload.engine.plan_monitor as plan_monitor
    def fs(path):
        return next(f for f in fss if str(path).startswith(f["mount_point"]))
    for module in (profile, plan_monitor):
        monkeypatch.setattr(module, "filesystem_id", fs)
    for d, fs, (r, w) in zip((a, b), fss, ((7.0, 6.0), (3.5, 3.0))):
        profile.save_profile({"filesystem": fs, "recommended": {"options": {}, "read_GBps": r, "write_GBps": w}}, where)

    def rates(weights):
        spec = f"posix:{a},{b}" + (f"?stripe_weights={weights}" if weights else "")
        with TieredStore(spec, host_budget_bytes=1 << 20, io_profile=str(where)) as store:
            got = plan_monitor.profiled_disk_rates(store)
            return got.read_Bps / 1e9, got.write_Bps / 1e9, got.source
    assert rates("2:1")[:2] == (10.1, 8.7) and "measured striped together by weights 2:1" in rates("2:1")[2]
    assert rates(None)[:2] == (6.8, 5.9)
    assert rates("1:2")[:2] == (pytest.approx(3.5 * 3 / 2), pytest.approx(3.0 * 3 / 2))  # (the rule)

def test_bench_io_bad_path_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc = main(["bench-io", "--path", str(f / "sub"), "--size", "1MiB", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(f) in err and "error" in err


@pytest.mark.parametrize("args, match", [
    (["--request-sizes", "0"], r"--request-sizes: 0 B is not a positive multiple of 4\.00 KiB"),
    (["--request-sizes", "1MiB,3000"], r"--request-sizes: 2\.93 KiB is not a positive multiple of 4\.00 KiB"),
    (["--threads", "0"], r"--threads: 0 is not an integer >= 1"),
    (["--threads", "4,lots"], r"--threads: 'lots' is not an integer >= 1"),
    (["--backends", "nope"], r"--backends: unknown mode 'nope'; the modes are posix-direct, posix-buffered, "
                             r"aiofiles, kvikio"),
    (["--backends", "kvikio"], r"no mode of --backends can run here: kvikio skipped"),
    (["--path", "FILE"], r"benchmark path .*file is a file, not a directory"),
], ids=["request 0", "request not a multiple", "threads 0", "threads not a number", "unknown mode", "none runs",
        "a file"])
def test_bench_io_bad_arguments_are_refused_before_measuring(tmp_path, capsys, args, match):
    """Before: ``--request-sizes 0`` was an untyped ``ValueError`` (``range() arg 3``); ``--threads 0``
    measured and recommended 0 threads (a profile the store then refuses); ``--threads lots`` an
    untyped ``ValueError``; an unknown ``--backends`` mode, or none that can run here, ended after
    the measuring with "the storage returned wrong bytes" (an untyped ``RuntimeError``); a file as
    ``--path`` was "File exists". Each is refused before anything is measured, naming the flag."""
    pytest.importorskip("tqdm")
    if args[0] == "--path":
        (tmp_path / "file").write_text("x")
        args = ["--path", str(tmp_path / "file")]
    elif args[:2] == ["--backends", "kvikio"]:
        from storage_backends.kvikio_backend import kvikio_status
        if kvikio_status() is None:
            pytest.skip("kvikio runs here: a mode that cannot run needs a machine without it")
    rc = main(["bench-io", "--size", "1MiB", "--no-progress", *args, *(["--path", str(tmp_path / "b")]
                                                                        if "--path" not in args else [])])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err), err
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


@pytest.mark.parametrize("second, match", [
    ("a/", r"--path .*/a and --path .*/a/ are one directory"),
    ("link", r"--path .*/a and --path .*/link are one directory"),
    ("file", r"benchmark path .*/file is a file, not a directory"),
], ids=["the same twice", "a link to the first", "a file second"])
def test_bench_io_paths_a_striped_store_cannot_use_are_refused_before_any_is_measured(tmp_path, capsys, second,
                                                                                     match):
    """With several ``--path``, a directory given twice (spelt another way, or through a link) was
    measured twice, then refused by the backend opened over both ("given twice"); a file given
    second was refused only once the first directory had been measured. Each is refused before
    anything is measured."""
    (tmp_path / "a").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "a", target_is_directory=True)
    rc = main(["bench-io", "--size", "1MiB", "--no-progress", "--request-sizes", "1MiB", "--threads", "1",
               "--path", str(tmp_path / "a"), "--path", f"{tmp_path}/{second}"])
    out, err = capsys.readouterr()
    assert rc == 2 and re.search(match, err), err
    assert "per test in" not in out and not any((tmp_path / "a").iterdir()), out  # nothing measured


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_a_state_command_on_a_file_is_a_clear_error(tmp_path, capsys, command):
    """``inspect FILE`` (a file given for the storage directory): a ``NotADirectoryError``
    traceback from a ``stat`` under it. Now the command's error line, naming it, exit 2."""
    f = tmp_path / "file"
    f.write_text("x")
    rc = main([command, str(f)] + ([str(tmp_path / "out")] if command == "export" else []))
    err = capsys.readouterr().err
    assert rc == 2 and f"{f} holds no training state" in err and "Traceback" not in err, err


def test_bench_io_refuses_more_than_the_free_space(tmp_path, capsys):
    rc = main(["bench-io", "--path", str(tmp_path), "--size", "100TiB", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "free" in err and "--size" in err and str(tmp_path) in err



def test_bench_io_refuses_drives_measured_together_that_their_free_space_cannot_hold(tmp_path, capsys, monkeypatch):
    """Measured together, the drives hold ``--size`` each at once, and directories on one file
    system share its free space: a size each fits alone, but not together, is refused before
    anything is measured (not after each drive's minutes of measuring)."""
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=6 << 20))
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    rc = main(["bench-io", "--path", str(a), "--path", str(b), "--size", "4MiB", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "8.00 MiB" in err and f"{a}, {b}" in err and "--size" in err, err
    assert not a.exists() and not b.exists()


def test_corrupt_profile_names_the_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{not json")
    from offload_core.errors import ProfileError
    with pytest.raises(ProfileError) as info:
        load_profile(p)
    assert str(p) in str(info.value)


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "tiered_offload", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench-io" in r.stdout


def test_demo_with_a_storage_directory_resumes_where_it_stopped(tmp_path):
    from tiered_offload_examples.demo import run_demo
    small = dict(d_model=32, layers=2, heads=2, context=16, batch=2, progress=False, host_memory="320KiB")
    whole = run_demo(steps=5, storage=str(tmp_path / "whole"), **small)
    first = run_demo(steps=3, storage=str(tmp_path / "parts"), **small)
    second = run_demo(steps=5, storage=str(tmp_path / "parts"), **small)
    assert (first["first_step"], first["steps"]) == (0, 3)
    assert (second["first_step"], second["steps"]) == (3, 2)
    assert second["loss_last"] == whole["loss_last"]  # step 5 is the same step, resumed or not
    assert main(["inspect", str(tmp_path / "parts")]) == 0


@pytest.mark.parametrize("args, match", [
    (["--batch", "0"], r"--batch must be an integer >= 1, got 0"),
    (["--layers", "1"], r"--layers must be an integer >= 2 \(the engine streams the blocks\), got 1"),
    (["--heads", "5"], r"--heads 5 does not divide --d-model 384"),
    (["--context", "1"], r"--context must be an integer >= 2"),
    (["--steps", "-1"], r"--steps must be an integer >= 0, got -1"),
    (["--lr", "inf"], r"--lr must be a finite number > 0, got inf"),
    (["--d-model", "0"], r"--d-model must be an integer >= 1, got 0"),
], ids=["batch", "layers", "heads", "context", "steps", "lr", "d-model"])
def test_demo_bad_arguments_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch, args, match):
    """``--batch 0`` was an untyped ``RuntimeError`` (``stack expects a non-empty TensorList``);
    ``--layers 1`` "GPT has no block sequence ... pass blocks="; ``--heads 5`` a shape error from
    the model's forward; ``--context 1`` "the loss is nan". Each is refused before the model is
    built, naming the flag."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not list(tmp_path.iterdir())  # (nothing made)


def test_bench_io_plot_without_matplotlib_fails_before_measuring(tmp_path, capsys, monkeypatch):
    import tiered_offload.bench_io as bench_io
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    measured = []
    monkeypatch.setattr(bench_io, "run_bench_io", lambda *a, **k: measured.append(1))
    rc = main(["bench-io", "--path", str(tmp_path / "d"), "--size", "1MiB", "--plot", str(tmp_path / "p.png"),
               "--no-progress"])
    assert rc == 2 and not measured
    assert "pip install 'tiered-offload[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--plot", "--save-profile"])
@pytest.mark.parametrize("where", ["under a file", "a directory"])
def test_bench_io_output_it_cannot_write_is_refused_before_measuring(tmp_path, capsys, monkeypatch, flag, where):
    """--json to a path under a file (or in no directory), --save-profile there or onto a directory: an untyped
    FileNotFoundError / FileExistsError after the whole measurement, its results lost."""
    import tiered_offload.bench_io as bench_io
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    target = tmp_path / "file" / "out.json" if where == "under a file" else tmp_path / "dir"
    measured = []
    monkeypatch.setattr(bench_io, "run_bench_io", lambda *a, **k: measured.append(1))
    rc = main(["bench-io", "--path", str(tmp_path / "d"), "--size", "1MiB", flag, str(target), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and not measured, err
    assert f"{flag} {target}" in err and "nothing was measured" in err, err


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_host_budget_auto_honours_the_container_memory_limit(tmp_path, version, monkeypatch):
    from tiered_offload import memstat
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    if version == "v2":
        (root / "job").mkdir(parents=True)
        (root / "job" / "memory.max").write_text(f"{2 << 30}\n")
        (root / "job" / "memory.current").write_text(f"{512 << 20}\n")
        proc.write_text("0::/job\n")
    else:
        (root / "memory" / "job").mkdir(parents=True)
        (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
        (root / "memory" / "job" / "memory.usage_in_bytes").write_text(f"{512 << 20}\n")
        proc.write_text("4:memory:/job\n0::/\n")
    assert memstat.cgroup_memory(str(root), str(proc)) == (2 << 30, 512 << 20)
    real = memstat.cgroup_memory
    monkeypatch.setattr(memstat, "cgroup_memory", lambda *_: real(str(root), str(proc)))
    monkeypatch.delenv("TIERED_OFFLOAD_HOST_BUDGET", raising=False)
    from tiered_offload import StoreConfig
    cfg = StoreConfig(host_budget_bytes="auto", device="cpu", device_budget_bytes=0).resolved()
    assert cfg.host_budget_bytes == min(memstat.psutil.virtual_memory().available, (2 << 30) - (512 << 20)) // 4
    (root / ("job" if version == "v2" else "memory/job") / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(
        "max\n" if version == "v2" else "9223372036854771712\n")
    assert real(str(root), str(proc)) is None  # no limit
