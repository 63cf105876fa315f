"""The checks an engine makes before it moves a byte: budgets that cannot hold one step's working
set, and a disk that cannot hold the state, are refused up front with the numbers (never in the
middle of a step)."""

from __future__ import annotations

from offload_core.errors import ConfigError, DiskFullError, TierCapacityError
from offload_core.sizes import format_size, format_size_up
from tiered_offload.engine.schedule import FP32_BYTES, Schedule
from tiered_offload.store.tiers import Tier

__all__ = ["check_budgets", "check_disk", "optimizer_tier"]


def check_budgets(store, schedule: Schedule, state_piece_numel: int) -> None:
    """Refuse budgets that cannot hold one step's working set (and, below a device tier, a host
    budget that cannot stage the largest unit to the GPU)."""
    compute = store.compute_tier
    cap = store.capacity(compute)
    ws = schedule.working_set()
    need = ws.need
    if need > cap:
        raise TierCapacityError(
            f"the {compute.name.lower()} budget ({format_size(cap)}) cannot hold one step's working set: "
            f"{format_size_up(need)} ({need} bytes) needed. Forward and backward keep the weights and gradients of "
            f"the parameters bound for the whole pass ({format_size(ws.rest_bytes)}) plus a streamed unit's weights "
            f"and gradients and the next one's weights (largest: {ws.largest_block} = {format_size(ws.block_bytes)} "
            f"of weights): "
            f"{format_size(ws.forward_backward)}; the optimizer keeps one unit's weights and gradients and one "
            f"{format_size(state_piece_numel * FP32_BYTES)} piece of each of its {len(schedule.state_kinds)} "
            f"state(s): {format_size(ws.optimizer)}; plus {format_size(ws.slack)} of slack against fragmentation. "
            f"Raise host_memory{' / device_memory' if compute == Tier.DEVICE else ''} to at least "
            f"{format_size_up(need)}")
    largest = max(schedule.unit_bytes(u, "weight") for u in schedule.units)
    if compute == Tier.DEVICE and store.capacity(Tier.HOST) < largest:
        raise TierCapacityError(f"host_memory ({format_size(store.capacity(Tier.HOST))}) must hold at least the "
                                f"largest unit ({format_size_up(largest)}) to stage it to the GPU")


def check_disk(backend, state_bytes: int, extra_bytes: int) -> None:
    """Refuse a storage location whose free space cannot hold the state and what a step adds."""
    free = backend.free_bytes()
    need = state_bytes + extra_bytes
    if free is not None and need > free:
        raise DiskFullError(
            f"the training state needs {format_size(need)} ({need} bytes) in {backend.location} "
            f"but {format_size(free)} ({free} bytes) is free; free space or add storage directories",
            path=backend.location, needed_bytes=need, free_bytes=free)


def optimizer_tier(setting: str, store, schedule: Schedule) -> Tier:
    """Where the optimizer step runs (``EngineConfig.optimizer_device``). With one memory tier
    (the CPU) there is nothing to choose. Below a device tier, ``"host"`` updates in the host tier,
    where the optimizer states live when they do not fit the device: ZeRO-Offload's arrangement,
    the link carries the gradients down and the weights up (8 bytes per parameter) instead of the
    states both ways; ``"device"`` updates in the device tier; ``"auto"``: the host when the state
    does not fit the device tier and the host budget holds the step's working set, else the device
    (a rule on sizes: the update rates are not weighed yet)."""
    if setting not in ("auto", "host", "device"):
        raise ConfigError(f"EngineConfig.optimizer_device must be 'auto', 'host' or 'device', got {setting!r}")
    if store.compute_tier != Tier.DEVICE or setting == "device":
        return store.compute_tier
    ws = schedule.working_set()
    need = ws.optimizer + ws.slack
    host = store.capacity(Tier.HOST)
    if setting == "host" and need > host:
        raise TierCapacityError(f"optimizer_device='host' runs the step in the host tier, whose budget "
                                f"({format_size(host)}) cannot hold one unit's weights, gradients and state pieces; "
                                f"raise host_memory to at least {format_size_up(need)}, or use 'device'")
    if setting == "host" or (need <= host and not schedule.fits(store.capacity(Tier.DEVICE))):
        return Tier.HOST
    return Tier.DEVICE
