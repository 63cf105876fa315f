"""``tiered-offload train``, offline: a tiny Llama saved with ``save_pretrained`` and a byte-level
BPE tokenizer trained here, data files written by the test. The loss falls; a SIGKILL in the
middle and the same command again give the uninterrupted run's weights bitwise; SIGINT stops
cleanly and the next run continues; the export loads with ``from_pretrained``; the loss is on the
responses only for ``alpaca``; each error a user will hit is one line naming what to change."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from offload_core.errors import (CheckpointError, ConfigError, DiskFullError, NonFiniteError,  # noqa: E402
                                 TierCapacityError)
from tiered_offload import format_size  # noqa: E402
from tiered_offload.cli import main as cli_main  # noqa: E402
from tiered_offload.train import load_config, train  # noqa: E402
from tiered_offload.train.data import IGNORE, prepare_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat while dogs ran around big red houses near green trees every day".split()


def sentences(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (8,), generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(200), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(d)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, max_position_embeddings=64, bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def state_budget(model_dir: Path) -> int:
    """Six tenths of the training state: it streams through the disk."""
    n = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir)).num_parameters()
    return 16 * n * 6 // 10


def write_config(tmp_path: Path, model_dir: Path, data: Path, **over) -> Path:
    cfg = {"model": {"path": str(model_dir)},
           "data": {"path": str(data), "format": "completion", "field": "text", "max_seq_len": 32, "packing": True,
                    "eval_fraction": 0.1},
           "train": {"micro_batch": 4, "grad_accum": 2, "max_steps": 8, "lr": 1.0e-2, "schedule": "cosine",
                     "warmup_steps": 2, "weight_decay": 0.01, "clip": 1.0, "seed": 0, "eval_every": 4},
           "offload": {"storage": str(tmp_path / "run"), "host_memory": state_budget(model_dir), "commit_every": 1},
           "output": {"dir": str(tmp_path / "out"), "export_every": 4, "keep": 1}}
    for key, value in over.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    import yaml
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(300, seed=1)))
    return path


def exported(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_the_loss_falls_and_the_export_loads_with_from_pretrained(tmp_path, model_dir, data):
    config = write_config(tmp_path, model_dir, data, train__max_steps=30, data__eval_fraction=0.1,
                          output__export_every=0)
    records = []
    summary = train(config, progress=False, on_step=lambda s, r: records.append(r))
    assert summary["step"] == 30 and not summary["stopped"]
    first, last = sum(r["loss"] for r in records[:5]) / 5, sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert all(r["grad_norm"] is not None and r["tokens"] > 0 for r in records)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 31)) and any("eval_loss" in x for x in lines)
    final = Path(summary["final"])
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert (final / "tokenizer.json").is_file()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported(final).items())
    # its logits are the engine's on the same weights
    from tiered_offload import Engine, empty_init
    with empty_init():
        again = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with Engine.resume(tmp_path / "run", again, host_memory=state_budget(model_dir)) as engine:
        again.eval()
        model.eval()
        with torch.no_grad():
            assert torch.equal(engine(input_ids=ids).logits, model(input_ids=ids).logits)


def test_the_export_command_with_tokenizer_writes_the_run_s_final_model_directory(tmp_path, model_dir, data, capsys,
                                                                                  monkeypatch):
    """`tiered-offload export STORAGE OUT --tokenizer MODEL_DIR` writes what the run's final/ holds, byte for byte
    (it wrote the weights alone, and a tokenizer had to be copied by hand); without it, a note says how."""
    summary = train(write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0),
                    progress=False)
    final, offline = Path(summary["final"]), tmp_path / "offline"
    assert cli_main(["export", str(tmp_path / "run"), str(offline), "--tokenizer", str(model_dir)]) == 0
    names = sorted(p.name for p in final.iterdir())
    assert "tokenizer.json" in names and sorted(p.name for p in offline.iterdir()) == names
    assert all((offline / n).read_bytes() == (final / n).read_bytes() for n in names), names
    assert transformers.AutoTokenizer.from_pretrained(offline)("a b").input_ids
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "bare")]) == 0
    assert "--tokenizer MODEL_DIR" in capsys.readouterr().err and not (tmp_path / "bare" / "tokenizer.json").exists()
    # a directory with no tokenizer is refused before anything is written
    for wrong in (tmp_path / "bare" / "config.json", tmp_path / "missing", tmp_path / "run"):
        assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "x"), "--tokenizer", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert f"--tokenizer {wrong}" in err and "Nothing was exported" in err, err
        assert not (tmp_path / "x").exists()
    # the Hub id the run was trained from, read through huggingface_hub's cache as model.path is; not cached: named
    huggingface_hub = pytest.importorskip("huggingface_hub")
    _hub_cache(tmp_path / "hub", model_dir, "acme/tiny-llama")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "by-id"), "--tokenizer", "acme/tiny-llama"]) == 0
    assert all((tmp_path / "by-id" / n).read_bytes() == (final / n).read_bytes() for n in names)
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "z"), "--tokenizer", "acme/missing"]) == 2
    assert "--tokenizer acme/missing is not a local directory, and the Hugging Face Hub gave no model" in \
        capsys.readouterr().err and not (tmp_path / "z").exists()
    # a disk with no room for the tokenizer: typed, naming the file
    import errno
    import tiered_offload.checkpoint.safetensors_io as io
    real = io.write_private
    monkeypatch.setattr(io, "write_private", lambda path, data, **kw: real(path, data, **kw) if path.name !=
                        "tokenizer.json" else (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "y"), "--tokenizer", str(model_dir)]) == 2
    assert f"y: the weights are exported, and the tokenizer's files are not ({tmp_path / 'y' / 'tokenizer.json'}: " \
        "No space left on device)" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", [dict(train__schedule="cosine"),
                                      dict(train__schedule="linear", train__betas=[0.9, 0.95], train__eps=1e-6,
                                           train__min_lr=2e-3, train__weight_decay=0.1),
                                      dict(data__packing="documents"),
                                      dict(train__clip=None, offload__commit_every=2),
                                      dict(offload__commit_every=2, train__clip=1.2),
                                      dict(offload__commit_every=2, train__clip=1.2, train__clip_in_backward=1e9,
                                           unpredicted=True),
                                      dict(data__packing="documents", offload__commit_every=2, train__clip=None)],
                         ids=["defaults", "adam-settings", "documents", "no-clipping", "clipped-in-backward",
                              "clipped-in-backward-torn", "documents-in-backward"])
def test_the_run_is_plain_pytorchs_training_of_the_same_recipe(tmp_path, model_dir, data, schedule, monkeypatch,
                                                                caplog):
    """The recipe the command runs, written out in plain PyTorch on the model ``from_pretrained``
    loads: the same micro-batches in the same order, the loss averaged over the step's tokens the
    loss counts (each micro-batch's mean weighed by its share of them; ``documents``: unequal), AdamW
    with weight decay on the matrices only, the warm-up and schedule (``train.min_lr``: the floor a
    linear or cosine decay ends at), clipping. Its losses and final weights are the run's, bitwise
    (the engine streams the state through the disk; the evaluations between steps change nothing).
    Without clipping (``train.clip: null``) every step runs in the backward (``forward_backward(...,
    step=True)``), every block updated inside it. With clipping and snapshot commits
    (``clipped-in-backward``), every step is tried in the backward (``train.clip_in_backward:
    true``, the default); the engine keeps those its norm's prediction puts over ``train.clip`` out
    of it (the first try, which learns how the norm grows, too); steps within run in it, and one
    torn (a jump the prediction missed) was over the limit. Without the prediction
    (``clipped-in-backward-torn``: ``TIERED_OFFLOAD_CLIP_PREDICT=0``, the bound alone) those over
    ``train.clip`` are torn, run again after the backward from the last commit, and reported once
    each in metrics.jsonl."""
    from tiered_offload.engine.step_in_backward import StepInBackward
    from tiered_offload.train.data import micro_batch_rows
    from tiered_offload.train.run import lr_factor
    from tiered_offload.train.steps import ClipSpeculation
    schedule = dict(schedule)
    if schedule.pop("unpredicted", False):
        monkeypatch.setenv("TIERED_OFFLOAD_CLIP_PREDICT", "0")
    config = write_config(tmp_path, model_dir, data, train__max_steps=6, output__export_every=0, **schedule)
    records, inside = {}, []
    update = StepInBackward._update
    monkeypatch.setattr(StepInBackward, "_update", lambda self, unit: (
        inside.append(self.engine._streamer.step_in_backward is not None), update(self, unit))[1])
    monkeypatch.setattr(ClipSpeculation, "HOLD", 1)  # (the torn step alone runs after the backward)
    summary = train(config, progress=False, on_step=lambda s, r: records.__setitem__(s, r))
    cfg = load_config(config, [])
    t = cfg.train
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    train_data, _ = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "reference-cache", None)
    torch.manual_seed(t.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.use_cache = False
    model.train()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}], lr=t.lr,
                                  betas=tuple(schedule.get("train__betas", (0.9, 0.999))),
                                  eps=schedule.get("train__eps", 1e-8))
    floor = schedule.get("train__min_lr", 0.0) / t.lr

    def factor(s):  # the warm-up from 0 to the peak, then the decay from the peak to the floor
        if s < t.warmup_steps:
            return (s + 1) / (t.warmup_steps + 1)
        return floor + (1 - floor) * lr_factor(s, t.max_steps, t.warmup_steps, t.schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    assert sorted(records) == list(range(1, t.max_steps + 1))
    unequal = 0
    for step in range(t.max_steps):
        record, losses = records[step + 1], []
        rows = [micro_batch_rows(len(train_data), t.seed, step * t.grad_accum + micro, t.micro_batch)
                for micro in range(t.grad_accum)]
        counts = [int((np.asarray(train_data.labels[r])[:, 1:] != IGNORE).sum()) for r in rows]
        equal = len(set(counts)) == 1  # (then each weighs 1 / grad_accum: the mean of the means)
        unequal += not equal
        for r, n in zip(rows, counts):
            out = model(**train_data.batch(r))
            loss = out.loss / t.grad_accum if equal else out.loss * (n / sum(counts))  # (its share)
            loss.backward()
            losses.append(loss.item() * t.grad_accum if equal else out.loss.item())
        shares = [n / sum(counts) for n in counts]
        mean = sum(losses) / len(losses) if equal else sum(x * w for x, w in zip(losses, shares))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip) if t.clip else None
        assert (record["loss"], record["grad_norm"], record["lr"]) == (
            mean, norm if norm is None else float(norm), optimizer.param_groups[0]["lr"]), step
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert bool(unequal) == (schedule.get("data__packing") == "documents"), unequal  # (weighed where they differ)
    final = exported(Path(summary["final"]))
    assert set(final) == set(model.state_dict()) and all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    blocks = model.config.num_hidden_layers
    torn = [r.getMessage() for r in caplog.records if "over train.clip" in r.getMessage()]
    if "offload__commit_every" not in schedule:  # (journal commits: after the backward)
        assert not inside and not torn
    elif not t.clip:  # (documents: the first step after the backward, where the model's masks are checked)
        first = schedule.get("data__packing") == "documents"
        assert inside == ([True] * blocks + [False]) * (t.max_steps - first) and not torn, inside
    elif os.environ.get("TIERED_OFFLOAD_CLIP_PREDICT") != "0":  # (a step within in it; a torn one over the limit:
        # a jump the prediction missed, step 2 here, its norm 1.26 where 1.06 was predicted)
        within = [s for s in range(2, t.max_steps + 1) if records[s]["grad_norm"] <= t.clip]
        steps = [int(re.search(r"step (\d+) ran", m)[1]) for m in torn]
        assert all(records[s]["grad_norm"] > t.clip for s in steps), (steps, records)
        assert within and blocks <= inside.count(True) <= blocks * (len(within) + len(steps)), (within, inside)
    else:  # of the steps tried in the backward (the policy's: a tear holds the next ones after it), those over
        sim, over, under = ClipSpeculation(t.clip, t.clip_in_backward, cfg.offload.commit_every), [], []  # the
        # limit were torn
        for step in range(1, t.max_steps + 1):
            if sim.allows(step):
                (over if records[step]["grad_norm"] > t.clip else under).append(step)
                if over and over[-1] == step:
                    sim.torn()
            sim.seen(records[step]["grad_norm"])
        assert over and under and [int(re.search(r"step (\d+) ran", m)[1]) for m in torn] == over, (over, torn)
        assert inside.count(True) >= blocks * len(under), inside
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, t.max_steps + 1))


def test_a_signal_during_a_step_torn_in_the_backward_stops_the_run_at_the_last_commit(tmp_path, model_dir, data,
                                                                                    monkeypatch):
    """SIGTERM arrives while step 2 runs in the backward, and that step is then torn over
    ``train.clip``. Before, the run went back to the last commit and trained on, the signal lost
    with the attempt. Now it stops there, as a signal stops it after a step: committed, the
    summary says so. (``TIERED_OFFLOAD_CLIP_PREDICT=0``: the engine's prediction of the norm would
    keep step 2 out of the backward.)"""
    from tiered_offload.engine.step_in_backward import StepInBackward
    clip_at_the_end = StepInBackward._clip_at_the_end
    monkeypatch.setenv("TIERED_OFFLOAD_CLIP_PREDICT", "0")

    def signalled(self):
        os.kill(os.getpid(), signal.SIGTERM)  # (the run's handler takes it: a step in flight)
        clip_at_the_end(self)
    monkeypatch.setattr(StepInBackward, "_clip_at_the_end", signalled)
    config = write_config(tmp_path, model_dir, data, train__max_steps=6, output__export_every=0, train__clip=1.2,
                          train__clip_in_backward=1e9, offload__commit_every=2)
    summary = train(config, progress=False)
    assert summary["stopped"] and summary["step"] == 0 and summary["final"] is None, summary
    assert not [r for r in _records(tmp_path / "out") if "loss" in r]  # (step 1 went back with the commit)


def test_clipped_steps_are_tried_in_the_backward_where_a_tear_is_unlikely_and_cheap():
    """``train.steps.ClipSpeculation``: a clipped step is tried in the backward after one whose
    norm was at most ``train.clip_in_backward`` of the limit (none known: not), only where a tear
    would run at most 4 steps again (with a commit every 10 steps, the first 4 after each), and not
    for 16 steps from a torn one on (32 after the next tear). ``true`` (the default): every step but
    those, whatever the last norm (the engine predicts each one's); ``false``: none. Without
    clipping, every step."""
    from tiered_offload.train.steps import ClipSpeculation
    policy = ClipSpeculation(1.0, 0.8, every=10)
    assert not policy.allows(1)  # (no norm known yet)
    policy.seen(0.5)
    assert [k for k in range(2, 25) if policy.allows(k)] == [2, 3, 4, 11, 12, 13, 14, 21, 22, 23, 24]
    policy.seen(0.81)
    assert not policy.allows(31)
    policy.seen(0.8)
    assert policy.allows(31) and policy.torn() == 31 and policy.held_until == 46
    assert [k for k in range(32, 75) if policy.allows(k)] == [51, 52, 53, 54, 61, 62, 63, 64, 71, 72, 73, 74]
    assert policy.allows(71) and policy.torn() == 71 and policy.held_until == 71 + 32 - 1
    assert ClipSpeculation(None, 0.8, every=10).allows(7)
    always = ClipSpeculation(1.0, True, every=10)
    assert always.allows(1)  # (no norm known: the engine's first try learns its prediction, and updates nothing there)
    always.seen(5.0)
    assert [k for k in range(2, 15) if always.allows(k)] == [2, 3, 4, 11, 12, 13, 14]
    assert always.allows(21) and always.torn() == 21 and not always.allows(36) and always.allows(41)
    assert not ClipSpeculation(1.0, False, every=1).allows(2) and not ClipSpeculation(1.0, 0, every=1).allows(2)


def test_the_example_configuration_reads_as_it_says():
    """``tiered_offload_examples/finetune.yaml`` is what the README runs: every key in it is one
    ``train`` knows, of its type, and the commented Hub dataset line reads too."""
    import yaml
    example = ROOT / "tiered_offload_examples" / "finetune.yaml"
    cfg = load_config(example)
    assert cfg.model.path == "./Llama-3.2-1B" and cfg.train.betas == [0.9, 0.999] and cfg.offload.durable
    commented = [line.split("(or a Hub dataset's files: ", 1)[1].rsplit(")", 1)[0]
                 for line in example.read_text().splitlines() if "hf://datasets/" in line]
    assert commented and load_config(example, [f"data.path={yaml.safe_load(commented[0])['path']}",
                                               "data.format=alpaca"]).data.path.startswith("hf://datasets/")


@pytest.mark.parametrize("setting, match", [
    ("train.betas=[0.9]", r"train\.betas must be two numbers in \[0, 1\) \(\[beta1, beta2\]\), got \[0\.9\]"),
    ("train.betas=[0.9,1.0]", r"train\.betas must be two numbers in \[0, 1\)"),
    ("train.betas=0.9", r"train\.betas must be two numbers"),
    ("train.eps=0", r"train\.eps must be a finite number > 0, got 0\.0"),
    ("train.eps=tiny", r"train\.eps must be a number, got 'tiny'"),
    ("train.min_lr=0.1", r"train\.min_lr must be in \[0, train\.lr 2e-05\], got 0\.1"),
    ("train.min_lr=-1", r"train\.min_lr must be in \[0, train\.lr"),
    # Before: an untyped ValueError from torch's AdamW at the engine's construction, an OverflowError, or an error
    # of the engine's own saying that the param_groups or the user state cannot be saved as JSON.
    ("train.weight_decay=-1", r"train\.weight_decay must be a finite number >= 0, got -1\.0"),
    ("train.weight_decay=nan", r"train\.weight_decay must be a finite number >= 0, got nan"),
    ("train.lr=inf", r"train\.lr must be a finite number > 0, got inf"),
    ("train.eps=inf", r"train\.eps must be a finite number > 0, got inf"),
    ("train.clip=inf", r"train\.clip must be a finite number > 0 or null \(no clipping\), got inf"),
    ("train.clip_in_backward=-1", r"train\.clip_in_backward must be true \(each clipped step tried in the backward\), "
                                  r"false \(never\) or a finite number >= 0 .*, got -1"),
    ("train.clip_in_backward=null", r"train\.clip_in_backward must be true .*, got None"),
    ("train.epochs=inf", r"train\.epochs must be a finite number > 0"),
    ("lora.alpha=inf", r"lora\.alpha must be a finite number > 0, got inf"),
    # (at the engine's construction, after the data was tokenised, named as StoreConfig's host_budget_bytes)
    ("offload.host_memory=lots", r"^offload\.host_memory: cannot read 'lots' as a byte size; write e\.g\. 4GiB"),
    ("offload.device_memory=-1", r"^offload\.device_memory: cannot read '-1' as a byte size"),
    # (joined by commas, then split again: /b and c, a directory relative to wherever the command ran)
    ('offload.storage=["/a", "/b,c"]', r"^offload\.storage: each directory of the list must be a path without a comma"),
    # (one directory whose name holds a comma: striped over /runs/lr=1e-4 and ./bs=32, where the command ran)
    ("offload.storage=/runs/lr=1e-4,bs=32", r"^offload\.storage '/runs/lr=1e-4,bs=32' names 2 striped directories"),
    # (an empty output.dir wrote final/ and metrics.jsonl into the directory the command ran in)
    ("output.dir=", r"^output\.dir is required")])
def test_a_bad_optimizer_setting_is_refused_naming_it(tmp_path, setting, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=m", "data.path=d", f"offload.storage={tmp_path}", "train.max_steps=1", setting])
    assert load_config(None, ["model.path=m", "data.path=d", f"offload.storage={tmp_path}", "train.max_steps=1",
                              "train.betas=[0.9,0.95]", "train.eps=1e-6", "train.min_lr=2e-6"]).train.betas == [0.9, 0.95]


def _of_type(value, annotation: str) -> bool:
    """Whether ``value`` is of the config field type ``annotation`` (``str | list[str]``, ``int | None`` ...)."""
    checks = {"str": lambda v: isinstance(v, str), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "bool": lambda v: isinstance(v, bool), "None": lambda v: v is None,
              "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "list[int]": lambda v: isinstance(v, list) and all(type(x) is int for x in v),
              "list[float]": lambda v: isinstance(v, list) and all(
                  isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)}
    return any(checks[a.strip()](value) for a in annotation.split("|"))


WRONG = ["abc", "", -1, 0, 1.5, True, None, [1], ["a", "b"], [0.9, 0.95], {"a": 1}]


def test_every_setting_of_the_wrong_type_is_refused_naming_its_key(tmp_path):
    """A YAML value of the wrong type (``seed: null``, ``epochs: two``, ``path: [a, b]``,
    ``max_steps: true``) passed the checks and stopped the run later with a TypeError from deep
    inside (or trained with it: ``seed: 1.5``). Every key, every value: a ConfigError naming the
    key, or a value of the field's type."""
    import dataclasses

    import yaml

    from tiered_offload.train.config import _section_types
    required = {"model": {"path": "m"}, "data": {"path": "d"}, "offload": {"storage": str(tmp_path / "s")},
                "train": {"max_steps": 1}}
    path = tmp_path / "run.yaml"
    accepted = []
    for section, cls in _section_types().items():
        for f in dataclasses.fields(cls):
            for value in WRONG:
                raw = {k: dict(v) for k, v in required.items()}
                raw.setdefault(section, {})[f.name] = value
                path.write_text(yaml.safe_dump(raw))
                key = f"{section}.{f.name}"
                try:
                    cfg = load_config(path)
                except ConfigError as e:
                    assert key in str(e) or (key == "train.max_steps" and "train.epochs" in str(e)), (key, value, e)
                    continue
                got = getattr(getattr(cfg, section), f.name)
                assert _of_type(got, str(f.type)), (key, value, got)
                accepted.append((key, value))
    assert ("train.seed", 1.5) not in accepted and ("train.epochs", -1) not in accepted
    assert ("train.epochs", 1.5) in accepted and ("offload.storage", ["a", "b"]) in accepted


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("earlier", ["metrics", "final", "step-N"])
def test_a_fresh_run_into_an_earlier_runs_output_dir_is_refused_unless_told_to_overwrite(tmp_path, model_dir, data,
                                                                                         earlier, capsys):
    """An earlier run's output.dir given to a run with a new offload.storage (the old state deleted, moved, or
    another experiment's) started over there: its first step dropped the earlier run's metrics.jsonl records
    with a warning, and its exports replaced the earlier run's final/ and step-N/. As in transformers' example
    scripts, it is refused before anything is written, naming what is there and what to do; the dry run says the
    same, and output.overwrite=true starts the run there as before."""
    out = tmp_path / "out"
    out.mkdir()
    records = "".join(json.dumps({"step": s, "loss": 2.0 / s}) + "\n" for s in (1, 2, 3))
    if earlier == "metrics":
        (out / "metrics.jsonl").write_text(records)
    else:
        (out / ("final" if earlier == "final" else "step-600")).mkdir()
        (out / ("final" if earlier == "final" else "step-600") / "model.safetensors").write_bytes(b"earlier")
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    named = {"metrics": "metrics.jsonl with 3 records", "final": "final/", "step-N": "step-600/"}[earlier]
    config = write_config(tmp_path, model_dir, data, train__max_steps=2, train__warmup_steps=0, output__export_every=0)
    for argv in (["train", str(config)], ["train", str(config), "--dry-run"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"output.dir {out} holds an earlier run's outputs ({named})" in err, err
        assert "output.overwrite=true" in err, err
        assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
                if p.is_file() and ".cache" not in p.parts} == before
        assert not (tmp_path / "run").exists()  # nothing of a training state either
    assert train(config, ["output.overwrite=true"])["step"] == 2
    assert [r["step"] for r in _records(out)] == [1, 2, 2]  # this run's steps and final evaluation only
    # the run's own state continues there as before: a resume is never refused
    assert train(config, ["train.max_steps=3"])["step"] == 3


def test_a_copy_of_the_storage_restored_later_continues_the_run_from_its_step(tmp_path, model_dir, data):
    """Our errors say "restore the directory from a copy": a copy (`cp -a`) of offload.storage made between two
    commands, put back after the run went on to its end, continues the run from the copy's step: the same final
    weights, exports and metrics.jsonl (the later steps' records and the stale final evaluation dropped) as a
    run that went on from that step once."""
    compared = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss")

    def history(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [tuple(r.get(k) for k in compared) for r in map(json.loads, lines)]
    train(write_config(tmp_path / "once", model_dir, data, train__max_steps=2), progress=False)
    whole = train(write_config(tmp_path / "once", model_dir, data, train__max_steps=6), progress=False)
    train(write_config(tmp_path / "r", model_dir, data, train__max_steps=2), progress=False)
    shutil.copytree(tmp_path / "r" / "run", tmp_path / "backup", symlinks=True)
    config = write_config(tmp_path / "r", model_dir, data, train__max_steps=6)
    train(config, progress=False)
    shutil.rmtree(tmp_path / "r" / "run")
    shutil.copytree(tmp_path / "backup", tmp_path / "r" / "run", symlinks=True)
    restored = train(config, progress=False)
    assert restored["step"] == 6 and exported(Path(restored["final"])).keys() == exported(Path(whole["final"])).keys()
    assert all(torch.equal(v, exported(Path(whole["final"]))[k]) for k, v in exported(Path(restored["final"])).items())
    assert sorted(p.name for p in (tmp_path / "r" / "out").iterdir()) == sorted(
        p.name for p in (tmp_path / "once" / "out").iterdir())
    assert history(tmp_path / "r" / "out") == history(tmp_path / "once" / "out")


def test_a_sigkill_and_the_same_command_again_give_the_uninterrupted_weights(tmp_path, model_dir, data, zygote):
    """Also the metrics: the steps a crash lost after the last commit (here 4 and 5) are trained
    again, and ``metrics.jsonl`` held their first records too (step 4, 5, then 4, 5 again: a plot
    of the loss doubled back). The resumed run drops the records after the step it resumes from, so
    the file is the uninterrupted run's, record for record (times and disk bytes aside)."""
    config = write_config(tmp_path / "b", model_dir, data, offload__commit_every=3)
    script = tmp_path / "killed.py"
    script.write_text(f"import os, signal, sys; sys.path.insert(0, {str(ROOT)!r})\n"
                      f"from tiered_offload.train import train\n"
                      f"train({str(config)!r}, progress=False, on_step=lambda s, r: s == 5 and os.kill(os.getpid(), 9))\n")
    run = zygote.launch(script, [])
    # (meanwhile)
    reference = train(write_config(tmp_path / "a", model_dir, data, offload__commit_every=3), progress=False)
    _, err = run.communicate(timeout=600)
    assert run.returncode == -signal.SIGKILL, err[-2000:]
    assert [r["step"] for r in _records(tmp_path / "b" / "out")][-2:] == [4, 5]  # (3 committed)
    summary = train(config, progress=False)  # the same command again
    assert summary["step"] == 8
    a, b = exported(Path(reference["final"])), exported(Path(summary["final"]))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    kept = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss")
    assert [{k: r[k] for k in kept if k in r} for r in _records(tmp_path / "b" / "out")] == [
        {k: r[k] for k in kept if k in r} for r in _records(tmp_path / "a" / "out")]


def test_a_model_with_dropout_runs_its_micro_batches_through_each_block_together(tmp_path, model_dir, data,
                                                                                 monkeypatch):
    """Attention dropout draws random numbers in every forward: the first step runs the
    micro-batches as the loop (and learns the draws), every later one through each block together;
    the weights are those of a run in which every step runs the loop, bitwise."""
    from tiered_offload.engine import micro_batches
    dropout = tmp_path / "dropout-model"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.attention_dropout = 0.1
    model.save_pretrained(dropout)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(dropout)
    calls = []
    loop = micro_batches._loop
    monkeypatch.setattr(micro_batches, "_loop", lambda *a: calls.append("loop") or loop(*a))
    fused = train(write_config(tmp_path / "a", dropout, data, train__max_steps=4), progress=False)
    assert calls == ["loop"]
    monkeypatch.setattr(micro_batches, "_vertical", lambda *a: None)  # every step the loop
    looped = train(write_config(tmp_path / "b", dropout, data, train__max_steps=4), progress=False)
    assert calls == ["loop"] * 5
    a, b = exported(Path(fused["final"])), exported(Path(looped["final"]))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_ranks(zygote, config: Path, world: int, *overrides: str, flags: tuple = (), env: dict | None = None) -> list:
    """``world`` ranks of ``torchrun --nproc_per_node WORLD -m tiered_offload train``, forked from the
    suite's zygote with the environment torchrun gives each (a launch through torchrun itself takes
    a fresh interpreter per rank and the launcher's: `test_two_machines_with_torchrun_on_localhost`
    in test_distributed.py runs one). ``flags``: the command's own, before ``train`` (``-v``);
    ``env``: more of the ranks' environment."""
    port, args = _free_port(), [*flags, "train", "--config", str(config), "--no-progress", *overrides]
    return [zygote.launch(ROOT / "tests" / "cli_worker.py", args, dict(
        RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))) for r in range(world)]


def _finish_ranks(ranks: list, timeout: float = 300) -> list[tuple[int, str, str]]:
    """Each rank's exit code, stdout and stderr (every rank killed if one outlives ``timeout``)."""
    try:
        outputs = [r.communicate(timeout=timeout) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    return [(r.returncode, out, err) for r, (out, err) in zip(ranks, outputs)]


def _torchrun(zygote, config: Path, world: int, *overrides: str) -> str:
    done = _finish_ranks(_start_ranks(zygote, config, world, *overrides))
    assert all(code == 0 for code, _, _ in done), "\n".join(
        f"rank {r} exited {code}:\n{out[-2000:]}{err[-4000:]}" for r, (code, out, err) in enumerate(done) if code)
    return "".join(out for _, out, _ in done)


def test_torchrun_trains_each_ranks_batches_as_one_process_accumulating_them_all(tmp_path, model_dir, data, zygote):
    """``torchrun --nproc_per_node 2 -m tiered_offload train``: the state sharded over the ranks
    (each its slice in ``storage/rank-R-of-2``), each rank its own micro-batches of every step (the
    step's sequences those of one process accumulating twice as many), the gradients averaged: one
    process's run with ``grad_accum`` doubled, to rounding (the ranks add in another order). The
    metrics (rank 0's file) are the ranks' means, the evaluation covers every held-out sequence
    once, the export is the one model, and the same command again resumes every rank."""
    sharded = write_config(tmp_path / "ranks", model_dir, data, train__max_steps=2, output__export_every=0,
                           train__grad_accum=1, train__eval_every=2)
    _torchrun(zygote, sharded, 2)
    _torchrun(zygote, sharded, 2, "train.max_steps=4")
    assert sorted(p.name for p in (tmp_path / "ranks" / "run").glob("rank-*")) == ["rank-0-of-2", "rank-1-of-2"]
    one = write_config(tmp_path / "one", model_dir, data, train__max_steps=4, output__export_every=0,
                       train__grad_accum=2, train__eval_every=2)
    train(one, progress=False)
    ranks, alone = _records(tmp_path / "ranks" / "out"), _records(tmp_path / "one" / "out")
    ranks, alone = ([r for r in rs if "loss" in r] + rs[-1:] for rs in (ranks, alone))  # (steps; the final evaluation)
    assert [r["step"] for r in ranks] == [r["step"] for r in alone] == [1, 2, 3, 4, 4]
    for a, b in zip(ranks, alone):
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert (key in a) == (key in b) and (key not in a or a[key] == pytest.approx(b[key], rel=1e-5)), (key, a, b)
        assert a.get("tokens") == b.get("tokens")
    got, want = exported(tmp_path / "ranks" / "out" / "final"), exported(tmp_path / "one" / "out" / "final")
    assert set(got) == set(want)
    have, w = (torch.cat([d[k].flatten() for k in sorted(want)]) for d in (got, want))
    assert ((have - w).norm() / w.norm()).item() <= 1e-6 and ((have - w).abs().max() / w.abs().max()).item() <= 1e-6
    assert (tmp_path / "ranks" / "out" / "final" / "tokenizer.json").is_file()
    refused = _finish_ranks(_start_ranks(zygote, sharded, 3, "train.max_steps=6"))  # (nothing started over)
    assert all(code != 0 and "another number of ranks (rank-0-of-2" in err for code, _, err in refused), refused


def test_under_torchrun_the_loss_is_the_mean_over_every_ranks_tokens(tmp_path, model_dir, zygote):
    """Prompt-completion examples of unequal completions, no packing: each rank's micro-batch holds
    another number of tokens the loss counts. With ``train.average: tokens`` 2 ranks x 1 micro-batch
    train one process's 1 x 2 (the step's loss the mean over both ranks' tokens: each rank weighs
    its own by its share of all), to rounding; the recorded loss too."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": w, "completion": " " + " ".join([w] * (1 + i % 5))}) + "\n"
                            for i, w in enumerate(sentences(64, seed=16))))
    settings = dict(data__format="prompt-completion", data__packing=False, data__max_seq_len=64,
                    data__eval_fraction=0.0, train__max_steps=3, output__export_every=0)
    _torchrun(zygote, write_config(tmp_path / "ranks", model_dir, path, train__grad_accum=1, **settings), 2)
    train(write_config(tmp_path / "one", model_dir, path, train__grad_accum=2, **settings), progress=False)
    ranks, alone = _records(tmp_path / "ranks" / "out"), _records(tmp_path / "one" / "out")
    assert [r["step"] for r in ranks] == [r["step"] for r in alone] == [1, 2, 3]
    for a, b in zip(ranks, alone):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-5), (a, b)


def test_under_torchrun_without_clipping_the_ranks_step_in_the_backward_as_one_process(tmp_path, model_dir, data,
                                                                                       zygote):
    """``train.clip: null`` on 2 ranks: each step runs in the backward on every rank (each updates its
    slice of a block right after the ranks reduced its gradient), and the run is one process's with
    ``grad_accum`` doubled, also without clipping, to rounding: the records and the export."""
    sharded = write_config(tmp_path / "ranks", model_dir, data, train__max_steps=3, output__export_every=0,
                           train__grad_accum=1, train__clip=None, offload__commit_every=2)
    done = _finish_ranks(_start_ranks(zygote, sharded, 2, flags=("-v",)))
    assert all(code == 0 for code, _, _ in done) and "each step runs in the backward" in done[0][2], done
    one = write_config(tmp_path / "one", model_dir, data, train__max_steps=3, output__export_every=0,
                       train__grad_accum=2, train__clip=None, offload__commit_every=2)
    train(one, progress=False)
    ranks, alone = ([r for r in _records(tmp_path / d / "out") if "loss" in r] for d in ("ranks", "one"))  # (steps)
    assert [r["step"] for r in ranks] == [r["step"] for r in alone] == [1, 2, 3]
    for a, b in zip(ranks, alone):
        assert a["grad_norm"] is None is b["grad_norm"] and a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    got, want = exported(tmp_path / "ranks" / "out" / "final"), exported(tmp_path / "one" / "out" / "final")
    assert set(got) == set(want)
    have, w = (torch.cat([d[k].flatten() for k in sorted(want)]) for d in (got, want))
    assert ((have - w).norm() / w.norm()).item() <= 1e-6 and ((have - w).abs().max() / w.abs().max()).item() <= 1e-6


def test_under_torchrun_clipped_steps_torn_in_the_backward_run_again_on_every_rank_as_one_process(
        tmp_path, model_dir, data, zygote):
    """``train.clip 1.2`` on 2 ranks, every step tried in the backward (``train.clip_in_backward``
    large; ``TIERED_OFFLOAD_CLIP_PREDICT=0``, the bound alone deciding, as if a spike no prediction
    saw): step 2 is over the limit there, so every rank tears it alike, and the run goes on from the
    last commit with it, and the 15 after it, clipped after the backward. The run is one process's
    with ``grad_accum`` doubled (clipping after the backward), to rounding: the records (the norms
    too) and the export; metrics.jsonl has each step once."""
    clipped = dict(train__max_steps=4, output__export_every=0, train__clip=1.2, offload__commit_every=2)
    sharded = write_config(tmp_path / "ranks", model_dir, data, train__grad_accum=1, train__clip_in_backward=1e9,
                           **clipped)
    done = _finish_ranks(_start_ranks(zygote, sharded, 2, env={"TIERED_OFFLOAD_CLIP_PREDICT": "0"}))
    assert all(code == 0 for code, _, _ in done), done
    torn = [int(m) for m in re.findall(r"step (\d+) ran in the backward but its gradient norm", done[0][2])]
    assert torn == [2] and "as do the steps to 17" in done[0][2], done[0][2][-3000:]
    one = write_config(tmp_path / "one", model_dir, data, train__grad_accum=2, train__clip_in_backward=0, **clipped)
    train(one, progress=False)
    ranks, alone = ([r for r in _records(tmp_path / d / "out") if "loss" in r] for d in ("ranks", "one"))  # (steps)
    assert [r["step"] for r in ranks] == [r["step"] for r in alone] == [1, 2, 3, 4]
    for a, b in zip(ranks, alone):
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"], (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-5), (a, b)
    assert alone[0]["grad_norm"] < 1.2 * 0.8 < 1.2 < alone[1]["grad_norm"]  # (step 2 tried after step 1, torn)
    got, want = exported(tmp_path / "ranks" / "out" / "final"), exported(tmp_path / "one" / "out" / "final")
    have, w = (torch.cat([d[k].flatten() for k in sorted(want)]) for d in (got, want))
    assert set(got) == set(want) and ((have - w).abs().max() / w.abs().max()).item() <= 1e-6


def test_under_torchrun_a_record_cut_off_after_its_step_is_written_at_the_resume_from_every_ranks_part(
        tmp_path, model_dir, data, zygote):
    """Sharded, each rank commits its own part of a step's record (its loss and tokens): a resume at a step whose
    record rank 0's metrics.jsonl lacks (a kill after the step's commit) sums the ranks' parts again, and runs
    the evaluation again, to the record the run wrote before."""
    config = write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0,
                          train__grad_accum=1, train__eval_every=2)
    _torchrun(zygote, config, 2)
    path = tmp_path / "out" / "metrics.jsonl"
    written = _records(tmp_path / "out")
    assert [r["step"] for r in written] == [1, 2, 2]  # (the steps; the final evaluation)
    path.write_text("".join(json.dumps(r) + "\n" for r in written[:1]))  # as killed before step 2's record
    _torchrun(zygote, config, 2, "train.max_steps=3")
    again = _records(tmp_path / "out")
    assert [r["step"] for r in again] == [1, 2, 3, 3]
    for key in ("loss", "lr", "grad_norm", "tokens", "eval_loss"):
        assert again[1][key] == written[1][key], (key, again[1], written[1])


def test_an_error_in_the_data_under_torchrun_stops_every_rank_with_it(tmp_path, model_dir, zygote):
    """Local rank 0 tokenises while the others wait; where it fails (here: no example), the others
    do not wait on: each says the same error and exits."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    done = _finish_ranks(_start_ranks(zygote, write_config(tmp_path, model_dir, empty), 2), timeout=240)
    assert all(code != 0 and f"data.path {empty} holds no example" in err for code, _, err in done), done


def test_under_torchrun_a_fresh_run_into_an_earlier_runs_output_dir_stops_every_rank_with_the_refusal(
        tmp_path, model_dir, data, zygote):
    """Every rank checks output.dir before the data is tokenised and the engine built (none has written there
    yet), so each says the refusal and exits; none waits on for the others in the engine's collectives."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    done = _finish_ranks(_start_ranks(zygote, write_config(tmp_path, model_dir, data, train__max_steps=2), 2),
                         timeout=240)
    assert all(code != 0 and "holds an earlier run's outputs (metrics.jsonl with 1 record)" in err
               for code, _, err in done), done
    assert (out / "metrics.jsonl").read_text() == json.dumps({"step": 1, "loss": 2.0}) + "\n"


def test_under_torchrun_a_first_start_killed_between_the_ranks_first_commits_starts_again(tmp_path, model_dir,
                                                                                          data, zygote):
    """A torchrun job stopped in its first start after one rank wrote its first commit (step 0, the
    pretrained weights) and before another did: its next start refused ("rank(s) [1] of 2 hold a
    training state and the others none") until the storage was deleted by hand. Every rank now
    starts fresh from the model directory (the engine forgetting rank 1's first commit), and the
    run is the one a fresh directory gives, bitwise. Here the first start stops at its first step
    (``packing: documents`` with OPT, refused there), and rank 0's first manifest is removed."""
    from tiered_offload.checkpoint.durable import StateFiles, state_directory
    other = tmp_path / "tiny-opt"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.save_pretrained(other)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).save_pretrained(other)
    settings = dict(train__max_steps=2, output__export_every=0, train__grad_accum=1, train__eval_every=0,
                    offload__host_memory="4MiB")
    config = write_config(tmp_path / "killed", other, data, **settings)
    done = _finish_ranks(_start_ranks(zygote, config, 2, "data.packing=documents"))
    assert all(code != 0 and "data.packing: documents" in err for code, _, err in done), done
    state = tmp_path / "killed" / "run"
    assert all(StateFiles(state_directory(str(state / f"rank-{r}-of-2"))).read_manifest()["step"] == 0 for r in (0, 1))
    StateFiles(state_directory(str(state / "rank-0-of-2"))).manifest_path.unlink()
    done = _finish_ranks(_start_ranks(zygote, config, 2))
    assert all(code == 0 for code, _, _ in done), done
    assert "rank 1 forgets its first commit" in done[1][2], done[1][2][-3000:]
    _torchrun(zygote, write_config(tmp_path / "fresh", other, data, **settings), 2)
    got, want = exported(tmp_path / "killed" / "out" / "final"), exported(tmp_path / "fresh" / "out" / "final")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, model_dir, data, zygote):
    """SIGINT to one rank of a torchrun (a scheduler's SIGTERM may also reach one first): every rank
    finishes the same step, commits and exits 0 (one rank stopping alone would leave the others
    waiting in the next step's collectives); rank 0 says where it stopped, and the same command
    continues there."""
    config = write_config(tmp_path, model_dir, data, train__max_steps=400, output__export_every=0,
                          train__grad_accum=1, train__eval_every=0)
    ranks = _start_ranks(zygote, config, 2)
    metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and ranks[0].poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    ranks[1].send_signal(signal.SIGINT)
    done = _finish_ranks(ranks, timeout=240)
    assert all(code == 0 for code, _, _ in done), done
    output = "".join(out + err for _, out, err in done)
    stopped = [int(m) for m in re.findall(r"stopped at step (\d+) \(committed\)", output)]
    steps = [r["step"] for r in _records(tmp_path / "out")]
    assert len(stopped) == 1 and steps == list(range(1, stopped[0] + 1)) and stopped[0] < 400, (stopped, steps)
    _torchrun(zygote, config, 2, f"train.max_steps={stopped[0] + 1}")
    assert [r["step"] for r in _records(tmp_path / "out") if "loss" in r] == list(range(1, stopped[0] + 2))


def test_sigint_finishes_the_step_commits_and_the_next_run_continues(tmp_path, model_dir, data, zygote):
    config = write_config(tmp_path, model_dir, data, train__max_steps=20, output__export_every=0)
    proc = zygote.launch(ROOT / "tests" / "cli_worker.py", ["train", "--config", str(config), "--no-progress"])
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert "run the same command to continue" in stdout
    stopped = int(stdout.split("stopped at step ")[1].split()[0])
    assert 3 <= stopped < 20
    summary = train(config, progress=False)
    assert summary["step"] == 20 and Path(summary["final"]).is_dir()
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "loss" in json.loads(x)]
    assert steps == list(range(1, 21))  # continued where it stopped, nothing repeated or skipped


def test_lora_trains_an_adapter_on_the_frozen_model_and_exports_it_for_peft(tmp_path, model_dir, data):
    """``lora: {r: 4}``: PEFT's LoRA on the model read from its directory (built under
    ``empty_init``, the base's weights read into it), only the adapter trained. An export holds the
    adapter alone (``adapter_model.safetensors``, ``adapter_config.json`` naming the model's
    directory) and the tokenizer, not the frozen weights: ``PeftModel.from_pretrained`` puts it on
    the base. The same command again continues. PEFT's use of a name transformers 5 deprecates
    printed a FutureWarning at each start, which the user can do nothing about: it is not shown."""
    import warnings
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    settings = dict(train__lr=0.05, output__export_every=0, lora__r=8)  # every linear layer (all-linear)
    config = write_config(tmp_path, model_dir, data, train__max_steps=16, **settings)
    records = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        summary = train(config, progress=False, on_step=lambda s, r: records.append(r))
    assert not [w for w in shown if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in shown]
    first, last = sum(r["loss"] for r in records[:4]) / 4, sum(r["loss"] for r in records[-4:]) / 4
    assert summary["step"] == 16 and last < first, (first, last)  # (an adapter on the fixture's random base learns slowly)
    final = Path(summary["final"])
    files = {f.name for f in final.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files, files
    assert not any(f.startswith("model") for f in files) and "config.json" not in files, files
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tuned = peft.PeftModel.from_pretrained(base, final)
    held = dict(tuned.named_parameters())
    assert all(torch.equal(held[k.replace(".weight", ".default.weight")], v) for k, v in adapter.items())
    assert any(torch.count_nonzero(v) for k, v in adapter.items() if ".lora_B." in k)  # it trained
    pretrained = dict(transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
                      .named_parameters())
    assert all(torch.equal(held[f"base_model.model.{k}"], v) for k, v in pretrained.items()
               if f"base_model.model.{k}" in held)  # the base untouched
    summary = train(write_config(tmp_path, model_dir, data, train__max_steps=18, **settings), progress=False)
    assert summary["step"] == 18


def test_output_dtype_exports_the_trained_weights_cast(tmp_path, model_dir, data):
    """``output.dtype: bf16``: the exports hold the fp32 state's weights cast to bf16 (half the
    files; what is served), the config says so, and ``from_pretrained`` loads them. The same command
    again with ``fp32`` writes the final export again: the bf16 one is it, cast."""
    config = json.loads
    bf16 = Path(train(write_config(tmp_path, model_dir, data, train__max_steps=2, output__dtype="bf16"),
                      progress=False)["final"])
    low = exported(bf16)
    assert all(t.dtype == torch.bfloat16 for t in low.values())
    assert config((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    full = exported(Path(train(write_config(tmp_path, model_dir, data, train__max_steps=2, output__dtype="fp32"),
                               progress=False)["final"]))
    assert list(full) == list(low) and all(torch.equal(full[k].to(torch.bfloat16), low[k]) for k in low)
    with pytest.raises(ConfigError, match=r"output\.dtype must be one of fp32, bf16, fp16, got 'int8'"):
        train(write_config(tmp_path, model_dir, data, train__max_steps=2, output__dtype="int8"), progress=False)


def test_dora_trains_its_magnitude_from_the_pretrained_weights(tmp_path, model_dir, data):
    """``lora: {r: 8, dora: true}``: PEFT's DoRA, whose magnitude starts as the row norms of the
    pretrained weights (read from the model's directory, not the ones the model was built with);
    the export is the adapter with its magnitudes, which ``PeftModel.from_pretrained`` loads."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    settings = dict(train__lr=1e-3, train__warmup_steps=0, output__export_every=0, lora__r=8, lora__dora=True)
    summary = train(write_config(tmp_path, model_dir, data, train__max_steps=3, **settings), progress=False)
    adapter = load_file(Path(summary["final"]) / "adapter_model.safetensors")
    magnitudes = {k: v for k, v in adapter.items() if "lora_magnitude_vector" in k}
    assert magnitudes
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tuned = dict(peft.PeftModel.from_pretrained(base, Path(summary["final"])).named_parameters())
    assert all(torch.equal(tuned[f"{k}.default.weight"], v) for k, v in magnitudes.items())
    pretrained = dict(transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
                      .named_parameters())
    for k, v in magnitudes.items():  # the pretrained weights' norms, 3 steps of at most 1e-3 each from them
        weight = pretrained[k.replace("base_model.model.", "").replace(".lora_magnitude_vector", ".weight")]
        assert (v - torch.linalg.norm(weight, dim=1)).abs().max() <= 3.1e-3, k


def tiny_beside_tokenizer(directory: Path, model_dir: Path, model_cls, config_cls, **config) -> Path:
    """A tiny 2-layer MoE ``model_cls`` (4 experts, 2 a token) saved in ``directory`` with
    ``model_dir``'s tokenizer, its special tokens in the config."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    model_cls(config_cls(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **config)).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("experts", [False, True], ids=["linear", "and-experts"])
def test_lora_on_an_moe_model_puts_the_adapter_on_its_linear_layers_and_the_parameters_named(tmp_path, model_dir,
                                                                                               data, caplog, experts):
    """``lora.targets: all-linear`` (the default) on an MoE in transformers 5: PEFT also puts LoRA on
    the router and the stacked experts, through its ``ParamWrapper`` (LoRA on a parameter, which
    takes no dropout or DoRA). ``all-linear`` here means the model's linear layers (attention, a
    shared expert), as in every version of this command, so a run resumes as it started; the log
    names the modules left out. ``lora.parameters`` (PEFT's ``target_parameters``) puts an adapter
    on the experts too. The export loads with PEFT."""
    peft = pytest.importorskip("peft")
    moe = tiny_beside_tokenizer(tmp_path / "tiny-mixtral", model_dir, transformers.MixtralForCausalLM,
                                transformers.MixtralConfig, intermediate_size=64)
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None
    with caplog.at_level("INFO", logger="tiered_offload"):
        summary = train(write_config(tmp_path, moe, data, train__max_steps=2, output__export_every=0, lora__r=4,
                                     lora__parameters=parameters), progress=False)
    assert summary["step"] == 2
    said = [r.getMessage() for r in caplog.records if "mlp.experts" in r.getMessage()]
    assert said and ("get one where lora.parameters" if experts else "get none") in said[0]
    adapter = Path(summary["final"])
    tuned = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(moe), adapter)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in tuned.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj"} | ({"experts", "base_layer"} if experts else set())
    if experts:  # trained: the experts' adapter moved from PEFT's start (lora_B zero)
        b = [p for n, p in tuned.named_parameters() if "experts" in n and "lora_B" in n]
        assert len(b) == 4 and all(p.abs().sum() > 0 for p in b)
        with pytest.raises(ConfigError, match="lora.dropout: 0"):
            train(write_config(tmp_path / "dropout", moe, data, lora__r=4, lora__dropout=0.1,
                               lora__parameters=parameters), progress=False, dry_run=True)


def test_gpt_oss_as_openai_ships_it_in_mxfp4_fine_tunes_with_lora_on_its_experts(tmp_path, model_dir, data):
    """gpt-oss's own checkpoint holds its experts in MXFP4 (``quantization_config: mxfp4``), which
    ``train`` refused as any quantized checkpoint. It is now dequantized as ``from_pretrained``
    does (``Mxfp4Config(dequantize=True)``), and LoRA goes on the experts named in
    ``lora.parameters``: the adapter PEFT loads onto that model, trained."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers.integrations.mxfp4")
    from test_conformance import as_mxfp4
    oss = tiny_beside_tokenizer(tmp_path / "tiny-gpt-oss", model_dir, transformers.GptOssForCausalLM,
                                transformers.GptOssConfig, intermediate_size=32, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
    as_mxfp4(oss)
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    summary = train(write_config(tmp_path, oss, data, train__max_steps=2, output__export_every=0, lora__r=4,
                                 lora__parameters=parameters), progress=False)
    assert summary["step"] == 2
    base = transformers.AutoModelForCausalLM.from_pretrained(
        oss, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, Path(summary["final"]))
    b = [p for n, p in tuned.named_parameters() if "experts" in n and "lora_B" in n]
    assert len(b) == 4 and all(p.abs().sum() > 0 for p in b)


def test_lora_merged_exports_the_model_with_the_adapter_merged(tmp_path, model_dir, data):
    """``lora: {r: 8, merged: true}``: the exports hold the model with the adapter merged into its
    weights, under the base model's names with its ``config.json`` and tokenizer, for
    ``from_pretrained`` without PEFT: bitwise what PEFT's ``merge_and_unload()`` makes of the
    adapter the same run exports without ``merged``."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    settings = dict(train__lr=0.05, train__max_steps=4, output__export_every=0, lora__r=8)
    merged = Path(train(write_config(tmp_path / "merged", model_dir, data, lora__merged=True, **settings),
                        progress=False)["final"])
    adapter = Path(train(write_config(tmp_path / "adapter", model_dir, data, **settings), progress=False)["final"])
    files = {f.name for f in merged.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files and not any("adapter" in f for f in files)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    expected = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    got = load_file(merged / "model.safetensors")
    assert set(got) <= set(expected) and all(torch.equal(v, expected[k]) for k, v in got.items())
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    assert any(not torch.equal(v, pretrained[k]) for k, v in got.items())  # the adapter is in it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    assert all(torch.equal(p, got[k]) for k, p in loaded.state_dict().items() if k in got)


def test_the_export_command_writes_a_lora_runs_adapter_as_the_run_exports_it(tmp_path, model_dir, data, capsys):
    """A LoRA run stopped before its final export (or an export of another step): ``tiered-offload
    export RUN OUT`` wrote the whole PEFT model under PEFT's names and no adapter, neither what
    ``PeftModel.from_pretrained`` nor what ``from_pretrained`` loads. The run's directory records
    its adapter (PEFT's config and which parameters make it, under which keys), and the command
    writes the adapter files the run's own export writes, bitwise; ``--adapter-only`` those alone.
    A directory without an adapter refuses ``--adapter-only``, naming the plain export."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    settings = dict(train__lr=0.05, train__max_steps=4, output__export_every=0, lora__r=8)
    final = Path(train(write_config(tmp_path, model_dir, data, **settings), progress=False)["final"])
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "all")]) == 0
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    for out in (tmp_path / "all", tmp_path / "adapter"):
        got, want = load_file(out / "adapter_model.safetensors"), load_file(final / "adapter_model.safetensors")
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
            (final / "adapter_config.json").read_text())
    assert {f.name for f in (tmp_path / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    held = dict(tuned.named_parameters())
    assert all(torch.equal(held[k.replace(".weight", ".default.weight")], v) for k, v in got.items())
    full = train(write_config(tmp_path / "full", model_dir, data, **dict(settings, lora__r=0)), progress=False)
    assert full["step"] == 4
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "full" / "run"), str(tmp_path / "x"), "--adapter-only"]) == 2
    assert re.search(r"no adapter.*tiered-offload export .* without --adapter-only", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("lora", [dict(lora__r=8), dict(lora__r=4, lora__dora=True, lora__modules_to_save=["lm_head"])],
                         ids=["lora", "dora-head"])
def test_the_export_command_merges_a_lora_runs_adapter_as_peft_merges_it(tmp_path, model_dir, data, capsys, lora):
    """A LoRA run exported its adapter; the user wants the model with it merged, for serving with
    ``from_pretrained`` (a model larger than memory, which PEFT's ``merge_and_unload()`` cannot
    hold). ``tiered-offload export RUN OUT --merged`` streams it from the directory: bitwise what
    ``PeftModel.from_pretrained(base, adapter).merge_and_unload()`` holds, under the base model's
    names with its ``config.json``, which ``from_pretrained`` loads. ``--merged`` with
    ``--adapter-only``, or of a run without an adapter, is refused, naming what to run."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    settings = dict(train__lr=0.05, train__max_steps=3, output__export_every=0, **lora)
    final = Path(train(write_config(tmp_path, model_dir, data, **settings), progress=False)["final"])
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merged"]) == 0
    assert {f.name for f in (tmp_path / "merged").iterdir()} == {"model.safetensors", "config.json"}
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    expected = peft.PeftModel.from_pretrained(base, final).merge_and_unload().state_dict()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(got) <= set(expected) and all(torch.equal(v, expected[k]) for k, v in got.items())
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    assert any(not torch.equal(v, pretrained[k]) for k, v in got.items())  # the adapter is in it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert all(torch.equal(p, expected[k]) for k, p in loaded.state_dict().items())
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "x"), "--merged", "--adapter-only"]) == 2
    assert re.search(r"--merged.*--adapter-only.*one", capsys.readouterr().err)
    from test_hostile import rewrite_manifest  # a class transformers has, which is no model; an older version's record
    rewrite_manifest(tmp_path / "run", lambda m: m["peft"]["base_config"].update(architectures=["AutoTokenizer"]))
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "x"), "--merged"]) == 2
    assert re.search(r"could not be rebuilt.*names no transformers model class.*--adapter-only", capsys.readouterr().err)
    rewrite_manifest(tmp_path / "run", lambda m: m["peft"].pop("base_config") and None)
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "x"), "--merged"]) == 2
    assert re.search(r"does not record its base model's config.json.*--adapter-only", capsys.readouterr().err)
    full = train(write_config(tmp_path / "full", model_dir, data, **dict(settings, lora__r=0, lora__dora=False,
                                                                        lora__modules_to_save=None)), progress=False)
    assert full["step"] == 3
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "full" / "run"), str(tmp_path / "x"), "--merged"]) == 2
    assert re.search(r"no adapter.*tiered-offload export .* without --merged", capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


def test_lora_adapter_starts_a_second_stage_from_a_saved_adapter(tmp_path, model_dir, data, monkeypatch):
    """``lora.adapter: DIR`` (a first run's exported adapter): the second run's adapter starts as
    the saved one, read with the base (``init_from=[BASE, ADAPTER]``), not as PEFT initialises it,
    and trains on. Settings other than those it was trained with, or a directory that holds no
    adapter, are refused naming what differs."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from tiered_offload import Engine
    settings = dict(train__lr=0.05, train__max_steps=3, output__export_every=0, lora__r=8)
    first = Path(train(write_config(tmp_path / "first", model_dir, data, **settings), progress=False)["final"])
    started = {}
    built = Engine.__init__

    def recording(self, *args, **kwargs):
        built(self, *args, **kwargs)
        started.update(self.named_parameters())
    monkeypatch.setattr(Engine, "__init__", recording)
    second = train(write_config(tmp_path / "second", model_dir, data, lora__adapter=str(first), **settings),
                   progress=False)
    saved = load_file(first / "adapter_model.safetensors")
    assert saved and all(torch.equal(started[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())
    tuned = load_file(Path(second["final"]) / "adapter_model.safetensors")
    assert list(tuned) == list(saved) and any(not torch.equal(tuned[k], saved[k]) for k in saved)  # trained on
    for dry_run in (True, False):
        with pytest.raises(ConfigError, match=r"lora.adapter .* was trained with lora.alpha 16.0 \(this run: 32\)"):
            train(write_config(tmp_path / "third", model_dir, data, lora__adapter=str(first),
                               **dict(settings, lora__alpha=32)), progress=False, dry_run=dry_run)
    with pytest.raises(ConfigError, match=r"lora.adapter .* holds no adapter_config.json"):
        train(write_config(tmp_path / "fourth", model_dir, data, lora__adapter=str(model_dir), **settings), progress=False)


def test_a_changed_lora_layout_on_resume_is_refused_naming_the_setting(tmp_path, model_dir, data):
    """What trains (``lora.r``, ``lora.targets``, ``lora.dora``, ``lora.modules_to_save``, LoRA on or
    off) is the state's layout: a run continued with another was refused with the engine's
    "manifest.json was written for another model or optimizer: its units differ (...)". It names the
    setting, the value the run was trained with, and the ways on. ``lora.merged`` (exports only)
    continues."""
    pytest.importorskip("peft")
    settings = dict(train__lr=1e-3, output__export_every=0, lora__r=4)
    train(write_config(tmp_path, model_dir, data, train__max_steps=1, **settings), progress=False)
    for change, match in (({"lora__r": 8}, r"lora\.r is 8, and .* was trained with 4"),
                          ({"lora__dora": True}, r"lora\.dora is True, and .* was trained with False"),
                          ({"lora__targets": ["q_proj"]}, r"lora\.targets is \['q_proj'\], and .* with 'all-linear'"),
                          ({"lora__r": 0}, r"lora\.r is 0, and .* was trained with 4")):
        with pytest.raises(ConfigError, match=match + r".*set it back, or train into another offload\.storage"):
            train(write_config(tmp_path, model_dir, data, train__max_steps=2, **{**settings, **change}), progress=False)
    assert train(write_config(tmp_path, model_dir, data, train__max_steps=2, lora__merged=True, **settings),
                 progress=False)["step"] == 2


def test_drives_of_unequal_speed_are_striped_by_weight_and_the_same_command_resumes(tmp_path, model_dir, data):
    """``offload.stripe_weights`` (bench-io's advice for drives of unequal speed): the storage striped
    by them, recorded in the state, the same command resuming to the step an uninterrupted run
    reaches with the same weights; a resume without them is refused naming them. ``3:1`` unquoted
    is a number in YAML (181, base 60): refused, naming the key and the list to write."""
    dirs = [str(tmp_path / "nvme"), str(tmp_path / "sata")]
    settings = dict(offload__storage=dirs, offload__stripe_weights=[3, 1], output__export_every=0, train__eval_every=0)
    assert train(write_config(tmp_path, model_dir, data, train__max_steps=2, **settings), progress=False)["step"] == 2
    from tiered_offload.checkpoint.durable import StateFiles, state_directory
    manifest = json.loads(StateFiles(state_directory(dirs[0])).manifest_path.read_text().split(" ", 1)[1])
    assert manifest["storage"]["stripe_weights"] == [3, 1]
    even = {**settings, "offload__stripe_weights": None}
    with pytest.raises(CheckpointError, match=r"stripe weights 3:1"):
        train(write_config(tmp_path, model_dir, data, train__max_steps=3, **even), progress=False)
    assert train(write_config(tmp_path, model_dir, data, train__max_steps=3, **settings), progress=False)["step"] == 3
    for value, match in ((181, r"offload\.stripe_weights: 181 is not a list of weights.*\[3, 1\]"),
                         ([3, 0], r"offload\.stripe_weights: .*0 is not an integer from 1 to 64"),
                         ([3, 1, 1], r"offload\.stripe_weights: .*3 weights for 2 directories")):
        with pytest.raises(ConfigError, match=match):
            load_config(write_config(tmp_path / "bad", model_dir, data, **{**even, "offload__stripe_weights": value}))
    with pytest.raises(ConfigError, match=r"offload\.stripe_weights: .*offload\.storage.*several directories"):
        load_config(write_config(tmp_path / "one", model_dir, data, offload__stripe_weights=[3, 1]))

@pytest.mark.parametrize("setting, match", [
    ({"lora__targets": ["nope"]}, r"lora\.targets \['nope'\] matches no module of the model.*q_proj"),
    ({"lora__modules_to_save": ["nope"]}, r"lora\.modules_to_save 'nope' matches no module of the model"),
    ({"lora__alpha": "x"}, r"lora\.alpha must be a finite number > 0, got 'x'"),
    ({"lora__targets": 5}, r"lora\.targets must be a module name, a list of them or all-linear, got 5"),
    ({"lora__merged": "yes"}, r"lora\.merged must be true or false, got 'yes'"),
    ({"lora__merged": True, "lora__r": 0}, r"lora\.merged: true merges an adapter.*lora\.r is 0"),
], ids=["targets", "modules_to_save", "alpha", "targets' type", "merged's type", "merged without lora"])
def test_a_bad_lora_setting_is_refused_naming_it(tmp_path, model_dir, data, setting, match):
    """PEFT's own errors came through untyped (``NoMatchingPeftModuleError``, ``TypeError``), and a
    module to save that the model does not have was dropped without a word."""
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=match):
        train(write_config(tmp_path, model_dir, data, train__max_steps=1, **{"lora__r": 4, **setting}), progress=False)


def test_alpaca_puts_the_loss_on_the_responses_only(tmp_path, model_dir):
    path = tmp_path / "alpaca.jsonl"
    rows = [{"instruction": "say the word", "input": "cat", "output": "dogs ran"},
            {"instruction": "repeat", "output": "red houses"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.format=alpaca",
                             "data.packing=false", "data.max_seq_len=400", f"offload.storage={tmp_path / 's'}",
                             "train.max_steps=1"])  # the template alone is ~170 of this tiny tokenizer's tokens
    train_data, _ = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
    for i, row in enumerate(rows):
        labels = [int(x) for x in train_data.labels[i] if x != IGNORE]
        assert tokenizer.decode(labels).strip() == row["output"] + "</s>"
        ids = [int(x) for x in train_data.ids[i]]
        assert "### Response:" in tokenizer.decode(ids)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_prompt_completion_puts_the_loss_on_the_completions_only(tmp_path, model_dir, kind):
    """TRL's prompt-completion layout (``{"prompt": ..., "completion": ...}``, no template): the
    prompt's tokens (with the tokenizer's special tokens) carry no loss, the completion's and EOS do."""
    rows = [{"prompt": "the cat sat", "completion": " on a mat"}, {"prompt": "dogs", "completion": " ran around"},
            {"prompt": "", "completion": "big red houses"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / f"train.{kind}"
    if kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        pq.write_table(pa.Table.from_pylist([{**r, "source": "x"} for r in rows]), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_data, _ = _prepared(tmp_path, model_dir, path, "data.format=prompt-completion", "data.packing=false",
                              "data.max_seq_len=40", "data.eval_fraction=0")
    for i, row in enumerate(rows):
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(prompt) + len(completion)
        assert [int(x) for x in train_data.ids[i][:n]] == prompt + completion
        assert [int(x) for x in train_data.labels[i][:n]] == [IGNORE] * len(prompt) + completion
    if kind == "jsonl":
        path.write_text(json.dumps({"prompt": "x"}) + "\n")
        with pytest.raises(ConfigError, match=r"train\.jsonl line 1: a prompt-completion example needs a text "
                                              r"'completion'; its keys are prompt"):
            _prepared(tmp_path, model_dir, path, "data.format=prompt-completion")


def _hub_cache(root: Path, directory: Path, repo: str, kind: str = "models") -> Path:
    """``directory`` laid out as huggingface_hub's cache keeps a downloaded repository: files in
    ``blobs/`` by hash, a snapshot of links to them, ``refs/main`` naming it; returns the snapshot."""
    import hashlib
    repo_dir = root / (f"{kind}--" + repo.replace("/", "--"))
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / ("5" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (blobs / digest).write_bytes(f.read_bytes())
        link = snapshot / f.relative_to(directory)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blobs / digest, link.parent), link)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("5" * 40)
    return snapshot


def test_model_path_may_be_a_hub_id_or_a_snapshot_in_the_hub_cache(tmp_path, model_dir, data, monkeypatch):
    """``model.path: owner/name`` stopped with "is not a Hugging Face model directory": a user had
    to find the snapshot under ``~/.cache/huggingface/hub`` (whose files are links into
    ``blobs/``). An id that is not a local path is read as ``from_pretrained`` reads it, through
    huggingface_hub's cache (downloaded there if missing: the config, the safetensors weights, the
    tokenizer's files, nothing else); the run is the local directory's, bitwise. Offline and not
    cached, the error says so and what to do."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, model_dir, "acme/tiny-llama")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    runs = {}
    for name, path in (("local", model_dir), ("snapshot", snapshot), ("id", "acme/tiny-llama")):
        summary = train(write_config(tmp_path / name, path, data, train__max_steps=2, output__export_every=0),
                        progress=False)
        runs[name] = exported(Path(summary["final"]))
    assert all(torch.equal(runs["local"][k], runs[name][k]) for name in ("snapshot", "id") for k in runs["local"])
    # a LoRA adapter trained from an id names the id as its base, as PEFT's own does
    summary = train(write_config(tmp_path / "lora", "acme/tiny-llama", data, train__max_steps=1, output__export_every=0,
                                 lora__r=4), progress=False)
    adapter = json.loads((Path(summary["final"]) / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "acme/tiny-llama"
    # a dry run reads the config and the tokenizer, not the weights
    bare = tmp_path / "bare-model"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (bare / f.name).write_bytes(f.read_bytes())
    _hub_cache(cache, bare, "acme/no-weights")
    config = write_config(tmp_path / "dry", model_dir, data)
    assert train(config, ["model.path=acme/no-weights"], dry_run=True)["model"]
    with pytest.raises(ConfigError, match=r"model\.path .*models--acme--no-weights.* holds no weights"):
        train(config, ["model.path=acme/no-weights"], progress=False)
    with pytest.raises(ConfigError, match=r"model\.path acme/other is not a local directory, and the Hugging Face "
                                          r"Hub gave no model of that id \(.*\): download it .*or name its directory"):
        train(write_config(tmp_path / "other", model_dir, data), ["model.path=acme/other"], progress=False)
    with pytest.raises(ConfigError, match=r"model\.path .*no-such-dir does not exist"):
        train(write_config(tmp_path / "missing", model_dir, data), [f"model.path={tmp_path / 'no-such-dir'}"],
              progress=False)


def test_a_model_that_ships_pytorch_files_only_trains_as_its_safetensors(tmp_path, model_dir, data, monkeypatch):
    """A model directory (or Hub repository) with ``pytorch_model.bin`` and no safetensors, as many
    still are, stopped with "holds no safetensors weights; save the model with save_pretrained",
    which needs the whole model in memory. It now trains from those files, bitwise the run from
    its safetensors; a Hub id fetches them only where it has no safetensors."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from test_conformance import as_pytorch_files
    bin_dir = tmp_path / "bin-model"
    shutil.copytree(model_dir, bin_dir)
    as_pytorch_files(bin_dir)
    assert (bin_dir / "pytorch_model.bin").is_file() and not list(bin_dir.glob("*.safetensors"))
    cache = tmp_path / "hub"
    _hub_cache(cache, bin_dir, "acme/bin-only")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    runs = {}
    for name, path in (("safetensors", model_dir), ("pytorch", bin_dir), ("hub", "acme/bin-only")):
        summary = train(write_config(tmp_path / name, path, data, train__max_steps=2, output__export_every=0),
                        progress=False)
        runs[name] = exported(Path(summary["final"]))
    assert all(torch.equal(runs["safetensors"][k], runs[name][k]) for name in ("pytorch", "hub")
               for k in runs["safetensors"])


def test_a_hub_id_fetches_the_weights_from_pretrained_reads_and_no_others(tmp_path, model_dir, data, monkeypatch):
    """A Hub id fetched every ``*.safetensors`` at the top of the repository: Mistral's ships its
    weights twice (``consolidated.safetensors`` beside the index's shards), so a run downloaded
    twice the model. It now fetches what ``from_pretrained`` reads: the index's shards, else
    ``model.safetensors``, else PyTorch's files likewise; a dry run, none. An index naming a
    shard outside the repository is refused, naming it."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    import fnmatch
    from test_conformance import as_pytorch_files
    remotes, fetched = {}, []

    def snapshot_download(repo, revision=None, allow_patterns=(), ignore_patterns=()):
        local = tmp_path / "snapshots" / repo
        local.mkdir(parents=True, exist_ok=True)
        for f in sorted(remotes[repo].iterdir()):
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns) and not (local / f.name).exists():
                shutil.copy(f, local / f.name)
                fetched.append(f.name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    sharded = tmp_path / "sharded"  # the index's shards, a consolidated copy, PyTorch's copy
    transformers.AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(f.name for f in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shutil.copy(model_dir / "model.safetensors", sharded / "consolidated.safetensors")
    (sharded / "pytorch_model.bin").write_bytes(b"not fetched")
    single, pytorch = tmp_path / "single", tmp_path / "pytorch"
    shutil.copytree(model_dir, single)
    (single / "pytorch_model.bin").write_bytes(b"not fetched")
    shutil.copytree(sharded, pytorch)
    for f in (pytorch / "consolidated.safetensors", pytorch / "pytorch_model.bin"):
        f.unlink()
    as_pytorch_files(pytorch)
    for repo, remote in (("acme/sharded", sharded), ("acme/single", single), ("acme/pytorch", pytorch)):
        for f in model_dir.glob("*token*"):
            shutil.copy(f, remote / f.name)
        remotes[repo] = remote
    weights = {"acme/sharded": shards, "acme/single": ["model.safetensors"],
               "acme/pytorch": sorted(f.name for f in pytorch.glob("pytorch_model-*.bin"))}
    for repo, expected in weights.items():
        fetched.clear()
        summary = train(write_config(tmp_path / repo, model_dir, data, train__max_steps=1, output__export_every=0),
                        [f"model.path={repo}"], progress=False)
        assert summary["step"] == 1
        assert sorted(f for f in fetched if f.endswith((".safetensors", ".bin"))) == expected, (repo, fetched)
    fetched.clear()
    remotes["acme/dry"] = sharded
    assert train(write_config(tmp_path / "dry", model_dir, data), ["model.path=acme/dry"], dry_run=True)["model"]
    assert not [f for f in fetched if f.endswith((".safetensors", ".bin"))]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text((model_dir / "config.json").read_text())
    (outside / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    remotes["acme/outside"] = outside
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: shard name '\.\./secret\.safetensors' "
                                              r"is not a plain file name"):
        train(write_config(tmp_path / "o", model_dir, data), ["model.path=acme/outside"], progress=False)


def test_model_path_may_pin_a_hub_revision_or_be_an_hf_url(tmp_path, model_dir, data, monkeypatch):
    """``model.path: owner/name@REVISION`` (a commit, branch or tag: a run that can be repeated
    when the repository moves on) and ``hf://owner/name`` (as ``data.path`` names a Hub dataset)
    stopped with "does not exist". Both are read through huggingface_hub's cache, bitwise the
    local directory's run; a LoRA adapter names the id as its base and the revision as PEFT's
    ``revision``; a revision the cache and the Hub do not have is named."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    _hub_cache(cache, model_dir, "acme/tiny-llama")
    commit = "5" * 40  # the snapshot _hub_cache lays out
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    runs = {}
    for name, path in (("local", model_dir), ("commit", f"acme/tiny-llama@{commit}"), ("url", "hf://acme/tiny-llama"),
                       ("url-branch", "hf://acme/tiny-llama@main")):
        summary = train(write_config(tmp_path / name, model_dir, data, train__max_steps=2, output__export_every=0),
                        [f"model.path={path}"], progress=False)
        runs[name] = exported(Path(summary["final"]))
    assert all(torch.equal(runs["local"][k], runs[name][k]) for name in runs for k in runs["local"])
    summary = train(write_config(tmp_path / "lora", model_dir, data, train__max_steps=1, output__export_every=0,
                                 lora__r=4), [f"model.path=hf://acme/tiny-llama@{commit}"], progress=False)
    adapter = json.loads((Path(summary["final"]) / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "acme/tiny-llama" and adapter["revision"] == commit, adapter
    with pytest.raises(ConfigError, match=r"model\.path acme/tiny-llama@v9 is not a local directory, and the Hugging "
                                          r"Face Hub gave no model of that id at revision v9 \("):
        train(write_config(tmp_path / "other", model_dir, data), ["model.path=acme/tiny-llama@v9"], progress=False)


@pytest.mark.parametrize("case", ["an encoder-decoder", "an unknown model type", "the repository's own code", "config.json not JSON",
                                  "no tokenizer", "quantized"])
def test_a_model_directory_train_cannot_use_is_one_line_naming_it(tmp_path, model_dir, data, capsys, case):
    """``train`` fine-tunes causal language models. A T5 directory stopped with
    transformers' "Unrecognized configuration class" and a traceback listing 200 classes; a model
    type this transformers does not know, a damaged config.json and a directory without a
    tokenizer stopped with tracebacks too; a model of the repository's own code had transformers
    ask whether to run it, and wait; a quantized one would have read as damaged. Each is now one
    line naming the directory and what to do, exit status 2, for the dry run too."""
    import shutil
    d = tmp_path / "model"
    if case == "an encoder-decoder":
        transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=320, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)).save_pretrained(d)
        match = (r"model\.path .*model holds a t5 model \(T5ForConditionalGeneration\), and train fine-tunes causal "
                 r"language models \(AutoModelForCausalLM: .*\); train it through the API \(tiered_offload\.Engine\)")
    else:
        shutil.copytree(model_dir, d)
        if case == "an unknown model type":
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, "model_type": "llama-from-the-future"}))
            match = (r"model\.path .*model: transformers .* cannot read its config.json .*llama-from-the-future.*; "
                     r"upgrade transformers")
        elif case == "the repository's own code":  # (transformers asked "run the custom code? [y/N]" and waited)
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, "model_type": "acme-lm",
                                                       "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}))
            match = r"model\.path .*model: .*\(model_type 'acme-lm': .*\); its model is code of the repository's own"
        elif case == "config.json not JSON":
            (d / "config.json").write_text('{"model_type": "llama", ')
            match = r"model\.path .*model: transformers .* cannot read its config.json .*; save the model again"
        elif case == "quantized":  # (an AWQ checkpoint: its packed weights are no fp32 tensors; FP8 and MXFP4 are read)
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
            match = (r"model\.path .*model is a quantized checkpoint \(quantization_config: awq\), and train trains "
                     r"fp32 weights from bf16, fp16 or fp32 ones; start from the unquantized model")
        else:
            for f in d.glob("*token*"):
                f.unlink()
            match = r"model\.path .*model holds no tokenizer .*; save the tokenizer beside the model"
    if case == "an encoder-decoder":
        for f in model_dir.glob("*token*"):
            shutil.copy(f, d / f.name)
    config = write_config(tmp_path, model_dir, data)
    capsys.readouterr()
    for dry_run in ((), ("--dry-run",)):
        assert cli_main(["train", "--config", str(config), "--no-progress", *dry_run, f"model.path={d}"]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", ["output.dir a file", "an unknown backend"])
def test_an_output_or_backend_train_cannot_use_is_named_before_anything_runs(tmp_path, model_dir, data, capsys, case):
    """``output.dir`` naming a file stopped with a FileExistsError traceback. ``offload.backend:
    nope`` trained into a directory named ``nope:/...`` under the working directory (a storage spec
    whose name is no backend is read as a directory with a colon in its name). Both are now one
    line naming the setting, for the dry run too, and nothing is written."""
    f = tmp_path / "a-file"
    f.write_text("x")
    if case == "output.dir a file":
        setting, match = f"output.dir={f}", r"output\.dir .*a-file is a file, not a directory"
    else:
        setting, match = "offload.backend=nope", r"offload\.backend 'nope' is no storage backend here; they are .*posix"
    config = write_config(tmp_path, model_dir, data)
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    for dry_run in ((), ("--dry-run",)):
        assert cli_main(["train", "--config", str(config), "--no-progress", *dry_run, setting]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not Path("nope:").exists()


def test_data_path_may_name_a_hub_datasets_files(tmp_path, model_dir, monkeypatch):
    """``data.path: hf://datasets/OWNER/NAME/PATH`` (the Hub's own file URLs, as pandas and DuckDB
    read them; PATH a file or a glob, ``@REVISION`` after the name) reads those files of the
    dataset through huggingface_hub's cache, downloading only them; the sequences are those of the
    same files on the local disk. A dataset the Hub does not give, or a spec without PATH, is a
    ConfigError saying what to write."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    dataset = tmp_path / "dataset"
    (dataset / "data").mkdir(parents=True)
    rows = PARQUET_ROWS["completion"]
    for i, part in enumerate((rows[:20], rows[20:])):
        pq.write_table(pa.Table.from_pylist(part), dataset / "data" / f"train-{i:05d}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:5]), dataset / "data" / "test-00000-of-00001.parquet")
    cache = tmp_path / "hub"
    _hub_cache(cache, dataset, "acme/stories", kind="datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    settings = ("data.packing=false", "data.max_seq_len=40", "data.eval_fraction=0")
    local = _prepared(tmp_path, model_dir, dataset / "data" / "train-*.parquet", *settings)
    assert len(local[0]) == len(rows)
    for spec in ("hf://datasets/acme/stories/data/train-*.parquet", "hf://datasets/acme/stories@main/data/train-*.parquet"):
        assert _same(_prepared(tmp_path, model_dir, spec, *settings), local)
    held = _prepared(tmp_path, model_dir, "hf://datasets/acme/stories/data/train-*.parquet", *settings,
                     "data.eval_path=hf://datasets/acme/stories/data/test-00000-of-00001.parquet")
    assert len(held[1]) == 5
    with pytest.raises(ConfigError, match=r"data\.path hf://datasets/acme/other/x\.parquet: the Hugging Face Hub gave no "
                                          r"dataset acme/other \(.*\); download it \(hf download --repo-type dataset"):
        _prepared(tmp_path, model_dir, "hf://datasets/acme/other/x.parquet")
    with pytest.raises(ConfigError, match=r"data\.path hf://datasets/acme/stories: write hf://datasets/OWNER/NAME/PATH"):
        _prepared(tmp_path, model_dir, "hf://datasets/acme/stories")
    with pytest.raises(ConfigError, match=r"data\.path hf://datasets/acme/stories/data/valid-\*\.parquet matches no file"):
        _prepared(tmp_path, model_dir, "hf://datasets/acme/stories/data/valid-*.parquet")


def test_the_errors_a_user_hits_name_what_to_change(tmp_path, model_dir, data, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="holds no weights"):
        train(write_config(tmp_path, bare, data), progress=False)
    missing = tmp_path / "bad.jsonl"
    missing.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl line 2: no text field 'text'"):
        train(write_config(tmp_path, model_dir, missing), progress=False)
    with pytest.raises(ConfigError, match="longer than the model's 64 positions"):
        train(write_config(tmp_path, model_dir, data, data__max_seq_len=128), progress=False)
    with pytest.raises(TierCapacityError, match="Raise host_memory to at least"):
        train(write_config(tmp_path, model_dir, data, offload__host_memory=4096), progress=False)
    with pytest.raises(ConfigError, match="unknown key train.learning_rate"):
        train(write_config(tmp_path, model_dir, data), ["train.learning_rate=1"], progress=False)
    # a storage directory of another model
    other = transformers.LlamaConfig(vocab_size=320, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    other_dir = tmp_path / "other-model"
    transformers.LlamaForCausalLM(other).save_pretrained(other_dir)
    for f in model_dir.glob("*token*"):
        (other_dir / f.name).write_bytes(f.read_bytes())
    train(write_config(tmp_path / "x", other_dir, data, train__max_steps=1, output__export_every=0), progress=False)
    with pytest.raises(CheckpointError, match="another model"):
        train(write_config(tmp_path / "x", model_dir, data, train__max_steps=1), progress=False)
    assert cli_main(["train", "--config", str(write_config(tmp_path, bare, data)), "--no-progress"]) == 2
    assert "holds no weights" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty", "blank lines", "a directory", "a number for the text"])
def test_a_data_file_without_examples_is_named_with_what_is_wrong(tmp_path, model_dir, case):
    """An empty data file (or one of blank lines) stopped the run with "TypeError: object of type
    'NoneType' has no len()"; a directory was "does not exist" (now its data files are read: one
    without any says what it looked for); a text field holding a number was "no text field 'text';
    its keys are text". Each is now a ConfigError that says what it found."""
    path = tmp_path / "train.jsonl"
    if case == "a directory":
        path.mkdir()
        match = r"train.jsonl holds no data file \(\*\.jsonl, \*\.json, \*\.parquet\) for data.format completion"
    elif case == "a number for the text":
        path.write_text(json.dumps({"text": 5}) + "\n")
        match = r"train.jsonl line 1: its field 'text' holds 5 \(int\), not a string"
    else:
        path.write_text("" if case == "empty" else "\n  \n\n")
        match = r"train.jsonl holds no example.*data.format completion"
    with pytest.raises(ConfigError, match=match):
        train(write_config(tmp_path, model_dir, path), progress=False)
    assert not list((tmp_path / "out" / ".cache").glob("data-*"))  # (what was tokenised is removed)


def test_a_plain_text_file_read_as_json_lines_says_which_format_reads_it(tmp_path, model_dir):
    """A ``.txt`` file given without ``data.format`` (``completion``, the default, reads JSON lines)
    stopped with "line 1: not JSON (Expecting value ...)", which does not say what to change. The
    error now names the format that reads plain text. A JSON-lines file broken further down keeps
    the line's own error alone: its format is the right one."""
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(sentences(40, seed=3)))
    with pytest.raises(ConfigError, match=r"notes\.txt line 1: not JSON .*data\.format completion reads JSON lines.*"
                                          r"plain text trains with data\.format text"):
        train(write_config(tmp_path, model_dir, path, train__max_steps=1), progress=False)
    broken = tmp_path / "train.jsonl"
    broken.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(5, seed=3)) + "{oops\n")
    with pytest.raises(ConfigError, match=r"train\.jsonl line 6: not JSON \(Expecting .*\)$") as refused:
        train(write_config(tmp_path, model_dir, broken, train__max_steps=1), progress=False)
    assert "data.format" not in str(refused.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_json_file_given_as_text_is_refused_not_trained_on_as_characters(tmp_path, model_dir, suffix):
    """``data.format: text`` with a ``.jsonl`` file (the format left at the wrong value, or copied
    from a text run) trained on the file's characters: braces, quotes and keys in every sequence,
    the loss falling, nothing said. A Parquet file was refused; a JSON one now is too, before any
    tokenising, with the format that reads its examples. A glob matching one is refused alike. The
    cache a refused run began is removed (it kept an empty directory; one that failed late, the
    arrays tokenised so far, until a later run's start)."""
    rows = [{"text": s} for s in sentences(40, seed=2)]
    path = tmp_path / f"train{suffix}"
    path.write_text(json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    for spec in (path, tmp_path / "train*"):
        with pytest.raises(ConfigError, match=rf"train\{suffix} is JSON.*data\.format text reads plain text.*"
                                              rf"data\.format completion"):
            train(write_config(tmp_path, model_dir, spec, data__format="text", train__max_steps=1), progress=False)
        assert not list((tmp_path / "out" / ".cache").glob("data-*"))  # (nothing tokenised is left behind)
    (tmp_path / "notes.txt").write_text("\n\n".join(r["text"] for r in rows))
    summary = train(write_config(tmp_path, model_dir, tmp_path / "notes.txt", data__format="text",
                                 data__max_seq_len=16, train__max_steps=1, output__export_every=0), progress=False)
    assert summary["step"] == 1


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_data_path_that_is_no_file_is_named_for_what_it_is(tmp_path, model_dir, kind):
    """A FIFO (``data.path=<(zcat train.jsonl.gz)``, a named pipe) or a device as ``data.path``
    stopped the run with "does not exist", though it does. The data is read more than once (a
    ``.json`` file's first bytes, then its examples; Parquet seeks), which a pipe cannot give: the
    error says what the path is and to save the data to a file. Nothing is read from it."""
    if kind == "fifo":
        path = tmp_path / "train.jsonl"
        os.mkfifo(path)
    else:
        path = Path("/dev/null")
    for key in ("data.path", "data.eval_path"):
        settings = [f"data.path={path}"] if key == "data.path" else [f"data.eval_path={path}"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(8, seed=1)))
        cfg = load_config(None, [f"model.path={model_dir}", f"data.path={data}", f"offload.storage={tmp_path / 's'}",
                                 "train.max_steps=1", *settings])
        what = "a FIFO" if kind == "fifo" else "a device"
        with pytest.raises(ConfigError, match=rf"{key} {re.escape(str(path))} is {what}, not a file.*save"):
            prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)


