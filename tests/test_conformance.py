"""Every ``torch.optim`` optimizer, with every configuration PyTorch's own tests use (``optim_db``):
through the engine it is exact (bitwise as plain PyTorch: state on disk, a host budget below the
state, 3 steps with clipping; elementwise ones on pieces of flat buffers, Adafactor and Muon on
whole parameters) or refused at construction with a ``ConfigError`` naming it (LBFGS: a closure;
SparseAdam: sparse gradients).

The list comes from PyTorch, so an optimizer or configuration a new PyTorch adds is covered
without a change here.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from offload_core.errors import CheckpointError, ConfigError
from tiered_offload import Engine
from tiered_offload.engine.optim_spec import ELEMENTWISE, optimizer_mode

from test_finetune import MLP, Block, Habits, TinyLM, check_parity, lm_loss

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


REFUSED = {torch.optim.LBFGS, torch.optim.SparseAdam}
"""The only torch.optim optimizers the engine refuses: LBFGS needs a closure, SparseAdam sparse gradients."""


def builder(cls, kwargs):
    if cls is torch.optim.Muon:  # Muon takes 2-D parameters only (the usual recipe leaves the rest to another)
        return lambda model: cls([p for p in model.parameters() if p.dim() == 2], **kwargs)
    return lambda model: cls(model.parameters(), **kwargs)


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_optim_db_configuration_is_exact_or_refused(tmp_path, cls, kwargs):
    if cls in REFUSED:
        with pytest.raises(ConfigError, match=cls.__name__):
            Engine(make(), cls, dict(kwargs), storage=tmp_path / "s", host_memory=1 << 22)
        assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
        return
    build = builder(cls, kwargs)
    check_parity(make, build, tmp_path, clip=1.0, host=budget(tmp_path, build))


FIRST = {}
for _p in CASES:
    FIRST.setdefault(_p.values[0], _p)


@pytest.mark.parametrize("cls, kwargs", [p for p in FIRST.values() if p.values[0] not in REFUSED])
def test_every_optimizer_trains_at_exactly_the_minimum_budget_it_states(tmp_path, cls, kwargs):
    """The engine's stated minimum is right for every optimizer (a stateless one too): 2 steps at it,
    bitwise."""
    build = builder(cls, kwargs)
    model = make()
    with Engine(model, build(model), storage=tmp_path / "probe", host_memory=1 << 24) as probe:
        smallest = probe.minimum_budget()
    check_parity(make, build, tmp_path, clip=1.0, host=smallest, steps=2)


def test_modes_follow_the_optimizer_not_a_list_of_failures():
    assert {optimizer_mode(c) for c in ELEMENTWISE} == {"elementwise"}
    assert optimizer_mode(torch.optim.Adafactor) == optimizer_mode(torch.optim.Muon) == "per_parameter"

    class Declared(torch.optim.SGD):  # its own step, declared elementwise
        tiered_offload_mode = "elementwise"

        def step(self, closure=None):
            return super().step(closure)
    assert optimizer_mode(Declared) == "elementwise"
    for cls in REFUSED:
        with pytest.raises(ConfigError, match=cls.__name__):
            optimizer_mode(cls)


class SignNorm(torch.optim.Optimizer):
    """A user's optimizer that works on whole parameters: each update is the gradient divided by
    that parameter's norm (not elementwise), with a momentum buffer and a factored row scale."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["rows"] = torch.zeros(p.shape[:1] + (1,) * (p.dim() - 1))
                state["buf"].mul_(0.9).add_(p.grad)
                state["rows"].lerp_(p.grad.square().mean(dim=tuple(range(1, p.dim())), keepdim=True) if p.dim() > 1
                                    else p.grad.square(), 0.1)
                p.add_(state["buf"] / (state["buf"].norm() + 1e-8) / (state["rows"].sqrt() + 1.0), alpha=-group["lr"])


class GlobalNorm(torch.optim.Optimizer):
    """Couples parameters: every update is scaled by the norm over all of them."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))
        for p in ps:
            p.add_(p.grad / total, alpha=-self.param_groups[0]["lr"])


def test_a_users_whole_parameter_optimizer_is_exact_and_survives_a_resume(tmp_path):
    build = lambda model: SignNorm(model.parameters(), lr=3e-2)  # noqa: E731
    check_parity(make, build, tmp_path, clip=1.0, host=budget(tmp_path, build), steps=4, resume_at=2)


def test_an_optimizer_that_couples_parameters_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="GlobalNorm couples parameters"):
        Engine(make(), GlobalNorm, dict(lr=1e-2), storage=tmp_path / "s", host_memory=1 << 22)


def test_muon_over_every_parameter_is_refused_saying_which_it_cannot_step(tmp_path):
    with pytest.raises(ConfigError, match=r"Muon cannot step the model's 1-D parameters.*Build it over"):
        Engine(make(), torch.optim.Muon, {}, storage=tmp_path / "s", host_memory=1 << 22)


def test_adafactor_state_is_its_factored_moments_packed_one_buffer_per_parameter(tmp_path):
    """Adafactor keeps a row and a column vector per matrix: one packed buffer of the parameter's
    size holds them (12 bytes per parameter of state, not Adam's 16), and a resume is bitwise."""
    build = lambda model: torch.optim.Adafactor(model.parameters(), lr=1e-2)  # noqa: E731
    _, ref, _, state = check_parity(make, build, tmp_path, clip=1.0, host=budget(tmp_path, build), steps=4, resume_at=2)
    assert state == 12 * sum(p.numel() for p in ref.parameters())


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


# ---- model families: encoder-decoder -------------------------------------------------------------
# The engine trains with the key/value cache off (``use_cache=False`` on every config of the model:
# the cache is for generation, and a block recomputed in backward would append to it twice). The
# reference is the same model with it off: with it on, PyTorch computes attention from the cache's
# copy of the keys, a different layout, which this CI's CPU (AMD EPYC, AVX-512 MKL) rounds
# differently in the last bit (T5: 1e-9 in one block's query gradient, then everywhere).
def t5(dropout=0.1):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4,
        dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0, use_cache=False))


def bart(dropout=0.1, layerdrop=0.0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=dropout, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop))


def seq2seq_loss(model, ids, route=None):
    ids = ids % 64
    return model(input_ids=ids, labels=ids.flip(1)).loss


def _saved_by_transformers(tmp_path, model):
    """``model`` saved by ``save_pretrained``: transformers 5 writes some models' tensors under
    older names or layouts (GPT-NeoX's head as ``embed_out``; Mixtral's experts one tensor each)
    and converts them when ``from_pretrained`` loads them."""
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _saved_models(transformers):
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 max_position_embeddings=32, use_cache=False)
    moe = dict(small, num_key_value_heads=2, num_experts_per_tok=2)
    return {
        "gpt-neox": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**small)),
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(**moe, num_local_experts=4)),
        "qwen2-moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **moe, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32)),
        "marian": (transformers.MarianMTModel, transformers.MarianConfig(  # sinusoidal positions, not saved
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            decoder_start_token_id=0, pad_token_id=0, use_cache=False)),
    }


@pytest.mark.parametrize("arch", ["gpt-neox", "mixtral", "qwen2-moe", "marian"])
def test_init_from_reads_a_checkpoint_as_transformers_converts_it(tmp_path, arch):
    """What ``save_pretrained`` writes is not always the model's names and layout in transformers
    5: GPT-NeoX's head is ``lm_head`` in the model and ``embed_out`` in the file; an MoE's experts
    are one tensor per layer in the model (``gate_up_proj``: the stacked ``w1`` and ``w3``, or
    ``gate_proj`` and ``up_proj``) and one per expert in the file. ``init_from`` (and
    ``tiered-offload train``) refused such a directory ("parameter(s) missing"); it now renames and
    stacks as ``from_pretrained`` does, reading each expert's tensor into its place: the weights
    ``from_pretrained`` gives, bitwise. Marian's sinusoidal positions are not saved
    (``_keys_to_ignore_on_save``): they were "2 parameter(s) missing"; they are the model's own."""
    transformers = pytest.importorskip("transformers")
    from tiered_offload import Engine
    cls, config = _saved_models(transformers)[arch]
    torch.manual_seed(0)
    path = _saved_by_transformers(tmp_path, cls(config))
    expected = dict(cls.from_pretrained(path).named_parameters())
    torch.manual_seed(1)  # other initial weights: every one must come from the file
    model = cls(config)
    with Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20, init_from=path) as engine:
        got = dict(engine.named_parameters())
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("arch", ["gpt-neox", "mixtral", "qwen2-moe", "marian"])
def test_an_export_is_what_save_pretrained_writes(tmp_path, arch):
    """The other way: ``export_safetensors`` wrote the model's own names and layout (Mixtral's
    ``mlp.experts.gate_up_proj``, one tensor a layer), which transformers 5 loads but transformers 4
    and tools that read the checkpoint format (a serving engine's loader, converters) do not: the
    format ``save_pretrained`` writes is one tensor per expert (``block_sparse_moe.experts.0.w1``).
    An export is now that format, converted a unit at a time as ``save_pretrained`` converts it:
    its tensors are ``save_pretrained``'s, bitwise, it loads, and ``init_from`` reads it back. So is
    ``tiered-offload export`` of the storage directory (the model built on the meta device from the
    ``config.json`` the directory records). What ``save_pretrained`` does not save (Marian's
    sinusoidal positions) is not exported either."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tiered_offload import Engine
    from tiered_offload.cli import main as cli_main
    cls, config = _saved_models(transformers)[arch]
    torch.manual_seed(0)
    model = cls(config)
    expected = load_file(_saved_by_transformers(tmp_path, model) / "model.safetensors")
    weights = dict(model.named_parameters())
    with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20,
                init_from=tmp_path / "hf") as engine:
        engine.export_safetensors(tmp_path / "export", max_shard_size="40KB")
    assert cli_main(["export", str(tmp_path / "s"), str(tmp_path / "offline"), "--max-shard-size", "40KB"]) == 0
    for export in ("export", "offline"):
        got = {}
        for f in sorted((tmp_path / export).glob("*.safetensors")):
            got.update(load_file(f))
        assert set(got) == set(expected), (export, sorted(set(got) ^ set(expected))[:6])
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    loaded = dict(cls.from_pretrained(tmp_path / "export").named_parameters())
    assert all(torch.equal(loaded[k], w) for k, w in weights.items())
    with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "t", host_memory=1 << 20,
                init_from=tmp_path / "export") as engine:
        again = dict(engine.named_parameters())
    assert all(torch.equal(again[k], w) for k, w in weights.items())


def test_init_from_names_the_tensors_it_cannot_convert(tmp_path):
    """A Mixtral checkpoint one expert's tensor short: its layer's experts cannot be stacked.
    Refused, naming the tensors and a way round, before anything is written."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from offload_core.errors import CheckpointError
    from tiered_offload import Engine
    cls, config = _saved_models(transformers)["mixtral"]
    path = _saved_by_transformers(tmp_path, cls(config))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"(?s)layers\.1\..*experts\.0\.w1.*converts.*from_pretrained.*save_file"):
        Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20, init_from=path)
    assert not [f for f in (tmp_path / "s").rglob("*") if f.is_file() and f.parent.name != ".tiered-offload"]


