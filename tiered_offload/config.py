"""Validated configuration of the tiered store: one keyword-only dataclass, a docstring per field."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from offload_core.errors import ConfigError
from offload_core.sizes import format_size, parse_size

from .memstat import available_memory_bytes, memory_limit_bytes

log = logging.getLogger(__name__)

PREFETCH_DEPTH = 16
"""The lookahead's default prefetch depth, for a store alone and for the engine's store alike."""

__all__ = ["EngineConfig", "StoreConfig", "resolve_device", "check_engine_arguments", "check_field_kinds"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None: ``TIERED_OFFLOAD_DEVICE`` if set, else the current CUDA device when torch sees
    one, else the CPU."""
    if device in (None, "auto") and os.environ.get("TIERED_OFFLOAD_DEVICE", "auto") != "auto":
        device = os.environ["TIERED_OFFLOAD_DEVICE"]
    if device in (None, "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a device torch knows ({e}); use 'cpu', 'cuda', 'cuda:N' or "
                          f"'auto'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: the engine computes on 'cpu', 'cuda' or 'cuda:N' (or 'auto')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is None:  # "cuda": the current one, by number (a tensor's device
        dev = torch.device("cuda", torch.cuda.current_device())  # has one; torch.cuda.set_device needs one)
    return dev


_KINDS = {"int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
          "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
          "bool": (lambda v: isinstance(v, bool), "True or False"), "str": (lambda v: isinstance(v, str), "a string"),
          "None": (lambda v: v is None, "None"),
          "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
          "torch.device": (lambda v: isinstance(v, torch.device), "a torch.device"),
          "Callable": (callable, "a callable")}
"""A field's annotated kind -> (whether a value is of it, its name in a message)."""


def check_field_kinds(values, kinds: dict, prefix: str) -> None:
    """Refuse the first field of the dataclass ``values`` whose value is not of its annotated kind
    (``int | None``...), naming it as ``prefix.field``; ``kinds``: a kind -> (whether a value is of
    it, its name in the message). A field of a kind the table lacks is not checked."""
    for f in dataclasses.fields(values):
        names = [k.strip() for k in str(f.type).split("|")]
        value = getattr(values, f.name)
        if all(k in kinds for k in names) and not any(kinds[k][0](value) for k in names):
            raise ConfigError(f"{prefix}.{f.name} must be {' or '.join(kinds[k][1] for k in names)}, got {value!r}")


def _check_kinds(config) -> None:
    check_field_kinds(config, _KINDS, type(config).__name__)


def check_engine_arguments(*, on_nonfinite, resume, durable, commit_every, trace, config, init_from,
                           store_config, host_memory="auto", device_memory="auto") -> None:
    """Refuse an ``Engine`` argument of the wrong kind or value, naming it, before anything is built
    (a truthy string for a flag, a number for a path: each did something else without a word)."""
    for name, budget in (("host_memory", host_memory), ("device_memory", device_memory)):
        if budget != "auto":  # (named as passed: StoreConfig's checks name its own fields)
            parse_size(budget, what=name)
    if on_nonfinite not in ("raise", "skip"):
        raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    if resume not in (True, False, "auto"):
        raise ConfigError(f"resume must be True, False or 'auto', got {resume!r}")
    if durable not in (True, False, None):
        raise ConfigError(f"durable must be True, False or None, got {durable!r}")
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise ConfigError(f"commit_every must be an integer >= 1, got {commit_every!r}")
    if trace is not None and not isinstance(trace, (str, os.PathLike)):
        raise ConfigError(f"trace must be a file path (str or pathlib.Path), got {type(trace).__name__} {trace!r}")
    paths = init_from if isinstance(init_from, (list, tuple)) else [init_from]
    if init_from is not None and not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise ConfigError(f"init_from must be a directory or file (str or pathlib.Path), or [BASE, ADAPTER]; got "
                          f"{type(init_from).__name__} {init_from!r}")
    if store_config is not None:
        if not isinstance(store_config, dict):
            raise ConfigError(f"store_config must be a dict of StoreConfig's fields, got {type(store_config).__name__} "
                              f"{store_config!r}")
        fields = [f.name for f in dataclasses.fields(StoreConfig)]
        unknown = [k for k in store_config if k not in fields]
        if unknown:
            raise ConfigError(f"store_config: no StoreConfig field {unknown[0]!r}; its fields are {', '.join(fields)}")
    if config is not None and not isinstance(config, EngineConfig):
        hint = (f": EngineConfig({', '.join(f'{k}={v!r}' for k, v in config.items())})" if isinstance(config, dict)
                else "")
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}{hint}")


