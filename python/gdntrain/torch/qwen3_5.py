"""apply_to_qwen3_5: gdntrain's kernels inside an HF transformers Qwen3.5 model, in place (the
role of liger_kernel.transformers.apply_liger_kernel_to_qwen3_5; docs/PYTHON.md).

What is swapped, per module instance (the module classes are untouched, so unpatched models in
the same process keep HF's code):
  * Qwen3_5RMSNorm (zero-centred: x * rstd * (1 + w))    -> rmsnorm(zero_centred=True)
  * Qwen3_5RMSNormGated (the GDN output norm)             -> gated_rmsnorm
  * Qwen3_5MLP: silu(gate_proj(x)) * up_proj(x)           -> swiglu
  * Qwen3_5GatedDeltaNet without a cache (training and prefill-free forward): the short conv and
    the delta rule -> causal_conv1d and chunk_gated_delta_rule, both honouring the documents of
    `cu_seq_lens_q` (packed sequences, B = 1), which HF's torch fallbacks ignore; with a cache
    (generation) HF's own forward runs.
  * Qwen3_5ForCausalLM with labels: the LM head and the loss -> linear_cross_entropy (logits are
    not materialised; `logits` is None in the output then, as with Liger).
The layout of every HF tensor stays as it is (gdn_spec.md §1.5): the projections, conv1d.weight
[C, 1, W], A_log, dt_bias, the [q | k | v] channel order.
"""
import types

import torch
import torch.nn.functional as F

from ._ops import causal_conv1d, chunk_gated_delta_rule, gated_rmsnorm, linear_cross_entropy
from ._ops import rmsnorm, swiglu


def _rmsnorm_forward(self, x):
    # HF Qwen3_5RMSNorm: fp32 norm, * (1 + w), cast back to x's dtype. The weight is used in x's
    # dtype (our op takes one dtype; the cuda kernel forms 1 + w in fp32 from it).
    return rmsnorm(x, self.weight.to(x.dtype), self.eps, zero_centred=True)


def _gated_norm_forward(self, hidden_states, gate):
    return gated_rmsnorm(hidden_states, gate.to(hidden_states.dtype),
                         self.weight.to(hidden_states.dtype), self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _gdn_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """HF Qwen3_5GatedDeltaNet.forward (modeling_qwen3_5.py) with our conv, delta rule and gated
    norm; the cached (generation) path is HF's."""
    if cache_params is not None:
        return self._gdntrain_hf_forward(hidden_states, cache_params=cache_params,
                                         attention_mask=attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 2:  # apply_mask_to_padding_states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    mixed_qkv = self.in_proj_qkv(hidden_states)  # [B, T, conv_dim], token-major as our conv
    z = self.in_proj_z(hidden_states).reshape(B, T, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    mixed_qkv, _ = causal_conv1d(mixed_qkv, self.conv1d.weight.to(mixed_qkv.dtype),
                                 None if self.conv1d.bias is None
                                 else self.conv1d.bias.to(mixed_qkv.dtype),
                                 activation=self.activation, cu_seqlens=cu_seqlens)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], -1)
    query = query.reshape(B, T, -1, self.head_k_dim)
    key = key.reshape(B, T, -1, self.head_k_dim)
    value = value.reshape(B, T, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    core, _ = chunk_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=cu_seqlens)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(B, T, -1))


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                       past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                       logits_to_keep=0, **kwargs):
    """HF Qwen3_5ForCausalLM.forward; with labels the loss is our fused linear cross-entropy
    (HF's ForCausalLMLoss semantics: labels shifted by one, ignore_index -100, mean over the
    valid targets or sum / num_items_in_batch when that is given)."""
    if labels is None and kwargs.get("shift_labels") is None:
        return self._gdntrain_hf_forward(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids,
                                         past_key_values=past_key_values,
                                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                                         logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    loss = _fused_loss(self, outputs.last_hidden_state, labels, shift_labels, num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)


def _fused_loss(self, hidden, labels, shift_labels, num_items):
    """HF's ForCausalLMLoss semantics (labels shifted by one, ignore_index -100, mean over the
    valid targets, or sum / num_items_in_batch when that is given) by our fused LM-head loss."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    w = self.lm_head.weight.to(hidden.dtype)
    if num_items is None:
        return linear_cross_entropy(hidden, w, shift_labels, reduction="mean")
    return linear_cross_entropy(hidden, w, shift_labels, reduction="sum") / num_items


def _conditional_generation_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                                    past_key_values=None, inputs_embeds=None, labels=None,
                                    logits_to_keep=0, **kwargs):
    """HF Qwen3_5ForConditionalGeneration.forward (the official Qwen3.5 checkpoints' class):
    with labels, the language model's last hidden states go to the fused loss instead of
    materialising [tokens, vocab] logits; the vision inputs (pixel_values, image_grid_thw, ...)
    pass through to self.model unchanged in **kwargs."""
    if labels is None and kwargs.get("shift_labels") is None:
        return self._gdntrain_hf_forward(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids,
                                         past_key_values=past_key_values,
                                         inputs_embeds=inputs_embeds,
                                         logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, **kwargs)
    loss = _fused_loss(self, outputs[0], labels, shift_labels, num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)


def _patch(module, fn):
    if not hasattr(module, "_gdntrain_hf_forward"):
        module._gdntrain_hf_forward = module.forward
    module.forward = types.MethodType(fn, module)


def apply_to_qwen3_5(model, rms_norm=True, gated_rms_norm=True, swiglu_mlp=True, gdn=True,
                     fused_linear_cross_entropy=True):
    """Swaps, in place, the kernels of an HF transformers Qwen3.5 model (Qwen3_5ForCausalLM or
    any module containing Qwen3.5 text modules) for gdntrain's; returns the model. Each flag turns
    one swap off. Idempotent. Raises TypeError for a model with no Qwen3.5 module."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    patched = 0
    for mod in model.modules():
        if rms_norm and isinstance(mod, hf.Qwen3_5RMSNorm):
            _patch(mod, _rmsnorm_forward)
        elif gated_rms_norm and isinstance(mod, hf.Qwen3_5RMSNormGated):
            if mod.activation not in ("silu", "swish"):
                raise ValueError(f"apply_to_qwen3_5: gated norm activation {mod.activation!r}")
            _patch(mod, _gated_norm_forward)
        elif swiglu_mlp and isinstance(mod, hf.Qwen3_5MLP):
            if mod.config.hidden_act not in ("silu", "swish"):
                raise ValueError(f"apply_to_qwen3_5: MLP activation {mod.config.hidden_act!r} "
                                 "is not silu")
            _patch(mod, _mlp_forward)
        elif gdn and isinstance(mod, hf.Qwen3_5GatedDeltaNet):
            if mod.activation not in ("silu", "swish"):
                raise ValueError(f"apply_to_qwen3_5: conv activation {mod.activation!r}")
            _patch(mod, _gdn_forward)
        elif fused_linear_cross_entropy and isinstance(mod, hf.Qwen3_5ForCausalLM):
            _patch(mod, _causal_lm_forward)
        elif fused_linear_cross_entropy and isinstance(mod, hf.Qwen3_5ForConditionalGeneration):
            _patch(mod, _conditional_generation_forward)
        else:
            continue
        patched += 1
    if patched == 0 and not any(type(m).__module__ == hf.__name__ for m in model.modules()):
        raise TypeError(f"apply_to_qwen3_5: {type(model).__name__} has no Qwen3.5 module")
    return model