def as_pytorch_files(directory, *, bf16: bool = False):
    """``directory``'s safetensors rewritten in PyTorch's format, as older transformers wrote it:
    ``pytorch_model.bin``, or shards with ``pytorch_model.bin.index.json`` (one 2-D tensor saved
    as a strided view, ``bf16`` every floating tensor in bfloat16)."""
    from safetensors.torch import load_file
    index = directory / "model.safetensors.index.json"
    shards = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
              else ["model.safetensors"])
    weight_map = {}
    for shard in shards:
        tensors = load_file(directory / shard)
        for k, t in tensors.items():
            tensors[k] = t.to(torch.bfloat16) if bf16 and t.is_floating_point() else t
        name = next(k for k, t in tensors.items() if t.ndim == 2)
        tensors[name] = tensors[name].t().contiguous().t()  # (the same values, other strides)
        target = "pytorch_model.bin" if len(shards) == 1 else shard.replace("model-", "pytorch_model-").replace(
            ".safetensors", ".bin")
        torch.save(tensors, directory / target)
        weight_map.update(dict.fromkeys(tensors, target))
        (directory / shard).unlink()
    if index.exists():
        index.unlink()
        (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("arch,layout", [("gpt-neox", "one file"), ("mixtral", "shards"), ("gpt-neox", "bf16")])
def test_init_from_reads_pytorch_files_as_from_pretrained_does(tmp_path, arch, layout):
    """Many Hugging Face models still ship PyTorch's files only (``pytorch_model.bin``, or its
    shards and ``pytorch_model.bin.index.json``). ``init_from`` refused such a directory ("holds
    neither model.safetensors nor a *.safetensors.index.json"), and the way round it named,
    ``save_pretrained``, needs the whole model in memory. They are now read as ``from_pretrained``
    reads them, memory-mapped a tensor at a time: the weights ``from_pretrained`` gives, bitwise
    (renamed and stacked as for safetensors; a bfloat16 file cast; a strided tensor read). A file
    given by name is read too."""
    transformers = pytest.importorskip("transformers")
    from tiered_offload import Engine
    cls, config = _saved_models(transformers)[arch]
    torch.manual_seed(0)
    path = _saved_by_transformers(tmp_path, cls(config))
    if layout == "shards":
        cls.from_pretrained(path).save_pretrained(path, max_shard_size="40KB")
        (path / "model.safetensors").unlink()
    as_pytorch_files(path, bf16=layout == "bf16")
    assert not list(path.glob("*.safetensors*")) and list(path.glob("pytorch_model*"))
    expected = dict(cls.from_pretrained(path).named_parameters())
    sources = [path] + ([path / "pytorch_model.bin"] if layout == "one file" else [])
    for i, source in enumerate(sources):
        torch.manual_seed(1)  # other initial weights: every one must come from the file
        with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / f"s{i}", host_memory=1 << 20,
                    init_from=source) as engine:
            got = dict(engine.named_parameters())
        assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected), source


