"""``tiered-offload bench-io``: measure a directory's sequential throughput and tune the engine.

For each available backend and mode (posix with O_DIRECT, posix buffered, aiofiles, kvikio where
it can run) x request size x thread count, it writes a test file of ``--size`` bytes (timed up to
a completed ``fsync``, so buffered writes cannot hide in the page cache), evicts it from the page
cache where it could be cached, reads it back (timed), and verifies every byte. The best
configuration is recommended and can be saved as the profile the store loads.

Honesty about caches: O_DIRECT modes bypass the page cache by construction. For buffered modes
the file is dropped from the cache before reading, by ``/proc/sys/vm/drop_caches`` where this
process may write it, else by ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the test file; the
report says which was used.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from offload_core.buffers import aligned_empty
from offload_core.errors import ConfigError, StorageDirectoryError
from offload_core.sizes import format_size, parse_size
from storage_backends import auto_choice, get_backend_class
from storage_backends._files import striped_free
from storage_backends.kvikio_backend import kvikio_status
from storage_backends.posix import probe_direct_io
from tiered_offload.checkpoint.lock import kind_of
from tiered_offload.profile import default_profile_path, filesystem_id, save_profile, striped_rates

__all__ = ["BenchConfig", "BenchResult", "run_bench_io", "drop_page_cache"]

GB = 1e9


MODES = ("posix-direct", "posix-buffered", "aiofiles", "kvikio")
"""The modes ``--backends`` names."""
PAGE = 4096


@dataclass(kw_only=True)
class BenchConfig:
    """What ``bench-io`` measures."""

    path: str | None = None
    """Directory to test; None: a temporary directory under the current directory (same file system)."""
    size_bytes: int = 512 << 20
    """Size of the test file: large enough to exceed the drive's own cache."""
    request_sizes: tuple[int, ...] = (1 << 20, 4 << 20, 16 << 20)
    """Request (chunk) sizes to try."""
    thread_counts: tuple[int, ...] = (1, 4, 8)
    """I/O thread counts to try."""
    backends: tuple[str, ...] = MODES
    """Backend modes to try; unavailable ones are reported and skipped."""

    def validate(self) -> "BenchConfig":
        """Refuse what cannot be measured, before anything is: a :class:`ConfigError` naming the flag."""
        for r in self.request_sizes:
            if r <= 0 or r % PAGE:
                raise ConfigError(f"--request-sizes: {format_size(r)} is not a positive multiple of "
                                  f"{format_size(PAGE)} (the unit of direct I/O)")
        for t in self.thread_counts:
            if not isinstance(t, int) or t < 1:
                raise ConfigError(f"--threads: {t!r} is not an integer >= 1")
        for mode in self.backends:
            if mode not in MODES:
                raise ConfigError(f"--backends: unknown mode {mode!r}; the modes are {', '.join(MODES)}")
        if self.size_bytes <= 0:
            raise ConfigError(f"--size: {self.size_bytes} bytes; give a positive size (512MiB)")
        return self


@dataclass
class BenchResult:
    """One configuration's measurement."""

    backend: str
    request_bytes: int
    threads: int
    write_GBps: float
    read_GBps: float
    verified: bool
    cache_defeat: str

    @property
    def score(self) -> float:
        """Harmonic mean of read and write throughput: a training step does both."""
        if self.read_GBps <= 0 or self.write_GBps <= 0:
            return 0.0
        return 2 / (1 / self.read_GBps + 1 / self.write_GBps)


