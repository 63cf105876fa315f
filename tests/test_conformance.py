"""Every ``torch.optim`` optimizer, with every configuration PyTorch's own tests use (``optim_db``):
through the engine it is exact (bitwise as plain PyTorch: state on disk, a host budget below the
state, 3 steps with clipping) or refused at construction with a ``ConfigError`` naming it.

The list comes from PyTorch, so an optimizer or configuration a new PyTorch adds is covered
without a change here.
"""

from __future__ import annotations

import pytest
import torch

from offload_core.errors import ConfigError
from tiered_offload import Engine
from tiered_offload.engine.optim_spec import ELEMENTWISE

from test_finetune import MLP, TinyLM, check_parity

optim_db = pytest.importorskip("torch.testing._internal.common_optimizers").optim_db

CASES = [pytest.param(info.optim_cls, inp.kwargs, id=f"{info.optim_cls.__name__}-{inp.desc}")
         for info in optim_db for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32)]


def make():
    torch.manual_seed(0)
    return TinyLM(lambda d: MLP(d), d=48, layers=4)


def budget(tmp_path, build) -> int:
    """A third of the state, or the engine's stated minimum where that is more."""
    model = make()
    with Engine(model, build(model), storage=tmp_path / "probe", host_memory=1 << 24) as probe:
        return max(probe.state_bytes() // 3, probe.minimum_budget())


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_optim_db_configuration_is_exact_or_refused(tmp_path, cls, kwargs):
    def build(model):
        return cls(model.parameters(), **kwargs)
    if cls in ELEMENTWISE:
        check_parity(make, build, tmp_path, clip=1.0, host=budget(tmp_path, build))
    else:
        with pytest.raises(ConfigError, match=cls.__name__):  # the class: Muon refuses 1-D parameters itself
            Engine(make(), cls, dict(kwargs), storage=tmp_path / "s", host_memory=1 << 22)
        assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_optim_db_covers_every_torch_optim_optimizer():
    every = {c for c in vars(torch.optim).values()
             if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    assert every <= {p.values[0] for p in CASES}, every - {p.values[0] for p in CASES}
