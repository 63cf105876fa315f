"""Storage backend plugins for tiered-offload.

Backends register through the entry-point group ``tiered_offload.storage_backends`` (the built-in
ones too, in this distribution's ``pyproject.toml``), are imported only when first used, and are
chosen by name or by a spec string::

    posix:/mnt/nvme0/run,/mnt/nvme1/run?threads=8&chunk_bytes=8MiB
    zarr:/data/state.zip
    memory
    auto:/mnt/nvme0/run          # kvikio where GPUDirect Storage is on, else posix

A third-party package adds a backend by declaring an entry point in that group whose target is a
:class:`StorageBackend` subclass taking ``(location, **options)``; or at run time with
:func:`register_backend`.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable
from urllib.parse import parse_qsl

from offload_core.errors import BackendUnavailableError, ConfigError, UnknownBackendError

from .base import StorageBackend, filename_to_key, key_to_filename, validate_key

__all__ = [
    "StorageBackend",
    "ENTRY_POINT_GROUP",
    "available_backends",
    "get_backend_class",
    "register_backend",
    "parse_spec",
    "StorageSpec",
    "resolve_storage",
    "auto_choice",
    "FILE_BACKENDS",
    "create_backend",
    "open_backend",
    "key_to_filename",
    "filename_to_key",
    "validate_key",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tiered_offload.storage_backends"

# Used only when the distribution's metadata is absent (running from a source tree that was never
# installed); an installed tiered-offload finds the same targets through its entry points.
_BUILTIN_TARGETS = {
    "posix": "storage_backends.posix:PosixBackend",
    "aiofiles": "storage_backends.aiofiles_backend:AiofilesBackend",
    "kvikio": "storage_backends.kvikio_backend:KvikioBackend",
    "zarr": "storage_backends.zarr_backend:ZarrBackend",
    "memory": "storage_backends.memory:MemoryBackend",
}
_INSTALL_HINTS = {
    "kvikio": "pip install 'tiered-offload[gds]' (kvikio-cu12; needs an NVIDIA GPU and driver)",
    "aiofiles": "pip install aiofiles",
    "zarr": "pip install 'zarr>=3'",
}
_registered: dict[str, Callable[..., StorageBackend] | str] = {}
_installed: dict[str, str] | None = None
"""The entry points last scanned (None: not yet). Scanning the installed distributions takes
milliseconds, once per engine built; a name not among them scans again, so a plugin installed
while the process runs is still found."""


def _targets(name: str | None = None, *, rescan: bool = False) -> dict[str, Callable[..., StorageBackend] | str]:
    """Every backend's target; the entry points scanned again when ``name`` is not among them."""
    global _installed
    found: dict[str, Callable[..., StorageBackend] | str] = dict(_BUILTIN_TARGETS)
    if rescan or _installed is None or (name is not None and name not in found and name not in _installed
                                        and name not in _registered):
        _installed = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update(_installed)
    found.update(_registered)
    return found


def available_backends() -> list[str]:
    """Names of every registered backend (installed or not importable: see :func:`get_backend_class`)."""
    return sorted(_targets(rescan=True))


def register_backend(name: str, target: Callable[..., StorageBackend] | str, *, clobber: bool = False) -> None:
    """Register a backend class (or ``"module:Class"`` string) under ``name`` at run time."""
    if not clobber and name in _targets(name):
        raise ValueError(f"a storage backend named {name!r} is already registered; pass clobber=True to replace it")
    _registered[name] = target


def get_backend_class(name: str) -> Callable[..., StorageBackend]:
    """The backend class registered as ``name``, imported on first use."""
    targets = _targets(name)
    if name not in targets:
        raise UnknownBackendError(f"unknown storage backend {name!r}; known: {', '.join(sorted(targets))} (or 'auto')")
    target = targets[name]
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = _INSTALL_HINTS.get(name, f"install the package that provides {module_name}")
        raise BackendUnavailableError(f"storage backend {name!r} cannot be imported ({e}); {hint}") from e
    return getattr(module, attr)


def parse_spec(spec: str) -> tuple[str, str | None, dict[str, str]]:
    """Split ``name[:location][?key=value&...]`` into its three parts.

    A spec with no ``name:`` prefix that looks like a path (``/mnt/x``, ``./x``, ``~/x``) means
    ``auto`` with that location.
    """
    spec, _, query = spec.partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True))
    if spec.startswith(("/", ".", "~")):
        return "auto", spec, options
    name, sep, location = spec.partition(":")
    return name, (location if sep else None), options


def _coerce(value: str):
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def auto_choice() -> tuple[str, str]:
    """What ``auto`` picks here, and why: ``kvikio`` only where GPUDirect Storage is really on
    (kvikio's compatibility mode is slower than the posix backend), else ``posix``."""
    from .kvikio_backend import gds_status
    active, reason = gds_status()
    return ("kvikio", reason) if active else ("posix", reason)


def resolve_auto() -> str:
    """The backend name ``auto`` stands for here (see :func:`auto_choice`); logged at INFO with the reason."""
    name, reason = auto_choice()
    log.info("auto storage backend: %s (%s)", name, reason)
    return name


FILE_BACKENDS = ("auto", "posix", "aiofiles", "kvikio")
"""Backends that keep extents as files in directories (so a durable training state can live there)."""