def test_init_from_a_language_models_checkpoint_starts_a_new_task_head_as_from_pretrained(tmp_path, caplog):
    """A reward model or a classifier starts from a language model's checkpoint:
    ``LlamaForSequenceClassification`` from a ``LlamaForCausalLM`` directory, whose file has no
    ``score.weight``. ``from_pretrained`` starts the head as the model initialises it and warns;
    ``init_from`` refused ("1 parameter(s) missing (score.weight)"). Parameters outside the model's
    trunk (``base_model_prefix``) that the file lacks now start as the model holds them (its own
    initialisation; under ``empty_init``, initialised), named in a warning: the weights are
    ``load_state_dict(file, strict=False)``'s, bitwise. A file that lacks any of the trunk's
    parameters is refused as before."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from tiered_offload import Engine, empty_init
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, num_labels=3,
                                      pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    torch.manual_seed(5)
    reference = transformers.LlamaForSequenceClassification(config)
    torch.manual_seed(5)
    model = transformers.LlamaForSequenceClassification(config)
    assert reference.load_state_dict(load_file(tmp_path / "lm" / "model.safetensors"), strict=False).missing_keys == [
        "score.weight"]
    with caplog.at_level("WARNING"), Engine(model, torch.optim.AdamW, {}, storage=tmp_path / "s",
                                             host_memory=1 << 20, init_from=tmp_path / "lm") as engine:
        got = dict(engine.named_parameters())
    assert all(torch.equal(got[k], p) for k, p in reference.named_parameters())
    assert re.search(r"does not hold 1 parameter\(s\) outside the model's trunk \(score\.weight\)", caplog.text)
    with empty_init():
        bare = transformers.LlamaForSequenceClassification(config)
    with Engine(bare, torch.optim.AdamW, {}, storage=tmp_path / "t", host_memory=1 << 20,
                init_from=tmp_path / "lm") as engine:
        head = dict(engine.named_parameters())["score.weight"]
    assert 0.5 * config.initializer_range < head.std().item() < 2 * config.initializer_range
    tensors = load_file(tmp_path / "lm" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "lm" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"2 parameter\(s\) missing \(model\.layers\.1\.mlp\.up_proj\.weight, "
                                              r"score\.weight\)"):
        Engine(transformers.LlamaForSequenceClassification(config), torch.optim.AdamW, {}, storage=tmp_path / "u",
               host_memory=1 << 20, init_from=tmp_path / "lm")


def test_init_from_adds_or_strips_the_trunks_prefix_as_from_pretrained(tmp_path):
    """A checkpoint of the trunk alone (``LlamaModel``: ``layers.0...``) read into a model with a
    head (``model.layers.0...``), and the other way: ``from_pretrained`` adds or strips the
    ``base_model_prefix``; ``init_from`` refused both ("parameter(s) missing"). It now names them
    as ``from_pretrained`` does: the trunk's weights bitwise ``from_pretrained``'s, a head the file
    lacks as the model holds it."""
    transformers = pytest.importorskip("transformers")
    from tiered_offload import Engine
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=False)
    transformers.LlamaModel(config).save_pretrained(tmp_path / "trunk")
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    for cls, path in ((transformers.LlamaForCausalLM, tmp_path / "trunk"), (transformers.LlamaModel, tmp_path / "lm")):
        expected = dict(cls.from_pretrained(path).named_parameters())
        torch.manual_seed(3)
        own = dict(cls(config).named_parameters())
        torch.manual_seed(3)
        with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / cls.__name__, host_memory=1 << 20,
                    init_from=path) as engine:
            got = dict(engine.named_parameters())
        assert list(got) == list(expected)
        assert all(torch.equal(got[k], own[k] if k == "lm_head.weight" else expected[k]) for k in expected), cls


def test_init_from_picks_the_files_from_pretrained_picks(tmp_path):
    """A directory can hold more than one set of weights: a single file beside an index (another
    tool's save), Mistral's ``consolidated.safetensors.index.json`` beside ``model.safetensors.index.json``
    (other names), PyTorch's copies. ``init_from`` took the first ``*.safetensors.index.json`` by
    name: the consolidated index (whose names and shards are not the model's), or stale shards
    where ``from_pretrained`` reads ``model.safetensors``. It now picks as ``from_pretrained`` does:
    ``model.safetensors``, its index, ``pytorch_model.bin``, its index."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from tiered_offload import Engine
    cls, config = _saved_models(transformers)["gpt-neox"]
    torch.manual_seed(0)
    path = _saved_by_transformers(tmp_path, cls(config))
    torch.manual_seed(2)
    cls(config).save_pretrained(tmp_path / "other", max_shard_size="40KB")  # other weights, in shards
    for f in (tmp_path / "other").glob("model*"):
        shutil.copy(f, path / f.name)
    consolidated = {k.replace("gpt_neox.", "native."): v for k, v in load_file(path / "model.safetensors").items()}
    save_file(consolidated, path / "consolidated-00001-of-00001.safetensors")
    (path / "consolidated.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(consolidated, "consolidated-00001-of-00001.safetensors")}))
    for step in ("single file", "index"):
        expected = dict(cls.from_pretrained(path).named_parameters())
        with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / step, host_memory=1 << 20,
                    init_from=path) as engine:
            got = dict(engine.named_parameters())
        assert all(torch.equal(got[k], expected[k]) for k in expected), step
        (path / "model.safetensors").unlink(missing_ok=True)  # then the index's shards, as from_pretrained


@pytest.mark.parametrize("fmt", ["safetensors", "pytorch"])
def test_a_quantized_checkpoint_is_refused_naming_its_tensors_and_an_unused_odd_dtype_is_passed_over(tmp_path, fmt):
    """An FP8 checkpoint (DeepSeek-V3's, Qwen3-FP8's: weights in ``F8_E4M3`` beside their scales,
    the config's ``quantization_config``) stopped with "tensor ... has a malformed header entry":
    as if the file were damaged. Casting the weights without their scales would be wrong, so it is
    refused, naming the tensors, their dtype and what to start from instead. A tensor of a dtype
    the reader does not know that the model does not need (a ``U16`` beside the weights) no longer
    stops the read."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from tiered_offload import Engine
    cls, config = _saved_models(transformers)["gpt-neox"]
    torch.manual_seed(0)
    path = _saved_by_transformers(tmp_path, cls(config))
    tensors = load_file(path / "model.safetensors")
    expected = dict(cls.from_pretrained(path).named_parameters())
    (path / "model.safetensors").unlink()

    def save(tensors):
        if fmt == "safetensors":
            save_file(tensors, path / "model.safetensors")
        else:
            torch.save(tensors, path / "pytorch_model.bin")
    save(dict(tensors, extra=torch.zeros(4, dtype=torch.uint16)))
    with Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20,
                init_from=path) as engine:
        got = dict(engine.named_parameters())
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    linear = [k for k, v in tensors.items() if ".layers." in k and v.ndim == 2]
    quantized = {k: (v.to(torch.float8_e4m3fn) if k in linear else v) for k, v in tensors.items()}
    quantized.update({k + "_scale_inv": torch.ones(1) for k in linear})
    save(quantized)
    with pytest.raises(CheckpointError, match=r"gpt_neox\.layers\.0\.attention\.dense\.weight: stored as "
                                              r"(F8_E4M3|torch\.float8_e4m3fn).*a "
                                              r"quantized checkpoint .* start from the model's weights in bf16, fp16 "
                                              r"or fp32"):
        Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "t", host_memory=1 << 20, init_from=path)
    # bitsandbytes' 8 bits: int8 weights under the weights' names beside their scales (SCB). They were read, cast
    # to fp32 (weights of -127..127), without a word
    eight = {k: ((v / v.abs().amax(1, keepdim=True) * 127).round().to(torch.int8) if k in linear else v)
             for k, v in tensors.items()}
    save(dict(eight, **{k.removesuffix(".weight") + ".SCB": tensors[k].abs().amax(1) for k in linear}))
    with pytest.raises(CheckpointError, match=r"dense\.weight: stored as (I8|torch\.int8).*a quantized checkpoint"):
        Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "u", host_memory=1 << 20, init_from=path)
    # a config that says quantized (from_pretrained would quantize the weights as it loads them)
    save(tensors)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(saved, quantization_config={"quant_method": "bitsandbytes",
                                                                                  "load_in_8bit": True})))
    with pytest.raises(CheckpointError, match=r"config\.json.*quantization_config: bitsandbytes.*bf16, fp16 or fp32"):
        Engine(cls(config), torch.optim.AdamW, {}, storage=tmp_path / "v", host_memory=1 << 20, init_from=path)


def as_mxfp4(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint ``save_pretrained`` wrote in ``path`` (gpt-oss) as OpenAI ships it: each
    expert weight as MXFP4 (random 4-bit values and scales), the config's ``quantization_config``
    ``mxfp4``. Returns the file's tensors."""
    from safetensors.torch import load_file, save_file
    packed, g = {}, torch.Generator().manual_seed(0)
    for k, v in load_file(path / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out] -> [experts, out, in/32, 16]
            packed[k + "_blocks"] = torch.randint(0, 256, (v.shape[0], v.shape[2], v.shape[1] // 32, 16), generator=g,
                                                  dtype=torch.uint8)
            packed[k + "_scales"] = torch.randint(120, 131, packed[k + "_blocks"].shape[:-1], generator=g,
                                                  dtype=torch.uint8)
        else:
            packed[k] = v
    save_file(packed, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return packed


def as_fp8(path: Path, block: int = 16) -> None:
    """The checkpoint in ``path`` as fine-grained FP8 (DeepSeek-V3's, Qwen3-FP8's layout): each
    linear layer's weight in ``float8_e4m3fn`` with an fp32 ``weight_scale_inv`` a block of
    ``block`` x ``block``, the config's ``quantization_config`` ``fp8``."""
    from safetensors.torch import load_file, save_file
    out = {}
    for k, v in load_file(path / "model.safetensors").items():
        if k.endswith("proj.weight"):
            r, c = v.shape
            grid = v.reshape(r // block, block, c // block, block)
            scale = grid.abs().amax(dim=(1, 3)) / 448
            out[k] = (grid / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
            out[k + "_scale_inv"] = scale
        else:
            out[k] = v
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block],
                                     "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))


def test_init_from_dequantizes_an_fp8_checkpoint_as_from_pretrained_does(tmp_path):
    """A fine-grained FP8 checkpoint (``quantization_config: fp8``: weights in ``float8_e4m3fn``,
    a scale a block) was refused. ``init_from`` now reads it as ``from_pretrained(...,
    quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)`` does, with
    transformers' own dequantization: bitwise."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    from tiered_offload import Engine, empty_init
    from test_finetune import _llama8
    path = _saved_by_transformers(tmp_path, _llama8())
    as_fp8(path)
    expected = dict(transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32).named_parameters())
    with empty_init():
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    with Engine(built, torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20, init_from=path) as engine:
        got = dict(engine.named_parameters())
    assert list(got) == list(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    from safetensors.torch import load_file, save_file  # a scale grid with partial blocks: transformers refuses it too
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(3, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight \[32, 32\] has a scale grid \[3, 2\] that does not"):
        Engine(_llama8(), torch.optim.AdamW, {}, storage=tmp_path / "t", host_memory=1 << 20, init_from=path)


def test_init_from_dequantizes_an_mxfp4_checkpoint_as_from_pretrained_does(tmp_path):
    """gpt-oss as OpenAI ships it: the experts in MXFP4 (``X_blocks``: two 4-bit values a byte,
    ``X_scales``: a power of two a group of 32), the config's ``quantization_config`` ``mxfp4``.
    ``init_from`` read them as ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
    does (bitwise; transformers' own dequantization, one expert at a time), and the export's
    ``config.json`` has no ``quantization_config``: its weights are plain, ``from_pretrained`` reads
    them back. A pair that is not MXFP4's layout is refused, naming it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.mxfp4")
    from safetensors.torch import save_file
    from tiered_offload import Engine, empty_init
    from test_finetune import _gpt_oss
    path = _saved_by_transformers(tmp_path, _gpt_oss())
    packed = as_mxfp4(path)
    expected = dict(transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).named_parameters())
    with empty_init():
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    with Engine(built, torch.optim.AdamW, {}, storage=tmp_path / "s", host_memory=1 << 20, init_from=path) as engine:
        got = dict(engine.named_parameters())
        engine.export_safetensors(tmp_path / "out")
    assert list(got) == list(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    again = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    assert all(torch.equal(again[k], expected[k]) for k in expected)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    save_file(dict(packed, **{name: packed[name][:, :1].clone()}), path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj_blocks .* not MXFP4's layout"):
        Engine(_gpt_oss(), torch.optim.AdamW, {}, storage=tmp_path / "t", host_memory=1 << 20, init_from=path)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_an_input_gradient_through_an_encoder_decoder_is_pytorchs(tmp_path, activations):
    """``torch.autograd.grad`` of the loss for the decoder's embeddings through T5's streamed
    stacks (the encoder's output and the position bias taken by several blocks): PyTorch's input
    gradients, bitwise, no weight's gradient added, and the training step after it PyTorch's."""
    from test_engine import one_step
    from tiered_offload import Engine, EngineConfig
    ref = t5(dropout=0.0)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    state = 16 * sum(p.numel() for p in ref.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=state // 3,
                    durable=False, config=EngineConfig(activations=activations))
    saved = {}
    for m in (ref, model):
        m.get_decoder().embed_tokens.register_forward_hook(lambda mod, args, out: saved.update(e=out))
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randint(0, 64, (2, 9), generator=g)
        grads = []
        for m in (ref, engine):
            grads.append(torch.autograd.grad(seq2seq_loss(m, x), saved["e"])[0])
            one_step(m, seq2seq_loss(m, x), opt)
        assert torch.equal(grads[0], grads[1]), step
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("make_model", [t5, bart], ids=["T5", "BART"])
@pytest.mark.parametrize("activations", ["auto", "recompute", "offload"])
def test_encoder_decoder_trains_bitwise_at_a_third_of_its_state(tmp_path, make_model, activations):
    """Both stacks stream (the decoder's blocks take the encoder's output, T5's blocks pass their
    position bias on), with dropout, at a third of the state: bitwise as PyTorch."""
    from tiered_offload import EngineConfig

    def inspect(engine):
        names = [u.qualname for u in engine.units if u.module is not None]
        assert any(".encoder." in f".{n}." for n in names) and any(".decoder." in f".{n}." for n in names), names
    check_parity(make_model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=seq2seq_loss,
                 clip=1.0, host_fraction=1 / 3, config=EngineConfig(activations=activations), inspect=inspect)


def test_a_loss_on_the_encoder_alone_trains_bitwise(tmp_path):
    """``model.get_encoder()(ids)`` (an encoder's embeddings trained on their own, as generate()
    calls it): it stopped with "shared.weight: embedding reads its values outside the engine's
    calls", the rest bound only on the model's own calls. The encoder's calls are the engine's."""
    from tiered_offload import Engine
    ref = t5(dropout=0.0)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / "s",
                    host_memory=int(16 * sum(p.numel() for p in ref.parameters()) * 0.4))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(1, 64, (2, 9), generator=g)
        loss = ref.get_encoder()(input_ids=ids).last_hidden_state.pow(2).mean()
        loss.backward()
        opt.step(), opt.zero_grad()
        mine = model.get_encoder()(input_ids=ids).last_hidden_state.pow(2).mean()
        engine.backward(mine)
        engine.step(), engine.zero_grad()
        assert mine.item() == loss.item()
    weights = dict(engine.named_parameters())
    engine.close()
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


@pytest.mark.parametrize("activations", ["recompute", "keep"])
def test_an_encoder_decoder_under_autocast_sums_the_encoders_gradient_use_by_use(tmp_path, activations):
    """Under autocast a block's input is given to the block as a copy (``as_layer_outputs``), so that
    each use casts it afresh, as a layer's output is in PyTorch. The encoder's output, read by every
    decoder block's cross-attention twice (keys, values), then got its uses inside a block added on
    the copy, and the sum the later blocks' backwards handed on added to that: (sum + (k + v)), where
    PyTorch adds ((sum + k) + v). Other bits in the encoder's gradients, on the weights a clipped
    step left (``tools/fuzz_options.py --wide``, seed 85159: BART, bf16 autocast, clipping). The
    running sum now seeds the copy's gradient, the uses' sum, as the unclipped runs did by chance."""
    from tiered_offload import EngineConfig
    check_parity(functools.partial(bart, dropout=0.0), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), tmp_path,
                 loss_fn=seq2seq_loss, steps=2, clip=1.0, habits=Habits(autocast=True),
                 config=EngineConfig(activations=activations))


@pytest.mark.parametrize("make_model", [t5, bart], ids=["T5", "BART"])
def test_encoder_decoder_forward_backward_bitwise(tmp_path, make_model, monkeypatch):
    """forward_backward over 3 micro-batches through both stacks (the encoder's output read by
    every decoder block of every micro-batch, chained per micro-batch): bitwise as PyTorch's loop.
    BART's stacks draw a random number before each layer in training with LayerDrop on
    (``torch.rand``; transformers before 5.25 at ``layerdrop=0`` too; here 1e-9, which draws and
    drops nothing): its first step runs the loop, which learns the draws, and the second draws the
    loop's numbers with the micro-batches side by side."""
    from tiered_offload.engine import micro_batches
    as_loop, loop = [], micro_batches._loop
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: as_loop.append(1) or loop(*a))
    make = functools.partial(make_model, dropout=0.0, **({"layerdrop": 1e-9} if make_model is bart else {}))
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path,
                 loss_fn=seq2seq_loss, clip=1.0, host_fraction=1 / 3, accumulate=3, steps=2, fused=True)
    model, before = make().train(), torch.get_rng_state()
    seq2seq_loss(model, torch.arange(8).view(1, 8))
    draws = not torch.equal(before, torch.get_rng_state())
    assert draws == (make_model is bart)
    assert as_loop == ([1] if draws else [])  # T5: no step ran the loop; BART: the first



@pytest.mark.parametrize("name", ["llava", "mllama"])
@pytest.mark.parametrize("fused", [False, True], ids=["loop", "forward_backward"])
def test_a_vision_language_model_streams_both_towers_bitwise(tmp_path, name, fused):
    """A vision tower before a language model (LLaVA: CLIP's layers, then Llama's; Mllama: the
    image read by cross-attention layers among the language model's): both block sequences stream,
    and training is PyTorch's bitwise, by the loop and by ``forward_backward``. The definitions are
    ``tools/conformance_sweep.py``'s (which also runs Qwen2-VL, Qwen2.5-VL and Gemma 3's)."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import conformance_sweep

    config_cls, model_cls, kwargs, loss, _ = conformance_sweep.cases()[name]

    def make():
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))

    def inspect(engine):
        names = [u.qualname for u in engine.units if u.module is not None]
        assert any("vision" in n for n in names) and any("language_model" in n for n in names), names
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=loss, accumulate=2,
                 clip=1.0, host_fraction=0.4, fused=fused, inspect=inspect)

class Memory(torch.nn.Module):
    """A block that reads a tensor every block shares (as a decoder reads the encoder's output),
    twice, and returns a mask-like tensor that requires no gradient."""

    def __init__(self, d=16):
        super().__init__()
        self.k, self.v, self.q = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, h, memory):
        att = torch.softmax(self.q(h) @ self.k(memory).transpose(1, 2), -1)
        return h + att @ self.v(memory), (memory.detach() > 0)


class SharedMemoryLM(torch.nn.Module):
    def __init__(self, d=16, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(64, d)
        self.encoder = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(Memory(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 64)
        self.ignore_last = self.hold_ignored = False

    def forward(self, ids):
        h = self.emb(ids)
        memory = torch.tanh(self.encoder(h))
        for i, block in enumerate(self.blocks):
            out, mask = block(h, memory)
            assert not mask.requires_grad  # as in PyTorch: kernels choose their path by it
            if not (self.ignore_last and i == len(self.blocks) - 1):
                h = out
            elif self.hold_ignored:
                self.ignored = out  # its graph lives on, outside the loss
        return self.head(h)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_tensor_every_block_reads_gets_its_gradient_in_pytorchs_order(tmp_path, activations):
    """The gradient of a tensor several streamed blocks read (each twice) is PyTorch's sum, added
    use by use in backward's order, not block by block: bitwise."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return SharedMemoryLM()
    check_parity(make, lambda m: torch.optim.SGD(m.parameters(), lr=0.5), tmp_path, clip=1.0, host_fraction=0.5,
                 config=EngineConfig(activations=activations, stream_modules_numel=None))


@pytest.mark.parametrize("held", [False, True])
def test_a_block_that_reads_a_shared_tensor_but_misses_the_loss(tmp_path, held):
    """The last block reads the shared tensor and its output is thrown away. Its graph dropped in
    the forward, it no longer counts among the tensor's users (``SharedInputs.dropped``): the
    gradient is PyTorch's, bitwise (before, a TensorStateError). Its output held outside the loss,
    its backward never runs and the shared tensor's gradient could not be returned in PyTorch's
    order: a typed error, not a silently different gradient."""
    from offload_core.errors import TensorStateError
    from tiered_offload import EngineConfig

    torch.manual_seed(0)
    ref = SharedMemoryLM()
    ref.ignore_last = True
    model = copy.deepcopy(ref)
    model.hold_ignored = held
    x = torch.randint(0, 64, (2, 8))
    ref(x).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    with Engine(model, torch.optim.SGD, dict(lr=0.1), storage=tmp_path / "s", host_memory=16 * 4 * 8000,
                recompute=True, config=EngineConfig(stream_modules_numel=None)) as engine:
        if held:
            with pytest.raises(TensorStateError, match="several streamed blocks"):
                engine.backward(engine(x).sum())
            return
        engine.backward(engine(x).sum())
        engine.step()
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


# ---- a model's forward that reads its blocks' attributes ------------------------------------------
class TorchEncoderLM(torch.nn.Module):
    """PyTorch's own ``nn.TransformerEncoder``: its forward reads the first layer's attributes
    (``layers[0].self_attn.batch_first``, to choose its fast path)."""

    def __init__(self, dropout=0.1, norm_first=True, d=32):
        super().__init__()
        self.emb = torch.nn.Embedding(64, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=dropout, batch_first=True, norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 64)

    def forward(self, ids, route=None):
        return self.head(self.encoder(self.emb(ids)))


class RepeatingLM(TinyLM):
    """Reads a flag of each block's part before calling it, as Gemma's decoder reads
    ``layer.self_attn.is_kv_shared_layer``; calls the flagged blocks twice (a weight-shared loop)."""

    def __init__(self):
        super().__init__(lambda d: MLP(d), d=32, layers=4)
        for i, block in enumerate(self.blocks):
            block.ffn.doubled = i % 2 == 1

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h) if not block.ffn.doubled else block(block(h))
        return self.head(self.norm(h))


@pytest.mark.parametrize("make_model", [TorchEncoderLM, RepeatingLM], ids=["nn.TransformerEncoder", "repeats"])
@pytest.mark.parametrize("activations, fused", [("recompute", False), ("offload", False), ("recompute", True)])
def test_a_forward_that_reads_its_blocks_attributes_trains_bitwise(tmp_path, make_model, activations, fused):
    """A streamed block is a stand-in in the model's tree (its weights live in the store); reading
    an attribute of it (``self_attn.batch_first``, a flag, a submodule) reads the real block's. It
    failed: "'_BlockProxy' object has no attribute 'self_attn'".

    A block called twice before a backward: PyTorch sums a weight's two gradients, then adds the
    sum to what ``.grad`` holds; the engine added each call's into the buffer in turn, other bits
    from the second micro-batch on (silently). Now it sums them first too, also in a pass."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return make_model()
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=3,
                 fused=fused, config=EngineConfig(activations=activations))


@pytest.mark.parametrize("activations, fused", [("recompute", False), ("offload", False), ("recompute", True),
                                                ("offload", True)])
def test_a_block_called_twice_under_autocast_sums_its_casts_gradients_as_pytorch(tmp_path, activations, fused):
    """A weight-shared block under bf16 autocast: PyTorch casts each weight once in the region and
    sums the two calls' gradients of the cast in bf16. The engine summed them in fp32 (other bits
    in the loop); and in a ``forward_backward`` pass, where each micro-batch's forward is a region
    of its own, as in the loop around it. Bitwise now (``repeated_calls.autocast_region``)."""
    from test_finetune import Habits
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return RepeatingLM()
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=3,
                 fused=fused, config=EngineConfig(activations=activations), habits=Habits(autocast=True))


@pytest.mark.parametrize("activations, fused, autocast", [("offload", False, False), ("recompute", True, True)])
def test_albert_whose_layer_groups_each_run_two_layers_trains_bitwise(tmp_path, activations, fused, autocast):
    """ALBERT shares its layers' weights across depth: each of its layer groups (the streamed
    blocks) runs two of its 8 layers, so the engine meets every block twice a forward and sums the
    two calls' gradients (in bf16 under autocast) as PyTorch's graph does. With dropout, a resume,
    at a budget of 3/4 of the state (the groups are 92% of it)."""
    from test_finetune import hf_loss, make_albert
    from tiered_offload import EngineConfig

    def four_groups_streamed(engine):
        assert engine.activation_modes == [activations] * 4
    check_parity(lambda: make_albert(0.1), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path,
                 loss_fn=hf_loss, accumulate=2, clip=1.0, fused=fused, resume_at=2, host_fraction=0.75,
                 config=EngineConfig(activations=activations), habits=Habits(autocast=autocast),
                 inspect=four_groups_streamed)


def parametrized_lm(kind: str) -> TinyLM:
    """A model whose linear layers compute their weights from parameters at each call
    (``torch.nn.utils.parametrizations``): ``weight_norm`` (a magnitude and a direction) or
    ``spectral_norm`` (whose training forward also updates two buffers, a power iteration's)."""
    parametrize = getattr(torch.nn.utils.parametrizations, kind)
    torch.manual_seed(0)
    return TinyLM(lambda d: MLP(d, lambda i, o: parametrize(torch.nn.Linear(i, o))), d=32)


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("activations, fused, autocast", [("recompute", False, False), ("offload", True, True)])
def test_weights_computed_by_a_parametrization_train_bitwise(tmp_path, kind, activations, fused, autocast):
    """``weight_norm`` and ``spectral_norm`` layers in every block: the parameters are the
    parametrization's originals, the weight a function of them at each call; spectral_norm's
    power-iteration buffers advance once a training forward, also where the engine recomputes the
    block, and survive a resume."""
    from tiered_offload import EngineConfig
    check_parity(lambda: parametrized_lm(kind), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path,
                 accumulate=2, clip=1.0, fused=fused, resume_at=2, host_fraction=0.6,
                 config=EngineConfig(activations=activations), habits=Habits(autocast=autocast))


class SquareTwice(torch.nn.Module):
    """A block part that applies one linear layer twice (a weight read twice in a call)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, route=None):
        return self.lin(torch.nn.functional.gelu(self.lin(x)))


@pytest.mark.parametrize("regions", ["one", "each"])
def test_a_weight_read_twice_in_a_block_called_twice_in_one_autocast_region_is_refused(tmp_path, regions):
    """Two forwards in one bf16 autocast region through blocks that read a weight's cast twice in a
    call: PyTorch adds the four uses' gradients to the shared cast's bf16 sum one at a time, the
    engine a call's two first; refused at the backward, naming the block, the weight and the fix.
    In a region each (separate casts, summed in fp32) it trains bitwise."""
    from test_finetune import batches, lm_loss

    def make():
        torch.manual_seed(0)
        return TinyLM(SquareTwice, d=32, layers=4)
    ref, model = make(), make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    state = 16 * sum(p.numel() for p in model.parameters())
    engine = Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(0.4 * state))
    with engine:
        for step in batches(2, 2):
            for ids, _ in step:
                for forward, backward in ((ref, torch.Tensor.backward), (engine, engine.backward)):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = lm_loss(forward, ids)
                        if regions == "one":
                            loss = loss + lm_loss(forward, ids.flip(0))
                    if regions == "each":
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            loss = loss + lm_loss(forward, ids.flip(0))
                    if regions == "one" and forward is engine:
                        refused = r"block block\.3 was called 2 times .* one torch\.autocast region and reads "
                        with pytest.raises(ConfigError, match=refused + r"ffn\.lin\.bias .* region of its own"):
                            backward(loss)
                        return
                    backward(loss)
            opt.step(), engine.step()
            opt.zero_grad(), engine.zero_grad()
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


class RepeatingSquareLM(RepeatingLM):
    """:class:`RepeatingLM` whose blocks apply one linear layer twice (:class:`SquareTwice`)."""

    def __init__(self):
        TinyLM.__init__(self, SquareTwice, d=32, layers=4)
        for i, block in enumerate(self.blocks):
            block.ffn.doubled = i % 2 == 1


def _rwkv():
    transformers = pytest.importorskip("transformers")
    return transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32, intermediate_size=64,
        context_length=32, use_cache=False))


def _squared():
    return TinyLM(SquareTwice, d=32, layers=4)


def _spectral():
    return parametrized_lm("spectral_norm")


@pytest.mark.parametrize("make, activations", [
    (_squared, "recompute"), (_squared, "offload"), (_squared, "keep"), (RepeatingSquareLM, "recompute"),
    (RepeatingSquareLM, "offload"), (_spectral, "recompute"), (_spectral, "keep"), (_rwkv, "recompute")],
    ids=["two-forwards-recompute", "two-forwards-offload", "two-forwards-keep", "block-twice-recompute",
         "block-twice-offload", "spectral-norm-recompute", "spectral-norm-keep", "rwkv-two-forwards-recompute"])
def test_a_weight_read_twice_in_a_call_of_a_block_called_twice_sums_its_uses_in_pytorchs_order(tmp_path, make,
                                                                                                activations):
    """A block that reads a weight twice in a call (a layer applied twice; spectral_norm's weight,
    read for its norm and divided by it; RWKV's time mixing), called twice before a backward (two
    forwards, a weight-shared loop). PyTorch adds the four uses' gradients one at a time, the later
    call's first: ``((d + c) + b) + a``. The engine summed each call's uses first: ``(d + c) + (b +
    a)``, other bits, silently (``tools/fuzz_options.py --zoo`` seeds 111079, 111265, 111337; RWKV
    in ``tools/conformance_sweep.py --twice``). Now the calls' sum so far is the first gradient each
    later call's backward adds to."""
    from test_finetune import Habits, hf_loss, lm_loss
    from tiered_offload import EngineConfig

    def seeded():
        torch.manual_seed(0)
        return make()
    twice = make is not RepeatingSquareLM
    check_parity(seeded, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, accumulate=2, clip=1.0,
                 host_fraction=0.6, config=EngineConfig(activations=activations), habits=Habits(twice=twice),
                 loss_fn=hf_loss if make is _rwkv else lm_loss)


@pytest.mark.parametrize("thread", ["same", "another"])
def test_the_calls_sum_reaches_a_weight_before_the_calls_uses_whatever_thread_runs_the_backward(thread):
    """``first_arrivals`` makes a call's backward start a weight's gradient from the earlier calls'
    sum. Autograd runs independent ready nodes latest-made first, by a counter each thread keeps:
    a backward on another thread than the forward's (autograd's CUDA device thread) would run a
    root made there (an alias of the weight carrying the sum, the first version) after the call's
    nodes, adding the sum last, other bits; the sum now comes from a node the call's nodes wait for."""
    import threading

    from tiered_offload.engine.repeated_calls import first_arrivals
    torch.manual_seed(0)
    w, x = torch.randn(32, 32, requires_grad=True), torch.randn(4, 32)

    def call(h, w):
        return torch.nn.functional.gelu(h @ w.t()) @ w.t()
    h1 = call(x, w)
    out, g = call(h1, w), torch.randn(4, 32)
    expected = torch.autograd.grad(out, w, g)[0]  # PyTorch: the four uses in turn, the second call's first
    w2, h = w.detach().requires_grad_(), h1.detach().requires_grad_()
    torch.autograd.backward([call(h, w2)], [g], inputs=[w2, h])  # the second call's backward first
    for _ in range(1000):  # (this thread's counter runs ahead of a fresh thread's)
        torch.ones(1, requires_grad=True) * 2
    w1 = w.detach().requires_grad_()
    pairs = [(call(x, w1), h.grad)]

    def backward():
        primed = first_arrivals({"w": w1}, {"w": w2.grad}, pairs)
        torch.autograd.backward([o for o, _ in primed], [g_ for _, g_ in primed], inputs=[w1])
    if thread == "same":
        backward()
    else:
        t = threading.Thread(target=backward)
        t.start()
        t.join()
    assert torch.equal(w1.grad, expected)
    assert not torch.equal(w2.grad + torch.autograd.grad(call(x, w), w, h.grad)[0], expected)  # (the call's sum first)


def test_a_block_called_twice_trains_bitwise_where_the_state_fits(tmp_path):
    """The whole state in memory (PyTorch's graphs): the second call of a block reuses the first's
    weight leaves, so autograd sums the calls' gradients before adding them, as in PyTorch."""
    from test_finetune import batches, lm_loss, train, train_engine

    def make():
        torch.manual_seed(0)
        return RepeatingLM()
    ref, model, data = make(), make(), batches(3, 2)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, lm_loss, 1.0)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=2 * state) as engine:
        assert engine.activation_modes is None
        assert train_engine(engine, data, lm_loss, 1.0) == expected
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