def test_a_cached_array_changed_on_disk_is_tokenised_again_not_trained_on(tmp_path, model_dir, data, caplog):
    """The tokenised data's cache kept its arrays' hash in its mark ``done`` but never checked it:
    a byte changed in an array (a bad disk, a copy gone wrong, a tool run on the wrong directory)
    trained on other tokens, silently, and a resume saw the same data as before. Each start now
    checks the arrays against the hash; ones that differ are tokenised again from the data, saying
    so, and train on the tokens they were made with."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={data}", f"offload.storage={tmp_path / 's'}",
                             "train.max_steps=1"])
    cache = tmp_path / "cache"
    first, _ = prepare_data(cfg.data, tokenizer, model_dir, cache, None)
    ids, labels = np.array(first.ids), np.array(first.labels)  # (copies: the arrays map the files changed below)
    (made,) = cache.glob("data-*")
    for name in ("train_ids.npy", "train_labels.npy"):
        raw = bytearray((made / name).read_bytes())
        raw[-3] ^= 0x01  # (a token of the last sequence: the array still loads)
        (made / name).write_bytes(bytes(raw))
        with caplog.at_level("WARNING", logger="tiered_offload"):
            caplog.clear()
            again, _ = prepare_data(cfg.data, tokenizer, model_dir, cache, None)
        assert "tokenised again" in caplog.text and "hash" in caplog.text, caplog.text
        assert again.content == first.content
        assert np.array_equal(again.ids, ids) and np.array_equal(again.labels, labels)


_FILL = """
import json, sys, transformers
from pathlib import Path
from tiered_offload.train.config import load_config
from tiered_offload.train.data import prepare_data
model_dir, data, cache = sys.argv[1:4]
cfg = load_config(None, [f"model.path={model_dir}", f"data.path={data}", "offload.storage=/nowhere",
                         "train.max_steps=1"])
