#!/usr/bin/env python
"""Hugging Face architectures through the engine, each against plain PyTorch, bitwise.

Every architecture below is built tiny (width 32, 3-8 layers, its own mechanisms on: relative
attention, rotary, ALiBi, sliding windows, MoE routers, state-space layers, two towers, an
encoder-decoder's two stacks, a vision tower before a language model) and trained 3 steps of 2 micro-batches with AdamW and clipping,
state on disk at 0.4 of 16 bytes per parameter, once per activation mode (``recompute``, ``keep``,
``offload``) and per way of running the micro-batches (the loop of ``engine.backward``, and
``engine.forward_backward``). Each run must give PyTorch's losses and weights bit for bit (the
harness of ``tests/test_finetune.py::check_parity``), or be refused with a typed error where this
list expects one. It takes about five minutes on a 2-core machine (342 runs), so the suite runs a
few of these models (``tests/test_finetune.py``, ``tests/test_conformance.py``) and this sweep is the
long check, for a new PyTorch or transformers version:

    python tools/conformance_sweep.py                         # every architecture, every mode
    python tools/conformance_sweep.py --only deberta-v2,t5 --modes recompute

With ``--export``, each architecture's export instead: ``engine.export_safetensors`` of the model's
weights against ``save_pretrained`` of the same model (every tensor, its name and bits), then
``from_pretrained`` and ``init_from`` of the export (every parameter back):

    python tools/conformance_sweep.py --export

``--twice`` makes each loss the mean of two forwards before one backward (the batch and its
sequences reversed: DPO's chosen and rejected), so every block is called twice before its backward
(the loop of backwards only); ``--autocast`` runs the forwards and losses under bf16 autocast:

    python tools/conformance_sweep.py --twice --autocast --modes recompute,keep

Prints a line per run and a summary; exits 1 if any run was neither bitwise nor the refusal expected.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

V = 64  # the tests' vocabulary (test_finetune.VOCAB)


def _lm(model, ids, route=None):
    return model(input_ids=ids, labels=ids).loss


def _pixels(ids):
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(ids.shape[0], 3, 16, 16, generator=g)


def _clip(model, ids, route=None):
    return model(input_ids=ids, pixel_values=_pixels(ids), return_loss=True).loss


def _vit(model, ids, route=None):
    return model(pixel_values=_pixels(ids), labels=ids[:, 0] % 5).loss


def _whisper(model, ids, route=None):
    g = torch.Generator().manual_seed(int(ids.sum()))
    return model(input_features=torch.randn(ids.shape[0], 8, 32, generator=g), labels=ids).loss


IMAGE = V - 4  # the vision-language models' image token (and the three after it: video, vision start and end)


def _llava(model, ids, route=None):
    """16 image tokens (a 16x16 image in 4x4 patches) before the text; no loss on them."""
    ids = ids % IMAGE
    full = torch.cat([torch.full((ids.shape[0], 16), IMAGE), ids], 1)
    return model(input_ids=full, pixel_values=_pixels(ids), labels=full.masked_fill(full == IMAGE, -100)).loss


def _qwen_vl(model, ids, route=None):
    """An image of 4x4 patches merged 2x2 (4 image tokens), between its start and end tokens."""
    ids, b = ids % IMAGE, ids.shape[0]
    full = torch.cat([torch.full((b, 1), IMAGE + 2), torch.full((b, 4), IMAGE), torch.full((b, 1), IMAGE + 3), ids], 1)
    g = torch.Generator().manual_seed(int(ids.sum()))
    return model(input_ids=full, pixel_values=torch.randn(b * 16, 24, generator=g),
                 image_grid_thw=torch.tensor([[1, 4, 4]] * b), mm_token_type_ids=(full == IMAGE).long(),
                 labels=full.masked_fill(full >= IMAGE, -100)).loss


def _gemma3_vl(model, ids, route=None):
    """A 16x16 image pooled to 4 tokens, between its start and end tokens."""
    ids, b = ids % IMAGE, ids.shape[0]
    full = torch.cat([torch.full((b, 1), IMAGE + 2), torch.full((b, 4), IMAGE), torch.full((b, 1), IMAGE + 3), ids], 1)
    return model(input_ids=full, pixel_values=_pixels(ids), token_type_ids=(full == IMAGE).long(),
                 labels=full.masked_fill(full >= IMAGE, -100)).loss


def _mllama(model, ids, route=None):
    """One image of one tile, which every text token attends to in the cross-attention layers."""
    ids, b = ids % IMAGE, ids.shape[0]
    full = torch.cat([torch.full((b, 1), IMAGE), ids], 1)
    return model(input_ids=full, pixel_values=_pixels(ids)[:, None, None], labels=full.masked_fill(full == IMAGE, -100),
                 aspect_ratio_ids=torch.ones(b, 1, dtype=torch.long),
                 aspect_ratio_mask=torch.ones(b, 1, 1, dtype=torch.long),
                 cross_attention_mask=torch.ones(b, full.shape[1], 1, 1, dtype=torch.long)).loss


def _classify(model, ids, route=None):
    return model(input_ids=ids, attention_mask=(ids > 3).long(), labels=ids[:, 0] % 3).loss


def cases() -> dict:
    """name -> (transformers' config class name, model class name, config keywords, loss, the
    refusal expected or None)."""
    nc = dict(use_cache=False)  # the engine trains with the key/value cache off; so does the reference
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, **nc)
    enc = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
               max_position_embeddings=32)
    s2s = dict(vocab_size=V, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, **nc)
    t5 = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, decoder_start_token_id=0, **nc)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    lin = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    mla_moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                   n_group=1, topk_group=1)
    mla = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    out = {
        # decoder-only
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(small, tie_word_embeddings=False)),
        "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(small, tie_word_embeddings=True)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", small),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(small, head_dim=8)),
        "mistral": ("MistralConfig", "MistralForCausalLM", small),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(small, head_dim=8)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(small, head_dim=8, sliding_window=4)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(small, head_dim=8, sliding_window=4)),
        "phi": ("PhiConfig", "PhiForCausalLM", small),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(small, pad_token_id=0)),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM", small),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", small),
        "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", small),
        "granite": ("GraniteConfig", "GraniteForCausalLM", small),
        "cohere": ("CohereConfig", "CohereForCausalLM", small),
        "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", small),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4, n_positions=32, **nc)),
        "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(enc, num_hidden_layers=4, **nc)),
        "gpt-neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(vocab_size=V, hidden_size=32, num_layers=4, num_heads=4,
                                                              attention_types=[[["global", "local"], 2]], window_size=4,
                                                              max_position_embeddings=32, **nc)),
        "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                                                       rotary_dim=4, **nc)),
        "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4,
                                                                n_positions=32, rotary_dim=4, **nc)),
        "gpt-bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4,
                                                                          n_positions=32, **nc)),
        "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=6,
                                                    num_attention_heads=4, max_position_embeddings=32,
                                                    word_embed_proj_dim=32, layerdrop=0.5, **nc)),
        "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
                                                             num_attention_heads=4, **nc)),
        "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=32, n_layer=4, n_head=4, **nc)),
        "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=V, d_model=32, n_layers=4, n_heads=4, max_seq_len=32,
                                                    **nc)),
        "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(vocab_size=V, d_model=32, num_layers=4, attention_heads=4,
                                                       ffn_dim=64, max_position_embeddings=32, **nc)),
        "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(enc, num_hidden_layers=4, hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0, **nc)),
        "xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(vocab_size=V, d_model=32, n_layer=4, n_head=4, d_inner=64,
                                                          dropout=0.0, use_mems_train=False)),
        # recent decoders (2025-2026): hybrid linear attention, per-layer inputs, convolutions, MLA
        "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(small, head_dim=8, global_head_dim=8, sliding_window=4,
                                                                 vocab_size_per_layer_input=V,
                                                                 hidden_size_per_layer_input=8)),
        "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(small, head_dim=8, **lin, **moe,
                                                                       shared_expert_intermediate_size=16)),
        "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(small, head_dim=8, **lin)),
        "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(small, sliding_window=4)),
        "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(small, pad_token_id=0)),
        "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(small, head_dim=8, pad_token_id=0)),
        "ernie4.5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(small, head_dim=8)),
        "seed-oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(small, head_dim=8)),
        "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(small, sliding_window=4)),
        "falcon-h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(small, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
                                                                    mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                                                                    mamba_chunk_size=8)),
        "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(small, layer_types=["conv", "full_attention"] * 2)),
        "apertus": ("ApertusConfig", "ApertusForCausalLM", small),
        "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(small, head_dim=8)),
        "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(small, sliding_window=4)),
        "bitnet": ("BitNetConfig", "BitNetForCausalLM", small),
        "arcee": ("ArceeConfig", "ArceeForCausalLM", small),
        "nemotron": ("NemotronConfig", "NemotronForCausalLM", small),
        # mixtures of experts
        "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(small, head_dim=8, num_local_experts=4,
                                                              num_experts_per_tok=2, sliding_window=4,
                                                              layer_types=["sliding_attention", "full_attention"] * 2)),
        "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(small, head_dim=8, **mla_moe)),
        "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(small, num_key_value_heads=4, **mla_moe,
                                                                          **mla)),
        "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(small, num_key_value_heads=4, **mla_moe,
                                                                          **mla)),
        "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(small, n_shared_experts=1, **mla_moe)),
        "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
            small, num_hidden_layers=8, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
            intermediate_size_mlp=64, interleave_moe_layer_step=2)),
        "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(small, num_local_experts=4,
                                                                         num_experts_per_tok=2)),
        "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
            small, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4,
            layer_types=["linear_attention", "full_attention"] * 2)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(small, num_experts=4, num_experts_per_tok=2)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(small, num_local_experts=4, num_experts_per_tok=2,
                                                                output_router_logits=True)),
        "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(small, moe_intermediate_size=16, num_experts=4,
                                                                    shared_expert_intermediate_size=32,
                                                                    num_experts_per_tok=2)),
        "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(small, head_dim=8, moe_intermediate_size=16,
                                                                    num_experts=4, num_experts_per_tok=2)),
        # state-space and recurrent layers
        "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=V, hidden_size=32, state_size=8,
                                                          num_hidden_layers=4, expand=2, conv_kernel=4, **nc)),
        "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
                                                             state_size=8, expand=2, num_heads=8, head_dim=8, n_groups=1,
                                                             chunk_size=8, **nc)),
        "falcon-mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(vocab_size=V, hidden_size=32, state_size=8,
                                                                             num_hidden_layers=4, expand=2, **nc)),
        "jamba": ("JambaConfig", "JambaForCausalLM", dict(small, num_experts=2, num_experts_per_tok=1,
                                                          expert_layer_period=2, attn_layer_period=2, attn_layer_offset=1,
                                                          mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)),
        "rwkv": ("RwkvConfig", "RwkvForCausalLM", dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
                                                       attention_hidden_size=32, intermediate_size=64, context_length=32,
                                                       **nc)),
        # encoders
        "bert": ("BertConfig", "BertForMaskedLM", enc),
        "bert-classifier": ("BertConfig", "BertForSequenceClassification", dict(enc, num_labels=3), _classify),
        "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(enc, max_position_embeddings=40, pad_token_id=1)),
        "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(enc, embedding_size=16)),
        "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(vocab_size=V, dim=32, hidden_dim=64,
                                                                         n_layers=6, n_heads=4,
                                                                         max_position_embeddings=32)),
        "mpnet": ("MPNetConfig", "MPNetForMaskedLM", dict(enc, num_hidden_layers=4, max_position_embeddings=40)),
        "deberta": ("DebertaConfig", "DebertaForMaskedLM", dict(enc, num_hidden_layers=4, relative_attention=True,
                                                                pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
                                                                attention_probs_dropout_prob=0.0)),
        "deberta-v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(enc, relative_attention=True, position_buckets=8,
                                                                       pos_att_type=["p2c", "c2p"])),
        "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(enc, embedding_size=16), _lm, "ModelStructureError"),
        "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                                               num_attention_heads=4, image_size=16, patch_size=4,
                                                               num_labels=5), _vit),
        # two towers, encoder-decoders
        "clip": ("CLIPConfig", "CLIPModel", dict(
            text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, max_position_embeddings=32),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                               image_size=16, patch_size=4), projection_dim=16), _clip),
        # vision-language: a vision tower's blocks and the language model's
        "llava": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=3, num_attention_heads=4, image_size=16, patch_size=4),
            text_config=dict(small, model_type="llama", max_position_embeddings=64), image_token_index=IMAGE,
            vision_feature_layer=-2, image_seq_length=16), _llava),
        **{name: (f"{cls}Config", f"{cls}ForConditionalGeneration", dict(
            text_config=dict(small, max_position_embeddings=64,
                             rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=1e4)),
            vision_config=dict(depth=3, embed_dim=32, hidden_size=32, num_heads=4, patch_size=2, spatial_merge_size=2,
                               temporal_patch_size=2, **extra),
            image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2,
            vision_end_token_id=IMAGE + 3, **nc), _qwen_vl)
           for name, cls, extra in [("qwen2-vl", "Qwen2VL", {}),
                                    ("qwen2.5-vl", "Qwen2_5_VL", dict(out_hidden_size=32, intermediate_size=64,
                                                                      fullatt_block_indexes=[2], window_size=4))]},
        "gemma3-vl": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
            text_config=dict(small, head_dim=8, sliding_window=4, max_position_embeddings=64),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                               image_size=16, patch_size=4),
            mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=IMAGE + 2, eoi_token_index=IMAGE + 3),
            _gemma3_vl),
        "mllama": ("MllamaConfig", "MllamaForConditionalGeneration", dict(
            vision_config=dict(image_size=16, patch_size=4, num_hidden_layers=3, num_global_layers=2,
                               intermediate_layers_indices=[0, 2], max_num_tiles=1, vision_output_dim=96,
                               hidden_size=32, intermediate_size=64, attention_heads=4,
                               supported_aspect_ratios=[[1, 1]]),
            text_config=dict(small, num_hidden_layers=5, cross_attention_layers=[1, 3], max_position_embeddings=64,
                             pad_token_id=0),
            image_token_index=IMAGE), _mllama),
        "t5": ("T5Config", "T5ForConditionalGeneration", t5),
        "t5-gated": ("T5Config", "T5ForConditionalGeneration", dict(t5, feed_forward_proj="gated-gelu")),
        "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", t5),
        "switch": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
                   dict(t5, num_decoder_layers=4, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2,
                        pad_token_id=0, dropout_rate=0.0)),
        "bart": ("BartConfig", "BartForConditionalGeneration", dict(s2s, encoder_layerdrop=0.5, decoder_layerdrop=0.5)),
        "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(s2s, dropout=0.0)),
        "marian": ("MarianConfig", "MarianMTModel", dict(s2s, decoder_start_token_id=0, pad_token_id=0, dropout=0.0)),
        "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", dict(s2s, decoder_start_token_id=0)),
        "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
            vocab_size=V, d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
            max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            suppress_tokens=[], begin_suppress_tokens=[], **nc), _whisper),
    }
    full = {}
    for name, (config_cls, model_cls, kwargs, *rest) in out.items():  # the loss and refusal are optional
        full[name] = (config_cls, model_cls, kwargs, rest[0] if rest else _lm, rest[1] if len(rest) > 1 else None)
    return full


def _pytorch_fails(make, loss, habits) -> str:
    """Why PyTorch itself cannot run a step of ``make()`` with ``habits`` ("": it can): a model
    whose forward overflows bf16 under autocast, say. Such a run is no test of the engine."""
    from test_finetune import batches
    model = make()
    ids = batches(1, 1)[0][0][0]
    try:
        with habits.forward():
            loss_value = habits.loss(loss, model, ids, None)
        loss_value.backward()
    except Exception as e:  # (whatever PyTorch raises)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return ""


def _export_differs(make, optimizer, d: Path, cls) -> str:
    """How the engine's export of ``make()``'s weights differs from ``save_pretrained``'s ("": not),
    and whether ``from_pretrained`` reads it back."""
    from safetensors.torch import load_file

    from tiered_offload import Engine

    def tensors(directory: Path) -> dict:
        out = {}
        for f in sorted(directory.glob("*.safetensors")):
            out.update(load_file(f))
        return out
    model = make()
    model.save_pretrained(d / "hf")
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = 16 * sum(p.numel() for p in model.parameters())
    model = make()
    with Engine(model, optimizer(model), storage=d / "s", host_memory=int(0.4 * state)) as engine:
        engine.export_safetensors(d / "ours")
    expected, got = tensors(d / "hf"), tensors(d / "ours")
    if set(got) != set(expected):
        return (f"names: only the export's {sorted(set(got) - set(expected))[:3]}, only save_pretrained's "
                f"{sorted(set(expected) - set(got))[:3]}")
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    if differ:
        return f"values differ: {differ[:3]}"
    loaded = dict(cls.from_pretrained(d / "ours").named_parameters())
    back = [k for k, w in weights.items() if k not in loaded or not torch.equal(loaded[k], w)]
    if back:
        return f"from_pretrained gives other values: {back[:3]}"
    model = make()
    unsaved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    with torch.no_grad():  # other values than the file's: each must be read from it (but the ones not saved)
        for k, p in model.named_parameters():
            p.add_(0 if k in unsaved else 1)
    with Engine(model, optimizer(model), storage=d / "again", host_memory=int(0.4 * state), init_from=d / "ours") as engine:
        again = dict(engine.named_parameters())
    back = [k for k, w in weights.items() if k not in again or not torch.equal(again[k], w)]
    return f"init_from reads other values: {back[:3]}" if back else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated architectures (default: all)")
    ap.add_argument("--modes", default="recompute,keep,offload", help="comma-separated activation modes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--export", action="store_true", help="each architecture's export against save_pretrained's")
    ap.add_argument("--twice", action="store_true", help="two forwards before each backward (the loop only)")
    ap.add_argument("--autocast", action="store_true", help="the forwards and losses under bf16 autocast")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers as T
    from test_finetune import Habits, check_parity
    from tiered_offload import EngineConfig
    from tiered_offload.errors import TieredOffloadError

    table = cases()
    names = [n for n in args.only.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown architectures {unknown}; known: {', '.join(table)}")
    tally = {"bitwise": 0, "refused as expected": 0, "architectures PyTorch itself fails": 0, "FAILED": 0}
    t0 = time.perf_counter()
    for name in names:
        config_cls, model_cls, kwargs, loss, refusal = table[name]

        def make():
            torch.manual_seed(0)
            return getattr(T, model_cls)(getattr(T, config_cls)(**kwargs))

        def optimizer(model):
            return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if args.export:
            with tempfile.TemporaryDirectory(prefix=".sweep-", dir=ROOT, ignore_cleanup_errors=True) as d:
                try:
                    why = _export_differs(make, optimizer, Path(d), getattr(T, model_cls))
                    result = "FAILED" if why or refusal is not None else "bitwise"
                except TieredOffloadError as e:
                    result = "refused as expected" if type(e).__name__ == refusal else "FAILED"
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            tally[result] += 1
            print(f"{name:16s} export    {result}{'  ' + why if why else ''}", flush=True)
            continue
        habits = Habits(twice=args.twice, autocast=args.autocast)
        fails = _pytorch_fails(make, loss, habits) if args.twice or args.autocast else ""
        if fails:
            tally["architectures PyTorch itself fails"] += 1
            print(f"{name:16s} PyTorch itself fails with these habits (not run): {fails}", flush=True)
            continue
        for mode in args.modes.split(","):
            for fused in (False,) if args.twice else (False, True):
                how = "forward_backward" if fused else "loop"
                with tempfile.TemporaryDirectory(prefix=".sweep-", dir=ROOT, ignore_cleanup_errors=True) as d:
                    try:
                        check_parity(make, optimizer, Path(d), loss_fn=loss, steps=args.steps, accumulate=2, clip=1.0,
                                     host_fraction=0.4, config=EngineConfig(activations=mode), fused=fused,
                                     habits=habits)
                        result = "bitwise" if refusal is None else "FAILED"
                        why = "" if refusal is None else f"trained where {refusal} was expected"
                    except TieredOffloadError as e:
                        result = "refused as expected" if type(e).__name__ == refusal else "FAILED"
                        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    except AssertionError as e:
                        result, why = "FAILED", str(e).splitlines()[0][:160]
                tally[result] += 1
                print(f"{name:16s} {mode:9s} {how:16s} {result}{'  ' + why if why else ''}", flush=True)
    runs = sum(n for k, n in tally.items() if not k.startswith("architectures"))
    print(f"{len(names)} architectures, {runs} runs in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{n} {k}" for k, n in tally.items()))
    return 1 if tally["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
