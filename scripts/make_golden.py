#!/usr/bin/env python3
"""Golden fixtures from Hugging Face transformers' own Qwen3.5 implementation.

For each tiny random configuration below this script builds the HF model, perturbs every
parameter so that no weight sits at a special value (zero-centred norms at 0, dt_bias at 1), saves
config.json + model.safetensors (F32) the way HF does (`save_pretrained`), and then, in float64 on
the CPU, runs every document separately through HF's forward and backward. It writes:

  docs.safetensors  doc{i}.input_ids  int64 [L_i]
  out.safetensors   doc{i}.logits     f32 [L_i, V]
                    doc{i}.loss_sum   f32 [1]   next-token cross-entropy summed over L_i - 1 targets
                    grad.<HF name>    f32       gradient of sum_i loss_sum_i / sum_i (L_i - 1)

`gdntrain dump --model DIR --docs docs.safetensors --out X.safetensors` packs the same documents
into one batch and must reproduce out.safetensors (tests/model/test_golden.cpp checks it in CI).

Precision: HF's code casts to float32 in several places even in a float64 model (its RMSNorms,
the gated norm, the gates, the torch gated-delta-rule fallback, the RoPE frequencies). While the
fixtures are computed, `Tensor.float()` / `Tensor.to(float32)` keep float64 tensors in float64 and
the RoPE inverse frequencies are recomputed in float64, so the fixtures are HF's own code evaluated
in float64 end to end (gdntrain's fp64 `ref` path then agrees to ~1e-10, its fp32 `cpu` path to
~1e-6).

Usage (needs torch and transformers >= 5.17; runs on CPU in under a minute):
  python3 scripts/make_golden.py tests/data/golden [NAME ...]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
from transformers import Qwen3_5Config, Qwen3_5TextConfig, Qwen3_5ForCausalLM

try:
    from transformers import Qwen3_5ForConditionalGeneration
except ImportError:  # pragma: no cover
    Qwen3_5ForConditionalGeneration = None

_ORIG_FLOAT = torch.Tensor.float
_ORIG_TO = torch.Tensor.to


def _float64_float(self, *args, **kwargs):
    if self.dtype == torch.float64:
        return self
    if not self.is_floating_point():  # integer positions, boolean masks: straight to float64
        return self.double()
    return _ORIG_FLOAT(self, *args, **kwargs)


def _float64_to(self, *args, **kwargs):
    if self.dtype == torch.float64:
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
    return _ORIG_TO(self, *args, **kwargs)


class float64_everywhere:
    """Within the block, no float64 tensor is downcast to float32 by HF's internal upcasts."""

    def __enter__(self):
        torch.Tensor.float = _float64_float
        torch.Tensor.to = _float64_to

    def __exit__(self, *exc):
        torch.Tensor.float = _ORIG_FLOAT
        torch.Tensor.to = _ORIG_TO


def recompute_rope_float64(model, text_cfg):
    """HF builds inv_freq in float32; rebuild it in float64 with the same formula."""
    rp = text_cfg.rope_parameters
    dim = int(text_cfg.head_dim * rp.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    found = 0
    for mod in model.modules():
        if type(mod).__name__ == "Qwen3_5TextRotaryEmbedding":
            mod.inv_freq = inv.clone()
            mod.original_inv_freq = inv.clone()
            found += 1
    assert found == 1, found


TEXT_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,  # layers 0-2 GDN, layer 3 gated attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # r = 2
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)

