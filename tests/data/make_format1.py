"""How tests/data/format1 was made, run with tiered-offload at commit 09be800 (storage format
"tiered-offload/1", CRC-32 checksums): a tiny GPT trained 2 steps into format1/state, and in
format1/expected.pt the weights after step 2 and after a third step that the same code ran on a
resume of that directory. The tests import the model, the settings and the step from here."""
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tiered_offload import Engine
from tiered_offload_examples.models import GPT, GPTConfig

KW = dict(optimizer_kwargs=dict(lr=1e-2, weight_decay=0.1), host_memory=16 * 9000)


def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, context=16, d_model=16, n_layers=2, n_heads=2))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 32, (2, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def one(engine, step):
    x, y = batch(step)
    loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.clip_grad_norm_(1.0)
    engine.step()
    engine.zero_grad()


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    kw = KW
    e = Engine(model(), torch.optim.AdamW, storage=out / "state", **kw)
    for s in range(2):
        one(e, s)
    after2 = {k: v.clone() for k, v in e.named_parameters()}
    e.close()
    shutil.copytree(out / "state", out / "pristine")
    e = Engine(model(), torch.optim.AdamW, storage=out / "state", resume=True, **kw)
    one(e, 2)
    after3 = {k: v.clone() for k, v in e.named_parameters()}
    e.close()
    shutil.rmtree(out / "state")
    (out / "pristine").rename(out / "state")
    torch.save({"after2": after2, "after3": after3}, out / "expected.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
