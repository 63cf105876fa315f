"""The layer-streaming training engine, as parts that each own their state:

* :mod:`.schedule`: unit layouts, the access sequence, phases and the budget arithmetic (no torch);
* :mod:`.binding`: the model split into units, parameters laid out in flat buffers;
* :mod:`.optim_spec`: the user's optimizer (class or instance with parameter groups) as the engine runs it;
* :mod:`.streaming`: forward and backward through the store, block by block (keep, offload or
  recompute activations; buffers);
* :mod:`.activations`: what a block's graph saves for backward, packed into the store;
* :mod:`.planner`: the plan (activation modes, predicted step time and bytes), from measurements;
* :mod:`.stats`: ``engine.stats()``;
* :mod:`.optimizer_step`: one unit's optimizer step, states streamed in pieces;
* :mod:`.pipeline`: the background optimizer step (thread, per-unit events, errors);
* :mod:`.facade`: :class:`Engine`, which composes them with the store and the checkpoint.
"""

from .facade import Engine, empty_init
from .planner import DiskRates, Plan, StepMeasurement
from .schedule import Phase, Schedule, UnitLayout, WorkingSet
from .stats import EngineStats
from .activations import recomputing

__all__ = ["Engine", "empty_init", "Phase", "Schedule", "UnitLayout", "WorkingSet", "Plan", "DiskRates",
           "StepMeasurement", "EngineStats", "recomputing"]
