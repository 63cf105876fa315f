"""Saved I/O profiles: the settings ``tiered-offload bench-io`` measured best, reused by the store.

A profile records, for the file system it was measured on (identified by its device number and
mount point), the backend options that gave the best throughput. :func:`tuned_options` returns
those options for a storage location on the same file system, and nothing for any other, so a
profile measured on one drive never silently tunes another.

A store striped over several directories is tuned and planned by the entry ``bench-io`` saves when
given a ``--path`` per directory: it measures them together, striped as the store stripes them,
and records the set by its directories' file systems (:func:`striped_key`). A set with no such
entry takes its first directory's options, and ``n`` x the least directory's rates
(:func:`striped_rates`).

Where: ``--save-profile PATH``, by default ``~/.config/tiered-offload/io-profile.json``; the
environment variable ``TIERED_OFFLOAD_PROFILE`` points elsewhere, or disables profiles with ``none``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from offload_core.errors import ProfileError
from storage_backends._files import striped_total

__all__ = ["default_profile_path", "profile_path", "save_profile", "load_profile", "tuned_options", "measured_rates",
           "striped_rates", "striped_key", "measured_striped_rates", "filesystem_id"]

log = logging.getLogger(__name__)
PROFILE_VERSION = 1


OFF = ("", "none", "off")
"""What ``TIERED_OFFLOAD_PROFILE`` or a store's ``io_profile`` is set to to turn profiles off (any case)."""


def default_profile_path() -> Path | None:
    """The profile file in use: ``TIERED_OFFLOAD_PROFILE`` or the per-user default; None if disabled."""
    env = os.environ.get("TIERED_OFFLOAD_PROFILE")
    if env is not None:
        return None if env.lower() in OFF else Path(env).expanduser()
    return Path("~/.config/tiered-offload/io-profile.json").expanduser()


