"""A quantized checkpoint's weights read as ``from_pretrained`` dequantizes them, where its config's
``quantization_config`` names a method transformers dequantizes tensor by tensor:

- ``mxfp4`` (gpt-oss as OpenAI ships it): each expert weight ``X`` stored as ``X_blocks``
  (``uint8``, two 4-bit values a byte, ``[experts, rows, groups, 16]``) and ``X_scales``
  (``uint8``, a power of two a group of 32 values, ``[experts, rows, groups]``). transformers'
  ``convert_moe_packed_tensors`` turns them into ``X``, here one expert at a time. Every value is a
  4-bit float times a power of two, exact in fp32 and bf16 alike.
- ``fp8`` (DeepSeek-V3's, Qwen3-FP8's: fine-grained FP8): a weight ``X`` stored in
  ``float8_e4m3fn`` beside ``X_scale_inv`` (one scale a block, fp32, bf16 or a power-of-two byte).
  transformers' ``Fp8Dequantize`` multiplies them in fp32; the engine keeps that fp32 product,
  which is ``from_pretrained(..., dtype=torch.float32)``'s (a bf16 model's rounds it once more).

Both run transformers' own code (``from_pretrained(..., quantization_config=...(dequantize=True))``
runs the same), into the engine's buffer: beyond it, one tensor's packed bytes and one
dequantized piece. The other tensors are plain.
"""

from __future__ import annotations

import math

import torch

from offload_core.errors import CheckpointError

__all__ = ["READABLE", "unpacked", "read_into"]

READABLE = ("mxfp4", "fp8")
"""The ``quant_method`` values of a ``quantization_config`` whose weights this reader dequantizes."""


def unpacked(entries: dict, source, method: str) -> dict:
    """``entries`` (a :class:`~tiered_offload.checkpoint.safetensors_io.PretrainedReader`'s) with
    each quantized weight and its scales replaced by one entry for the weight as the model holds it
    (fp32), which :func:`read_into` reads."""
    return _mxfp4(entries, source) if method == "mxfp4" else _fp8(entries, source)


def _mxfp4(entries: dict, source) -> dict:
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


_FP8_SCALES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8,
               "F8_E8M0": torch.uint8}  # (an E8M0 scale is a power-of-two byte, as transformers reads a uint8 one)


def _fp8(entries: dict, source) -> dict:
    out = dict(entries)
    for name, entry in entries.items():
        if entry[1].get("dtype") != "F8_E4M3" or f"{name}_scale_inv" not in entries:
            continue
        scales = entries[f"{name}_scale_inv"]
        shape, sshape = list(entry[1]["shape"]), list(scales[1]["shape"])
        if scales[1]["dtype"] not in _FP8_SCALES or len(shape) < 2 or len(sshape) not in (0, len(shape)):
            raise CheckpointError(f"{source}: {name} (F8_E4M3 {shape}) and {name}_scale_inv ({scales[1]['dtype']} "
                                  f"{sshape}) are not fine-grained FP8's layout (a scale a block of the weight); "
                                  f"download the checkpoint again")
        if any(n % max(1, k) for n, k in zip(shape[-2:], sshape[-2:])):  # (transformers' dequantization refuses it)
            raise CheckpointError(f"{source}: {name} {shape} has a scale grid {sshape} that does not divide it "
                                  f"(partial blocks at its edges), which transformers' FP8 dequantization does not "
                                  f"read either; start from the model's weights in bf16, fp16 or fp32")
        del out[f"{name}_scale_inv"]
        out[name] = (entry[0], {"dtype": "FP8", "torch_dtype": torch.float32, "shape": shape,
                                "fp8": (name, entry, f"{name}_scale_inv", scales)}, None)
    return out


def read_into(read_entry, info: dict, out: torch.Tensor) -> None:
    """Dequantize the entry ``info`` (of :func:`unpacked`) into ``out`` with transformers' own code;
    ``read_entry(name, entry, tensor)`` reads one of the file's tensors whole, as raw bytes."""
    if "mxfp4" in info:
        try:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
        except ImportError as e:
            raise CheckpointError(f"an MXFP4 checkpoint is dequantized by transformers' own code, which this "
                                  f"transformers lacks ({e}); pip install -U transformers") from None
        bname, bentry, sname, sentry = info["mxfp4"]
        blocks, scales = _raw(read_entry, bname, bentry, torch.uint8), _raw(read_entry, sname, sentry, torch.uint8)
        for e in range(blocks.shape[0]):
            part = convert_moe_packed_tensors(blocks[e:e + 1], scales[e:e + 1], dtype=out.dtype,
                                              rows_per_chunk=max(1, math.prod(blocks.shape[1:3])))
            out[e].copy_(part[0])
        return
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize
        dequantize = Fp8Dequantize(None)._dequantize_one
    except (ImportError, AttributeError, TypeError) as e:
        raise CheckpointError(f"an FP8 checkpoint is dequantized by transformers' own code, which this transformers "
                              f"lacks ({e}); pip install -U transformers") from None
    wname, wentry, sname, sentry = info["fp8"]
    weight = _raw(read_entry, wname, wentry, torch.uint8).view(torch.float8_e4m3fn)
    scales = _raw(read_entry, sname, sentry, _FP8_SCALES[sentry[1]["dtype"]])
    out.copy_(dequantize(weight, scales, output_dtype=torch.float32))


def _raw(read_entry, name: str, entry: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One of the file's tensors, its bytes as ``dtype`` (of the same size as what it stores)."""
    t = torch.empty(entry[1]["shape"], dtype=dtype)
    read_entry(name, (entry[0], dict(entry[1], torch_dtype=dtype), entry[2]), t)
    return t