try:
    prepare_data(cfg.data, transformers.AutoTokenizer.from_pretrained(model_dir), Path(model_dir), Path(cache), None)
    out = {"error": None}
except Exception as e:
    out = {"error": type(e).__name__, "message": str(e)}
out["left"] = sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*") if p.is_file() and p.name != "lock")
print(json.dumps(out))
"""


@pytest.mark.parametrize("room", ["100k", "300k"])
def test_a_disk_that_fills_while_the_data_is_tokenised_is_a_disk_full_error(tmp_path, model_dir, room):
    """output.dir on a disk with too little room for the tokenised data: where the tokens' spool
    filled it (100k) the run stopped with an untyped ``OSError`` from a file's close; where the
    sequences' arrays did (300k, written through memory maps of files the disk had no blocks for)
    the process was killed by ``SIGBUS``, with no message at all. Either way the cache's partial
    files filled the disk. Now the arrays' blocks are reserved before they are mapped, a full disk
    is a ``DiskFullError`` naming the cache and what to do, and the partial cache is removed.

    The disk is a tmpfs of ``room`` bytes, mounted in a mount namespace of the child's own
    (``unshare``: no privilege needed where user namespaces are allowed)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine lets no process mount a tmpfs of its own (unshare -rm)")
    data = tmp_path / "big.jsonl"  # (~36k tokens: a spool of ~180 KB, arrays of ~290 KB)
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(3000, seed=1)))
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_FILL)
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={room} tmpfs "$1" && shift && '
                        f'exec "$@"', "sh", str(disk), sys.executable, str(script), str(model_dir), str(data),
                        str(disk / "cache")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] == "DiskFullError", out
    assert re.search(r"the disk filled while the data was tokenised into .*cache/data-.*free space there, or put "
                     r"output\.dir on a disk with more room", out["message"]), out["message"]
    assert out["left"] == [], out  # (the partial cache removed: its room given back)