def filesystem_id(path: str | os.PathLike) -> dict:
    """Device number and mount point of the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    dev = os.stat(p).st_dev
    mount = p
    while mount != mount.parent and os.stat(mount.parent).st_dev == dev:
        mount = mount.parent
    return {"st_dev": dev, "mount_point": str(mount)}


def save_profile(profile: dict, path: str | os.PathLike | None = None) -> Path:
    """Merge ``profile`` (one file system's entry, or a striped set's: one with ``filesystems``) into
    the profile file; returns its path."""
    target = profile_path(path)
    if target is None:
        raise ProfileError("profiles are disabled (TIERED_OFFLOAD_PROFILE=none); pass a path to --save-profile")
    existing = {"version": PROFILE_VERSION, "filesystems": {}}
    if target.exists():
        try:
            existing = load_profile(target)
        except ProfileError:
            log.warning("replacing unreadable profile %s", target)
    if "filesystems" in profile:
        existing.setdefault("striped", {})[striped_key(profile["filesystems"])] = profile
    else:
        existing["filesystems"][profile["filesystem"]["mount_point"]] = profile
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(existing, indent=2, sort_keys=True))
    os.replace(tmp, target)
    return target


def load_profile(path: str | os.PathLike | None = None) -> dict:
    """Read a profile file; raises :class:`ProfileError` naming the file if it is malformed."""
    target = profile_path(path)
    if target is None or not target.exists():
        return {"version": PROFILE_VERSION, "filesystems": {}, "striped": {}}
    try:
        data = json.loads(target.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot read I/O profile {target}: {e}; delete it or run tiered-offload bench-io --save-profile again") from e
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or not isinstance(data.get("filesystems"), dict):
        raise ProfileError(f"I/O profile {target} has an unknown format (expected version {PROFILE_VERSION}); "
                           f"run tiered-offload bench-io --save-profile again")
    for mount, entry in data["filesystems"].items():
        wrong = _entry_fault(entry)
        if wrong:
            raise ProfileError(f"I/O profile {target}: the entry for {mount!r} {wrong}; delete the file or run "
                               f"tiered-offload bench-io --save-profile again")
    striped = data.setdefault("striped", {})
    if not isinstance(striped, dict):
        raise ProfileError(f"I/O profile {target}: its striped sets are not an object; delete the file or run "
                           f"tiered-offload bench-io --save-profile again")
    for key, entry in striped.items():
        wrong = _entry_fault(entry, striped=True)
        if wrong is None and key != striped_key(entry["filesystems"]):
            wrong = f"is filed under another set's file systems ({striped_key(entry['filesystems'])})"
        if wrong:
            raise ProfileError(f"I/O profile {target}: the striped set {key!r} {wrong}; delete the file or run "
                               f"tiered-offload bench-io --save-profile again with a --path per directory")
    return data


def _entry_fault(entry, striped: bool = False) -> str | None:
    """What is wrong with one file system's entry of a profile, or a striped set's (None: nothing):
    the shape :func:`save_profile` writes, each rate a finite number of GB/s, not negative."""
    if not isinstance(entry, dict):
        return "is not an object"
    rec = entry.get("recommended", {})
    if striped:
        fss = entry.get("filesystems")
        if not isinstance(fss, list) or len(fss) < 2 or not all(
                isinstance(fs, dict) and type(fs.get("st_dev")) is int for fs in fss):
            return "has no list of its directories' file system device numbers (filesystems[].st_dev)"
        weighted = entry.get("weighted", {})
        if not isinstance(weighted, dict):
            return "gives stripe weights that are not an object (weighted)"
        weights = weighted.get("stripe_weights", [1] * len(fss))
        if not isinstance(weights, list) or len(weights) != len(fss) or not all(
                type(w) is int and 1 <= w <= 64 for w in weights):
            return "gives no stripe weight from 1 to 64 for each directory (weighted.stripe_weights)"
        wrong = _rates_fault(weighted)
        if wrong:
            return wrong
    elif not isinstance(entry.get("filesystem"), dict) or type(entry["filesystem"].get("st_dev")) is not int:
        return "has no file system device number (filesystem.st_dev)"
    if not isinstance(rec, dict) or not isinstance(rec.get("options", {}), dict):
        return "recommends no object of options"
    return _rates_fault(rec)


def _rates_fault(rec: dict) -> str | None:
    """What is wrong with a measurement's ``read_GBps`` and ``write_GBps`` (None: each a finite
    number, not negative, or absent)."""
    for rate in ("read_GBps", "write_GBps"):
        v = rec.get(rate)
        if v is not None and (type(v) not in (int, float) or not 0 <= v < math.inf):  # (0: not measured)
            return f"gives {rate} {v!r}, not a number of GB/s"
    return None


def profile_path(path: str | os.PathLike | None = None) -> Path | None:
    """The profile file ``path`` names (None: turned off, ``"none"``), else the one in use
    (:func:`default_profile_path`)."""
    if isinstance(path, str) and path.lower() in OFF[1:]:
        return None
    return Path(path).expanduser() if path else default_profile_path()


def measured_rates(location: str | os.PathLike, path: str | os.PathLike | None = None) -> tuple[float, float, str] | None:
    """``(read bytes/s, write bytes/s, profile path)`` that bench-io measured with its recommended
    settings on the file system holding ``location``; None if no profile covers it."""
    try:
        data = load_profile(path)
    except ProfileError:
        return None
    fs = filesystem_id(location)
    for entry in data["filesystems"].values():
        rates = _as_rates(entry.get("recommended", {}), path)
        if entry.get("filesystem", {}).get("st_dev") == fs["st_dev"] and rates:
            return rates
    return None


def _as_rates(measured: dict, path) -> tuple[float, float, str] | None:
    """A measurement's ``(read bytes/s, write bytes/s, the profile's path)``; None where it lacks a rate."""
    if measured.get("read_GBps") and measured.get("write_GBps"):
        return measured["read_GBps"] * 1e9, measured["write_GBps"] * 1e9, str(profile_path(path))
    return None


def striped_key(locations) -> str:
    """The key of a striped set's entry: the file systems of its directories (each a path, or a
    :func:`filesystem_id`), sorted, as many times as the set has directories on each."""
    return ",".join(sorted(str(loc["st_dev"] if isinstance(loc, dict) else filesystem_id(loc)["st_dev"])
                           for loc in locations))


def _directories(location) -> list:
    """The directories a storage location names: a list, or a string separated by commas."""
    return [p for p in str(location).split(",") if p] if isinstance(location, (str, os.PathLike)) else list(location)


def measured_striped_rates(locations, path: str | os.PathLike | None = None,
                           weights=None) -> tuple[float, float, str] | None:
    """``(read bytes/s, write bytes/s, profile path)`` that bench-io measured for directories on the
    file systems of ``locations`` (two or more) striped together, in even stripes or (``weights``)
    by the weights it advised; None if no profile has the set so striped."""
    try:
        data = load_profile(path)
    except ProfileError:
        return None
    entry = data["striped"].get(striped_key(_directories(locations)), {})
    weighted = entry.get("weighted") or {}
    rec = entry.get("recommended", {}) if not weights else (
        weighted if weighted.get("stripe_weights") == list(weights) and weighted.get("verified", True) else {})
    return _as_rates(rec, path)


def striped_rates(drives: list[tuple[int, float, float]], weights=None) -> tuple[float, float]:
    """Read and write bytes per second of a store striped over directories (RAID-0: each tensor's
    stripes in turn), each given as ``(its file system's st_dev, that file system's read rate, write
    rate)``: a transfer takes as long as its slowest directory's share, so, with even stripes, ``n``
    x the least of the directories' rates, the directories on one file system sharing its rate
    (:func:`striped_total`; ``weights``: the backend's ``stripe_weights``)."""
    return (striped_total([(fs, r) for fs, r, _ in drives], weights),
            striped_total([(fs, w) for fs, _, w in drives], weights))


def tuned_options(location, path: str | os.PathLike | None = None) -> dict:
    """Backend options measured best for ``location`` (a directory, or several: a list or a string
    separated by commas): its striped set's, else its first directory's file system's; {} if none."""
    try:
        data = load_profile(path)
    except ProfileError as e:
        log.warning("%s", e)
        return {}
    directories = _directories(location)
    if len(directories) > 1 and striped_key(directories) in data["striped"]:
        return _as_defaults(data["striped"][striped_key(directories)])
    fs = filesystem_id(directories[0])
    for entry in data["filesystems"].values():
        if entry.get("filesystem", {}).get("st_dev") == fs["st_dev"]:
            return _as_defaults(entry)
    return {}


LAYOUT = ("stripe_bytes", "stripe_weights")
"""Backend options that lay out a state's bytes (a resume must give those it was written with): a
profile never sets them, only how the bytes move."""


def _as_defaults(entry: dict) -> dict:
    """An entry's recommended options as a backend's defaults, less any :data:`LAYOUT` option (a
    profile edited by hand). Direct I/O measured best becomes
    ``"auto"`` (where the file system has it), not ``True``: a store whose other directory has none
    would refuse to open, though nobody asked for direct I/O (it opens buffered, logging why)."""
    options = {k: v for k, v in entry.get("recommended", {}).get("options", {}).items() if k not in LAYOUT}
    if options.get("direct") is True:
        options["direct"] = "auto"
    return options
