"""gdntrain's kernels as PyTorch custom ops (torch.library), on CPU and CUDA tensors.

Backends follow the tensors: float32 on CPU runs gdntrain's `cpu` backend, float64 on CPU its
fp64 `ref` backend (for gradcheck), bfloat16 on CUDA its `cuda` backend on the current stream.
Other combinations raise TypeError naming the op, the argument and the dtype. See docs/PYTHON.md.
"""
from ._ops import (LinearCrossEntropyLoss, causal_conv1d, chunk_gated_delta_rule, gated_rmsnorm,
                   linear_cross_entropy, rmsnorm, swiglu)
from .qwen3_5 import apply_to_qwen3_5

__all__ = ["rmsnorm", "gated_rmsnorm", "swiglu", "causal_conv1d", "chunk_gated_delta_rule",
           "linear_cross_entropy", "LinearCrossEntropyLoss", "apply_to_qwen3_5"]