def test_no_room_for_the_tokenised_arrays_is_found_before_they_are_written(tmp_path, model_dir, data, monkeypatch):
    """The same as the test above, where no mount namespace can be made: the room of each array is
    reserved before it is mapped (a write through a map of a file the disk has no blocks for is a
    ``SIGBUS``), and a disk that has none is a ``DiskFullError``, the partial cache removed."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    cache = tmp_path / "cache"
    with pytest.raises(DiskFullError, match=r"the disk filled while the data was tokenised into"):
        _prepared_into(cache, model_dir, data)
    assert [p for p in cache.rglob("*") if p.is_file() and p.name != "lock"] == []
    monkeypatch.undo()
    assert len(_prepared_into(cache, model_dir, data)[0]) > 0


def _prepared_into(cache, model_dir, path, *settings):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.max_seq_len=16",
                             "offload.storage=/nowhere", "train.max_steps=1", *settings])
    return prepare_data(cfg.data, tokenizer, model_dir, cache, None)


def _prepared(tmp_path, model_dir, path, *settings):
    """The training and evaluation datasets ``prepare_data`` makes of ``path`` (each call its own cache)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.max_seq_len=16",
                             f"offload.storage={tmp_path / 's'}", "train.max_steps=1", *settings])
    return prepare_data(cfg.data, tokenizer, model_dir, Path(tempfile.mkdtemp(dir=tmp_path)), None)


