#!/usr/bin/env python
"""Side by side with DeepSpeed ZeRO-3, parameters and optimizer states offloaded to NVMe, on
DeepSpeed's kind of workload: GPT-2 4 x 512 (38.9M parameters, 593 MiB of fp32 training state),
batch 4 x 128, AdamW (lr 1e-4, weight decay 0.01), gradient clipping at 1.0, on the CPU.

    pip install deepspeed          # and libaio-dev for its async I/O op (apt-get install libaio-dev)
    python tools/bench_deepspeed.py --rounds 5

Configurations, all built once, then run in interleaved rounds (each round runs each one for a
few steps, the order reversed every other round) so a noisy machine hits them alike; medians:

* plain PyTorch, everything in memory (the reference);
* DeepSpeed 0.19 ZeRO-3, ``offload_param`` and ``offload_optimizer`` on NVMe (``DS_ACCELERATOR=cpu``,
  gloo, one process; the model built inside ``deepspeed.zero.Init`` in fp32, then loaded with the
  reference's initial weights);
* the engine, durable (the default for a directory), host budget at its minimum;
* the same with ``durable=False``;
* the same durable with ``commit_every=4``;
* the engine, ``durable=False``, host budget half the state;
* the engine with a host budget that holds the whole state (1.6x it, still a fraction of the memory
  DeepSpeed takes), durable with ``commit_every=4`` and ``durable=False``.

DeepSpeed's memory is not bounded by a budget: the process's resident memory after DeepSpeed's
set-up is printed beside the engine's budget.

Every configuration starts from the same weights and sees the same batches; the first losses
are printed side by side (the engine's equal plain PyTorch's bitwise; DeepSpeed's agree to
float tolerance). Ratios: each configuration's throughput over DeepSpeed's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
             ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - imported before zero.Init patches tensor construction

VOCAB = 50257


def build(layers: int, d_model: int):
    import transformers
    from transformers import masking_utils  # noqa: F401 - as torch._dynamo above
    # no dropout: every configuration computes the same thing from the same batches (with dropout
    # they would draw different masks from the one global RNG they share in this process)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=d_model, n_head=8, n_positions=1024, vocab_size=VOCAB,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return cfg, model


def loss_of(model, x):
    return model(input_ids=x, labels=x).loss


class Config:
    def __init__(self, name, step, finish=lambda: None):
        self.name, self.step, self.finish = name, step, finish
        self.per_step: list[float] = []
        self.losses: list[float] = []

    def run(self, batches):
        t0 = time.perf_counter()
        for x in batches:
            self.losses.append(self.step(x))
        self.finish()
        self.per_step.append((time.perf_counter() - t0) / len(batches))


def deepspeed_config(cfg, ref, directory: str, batch: int):
    import deepspeed
    nvme = os.path.join(directory, "deepspeed-nvme")
    os.makedirs(nvme, exist_ok=True)
    n_tensors = len(list(ref.parameters()))
    ds_config = {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            # buffer_count must cover every parameter it swaps, or it stops with an assertion
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                              "buffer_count": n_tensors + 8, "buffer_size": 3e7},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False, "buffer_count": 4},
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1e8,
            "stage3_prefetch_bucket_size": 1e7},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }
    import psutil
    before = psutil.Process().memory_info().rss
    deepspeed.init_distributed(dist_backend="gloo")
    import transformers
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.float32):
        model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    start = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # the reference's initial weights
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(start[name].data)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(x):
        loss = loss_of(engine, x)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def resident():
        RESIDENT["deepspeed"] = max(RESIDENT.get("deepspeed", 0), psutil.Process().memory_info().rss - before)
    return Config("deepspeed", step, finish=resident)


RESIDENT: dict[str, int] = {}
"""DeepSpeed's resident memory growth from before its set-up, sampled after each round (the other
configurations run in between, so this includes theirs: an upper bound)."""


def minimum_budget(make_engine) -> int:
    from tiered_offload import TierCapacityError
    try:
        make_engine(1 << 20).close()
    except TierCapacityError as e:
        return int(re.search(r"\((\d+) bytes\) needed", str(e)).group(1))
    raise SystemExit("the engine accepted a 1 MiB budget; this model is too small for this benchmark")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--path", default=None, help="where the state goes (default: a temp dir under cwd)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--trace", default=None, help="write the durable engine's step timeline (Chrome trace) here "
                                                  "(tools/trace_summary.py reads it)")
    args = ap.parse_args()
    from tiered_offload import Engine
    cfg, ref = build(args.layers, args.d_model)
    directory = args.path or tempfile.mkdtemp(prefix=".bench-deepspeed-", dir=os.getcwd())
    engines = []
    try:
        plain_model = copy.deepcopy(ref)
        opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-4, weight_decay=0.01)

        def plain_step(x):
            loss = loss_of(plain_model, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.item()

        def make_engine(host, name="probe", **kw):
            path = os.path.join(directory, name)
            shutil.rmtree(path, ignore_errors=True)
            return Engine(copy.deepcopy(ref), torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01), storage=path,
                          host_memory=host, **kw)
        budget = minimum_budget(make_engine)

        def engine_config(name, host=None, **kw):
            engine = make_engine(host or budget, name, **kw)
            engines.append(engine)

            def step(x):
                loss = loss_of(engine, x)
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
                return loss.item()
            return Config(name, step, finish=engine.wait_committed)

        configs = [Config("plain", plain_step), deepspeed_config(cfg, ref, directory, args.batch),
                   engine_config("engine", trace=args.trace), engine_config("engine-volatile", durable=False),
                   engine_config("engine-commit-every-4", commit_every=4)]
        half = int(engines[0].state_bytes() * 0.5)
        configs.append(engine_config("engine-volatile-half-state", half, durable=False))
        state = engines[0].state_bytes()
        roomy = int(state * 1.6) + (64 << 20)
        configs += [engine_config("engine-fits-commit-every-4", roomy, commit_every=4),
                    engine_config("engine-volatile-fits", roomy, durable=False)]
        g = torch.Generator().manual_seed(1)
        for r in range(args.rounds + 1):
            batches = [torch.randint(0, VOCAB, (args.batch, args.context), generator=g)
                       for _ in range(args.steps_per_round)]
            for c in configs if r % 2 == 0 else configs[::-1]:
                c.run(batches)
        plans = {e.durable and e.commit_every: e.plan.summary() for e in engines}
        for e in engines:
            e.close()
        engines.clear()
    finally:
        for e in engines:
            e.close()
        if args.path is None:
            shutil.rmtree(directory, ignore_errors=True)
    med = {c.name: statistics.median(c.per_step[1:]) for c in configs}  # the first round warms up
    ds = med["deepspeed"]
    print(f"GPT-2 {args.layers} x {args.d_model}: {sum(p.numel() for p in ref.parameters()) / 1e6:.1f}M parameters, "
          f"{state / 2**20:.0f} MiB of training state; batch {args.batch} x {args.context}; engine host budget "
          f"{budget / 2**20:.1f} MiB (its minimum); {args.rounds} interleaved rounds of {args.steps_per_round} steps, medians")
    for c in configs:
        print(f"{c.name:24s} {med[c.name]:7.3f} s/step   throughput vs DeepSpeed {ds / med[c.name]:5.2f}x   "
              f"vs plain {med[c.name] / med['plain']:5.2f}x slower   first losses {[round(v, 4) for v in c.losses[:2]]}")
    print(f"DeepSpeed: resident memory grew by at most {RESIDENT.get('deepspeed', 0) / 2**30:.2f} GiB from before its "
          f"set-up; the engine's host budget: {budget / 2**30:.2f} GiB (its minimum), {half / 2**30:.2f} GiB (half the state), "
          f"{roomy / 2**30:.2f} GiB (holds the state)")
    print("engine's plan (durable):\n  " + plans[1].replace("\n", "\n  "))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds_per_step": med, "per_round": {c.name: c.per_step for c in configs},
                       "losses": {c.name: c.losses for c in configs}, "engine_budget_bytes": budget,
                       "deepspeed_resident_growth_bytes": RESIDENT.get("deepspeed"), "state_bytes": state,
                       "engine_roomy_budget_bytes": roomy}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