@dataclass(kw_only=True)
class StoreConfig:
    """Budgets and policies of a :class:`~tiered_offload.store.tiered_store.TieredStore`."""

    host_budget_bytes: int | float | str = "auto"
    """Bytes of host memory the store may use for tensor copies (the pinned pool on CUDA
    machines). ``"auto"``: a quarter of the memory available now (within a container's cgroup limit,
    ``memory.max``, where there is one), or ``TIERED_OFFLOAD_HOST_BUDGET``."""

    device_budget_bytes: int | float | str = "auto"
    """Bytes of device memory for tensor copies. ``"auto"``: half the free GPU memory on CUDA, 0
    on the CPU (the device tier is then unused: compute runs on host copies), or
    ``TIERED_OFFLOAD_DEVICE_BUDGET``."""

    device: str | torch.device = "auto"
    """The device tier's device. ``"auto"``: CUDA when available, else the CPU. A CPU device tier
    with a non-zero budget is a real separate tier (handy to test three-tier logic without a GPU)."""

    pin_host_memory: bool | None = None
    """Page-lock the host pool. None: when the device is CUDA."""

    policy: str | Callable = "lookahead"
    """Eviction policy per tier: ``"lru"``, ``"lookahead"`` (Belady over the declared access
    sequence, with prefetching), or a factory returning an ``EvictionPolicy``."""

    prefetch_depth: int = PREFETCH_DEPTH
    """How many upcoming tensors the lookahead policy may prefetch into a tier at once."""

    tier_caching: str = "exclusive"
    """How the device and host tiers share tensors. ``"exclusive"``: they cache different tensors
    (a device copy pushed out moves down to the host tier; the host tier gives up copies the
    device also holds first), so together they hold their two budgets' worth. ``"inclusive"``:
    the host tier keeps what it staged for the device and a device victim is written to the disk
    (each tier caches on its own: kept to compare against, ``tools/bench_tiers.py``)."""

    host_prefetch_share: float = 0.125
    """Below a device tier, the host tier's lookahead prefetches upcoming tensors from the disk
    only until they add up to this share of the host budget (the nearest one always)."""

    prefetch_share: float = 0.25
    """Where the host tier is the compute tier (no device tier), its lookahead prefetches the
    upcoming tensors (at most ``prefetch_depth``) only until they add up to this share of its
    budget, counting those already in it (the nearest one always). Further ahead it filled room
    that nearer needs took back before the tensors were used, and they were read again (the
    disk reads of ``tools/bench_train.py --host-fraction 0.25``: 0.91x with it; docs/RESULTS.md).
    ``math.inf``: ``prefetch_depth`` alone, as before. A device compute tier is bounded by
    ``prefetch_depth`` alone (a share measured mixed there)."""

    preallocate: bool = True
    """Reserve each tensor's disk space at registration, so a full disk fails up front."""

    verify_checksums: bool = True
    """Record a checksum of every tensor written to disk and check it on every read back."""

    io_profile: str | None = None
    """The ``tiered-offload bench-io --save-profile`` file whose measurements tune the file backend
    and give the plan the disk's rates (None: ``TIERED_OFFLOAD_PROFILE``, else the per-user
    default ``~/.config/tiered-offload/io-profile.json``; ``"none"``: no profile, the backend's
    defaults; a profile applies only to the file system it was measured on)."""

    checksum: str = "xxh3"
    """The checksum algorithm: ``"xxh3"`` (64-bit XXH3: fast, off the GIL) or ``"crc32"``
    (zlib's, what storage format 1 recorded). A durable directory keeps the algorithm it was
    created with (a resume switches to it)."""

    versioned_writes: bool = False
    """Write each new version of a tensor to a new extent (``key@N``) instead of over the old one,
    so the last version written stays readable until a newer one has fully landed. The old
    extent is deleted once superseded, or handed to :attr:`TieredStore.on_disk_written` to
    decide (the engine's journal keeps the extents its committed state refers to)."""

    wait_timeout_s: float = 600.0
    """Longest wait for space held by operations in flight before giving up with an error."""

    def __post_init__(self):
        _check_kinds(self)

    def resolved(self) -> "StoreConfig":
        """A copy with ``auto`` values and size strings replaced by numbers, validated."""
        device = resolve_device(self.device)
        host, host_from = self.host_budget_bytes, "host_budget_bytes"
        if host == "auto":
            host = os.environ.get("TIERED_OFFLOAD_HOST_BUDGET") or available_memory_bytes() // 4
            host_from = "TIERED_OFFLOAD_HOST_BUDGET (host_memory='auto')" if isinstance(host, str) else host_from
        dev_budget, dev_from = self.device_budget_bytes, "device_budget_bytes"
        if dev_budget == "auto":
            dev_budget = os.environ.get("TIERED_OFFLOAD_DEVICE_BUDGET")
            dev_from = "TIERED_OFFLOAD_DEVICE_BUDGET (device_memory='auto')"
            if dev_budget is None:
                dev_budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 0
        if self.prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.wait_timeout_s <= 0:
            raise ConfigError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        if self.tier_caching not in ("exclusive", "inclusive"):
            raise ConfigError(f"tier_caching must be 'exclusive' or 'inclusive', got {self.tier_caching!r}")
        if not 0 <= self.host_prefetch_share <= 1:
            raise ConfigError(f"host_prefetch_share must be between 0 and 1, got {self.host_prefetch_share}")
        if not self.prefetch_share > 0:
            raise ConfigError(f"prefetch_share must be > 0 (math.inf: prefetch_depth alone), got {self.prefetch_share}")
        from tiered_offload.store.checksum import checksum_function
        checksum_function(self.checksum)  # an unknown name fails here, with the known ones
        pin = self.pin_host_memory if self.pin_host_memory is not None else device.type == "cuda"
        if pin and not torch.cuda.is_available():
            raise ConfigError("pin_host_memory=True needs CUDA; leave it None on CPU-only machines")
        host = parse_size(host, what=host_from)
        _check_host_budget(host)
        return dataclasses.replace(
            self, device=device, pin_host_memory=pin, host_budget_bytes=host,
            device_budget_bytes=parse_size(dev_budget, what=dev_from))