def _same(a, b) -> bool:
    """Whether two ``(train, eval)`` pairs of datasets hold the same arrays."""
    return all((da is None and db is None) or (da is not None and db is not None and all(
        (x is None and y is None) or np.array_equal(x, y)
        for x, y in ((da.ids, db.ids), (da.labels, db.labels), (da.attention, db.attention)))) for da, db in zip(a, b))


@pytest.mark.parametrize("packing", [True, False])
def test_the_data_may_be_a_directory_or_a_glob_of_shards(tmp_path, model_dir, packing):
    """A dataset in shards (``train-00000-of-00003.jsonl`` ...) is one corpus: ``data.path`` (and
    ``data.eval_path``) may name a directory (its ``.jsonl`` / ``.json`` files, or ``.txt`` for
    ``format: text``, in name order) or a glob; the sequences are those of the shards concatenated
    in that order. Only one file was taken ("is a directory; name the data file in it"). An error
    names the shard and its line."""
    rows = [json.dumps({"text": s}) + "\n" for s in sentences(90, seed=3)]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"train-{i:05d}-of-00003.jsonl").write_text("".join(rows[30 * i:30 * (i + 1)]))
    (shards / "README.md").write_text("# not data\n")
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(rows))
    settings = (f"data.packing={packing}", "data.eval_fraction=0.1")
    reference = _prepared(tmp_path, model_dir, whole, *settings)
    assert len(reference[0]) > 0 and len(reference[1]) > 0
    assert _same(_prepared(tmp_path, model_dir, shards, *settings), reference)
    assert _same(_prepared(tmp_path, model_dir, shards / "train-*.jsonl", *settings), reference)
    held = _prepared(tmp_path, model_dir, shards / "train-0000[01]-*.jsonl", f"data.packing={packing}",
                     f"data.eval_path={shards / 'train-00002-*.jsonl'}")
    first, last = (tmp_path / "first.jsonl", tmp_path / "last.jsonl")
    first.write_text("".join(rows[:60]))
    last.write_text("".join(rows[60:]))
    assert _same(held, _prepared(tmp_path, model_dir, first, f"data.packing={packing}", f"data.eval_path={last}"))
    (shards / "train-00001-of-00003.jsonl").write_text("".join(rows[30:40]) + "{not json\n")
    with pytest.raises(ConfigError, match=r"train-00001-of-00003\.jsonl line 11: not JSON"):
        _prepared(tmp_path, model_dir, shards, *settings)
    with pytest.raises(ConfigError, match=r"data\.path .*nothing-\*\.jsonl matches no file"):
        _prepared(tmp_path, model_dir, shards / "nothing-*.jsonl")
    with pytest.raises(ConfigError, match=r"data\.path .*shards holds no data file \(\*\.txt\) for data\.format text"):
        _prepared(tmp_path, model_dir, shards, "data.format=text")


@pytest.mark.parametrize("odd", ["a dangling link", "a FIFO"])
@pytest.mark.parametrize("named", ["directory", "glob"])
def test_a_shard_that_is_no_file_is_named_not_left_out(tmp_path, model_dir, odd, named):
    """A dataset directory (or glob) where one shard is a link whose target is gone (a Hub
    dataset's cache with a blob deleted, a copy of links) or a FIFO: the shard was left out, and
    the run trained on the others, silently. It is refused, naming the shard."""
    rows = [json.dumps({"text": s}) + "\n" for s in sentences(60, seed=4)]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"train-{i:05d}-of-00003.jsonl").write_text("".join(rows[30 * i:30 * (i + 1)]))
    gone = shards / "train-00002-of-00003.jsonl"
    if odd == "a FIFO":
        os.mkfifo(gone)
        what = r"is a FIFO, not a file"
    else:
        gone.symlink_to(tmp_path / "blobs" / "0123")
        what = r"is a link to .*blobs/0123, which does not exist"
    path = shards if named == "directory" else shards / "train-*.jsonl"
    with pytest.raises(ConfigError, match=rf"data\.path .*train-00002-of-00003\.jsonl {what}"):
        _prepared(tmp_path, model_dir, path)


@pytest.mark.parametrize("suffix,fmt", [(".jsonl", "completion"), (".json", "alpaca"), (".json", "array"),
                                        (".txt", "text"), (".parquet", "completion")])
def test_a_fifo_put_in_a_data_files_place_after_its_check_is_named_not_waited_on(tmp_path, monkeypatch, suffix, fmt):
    """The data files are checked to be files when the run lists them, and opened when they are
    tokenised. A FIFO put in a file's place between the two (another process in the directory)
    made the run wait for a writer forever. Each reader opens its file without waiting and checks
    what it opened: a FIFO is refused at once, naming it. (``array``: put there after the file's
    first bytes were read, which said it holds a JSON array.)"""
    if suffix == ".parquet":
        pytest.importorskip("pyarrow.parquet")
    from tiered_offload.train import sources
    if fmt == "array":
        monkeypatch.setattr(sources, "_json_array", lambda path: True)
        fmt = "alpaca"
    path = tmp_path / f"train{suffix}"
    os.mkfifo(path)  # (the check passed on the file that stood here)
    try:
        with pytest.raises(ConfigError, match=rf"^data\.path {re.escape(str(path))} is a FIFO, not a file"):
            _within(10, lambda: list(sources.examples(path, fmt, "text")))
    finally:
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))  # (a reader left waiting returns)


def _documents(data, pad: int = 3) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every example in ``data`` packed as documents: a stretch whose
    position ids count up from 0 (the padding after the last example, all pad tokens, left out)."""
    out = []
    for row, (ids, positions) in enumerate(zip(data.ids, data.positions)):
        starts = [int(i) for i in np.flatnonzero(positions == 0)] + [len(positions)]
        assert all((positions[a:b] == np.arange(b - a)).all() for a, b in zip(starts, starts[1:]))
        out += [(row, a, b) for a, b in zip(starts, starts[1:]) if not (ids[a:b] == pad).all()]
    return out


def test_packing_documents_puts_whole_examples_in_sequences_that_attend_only_to_themselves(tmp_path, model_dir):
    """``data.packing: documents``: every example whole in one sequence (best fit, longest first), its
    position ids from 0, its first token no target (nothing of it is in view before it), the padding
    after the last one its own stretch; Hugging Face's attention reads the restarting position ids
    as separate documents, so each example's logits are those it has alone. ``packing: true`` cuts
    examples across sequences, and each attends to the ones before it: its logits are others."""
    g = torch.Generator().manual_seed(3)
    words = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
             for n in torch.randint(1, 12, (60,), generator=g)]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": w[: len(w) // 2], "completion": w[len(w) // 2:]}) + "\n"
                            for w in words))
    settings = ("data.format=prompt-completion", "data.max_seq_len=40", "data.eval_fraction=0")
    alone, _ = _prepared(tmp_path, model_dir, path, "data.packing=false", *settings)
    packed, _ = _prepared(tmp_path, model_dir, path, "data.packing=documents", *settings)
    assert alone.positions is None and len(packed) < len(alone) / 2, (len(packed), len(alone))
    examples = sorted((tuple(ids[m == 1]), tuple(np.concatenate([[IGNORE], lab[m == 1][1:]])))
                      for ids, lab, m in zip(alone.ids, alone.labels, alone.attention))
    found = sorted((tuple(packed.ids[r, a:b]), tuple(packed.labels[r, a:b])) for r, a, b in _documents(packed))
    assert found == examples  # each example once, whole, its first token no target
    assert all((packed.labels[r, b:] == IGNORE).all() for r, b in
               ((r, max(e for q, _, e in _documents(packed) if q == r)) for r in range(len(packed))))
    batch = packed.batch([0, 1])
    assert set(batch) == {"input_ids", "labels", "position_ids"}

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.config.use_cache = False  # (as the engine trains it: with a cache, transformers reads no documents)
    row = max(range(len(packed)), key=lambda r: sum(q == r for q, _, _ in _documents(packed)))
    spans = [(a, b) for q, a, b in _documents(packed) if q == row]
    assert len(spans) >= 3
    ids = torch.tensor(np.asarray(packed.ids[row:row + 1]), dtype=torch.long)
    with torch.no_grad():
        together = model(input_ids=ids, position_ids=torch.tensor(np.asarray(packed.positions[row:row + 1]),
                                                                  dtype=torch.long)).logits[0]
        attending = model(input_ids=ids).logits[0]
        for a, b in spans:
            own = model(input_ids=ids[:, a:b]).logits[0]
            torch.testing.assert_close(together[a:b], own, rtol=1e-5, atol=1e-5)
        a, b = spans[-1]
        assert not torch.allclose(attending[a:b], model(input_ids=ids[:, a:b]).logits[0], atol=1e-3)


def _same_weights(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_best_fit_places_every_example_in_a_sequence_that_holds_it():
    """The placement ``data.packing: documents`` uses: every example in one sequence, none over the
    length, within best-fit decreasing's bound of the fewest possible (11/9 of it, plus one), the
    same for the same lengths; lengths equal to the capacity or of a single token included."""
    from tiered_offload.train.packing import best_fit
    rng = np.random.default_rng(0)
    cases = ((64, rng.integers(1, 65, 500)), (8, np.array([8, 1, 7, 8, 2, 6, 3, 5, 4])),
             (2048, np.minimum(rng.lognormal(5.5, 1.0, 5000).astype(int) + 1, 2048)))
    for capacity, lengths in cases:
        where = best_fit(lengths, capacity)
        used = np.bincount(where, weights=lengths)
        fewest = math.ceil(lengths.sum() / capacity)
        assert len(where) == len(lengths) and used.max() <= capacity and (used > 0).all()
        assert len(used) <= 11 * fewest / 9 + 1, (len(used), fewest)
        assert np.array_equal(where, best_fit(lengths.copy(), capacity))


@pytest.mark.parametrize("clip", [1.0, None], ids=["clipped", "in-backward"])
@pytest.mark.parametrize("kind", ["opt", "mamba"])
def test_packing_documents_with_a_model_whose_attention_ignores_position_ids_is_refused(tmp_path, model_dir, data,
                                                                                         kind, clip):
    """A model whose forward builds no attention mask from the position ids (OPT's masks and
    positions come from the attention mask; a state-space model carries its state from one
    example into the next) would train each example on the ones before it: refused at the first
    step, naming the model and the setting, with nothing trained. Without clipping (the step in
    the backward, snapshot commits) too: the check's step runs after its backward."""
    more = {} if clip else dict(train__clip=None, offload__commit_every=2)
    other = tmp_path / f"tiny-{kind}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.save_pretrained(other)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    if kind == "opt":
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, **special))
    else:
        model = transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, **special))
    model.save_pretrained(other)
    records = []
    config = write_config(tmp_path, other, data, train__max_steps=2, output__export_every=0,
                          data__packing="documents", **more)
    with pytest.raises(ConfigError, match=rf"data.packing: documents.*{type(model).__name__}.*packing: true or false"):
        train(config, progress=False, on_step=lambda s, r: records.append(r))
    assert records == []
    again = train(write_config(tmp_path, other, data, train__max_steps=2, output__export_every=0, **more),
                  progress=False)
    fresh = train(write_config(tmp_path / "fresh", other, data, train__max_steps=2, output__export_every=0, **more),
                  progress=False)
    assert again["step"] == 2 and _same_weights(exported(Path(again["final"])), exported(Path(fresh["final"])))


def test_the_tokenised_data_of_other_settings_is_not_kept(tmp_path, model_dir, caplog):
    """Each change of the data (a file edited, another max_seq_len) tokenises again into a cache of
    its own beside the run, and the old ones stayed: the disk filled a little more every run (~9
    bytes a token each). The run keeps the cache of its current data only, and says what it removed."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / "train.jsonl"
    cache = tmp_path / "cache"

    def prepare(n, length):
        path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(n, seed=n)))
        cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", f"data.max_seq_len={length}",
                                 f"offload.storage={tmp_path / 's'}", "train.max_steps=1"])
        train_data, _ = prepare_data(cfg.data, tokenizer, model_dir, cache, None)
        return len(train_data)
    first = prepare(40, 16)
    assert len(list(cache.glob("data-*"))) == 1
    with caplog.at_level("INFO", logger="tiered_offload"):
        assert prepare(80, 16) > first  # the file grew
    kept = list(cache.glob("data-*"))
    assert len(kept) == 1 and "removed the tokenised data of other settings" in caplog.text, caplog.text
    prepare(80, 8)
    assert len(list(cache.glob("data-*"))) == 1 and not kept[0].exists()


_FILLED_MID_RUN = """
import json, os, signal, sys
from pathlib import Path
from tiered_offload.train import train
config, disk = sys.argv[1], Path(sys.argv[2])


def fill(step, record):  # (another job's files fill the disk after the first step)
    if step == 1:
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(1 << 16))
        except OSError:
            os.close(fd)
out = {}
handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]  # (SIGINT ignored where started so)
try:
    train(config, progress=False, on_step=fill)
except Exception as e:
    out["error"], out["message"] = type(e).__name__, str(e)
out["handler"] = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
os.unlink(disk / "filler")
try:
    out["again"] = train(config, progress=False)["step"]
except Exception as e:
    out["again"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("room", ["full", "injected"])
def test_a_disk_filled_mid_run_stops_it_typed_and_the_same_command_finishes_it(tmp_path, model_dir, data, room,
                                                                                 monkeypatch):
    """The output.dir's disk filled by something else after the first step: ``metrics.jsonl``'s
    write was an untyped ``OSError``; the last one (the evaluation's, flushed when the file closed)
    was raised by the cleanup before the engine closed, so the storage stayed locked (the same
    call again in the process: ``StorageLockedError``) and the command's signal handlers stayed in
    place. Now the run stops with a ``DiskFullError`` naming ``metrics.jsonl``, the engine closes
    (its steps committed), and the same command again, with room, finishes the run.

    ``full``: a tmpfs in a mount namespace of the child's own (``unshare``), filled for real;
    ``injected``: where no namespace can be made, the metrics file's writes fail with ENOSPC."""
    config = write_config(tmp_path, model_dir, data, train__max_steps=24, train__eval_every=0,
                          output__export_every=0, output__dir=str(tmp_path / "disk" / "out"))
    (tmp_path / "disk").mkdir()
    if room == "full":
        if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
            pytest.skip("this machine lets no process mount a tmpfs of its own (unshare -rm)")
        script = tmp_path / "filled.py"
        script.write_text(_FILLED_MID_RUN)
        r = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=3M tmpfs "$1" && shift && exec "$@"',
                            "sh", str(tmp_path / "disk"), sys.executable, str(script), str(config),
                            str(tmp_path / "disk")], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    else:
        import errno
        import tiered_offload.train.outputs as run_module

        class Full:  # (a file whose writes find no room after the first step's)
            def __init__(self, f):
                self.f, self.lines = f, 0

            def write(self, text):
                self.lines += 1
                if self.lines > 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return self.f.write(text)

            def __getattr__(self, name):
                return getattr(self.f, name)
        monkeypatch.setattr(run_module, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)
        out = {}
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]  # (ignored where started so)
        try:
            train(config, progress=False)
        except Exception as e:
            out["error"], out["message"] = type(e).__name__, str(e)
        out["handler"] = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
        monkeypatch.undo()
        out["again"] = train(config, progress=False)["step"]
    assert out.get("error") == "DiskFullError", out
    assert re.search(r"metrics\.jsonl.*no room.*committed.*the same command again", out["message"]), out["message"]
    assert out["handler"] and out["again"] == 24, out


class _Hang(BaseException):  # (no OSError: the code under test may catch those)
    pass


def _within(seconds: float, fn):
    """``fn()`` on this thread (the command sets its signal handlers), stopped with :class:`_Hang`
    where it has not returned after ``seconds`` (a wait on a FIFO)."""
    def ring(*_):
        raise _Hang(f"no answer after {seconds}s")
    before = signal.signal(signal.SIGALRM, ring)
    # (sent to this thread: a signal to the process may land on another, leaving a wait here unbroken)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.get_ident(), signal.SIGALRM))
    timer.start()
    try:
        return fn()
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "config.json", "generation_config.json",
                                  "model.safetensors", "a dangling link"])
def test_a_fifo_in_the_model_directory_is_named_not_skipped(tmp_path, model_dir, data, name):
    """A FIFO among a model directory's files (a tool's leftover, a copy that went wrong):
    transformers skipped it as the ``tokenizer_config.json`` or ``generation_config.json`` (the run
    trained, silently, with the tokenizer's defaults: a chat template or special tokens there were
    gone), and the run said "no config.json", "no tokenizer transformers can load" or "holds no
    weights" for the others, though they are there. Each is refused at once, naming the file and
    what it is. (Within a time: a reader that opened it would wait.)"""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    if name == "a dangling link":  # (an HF cache snapshot whose blob is gone: transformers skipped it the same way)
        name, what = "tokenizer_config.json", r"a link to \.\./blobs/0123, which does not exist"
        (copy / name).unlink()
        (copy / name).symlink_to("../blobs/0123")
    else:
        what = "a FIFO, not a file"
        (copy / name).unlink()
        os.mkfifo(copy / name)
    config = write_config(tmp_path, model_dir, data, train__max_steps=1, model__path=str(copy))
    with pytest.raises(ConfigError, match=rf"model\.path .*model: {re.escape(name)} is {what}"):
        _within(60, lambda: train(config, progress=False))