def drop_page_cache(files: list[str]) -> str:
    """Evict ``files`` from the page cache; returns how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped the system page cache (/proc/sys/vm/drop_caches)"
    except OSError:
        pass
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(POSIX_FADV_DONTNEED) on the test file (drop_caches not permitted)"


def _plan(cfg: BenchConfig, directory: Path) -> tuple[list[tuple[str, int, int]], list[str]]:
    """The configurations to run and the notes on modes that cannot run here."""
    notes, modes = [], []
    for mode in cfg.backends:
        if mode == "posix-direct":
            reason = probe_direct_io(directory)
            if reason:
                notes.append(f"posix-direct skipped: {reason}")
                continue
        elif mode == "kvikio":
            reason = kvikio_status()
            if reason:
                notes.append(f"kvikio skipped: {reason}")
                continue
        modes.append(mode)
    plan = []
    for mode in modes:
        threads = (1,) if mode == "aiofiles" else cfg.thread_counts
        for req in cfg.request_sizes:
            for t in threads:
                plan.append((mode, req, t))
    return plan, notes


def _make_backend(mode: str, directory: Path, request: int, threads: int, weights=None):
    striped = {"stripe_weights": weights} if weights else {}
    if mode == "posix-direct":
        return get_backend_class("posix")(directory, threads=threads, chunk_bytes=request, direct=True, **striped)
    if mode == "posix-buffered":
        return get_backend_class("posix")(directory, threads=threads, chunk_bytes=request, direct=False, **striped)
    if mode == "aiofiles":
        return get_backend_class("aiofiles")(directory, chunk_bytes=request)
    return get_backend_class("kvikio")(directory, threads=threads, chunk_bytes=request, **striped)


def _measure(mode: str, directory: Path, request: int, threads: int, src: torch.Tensor, dst: torch.Tensor,
             weights=None) -> BenchResult:
    backend = _make_backend(mode, directory, request, threads, weights).open()
    key = f"bench-{mode}-{request}-{threads}"
    try:
        dst.zero_()
        t0 = time.perf_counter()
        backend.write_from(key, src).get()
        backend.flush()
        write_s = time.perf_counter() - t0
        files = [backend.describe(key)] if mode == "aiofiles" else backend._paths(key)
        cache = "O_DIRECT (page cache bypassed)" if mode == "posix-direct" else drop_page_cache(files)
        if mode == "kvikio":
            cache = "GPUDirect Storage" if backend.gds_active else "kvikio compat mode; " + cache
        t0 = time.perf_counter()
        backend.read_into(key, dst).get()
        if dst.device.type == "cuda":
            torch.cuda.synchronize()
        read_s = time.perf_counter() - t0
        verified = bool(torch.equal(src, dst))
        backend.delete(key)
    finally:
        backend.close()
    n = src.numel()
    return BenchResult(mode, request, threads, n / write_s / GB, n / read_s / GB, verified, cache)


def _check_directory(directory: Path) -> None:
    """Refuse a ``--path`` that is something other than a directory (or nothing yet)."""
    if os.path.lexists(directory) and not directory.is_dir():
        what = "a file" if directory.is_file() else kind_of(os.lstat(directory).st_mode)
        raise StorageDirectoryError(errno.ENOTDIR, f"benchmark path {directory} is {what}, not a directory; pass "
                                                   f"--path a directory (new or existing) on the disk to measure")


def _check_paths(paths: list[str]) -> None:
    """Refuse, before anything is measured, a ``--path`` that is no directory, and one directory
    given twice (spelt another way, or through a link): a store striped over both would write
    each stripe over another (the backend refuses it)."""
    seen: dict[str, str] = {}
    for p in paths:
        directory = Path(p).expanduser().absolute()
        _check_directory(directory)
        first = seen.setdefault(os.path.realpath(directory), p)
        if first is not p:
            raise ConfigError(f"--path {first} and --path {p} are one directory; give each drive's directory once "
                              f"(nothing was measured)")


def _check_free(need: int, free: int, where) -> None:
    """Refuse a test file of ``need`` bytes that ``free`` bytes (with a tenth to spare) cannot hold."""
    if need > free * 0.9:
        from offload_core.errors import DiskFullError
        raise DiskFullError(f"bench-io needs {format_size(need)} in {where} but only {format_size(free)} is free; pass "
                            f"a smaller --size", path=str(where), needed_bytes=need, free_bytes=free)


def _measure_plan(plan: list[tuple[str, int, int]], location, size: int, progress: bool,
                  weights=None) -> list[BenchResult]:
    """Measure each ``(mode, request, threads)`` of ``plan`` on ``location`` (a directory, or a list
    of them: striped, by ``weights`` where given), a test file of ``size`` bytes each."""
    host_src = aligned_empty(size)
    g = torch.Generator().manual_seed(1234)
    host_src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    host_dst = aligned_empty(size)
    results: list[BenchResult] = []
    from tqdm import tqdm
    bar = tqdm(plan, desc="bench-io", unit="cfg", disable=not progress, leave=False)
    for mode, req, threads in bar:
        bar.set_postfix_str(f"{mode} {format_size(req)} x{threads}")
        if mode == "kvikio":
            src, dst = host_src.to("cuda"), torch.empty(size, dtype=torch.uint8, device="cuda")
        else:
            src, dst = host_src, host_dst
        results.append(_measure(mode, location, req, threads, src, dst, weights))
    bar.close()
    return results


def run_bench_striped(cfg: BenchConfig, reports: list[dict], *, progress: bool = True) -> dict:
    """Measure the directories of ``reports`` (each one's :func:`run_bench_io`, in order) together,
    striped as a store over them stripes them (one backend over all, ``--size`` a directory), in the
    mode their recommendations share (in each where they differ: :func:`_striped_modes`), at each
    request size and thread count of ``cfg`` and at the sum of their recommended thread counts;
    return the report of the set (``--save-profile`` saves it as the striped set's entry: the store
    over them is tuned and planned by it)."""
    recs = [r["recommended"] for r in reports]
    if any(r["backend"] == "aiofiles" for r in recs):
        return {"skipped": "aiofiles was recommended for a directory, and it stores one directory (striping is a "
                           "posix backend feature)"}
    directories = [Path(r["path"]) for r in reports]
    modes = _striped_modes(recs, directories)
    threads = sorted(set(cfg.thread_counts) | {sum(r["options"].get("threads", 1) for r in recs)})
    plan = [(mode, req, t) for mode in modes for req in cfg.request_sizes for t in threads]
    size = cfg.size_bytes * len(directories)
    _check_free(size, striped_free(directories), ", ".join(map(str, directories)))
    results = _measure_plan(plan, directories, size, progress)
    best = recommend(results)
    drives = [(r["filesystem"]["st_dev"], rec["read_GBps"], rec["write_GBps"]) for r, rec in zip(reports, recs)]
    rule = striped_rates(drives)
    weights = advised_weights(drives)
    weighted = None
    if weights:  # the even set's best settings again, each drive taking its share of the stripes
        [by_weight] = _measure_plan([(best.backend, best.request_bytes, best.threads)], directories, size, progress,
                                    weights)
        weighted = {"stripe_weights": weights, "read_GBps": by_weight.read_GBps, "write_GBps": by_weight.write_GBps,
                    "verified": by_weight.verified, "rule": dict(zip(("read_GBps", "write_GBps"),
                                                                     striped_rates(drives, weights)))}
    return {
        "tool": "tiered-offload bench-io",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "directories": [str(d) for d in directories],
        "filesystems": [r["filesystem"] for r in reports],
        "size_bytes": size,
        "results": [dataclasses.asdict(r) | {"score_GBps": r.score} for r in results],
        "one_at_a_time": {"read_GBps": rule[0], "write_GBps": rule[1]},
        **({"weighted": weighted} if weighted else {}),
        "recommended": {"backend": "kvikio" if best.backend == "kvikio" else "posix", "options": _options_for(best),
                        "read_GBps": best.read_GBps, "write_GBps": best.write_GBps},
    }


def _striped_modes(recs: list[dict], directories: list[Path]) -> list[str]:
    """The modes a striped set is measured in: the one its directories' recommendations share; where
    they differ (O_DIRECT on a disk, buffered on a tmpfs), each the set can run in (O_DIRECT only
    where every directory takes it: the backend's direct I/O is the whole set's), as either may be
    the faster together."""
    if all(r["backend"] == "kvikio" for r in recs):
        return ["kvikio"]
    direct = {bool(r["options"].get("direct", True)) for r in recs}  # (kvikio's: the posix path's O_DIRECT)
    if direct == {True}:
        return ["posix-direct"]
    if direct == {False} or any(probe_direct_io(d) for d in directories):
        return ["posix-buffered"]
    return ["posix-direct", "posix-buffered"]


def advised_weights(drives: list[tuple[int, float, float]], most: int = 8) -> list[int] | None:
    """The ``stripe_weights`` (each from 1 to ``most``) under which drives measured alone, each
    ``(file system, read GB/s, write GB/s)``, give a striped set the best harmonic mean of read and
    write rates by the plan's rule (:func:`~tiered_offload.profile.striped_rates`; a later one in
    the order tried, small weights first, must be 1% better); None where even stripes do as well
    (within 1%)."""
    def score(weights):
        return _score(dict(zip(("read_GBps", "write_GBps"), striped_rates(drives, weights))))
    even = score(None)
    best, best_score = None, even
    for weights in itertools.product(range(1, most + 1), repeat=len(drives)) if len(drives) <= 4 else ():
        if math.gcd(*weights) == 1 and (s := score(list(weights))) > best_score * 1.01:
            best, best_score = list(weights), s
    return best


def recommend(results: list[BenchResult]) -> BenchResult:
    """The best verified configuration; among those within 3% of the best, the fewest threads."""
    # kvikio in compatibility mode is never recommended: auto would not pick it (see auto_choice)
    usable = [r for r in results if r.verified and not r.cache_defeat.startswith("kvikio compat")]
    ok = [r for r in usable if r.backend != "aiofiles"] or usable
    if not ok:
        raise RuntimeError("no configuration verified its data: the storage returned wrong bytes")
    best = max(r.score for r in ok)
    near = [r for r in ok if r.score >= 0.97 * best]
    return min(near, key=lambda r: (r.threads, -r.score))


def _options_for(r: BenchResult) -> dict:
    if r.backend.startswith("posix"):
        return {"threads": r.threads, "chunk_bytes": r.request_bytes, "direct": r.backend == "posix-direct"}
    if r.backend == "kvikio":
        return {"threads": r.threads, "chunk_bytes": r.request_bytes}
    return {"chunk_bytes": r.request_bytes}


def format_table(results: list[BenchResult]) -> str:
    """A plain-text table of the results."""
    head = f"{'backend':<15} {'request':>9} {'threads':>7} {'write GB/s':>10} {'read GB/s':>9}  verified"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.backend:<15} {format_size(r.request_bytes):>9} {r.threads:>7} {r.write_GBps:>10.2f} "
                     f"{r.read_GBps:>9.2f}  {'yes' if r.verified else 'NO'}")
    return "\n".join(lines)


def plot(results: list[BenchResult], out: str) -> None:
    """Write a PNG: read and write throughput against request size, a line per backend and thread count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    series: dict[tuple[str, int], list[BenchResult]] = {}
    for r in results:
        series.setdefault((r.backend, r.threads), []).append(r)
    for ax, attr, title in ((axes[0], "read_GBps", "sequential read"), (axes[1], "write_GBps", "sequential write (to fsync)")):
        for (backend, threads), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r.request_bytes)
            ax.plot([r.request_bytes / 2**20 for r in rs], [getattr(r, attr) for r in rs], marker="o",
                    label=f"{backend}, {threads} thr")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (MiB)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_bench_io(cfg: BenchConfig, *, progress: bool = True) -> dict:
    """Run the benchmark; return the report (what ``--json`` writes)."""
    cfg.validate()
    created_tmp = cfg.path is None
    directory = Path(tempfile.mkdtemp(prefix=".tiered-offload-bench-", dir=os.getcwd())) if created_tmp \
        else Path(cfg.path).expanduser().absolute()
    _check_directory(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageDirectoryError(e.errno, f"cannot create benchmark directory {directory}: {e.strerror}") from e
    if not os.access(directory, os.W_OK):
        raise StorageDirectoryError(13, f"benchmark directory {directory} is not writable; pass --path to a writable directory")
    _check_free(cfg.size_bytes, shutil.disk_usage(directory).free, directory)
    plan, notes = _plan(cfg, directory)
    if not plan:
        if created_tmp:
            shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError(f"no mode of --backends can run here: {'; '.join(notes)}; name others "
                          f"({', '.join(MODES)})")
    try:
        results = _measure_plan(plan, directory, cfg.size_bytes, progress)
    finally:
        if created_tmp:
            shutil.rmtree(directory, ignore_errors=True)
    best = recommend(results)
    return {
        "tool": "tiered-offload bench-io",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "path": str(directory),
        "temporary_path": created_tmp,
        "filesystem": filesystem_id(directory if directory.exists() else directory.parent),
        "size_bytes": cfg.size_bytes,
        "notes": notes,
        "auto": dict(zip(("backend", "reason"), auto_choice())),
        "results": [dataclasses.asdict(r) | {"score_GBps": r.score} for r in results],
        "recommended": {
            "backend": "kvikio" if best.backend == "kvikio" else ("aiofiles" if best.backend == "aiofiles" else "posix"),
            "options": _options_for(best),
            "read_GBps": best.read_GBps,
            "write_GBps": best.write_GBps,
        },
    }


def _count(text: str) -> int | str:
    """A ``--threads`` item: its integer, else the text (refused by :meth:`BenchConfig.validate`)."""
    try:
        return int(text)
    except ValueError:
        return text


def _check_output(flag: str, path: str | os.PathLike | None) -> None:
    """Refuse an output file ``flag`` names that cannot be written (a directory there, a file or nothing
    writable above it), before measuring for minutes: after, it was an untyped error and the results lost."""
    if path is None:
        return
    target = Path(path).expanduser()
    above = target.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent  # (--save-profile makes the directories it needs)
    why = ("it is a directory" if target.is_dir() else
           f"{above} is not a directory" if not above.is_dir() else
           f"{above} is not writable by this user" if not os.access(above, os.W_OK | os.X_OK) else None)
    if why is None and flag != "--save-profile" and above != target.parent:
        why = f"{target.parent} does not exist"
    if why:
        raise ConfigError(f"{flag} {target}: cannot write there ({why}); name a file in a directory you can write "
                          f"(nothing was measured)")


def _write_output(flag: str, path, write):
    """Write an output file (``write()``, whose result is returned); a failure (a full disk at the
    end) is typed, naming it and the flag."""
    try:
        return write()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror or e}); the measurement above is complete, "
                          f"but this file was not written") from None