@dataclass(frozen=True)
class StorageSpec:
    """What a ``storage=`` argument names, read once: a backend object, or a backend name with
    its location and options. The one place a user's storage argument is interpreted."""

    name: str
    """Backend name (``auto`` until :func:`create_backend` resolves it); the object's name for ``backend``."""
    location: str | None = None
    options: dict = field(default_factory=dict)
    backend: StorageBackend | None = None
    """The backend object the user passed, used as it is."""

    @property
    def text(self) -> str:
        """The spec as a string (``posix:/a,/b?threads=8``)."""
        query = "&".join(f"{k}={v}" for k, v in self.options.items())
        return self.name + (f":{self.location}" if self.location is not None else "") + (f"?{query}" if query else "")

    @property
    def names_directories(self) -> bool:
        """The user named directories for a file backend (not a backend object, not memory or zarr)."""
        return self.backend is None and self.name in FILE_BACKENDS and bool(self.location)

    @property
    def first_directory(self) -> str | None:
        return self.location.split(",")[0] if self.names_directories else None


def _directory(path) -> str:
    """A directory given as a path (alone, or in a list of stripes), as the spec's text: never one a comma
    would split (``Path("/data/run,1")`` trained in ``/data/run`` and ``./1``), nor one of another kind."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ConfigError(f"storage directory {path!r} ({type(path).__name__}) is not a path; give each directory "
                          f"as a str or pathlib.Path")
    if "," in text:
        raise ConfigError(f"storage directory {text!r} holds a comma, which separates striped directories in a "
                          f"storage location; rename it, or give a link to it whose path has none")
    return text


def resolve_storage(storage) -> StorageSpec:
    """Read a ``storage=`` argument: a :class:`StorageBackend`, a directory (``str`` or path), a list
    of directories (striped), or a spec string (``posix:/a,/b?threads=8``, ``memory``, ``zarr:x``)."""
    if isinstance(storage, StorageSpec):
        return storage
    if isinstance(storage, StorageBackend):
        return StorageSpec(storage.name, None, {}, storage)
    if isinstance(storage, (list, tuple)):
        return StorageSpec("posix", ",".join(_directory(p) for p in storage))
    if isinstance(storage, os.PathLike):
        return StorageSpec("auto", _directory(storage))
    if not isinstance(storage, str):  # (str() of it named a directory the caller never meant)
        raise ConfigError(f"storage must be a directory (str or pathlib.Path), a list of directories, a spec string "
                          f"(posix:/a,/b) or a StorageBackend; got {type(storage).__name__} {storage!r}")
    name, location, options = parse_spec(storage)
    if name != "auto" and name not in _targets(name):
        if location and location.startswith(("/", ".", "~")):  # a backend's name mistyped, not a directory
            raise UnknownBackendError(
                f"storage {str(storage)!r} names no storage backend {name!r}; they are "
                f"{', '.join(available_backends())} (or auto). A directory whose name holds a colon: pass it as a "
                f"pathlib.Path")
        name, location, options = "auto", str(storage), {}  # a directory whose name holds a colon
    if name in FILE_BACKENDS and location:
        check_stripes_named(storage, location)
    return StorageSpec(name, location, options)


def check_stripes_named(storage: str, location: str, warn: bool = True) -> None:
    """A comma separates striped directories; directories some absolute and some relative (``/data/lr=1,bs=2``:
    ``/data/lr=1`` and ``./bs=2``) are one directory whose name holds a comma, not stripes: refused. All relative
    (``runs/lr=1,bs=2``) may be either: a warning (``warn``) says which it is taken for."""
    pieces = location.split(",")
    absolute = [os.path.isabs(os.path.expanduser(p)) for p in pieces]
    if warn and len(pieces) > 1 and not any(absolute):
        log.warning("storage %r stripes over %d directories relative to the working directory (%s), a comma "
                    "separating them; one directory whose name holds a comma: rename it", storage, len(pieces),
                    ", ".join(pieces))
    if len(pieces) > 1 and any(absolute) and not all(absolute):
        raise ConfigError(f"storage {storage!r} names {len(pieces)} striped directories (a comma separates them): "
                          f"{', '.join(pieces)}, some absolute and some relative to the working directory. One "
                          f"directory whose name holds a comma: rename it, or give a link to it whose path has none; "
                          f"several: give each as an absolute path (or a list)")


def create_backend(spec: str | StorageSpec, *, defaults: dict | None = None, **options) -> StorageBackend:
    """Construct (but do not open) the backend a spec string names.

    Options apply in this order, later ones winning: ``defaults`` (e.g. a bench-io profile's
    tuned settings, used only where the backend accepts them), the spec's ``?key=value`` options,
    then ``options``.
    """
    if isinstance(spec, StorageSpec):
        name, location, spec_options = spec.name, spec.location, spec.options
    else:
        name, location, spec_options = parse_spec(spec)
    if name == "auto":
        name = resolve_auto()
    cls = get_backend_class(name)
    merged = {}
    if defaults:
        import inspect
        accepted = inspect.signature(cls).parameters
        merged.update({k: v for k, v in defaults.items() if k in accepted})
    merged.update({k: _coerce(v) for k, v in spec_options.items()})
    merged.update(options)
    import inspect
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in merged if k not in accepted and not takes_any)
    if unknown:
        known = sorted(k for k, p in accepted.items() if k != "location" and p.kind == p.KEYWORD_ONLY
                       or (k != "location" and p.default is not p.empty))
        raise ConfigError(f"storage backend {name!r} has no option {unknown[0]!r}; its options are "
                          f"{', '.join(known) or 'none'}")
    if location is None:
        return cls(**merged)
    return cls(location, **merged)


def open_backend(spec: str, **options) -> StorageBackend:
    """Construct and open the backend a spec string names."""
    return create_backend(spec, **options).open()