def test_a_tokenizer_file_an_export_cannot_write_is_named(tmp_path, model_dir, data, monkeypatch):
    """The export's copy of the tokenizer's files (Llama 3's ``tokenizer.json`` is 9 MB, which the
    run's up-front check of the exports' room does not count) on a disk with no room left was an
    untyped ``OSError``. It is a ``DiskFullError`` naming the export and the file, and the same
    command again writes the final export whole."""
    import errno
    import tiered_offload.checkpoint.safetensors_io as run_module  # (where the copy writes: copy_tokenizer)
    real = run_module.write_private

    def full(path, data, **kw):
        if path.name == "tokenizer.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, **kw)
    monkeypatch.setattr(run_module, "write_private", full)
    config = write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0)
    with pytest.raises(DiskFullError, match=r"out/final: the weights are exported, and the tokenizer's tokenizer\.json "
                                            r"is not \(no room on its disk\).*the same command again"):
        train(config, progress=False)
    monkeypatch.undo()
    assert train(config, progress=False)["step"] == 2
    assert (tmp_path / "out" / "final" / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("case", ["cache-fifo", "cache-cut", "exports", "metrics"])
def test_what_is_not_a_regular_file_among_the_runs_own_files_is_no_hang(tmp_path, model_dir, data, case, caplog):
    """The same command again read and wrote the run's own files as it found them: a FIFO in the
    tokenised data's cache (its mark or an array) or as the final export's ``config.json`` made it
    wait forever; a FIFO as ``metrics.jsonl`` too; one as the export's ``tokenizer.json`` was an
    untyped ``SpecialFileError``; a link there had its target overwritten; a cut array was an
    untyped ``ValueError``. The cache is tokenised again (it is made from the data), an export's
    files are replaced whole, and ``metrics.jsonl`` is refused, naming it."""
    from test_hostile import _unblock
    within = _within
    config = write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0)
    train(config, progress=False)
    out = tmp_path / "out"
    (cache,) = (out / ".cache").glob("data-*")
    outside = tmp_path / "notes.txt"
    outside.write_text("the user's own file")
    planted = {"cache-fifo": [cache / "done", cache / "train_labels.npy"],
               "exports": [out / "final" / "config.json", out / "final" / "tokenizer.json"],
               "metrics": [out / "metrics.jsonl"]}.get(case, [])
    for path in planted:
        path.unlink()
        os.mkfifo(path)
    if case == "cache-cut":
        ids = cache / "train_ids.npy"
        ids.write_bytes(ids.read_bytes()[:200])
    if case == "exports":
        (out / "final" / "tokenizer_config.json").unlink()
        (out / "final" / "tokenizer_config.json").symlink_to(outside)
    try:
        with caplog.at_level("WARNING", logger="tiered_offload"):
            if case == "metrics":
                with pytest.raises(CheckpointError, match=r"metrics.jsonl is a FIFO.*Remove it"):
                    within(60, lambda: train(config, ["train.max_steps=3"], progress=False))
                return
            summary = within(120, lambda: train(config, ["train.max_steps=3"], progress=False))
    finally:
        for path in planted:
            _unblock(path)
    assert summary["step"] == 3
    if case.startswith("cache"):
        assert "tokenised again" in caplog.text and str(cache) in caplog.text, caplog.text
    final = out / "final"
    assert all(f.is_file() and not f.is_symlink() for f in final.iterdir()), list(final.iterdir())
    assert outside.read_text() == "the user's own file"
    assert (final / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_the_log_says_where_the_steps_run_and_a_state_that_fits_memory_runs_them_after_the_backward(tmp_path,
                                                                                                      model_dir, data,
                                                                                                      caplog):
    """``train.clip: null`` with snapshot commits: where the state streams, each step runs in the
    backward, and the log says so. Where the whole state fits the host budget the engine keeps
    PyTorch's graphs and streams nothing: the step runs after the backward, in memory, and the log
    says that instead of claiming the step runs in the backward; so does ``--dry-run``'s plan."""
    said = {}
    for name, budget in (("streamed", state_budget(model_dir)), ("fits", "1GiB")):
        plan = train(write_config(tmp_path / f"{name}-dry", model_dir, data, train__clip=None, offload__commit_every=2,
                                  offload__host_memory=budget), dry_run=True)["plan"]  # (--dry-run says the same)
        assert plan["step"] == ("in the backward" if name == "streamed" else "after the backward"), plan
        caplog.clear()
        with caplog.at_level("INFO", logger="tiered_offload"):
            summary = train(write_config(tmp_path / name, model_dir, data, train__clip=None, train__max_steps=2,
                                         offload__commit_every=2, offload__host_memory=budget,
                                         output__export_every=0), progress=False)
        assert summary["step"] == 2
        said[name] = [m for m in (r.getMessage() for r in caplog.records) if "step" in m and "backward" in m]
    assert any("each step runs in the backward" in m for m in said["streamed"]), said
    assert not any("fits the memory budget" in m for m in said["streamed"]), said
    assert any("the whole state fits the memory budget: each step runs after the backward, in memory" in m
               for m in said["fits"]), said
    assert not any("each step runs in the backward" in m for m in said["fits"]), said


def test_a_second_run_into_the_output_dir_of_one_training_is_refused_naming_it(tmp_path, model_dir, data):
    """Two runs with one ``output.dir`` and their own ``offload.storage`` (a second experiment
    started without changing the output): both trained, their records interleaved in one
    ``metrics.jsonl``, and whichever exported last replaced the other's ``final/``, silently. A run
    now holds its output.dir (``.cache/train.lock``): a second one is refused at once, naming the
    first's process, and the first trains on untouched."""
    from offload_core.errors import StorageLockedError
    first = write_config(tmp_path / "a", model_dir, data, train__max_steps=400, train__eval_every=0,
                         output__export_every=0, output__dir=str(tmp_path / "out"))
    runner = subprocess.Popen([sys.executable, "-m", "tiered_offload", "train", "--config", str(first), "--no-progress"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert runner.poll() is None and time.monotonic() < deadline, runner.stderr.read() if runner.poll() else ""
            time.sleep(0.2)
        second = write_config(tmp_path / "b", model_dir, data, train__max_steps=2, output__export_every=0,
                              output__dir=str(tmp_path / "out"))
        with pytest.raises(StorageLockedError, match=rf"output\.dir .*out is in use by process {runner.pid}.*another "
                                                     rf"output\.dir"):
            train(second, progress=False)
        assert not (tmp_path / "b" / "run").exists()  # (refused before anything was made)
    finally:
        runner.send_signal(signal.SIGTERM)  # (it commits its step and stops)
        out, err = runner.communicate(timeout=120)
    assert runner.returncode == 0 and "stopped at step" in out, err[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # the first run's records alone


def test_an_output_dir_that_cannot_be_locked_trains_with_a_warning(tmp_path, model_dir, data, monkeypatch, caplog):
    """An output.dir on a file system without ``flock``: the run's hold on it (which refuses a
    second run there) cannot be taken; the run trains, saying so, instead of stopping on it."""
    import errno
    import fcntl
    real = fcntl.flock

    def no_locks(fd, op):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("train.lock"):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="tiered_offload"):
        assert train(write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0),
                     progress=False)["step"] == 2
    assert "cannot lock" in caplog.text and "train.lock" in caplog.text, caplog.text


def test_a_second_command_leaves_the_data_another_is_tokenising_alone(tmp_path, model_dir, data):
    """Two ``train`` commands on one output.dir (the same command started twice; two machines of a
    torchrun job sharing it): the second one found the first's cache unfinished and tokenised into
    it too (before: truncating its files; since a cache cut short is made again: removing it). The
    second now waits while another process prepares data there, then uses what it made."""
    import fcntl
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={data}", f"offload.storage={tmp_path / 's'}",
                             "train.max_steps=1"])
    cache = tmp_path / "cache"
    first, _ = prepare_data(cfg.data, tokenizer, model_dir, cache, None)
    (made,) = cache.glob("data-*")
    (made / "done").unlink()  # the first command, in the middle of its tokenising
    before = {f.name: f.stat().st_mtime_ns for f in made.iterdir()}
    fd = os.open(cache / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    box = []
    second = threading.Thread(target=lambda: box.append(prepare_data(cfg.data, tokenizer, model_dir, cache, None)),
                              daemon=True)
    second.start()
    second.join(3)
    try:
        assert second.is_alive() and {f.name: f.stat().st_mtime_ns for f in made.iterdir()} == before
    finally:
        os.close(fd)  # (the first command is done)
    second.join(60)
    assert not second.is_alive() and np.array_equal(box[0][0].ids, first.ids)


@pytest.mark.parametrize("kind", ["jsonl", "json", "txt"])
def test_a_byte_order_mark_at_the_start_of_a_file_is_not_data(tmp_path, model_dir, kind):
    """Files saved by Windows tools often start with a UTF-8 byte order mark. A JSON-lines file's
    first line was "not JSON (Unexpected UTF-8 BOM)"; a text file's first example began with the
    mark's token. The mark is dropped, as ``utf-8-sig`` does."""
    texts = sentences(6, seed=5)
    body = {"jsonl": "".join(json.dumps({"text": t}) + "\n" for t in texts),
            "json": json.dumps([{"text": t} for t in texts]), "txt": "\n\n".join(texts)}[kind]
    settings = ("data.packing=false", "data.eval_fraction=0") + (("data.format=text",) if kind == "txt" else ())
    plain, marked = tmp_path / f"plain.{kind}", tmp_path / f"marked.{kind}"
    plain.write_text(body, encoding="utf-8")
    marked.write_text(body, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert _same(_prepared(tmp_path, model_dir, marked, *settings), _prepared(tmp_path, model_dir, plain, *settings))


def test_a_json_array_file_is_read_as_its_examples(tmp_path, model_dir):
    """Alpaca's own ``alpaca_data.json`` is one JSON array of objects, not JSON lines: it stopped
    with "line 1: not JSON". A ``.json`` file that holds an array is read as its items."""
    rows = [{"instruction": "say the word", "input": "cat", "output": "dogs ran"},
            {"instruction": "repeat", "input": "", "output": "red houses"},
            {"instruction": "name a color", "output": "green"}]
    array, lines = tmp_path / "alpaca_data.json", tmp_path / "alpaca.jsonl"
    array.write_text(json.dumps(rows, indent=4))
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = ("data.format=alpaca", "data.packing=false", "data.max_seq_len=400")
    assert _same(_prepared(tmp_path, model_dir, array, *settings), _prepared(tmp_path, model_dir, lines, *settings))
    array.write_text(json.dumps([*rows, ["not", "an", "object"]], indent=4))
    with pytest.raises(ConfigError, match=r"alpaca_data\.json item 4: expected a JSON object, found list"):
        _prepared(tmp_path, model_dir, array, *settings)


def test_a_json_string_holding_a_line_separator_is_one_example(tmp_path, model_dir):
    """JSON allows U+2028, U+2029 and U+0085 unescaped in a string (``json.dumps(...,
    ensure_ascii=False)``, common in scraped and multilingual text). The lines were split with
    ``str.splitlines``, which also splits there: "line 1: not JSON". A line ends at a newline only."""
    path = tmp_path / "train.jsonl"
    texts = ["the cat\u2028sat on a mat", "dogs\x85ran around", "big\u2029red houses", "near green trees"]
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\r\n" for t in texts), encoding="utf-8")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.packing=false",
                             "data.max_seq_len=40", "data.eval_fraction=0", f"offload.storage={tmp_path / 's'}",
                             "train.max_steps=1"])
    train_data, _ = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
    assert len(train_data) == len(texts)
    for row, text in zip(train_data.ids, texts):
        assert [int(x) for x in row if x != tokenizer.pad_token_id] == tokenizer(text)["input_ids"] + [
            tokenizer.eos_token_id]


def _chat_model(tmp_path, model_dir) -> Path:
    """A copy of the model directory whose tokenizer has :data:`CHAT_TEMPLATE`."""
    chat_dir = tmp_path / "chat-model"
    chat_dir.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        (chat_dir / f.name).write_bytes(f.read_bytes())
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat_dir)
    return chat_dir


PARQUET_ROWS = {
    "completion": [{"text": s, "id": i} for i, s in enumerate(sentences(40, seed=7))],
    "alpaca": [{"instruction": f"say {a}", "input": None if i % 3 else b, "output": c}
               for i, (a, b, c) in enumerate(zip(sentences(12, 1), sentences(12, 2), sentences(12, 3)))],
    "chat": [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
             for a, b in zip(sentences(12, 4), sentences(12, 5))]}


@pytest.mark.parametrize("fmt", ["completion", "alpaca", "chat"])
def test_a_parquet_file_or_a_directory_of_them_is_read_as_its_rows(tmp_path, model_dir, fmt):
    """The Hugging Face Hub keeps datasets as Parquet (``data/train-00000-of-00002.parquet``, and
    every dataset's ``refs/convert/parquet``): ``data.path`` named one and the run stopped with
    "cannot read it as UTF-8 JSON lines". A Parquet file is read a row group at a time (never
    whole), each row an example as a JSON-lines line is; a directory of them is one corpus. The
    sequences are those of the same rows in JSON lines."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = PARQUET_ROWS[fmt]
    model = _chat_model(tmp_path, model_dir) if fmt == "chat" else model_dir
    lines = tmp_path / "train.jsonl"
    lines.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows))
    one = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), one, row_group_size=5)
    shards = tmp_path / "data"
    shards.mkdir()
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), shards / f"train-{i:05d}-of-00002.parquet", row_group_size=4)
    settings = (f"data.format={fmt}", "data.packing=false", "data.max_seq_len=400", "data.eval_fraction=0.2")
    reference = _prepared(tmp_path, model, lines, *settings)
    assert len(reference[0]) > 0 and len(reference[1]) > 0
    assert _same(_prepared(tmp_path, model, one, *settings), reference)
    assert _same(_prepared(tmp_path, model, shards, *settings), reference)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_chat_reads_sharegpts_conversations_as_messages(tmp_path, model_dir, kind):
    """Many chat datasets (ShareGPT's layout: OpenHermes, SlimOrca...) hold ``conversations``, each
    turn ``{"from": "human" | "gpt" | "system", "value": ...}``: the run stopped with "a chat example
    needs 'messages'". They are read as messages (human: user, gpt: assistant); the sequences are
    those of the same conversations in ``messages``. A turn from anyone else is named."""
    model = _chat_model(tmp_path, model_dir)
    rows = PARQUET_ROWS["chat"]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in
                                 [{"role": "system", "content": "be brief"}, *r["messages"]]]} for r in rows]
    plain = [{"messages": [{"role": "system", "content": "be brief"}, *r["messages"]]} for r in rows]
    settings = ("data.format=chat", "data.packing=false", "data.max_seq_len=400")
    lines = tmp_path / "plain.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in plain))
    path = tmp_path / f"sharegpt.{kind}"
    if kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        pq.write_table(pa.Table.from_pylist(shared), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in shared))
    assert _same(_prepared(tmp_path, model, path, *settings), _prepared(tmp_path, model, lines, *settings))
    if kind == "jsonl":
        shared[3]["conversations"][1]["from"] = "bard"
        path.write_text("".join(json.dumps(r) + "\n" for r in shared))
        with pytest.raises(ConfigError, match=r"sharegpt\.jsonl line 4: turn 2 is from 'bard'; a ShareGPT turn is "
                                              r"from human, gpt or system"):
            _prepared(tmp_path, model, path, *settings)


@pytest.mark.parametrize("case", ["no such column", "no conversation column", "a null text", "cut short", "not parquet", "a page damaged",
                                  "format text", "no pyarrow"])
def test_a_parquet_file_that_cannot_be_read_is_a_typed_error_naming_it(tmp_path, model_dir, case, monkeypatch):
    """Each is a ConfigError naming the file (and the row or column) and what to do, before any
    training: not pyarrow's own exception out of the middle of tokenising."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    path = tmp_path / "train-00000-of-00001.parquet"
    rows = [{"text": s} for s in sentences(200, seed=8)]
    settings = ["data.packing=false", "data.max_seq_len=400"]
    if case == "no such column":
        pq.write_table(pa.Table.from_pylist([{"content": r["text"], "id": 1} for r in rows]), path)
        match = r"train-00000-of-00001\.parquet: no column 'text' \(data\.field\); its columns are content, id"
    elif case == "no conversation column":
        pq.write_table(pa.Table.from_pylist(rows), path)
        settings.append("data.format=chat")
        model_dir = _chat_model(tmp_path, model_dir)
        match = r"train-00000-of-00001\.parquet: no column 'messages' \(or 'conversations'\); its columns are text$"
    elif case == "a null text":
        pq.write_table(pa.Table.from_pylist([*rows[:3], {"text": None}, *rows[3:]]), path, row_group_size=2)
        match = r"train-00000-of-00001\.parquet row 4: its field 'text' is null"
    elif case == "format text":
        pq.write_table(pa.Table.from_pylist(rows), path)
        settings.append("data.format=text")
        match = (r"train-00000-of-00001\.parquet is a Parquet file: data\.format text reads \.txt files; its rows "
                 r"train with data\.format completion")
    elif case == "no pyarrow":
        pq.write_table(pa.Table.from_pylist(rows), path)
        monkeypatch.setitem(sys.modules, "pyarrow", None)
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
        match = r"train-00000-of-00001\.parquet is a Parquet file, and reading one needs pyarrow: pip install pyarrow"
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=50)
        body = path.read_bytes()
        if case == "cut short":
            body = body[:len(body) // 2]
        elif case == "not parquet":
            body = b"<html>404: not found</html>\n" * 10
        else:
            middle = len(body) // 2  # (in the third of four row groups)
            body = body[:middle] + bytes(range(256)) * 4 + body[middle + 1024:]
        path.write_bytes(body)
        match = (r"train-00000-of-00001\.parquet: cannot read "
                 + (r"its row group 3 of 4 \(rows 101-150\)" if case == "a page damaged" else "it")
                 + r" as Parquet \(.*\); download it again")
    with pytest.raises(ConfigError, match=match) as error:
        _prepared(tmp_path, model_dir, path, *settings)
    assert str(error.value).count(path.name) == 1, error.value  # (said once: not wrapped in another message)


def _one_at_a_time(tokenizer, example) -> tuple[list[int], list[int]]:
    """An example's ids and loss mask, tokenised alone (the reference for batched tokenising)."""
    eos = [tokenizer.eos_token_id]
    if isinstance(example, str):
        ids = tokenizer(example)["input_ids"] + eos
        return ids, [1] * len(ids)
    if "instruction" in example:
        from tiered_offload.train.data import ALPACA_PROMPT
        extra = example.get("input") or ""
        prompt = ALPACA_PROMPT.format(with_input=", paired with an input that provides further context" if extra
                                      else "", instruction=example["instruction"],
                                      input_block=f"### Input:\n{extra}\n\n" if extra else "")
        p, r = tokenizer(prompt)["input_ids"], tokenizer(example["output"], add_special_tokens=False)["input_ids"] + eos
        return p + r, [0] * len(p) + [1] * len(r)
    messages = example["messages"]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    spans = [(len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i + 1])))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    encoded = tokenizer(render(messages), add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], [int(any(a < e and b > s for s, e in spans)) for a, b in encoded["offset_mapping"]]


@pytest.mark.parametrize("fmt", ["completion", "alpaca", "chat"])
def test_tokenising_in_batches_gives_each_example_its_own_tokens(tmp_path, model_dir, fmt, monkeypatch):
    """Examples are tokenised a batch at a time (a chunk of text: the fast tokenizer's threads share
    it; one at a time took 2.5x as long on two cores). Each example's ids and loss mask are those it
    has tokenised alone, across batch ends, an example longer than a batch, and empty ones (an empty
    text, its EOS alone, has no token the loss is on past its first: left out)."""
    from tiered_offload.train import sources
    monkeypatch.setattr(sources, "CHUNK", 1 << 9)  # (read, tokenised and written a chunk at a time)
    texts = sentences(120, seed=9)
    texts[7] = " ".join(texts[:40])  # longer than a batch
    texts[30] = texts[31] = ""
    model = model_dir
    if fmt == "completion":
        rows = [{"text": t} for t in texts]
    elif fmt == "alpaca":
        rows = [{"instruction": a, "input": b if i % 2 else "", "output": c}
                for i, (a, b, c) in enumerate(zip(texts, texts[1:] + texts[:1], texts[2:] + texts[:2]))]
    else:
        model = _chat_model(tmp_path, model_dir)
        rows = [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b},
                              {"role": "user", "content": "more"}, {"role": "assistant", "content": c}]}
                for a, b, c in zip(texts, texts[1:] + texts[:1], texts[2:] + texts[:2])]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    train_data, _ = _prepared(tmp_path, model, path, f"data.format={fmt}", "data.packing=false",
                              "data.max_seq_len=2000", "data.eval_fraction=0")
    alone = [_one_at_a_time(tokenizer, row["text"] if fmt == "completion" else row) for row in rows]
    alone = [(ids, mask) for ids, mask in alone if any(mask[1:])]
    assert len(train_data) == len(alone) == len(rows) - (2 if fmt == "completion" else 0)
    for k, (ids, mask) in enumerate(alone):
        n = len(ids)
        assert [int(x) for x in train_data.ids[k][:n]] == ids, k
        assert [int(x) != IGNORE for x in train_data.labels[k][:n]] == [bool(m) for m in mask], k
        assert not np.asarray(train_data.attention[k][n:]).any()


@pytest.mark.parametrize("packing", [True, False])
def test_tokenising_holds_no_list_of_the_corpus_tokens(tmp_path, model_dir, packing, monkeypatch):
    """The corpus is read a chunk at a time and its tokens go to files as they come: the memory
    tokenising takes does not grow with the corpus (the text and a list of Python ints held ~70
    bytes a token: tens of gigabytes for a corpus of a few hundred million tokens, on a machine
    whose RAM the user has budgeted). Measured with ``tracemalloc``, chunks of 4 KiB for a corpus of
    35-280 KiB: 8x the corpus adds under 2 bytes a token (an example's length, 8 bytes, remains)."""
    import tracemalloc

    from tiered_offload.train import sources
    monkeypatch.setattr(sources, "CHUNK", 1 << 12)  # (read, tokenised and written a chunk at a time)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    peaks, tokens = [], []
    for n in (500, 4000):
        path = tmp_path / f"train-{n}.jsonl"
        path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(n, seed=n)))
        cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", f"data.packing={packing}",
                                 "data.max_seq_len=16", "data.eval_fraction=0.1", f"offload.storage={tmp_path / 's'}",
                                 "train.max_steps=1"])
        tracemalloc.start()
        try:
            train_data, eval_data = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        tokens.append(sum(int((np.asarray(d.labels) != IGNORE).sum()) for d in (train_data, eval_data)))
    assert tokens[1] > 7 * tokens[0]
    assert (peaks[1] - peaks[0]) / (tokens[1] - tokens[0]) < 2, (peaks, tokens)


def test_the_same_command_with_other_settings_says_what_it_changes(tmp_path, model_dir, data, caplog):
    """Run again with another seed, micro-batch or learning rate, the command resumed and drew other
    batches than the first run would have, without a word (and kept the saved learning rate). It
    now says which settings differ from the ones the directory was trained with and that they
    apply from the resumed step on. A longer run (``max_steps``) and the same command again say
    nothing."""
    import logging
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    config = write_config(tmp_path, model_dir, data, train__max_steps=1, output__export_every=0)
    train(config, progress=False)
    train(config, ["train.max_steps=2"], progress=False)
    assert not [r for r in caplog.records if "trained with other settings" in r.getMessage()]
    train(config, ["train.max_steps=3", "train.seed=7", "train.micro_batch=2", "train.lr=0.02"], progress=False)
    said = [r.getMessage() for r in caplog.records if "trained with other settings" in r.getMessage()]
    assert len(said) == 1 and "train.seed 0 (now 7)" in said[0] and "train.micro_batch 4 (now 2)" in said[0]
    assert "max_steps" not in said[0] and "from step 3 on" in said[0] and "train.lr 0.01 (now 0.02)" in said[0]


def test_a_resume_with_other_optimizer_settings_trains_on_with_them(tmp_path, model_dir, data, caplog):
    """``train.lr`` lowered after a loss spike (or ``weight_decay``, ``betas``, ``eps`` changed) and
    the same command run again: the resume kept the saved values and said to start a new run from
    the last export, so the Adam moments were lost to change a rate. The command's values now
    apply from the resumed step on, on the schedule (the optimizer's moments kept), as a run from
    the start with them would have them there; the next resume with them says nothing."""
    import logging
    from tiered_offload.checkpoint.durable import StateFiles, state_directory
    from tiered_offload.train.run import lr_factor
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    config = write_config(tmp_path, model_dir, data, train__max_steps=4, output__export_every=0)
    train(config, ["train.max_steps=2"], progress=False)
    changed = ["train.lr=0.004", "train.weight_decay=0.1", "train.betas=[0.8,0.99]", "train.eps=1.0e-6"]
    train(config, ["train.max_steps=3", *changed], progress=False)
    assert not [r for r in caplog.records if "saved hyperparameters" in r.getMessage()]
    said = [r.getMessage() for r in caplog.records if "trained with other settings" in r.getMessage()]
    assert len(said) == 1 and "train.lr 0.01 (now 0.004)" in said[0] and "train.eps 1e-08 (now 1e-06)" in said[0]
    assert "train.weight_decay 0.01 (now 0.1)" in said[0] and "train.betas [0.9, 0.999] (now [0.8, 0.99])" in said[0]
    caplog.clear()
    train(config, changed, progress=False)
    assert not [r for r in caplog.records if "other settings" in r.getMessage() or "hyperparameters" in r.getMessage()]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]  # (the step records)
    assert lrs[:2] == pytest.approx([0.01 * lr_factor(s, 2, 2, "cosine") for s in range(2)])
    assert lrs[2:] == pytest.approx([0.004 * lr_factor(s, 4, 2, "cosine") for s in (2, 3)])
    state = StateFiles(state_directory(str(tmp_path / "run"))).read_manifest()["meta"]["param_groups"]
    assert [g["weight_decay"] for g in state] == [0.1, 0.0] and state[0]["betas"] == [0.8, 0.99]
    assert state[0]["eps"] == 1e-6 and state[0]["initial_lr"] == 0.004




def test_a_run_stopped_before_its_first_step_resumes_with_the_commands_optimizer_settings(
        tmp_path, model_dir, data, monkeypatch):
    """A first run that stopped before its first step (its state committed at step 0, with its
    settings), then the command again with another ``train.lr``: the new rate trains, as a run
    from the start with it would (the engine resumes the saved groups; the command gives its own
    whatever the step)."""
    from tiered_offload import Engine
    from tiered_offload.train.run import lr_factor
    config = write_config(tmp_path, model_dir, data, train__max_steps=2, output__export_every=0)

    def fails(*_a, **_k):
        raise RuntimeError("stopped before the first step")
    with monkeypatch.context() as m:
        m.setattr(Engine, "forward_backward", fails)
        with pytest.raises(RuntimeError, match="before the first step"):
            train(config, progress=False)
    train(config, ["train.lr=0.004"], progress=False)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]
    assert lrs == pytest.approx([0.004 * lr_factor(s, 2, 2, "cosine") for s in (0, 1)])