def main(args) -> int:
    """The ``bench-io`` subcommand (arguments parsed by :mod:`tiered_offload.cli`): each ``--path`` in
    turn; with several, then all of them together, striped as a store over them is."""
    paths = args.path or [None]
    if args.plot:  # before measuring for minutes, not after
        if len(paths) > 1:
            print("bench-io: --plot draws one directory's measurements: give one --path with it (nothing was "
                  "measured)", file=sys.stderr)
            return 2
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("bench-io: --plot needs matplotlib, which is not installed: pip install 'tiered-offload[plot]' "
                  "(or drop --plot); nothing was measured", file=sys.stderr)
            return 2
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--save-profile", args.save_profile or None)):
        _check_output(flag, path)
    if len(paths) > 1:  # (measured together: --size in each, on file systems that some may share)
        _check_paths(paths)
        _check_free(len(paths) * parse_size(args.size, what="--size"), striped_free(paths), ", ".join(paths))
    reports, striped = [], None
    for path in paths:
        cfg = BenchConfig(
            path=path,
            size_bytes=parse_size(args.size, what="--size"),
            request_sizes=tuple(parse_size(s, what="--request-sizes") for s in args.request_sizes.split(",")),
            thread_counts=tuple(_count(t) for t in args.threads.split(",")),
            backends=tuple(args.backends.split(",")),
        ).validate()
        reports.append(run_bench_io(cfg, progress=not args.no_progress))
        _say(reports[-1], cfg, args)
    if len(reports) > 1:
        striped = run_bench_striped(cfg, reports, progress=not args.no_progress)
        _say_striped(striped, reports, args)
    if args.json:
        data = reports[0] if striped is None else {"reports": reports, "striped": striped}
        _write_output("--json", args.json, lambda: Path(args.json).write_text(json.dumps(data, indent=2)))
        print(f"wrote {args.json}")
    if args.plot:
        results = [BenchResult(**{k: v for k, v in r.items() if k != "score_GBps"}) for r in reports[0]["results"]]
        _write_output("--plot", args.plot, lambda: plot(results, args.plot))
        print(f"wrote {args.plot}")
    return 0