CONFIGS = {
    # grouped heads r = 2, dk != dv, untied head, flat qwen3_5_text
    "r2_untied": dict(kind="text", text=dict(TEXT_BASE, tie_word_embeddings=False)),
    # r = 1, tied head, attention with GQA 4/1, layer_types given explicitly
    "r1_tied": dict(kind="text", text=dict(
        TEXT_BASE, tie_word_embeddings=True, linear_num_value_heads=2, linear_value_head_dim=8,
        num_key_value_heads=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    # nested multimodal layout (model.language_model.* + a tiny vision tower kept untouched)
    "nested_vl": dict(kind="vl", text=dict(TEXT_BASE, tie_word_embeddings=False)),
    # r = 2 with HF's default initializer_range 0.02: a well-conditioned net. The fixtures above use
    # 0.2, which amplifies rounding through the layers ~10^3-fold (fine for fp64/fp32 checks, too
    # much for bf16); the cuda (bf16) golden test uses this one.
    "r2_std_init": dict(kind="text", text=dict(TEXT_BASE, tie_word_embeddings=False,
                                               initializer_range=0.02)),
    # Qwen3.5's production head dims on a tiny hidden size (issue 21): attention hd 256 (rotary
    # dim 64), GDN dk = dv = 128 with r = 2, so that the cuda golden test runs the kernels that
    # production shapes run (the fast GDR route's constant-shape kernels, the hd-256 attention).
    "prod_dims": dict(kind="text", text=dict(
        TEXT_BASE, tie_word_embeddings=False, initializer_range=0.02, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=2)),
}

# Documents per configuration: a 1-token document, a document longer than a 64-token chunk, and
# lengths that are not multiples of anything.
DOC_LENGTHS = [5, 1, 70, 13]


def build(name, spec):
    torch.manual_seed(1234 + sum(map(ord, name)))
    if spec["kind"] == "text":
        cfg = Qwen3_5TextConfig(**spec["text"])
        cfg._attn_implementation = "eager"
        model = Qwen3_5ForCausalLM(cfg)
        text_cfg = cfg
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, in_channels=3,
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                      out_hidden_size=spec["text"]["hidden_size"], num_position_embeddings=16)
        cfg = Qwen3_5Config(text_config=dict(spec["text"]), vision_config=vision,
                            tie_word_embeddings=spec["text"]["tie_word_embeddings"])
        cfg._attn_implementation = "eager"
        cfg.text_config._attn_implementation = "eager"
        model = Qwen3_5ForConditionalGeneration(cfg)
        text_cfg = cfg.text_config
    model = model.float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model, text_cfg


def run_docs(model, text_cfg, docs):
    model.double().eval()  # eval: no dropout (there is none); gradients still flow
    recompute_rope_float64(model, text_cfg)
    model.zero_grad(set_to_none=True)
    total_targets = sum(len(d) - 1 for d in docs)
    out = {}
    losses = []
    for i, ids in enumerate(docs):
        logits = model(input_ids=ids[None, :]).logits[0]  # [L, V] float64
        out[f"doc{i}.logits"] = logits.detach().float()
        if len(ids) > 1:
            loss_sum = F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")
        else:
            loss_sum = logits.sum() * 0.0
        out[f"doc{i}.loss_sum"] = loss_sum.detach().float().reshape(1)
        losses.append(loss_sum)
    total = torch.stack(losses).sum() / total_targets
    total.backward()
    return out


def main(out_root, only=None):
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, spec in CONFIGS.items():
        if only and name not in only:
            continue
        d = os.path.join(out_root, name)
        os.makedirs(d, exist_ok=True)
        model, text_cfg = build(name, spec)
        model.save_pretrained(d, safe_serialization=True)
        # Reload what was written so the golden run uses exactly the saved F32 weights.
        sd_names = {n for n, _ in model.named_parameters()}
        vocab = text_cfg.vocab_size
        g = torch.Generator().manual_seed(99)
        docs = [torch.randint(0, vocab, (n,), generator=g, dtype=torch.int64) for n in DOC_LENGTHS]
        with float64_everywhere():
            out = run_docs(model, text_cfg, docs)
        trained = 0
        for pname, p in model.named_parameters():
            if ".visual." in pname or pname.startswith("model.visual") or pname.startswith("mtp."):
                continue
            assert p.grad is not None, pname
            out[f"grad.{pname}"] = p.grad.detach().float().contiguous()
            trained += 1
        save_file({f"doc{i}.input_ids": t for i, t in enumerate(docs)},
                  os.path.join(d, "docs.safetensors"))
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(d, "out.safetensors"))
        losses = [float(out[f"doc{i}.loss_sum"]) for i in range(len(docs))]
        print(f"{name}: {trained} trained tensors, {len(sd_names)} parameters, loss_sum {losses}")
        with open(os.path.join(d, "README.md"), "w") as f:
            f.write(f"Golden fixture `{name}` written by scripts/make_golden.py with transformers "
                    f"{transformers.__version__} and torch {torch.__version__}.\n"
                    f"Documents of lengths {DOC_LENGTHS}; loss_sum per document {losses}.\n")


if __name__ == "__main__":
    # make_golden.py [OUT_ROOT [NAME ...]]: every configuration, or only the named ones.
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/golden", set(sys.argv[2:]))