@pytest.mark.parametrize("fits", [False, True], ids=["streams", "fits"])
def test_two_forwards_one_backward_accumulated_trains_bitwise(tmp_path, fits):
    """Two views through the model and one loss (contrastive, siamese), two micro-batches a step:
    each block is used twice per backward, and PyTorch sums the two uses' gradients before adding
    them to what the first micro-batch left. The engine added each use's in turn: other bits, also
    where the whole state fits. Now bitwise."""
    from test_finetune import lm_loss
    torch.manual_seed(0)
    ref = TinyLM(lambda d: MLP(d), d=32, layers=4)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    model.load_state_dict(ref.state_dict())
    state = 16 * sum(p.numel() for p in ref.parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s",
                host_memory=2 * state if fits else int(0.4 * state)) as engine:
        for _ in range(3):
            for _ in range(2):
                a, b = (torch.randint(0, 64, (2, 9), generator=g) for _ in range(2))
                (lm_loss(ref, a) + lm_loss(ref, b)).backward()
                engine.backward(lm_loss(engine, a) + lm_loss(engine, b))
            opt.step()
            opt.zero_grad()
            engine.step()
            engine.zero_grad()
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p) for k, p in ref.named_parameters())


class CountingMLP(torch.nn.Module):
    """An MLP that counts its calls in a plain attribute and scales by the count (a schedule kept
    as an int, as some stochastic-depth and warm-up layers do)."""

    def __init__(self, d):
        super().__init__()
        self.mlp, self.calls = MLP(d), 0

    def forward(self, x, route=None):
        self.calls += 1
        return self.mlp(x) * (1.0 + 0.01 * self.calls)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_block_that_counts_its_calls_in_an_attribute_trains_bitwise(tmp_path, activations):
    """A recomputed block runs its forward again in backward: buffers were put back to what the
    forward saw, a plain attribute (an int, a float, a bool) was not, so the count moved twice per
    call and the recompute and every later forward scaled by another number. Now the recompute sees
    the attributes as the forward did, and they end as the forward left them."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: CountingMLP(d), d=32, layers=4)
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=2,
                 config=EngineConfig(activations=activations))


class HistoryMLP(torch.nn.Module):
    """An MLP that keeps what it saw in containers of its own and shifts its input by how many
    calls its list holds (a position a layer counts itself, as a hand-written key/value cache
    does)."""

    def __init__(self, d):
        super().__init__()
        self.mlp, self.seen, self.counts = MLP(d), [], {"calls": 0}

    def forward(self, x, route=None):
        self.seen.append(tuple(x.shape))
        self.counts["calls"] += 1
        return self.mlp(x + 0.01 * len(self.seen))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_block_that_appends_to_a_list_of_its_own_trains_bitwise(tmp_path, activations, fused):
    """A list or dict a block's forward changes in place: a recompute ran the forward on the list
    as the forward had left it (one entry more), so the recomputed block shifted its input by
    another amount and the weights took other gradients (silently), and the list held two entries
    per call. Now a recompute sees the block's lists, dicts and sets as its forward did, and they
    end as the forward left them: the entries PyTorch's run has."""
    from tiered_offload import EngineConfig
    made = []

    def make():
        torch.manual_seed(0)
        made.append(TinyLM(lambda d: HistoryMLP(d), d=32, layers=4))
        return made[-1]
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=2,
                 fused=fused, config=EngineConfig(activations=activations))
    ref, ours = made[0], made[-1]
    for a, b in zip(ref.blocks, ours.blocks):
        assert (b.ffn.seen, b.ffn.counts) == (a.ffn.seen, a.ffn.counts) and len(a.ffn.seen) == 6


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_forward_hooks_on_blocks_change_the_recompute_alike_and_can_tell_it_apart(tmp_path, caplog, activations):
    """A user's forward hooks on a block and on its modules (registered before the engine): one
    that changes the output changes the recomputed one alike (bitwise PyTorch's), and one that
    records each forward sees each forward once, as in PyTorch, where it skips the recompute
    (``tiered_offload.recomputing()``); the engine says so when built. Before, nothing told a hook
    that its block's forward ran again, so a recording hook saw a recomputed block twice."""
    import tiered_offload
    from tiered_offload import EngineConfig
    seen: list[list] = []

    def make():
        torch.manual_seed(0)
        model = TinyLM(lambda d: MLP(d), d=32, layers=4)
        calls = []
        seen.append(calls)
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(lambda m, a, out: out * 1.5)  # steers: changes the block's output
            block.ffn.up.register_forward_pre_hook(
                lambda m, a, i=i: None if tiered_offload.recomputing() else calls.append(i))
        return model
    with caplog.at_level(logging.WARNING, logger="tiered_offload"):
        check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=2,
                     config=EngineConfig(activations=activations))
    reference, engine = seen
    assert engine == reference == [0, 1, 2, 3] * 6  # 3 steps of 2 micro-batches
    assert "forward hooks on blocks.0, blocks.1, blocks.2 and 1 more run again" in caplog.text
    assert not tiered_offload.recomputing()


