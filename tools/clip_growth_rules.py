"""How well rules on past steps predict a clipped step's gradient norm from its first bound.

A step clipped in the backward (``clip_norm``) is kept out of it where its bound at the first unit,
grown as the last clipped step's total grew from its own (``TrainState.clip_growth``), passes 0.9
of the limit (tiered_offload/engine/step_in_backward.py). This runs ``tiered-offload train`` on
``tools/bench_finetune.py``'s small Llama with every step tried in the backward (``train.clip``
1e9: none is over), records each step's first bound and total norm, then replays rules for the
predicted total at limits spread over the run's own norms (its quantiles, and 5% above each):

* a step runs in the backward where its first bound is within the limit and the prediction within
  0.9 of it (the first step of a run: after the backward, to learn);
* it is **torn** where it ran there and its total is over the limit;
* else it is **kept out** (run after the backward, clipped).

    python tools/clip_growth_rules.py                     # three runs of 40 steps, about 3 minutes here
    python tools/clip_growth_rules.py --runs 6x256@1e-3/2 --steps 60

``--runs``: comma-separated ``LAYERSxWIDTH@LR/ACCUMULATION``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MARGIN = 0.9
RULES = {
    "first bound x the last step's growth (the engine's)": lambda h: h[-1],
    "x the largest of the last 3 growths": lambda h: max(h[-3:]),
    "x the largest of the last 8": lambda h: max(h[-8:]),
    "x the last growth, extrapolated where it rose": lambda h: h[-1] * max(1.0, h[-1] / h[-2]) if len(h) > 1 else h[-1],
}


def record(layers: int, width: int, lr: float, accumulation: int, steps: int, host_fraction: float) -> list:
    """(first bound, total norm) of each step of one ``train`` run."""
    import transformers

    import bench_finetune
    from tiered_offload.engine import step_in_backward
    from tiered_offload.train import load_config, train
    seen, learn = [], step_in_backward.StepInBackward._learn_growth

    def spy(self):
        seen.append((self.first, float(self.norm)))
        return learn(self)
    work = Path(tempfile.mkdtemp(prefix="clip-growth-"))
    try:
        model_dir = bench_finetune.build(work, layers, width)
        n = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(model_dir)).num_parameters()
        overrides = [f"model.path={model_dir}", f"data.path={work / 'train.jsonl'}", "data.max_seq_len=128",
                     "train.micro_batch=4", f"train.grad_accum={accumulation}", f"train.max_steps={steps}",
                     f"train.lr={lr}", "train.warmup_steps=5", "train.clip=1e9", f"offload.storage={work / 'state'}",
                     f"offload.host_memory={int(16 * n * host_fraction)}", "offload.commit_every=4",
                     f"output.dir={work / 'out'}", "output.export_every=0"]
        step_in_backward.StepInBackward._learn_growth = spy
        train(load_config(None, overrides), progress=False)
    finally:
        step_in_backward.StepInBackward._learn_growth = learn
        shutil.rmtree(work, ignore_errors=True)  # (each run wrote 0.1 GB there)
    missing = sum(first is None for first, _ in seen)
    if missing:
        raise SystemExit(f"{missing} of {len(seen)} steps took no first bound (were they run in the backward?)")
    return seen


def limits(seen: list) -> list[float]:
    """The limits a run is replayed at: its norms' quantiles 1/20..19/20, and 5% above each."""
    norms = sorted(t for _, t in seen)
    return [f * norms[q * len(norms) // 20] for q in range(1, 20) for f in (1.0, 1.05)]


def replay(seen: list, limit: float, grow) -> tuple[int, int, int]:
    """Steps run in the backward, torn, kept out, at ``limit`` under the rule ``grow(growths)``."""
    growths, ran, torn, out = [], 0, 0, 0
    for first, total in seen:
        if growths and first <= limit and first * grow(growths) <= MARGIN * limit:
            torn, ran = torn + (total > limit), ran + (total <= limit)
        else:
            out += 1
        growths.append(max(total / first, 1.0))
    return ran, torn, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="6x256@1e-3/2,6x256@1e-4/1,12x128@3e-4/2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--host-fraction", type=float, default=0.3, help="the host budget, of the training state")
    args = ap.parse_args()
    runs = []
    for spec in args.runs.split(","):
        shape, _, rest = spec.partition("@")
        lr, _, accumulation = rest.partition("/")
        layers, width = (int(x) for x in shape.split("x"))
        seen = record(layers, width, float(lr), int(accumulation or 1), args.steps, args.host_fraction)
        runs.append((spec, seen))
        print(f"{spec}: growths " + " ".join(f"{t / f:.2f}" for f, t in seen), flush=True)
    print("\n| rule for the predicted total | steps run in the backward | tears | kept out |")
    print("| --- | ---: | ---: | ---: |")
    for name, grow in RULES.items():
        total = [0, 0, 0]
        for _, seen in runs:
            for limit in limits(seen):
                total = [a + b for a, b in zip(total, replay(seen, limit, grow))]
        print(f"| {name} | {total[0]} | {total[1]} | {total[2]} |")
    for spec, seen in runs:  # where the engine's rule tore a step: which steps, and their growth
        growths, torn = [], set()
        for i, (first, total) in enumerate(seen):
            if growths and any(first <= limit < total and first * growths[-1] <= MARGIN * limit
                               for limit in limits(seen)):
                torn.add((i, round(growths[-1], 2), round(total / first, 2)))
            growths.append(max(total / first, 1.0))
        for i, was, now in sorted(torn):
            print(f"{spec}: step {i} tore under the engine's rule at some limit (growth {was} before, {now} there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