def _check_host_budget(host: int) -> None:
    """The host tier maps its whole budget when the store opens: one beyond what this process
    could ever have is refused (the mapping failed untyped, or where the kernel overcommits the
    process was killed as the tier filled); one beyond what is available now is a warning."""
    (limit, what), available = memory_limit_bytes(), available_memory_bytes()
    auto = format_size(available // 4)
    if host > limit:
        raise ConfigError(f"host_memory {format_size(host)} is more than this machine's memory ({what}: "
                          f"{format_size(limit)}); lower it ('auto': a quarter of the memory available now, {auto})")
    if host > available:
        log.warning("host_memory %s is more than the memory available now (%s): the host tier takes it as it fills, "
                    "and the kernel may stop the process where it cannot give it; 'auto' gives %s",
                    format_size(host), format_size(available), auto)


@dataclass(kw_only=True)
class EngineConfig:
    """Tuning knobs of an :class:`~tiered_offload.Engine` (the defaults suit most runs).

    ``Engine(model, ..., config=EngineConfig(state_piece_numel=1 << 20))``.
    """

    optimizer_chunk_numel: int = 1 << 20
    """Elements per optimizer call: bounds the optimizer's temporaries (a few chunks of fp32)."""

    state_piece_numel: int = 4 << 20
    """Elements per piece of an optimizer-state buffer. The step streams a unit's states through
    memory one piece of each kind at a time, so the host working set of the step is the largest
    unit's weights and gradients plus one piece per state kind, not four whole buffers. Fixed
    for a storage directory (a resume must use the same value)."""

    step_lead: int = 2
    """How many units the background (overlapped) step may run ahead of the next forward: further
    ahead, the units it updated would be evicted again before the forward reaches them."""

    prefetch_depth: int = PREFETCH_DEPTH
    """How many upcoming tensors the lookahead policy may prefetch into the engine's store at once
    (:attr:`StoreConfig.prefetch_depth`)."""

    stream_modules_numel: int | None = 0
    """An ``nn.Embedding`` or ``nn.Linear`` outside the block sequence whose parameters are its own
    (an untied embedding or head) and number at least this many streams like a block: fetched for
    its forward, recomputed in backward, instead of held for the whole forward and backward. 0: as
    many as the largest block; None: never (such modules stay with the rest of the model). Fixed
    for a storage directory (it decides the units)."""

    activations: str | list[str] = "auto"
    """What each streamed block does with the tensors its forward saves for backward, when the
    state does not fit the compute tier: ``"keep"`` (into the store, in the compute tier unless it
    needs the room), ``"offload"`` (into the store and out of the compute tier at once, to host or
    disk), ``"recompute"`` (only the block's input is stored; backward runs the block again), a
    list with one of those per streamed block, or ``"auto"``: the planner chooses per block from
    the first step's measurements (see ``engine.plan``). Every choice computes the same numbers."""

    optimizer_device: str = "auto"
    """Where the optimizer step runs on a GPU (with a device tier): ``"host"`` (PyTorch's CPU
    optimizer on the host tier, where the states live: the link carries gradients down and weights
    up), ``"device"`` (the states go to the GPU for the update and back), or ``"auto"``: the device
    when the whole state fits the device budget or the host budget cannot hold one unit's update,
    else whichever takes less time per step at rates measured when the engine is built (the
    optimizer on the host and on the device, the link) and the disk's from its ``bench-io``
    profile, where one covers it (the device's room keeps optimizer states off the disk only under
    an update on the device; ``engine.plan`` says which numbers decided; a resumed run keeps the
    placement its state was trained with, sharded ranks agree on one).
    Either computes PyTorch's numbers: the host one those of the optimizer run on CPU copies of
    the parameters, the device one those of the optimizer on the GPU (they can differ in the last
    bits: name the placement where runs on different machines must agree bitwise)."""

    overlap_step: bool | None = None
    """Run the step in the background, overlapped with the next forward. None: when the state
    does not fit the compute tier and the budget holds a unit being updated beside the forward's
    working set; where the disk then bounds the step, the engine also runs a few steps deferred
    once its plan is final and keeps the mode that measured better (``engine.plan`` says which).
    True where the update runs in the compute tier and its budget is below the one at which None
    would overlap: refused when the engine is built, with that budget."""

    defer_step: bool | None = None
    """Where the step does not overlap the next forward: run each unit's update on the forward's
    thread just before the forward needs the unit (``step()`` returns at once), so the weights the
    update wrote are the ones the forward reads, instead of updating every unit first and reading
    the weights again. None: when the state does not fit the compute tier and the budget holds a
    unit's update beside what the forward pins (True below that budget: refused when the engine is
    built, with it). Every mode computes the same numbers."""

    def __post_init__(self):
        _check_kinds(self)
        for name in ("optimizer_chunk_numel", "state_piece_numel", "step_lead"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefetch_depth < 0:
            raise ConfigError(f"EngineConfig.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        modes = ("keep", "offload", "recompute")
        wanted = [self.activations] if isinstance(self.activations, str) else list(self.activations)
        bad = [m for m in wanted if m not in modes and not (m == "auto" and isinstance(self.activations, str))]
        if bad:
            raise ConfigError(f"EngineConfig.activations: {bad[0]!r} is not one of 'auto', {', '.join(map(repr, modes))}")
