"""An MXFP4 checkpoint's experts read as ``from_pretrained`` dequantizes them (gpt-oss as OpenAI
ships it: its config's ``quantization_config`` says ``mxfp4``).

Each expert weight ``X`` of the model is stored as ``X_blocks`` (``uint8``, two 4-bit values a
byte, ``[experts, rows, groups, 16]``) and ``X_scales`` (``uint8``, one power of two a group of 32
values, ``[experts, rows, groups]``); the other tensors are plain. ``from_pretrained`` with
``Mxfp4Config(dequantize=True)`` turns the pair into ``X`` with transformers' own
``convert_moe_packed_tensors``, and so does this reader, one expert at a time into the engine's
buffer: beyond it, the packed tensors (an eighth of ``X`` in fp32) and one expert dequantized. Every
value is a 4-bit float times a power of two, which fp32 and bf16 both hold exactly: the weights are
those of ``from_pretrained`` in either dtype.
"""

from __future__ import annotations

import math

import torch

from offload_core.errors import CheckpointError

__all__ = ["READABLE", "unpacked", "read_into"]

READABLE = ("mxfp4",)
"""The ``quant_method`` values of a ``quantization_config`` whose weights this reader dequantizes."""


def unpacked(entries: dict, source) -> dict:
    """``entries`` (a :class:`~tiered_offload.checkpoint.safetensors_io.PretrainedReader`'s) with each
    ``X_blocks`` / ``X_scales`` pair replaced by an entry for ``X``, as the model holds it (fp32,
    ``[experts, groups * 32, rows]``), which :func:`read_into` reads."""
    out = {n: e for n, e in entries.items() if not (n.endswith("_blocks") or n.endswith("_scales"))}
    for name in entries:
        if not name.endswith("_blocks"):
            continue
        x = name.removesuffix("_blocks")
        blocks, scales = entries[name], entries.get(f"{x}_scales")
        if scales is None:
            raise CheckpointError(f"{source}: {name} has no {x}_scales beside it: not a whole MXFP4 tensor; download "
                                  f"the checkpoint again")
        b, s = blocks[1], scales[1]
        bshape, sshape = list(b["shape"]), list(s["shape"])
        if b["dtype"] != "U8" or s["dtype"] != "U8" or len(bshape) != 4 or bshape[-1] != 16 or bshape[:-1] != sshape:
            raise CheckpointError(f"{source}: {name} ({b['dtype']} {bshape}) and {x}_scales ({s['dtype']} {sshape}) "
                                  f"are not MXFP4's layout (uint8 [experts, rows, groups, 16] and [experts, rows, "
                                  f"groups]); download the checkpoint again")
        experts, rows, groups, _ = bshape
        out[x] = (blocks[0], {"dtype": "MXFP4", "torch_dtype": torch.float32, "shape": [experts, groups * 32, rows],
                              "mxfp4": (name, blocks, f"{x}_scales", scales)}, None)
    for name in entries:
        if name.endswith("_scales") and f"{name.removesuffix('_scales')}_blocks" not in entries:
            out[name] = entries[name]  # (a plain tensor of that name)
    return out


def read_into(read_entry, info: dict, out: torch.Tensor) -> None:
    """Dequantize the entry ``info`` (of :func:`unpacked`) into ``out``, one expert at a time;
    ``read_entry(name, entry, tensor)`` reads one of the file's tensors whole."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as e:
        raise CheckpointError(f"an MXFP4 checkpoint is dequantized by transformers' own code, which this "
                              f"transformers lacks ({e}); pip install -U transformers") from None
    bname, bentry, sname, sentry = info["mxfp4"]
    blocks = torch.empty(bentry[1]["shape"], dtype=torch.uint8)
    scales = torch.empty(sentry[1]["shape"], dtype=torch.uint8)
    read_entry(bname, bentry, blocks)
    read_entry(sname, sentry, scales)
    for e in range(blocks.shape[0]):
        part = convert_moe_packed_tensors(blocks[e:e + 1], scales[e:e + 1], dtype=out.dtype,
                                          rows_per_chunk=max(1, math.prod(blocks.shape[1:3])))
        out[e].copy_(part[0])