class SkipLM(TinyLM):
    """Block 1's output also goes past the blocks after it, into the head's input."""

    def forward(self, ids, route=None):
        h, outs = self.emb(ids), []
        for block in self.blocks:
            h = block(h, route)
            outs.append(h)
        return self.head(self.norm(h + 0.1 * outs[1]))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_blocks_output_used_past_the_next_block_trains_bitwise(tmp_path, activations, fused):
    """A block's output that the model uses again further on (a skip across blocks, a mix of
    layers, a loss on inner layers): PyTorch adds that use's gradient first, then the next block's
    uses one by one; autograd added it to the next block's whole sum, so the weights were 1 ulp
    off, silently. Now it starts the next block's sum."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return SkipLM(lambda d: MLP(d), d=32, layers=4)
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=2,
                 fused=fused, config=EngineConfig(activations=activations))


class AuxLossMLP(MLP):
    """Keeps a loss term of its own as an attribute for the training loop to add (as many
    mixture-of-experts layers keep their load-balancing loss)."""

    def forward(self, x, route=None):
        h = self.up(x)
        self.aux_loss = h.pow(2).mean()
        return self.down(torch.nn.functional.gelu(h))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_tensor_a_block_keeps_as_an_attribute_trains_bitwise(tmp_path, activations, fused):
    """A loss term a block keeps as an attribute, which the loop adds after the forward: it was the
    engine's inner forward's tensor, outside the engine's backward, and the step stopped with "a
    measuring forward's graph was back-propagated; this is a bug". Now a tensor a block's forward
    sets as an attribute (requiring a gradient) is an output of the block's node, its gradient in
    the block's backward; ``forward_backward`` runs the loop, as each micro-batch's loss reads the
    attribute its own forward set."""
    from tiered_offload import EngineConfig
    made = []

    def make():
        torch.manual_seed(0)
        made.append(TinyLM(lambda d: AuxLossMLP(d), d=32, layers=4))
        return made[-1]

    def loss(model, ids, route=None):  # the last model made is the one training (the reference first)
        from test_finetune import lm_loss
        return lm_loss(model, ids, route) + 0.01 * sum(b.ffn.aux_loss for b in made[-1].blocks)
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=loss, clip=1.0,
                 accumulate=2, fused=fused, config=EngineConfig(activations=activations))


class TwoInputBlock(torch.nn.Module):
    """Reads each of its two inputs several times."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.ffn, self.gate = torch.nn.LayerNorm(d), MLP(d), torch.nn.Linear(d, d)

    def forward(self, x, memory):
        return x + self.ffn(self.norm(x) * torch.sigmoid(self.gate(memory))) + memory * 0.3 + x * memory


class SameTensorTwiceLM(TinyLM):
    """Gives each block one tensor as both of its inputs (``block(h, h)``: attention to itself as memory)."""

    def __init__(self, d=32, layers=4):
        super().__init__(lambda d: MLP(d), d=d, layers=layers)
        self.blocks = torch.nn.ModuleList(TwoInputBlock(d) for _ in range(layers))

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, h)
        return self.head(self.norm(h))


class TwoOfOneOutputBlock(Block):
    """Returns one tensor twice (``return y, y``)."""

    def forward(self, x, route=None):
        y = x + self.ffn(self.norm(x), route)
        return y, y


class TwoOfOneOutputLM(TinyLM):
    def __init__(self, d=32, layers=4):
        super().__init__(lambda d: MLP(d), d=d, layers=layers)
        self.blocks = torch.nn.ModuleList(TwoOfOneOutputBlock(d, MLP(d)) for _ in range(layers))

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            a, b = block(h)
            h = a * 0.7 + torch.tanh(b) * a
        return self.head(self.norm(h))


@pytest.mark.parametrize("activations, fused", [("recompute", False), ("offload", False), ("keep", False),
                                               ("recompute", True), ("keep", True)])
@pytest.mark.parametrize("make_model", [SameTensorTwiceLM, TwoOfOneOutputLM], ids=["input", "output"])
def test_one_tensor_in_two_places_of_a_block_call_trains_bitwise(tmp_path, make_model, activations, fused):
    """One tensor as two of a block's inputs: the gradient of the first place was dropped (the
    embedding's gradient 5% of PyTorch's, silently). One tensor as two of its outputs: their
    gradients were added apart from each use's (ulps off). Now a tensor is one input and one output
    of the block's node however many places it takes, its uses' gradients in PyTorch's order."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return make_model()
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, accumulate=2, clip=1.0,
                 fused=fused, config=EngineConfig(activations=activations))


@pytest.mark.parametrize("activations", ["recompute", "offload", "keep"])
def test_a_blocks_input_is_not_held_in_memory_after_its_forward(tmp_path, activations):
    """What a block's backward needs of its inputs is in the store (its checkpoint, or its graph's
    saved tensors): the input itself goes when the model lets go of it. A recomputed block's node
    held every block's input to its backward, in the compute device's memory and outside the
    budgets, beside the store's copy."""
    import gc
    import weakref
    from test_finetune import VOCAB
    from tiered_offload import EngineConfig
    seen = []

    class Watched(TinyLM):
        def forward(self, ids, route=None):
            h = self.emb(ids)
            for block in self.blocks:
                seen.append(weakref.ref(h))
                h = block(h, route)
            return self.head(self.norm(h))
    torch.manual_seed(0)
    model = Watched(lambda d: MLP(d), d=32, layers=4)
    host = 16 * sum(p.numel() for p in model.parameters()) * 2 // 5
    with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path, host_memory=host,
                config=EngineConfig(activations=activations)) as engine:
        loss = lm_loss(engine, torch.randint(0, VOCAB, (2, 9)))
        gc.collect()
        assert [ref() is None for ref in seen] == [True] * 4
        engine.backward(loss)


