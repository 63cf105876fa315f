"""The README's Python examples run as written, on tiny sizes.

Every ```python block of README.md is executed, in order, in one namespace (a later block uses the
names an earlier one defined, as a reader would), with only sizes and paths replaced: each
replacement must find its text in the README, so an edited example cannot silently escape it.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_python_example_in_the_readme_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    blocks = python_blocks(readme)
    assert len(blocks) == 4, "the README's examples changed: update this test's expectations"

    # a local Hugging Face directory for the fine-tuning example
    tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny))
    pretrained.save_pretrained(tmp_path / "Llama-3.2-1B")
    initial = {k: v.clone() for k, v in pretrained.state_dict().items()}

    replacements = {
        "vocab_size=32000": "vocab_size=256", "hidden_size=2048": "hidden_size=64",
        "intermediate_size=5632": "intermediate_size=128", "num_hidden_layers=22": "num_hidden_layers=2",
        "num_attention_heads=32": "num_attention_heads=4", "(4, 512)": "(2, 16)",
        '"/mnt/nvme/': f'"{tmp_path}/nvme/', '"4GiB"': '"4MiB"',
    }
    for old in replacements:
        assert old in readme, f"the README no longer contains {old!r}: update this test"
    monkeypatch.chdir(tmp_path)  # "./Llama-3.2-1B" and "./llama-ft" are here
    # the distributed example's init_process_group() as torchrun would set it up, with one rank
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    namespace: dict = {}
    for i, block in enumerate(blocks):
        for old, new in replacements.items():
            block = block.replace(old, new)
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
        if i == 0:  # the training loop: 3 steps, the weights on the CPU, finite
            weights = namespace["weights"]
            assert set(weights) == {n for n, _ in transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**tiny)).named_parameters()}
            assert all(bool(torch.isfinite(w).all()) for w in weights.values())
        if i == 1:  # fine-tuned from the local directory and loaded back: trained, so different
            tuned = namespace["tuned"]
            assert isinstance(tuned, transformers.LlamaForCausalLM)
            changed = [k for k, v in tuned.state_dict().items() if k in initial and not torch.equal(v, initial[k])]
            assert changed and all(bool(torch.isfinite(v).all()) for v in tuned.state_dict().values())
        if i == 2:  # resumed the first example's directory at step 3 and trained 3 more steps
            assert namespace["engine"].step_count == 6
            assert namespace["engine"].user_state == {"batches": 6}
    assert not torch.distributed.is_initialized()