@pytest.mark.parametrize("key, value", [("lr", "x"), ("betas", "nope")])
def test_a_resume_whose_saved_optimizer_setting_is_of_the_wrong_kind_is_refused_naming_the_manifest(
        tmp_path, model_dir, data, key, value):
    """A manifest edited with its checksum mended, a rate that is a string or betas that are not a
    pair: the resume took the value and the first step failed (a bare ``TypeError``, or a
    ``StepFailedError`` part-way). Now a ``CorruptionError`` at the resume, naming the manifest."""
    import zlib
    from tiered_offload.checkpoint.durable import StateFiles, state_directory
    from offload_core.errors import CorruptionError
    config = write_config(tmp_path, model_dir, data, train__max_steps=1, output__export_every=0)
    train(config, progress=False)
    path = StateFiles(state_directory(str(tmp_path / "run"))).manifest_path
    manifest = json.loads(path.read_text().partition(" ")[2])
    manifest["meta"]["param_groups"][0][key] = value
    text = json.dumps(manifest)
    path.write_text(f"{zlib.crc32(text.encode()):08x} {text}")
    with pytest.raises(CorruptionError, match=rf"manifest.json: the saved hyperparameter {key} of group 0 is"):
        train(config, ["train.max_steps=2"], progress=False)

def test_data_edited_since_the_last_run_is_named_when_the_run_resumes(tmp_path, model_dir, caplog):
    """The data file edited between two runs of the same command (an example fixed, the same number
    of them): the resumed run trained on other sequences than the first run would have, without a
    word (only a changed count was named). The tokenised data's content is now part of the saved
    settings: a change is named as the other settings are. A file copied or touched, its content
    the same, says nothing."""
    import logging
    import shutil
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    path = tmp_path / "train.jsonl"
    rows = sentences(120, seed=11)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    config = write_config(tmp_path, model_dir, path, train__max_steps=1, output__export_every=0, data__packing=False)
    train(config, progress=False)
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(path, copy)
    os.replace(copy, path)  # (another inode, another time: re-tokenised, the same content)
    train(config, ["train.max_steps=2"], progress=False)
    assert not [r for r in caplog.records if "trained with other settings" in r.getMessage()]
    rows[5] = rows[6]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    train(config, ["train.max_steps=3"], progress=False)
    said = [r.getMessage() for r in caplog.records if "trained with other settings" in r.getMessage()]
    assert len(said) == 1 and re.search(r"data: content [0-9a-f]{12} \(now [0-9a-f]{12}\)", said[0]), said


def test_dry_run_trains_nothing(tmp_path, model_dir, data, capsys):
    assert cli_main(["train", "--config", str(write_config(tmp_path, model_dir, data)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "first batch" in out and "a fresh run" in out
    assert "units streamed" in out and "minimum" in out and "step time" in out  # the plan
    assert not (tmp_path / "run").exists()
    info = train(write_config(tmp_path / "again", model_dir, data, offload__host_memory="64KiB"), dry_run=True)
    plan = info["plan"]
    assert plan["state_bytes"] == info["state_bytes"] and plan["host_bytes"] == 64 << 10
    # the engine's floors: what of the update's inputs (every weight, gradient and state: all of it,
    # every parameter trains) the budget cannot hold comes back every step; journal commits
    # rewrite the weights and states, with the gradients
    assert plan["disk_floor_read_bytes"] == plan["state_bytes"] - (64 << 10)
    assert plan["disk_floor_written_bytes"] == plan["state_bytes"]
    assert plan["minimum_host_bytes"] > 64 << 10 and any("too small" in line for line in plan["lines"])
    assert any("(journal commits; the step after the backward); journal commits keep the step out of the "
               "backward: offload.commit_every >= 2 runs it there" in line for line in plan["lines"]), plan["lines"]
    assert plan["step"] == "after the backward"
    journal = train(write_config(tmp_path / "journal", model_dir, data, offload__host_memory="64KiB",
                                 train__clip=None), dry_run=True)["plan"]  # (no clipping: the journal keeps it out)
    assert journal["step"] == "after the backward" and any(
        "journal commits keep the step out of the backward: offload.commit_every >= 2 runs it there" in line
        for line in journal["lines"]), journal["lines"]
    # without clipping, with snapshot commits, the run steps in the backward where a unit's update fits beside
    # the backward's pins (not in 64 KiB: the plan names the budget that does)
    info = train(write_config(tmp_path / "fused", model_dir, data, offload__host_memory="64KiB", train__clip=None,
                              offload__commit_every=2), dry_run=True)
    assert info["plan"]["step"] == "after the backward"
    said = re.search(r"a unit's update does not fit beside the backward's pins: "
                     r"offload\.host_memory >= \S+ \S+ \((\d+) bytes\) runs it in the backward",
                     str(info["plan"]["lines"]))
    assert said, info["plan"]["lines"]
    room = int(said.group(1))
    # there no gradient reaches the disk, so the floor is the weights and states beyond the budget, read and
    # (all of them trained) written
    info = train(write_config(tmp_path / "fused", model_dir, data, offload__host_memory=room, train__clip=None,
                              offload__commit_every=2), dry_run=True)
    plan, weights, host = info["plan"], info["parameters"] * 4, info["plan"]["host_bytes"]
    assert host == room // 4096 * 4096 >= room - 4095
    assert plan["step"] == "in the backward" and any("snapshot commits every 2 steps" in line and
                                                     "in the backward" in line for line in plan["lines"])
    assert plan["disk_floor_read_bytes"] == plan["disk_floor_written_bytes"] == 3 * weights - host
    assert not any("without clipping" in line for line in plan["lines"])
    # clipping, with snapshot commits: the plan's floors are the step's after the backward; it says what a step
    # in the backward (train.steps.ClipSpeculation: each tried, the engine keeping those it predicts over the
    # limit out of it) moves instead
    info = train(write_config(tmp_path / "clipped", model_dir, data, offload__host_memory=room,
                              offload__commit_every=2), dry_run=True)
    plan = info["plan"]
    assert plan["step"] == "after the backward" and plan["disk_floor_read_bytes"] > 3 * weights - host
    said = format_size(3 * weights - host)
    assert any(f"a step runs in the backward unless the engine predicts its gradient norm over train.clip (the run's "
               f"first learns it), clipped exactly (one over the limit there runs again after it): at least "
               f"{said} read and {said} written" in line for line in plan["lines"]), plan["lines"]
    # a commit every 8 steps: only the first 4 after each are tried (a tear replays the steps since the last commit);
    # a share of the limit: after a step whose norm was at most that
    plan = train(write_config(tmp_path / "clipped-8", model_dir, data, offload__host_memory=room,
                              offload__commit_every=8, train__clip_in_backward=0.8), dry_run=True)["plan"]
    assert any("a step runs in the backward after one whose gradient norm was at most 0.8 x train.clip (and among "
               "the first 4 after each commit), clipped exactly" in line for line in plan["lines"]), plan["lines"]


def test_step_exports_rotate_only_this_runs_own(tmp_path, model_dir, data):
    """The rotation of ``step-N`` exports took every ``step-*`` in output.dir: a user's ``step-best/`` stopped the
    run at its first export with an untyped ValueError (int('best')), a ``step-2-copy/`` was deleted, and a new run
    into an earlier run's output.dir deleted the export it had just written, keeping the earlier run's step-600
    (such a run is refused now unless told to overwrite: its step-600 is still not this run's to rotate)."""
    out = tmp_path / "out"
    mine = {name: out / name for name in ("step-best", "step-2-copy", "step-600")}
    for directory in mine.values():
        directory.mkdir(parents=True)
        (directory / "note.txt").write_text(directory.name)
    summary = train(write_config(tmp_path, model_dir, data, train__max_steps=6, output__export_every=2,
                                 output__keep=2, output__overwrite=True))
    assert summary["step"] == 6
    assert all((d / "note.txt").read_text() == d.name for d in mine.values())  # none of them this run's to rotate
    assert sorted(p.name for p in out.glob("step-*")) == ["step-2-copy", "step-4", "step-6", "step-600", "step-best"]


def test_a_step_export_a_kill_cut_short_is_never_left_looking_whole_and_is_written_at_the_resume(
        tmp_path, model_dir, data, monkeypatch):
    """A run killed during its step-4 export (after step 4 was committed) left step-4/ with the weights and no
    tokenizer, a directory that looked like an export; the same command resumed at step 4 and never wrote it
    again. Now a step export is written aside and renamed into place whole, and a resume at an export's step
    whose export is missing writes it first."""
    from tiered_offload.train import outputs
    copy = outputs.copy_tokenizer

    def killed(model_dir_, out_, ranks_):  # (an exception as the kill: the tokenizer's files never come)
        raise KeyboardInterrupt("killed mid-export")
    monkeypatch.setattr(outputs, "copy_tokenizer", killed)
    config = write_config(tmp_path, model_dir, data, train__max_steps=6, output__export_every=4)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    out = tmp_path / "out"
    assert not (out / "step-4").exists()  # no directory that looks like an export
    monkeypatch.setattr(outputs, "copy_tokenizer", copy)
    assert train(config)["step"] == 6
    assert (out / "step-4" / "tokenizer_config.json").is_file() and exported(out / "step-4")
    assert sorted(p.name for p in out.iterdir() if "step" in p.name) == ["step-4"]  # nothing partial left


def test_a_record_a_kill_cut_off_after_its_step_was_committed_is_written_at_the_resume(tmp_path, model_dir, data,
                                                                                       monkeypatch):
    """Found by `python tools/crash_loop_train.py --kills 30 --seed 2`: a kill after a step's commit and before its
    record (in the evaluation it waits for) left metrics.jsonl without that step for good, as the resume went on
    from the next. And a kill in the final export, after the final evaluation's record, wrote that record twice
    at the next start. Now the step's part of the record is committed with it and written at the resume (the
    evaluation run again, on the same weights); a final evaluation already there is not written again."""
    from tiered_offload.train import outputs
    from tiered_offload.train import run as run_module
    compared = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss")

    def history(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [tuple(r.get(k) for k in compared) for r in map(json.loads, lines)]
    whole = write_config(tmp_path / "whole", model_dir, data, train__max_steps=6, output__export_every=0)
    train(whole)
    write, export = outputs.Metrics.write, outputs.export
    cuts = {"record": 4, "export": 1}

    def cut_record(self, record):  # (an exception as the kill, after step 4's commit)
        if record.get("step") == cuts["record"] and "loss" in record:
            cuts["record"] = None
            raise KeyboardInterrupt("killed before step 4's record")
        write(self, record)

    def cut_export(*a, **k):
        if cuts["export"]:
            cuts["export"] = None
            raise KeyboardInterrupt("killed in the final export")
        export(*a, **k)
    monkeypatch.setattr(outputs.Metrics, "write", cut_record)
    monkeypatch.setattr(run_module, "export", cut_export)
    config = write_config(tmp_path / "cut", model_dir, data, train__max_steps=6, output__export_every=0)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            train(config)
    assert train(config)["step"] == 6
    assert history(tmp_path / "cut" / "out") == history(tmp_path / "whole" / "out")


def test_the_commands_crash_loop_ends_each_run_as_an_uninterrupted_one():
    """`tools/crash_loop_train.py`, short (the long loop: `--kills 30`): the command SIGKILLed at random moments and
    run again until it finishes leaves final/, the step-N/ exports and metrics.jsonl as an uninterrupted run does."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "crash_loop_train.py"), "--kills", "4", "--seed", "5",
                        "--steps", "6"], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^4 kills over (\d+) runs: \1 of \1 the same as the uninterrupted run$", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("inside", ["step-2", "step-2/run", "final"])
def test_a_storage_directory_inside_an_export_of_the_run_is_refused(tmp_path, model_dir, data, inside):
    """offload.storage under output.dir/step-2: the rotation (keep 1) deleted the directory at step 4, with the
    training state in it, mid-run; under final/ the state shares a directory the export rewrites."""
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"offload.storage {out / inside} is inside {inside.split('/')[0]}/"):
        train(write_config(tmp_path, model_dir, data, train__max_steps=6, output__export_every=2,
                           offload__storage=str(out / inside)))
    assert not (out / inside).exists()


@pytest.mark.parametrize("target", ["final", "step-4"])
def test_a_model_path_this_runs_exports_would_replace_or_rotate_away_is_refused(tmp_path, model_dir, data, target):
    """Fine-tuning on from an earlier run's export in the same output.dir: `final/` (or `step-N/`) was the model
    this run read, and its own export replaced it (or its rotation deleted it) at the end, so the same command
    run again from scratch silently started from other weights, or found no model."""
    out = tmp_path / "out"
    shutil.copytree(model_dir, out / target)
    before = {p.name: p.read_bytes() for p in (out / target).iterdir()}
    with pytest.raises(ConfigError, match=rf"model.path {out / target} is .*output.dir"):
        train(write_config(tmp_path, out / target, data, train__max_steps=4, output__export_every=2))
    assert {p.name: p.read_bytes() for p in (out / target).iterdir()} == before
    data_there = out / target / "train.jsonl"  # (the data too: a step-N/ is replaced whole, then rotated away)
    shutil.copy(data, data_there)
    with pytest.raises(ConfigError, match=rf"data.path {data_there} is in {target}/ of output.dir"):
        train(write_config(tmp_path, model_dir, data_there, train__max_steps=4, output__export_every=2))
    # exports elsewhere (or none of step-N's), it trains
    assert train(write_config(tmp_path / "other", out / target, data, train__max_steps=2,
                              output__export_every=0))["step"] == 2


def test_the_runs_yaml_file_may_be_given_first_without_its_flag(tmp_path, model_dir, data, capsys):
    """`tiered-offload train run.yaml` (as other fine-tuning commands take their file) was "override 'run.yaml':
    write section.key=value". The file given first is the run's configuration; overrides follow it."""
    config = write_config(tmp_path, model_dir, data)
    assert cli_main(["train", str(config), "--dry-run", "train.max_steps=3"]) == 0
    assert "first batch" in capsys.readouterr().out and not (tmp_path / "run").exists()
    # a second file, or one beside --config, is not taken for an override: it is named
    for argv in (["train", str(config), str(config), "--dry-run"], ["train", "--config", str(config), str(config)]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"{str(config)!r} is a file" in err and "one YAML file" in err, err


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def test_chat_puts_the_loss_on_the_assistant_turns_only(tmp_path, model_dir):
    chat_dir = tmp_path / "chat-model"
    chat_dir.mkdir()
    for f in model_dir.iterdir():
        (chat_dir / f.name).write_bytes(f.read_bytes())
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    path = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"},
                    {"role": "user", "content": "and dogs"}, {"role": "assistant", "content": "ran around"}]
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    cfg = load_config(None, [f"model.path={chat_dir}", f"data.path={path}", "data.format=chat", "data.packing=false",
                             "data.max_seq_len=400", f"offload.storage={tmp_path / 's'}", "train.max_steps=1"])
    with pytest.raises(ConfigError, match="chat template"):
        prepare_data(cfg.data, tokenizer, chat_dir, tmp_path / "cache", None)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    train_data, _ = prepare_data(cfg.data, tokenizer, chat_dir, tmp_path / "cache", None)
    labels = [int(x) for x in train_data.labels[0] if x != IGNORE]
    text = tokenizer.decode(labels)
    assert "sat on a mat" in text and "ran around" in text
    assert "the cat" not in text and "and dogs" not in text and "user" not in text


def _template(content: str, end: str = "", marks: bool = False) -> str:
    """:data:`CHAT_TEMPLATE` with ``content`` rendering a message's text and ``end`` after the last
    message; ``marks``: the assistant's text and end in ``{% generation %}``."""
    assistant = f"{content}</s>"
    if marks:
        assistant = "{% generation %}" + assistant + "{% endgeneration %}"
    return ("{% for m in messages %}<s>{{ m['role'] }}: {% if m['role'] == 'assistant' %}" + assistant
            + "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}" + end
            + "{% if add_generation_prompt %}<s>assistant: {% endif %}")


TEMPLATES = {"an end of its own": ("{{ m['content'] }}", "{% if not add_generation_prompt %}<s>end</s>{% endif %}"),
             "earlier turns rewritten": ("{% if not loop.last %}{{ m['content'].split('</think>')[-1] }}"
                                         "{% else %}{{ m['content'] }}{% endif %}", "")}


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_chat_template_that_renders_a_last_turn_otherwise_is_refused_not_masked_wrong(tmp_path, model_dir, template):
    """The assistant's turns are found by rendering the conversation up to each of them. A template
    that renders a turn otherwise when it is the last (one that ends the conversation with text of
    its own; Qwen3's, which drops the reasoning of earlier turns) made those lengths point into
    other text: the loss fell on the wrong tokens, silently ("</s><s>user: a" carried loss, "nd
    dogs" of the user's turn). Each turn's renderings must now begin the whole conversation's, or
    the example is refused, naming it and the turn. A template that marks the assistant's text
    (``{% generation %}``, as TRL's assistant-only loss asks) says where each turn is: its marks
    make the mask."""
    chat_dir = _chat_model(tmp_path, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "<think>red</think>sat on"},
                    {"role": "user", "content": "and dogs"}, {"role": "assistant", "content": "ran around"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    settings = ("data.format=chat", "data.packing=false", "data.max_seq_len=400", "data.eval_fraction=0")
    tokenizer.chat_template = _template(*TEMPLATES[template])
    tokenizer.save_pretrained(chat_dir)
    with pytest.raises(ConfigError, match=r"chat\.jsonl line 1: the tokenizer's chat template renders turn 2 "
                                          r"\(assistant\) otherwise inside the conversation than as its last"):
        _prepared(tmp_path, chat_dir, path, *settings)
    path.write_text(json.dumps({"messages": conversation[2:]}) + "\n")  # one turn, the last: as the template says
    train_data, _ = _prepared(tmp_path, chat_dir, path, *settings)
    text = tokenizer.decode([int(x) for x in train_data.labels[0] if x != IGNORE])
    assert "ran around" in text and "dogs" not in text, text
    tokenizer.chat_template = _template(*TEMPLATES[template], marks=True)
    tokenizer.save_pretrained(chat_dir)
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    train_data, _ = _prepared(tmp_path, chat_dir, path, *settings)
    whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    ids = [int(x) for x in train_data.ids[0] if x != tokenizer.pad_token_id]
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode([int(x) for x in train_data.labels[0] if x != IGNORE])
    reply = "sat on" if template == "earlier turns rewritten" else "<think>red</think>sat on"
    assert text.replace(" ", "") == f"{reply}</s>ranaround</s>".replace(" ", ""), (text, whole)  # (decode's spaces)


@pytest.mark.parametrize("marks", [False, True], ids=["rendered", "marked"])
def test_chat_turns_each_trains_every_assistant_turn_as_its_own_last(tmp_path, model_dir, marks):
    """``data.chat_turns: each``: an example per assistant turn, the conversation up to it, the
    loss on that turn only, the earlier turns rendered as the template renders history. So a
    template that renders a turn otherwise as the last (Qwen3's drops earlier turns' reasoning),
    whose conversations ``all`` refuses without ``{% generation %}`` marks, trains on what the
    model sees and says at inference: each sequence is the template's rendering of the
    conversation up to the turn, the loss on what follows the generation prompt."""
    chat_dir = _chat_model(tmp_path, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = _template(*TEMPLATES["earlier turns rewritten"], marks=marks)
    tokenizer.save_pretrained(chat_dir)
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "<think>red</think>sat on"},
                    {"role": "user", "content": "and dogs"}, {"role": "assistant", "content": "ran around"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n"
                    + json.dumps({"messages": conversation[:1]}) + "\n")  # no assistant turn: no example
    settings = ("data.format=chat", "data.packing=false", "data.max_seq_len=400", "data.eval_fraction=0")
    train_data, _ = _prepared(tmp_path, chat_dir, path, *settings, "data.chat_turns=each")
    assert len(train_data) == 2
    for row, (upto, reply) in enumerate([(2, "<think>red</think>sat on</s>"), (4, "ran around</s>")]):
        ids = [int(x) for x in train_data.ids[row] if x != tokenizer.pad_token_id]
        whole = tokenizer.apply_chat_template(conversation[:upto], tokenize=False)
        assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"], row
        text = tokenizer.decode([int(x) for x in train_data.labels[row] if x != IGNORE])
        assert text.replace(" ", "") == reply.replace(" ", ""), (row, text)  # (decode's spaces)
    if not marks:  # the whole conversation at once cannot be masked with this template
        with pytest.raises(ConfigError, match=r"chat\.jsonl line 1: .* or set data\.chat_turns: each"):
            _prepared(tmp_path, chat_dir, path, *settings)
    # a generation prompt that is not how the template begins the turn: no tokens to point at
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% if add_generation_prompt %}<s>assistant: ",
                                                    "{% if add_generation_prompt %}<s>bot: ")
    tokenizer.save_pretrained(chat_dir)
    with pytest.raises(ConfigError, match=r"chat\.jsonl line 1 turn 2: the tokenizer's chat template does not begin "
                                          r"the conversation with turn 2 \(assistant\) as it renders"):
        _prepared(tmp_path, chat_dir, path, *settings, "data.chat_turns=each")
    with pytest.raises(ConfigError, match=r"data\.chat_turns applies to data\.format chat"):
        _prepared(tmp_path, chat_dir, path, "data.format=completion", "data.chat_turns=each")
    with pytest.raises(ConfigError, match=r"data\.chat_turns must be one of"):
        _prepared(tmp_path, chat_dir, path, *settings, "data.chat_turns=some")


def test_chat_turns_each_keeps_a_conversations_turns_on_one_side_of_the_evaluation_split(tmp_path, model_dir):
    """With ``data.chat_turns: each`` a conversation's turns are examples in a row, each one's text
    beginning the next's; ``eval_fraction`` holds out the last examples, and cut between two turns
    of one conversation the evaluation scored text the training had trained on. The split moves to
    the next conversation's start: each conversation's turns are all on one side."""
    chat_dir = _chat_model(tmp_path, model_dir)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
        {"role": "user", "content": f"r{i}"}, {"role": "assistant", "content": f"b{i}"}]}) + "\n" for i in range(3)))
    settings = ("data.format=chat", "data.packing=false", "data.max_seq_len=400", "data.chat_turns=each")
    train_data, eval_data = _prepared(tmp_path, chat_dir, path, *settings, "data.eval_fraction=0.5")
    assert (len(train_data), len(eval_data)) == (4, 2)  # 3 of 6 held out would split the second conversation
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    assert all("2" in tokenizer.decode([int(x) for x in row if x != tokenizer.pad_token_id]) for row in eval_data.ids)
    assert not any("2" in tokenizer.decode([int(x) for x in row if x != tokenizer.pad_token_id]) for row in train_data.ids)
    train_data, eval_data = _prepared(tmp_path, chat_dir, path, *settings, "data.eval_fraction=0.34")
    assert (len(train_data), len(eval_data)) == (4, 2)  # 2 of 6: at a conversation's start already


TOOL_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
                 "{% for m in messages %}<s>{{ m['role'] }}: {% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
                 "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>{% endfor %}"
                 "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.mark.parametrize("turns", ["all", "each"])