class ReadsSharedBlock(Block):
    """Adds what ``shared`` (a module or function it is given) makes of its input."""

    def forward(self, x, shared):
        return x + self.ffn(self.norm(x)) + 0.1 * shared(x)


class ReadsOutsideLM(TinyLM):
    """Each block reads a parameter outside the blocks other than as an argument: through a module
    of the model's it is given (``"module"``) or a function over a parameter (``"closure"``)."""

    def __init__(self, how, d=32, layers=4):
        super().__init__(lambda d: MLP(d), d=d, layers=layers)
        self.blocks = torch.nn.ModuleList(ReadsSharedBlock(d, MLP(d)) for _ in range(layers))
        self.shared, self.scale, self.how = torch.nn.Linear(d, d), torch.nn.Parameter(torch.ones(d)), how

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, self.shared if self.how == "module" else lambda x: x * self.scale)
        return self.head(self.norm(h))


@pytest.mark.parametrize("activations", ["recompute", "offload", "keep"])
@pytest.mark.parametrize("how", ["module", "closure"])
def test_a_block_that_reads_a_parameter_outside_the_blocks_not_as_an_argument_is_refused(tmp_path, how, activations):
    """A block that reads a parameter of the rest of the model through a module or a function it
    is given: its gradient from the block's uses never reached it (the block's backward computes
    gradients for the block's weights and inputs alone), silently. Now the block's first forward
    raises a ``ConfigError`` naming the parameter and how to pass it. Given as a tensor argument, it
    trains bitwise (``test_a_tensor_every_block_reads_gets_its_gradient_in_pytorchs_order``)."""
    from test_finetune import VOCAB
    from tiered_offload import EngineConfig

    torch.manual_seed(0)
    model = ReadsOutsideLM(how)
    name = "shared.weight" if how == "module" else "scale"
    host = 16 * sum(p.numel() for p in model.parameters()) * 2 // 5
    with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path, host_memory=host,
                config=EngineConfig(activations=activations)) as engine:
        with pytest.raises(ConfigError, match=f"block.0.*{name}.*as an argument"):
            engine.backward(lm_loss(engine, torch.randint(0, VOCAB, (2, 9))))


class RunningMean(torch.nn.Module):
    """Adds the mean magnitude of what it sees to a buffer (running statistics kept by the model)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("seen", torch.zeros(d))

    def forward(self, x):
        with torch.no_grad():
            self.seen += x.abs().mean((0, 1))
        return x


class UpdatesOutsideLM(ReadsOutsideLM):
    """Each block is given a module of the model's whose buffer its forward updates; the output reads it."""

    def __init__(self, d=32, layers=4):
        super().__init__("module", d, layers)
        self.stats = RunningMean(d)

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, self.stats)
        return self.head(self.norm(h + 1e-3 * self.stats.seen))


class CallCounter(torch.nn.Module):
    """Counts its calls in a plain attribute and scales by the count (a schedule kept by the model)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 0.01 * (self.calls % 5))


class CountsOutsideLM(ReadsOutsideLM):
    """Each block is given a module of the model's that counts its calls in an attribute."""

    def __init__(self, d=32, layers=4):
        super().__init__("module", d, layers)
        self.counter = CallCounter()

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, self.counter)
        return self.head(self.norm(h))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activations", ["recompute", "offload"])
@pytest.mark.parametrize("make_model", [UpdatesOutsideLM, CountsOutsideLM], ids=["buffer", "attribute"])
def test_a_buffer_outside_the_blocks_that_a_block_updates_is_updated_once(tmp_path, make_model, activations, fused):
    """A block updates a buffer or a plain attribute of the rest of the model (a module it is
    given): its recompute updated it again, so the next step read other statistics, silently (in
    every mode, as the plan recomputes some blocks). Now the recompute sees it as the forward did
    and leaves it as the forward left it, as the block's own; ``forward_backward`` runs the loop."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return make_model()
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, accumulate=2, fused=fused,
                 config=EngineConfig(activations=activations))


# ---- a tensor the block saved, changed in place before its backward ---------------------------
class TanhBlock(torch.nn.Module):
    """Ends with ``tanh``, which saves its output for backward."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, route=None):
        return torch.tanh(self.lin(x))


class ShiftBlock(Block):
    """Reads its input only through ``x + 1``, which saves nothing: its graph never saves the input."""

    def forward(self, x, route=None):
        y = x + 1
        return y + self.ffn(self.norm(y), route)


class InPlaceLM(TinyLM):
    """Changes a tensor in place after the block that read or made it: block 1's input (``where="input"``)
    or the last block's output (``"output"``)."""

    def __init__(self, block, where, d=32, layers=4):
        super().__init__(lambda d: MLP(d), d=d, layers=layers)
        self.blocks = torch.nn.ModuleList(block(d) for _ in range(layers))
        self.where = where

    def forward(self, ids, route=None):
        h = self.emb(ids)
        for i, block in enumerate(self.blocks):
            x, h = h, block(h, route)
            if i == 1 and self.where == "input":
                x.mul_(0.5)
        if self.where == "output":
            h.mul_(0.5)
        return self.head(self.norm(h))


_SAVED = {"input": lambda d: Block(d, MLP(d)), "output": TanhBlock}


@pytest.mark.parametrize("where, activations, fused", [
    *((w, a, False) for w in ("input", "output") for a in ("recompute", "offload", "keep")),
    ("input", "offload", True), ("output", "recompute", True)])
def test_a_saved_block_input_or_output_changed_in_place_raises_as_in_pytorch(tmp_path, where, activations, fused):
    """A block's input (its layer norm saves it) or output (``tanh`` saves it) changed in place
    after the block ran: PyTorch's backward raises ("modified by an inplace operation"). The engine
    had copied what the block saved, so the backward went on silently with the old values. Now it
    raises too, naming the block."""
    from test_finetune import VOCAB, fused_step
    from tiered_offload import EngineConfig
    from offload_core.errors import TensorStateError

    def make():
        torch.manual_seed(0)
        return InPlaceLM(_SAVED[where], where)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lm_loss(make(), ids).backward()
    model = make()
    host = 16 * sum(p.numel() for p in model.parameters()) * 2 // 5
    with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path, host_memory=host,
                config=EngineConfig(activations=activations)) as engine:
        assert engine.state_bytes() > engine.store.capacity("host")
        block = "block.1" if where == "input" else "block.3"
        with pytest.raises(TensorStateError, match=f"modified by an inplace operation.*{block}"):
            if fused:
                fused_step(engine, [(ids, None), (ids, None)], lm_loss)
            else:
                engine.backward(lm_loss(engine, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the GPU check runs it (tools/gpu_check.py)")
@pytest.mark.parametrize("case", ["saved-input-changed-in-place", "weight-read-twice-in-two-calls"])
def test_the_block_calls_checks_and_sums_hold_on_cuda(tmp_path, case, deterministic):
    """On a GPU, where a block's backward runs on autograd's device thread and a saved input's
    witness shares a CUDA tensor's version counter: the saved block input changed in place raises
    as PyTorch's backward does, and the weight read twice in each of two calls sums its uses in
    PyTorch's order (``repeated_calls._StartFrom``), bitwise PyTorch's on the same GPU."""
    from test_finetune import VOCAB, fused_step
    from tiered_offload import EngineConfig
    from offload_core.errors import TensorStateError
    if case == "weight-read-twice-in-two-calls":
        def seeded():
            torch.manual_seed(0)
            return _squared()
        check_parity(seeded, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, accumulate=2, clip=1.0,
                     host_fraction=0.6, config=EngineConfig(activations="recompute"), habits=Habits(twice=True),
                     device="cuda")
        return
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).cuda()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lm_loss(InPlaceLM(_SAVED["input"], "input").cuda(), ids).backward()
    for activations, fused in (("recompute", False), ("offload", True)):
        model = InPlaceLM(_SAVED["input"], "input")
        host = 16 * sum(p.numel() for p in model.parameters()) * 2 // 5
        with Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage=tmp_path / activations,
                    host_memory=host, device="cuda", config=EngineConfig(activations=activations)) as engine:
            with pytest.raises(TensorStateError, match="modified by an inplace operation.*block.1"):
                if fused:
                    fused_step(engine, [(ids, None), (ids, None)], lm_loss)
                else:
                    engine.backward(lm_loss(engine, ids))


@pytest.mark.parametrize("activations", ["recompute", "offload", "keep"])
def test_a_block_input_its_graph_did_not_save_may_change_in_place(tmp_path, activations):
    """The same change of block 1's input, where the block never saves it: PyTorch trains, and so
    does the engine, bitwise (the check is on what the block saved, not on every input)."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return InPlaceLM(lambda d: ShiftBlock(d, MLP(d)), "input")
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, accumulate=2,
                 config=EngineConfig(activations=activations))


class ScalesItsInputBlock(Block):
    """Scales its input in place before anything reads it (PyTorch trains it: nothing saved the input yet)."""

    def forward(self, x, route=None):
        x.mul_(0.5)
        return x + self.ffn(self.norm(x), route)


@pytest.mark.parametrize("frozen, activations, fused", [
    *((f, a, False) for f in (False, True) for a in ("recompute", "offload", "keep")), (True, "recompute", True)])
def test_a_block_that_changes_its_input_in_place_is_refused_naming_it(tmp_path, frozen, activations, fused):
    """Block 0 scales its input in place. With the embedding frozen (its input needs no gradient),
    the engine recomputed from the scaled input (scaling it twice) and ``forward_backward`` gave
    other losses, silently; with an input that needs one, the error blamed the batch's shapes. Now
    the block's first forward raises a ``ConfigError`` naming it and the fix."""
    from test_finetune import VOCAB, fused_step
    from tiered_offload import EngineConfig

    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    model.blocks[0] = ScalesItsInputBlock(32, MLP(32))
    model.emb.requires_grad_(not frozen)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    host = 16 * sum(p.numel() for p in model.parameters()) * 2 // 5
    with Engine(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                storage=tmp_path, host_memory=host, config=EngineConfig(activations=activations)) as engine:
        with pytest.raises(ConfigError, match="block.0.*changes .* in place.*out of place"):
            if fused:
                fused_step(engine, [(ids, None), (ids, None)], lm_loss)
            else:
                engine.backward(lm_loss(engine, ids))


