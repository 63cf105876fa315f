"""``PlanMonitor``: the engine's plan while it runs.

It owns the plan (what each block does with its activations, the prefetch depth, whether the step
overlaps the next forward, how the budget is split), the per-iteration measurements it is made
from, the check of its prediction against later iterations, and ``engine.stats()``. The
arithmetic itself stays in :mod:`.planner` (pure numbers); this part measures and asks it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from offload_core.sizes import format_size
from tiered_offload.engine.planner import DiskRates, Plan, StepMeasurement, make_plan, median
from tiered_offload.engine.stats import EngineStats
from tiered_offload.profile import filesystem_id, measured_rates, measured_striped_rates, striped_rates
from tiered_offload.store.tiers import Tier

__all__ = ["PlanMonitor", "profiled_disk_rates"]

log = logging.getLogger("tiered_offload")


def profiled_disk_rates(store) -> DiskRates | None:
    """The rates ``tiered-offload bench-io --save-profile`` measured for the store's storage
    directories: striped together where it measured their set (in even stripes, or by the weights
    it advised where the backend has them), else each directory's file system's, striped
    (:func:`~tiered_offload.profile.striped_rates`, by the backend's ``stripe_weights``); None
    without a disk, or where a directory's file system has no profile."""
    dirs, weights = store.backend.directories, store.backend.stripe_weights
    together = measured_striped_rates(dirs, store.config.io_profile, weights) if len(dirs) > 1 else None
    if together is not None:
        return DiskRates(together[0], together[1], f"bench-io profile {together[2]}, {len(dirs)} directories "
                                                   f"measured striped together" + (
                                                       f" by weights {':'.join(map(str, weights))}" if weights else ""))
    drives, where = [], None
    for d in store.backend.directories:
        known = measured_rates(d, store.config.io_profile)
        if known is None:
            return None
        drives.append((filesystem_id(d)["st_dev"], known[0], known[1]))
        where = known[2]
    if not drives:
        return None
    read, write = striped_rates(drives, weights)
    n = len(drives)
    return DiskRates(read, write, f"bench-io profile {where}" + (
        f", {n} directories striped over {len({fs for fs, _, _ in drives})} file systems" if n > 1 else "")
        + (f" by weights {':'.join(map(str, weights))}" if weights else ""))


@dataclass(frozen=True)
class _Counters:
    """The running totals an iteration's measurement is the difference of."""

    engine_seconds: float
    disk_read: int
    disk_written: int
    io_wait_seconds: float
    disk_busy_seconds: float
    link: int


class PlanMonitor:
    """Makes the plan, measures iterations, checks the prediction, goes back once if the plan did
    not earn its disk bytes (:meth:`Plan.unearned`; where it looked faster than the one step of the
    modes it replaced, after those ran again for :attr:`CHECK_AFTER` steps).

    Args:
        store: the engine's store (its counters and budgets).
        schedule: the engine's schedule (working set, overlap arithmetic).
        streamer: the block streamer (its modes, per-block forward times and graph sizes).
        block_names: the streamed blocks, in order.
        config: the engine's :class:`EngineConfig`.
        recompute: the engine's ``recompute=`` argument.
        parameter_count: the model's parameters (for bytes per parameter).
        floors: the bytes a step cannot avoid (see :meth:`Schedule.floors`), shown in the plan.
        commit_disk_bytes: the disk space commits may take beyond the state (the journal's window,
            a snapshot's second copy): not for offloaded activations.
        ranks: processes training together (sharded); they may share one disk, so each plans with
            its share of the free space.
        agree: ``agree(flags, what)``: each flag's AND over the ranks (a collective; sharded).
    """

    PLAN_FROM = 1
    """The measured iteration the plan is made from (0-based). Not the first: its optimizer step
    finds the optimizer states still implicitly zero (nothing to read) and its lookahead has not
    learned the access order yet, so its disk traffic is not what later steps move."""
    CHECK_AFTER = 3
    """Iterations measured under a plan before its prediction is compared with them."""
    FINAL_AFTER = 1 + PLAN_FROM + 2 * CHECK_AFTER + 1
    """Steps after which the plan in force is the one the run keeps: made, checked, revised if it
    did not earn its disk bytes (or kept after the modes it replaced ran again), and its step mode
    tried (:meth:`_try_deferral`) where the disk bounds it (a benchmark's warm-up runs this many)."""
    SHARDED_TRIAL_AT = 1 + PLAN_FROM + 2 * CHECK_AFTER
    """Sharded, the measured iteration after which every rank decides whether to try the step
    deferred (each one's plan final by then, revised or not: the agreement is a collective, so
    the ranks must reach it at the same step)."""
    DISK_BOUND = 1.0
    """How long the disk must have been busy in an overlapped step, as a multiple of the step's
    compute (its time less the waits for bytes, as the planner measures compute; median over the
    plan's check), for the engine to try the step deferred: below it the disk has time to spare,
    the bytes deferral saves would not shorten the step, and the update beside the forward uses
    idle cores. (The share of the step the disk is busy does not tell: measured 0.71-0.77 in a
    step 2.4x its compute on a 300 MB/s disk, 0.30-0.57 in a compute-bound one.)"""
    KEEP = 64
    """Measurements kept for stats() (the plan's entries first)."""
    DISK_SHARE = 0.9
    """Of the free disk space commits leave, the share a step's offloaded activations may take
    (the rest: other writers, the file system's own blocks)."""

    def __init__(self, store, schedule, streamer, block_names: list[str], config, recompute,
                 parameter_count: int, floors: dict | None = None, commit_disk_bytes: int = 0, ranks: int = 1,
                 agree=None):
        self.floors = floors
        self.commit_disk_bytes, self.ranks = commit_disk_bytes, ranks
        self._agree = agree or (lambda flags, what: list(flags))
        self.store, self.schedule, self.streamer = store, schedule, streamer
        self.block_names = block_names
        self.config = config
        self.planner_chooses = recompute == "auto" and config.activations == "auto"
        """Whether the planner picks each block's activation mode after measuring (else it is fixed)."""
        self.parameter_count = parameter_count
        self.engine_seconds = 0.0
        """Time spent in the engine's calls (forward, backward, clipping, step)."""
        self.loops: dict[str, int] = {}
        """Why ``forward_backward`` ran the loop instead of a pass -> how many calls it did."""
        self.updates_in_backward = 0
        """Units updated inside a backward (:attr:`EngineStats.updates_in_backward`)."""
        self.measured: list[StepMeasurement] = []
        self._last: _Counters | None = None
        self._check_at = 1 + self.PLAN_FROM + self.CHECK_AFTER
        """Measured iterations after which the plan in force is checked (and revised, once)."""
        self._revised = False
        self._again: tuple[list[StepMeasurement], int, list[str]] | None = None
        """While the modes the plan replaced run again: the plan's steps, the count of measured
        iterations at which they are compared (:meth:`_end_again`), and the plan's modes."""
        self._overlapped: list[StepMeasurement] | None = None
        """The overlapped steps the deferred ones are compared with, while the step mode is tried."""
        self._trial_end: int | None = None
        self._plan = self._initial_plan(recompute)
        if streamer.modes is not None:
            log.info("tiered-offload plan (until measured):\n%s", self._plan.summary())

    # ---- the plan ----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan, with the blocks recomputed since (their activations outgrew the budget) noted."""
        now = self.streamer.modes
        if self._again is not None:  # the modes it replaced run again for a few steps: the plan as made
            return self._plan
        if now is not None and self._plan.modes is not None and list(now) != self._plan.modes:
            fell = [b for b, was, is_ in zip(self._plan.blocks, self._plan.modes, now) if was != is_]
            self._plan.reasons.append(f"recomputed since the plan, their activations not fitting the budget at the "
                                      f"time: {', '.join(fell)}")
            self._plan.modes = list(now)
        return self._plan

    def _initial_plan(self, recompute) -> Plan:
        cap = self.store.capacity(self.store.compute_tier)
        need = self.schedule.working_set().need
        streamer = self.streamer
        acts = max(streamer.activation_room.values(), default=0) if streamer.modes is not None else 0
        overridden = []
        if recompute is not True and recompute is not False and self.config.activations != "auto":
            overridden.append(f"activations = {self.config.activations!r} (EngineConfig.activations)")
        elif recompute in (True, False):
            overridden.append(f"recompute={recompute}")
        for name in ("overlap_step", "defer_step"):
            if getattr(self.config, name) is not None:
                overridden.append(f"{name} = {getattr(self.config, name)} (EngineConfig.{name})")
        return Plan(modes=None if streamer.modes is None else list(streamer.modes), blocks=list(self.block_names),
                    prefetch_depth=self.store.config.prefetch_depth, overlap_step=streamer.overlap_step,
                    defer_step=streamer.defer_step,
                    host_split={"working_set": min(need, cap), "activation_room": min(acts, max(0, cap - need)),
                                "cache": max(0, cap - need - acts)},
                    lower_tier=self._lower_tier(), overridden=overridden, floors=self.floors)

    def _lower_tier(self) -> dict[str, int] | None:
        """The host tier below a device tier, as the plan shows it (None without a device tier)."""
        if self.store.compute_tier != Tier.DEVICE or not self.store.capacity(Tier.HOST):
            return None
        host = self.store.capacity(Tier.HOST)
        return {"budget": host, "prefetch_window": int(self.store.config.host_prefetch_share * host)}

    # ---- measuring ----------------------------------------------------------------------------
    def _counters(self) -> _Counters:
        st = self.store.stats
        return _Counters(self.engine_seconds, st.bytes_read[Tier.DISK], st.bytes_written[Tier.DISK],
                         st.io_wait_seconds, st.disk_busy_seconds, st.link_bytes)

    def iteration_boundary(self) -> None:
        """A step begins: measure the iteration that ended (for the plan), start the next. Its
        time is the time spent in the engine's calls, so what the caller does between them
        (loading data, logging, evaluating) is not counted."""
        now, streamer, n = self._counters(), self.streamer, len(self.block_names)
        if self._last is not None:
            last = self._last
            self.measured.append(StepMeasurement(
                seconds=now.engine_seconds - last.engine_seconds,
                io_wait_seconds=now.io_wait_seconds - last.io_wait_seconds,
                disk_read=now.disk_read - last.disk_read, disk_written=now.disk_written - last.disk_written,
                disk_busy_seconds=now.disk_busy_seconds - last.disk_busy_seconds,
                forward_seconds=[streamer.forward_seconds.get(i, 0.0) for i in range(n)],
                graph_bytes=[streamer.graph_bytes.get(i, 0) for i in range(n)],
                modes=list(streamer.modes) if streamer.modes is not None else ["keep"] * n, link=now.link - last.link,
                forwards=[streamer.forward_calls.get(i, 1) for i in range(n)]))
            self._after_iteration()
            if len(self.measured) > self.KEEP:
                del self.measured[self.PLAN_FROM + 1 + self.CHECK_AFTER]
        self._last = now
        streamer.forward_seconds.clear()
        streamer.forward_calls.clear()

    def _after_iteration(self) -> None:
        """After the planning iteration: plan. After a few more: compare and say if it is off; where
        the plan moved more disk bytes than the modes it replaced, measure those again and keep the
        faster."""
        measured = self.measured
        kept = self._end_again() if self._again is not None and len(measured) == self._again[1] else None
        if self.ranks > 1 and len(measured) == self.SHARDED_TRIAL_AT:  # every rank at once, whatever its plan:
            self._try_deferral(kept or measured[-self.CHECK_AFTER:])    # the ranks agree (a collective)
        elif self.ranks > 1 and len(measured) == self._trial_end:
            self._end_trial()
        if self.streamer.modes is None:
            return  # plain PyTorch: nothing to plan
        if kept is not None:
            if self.ranks == 1:  # the plan is final
                self._try_deferral(kept)
        elif len(measured) == 1 + self.PLAN_FROM:
            m = measured[self.PLAN_FROM]
            self._plan = make_plan(self._plan, m, self._disk_rates(m), *self._rooms(), not self.planner_chooses,
                                   disk_room=self._disk_room(), must_recompute=dict(self.streamer.held_on_ctx))
            advice = self._overlap_advice(m)
            if advice:
                self._plan.reasons.append(advice[0])
                self._plan.advised_memory = advice[1]
            self._apply("tiered-offload plan:\n%s")
        elif len(measured) == self._check_at:
            under = measured[-self.CHECK_AFTER:]
            for note in self._plan.check(under):
                self._plan.reasons.append(note)
                log.warning("tiered-offload: %s", note)
            before = [measured[self.PLAN_FROM]]
            judge = self.planner_chooses and not self._revised
            why = self._plan.unearned(before, under) if judge else None
            again = self._plan.measure_again(before, under) if judge and not why else None
            if why:  # the measurement of both choices overrules the model: the modes planned from
                self._revise(why, before)
                self._check_at += self.CHECK_AFTER
            elif again:
                self._again = (under, len(measured) + self.CHECK_AFTER, list(self.streamer.modes))
                self.streamer.modes = list(before[0].modes)
                self._plan.reasons.append(f"the activation modes it replaced measured again for {self.CHECK_AFTER} "
                                          f"steps: {again}")
                log.info("tiered-offload: %s", self._plan.reasons[-1])
            elif self.ranks == 1:  # the plan is final
                self._try_deferral(under)
        elif self.ranks == 1 and len(measured) == self._trial_end:
            self._end_trial()

    def _revise(self, why: str, before: list[StepMeasurement]) -> None:
        """Go back to the modes of ``before`` (measured under them), predicted from the first."""
        self._plan = make_plan(self._plan, before[0], self._disk_rates(before[0]), *self._rooms(), True,
                               disk_room=self._disk_room())
        self._plan.reasons.append(why)
        self._revised = True
        self._apply("tiered-offload plan, measured and revised:\n%s")

    def _end_again(self) -> list[StepMeasurement]:
        """The modes the plan replaced ran again (:meth:`Plan.measure_again`): keep the plan only if
        it ran :attr:`Plan.EARN` faster than they did, by the medians of all their steps. Returns
        the steps of the modes kept."""
        planned, _, modes = self._again
        self._again = None
        before = [self.measured[self.PLAN_FROM]] + self.measured[-self.CHECK_AFTER:]
        why = self._plan.unearned(before, planned)
        if why is None:
            self._plan.reasons.append(self._plan.earned(before, planned))
            self.streamer.modes = modes
            log.info("tiered-offload: %s", self._plan.reasons[-1])
            return planned
        self._revise(why, before)
        for note in self._plan.check(before[1:]):
            self._plan.reasons.append(note)
            log.warning("tiered-offload: %s", note)
        return before[1:]

    # ---- the step mode, measured -------------------------------------------------------------------
    def _try_deferral(self, overlapped: list[StepMeasurement]) -> None:
        """Where the step overlaps the next forward by the planner's choice and the disk bounds it,
        run the next steps deferred instead; after :attr:`CHECK_AFTER` of them the plan keeps the
        mode that measured better (:meth:`Plan.choose_step_mode`). Overlapped, the update may write
        weights that the forward then reads back; deferred, the forward uses them as written, but
        the update no longer runs beside it. Sharded, every rank decides at
        :attr:`SHARDED_TRIAL_AT` and they try only if all would. ``TIERED_OFFLOAD_DEFER_STEP=0``
        never tries; ``=try`` tries whatever the disk's load (``tools/crash_loop.py
        --try-step-modes``: kills across the change)."""
        config, env = self.config, os.environ.get("TIERED_OFFLOAD_DEFER_STEP")
        wanted = (self.streamer.modes is not None and self.streamer.overlap_step and config.overlap_step is None
                  and config.defer_step is None and env != "0"
                  and self.schedule.defer_fits(self.store.capacity(self.store.compute_tier))
                  and (env == "try" or self._disk_bound(overlapped)))
        if self.ranks > 1:
            wanted = self._agree([wanted], "whether to try the step deferred")[0]
        if not wanted:
            return
        self._overlapped, self._trial_end = list(overlapped), len(self.measured) + self.CHECK_AFTER
        self._set_step_mode(False)
        log.info("tiered-offload: trying the step deferred to the next forward for %d steps (the disk was busy "
                 "%.1fx as long as an overlapped step computed)", self.CHECK_AFTER, self._busy(overlapped))

    def _end_trial(self) -> None:
        """The deferred steps are measured: keep the better mode (sharded: deferred only if every
        rank measured it better, so the ranks keep one mode) and say why."""
        deferred = self.measured[-self.CHECK_AFTER:]
        why = self._plan.choose_step_mode(self._overlapped, deferred)
        if self.ranks > 1 and not self._agree([self._plan.defer_step], "the step mode to keep")[0] \
                and self._plan.defer_step:
            self._plan.keep_measured(self._overlapped)
            self._plan.overlap_step, self._plan.defer_step = True, False
            why = why.replace("step deferred to the next forward, measured:", "step overlapped with the next forward, "
                              "as another rank measured it better (the ranks keep one mode); this rank measured:", 1)
        self._plan.reasons.append(why)
        self._set_step_mode(self._plan.overlap_step)
        self._overlapped = self._trial_end = None
        log.info("tiered-offload: %s", why)

    def _set_step_mode(self, overlap: bool) -> None:
        """From the step about to start: overlapped with the next forward, or deferred to it."""
        self.streamer.overlap_step, self.streamer.defer_step = overlap, not overlap
        self._plan.overlap_step, self._plan.defer_step = overlap, not overlap

    @staticmethod
    def _busy(steps: list[StepMeasurement]) -> float:
        """The disk's busy time in these steps against their compute (time less waits for bytes), median."""
        return median([m.disk_busy_seconds / max(m.seconds - m.io_wait_seconds, 1e-9) for m in steps])

    def _disk_bound(self, steps: list[StepMeasurement]) -> bool:
        """Whether the disk was busy :attr:`DISK_BOUND` times these steps' compute or more."""
        return self._busy(steps) >= self.DISK_BOUND

    def _rooms(self) -> tuple[list[int], int]:
        """Per block, the saved-activation bytes its backward may pin, and the most of them kept
        (``forward_backward``: the micro-batches' activations of a block share its room)."""
        room = [self.streamer.activation_room.get(i, 0) // self.streamer.micro_batches
                for i in range(len(self.block_names))]
        return room, max(room, default=0)

    def _disk_room(self) -> int | None:
        """Disk bytes a step's offloaded activations may take: a share of this rank's part of the
        free space, less what its commits need (None: the backend cannot tell)."""
        free = self.store.backend.free_bytes()
        return None if free is None else int(self.DISK_SHARE * max(0, free // self.ranks - self.commit_disk_bytes))

    def _apply(self, message: str) -> None:
        """The plan's modes take effect from the next iteration on; logged."""
        self.streamer.modes = list(self._plan.modes)
        self.streamer.measure_graphs = False
        log.info(message, self._plan.summary())

    def _overlap_advice(self, m: StepMeasurement) -> tuple[str, int] | None:
        """When the step runs inline only because the budget is short (the state does not fit,
        nobody configured it): why, and the budget at which it would overlap the next forward,
        with room for the largest block's saved activations beside it."""
        cap = self.store.capacity(self.store.compute_tier)
        if self.streamer.overlap_step or self.config.overlap_step is not None or self.schedule.fits(cap):
            return None
        tier = self.store.compute_tier.name.lower()
        acts = max(m.graph_bytes, default=0)
        need = self.schedule.overlap_budget(acts)
        how = "each unit just before the forward needs it" if self.streamer.defer_step else "inline"
        why = (f"the step does not overlap the next forward (it runs {how}): the {tier} budget ({format_size(cap)}) "
               f"cannot hold a unit being updated beside the forward, so reads and compute alternate; ")
        if self.schedule.fits(need):  # that much holds the whole state: nothing left to overlap
            state = self.schedule.resident_bytes()  # (its tensors as the tier stores them)
            return why + f"{tier}_memory >= {format_size(state)} ({state} bytes) holds the whole training state", state
        defer = self.schedule.defer_budget()
        sooner = (f"; {tier}_memory >= {format_size(defer)} ({defer} bytes) defers it to the next forward (one read of "
                  f"the weights less per step)") if not self.streamer.defer_step and defer < need else ""
        return why + (f"{tier}_memory >= {format_size(need)} ({need} bytes) lets it overlap the next forward with "
                      f"room for a block's saved activations ({format_size(acts)})") + sooner, need

    def _disk_rates(self, m: StepMeasurement) -> DiskRates:
        """The disk's rates for the plan: the bench-io profile of its file system, else what the
        measured iteration's own transfers achieved (bytes over the time any was in flight)."""
        known = profiled_disk_rates(self.store)
        if known is not None:
            return known
        moved = m.disk_read + m.disk_written
        if moved == 0 or m.disk_busy_seconds <= 0:
            return DiskRates(0.0, 0.0, "none: the measured step moved nothing to or from disk")
        rate = moved / m.disk_busy_seconds
        return DiskRates(rate, rate, "the measured step's own transfers (`tiered-offload bench-io --save-profile` "
                                     "records the disk's best)")

    # ---- reporting ------------------------------------------------------------------------------
    def ran_loop(self, why: str, detail: str = "") -> None:
        """``forward_backward`` ran the micro-batches as the loop (every block read per micro-batch):
        counted by ``why``, logged the first time with ``detail``."""
        if why not in self.loops:  # (an error only a pass raised: a fault of the engine's, so louder)
            log.log(logging.WARNING if " raised " in why else logging.INFO, "forward_backward ran its micro-batches "
                    "as a loop, each block's weights fetched once per micro-batch: %s%s "
                    "(engine.stats().forward_backward_loops counts the calls)", why, f" ({detail})" if detail else "")
        self.loops[why] = self.loops.get(why, 0) + 1

    def stats(self) -> EngineStats:
        """The store's counters and, per measured training step, the medians of time and disk bytes."""
        m = self.measured
        mid = median if m else (lambda xs: None)
        busy = sum(x.disk_busy_seconds for x in m)
        moved = sum(x.disk_read + x.disk_written for x in m)
        return EngineStats(self.store.stats, self.parameter_count, len(m),
                           mid([x.seconds for x in m]), mid([x.disk_read for x in m]),
                           mid([x.disk_written for x in m]), moved / busy if busy > 0 else None,
                           mid([x.link for x in m]), self.floors, dict(self.loops),
                           self.updates_in_backward)
