"""The custom ops: torch.library definitions calling gdntrain._C (docs/PYTHON.md).

Each op is a pair of custom ops, forward and backward, that allocate their outputs with torch and
hand libgdn views of them (_view); register_fake gives torch.compile their output shapes, and
register_autograd connects the pair. The public functions at the end check dtypes and devices
(_backend) and reshape to the layouts of src/ops/*/op.h.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
                torch.int32: "I32", torch.int64: "I64"}


def _view(t: Optional[Tensor]):
    """A (ptr, dtype, shape, device) tuple for _C (None stays None). `t` must be contiguous, and
    the caller must hold a reference to it until _C returns: the tuple does not keep it alive
    (so never _view(t.contiguous()) inline)."""
    if t is None:
        return None
    assert t.is_contiguous(), "gdntrain internal: a view of a non-contiguous tensor"
    dev = -1 if t.device.type == "cpu" else t.device.index
    return (t.data_ptr(), _DTYPE_NAMES[t.dtype], list(t.shape), dev)


def _where(t: Tensor) -> Tuple[int, int]:
    """(device index or -1 for the host, current CUDA stream handle or 0) for _C."""
    if t.device.type == "cpu":
        return -1, 0
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


def _stat_dtype(t: Tensor) -> torch.dtype:
    """rstd / weight-gradient dtype of src/ops: float64 on ref, float32 on cpu and cuda."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _backend(op: str, **tensors) -> None:
    """Checks that the float tensors select one gdntrain backend: float32 or float64 on CPU,
    bfloat16 on CUDA, all of one dtype and device. Raises TypeError naming op, argument, dtype."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"gdntrain.{op}: argument '{name}' must be a torch.Tensor, "
                            f"got {type(t).__name__}")
        ok = ((t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64))
              or (t.device.type == "cuda" and t.dtype == torch.bfloat16))
        if not ok:
            raise TypeError(f"gdntrain.{op}: argument '{name}' has dtype {t.dtype} on "
                            f"{t.device.type}; supported: float32 (cpu backend) or float64 (ref "
                            "backend) on CPU, bfloat16 on CUDA (cuda backend)")
        if first is None:
            first = (name, t)
        elif t.dtype != first[1].dtype or t.device != first[1].device:
            raise TypeError(f"gdntrain.{op}: argument '{name}' is {t.dtype} on {t.device} but "
                            f"'{first[0]}' is {first[1].dtype} on {first[1].device}; all must "
                            "match")


def _shape_error(op: str, msg: str):
    return ValueError(f"gdntrain.{op}: {msg}")


# --- rmsnorm ----------------------------------------------------------------------------------

@torch.library.custom_op("gdntrain::rmsnorm_fwd", mutates_args=())
def _rmsnorm_fwd(x: Tensor, w: Tensor, eps: float, zero_centred: bool) -> Tuple[Tensor, Tensor]:
    x, w = x.contiguous(), w.contiguous()
    x2 = x.view(-1, x.shape[-1])
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=_stat_dtype(x), device=x.device)
    _C.rmsnorm_forward(_view(x2), _view(w), _view(y), _view(rstd), eps, zero_centred, *_where(x))
    return y.view(x.shape), rstd


@_rmsnorm_fwd.register_fake
def _(x, w, eps, zero_centred):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=_stat_dtype(x))


@torch.library.custom_op("gdntrain::rmsnorm_bwd", mutates_args=())
def _rmsnorm_bwd(dy: Tensor, x: Tensor, w: Tensor, rstd: Tensor,
                 zero_centred: bool) -> Tuple[Tensor, Tensor]:
    x, w, dy = x.contiguous(), w.contiguous(), dy.contiguous()
    x2, dy2 = x.view(-1, x.shape[-1]), dy.view(-1, x.shape[-1])
    dx = torch.empty_like(x2)
    dw = torch.zeros(w.shape, dtype=_stat_dtype(x), device=x.device)  # accumulated (+=)
    _C.rmsnorm_backward(_view(x2), _view(w), _view(rstd), _view(dy2), _view(dx), _view(dw),
                        zero_centred, *_where(x))
    return dx.view(x.shape), dw


@_rmsnorm_bwd.register_fake
def _(dy, x, w, rstd, zero_centred):
    return torch.empty_like(x), w.new_empty(w.shape, dtype=_stat_dtype(x))


def _rmsnorm_setup(ctx, inputs, output):
    x, w, _, zero_centred = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.zero_centred = zero_centred


def _rmsnorm_grad(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = _rmsnorm_bwd(dy, x, w, rstd, ctx.zero_centred)
    return dx, dw.to(w.dtype), None, None


_rmsnorm_fwd.register_autograd(_rmsnorm_grad, setup_context=_rmsnorm_setup)


# --- gated_rmsnorm ----------------------------------------------------------------------------

@torch.library.custom_op("gdntrain::gated_rmsnorm_fwd", mutates_args=())
def _gated_rmsnorm_fwd(x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x, z, w = x.contiguous(), z.contiguous(), w.contiguous()
    x2, z2 = x.view(-1, x.shape[-1]), z.view(-1, x.shape[-1])
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=_stat_dtype(x), device=x.device)
    _C.gated_rmsnorm_forward(_view(x2), _view(z2), _view(w), _view(y), _view(rstd), eps,
                             *_where(x))
    return y.view(x.shape), rstd


@_gated_rmsnorm_fwd.register_fake
def _(x, z, w, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=_stat_dtype(x))


@torch.library.custom_op("gdntrain::gated_rmsnorm_bwd", mutates_args=())
def _gated_rmsnorm_bwd(dy: Tensor, x: Tensor, z: Tensor, w: Tensor,
                       rstd: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    x, z, w, dy = x.contiguous(), z.contiguous(), w.contiguous(), dy.contiguous()
    d = x.shape[-1]
    x2, z2, dy2 = x.view(-1, d), z.view(-1, d), dy.view(-1, d)
    dx, dz = torch.empty_like(x2), torch.empty_like(z2)
    dw = torch.zeros(w.shape, dtype=_stat_dtype(x), device=x.device)  # accumulated (+=)
    _C.gated_rmsnorm_backward(_view(x2), _view(z2), _view(w), _view(rstd), _view(dy2), _view(dx),
                              _view(dz), _view(dw), *_where(x))
    return dx.view(x.shape), dz.view(x.shape), dw


@_gated_rmsnorm_bwd.register_fake
def _(dy, x, z, w, rstd):
    return torch.empty_like(x), torch.empty_like(z), w.new_empty(w.shape, dtype=_stat_dtype(x))


def _gated_rmsnorm_setup(ctx, inputs, output):
    x, z, w, _ = inputs
    ctx.save_for_backward(x, z, w, output[1])


def _gated_rmsnorm_grad(ctx, dy, _drstd):
    x, z, w, rstd = ctx.saved_tensors
    dx, dz, dw = _gated_rmsnorm_bwd(dy, x, z, w, rstd)
    return dx, dz, dw.to(w.dtype), None


_gated_rmsnorm_fwd.register_autograd(_gated_rmsnorm_grad, setup_context=_gated_rmsnorm_setup)


# --- swiglu -----------------------------------------------------------------------------------

@torch.library.custom_op("gdntrain::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    d = gate.shape[-1]
    g2, u2 = gate.view(-1, d), up.view(-1, d)
    y = torch.empty_like(g2)
    _C.swiglu_forward(_view(g2), _view(u2), _view(y), *_where(gate))
    return y.view(gate.shape)


@_swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("gdntrain::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    d = gate.shape[-1]
    g2, u2, dy2 = gate.view(-1, d), up.view(-1, d), dy.view(-1, d)
    dgate, dup = torch.empty_like(g2), torch.empty_like(u2)
    _C.swiglu_backward(_view(g2), _view(u2), _view(dy2), _view(dgate), _view(dup),
                       *_where(gate))
    return dgate.view(gate.shape), dup.view(gate.shape)


@_swiglu_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_bwd(dy, gate, up)


_swiglu_fwd.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# --- causal_conv1d ----------------------------------------------------------------------------

def _conv_state_shape(x: Tensor, w: Tensor, n: int):
    return (n, x.shape[-1], w.shape[-1] - 1)


@torch.library.custom_op("gdntrain::causal_conv1d_fwd", mutates_args=())
def _causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], cu_seqlens: Tensor,
                       initial_state: Optional[Tensor], silu: bool,
                       output_final_state: bool) -> Tuple[Tensor, Tensor]:
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    init = None if initial_state is None else initial_state.contiguous()
    cu = cu_seqlens.contiguous()
    n = cu_seqlens.shape[0] - 1
    y = torch.empty_like(x)
    final = (torch.empty(_conv_state_shape(x, weight, n), dtype=x.dtype, device=x.device)
             if output_final_state else x.new_empty(0))
    _C.causal_conv1d_forward(_view(x), _view(weight), _view(bias), _view(cu),
                             _view(init), _view(y), _view(final) if output_final_state else None,
                             silu, *_where(x))
    return y, final


@_causal_conv1d_fwd.register_fake
def _(x, weight, bias, cu_seqlens, initial_state, silu, output_final_state):
    n = cu_seqlens.shape[0] - 1
    final = (x.new_empty(_conv_state_shape(x, weight, n)) if output_final_state
             else x.new_empty(0))
    return torch.empty_like(x), final


@torch.library.custom_op("gdntrain::causal_conv1d_bwd", mutates_args=())
def _causal_conv1d_bwd(dy: Tensor, dfinal_state: Optional[Tensor], x: Tensor, weight: Tensor,
                       bias: Optional[Tensor], cu_seqlens: Tensor,
                       initial_state: Optional[Tensor],
                       silu: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    x, weight, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    bias = None if bias is None else bias.contiguous()
    init = None if initial_state is None else initial_state.contiguous()
    dfin = None if dfinal_state is None else dfinal_state.contiguous()
    cu = cu_seqlens.contiguous()
    gdt = _stat_dtype(x)
    dx = torch.empty_like(x)
    dweight = torch.zeros(weight.shape, dtype=gdt, device=x.device)  # accumulated (+=)
    dbias = (torch.zeros(bias.shape, dtype=gdt, device=x.device) if bias is not None
             else x.new_empty(0, dtype=gdt))
    dinit = torch.empty_like(init) if init is not None else x.new_empty(0)
    _C.causal_conv1d_backward(_view(x), _view(weight), _view(bias),
                              _view(cu), _view(init), _view(dy), _view(dfin),
                              _view(dx), _view(dweight), _view(dbias) if bias is not None else None,
                              _view(dinit) if init is not None else None, silu, *_where(x))
    return dx, dweight, dbias, dinit


@_causal_conv1d_bwd.register_fake
def _(dy, dfinal_state, x, weight, bias, cu_seqlens, initial_state, silu):
    gdt = _stat_dtype(x)
    dbias = bias.new_empty(bias.shape, dtype=gdt) if bias is not None else x.new_empty(0, dtype=gdt)
    dinit = torch.empty_like(initial_state) if initial_state is not None else x.new_empty(0)
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=gdt), dbias, dinit


def _causal_conv1d_setup(ctx, inputs, output):
    x, weight, bias, cu_seqlens, initial_state, silu, output_final_state = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens, initial_state)
    ctx.silu = silu
    ctx.output_final_state = output_final_state


def _causal_conv1d_grad(ctx, dy, dfinal):
    x, weight, bias, cu_seqlens, initial_state = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    if not ctx.output_final_state:
        dfinal = None
    dx, dweight, dbias, dinit = _causal_conv1d_bwd(dy, dfinal, x, weight, bias, cu_seqlens,
                                                   initial_state, ctx.silu)
    return (dx, dweight.to(weight.dtype), None if bias is None else dbias.to(bias.dtype), None,
            None if initial_state is None else dinit, None, None)


_causal_conv1d_fwd.register_autograd(_causal_conv1d_grad, setup_context=_causal_conv1d_setup)


# --- public functions -------------------------------------------------------------------------

def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6, zero_centred: bool = False) -> Tensor:
    """RMSNorm over the last dim: x * rstd * w, or x * rstd * (1 + w) with zero_centred=True
    (Qwen3.5's Qwen3_5RMSNorm). x [..., D], weight [D]. src/ops/rmsnorm/op.h."""
    _backend("rmsnorm", x=x, weight=weight)
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise _shape_error("rmsnorm", f"weight {list(weight.shape)} must be [D] with D = the "
                           f"last dim of x {list(x.shape)}")
    return _rmsnorm_fwd(x, weight, float(eps), bool(zero_centred))[0]


def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Gated RMSNorm (HF Qwen3_5RMSNormGated, fla FusedRMSNormGated with swish): rmsnorm(x) * w
    * silu(gate), the norm over x alone, w plain (not zero-centred). x, gate [..., D], weight [D].
    src/ops/gated_rmsnorm/op.h."""
    _backend("gated_rmsnorm", x=x, gate=gate, weight=weight)
    if gate.shape != x.shape:
        raise _shape_error("gated_rmsnorm", f"gate {list(gate.shape)} must have x's shape "
                           f"{list(x.shape)}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise _shape_error("gated_rmsnorm", f"weight {list(weight.shape)} must be [D] with D = "
                           f"the last dim of x {list(x.shape)}")
    return _gated_rmsnorm_fwd(x, gate, weight, float(eps))[0]


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise (the MLP activation; Liger's LigerSiLUMulFunction).
    src/ops/swiglu/op.h."""
    _backend("swiglu", gate=gate, up=up)
    if gate.shape != up.shape or gate.dim() < 1:
        raise _shape_error("swiglu", f"gate {list(gate.shape)} and up {list(up.shape)} must have "
                           "one shape")
    return _swiglu_fwd(gate, up)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  activation: Optional[str] = "silu", cu_seqlens: Optional[Tensor] = None,
                  initial_state: Optional[Tensor] = None, output_final_state: bool = False):
    """Depthwise causal conv1d (the GDN short convolution), layout of fla's causal_conv1d:
    x [B, T, C] (token-major), weight [C, W] or HF's [C, 1, W], W in 1..8, bias [C].
    activation: "silu"/"swish" or None. cu_seqlens [N+1] (B must be 1): packed documents, no
    output reads another document. initial_state [N, C, W-1] (N = B without cu_seqlens): the W-1
    inputs before each document, oldest first (HF's W-column conv cache is [:, :, 1:] of it).
    Returns (y [B, T, C], final_state [N, C, W-1] or None). src/ops/causal_conv1d/op.h."""
    op = "causal_conv1d"
    _backend(op, x=x, weight=weight, bias=bias, initial_state=initial_state)
    if activation not in (None, "silu", "swish"):
        raise _shape_error(op, f"activation must be 'silu', 'swish' or None, got {activation!r}")
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if x.dim() != 3:
        raise _shape_error(op, f"x must be [B, T, C], got {list(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise _shape_error(op, f"weight must be [C, W] with C = {C}, got {list(weight.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise _shape_error(op, f"with cu_seqlens x must be [1, T, C], got {list(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"gdntrain.{op}: argument 'cu_seqlens' must be a 1-D int32/int64 "
                            f"tensor, got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
        cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    else:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=x.device)
    y, final = _causal_conv1d_fwd(x.reshape(B * T, C), weight, bias, cu, initial_state,
                                  activation is not None, bool(output_final_state))
    return y.view(B, T, C), (final if output_final_state else None)


# --- chunk_gated_delta_rule -------------------------------------------------------------------

@torch.library.custom_op("gdntrain::gated_delta_rule_fwd", mutates_args=())
def _gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
             initial_state: Optional[Tensor], scale: float, use_qk_l2norm: bool,
             output_final_state: bool) -> Tuple[Tensor, Tensor]:
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.contiguous()
    cu = cu_seqlens.contiguous()
    n = cu_seqlens.shape[0] - 1
    o = torch.empty_like(v)
    hT = (torch.empty((n, v.shape[1], q.shape[2], v.shape[2]), dtype=g.dtype, device=q.device)
          if output_final_state else q.new_empty(0, dtype=g.dtype))
    _C.gated_delta_rule_forward(_view(q), _view(k), _view(v), _view(g), _view(beta),
                                _view(cu), _view(h0), _view(o),
                                _view(hT) if output_final_state else None, scale, use_qk_l2norm,
                                *_where(q))
    return o, hT


@_gdr_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, output_final_state):
    n = cu_seqlens.shape[0] - 1
    hT = (g.new_empty((n, v.shape[1], q.shape[2], v.shape[2])) if output_final_state
          else g.new_empty(0))
    return torch.empty_like(v), hT


@torch.library.custom_op("gdntrain::gated_delta_rule_bwd", mutates_args=())
def _gdr_bwd(do: Tensor, dhT: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor,
             beta: Tensor, cu_seqlens: Tensor, initial_state: Optional[Tensor], scale: float,
             use_qk_l2norm: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, g, beta, do = (t.contiguous() for t in (q, k, v, g, beta, do))
    h0 = None if initial_state is None else initial_state.contiguous()
    dhT = None if dhT is None else dhT.contiguous()
    cu = cu_seqlens.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    dh0 = torch.empty_like(h0) if h0 is not None else g.new_empty(0)
    _C.gated_delta_rule_backward(_view(q), _view(k), _view(v), _view(g), _view(beta),
                                 _view(cu), _view(h0), _view(do), _view(dhT),
                                 _view(dq), _view(dk), _view(dv), _view(dg), _view(dbeta),
                                 _view(dh0) if h0 is not None else None, scale, use_qk_l2norm,
                                 *_where(q))
    return dq, dk, dv, dg, dbeta, dh0


@_gdr_bwd.register_fake
def _(do, dhT, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else g.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _gdr_setup(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, initial_state, scale, l2, output_final_state = inputs
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
    ctx.scale, ctx.l2, ctx.output_final_state = scale, l2, output_final_state


def _gdr_grad(ctx, do, dhT):
    q, k, v, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state:
        dhT = None
    dq, dk, dv, dg, dbeta, dh0 = _gdr_bwd(do, dhT, q, k, v, g, beta, cu_seqlens, initial_state,
                                          ctx.scale, ctx.l2)
    return (dq, dk, dv, dg, dbeta, None, None if initial_state is None else dh0, None, None, None)


_gdr_fwd.register_autograd(_gdr_grad, setup_context=_gdr_setup)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[Tensor] = None):
    """The gated delta rule with fla's signature and layout (fla.ops.gated_delta_rule.
    chunk_gated_delta_rule): q, k [B, T, H, K], v [B, T, HV, V] with HV a multiple of H (GVA: value
    head h reads key head h // (HV / H)), g (log-decay, <= 0) and beta [B, T, HV]; scale None =
    K^-0.5; initial_state / final_state [N, HV, K, V] (N = B, or the documents of cu_seqlens, when
    B must be 1). Returns (o [B, T, HV, V] in v's dtype, final_state or None). g, beta and the
    states are computed in float32 (float64 on the ref backend) and their gradients are returned
    in their own dtypes. src/ops/gated_delta_rule/op.h."""
    op = "chunk_gated_delta_rule"
    _backend(op, q=q, k=k, v=v)
    for name, t in (("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and (not isinstance(t, Tensor) or not t.is_floating_point()
                              or t.device != q.device):
            raise TypeError(f"gdntrain.{op}: argument '{name}' must be a floating tensor on "
                            f"{q.device}, got {getattr(t, 'dtype', type(t))} on "
                            f"{getattr(t, 'device', '-')}")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise _shape_error(op, f"q, k must be [B, T, H, K] and v [B, T, HV, V]; got q "
                           f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise _shape_error(op, f"v's heads ({HV}) must be a multiple of q's ({H})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise _shape_error(op, f"{name} must be [B, T, HV] = {[B, T, HV]}, got "
                               f"{list(t.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise _shape_error(op, f"with cu_seqlens the batch size must be 1, got {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"gdntrain.{op}: argument 'cu_seqlens' must be a 1-D int32/int64 "
                            f"tensor, got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    else:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    n = cu.shape[0] - 1
    sdt = _stat_dtype(q)
    if initial_state is not None and initial_state.shape != (n, HV, K, V):
        raise _shape_error(op, f"initial_state must be [N, HV, K, V] = {[n, HV, K, V]}, got "
                           f"{list(initial_state.shape)}")
    if scale is None:
        scale = K ** -0.5
    if not scale > 0:
        raise _shape_error(op, f"scale must be positive, got {scale}")
    o, hT = _gdr_fwd(q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
                     g.reshape(B * T, HV).to(sdt), beta.reshape(B * T, HV).to(sdt), cu,
                     None if initial_state is None else initial_state.to(sdt), float(scale),
                     bool(use_qk_l2norm_in_kernel), bool(output_final_state))
    return o.view(B, T, HV, V), (hT if output_final_state else None)


# --- linear_cross_entropy ---------------------------------------------------------------------

_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}


def _lce_loss_shape(n: int, reduction: int):
    return (n,) if reduction == 2 else (1,)


@torch.library.custom_op("gdntrain::linear_cross_entropy_fwd", mutates_args=())
def _lce_fwd(x: Tensor, w: Tensor, targets: Tensor, reduction: int, z_loss_scale: float,
             label_smoothing: float, with_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Loss and z-loss; with with_grad (mean and sum) also dx and dw for an upstream gradient of 1
    (gradient-in-forward, as Liger's fused_linear_cross_entropy.py does); else empty tensors."""
    x, w, targets = x.contiguous(), w.contiguous(), targets.contiguous()
    n, sdt = x.shape[0], _stat_dtype(x)
    loss = torch.empty(_lce_loss_shape(n, reduction), dtype=sdt, device=x.device)
    z_loss = torch.empty_like(loss)
    lse = torch.empty(n, dtype=sdt, device=x.device)
    dx = torch.empty_like(x) if with_grad else x.new_empty(0)
    dw = torch.zeros(w.shape, dtype=sdt, device=x.device) if with_grad else x.new_empty(0, dtype=sdt)
    _C.linear_cross_entropy(_view(x), _view(w), _view(targets), _view(loss), _view(lse),
                            _view(z_loss), None, _view(dx) if with_grad else None,
                            _view(dw) if with_grad else None, reduction, z_loss_scale,
                            label_smoothing, *_where(x))
    return loss, z_loss, dx, dw


@_lce_fwd.register_fake
def _(x, w, targets, reduction, z_loss_scale, label_smoothing, with_grad):
    sdt = _stat_dtype(x)
    loss = x.new_empty(_lce_loss_shape(x.shape[0], reduction), dtype=sdt)
    dx = torch.empty_like(x) if with_grad else x.new_empty(0)
    dw = w.new_empty(w.shape, dtype=sdt) if with_grad else x.new_empty(0, dtype=sdt)
    return loss, torch.empty_like(loss), dx, dw


@torch.library.custom_op("gdntrain::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd(dloss: Tensor, x: Tensor, w: Tensor, targets: Tensor, reduction: int,
             z_loss_scale: float, label_smoothing: float) -> Tuple[Tensor, Tensor]:
    """dx and dw for a given upstream gradient (reduction none, or when the forward ran without
    gradients): one more pass over the logits."""
    x, w, targets = x.contiguous(), w.contiguous(), targets.contiguous()
    n, sdt = x.shape[0], _stat_dtype(x)
    loss = torch.empty(_lce_loss_shape(n, reduction), dtype=sdt, device=x.device)
    z_loss, lse = torch.empty_like(loss), torch.empty(n, dtype=sdt, device=x.device)
    dx = torch.empty_like(x)
    dw = torch.zeros(w.shape, dtype=sdt, device=x.device)
    dl = dloss.to(sdt).contiguous()  # kept alive: _view holds only its address
    _C.linear_cross_entropy(_view(x), _view(w), _view(targets), _view(loss), _view(lse),
                            _view(z_loss), _view(dl), _view(dx),
                            _view(dw), reduction, z_loss_scale, label_smoothing, *_where(x))
    return dx, dw


@_lce_bwd.register_fake
def _(dloss, x, w, targets, reduction, z_loss_scale, label_smoothing):
    return torch.empty_like(x), w.new_empty(w.shape, dtype=_stat_dtype(x))


def _lce_setup(ctx, inputs, output):
    x, w, targets, reduction, zs, ls, with_grad = inputs
    ctx.with_grad = with_grad
    ctx.args = (reduction, zs, ls)
    if with_grad:
        ctx.save_for_backward(output[2], output[3], w)
    else:
        ctx.save_for_backward(x, w, targets)


def _lce_grad(ctx, dloss, _dz, _ddx, _ddw):
    if ctx.with_grad:  # gradients of an upstream 1, scaled (mean and sum: dloss is a scalar)
        dx, dw, w = ctx.saved_tensors
        g = dloss.reshape(())
        return (dx * g.to(dx.dtype), (dw * g.to(dw.dtype)).to(w.dtype), None, None, None, None,
                None)
    x, w, targets = ctx.saved_tensors
    dx, dw = _lce_bwd(dloss, x, w, targets, *ctx.args)
    return dx, dw.to(w.dtype), None, None, None, None, None


_lce_fwd.register_autograd(_lce_grad, setup_context=_lce_setup)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                         lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                         reduction: str = "mean", return_z_loss: bool = False):
    """Fused LM head + cross-entropy with Liger's LigerFusedLinearCrossEntropyLoss semantics: the
    logits x @ weight^T are never materialised whole; loss = cross-entropy (label smoothing eps:
    (1 - eps) nll + eps (lse - mean logit)) + lse_square_scale * lse^2 (z-loss) per non-ignored
    token; reduction "mean" divides by the non-ignored count (0 when there is none), "sum", or
    "none" ([N], 0 at ignored tokens). x [..., D], weight [V, D], target [...] int.
    return_z_loss: also return the z-loss part, reduced the same way (not differentiable).
    The loss is float32 (float64 on the ref backend). src/ops/linear_cross_entropy/op.h."""
    op = "linear_cross_entropy"
    _backend(op, x=x, weight=weight)
    if reduction not in _REDUCTIONS:
        raise _shape_error(op, f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(target, Tensor) or target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"gdntrain.{op}: argument 'target' must be an int32/int64 tensor, got "
                        f"{getattr(target, 'dtype', type(target))}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise _shape_error(op, f"weight must be [V, D] with D = the last dim of x "
                           f"{list(x.shape)}, got {list(weight.shape)}")
    if target.shape != x.shape[:-1]:
        raise _shape_error(op, f"target {list(target.shape)} must be x's shape without the last "
                           f"dim {list(x.shape[:-1])}")
    if lse_square_scale < 0 or not 0 <= label_smoothing < 1:
        raise _shape_error(op, f"lse_square_scale must be >= 0 and label_smoothing in [0, 1), got "
                           f"{lse_square_scale}, {label_smoothing}")
    x2, t = x.reshape(-1, x.shape[-1]), target.reshape(-1).to(x.device)
    if ignore_index != -100:  # libgdn's ignore index is -100
        t = torch.where(t == ignore_index, torch.full_like(t, -100),
                        torch.where(t == -100, torch.full_like(t, weight.shape[0]), t))
    red = _REDUCTIONS[reduction]
    with_grad = (red != 2 and torch.is_grad_enabled()
                 and (x.requires_grad or weight.requires_grad))
    loss, z_loss, _, _ = _lce_fwd(x2, weight, t, red, float(lse_square_scale),
                                  float(label_smoothing), with_grad)
    if red != 2:
        loss, z_loss = loss.reshape(()), z_loss.reshape(())
    else:
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss.detach()) if return_z_loss else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """Drop-in for liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss: forward(lin_weight,
    _input, target, bias=None). bias and softcap are not supported (ValueError); Qwen3.5's LM head
    has neither."""

    def __init__(self, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False):
        super().__init__()
        if softcap is not None:
            raise ValueError("gdntrain.LinearCrossEntropyLoss: softcap is not supported")
        self.ignore_index, self.lse_square_scale = ignore_index, lse_square_scale
        self.label_smoothing, self.reduction = label_smoothing, reduction
        self.return_z_loss = return_z_loss

    def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor,
                bias: Optional[Tensor] = None):
        if bias is not None:
            raise ValueError("gdntrain.LinearCrossEntropyLoss: a bias is not supported")
        return linear_cross_entropy(_input, lin_weight, target, self.ignore_index,
                                    self.lse_square_scale, self.label_smoothing, self.reduction,
                                    self.return_z_loss)