# ---- custom autograd Functions --------------------------------------------------------------------
class ScaleOnCtx(torch.autograd.Function):
    """``x * w``, keeping ``x`` and ``w`` on its ctx as attributes (not ``ctx.save_for_backward``):
    PyTorch allows it, and saved-tensor hooks never see them."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w, (g * ctx.x).sum_to_size(ctx.w.shape)


class CtxMLP(MLP):
    """Scales its input by a slice of a weight of its own through :class:`ScaleOnCtx`."""

    def __init__(self, d):
        super().__init__(d)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 2 * d))

    def forward(self, x, route=None):
        return super().forward(ScaleOnCtx.apply(x, self.scale[:x.shape[-1]]))


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_a_function_keeping_tensors_on_its_ctx_is_refused_where_its_graph_would_be_kept(tmp_path, activations):
    """A custom autograd Function that keeps a weight's slice on its ctx as an attribute: in a kept
    or offloaded graph the engine's store reuses that memory before the backward, so the weights
    took other gradients (silently). Configured to keep the graphs, the engine now refuses the first
    forward, naming the Function, the attribute and the fix."""
    from test_finetune import lm_loss
    from tiered_offload import EngineConfig
    torch.manual_seed(0)
    model = TinyLM(lambda d: CtxMLP(d), d=32, layers=4)
    state = 16 * sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(0.6 * state),
                config=EngineConfig(activations=activations)) as engine:
        with pytest.raises(ConfigError, match=r"block.0.*ScaleOnCtx\.w.*save_for_backward.*activations='recompute'"):
            lm_loss(engine, torch.randint(0, 64, (2, 9)))


def test_a_function_keeping_tensors_on_its_ctx_is_recomputed_where_the_planner_would_keep_it(tmp_path):
    """With ``activations="auto"`` and a budget that keeps every block's graph, the planner now
    leaves such blocks recomputing (exact: the recompute builds the graph in the backward), and
    the plan says why."""
    made = []

    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: CtxMLP(d), d=32, layers=4)
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, steps=8, clip=1.0,
                 host_fraction=0.8, inspect=lambda e: made.append((e.activation_modes, e.plan.summary())))
    modes, plan = made[0]
    assert modes == ["recompute"] * 4 and "ScaleOnCtx.w" in plan and "save_for_backward" in plan


class InPlaceAfterSaveMLP(MLP):
    """Changes in place a tensor its forward saved for backward: PyTorch's backward refuses it."""

    def forward(self, x, route=None):
        h = self.up(x)
        g = h * h  # saves h
        h.add_(1.0)
        return self.down(g + h)


def test_a_saved_tensor_changed_in_place_is_a_typed_error_as_pytorchs_backward_refuses_it(tmp_path):
    """PyTorch's backward fails on a tensor saved for backward and then changed in place ("one of
    the variables needed for gradient computation has been modified by an inplace operation").
    With its graph kept, the engine sees it when the forward ends; it raised a plain RuntimeError,
    now a ``TensorStateError`` (still a ``RuntimeError``) that says what to change."""
    from offload_core.errors import TensorStateError
    from tiered_offload import EngineConfig
    from test_finetune import lm_loss
    torch.manual_seed(0)
    ref = TinyLM(lambda d: InPlaceAfterSaveMLP(d), d=32, layers=4)
    ids = torch.randint(0, 64, (2, 9))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lm_loss(ref, ids).backward()
    state = 16 * sum(p.numel() for p in ref.parameters())
    with Engine(ref, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(0.6 * state),
                config=EngineConfig(activations="offload")) as engine:
        with pytest.raises(TensorStateError, match="modified in place.*out-of-place"):
            lm_loss(engine, ids)


# ---- the user's hooks on parameters -----------------------------------------------------------------
def hook_parameters(model):
    """Gradient hooks as users register them: a mask on the embedding's rows (the tokens a run
    trains), a clamp on a block's weight (not linear: on a block called twice, PyTorch clamps the
    calls' sum), and two hooks in a row on another (they run in the order registered)."""
    rows = (torch.arange(model.emb.num_embeddings) % 3 != 0).float()[:, None]
    model.emb.weight.register_hook(lambda g: g * rows)
    model.blocks[1].ffn.up.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    model.blocks[2].ffn.down.weight.register_hook(lambda g: g * 0.5)
    model.blocks[2].ffn.down.weight.register_hook(lambda g: g + 1e-4)
    return model


@pytest.mark.parametrize("make_model", [lambda: TinyLM(lambda d: MLP(d), d=32, layers=4), RepeatingLM],
                         ids=["blocks", "repeats"])
@pytest.mark.parametrize("activations, fused", [("recompute", False), ("offload", False), ("recompute", True)])
def test_gradient_hooks_on_parameters_change_the_gradients_as_in_pytorch(tmp_path, make_model, activations, fused):
    """``param.register_hook(fn)`` on a streamed block's weight: the engine's backward ran on leaves
    of its own over the store's buffers, so the hook never ran and the model trained on the
    gradients PyTorch's would have changed (silently). Now the leaves carry the parameter's hooks,
    in its order; a block called twice has its calls' gradients summed first and then hooked, as
    PyTorch's accumulator runs them."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return hook_parameters(make_model())
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, accumulate=2,
                 fused=fused, config=EngineConfig(activations=activations))


def test_gradient_hooks_registered_or_removed_after_the_engine_is_built_count_where_the_state_fits(tmp_path):
    """The whole state in memory (PyTorch's graphs kept): the hooks a parameter has at each
    backward run, also those registered after the engine was built; a removed one does not."""
    from test_finetune import batches, lm_loss

    def make():
        torch.manual_seed(0)
        return RepeatingLM()
    ref, model = make(), make()
    removed = [m.blocks[3].ffn.up.weight.register_hook(lambda g: g * 0) for m in (ref, model)]
    state = 16 * sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=2 * state) as engine:
        assert engine.activation_modes is None
        for m, handle in zip((ref, model), removed):
            hook_parameters(m)
            handle.remove()
        for step in batches(3, 2):
            for ids, _ in step:
                lm_loss(ref, ids).backward()
                engine.backward(lm_loss(engine, ids))
            opt.step()
            opt.zero_grad()
            engine.step()
            engine.zero_grad()
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_post_accumulate_grad_hook_on_a_streamed_weight_is_refused_naming_it(tmp_path, when):
    """``register_post_accumulate_grad_hook`` (an optimizer run inside the backward, a gradient
    log) on a block's weight: the gradient accumulates in the engine's store, never in that
    parameter's ``.grad``, so the hook never ran (silently). Now the engine refuses it, at
    construction or at the next forward, naming the parameter and what to do."""
    from test_finetune import lm_loss
    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    state = 16 * sum(p.numel() for p in model.parameters())

    def hook():
        return model.blocks[2].ffn.up.weight.register_post_accumulate_grad_hook(lambda p: None)
    if when == "before":
        hook()
        with pytest.raises(ConfigError, match=r"blocks\.2\.ffn\.up\.weight.*post.accumulate.*remove"):
            Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(0.4 * state))
        return
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(0.4 * state)) as engine:
        handle = hook()
        ids = torch.randint(0, 64, (2, 9))
        with pytest.raises(ConfigError, match=r"blocks\.2\.ffn\.up\.weight.*post.accumulate.*remove"):
            engine(ids)
        handle.remove()
        engine.backward(lm_loss(engine, ids))
        engine.step()


class PenaltyMLP(MLP):
    """Keeps a penalty on its own weights (an L2 term written out, as EWC and sparsity penalties
    are) as an attribute for the loss."""

    def forward(self, x, route=None):
        self.penalty = sum(p.pow(2).sum() for p in self.parameters())
        return super().forward(x)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_a_penalty_on_a_blocks_weights_is_trained_bitwise_as_an_attribute_its_forward_sets(tmp_path, activations):
    """A streamed block's weights are in the store: outside the block's forward its parameters hold
    placeholders, so a penalty summed over ``model.parameters()`` is refused (``test_engine.py``).
    The README's way for a penalty on a block's weights: the block's forward computes it and keeps
    it as an attribute, which trains bitwise as PyTorch's."""
    from tiered_offload import EngineConfig
    made = []

    def make():
        torch.manual_seed(0)
        made.append(TinyLM(lambda d: PenaltyMLP(d), d=32, layers=4))
        return made[-1]

    def loss(model, ids, route=None):
        from test_finetune import lm_loss
        return lm_loss(model, ids, route) + 1e-3 * sum(b.ffn.penalty for b in made[-1].blocks)

    def outside_the_blocks(engine):
        from offload_core.errors import TensorStateError
        with pytest.raises(TensorStateError, match=r"blocks\.0\.\S+: pow .*forward"):
            sum(p.pow(2).sum() for n, p in engine.model.named_parameters() if n.startswith("blocks"))
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=loss, clip=1.0,
                 accumulate=2, config=EngineConfig(activations=activations), inspect=outside_the_blocks)


# ---- generators of the model's own ------------------------------------------------------------------
class OwnNoise(torch.nn.Module):
    """An MLP whose output is masked with numbers drawn from a generator other than PyTorch's
    default one: ``gen`` (an attribute), or a function that draws from one it closes over."""

    def __init__(self, d, gen=None, draw=None):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.gen, self.draw = gen, draw

    def forward(self, x, route=None):
        h = torch.nn.functional.gelu(self.up(x))
        if self.training:
            noise = self.draw(h.shape) if self.draw is not None else torch.rand(h.shape, generator=self.gen)
            h = h * (noise > 0.25) / 0.75
        return self.down(h)


class NoisyEmbeddingLM(TinyLM):
    """Blocks with a generator each, and the embeddings (outside the blocks) masked with numbers of
    the model's own generator."""

    def __init__(self):
        super().__init__(lambda d: OwnNoise(d, gen=torch.Generator().manual_seed(d)), d=48, layers=4)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, ids, route=None):
        h = self.emb(ids)
        if self.training:
            h = h * (torch.rand(h.shape, generator=self.gen) > 0.1) / 0.9
        for block in self.blocks:
            h = block(h, route)
        return self.head(self.norm(h))


class _Drawer:
    """Draws from a generator it holds: an object that is neither a module nor a function."""

    def __init__(self, g):
        self.g = g

    def __call__(self, shape):
        return torch.rand(shape, generator=self.g)


def own_noise(kind):
    """A TinyLM whose blocks draw from a generator of their own each ("each"), from one the
    blocks share ("shared"), from one a function attribute closes over ("closure"), or from one an
    object holds ("held": only the watch of the blocks' first forwards finds it); "outside": each,
    and the model's own outside the blocks."""
    def make():
        torch.manual_seed(0)
        shared = torch.Generator().manual_seed(11)
        if kind == "outside":
            return NoisyEmbeddingLM()
        if kind == "each":
            return TinyLM(lambda d: OwnNoise(d, gen=torch.Generator().manual_seed(d)), d=48, layers=4)
        if kind == "shared":
            return TinyLM(lambda d: OwnNoise(d, gen=shared), d=48, layers=4)
        if kind == "closure":
            return TinyLM(lambda d: OwnNoise(d, draw=lambda shape: torch.rand(shape, generator=shared)), d=48, layers=4)
        held = _Drawer(shared)
        return TinyLM(lambda d: OwnNoise(d, draw=held), d=48, layers=4)
    return make


OWN_KINDS = ["each", "shared", "closure", "held", "outside"]