def _say(report: dict, cfg: BenchConfig, args) -> None:
    """Print one directory's measurements and recommendation; save its profile (``--save-profile``)."""
    results = [BenchResult(**{k: v for k, v in r.items() if k != "score_GBps"}) for r in report["results"]]
    print(f"bench-io: {format_size(cfg.size_bytes)} per test in {report['path']}"
          f"{' (temporary, removed)' if report['temporary_path'] else ''}")
    print(format_table(results))
    for note in report["notes"]:
        print(f"note: {note}")
    caches = sorted({r.cache_defeat for r in results})
    print("page cache: " + "; ".join(caches))
    print(f"auto storage backend here: {report['auto']['backend']} ({report['auto']['reason']})")
    rec = report["recommended"]
    print(f"recommended: {rec['backend']} {json.dumps(rec['options'])}  "
          f"(read {rec['read_GBps']:.2f} GB/s, write {rec['write_GBps']:.2f} GB/s)")
    if args.save_profile is not None:
        where = _write_output("--save-profile", args.save_profile or default_profile_path(),
                              lambda: save_profile(report, args.save_profile or None))
        default = args.save_profile in ("", None) or str(where) == str(default_profile_path())
        how = ("stores on this file system use it" if default else
               f"stores on this file system use it with TIERED_OFFLOAD_PROFILE={where} or "
               f"store_config={{'io_profile': '{where}'}}")
        print(f"saved profile for {report['filesystem']['mount_point']} to {where} ({how})")


