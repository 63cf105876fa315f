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


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.NAdam, {"lr": 1e-2, "momentum_decay": 6e-3}),
                                         (torch.optim.ASGD, {"lr": 2e-2, "t0": 1})], ids=["NAdam", "ASGD"])
def test_per_parameter_scalar_state_survives_a_resume(tmp_path, cls, kwargs):
    """NAdam's mu_product, ASGD's eta and mu: kept per parameter, saved with every step, bitwise
    after a resume in the middle."""
    def build(model):
        return cls(model.parameters(), **kwargs)
    check_parity(make, build, tmp_path, clip=1.0, host=budget(tmp_path, build), steps=4, resume_at=2)


def test_a_step_cut_short_is_redone_bitwise_with_scalar_state(tmp_path, monkeypatch):
    """NAdam, journal commits, the process dies after two of step 3's units are recorded: the
    resume redoes the rest from the scalars before the step, bitwise as an uninterrupted run."""
    import torch.nn.functional as F

    from test_durable import die_after_records
    from tiered_offload_examples.models import GPT, GPTConfig

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=128, context=32, d_model=32, n_layers=4, n_heads=4))
    host = 16 * sum(p.numel() for p in gpt().parameters()) // 3  # a third of the state: journal commits

    def engine_at(path):
        return Engine(gpt(), torch.optim.NAdam, dict(lr=3e-3, momentum_decay=4e-3), storage=path, host_memory=host)

    def train_to(engine, until):
        while engine.step_count < until:
            x = torch.randint(0, 128, (2, 17))
            engine.backward(F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
    torch.manual_seed(7)
    with engine_at(tmp_path / "ref") as ref:
        train_to(ref, 4)
        expected = dict(ref.named_parameters())
    torch.manual_seed(7)
    engine = engine_at(tmp_path / "s")
    train_to(engine, 2)
    engine.wait_committed()
    die_after_records(engine, 3, 2, train_fn=train_to)
    with Engine.resume(tmp_path / "s", gpt(), host_memory=host) as resumed:  # NAdam and its settings from the state
        assert resumed.step_count == 3
        train_to(resumed, 4)
        got = dict(resumed.named_parameters())
    assert all(torch.equal(got[k], expected[k]) for k in expected)