def test_chat_with_tool_calls_trains_on_the_assistants_calls_and_answers(tmp_path, model_dir, turns):
    """An agent's conversation: an assistant turn that calls a tool (``tool_calls``, its content
    null), the tool's result (role ``tool``), the answer; and the row's ``tools`` (their schemas),
    which the template renders. It was refused ("a chat example needs 'messages'": a null
    content). Now the messages and tools go to the chat template as they are, and the loss is on
    the assistant's turns, the calls included, not on the tool's result. A template that renders no
    tool calls is refused for such an example, naming it."""
    chat_dir = _chat_model(tmp_path, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(chat_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    conversation = [{"role": "user", "content": "two and three"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "five"}, {"role": "assistant", "content": "it is five"}]
    if turns == "each":
        del conversation[1]["content"]  # (or no content at all)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": conversation, "tools": tools}) + "\n")
    settings = ("data.format=chat", "data.packing=false", "data.max_seq_len=400", "data.eval_fraction=0",
                f"data.chat_turns={turns}")
    train_data, _ = _prepared(tmp_path, chat_dir, path, *settings)
    rows = [(4, '<call>add {"a": 2, "b": 3}</call></s>it is five</s>')] if turns == "all" else \
        [(2, '<call>add {"a": 2, "b": 3}</call></s>'), (4, "it is five</s>")]
    assert len(train_data) == len(rows)
    for row, (upto, reply) in enumerate(rows):
        whole = tokenizer.apply_chat_template(conversation[:upto], tools=tools, tokenize=False)
        assert whole.startswith("<tools>add;</tools>")
        ids = [int(x) for x in train_data.ids[row] if x != tokenizer.pad_token_id]
        assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"], row
        text = tokenizer.decode([int(x) for x in train_data.labels[row] if x != IGNORE])
        assert text.replace(" ", "") == reply.replace(" ", ""), (row, text)  # (decode's spaces)
    tokenizer.chat_template = CHAT_TEMPLATE  # renders content only: a call would be "None"
    tokenizer.save_pretrained(chat_dir)
    with pytest.raises(ConfigError, match=r"chat\.jsonl line 1( turn 2)?: .*tool.* the tokenizer's chat template renders no tool"):
        _prepared(tmp_path, chat_dir, path, *settings)


@pytest.mark.parametrize("marks", [False, True], ids=["rendered", "marked"])
def test_a_conversation_the_chat_template_refuses_is_named(tmp_path, model_dir, marks):
    """Mistral's and Llama 2's templates raise on a conversation whose roles do not alternate (or
    that holds a system message): a jinja2 TemplateError traceback from the middle of tokenising,
    with nothing saying which example. It is now a ConfigError naming the example and the
    template's own words."""
    chat_dir = _chat_model(tmp_path, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
              "{% endfor %}")
    tokenizer.chat_template = strict + (_template("{{ m['content'] }}", marks=True) if marks else CHAT_TEMPLATE)
    tokenizer.save_pretrained(chat_dir)
    good = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    bad = [{"role": "user", "content": "the cat"}, {"role": "user", "content": "sat on"},
           {"role": "assistant", "content": "a mat"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": bad}) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl line 2: the tokenizer's chat template refuses this "
                                          r"conversation \(Conversation roles must alternate"):
        _prepared(tmp_path, chat_dir, path, "data.format=chat", "data.packing=false", "data.max_seq_len=400")


def test_a_disk_that_cannot_hold_the_exports_is_refused_before_training(tmp_path, model_dir, data, monkeypatch, capsys):
    """The exports kept plus the final one (and the state, on the same disk) must fit: refused up
    front with the figures, nothing trained."""
    import collections

    import tiered_offload.train.outputs as run
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 4096))
    config = write_config(tmp_path, model_dir, data)
    assert cli_main(["train", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "for the exports (1 kept and the final one)" in err and "lower output.keep" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_bf16_autocast_computes_in_bf16_and_keeps_the_state_fp32(tmp_path, model_dir, data):
    """``train.precision: bf16-autocast``: the losses are those of bfloat16 matrix products (not
    fp32's, but close), the exported weights are fp32; another value is refused by name."""
    runs = {}
    for precision in ("fp32", "bf16-autocast"):
        records = []
        summary = train(write_config(tmp_path / precision, model_dir, data, train__max_steps=4, train__precision=precision,
                                     output__export_every=0), progress=False, on_step=lambda s, r: records.append(r["loss"]))
        runs[precision] = (records, exported(Path(summary["final"])))
    (fp32, _), (bf16, weights) = runs["fp32"], runs["bf16-autocast"]
    assert fp32 != bf16 and all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert all(w.dtype == torch.float32 for w in weights.values())
    with pytest.raises(ConfigError, match="train.precision must be one of fp32, bf16-autocast"):
        train(write_config(tmp_path / "bad", model_dir, data, train__precision="fp16"), progress=False)


def test_the_long_steps_show_progress_bars_where_a_command_asks(tmp_path, model_dir, data, capsys):
    """Tokenising, reading init_from and exporting under `train`; verifying and exporting under
    the CLI; nothing from the library on its own, nothing with --json."""
    train(write_config(tmp_path, model_dir, data, train__max_steps=1, output__export_every=0), progress=True)
    err = capsys.readouterr().err
    assert "tokenising" in err and "reading init_from" in err and "exporting to" in err, err[-2000:]
    assert cli_main(["verify", str(tmp_path / "run")]) == 0
    assert "verifying" in capsys.readouterr().err
    assert cli_main(["verify", "--json", str(tmp_path / "run")]) == 0
    assert "verifying" not in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "again")]) == 0
    assert "exporting to" in capsys.readouterr().err
    from tiered_offload.progress import counter, track
    assert list(track([1, 2, 3], desc="quiet")) == [1, 2, 3]
    with counter(3, desc="quiet") as advance:
        advance(1)
    assert capsys.readouterr().err == ""


def test_a_step_that_fails_part_way_stops_the_command_and_the_same_command_again_resumes(tmp_path, model_dir, data,
                                                                                           monkeypatch, capsys):
    """An error in one unit's optimizer update (an out-of-memory, the optimizer's code): the command
    stops with exit 2 and says so, naming the unit and telling a command-line user what to do (the
    same command again), not the engine's API; the same command again finishes the step the journal
    recorded and trains on: the weights of a run that never failed."""
    from tiered_offload.engine.optimizer_step import UnitUpdater
    reference = train(write_config(tmp_path / "a", model_dir, data, train__max_steps=4), progress=False)
    config = write_config(tmp_path / "b", model_dir, data, train__max_steps=4)
    update, calls = UnitUpdater.update, []

    def failing(self, unit, *args, **kwargs):
        calls.append(unit.name)
        if len(calls) == 7:  # (in the second step)
            raise RuntimeError("an error in the optimizer's code")
        return update(self, unit, *args, **kwargs)
    monkeypatch.setattr(UnitUpdater, "update", failing)
    assert cli_main(["train", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"update of {calls[6]}: RuntimeError: an error in the optimizer's code" in err, err
    assert "Run the same command again" in err and "resume=True" not in err, err
    monkeypatch.undo()
    assert cli_main(["train", "--config", str(config), "--no-progress"]) == 0
    a, b = exported(Path(reference["final"])), exported(tmp_path / "b" / "out" / "final")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_warm_up_the_run_never_finishes_is_warned_of(tmp_path, model_dir, data, caplog):
    """``train.warmup_steps`` at or beyond the run's steps (a warm-up set for a long run, kept for a
    short one): the learning rate never reached ``train.lr``, and nothing said so. Now the start
    warns, with the rate the last step takes; a warm-up that ends inside the run says nothing."""
    for warmup, warned in ((8, True), (20, True), (7, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="tiered_offload"):
            train(write_config(tmp_path / str(warmup), model_dir, data, train__warmup_steps=warmup), [],
                  dry_run=True, progress=False)
        said = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
        assert bool(said) == warned, (warmup, said)
        if warned:  # (8 steps, the last one's factor 8 / (warmup + 1) of lr 0.01)
            assert re.search(rf"train\.warmup_steps {warmup} is not below the run's 8 steps: the learning rate never "
                             rf"reaches train\.lr 0\.01 \(the last step's is {0.01 * 8 / (warmup + 1):.3g}\)", said[0])


def test_the_commands_warnings_name_the_library_once(tmp_path, model_dir, data):
    """The command line's log lines name their logger (``WARNING tiered_offload: ...``), and the
    library's warnings begin with ``tiered-offload:`` for a program that logs them in its own way:
    the command printed both (``WARNING tiered_offload: tiered-offload: ...``)."""
    config = write_config(tmp_path, model_dir, data, train__warmup_steps=8)
    r = subprocess.run([sys.executable, "-m", "tiered_offload", "train", "--config", str(config), "--dry-run",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING tiered_offload: train.warmup_steps 8 is not below the run's 8 steps" in r.stderr, r.stderr[-2000:]
    assert "tiered-offload: train.warmup_steps" not in r.stderr


def _long_prompts(path: Path, n: int = 48) -> Path:
    """Prompt-completion examples, three in four with a prompt longer than 16 tokens: cut to 16
    without packing, their completions are gone."""
    words = sentences(n, seed=11)
    path.write_text("".join(json.dumps({"prompt": " ".join([w] * (1 if i % 4 == 0 else 6)), "completion": " done"})
                            + "\n" for i, w in enumerate(words)))
    return path


@pytest.mark.parametrize("packing", [False, True, "documents"])
def test_every_sequence_made_has_a_token_the_loss_is_on(tmp_path, model_dir, packing):
    """A sequence whose loss-carrying tokens were cut away by ``max_seq_len`` (a prompt longer than
    it), or that never had any, trains nothing, and a micro-batch of only such sequences has a loss
    of 0/0: NaN. Such sequences are left out when the data is made, saying how many, and every one
    made has a token the model's shifted loss counts (its label at position 1 or later)."""
    import logging
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    path = _long_prompts(tmp_path / "train.jsonl")
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.format=prompt-completion",
                             f"data.packing={str(packing).lower()}", "data.max_seq_len=16", "data.eval_fraction=0.25",
                             f"offload.storage={tmp_path / 's'}", "train.max_steps=1"])
    logger = logging.getLogger("tiered_offload")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger.addHandler(handler)
    try:
        train_data, eval_data = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
    finally:
        logger.removeHandler(handler)
    for part in (train_data, eval_data):
        labels = np.asarray(part.labels)
        assert len(labels) and (labels[:, 1:] != IGNORE).any(axis=1).all(), labels
    if packing is not True:  # (packed, a window cut from the stream always reaches some completion here)
        assert [m for m in said if re.search(r"\d+ of \d+ training sequences have no token the loss is on", m)], said


def test_a_run_whose_cut_prompts_leave_some_sequences_without_loss_trains_on(tmp_path, model_dir):
    """``micro_batch: 1`` and prompts longer than ``max_seq_len`` without packing: the run stopped at
    the first sequence left without its completion, with "the loss is nan ... lower the learning
    rate", and again at the same step on every resume. It now trains."""
    path = _long_prompts(tmp_path / "train.jsonl")
    config = write_config(tmp_path, model_dir, path, data__format="prompt-completion", data__packing=False,
                          data__max_seq_len=16, data__eval_fraction=0.0, train__micro_batch=1, train__grad_accum=1,
                          train__max_steps=8, output__export_every=0)
    records = []
    summary = train(config, progress=False, on_step=lambda s, r: records.append(r))
    assert summary["step"] == 8 and all(math.isfinite(r["loss"]) for r in records), records


@pytest.mark.parametrize("case", ["chat without an assistant turn", "every completion cut"])
def test_data_without_a_token_the_loss_is_on_is_refused_saying_why(tmp_path, model_dir, case):
    """Chat examples without an ``assistant`` turn (roles ``human`` / ``bot``, or the user's turns
    only), or completions all cut away by ``max_seq_len``: every sequence had a loss of NaN, and
    the run stopped at step 1 advising a lower learning rate. It is now refused before the model
    is built, naming what carries the loss in that format."""
    if case == "chat without an assistant turn":
        model_dir = _chat_model(tmp_path, model_dir)
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": s}]}) + "\n"
                                for s in sentences(40, seed=12)))
        settings, match = dict(data__format="chat"), r"the assistant's turns"
    else:
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"prompt": s + " " + s, "completion": " done"}) + "\n"
                                for s in sentences(40, seed=12)))
        settings, match = dict(data__format="prompt-completion", data__max_seq_len=8), r"the completion.*max_seq_len 8"
    config = write_config(tmp_path, model_dir, path, data__packing=False, train__max_steps=1, **settings)
    with pytest.raises(ConfigError, match=r"chat\.jsonl|train\.jsonl") as refused:
        train(config, progress=False)
    assert re.search(r"no sequence has a token the loss is on", str(refused.value)), refused.value
    assert re.search(match, str(refused.value)), refused.value
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_evaluation_examples_that_make_no_sequence_are_no_evaluation(tmp_path, model_dir):
    """Held-out examples too few to fill one packed sequence (or none with a token the loss is on)
    made an evaluation set of no sequence, and every evaluation reported ``eval_loss`` 0.0: a
    perfect model. There is now no evaluation set, and the run says why."""
    import logging
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(60, seed=13)))
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.max_seq_len=32",
                             "data.eval_fraction=0.02", f"offload.storage={tmp_path / 's'}", "train.max_steps=1"])
    logger, said = logging.getLogger("tiered_offload"), []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger.addHandler(handler)
    try:
        train_data, eval_data = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
        assert eval_data is None and len(train_data)
        assert [m for m in said if "evaluation" in m and "no sequence" in m and "data.eval_fraction" in m], said
        said.clear()
        assert prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)[1] is None  # (from the cache)
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("average", ["tokens", "micro_batches"])
def test_accumulated_micro_batches_give_the_large_batch_s_gradient(tmp_path, model_dir, average):
    """The loss of a step of ``grad_accum`` micro-batches was the mean of their means: a micro-batch
    with few tokens the loss is on (short completions, a prompt-completion set without packing)
    weighed as much as one with many, so 4 x 2 sequences trained another gradient than 8 x 1 of the
    same rows (Hugging Face's Trainer has averaged over the step's tokens since 4.46). The default
    ``train.average: tokens`` does the same: the gradient norm and loss of 4 x 2 are those of 8 x 1
    up to rounding. ``micro_batches`` keeps the mean of means (a run begun before keeps it)."""
    path = tmp_path / "train.jsonl"
    words = sentences(64, seed=14)
    path.write_text("".join(json.dumps({"prompt": w, "completion": " " + " ".join([w] * (1 + i % 5))}) + "\n"
                            for i, w in enumerate(words)))
    runs = {}
    for mb, accum in ((8, 1), (4, 2), (2, 4)):
        config = write_config(tmp_path / f"{mb}x{accum}", model_dir, path, data__format="prompt-completion",
                              data__packing=False, data__max_seq_len=64, data__eval_fraction=0.0,
                              train__micro_batch=mb, train__grad_accum=accum, train__max_steps=1,
                              train__average=average, output__export_every=0)
        records = []
        train(config, progress=False, on_step=lambda s, r: records.append(r))
        runs[mb] = records[0]
    for mb in (4, 2):
        close = runs[mb]["grad_norm"] == pytest.approx(runs[8]["grad_norm"], rel=1e-5)
        assert close == (average == "tokens"), (mb, runs[mb]["grad_norm"], runs[8]["grad_norm"])
        close = runs[mb]["loss"] == pytest.approx(runs[8]["loss"], rel=1e-5)
        assert close == (average == "tokens"), (mb, runs[mb]["loss"], runs[8]["loss"])


def test_a_run_begun_before_train_average_goes_on_as_it_began(tmp_path, model_dir, monkeypatch, caplog):
    """A run whose saved settings hold no ``train.average`` (begun before it) resumed with the new
    default would change its steps' loss midway: it keeps the mean of the micro-batches' means at
    every resume, saying so, and its steps are bitwise those of a run with ``micro_batches``
    throughout."""
    import logging
    from tiered_offload.train import run as run_module
    caplog.set_level(logging.INFO, logger="tiered_offload")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": w, "completion": " " + " ".join([w] * (1 + i % 5))}) + "\n"
                            for i, w in enumerate(sentences(64, seed=15))))
    settings = dict(data__format="prompt-completion", data__packing=False, data__max_seq_len=64,
                    data__eval_fraction=0.0, train__grad_accum=2, output__export_every=0)
    records = {"before": [], "throughout": []}
    config = write_config(tmp_path / "before", model_dir, path, train__max_steps=1, **settings)
    with monkeypatch.context() as m:  # (the first step as the command before the setting ran it)
        m.setattr(run_module, "loss_average", lambda average, saved, location: "micro_batches")
        train(config, progress=False, on_step=lambda s, r: records["before"].append(r))
    for steps in (2, 3):
        train(config, [f"train.max_steps={steps}"], progress=False, on_step=lambda s, r: records["before"].append(r))
    assert sum("began before train.average" in r.getMessage() for r in caplog.records) == 2
    config = write_config(tmp_path / "throughout", model_dir, path, train__max_steps=3, train__average="micro_batches",
                          **settings)
    train(config, progress=False, on_step=lambda s, r: records["throughout"].append(r))
    assert [(r["loss"], r["grad_norm"]) for r in records["before"]] == \
        [(r["loss"], r["grad_norm"]) for r in records["throughout"]]


def test_the_evaluation_loss_is_the_mean_over_the_held_out_tokens(tmp_path, model_dir):
    """``eval_loss`` was each micro-batch's mean weighed by its sequences: with completions of
    unequal length, a short one's tokens weighed more than a long one's, so it was no token mean
    (its exponent no perplexity) and not the quantity the training loss is. It is now the mean over
    every held-out token the loss counts: the final model's, read back from the export."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": w, "completion": " " + " ".join([w] * (1 + 3 * (i % 5)))}) + "\n"
                            for i, w in enumerate(sentences(96, seed=17))))
    config = write_config(tmp_path, model_dir, path, data__format="prompt-completion", data__packing=False,
                          data__max_seq_len=64, data__eval_fraction=0.25, train__max_steps=2, output__export_every=0)
    summary = train(config, progress=False)
    cfg = load_config(config, [])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    _, eval_data = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "reference-cache", None)
    model = transformers.AutoModelForCausalLM.from_pretrained(summary["final"]).eval()
    total, count, means = 0.0, 0, []
    with torch.no_grad():
        for a in range(0, len(eval_data), 5):
            batch = eval_data.batch(list(range(a, min(len(eval_data), a + 5))))
            logits = model(**batch).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                       ignore_index=IGNORE, reduction="sum")
            total, count = total + losses.item(), count + int((labels != IGNORE).sum())
            means.append((losses.item() / int((labels != IGNORE).sum()), len(batch["labels"])))
    assert summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    by_rows = sum(m * n for m, n in means) / sum(n for _, n in means)
    assert by_rows != pytest.approx(total / count, rel=1e-5)  # (the data makes the two differ past that rounding)


def test_a_cache_made_before_sequences_without_loss_were_left_out_is_made_again(tmp_path, model_dir, monkeypatch):
    """The tokenised data is cached by the files and settings. A cache made by the code before,
    which kept sequences with no token the loss counts, would have been read as it was by a run
    after the fix (the user who met the NaN, running again): it is made again."""
    from tiered_offload.train import data as data_module
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    path = _long_prompts(tmp_path / "train.jsonl")
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", "data.format=prompt-completion",
                             "data.packing=false", "data.max_seq_len=16", f"offload.storage={tmp_path / 's'}",
                             "train.max_steps=1"])
    with monkeypatch.context() as m:  # (the code before: its key, every example a sequence)
        m.setattr(data_module, "MADE", 1)
        m.setattr(data_module, "_examples_with_loss", lambda spool, a, b, length: np.arange(a, b))
        before, _ = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
    assert not (np.asarray(before.labels)[:, 1:] != IGNORE).any(axis=1).all()
    after, _ = prepare_data(cfg.data, tokenizer, model_dir, tmp_path / "cache", None)
    assert len(after) < len(before) and (np.asarray(after.labels)[:, 1:] != IGNORE).any(axis=1).all()
    assert len(list((tmp_path / "cache").glob("data-*"))) == 1  # (the one before removed)


def test_a_step_larger_than_the_data_is_warned_of(tmp_path, model_dir, caplog):
    """``train.micro_batch`` x ``grad_accum`` above the number of training sequences (a batch size
    copied from a large run onto a small data set) trained each step on some sequences twice or
    more, without a word: the run now warns, naming both numbers."""
    import logging
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(12, seed=18)))
    config = write_config(tmp_path, model_dir, path, data__eval_fraction=0.0, data__max_seq_len=16,
                          train__micro_batch=8, train__grad_accum=2, train__max_steps=1, output__export_every=0)
    train(config, progress=False)
    said = [r.getMessage() for r in caplog.records if "a step's 16 sequences" in r.getMessage()]
    assert len(said) == 1 and re.search(r"more than the data's \d+: a step trains some of them twice", said[0]), said


def test_a_loss_that_turns_non_finite_names_the_command_s_way_on(tmp_path, model_dir, data):
    """A loss or gradients that turned non-finite (a learning rate far too high here) stopped the
    command with the engine's advice, "pass on_nonfinite='skip'", an argument of the engine's that
    the command has no key for. It now names the step, ``train.lr`` and the same command again
    (which resumes from the last commit with the new rate), and an earlier export where the
    committed weights had diverged already: here they had (step 1 at ``lr=1e30``), and the resume
    at a sane rate stops alike, typed."""
    config = write_config(tmp_path, model_dir, data, train__max_steps=4, train__lr=1e30, train__warmup_steps=0,
                          output__export_every=0)
    with pytest.raises(NonFiniteError, match=r"^step \d: (the loss is nan|non-finite gradients in [^;]+); the "
                                             r"training state is the last commit's\. Lower train\.lr .*run the same "
                                             r"command again.*an earlier export \(model\.path: .*/out/step-N\)"
                       ) as stopped:
        train(config, progress=False)
    assert "on_nonfinite" not in str(stopped.value)
    with pytest.raises(NonFiniteError, match=r"^step 2: "):
        train(config, ["train.lr=1e-3"], progress=False)


def test_a_longer_run_that_warms_a_finished_schedule_again_says_so(tmp_path, model_dir, data, caplog):
    """A cosine run to its end, then the same command with a larger ``train.max_steps``: the
    schedule is drawn over the new length, and the learning rate jumped from near zero back to
    near its peak without a word (by design: a longer run gets its own cosine). The resume now
    says so, with the rate it had reached; a slightly longer run, whose rate moves little, and the
    warm-up say nothing."""
    import logging
    caplog.set_level(logging.WARNING, logger="tiered_offload")
    config = write_config(tmp_path, model_dir, data, train__max_steps=8, output__export_every=0)
    train(config, ["train.max_steps=1"], progress=False)
    train(config, progress=False)
    assert not [r for r in caplog.records if "learning rate rises" in r.getMessage()]
    train(config, ["train.max_steps=40"], progress=False)
    said = [r.getMessage() for r in caplog.records if "learning rate rises" in r.getMessage()]
    assert len(said) == 1 and re.search(r"at step 8 to [\d.e-]+ at step 9: the cosine schedule is drawn over the "
                                        r"run's 40 steps", said[0]), said
    train(config, ["train.max_steps=41"], progress=False)
    assert len([r for r in caplog.records if "learning rate rises" in r.getMessage()]) == 1