def _say_striped(striped: dict, reports: list[dict], args) -> None:
    """Print the directories' measurement together (:func:`run_bench_striped`) against the rates
    of each one alone; save it as the striped set's profile entry (``--save-profile``)."""
    if len({r["filesystem"]["st_dev"] for r in reports}) < len(reports):
        print("note: some of these directories are on one file system: they share its rate")
    dirs = ", ".join(f'"{r["path"]}"' for r in reports)
    if "skipped" in striped:
        print(f"striped over these {len(reports)} directories (storage=[{dirs}]): not measured together: "
              f"{striped['skipped']}")
        return
    results = [BenchResult(**{k: v for k, v in r.items() if k != "score_GBps"}) for r in striped["results"]]
    print(f"bench-io: striped over these {len(reports)} directories (storage=[{dirs}]), measured together, "
          f"{format_size(striped['size_bytes'])} per test")
    print(format_table(results))
    rec, alone = striped["recommended"], striped["one_at_a_time"]
    times = f"{_times(rec['read_GBps'], alone['read_GBps'])} and {_times(rec['write_GBps'], alone['write_GBps'])}"
    print(f"recommended for the striped store: {rec['backend']} {json.dumps(rec['options'])}  (read "
          f"{rec['read_GBps']:.2f} GB/s, write {rec['write_GBps']:.2f} GB/s: {times} what the plan's rule makes of "
          f"the directories measured alone, {alone['read_GBps']:.2f} and {alone['write_GBps']:.2f} GB/s: "
          f"{len(reports)} x the least, directories on one file system sharing its rate)")
    weighted = striped.get("weighted")
    if weighted and not weighted["verified"]:
        print(f"by weight ({':'.join(map(str, weighted['stripe_weights']))}): the bytes read back differed from "
              f"those written; not advised (report it: the storage or the striping returned wrong bytes)")
        weighted = None
    if weighted:
        said = ":".join(map(str, weighted["stripe_weights"]))
        spec = f"posix:{','.join(r['path'] for r in reports)}?stripe_weights={said}"
        print(f"by weight, each drive taking its share of the stripes ({said}; the plan's rule: read "
              f"{weighted['rule']['read_GBps']:.2f}, write {weighted['rule']['write_GBps']:.2f} GB/s), measured with "
              f"the settings above: read {weighted['read_GBps']:.2f} GB/s, write {weighted['write_GBps']:.2f} GB/s "
              f"({_times(weighted['read_GBps'], rec['read_GBps'])} and "
              f"{_times(weighted['write_GBps'], rec['write_GBps'])} the even set's). A fresh run takes them as "
              f"storage=\"{spec}\" (part of the state's layout: give them on every resume)")
    fastest = max(reports, key=lambda r: _score(r["recommended"]))
    if _score(fastest["recommended"]) > max(_score(rec), _score(weighted) if weighted else 0.0):
        print(f"note: {fastest['path']} alone (read {fastest['recommended']['read_GBps']:.2f} GB/s, write "
              f"{fastest['recommended']['write_GBps']:.2f} GB/s) is faster than the set: with even stripes a set runs "
              f"at {len(reports)} x about its slowest drive's rate. Train on the faster drive alone where it holds the "
              f"state, and add a slower one only for its space")
    if args.save_profile is not None:
        where = _write_output("--save-profile", args.save_profile or default_profile_path(),
                              lambda: save_profile(striped, args.save_profile or None))
        print(f"saved profile for the striped set to {where}: a store over these directories uses its options, and "
              f"its plan these rates")
    else:
        print("a store over these directories uses its options, and its plan these rates, once saved "
              "(--save-profile)")


def _score(rec: dict) -> float:
    """A recommendation's :attr:`BenchResult.score` (the harmonic mean of its read and write rates)."""
    return BenchResult("", 0, 0, rec["write_GBps"], rec["read_GBps"], True, "").score


def _times(measured: float, alone: float) -> str:
    """``measured`` as a multiple of ``alone`` ("-" where nothing was measured alone)."""
    return f"{measured / alone:.2f}x" if alone > 0 else "-"