@pytest.mark.parametrize("activations", ["recompute", "offload"])
@pytest.mark.parametrize("kind", OWN_KINDS)
def test_blocks_that_draw_from_their_own_generator_train_bitwise(tmp_path, kind, activations):
    """A recomputed block draws again in backward. PyTorch's default generators are put back to
    where its forward started; a generator of the model's own was not, so the recompute drew other
    numbers and the gradients were silently another mask's. Now each such generator is put back
    too (found as a block's attribute, or seen drawing in the block's first forwards)."""
    from tiered_offload import EngineConfig
    check_parity(own_noise(kind), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0,
                 steps=3, accumulate=2, config=EngineConfig(activations=activations))


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_forward_backward_with_generators_of_the_models_own_is_the_loop_bitwise(tmp_path, kind, monkeypatch):
    """Vertical order draws a generator a block keeps to itself in the loop's order (block i for
    micro-batch 0, 1, ...), but one that several blocks share in another (block 0 for every
    micro-batch before block 1), and so may one outside the blocks: then the pass is undone before
    any backward (the generators put back) and the loop runs, from then on without a pass."""
    from tiered_offload import EngineConfig
    from tiered_offload.engine import micro_batches
    calls = []
    loop, vertical = micro_batches._loop, micro_batches._vertical
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: calls.append("l") or loop(*a))
    monkeypatch.setattr(micro_batches, "_vertical",
                        lambda *a: (lambda r: calls.append("p" if r is not None else "u") or r)(vertical(*a)))
    check_parity(own_noise(kind), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0,
                 steps=3, accumulate=3, fused=True, config=EngineConfig(activations="recompute"))
    if kind == "each":
        assert calls == ["p"] * 3
    elif kind in ("shared", "closure", "outside"):  # known from the start (attributes, closures): the loop
        assert calls == ["l"] * 3
    else:  # seen in the first pass's forwards: undone, then the loop
        assert calls == ["u", "l", "l", "l"]


@pytest.mark.parametrize("kind", [k for k in OWN_KINDS if k != "held"])
def test_a_resumed_run_draws_from_the_models_own_generators_where_it_stopped(tmp_path, kind, caplog):
    """A commit saves PyTorch's default generators, so a resumed run draws the dropout masks the
    uninterrupted one would. A generator of the model's own was not saved: the resumed run drew
    from it as the model's construction left it, silently other masks. Now each one the model
    holds (an attribute, or a variable a function attribute closes over) is saved by its name."""
    from tiered_offload import EngineConfig
    with caplog.at_level(logging.WARNING, logger="tiered_offload"):
        check_parity(own_noise(kind), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0,
                     steps=4, accumulate=2, resume_at=2, config=EngineConfig(activations="recompute"))
    assert "under no name" not in caplog.text


def test_a_generator_no_name_reaches_is_replayed_and_its_unsaved_state_is_logged(tmp_path, caplog):
    """A generator held by some other object has no name a commit could save it under: the
    recompute still replays it (the training is bitwise), and the engine says, once, that a resumed
    run will draw from it as the model's construction left it."""
    from tiered_offload import EngineConfig

    def make():
        torch.manual_seed(0)
        return TinyLM(lambda d: OwnNoise(d, draw=_Drawer(torch.Generator().manual_seed(d))), d=48, layers=4)
    with caplog.at_level(logging.WARNING, logger="tiered_offload"):
        check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0,
                     steps=2, accumulate=2, config=EngineConfig(activations="recompute"))
    found = [r.getMessage() for r in caplog.records if "under no name" in r.getMessage()]
    assert [m.split(" draws")[0] for m in found] == [f"block {i}" for i in range(4)]
    assert "a commit does not save its state" in found[0]


def test_a_saved_generator_state_that_does_not_fit_is_a_checkpoint_error():
    """A saved state the model's generator cannot take is a typed error that names it."""
    from offload_core.errors import CheckpointError
    from tiered_offload.checkpoint.durable import encode_rng
    from tiered_offload.engine.train_state import TrainState
    state = TrainState([], [], torch.device("cpu"))
    state.generators = [("blocks.0.gen", torch.Generator())]
    with pytest.raises(CheckpointError, match=r"manifest\.json: .* generator blocks\.0\.gen does not fit"):
        state._load_generators({"blocks.0.gen": encode_rng(torch.zeros(7, dtype=torch.uint8))}, "manifest.json")
    with pytest.raises(CheckpointError, match="blocks.0.gen"):
        state._load_generators({"blocks.0.gen": "not base64!"}, "manifest.json")


def test_compiled_blocks_train_bitwise(tmp_path):
    """``block.compile()`` (inductor): the watch for generators of the model's own is a
    ``TorchDispatchMode``, under which compiled code runs uncompiled, so each block's first two
    forwards computed with eager kernels where PyTorch's ran inductor's: a loss 2e-7 off. Compiled
    blocks are not watched (their generators are found as attributes and closures)."""
    import shutil

    from tiered_offload import EngineConfig
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor needs a C++ compiler on the CPU, and this machine has none")

    def make():
        torch.manual_seed(0)
        model = TinyLM(lambda d: MLP(d), d=32, layers=4)
        for block in model.blocks:
            block.compile()
        return model
    check_parity(make, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, clip=1.0, steps=2,
                 accumulate=2, config=EngineConfig(activations="recompute"))


@pytest.mark.parametrize("how", ["block.compile()", "a compiled forward", "none"])
def test_which_blocks_run_compiled_is_seen(tmp_path, how):
    """The watch is left out for exactly the blocks that run compiled, however they were compiled."""
    def make():
        torch.manual_seed(0)
        model = TinyLM(lambda d: MLP(d), d=32, layers=4)
        if how == "block.compile()":
            model.blocks[1].compile(backend="eager")
        elif how == "a compiled forward":
            model.blocks[2].forward = torch.compile(model.blocks[2].forward, backend="eager")
        return model
    expected = {"block.compile()": [False, True, False, False], "a compiled forward": [False, False, True, False],
                "none": [False] * 4}[how]
    model = make()
    n = sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, storage=tmp_path, host_memory=8 * n) as engine:
        assert engine._streamer.own._unwatched == expected


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "a holder's compile()"])
def test_a_compiled_model_around_the_blocks_is_refused_naming_the_fix(tmp_path, how):
    """``torch.compile(model)`` had dynamo trace the engine's streaming of the blocks: the first
    forward stopped with "rejected the batch: ... this parameter's gradient lives in the engine's
    store" (dynamo read the stand-ins' ``.grad``). It is refused when the engine is built, naming
    the per-block compile that works."""
    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    holder = torch.nn.Module()
    if how == "torch.compile(model)":
        model = torch.compile(model, backend="eager")
    elif how == "model.compile()":
        model.compile(backend="eager")
    else:
        holder.inner = model
        holder.forward = lambda ids, route=None: holder.inner(ids, route)
        model.compile(backend="eager")
        model = holder
    where = {"torch.compile(model)": "the model", "model.compile()": "the model", "a holder's compile()": "inner"}[how]
    with pytest.raises(ConfigError, match=rf"^{where} runs compiled .*for block in model\.(inner\.)?blocks: "
                                          r"block\.compile\(\)"):
        Engine(model, torch.optim.AdamW, storage=tmp_path, host_memory=1 << 30)


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_model_compiled_after_the_engine_was_built_is_refused_naming_the_fix(tmp_path, how):
    """Compiled after the engine was built, dynamo stopped in the first call on a parameter's
    placeholder, with a message about reading weights for an EMA. It now names the per-block
    compile that works (the error still comes through dynamo's own, which wraps it); training
    then goes on uncompiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(lambda d: MLP(d), d=32, layers=4)
    engine = Engine(model, torch.optim.AdamW, storage=tmp_path, host_memory=1 << 30)
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="eager") if how == "torch.compile(model)" else model
    if how == "model.compile()":
        model.compile(backend="eager")
    with pytest.raises(Exception, match=r"torch\.compile traces a model the engine streams.*block\.compile\(\)") as got:
        compiled(ids)
    assert "TensorStateError" in str(got.value)  # (dynamo's InternalTorchDynamoError around it)
    if how == "model.compile()":
        model._compiled_call_impl = None
    engine.backward(model(ids).float().pow(2).mean())
    engine.step()
    engine.close()


# ---- mixed precision ------------------------------------------------------------------------------
@pytest.mark.parametrize("activations", ["recompute", "offload", "auto"])
def test_autocast_bf16_trains_bitwise_as_pytorch_under_autocast(tmp_path, activations):
    """``torch.autocast("cpu", torch.bfloat16)`` around the forward: the state stays fp32, a
    recomputed block runs in the autocast its forward ran in; bitwise as PyTorch under autocast."""
    import copy

    from test_finetune import VOCAB, lm_loss
    from tiered_offload import EngineConfig

    def small():
        torch.manual_seed(0)
        return TinyLM(lambda d: MLP(d), d=32, layers=4)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (2, 9), generator=g) for _ in range(3)]

    def run(model, finish):
        losses = []
        for ids in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, ids)
            assert loss.dtype == torch.float32
            losses.append(loss.item())
            finish(loss)
        return losses
    ref = small()
    start = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def ref_step(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    expected = run(ref, ref_step)
    model = small()
    model.load_state_dict(start)
    n = sum(p.numel() for p in model.parameters())
    with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(16 * n * 0.4),
                config=EngineConfig(activations=activations)) as engine:
        def step(loss):
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        assert run(engine, step) == expected
        weights = dict(engine.named_parameters())
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())


@pytest.mark.parametrize("activations, fused", [("keep", False), ("offload", True), ("recompute", False)],
                         ids=["keep-loop", "offload-forward_backward", "recompute-loop"])
def test_autocast_casts_a_blocks_input_for_each_use_as_pytorch_does(tmp_path, activations, fused):
    """DeBERTa's layers give their input straight to three projections (no norm first). Under
    bf16 autocast PyTorch casts that input (an earlier layer's output) once for each of them, and
    their gradients come back and are added in fp32. The engine gave each block its input as a
    leaf tensor, whose casts autocast caches: one cast, the three gradients added in bf16, and
    every layer below the last trained on other numbers (found by ``tools/fuzz_options.py``)."""
    from test_finetune import Habits, hf_loss, make_deberta
    from tiered_offload import EngineConfig
    check_parity(make_deberta, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), tmp_path, loss_fn=hf_loss,
                 steps=2, accumulate=2, host_fraction=0.8, fused=fused, config=EngineConfig(activations=activations),
                 habits=Habits(autocast=True))


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["through-each-block", "dropout-learned-by-the-first-step"])
def test_forward_backward_under_autocast_is_the_loop_with_forwards_in_it(tmp_path, dropout):
    """``with torch.autocast(...): engine.forward_backward(...)``: the forwards and losses in bf16
    autocast, the backwards outside it: bitwise PyTorch's loop written that way."""
    import copy

    from test_finetune import make_gpt2
    from tiered_offload.engine import micro_batches

    g = torch.Generator().manual_seed(1)
    steps = [[torch.randint(0, 64, (2, 9), generator=g) for _ in range(3)] for _ in range(2)]
    ref = make_gpt2(dropout=dropout)
    start = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = []
    for step in steps:
        for ids in step:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref(input_ids=ids, labels=ids).loss / 3
            loss.backward()
            expected.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    model = make_gpt2(dropout=dropout)
    model.load_state_dict(start)
    n = sum(p.numel() for p in model.parameters())
    loops = []
    loop = micro_batches._loop
    micro_batches._loop = lambda *a: loops.append(1) or loop(*a)
    try:
        with Engine(model, torch.optim.AdamW, dict(lr=1e-2), storage=tmp_path / "s", host_memory=int(16 * n * 0.4)) as engine:
            losses = []
            for step in steps:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    losses += [x.item() for x in engine.forward_backward(
                        [{"input_ids": ids, "labels": ids} for ids in step], lambda out, b: out.loss / 3)]
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
            weights = dict(engine.named_parameters())
    finally:
        micro_batches._loop = loop
    assert losses == expected and len(loops) == (1 if dropout else 0)
    assert all(torch.equal(weights[k], p.detach()) for k, p in ref.named_parameters())
