"""gdntrain.torch's ops on CPU: opcheck, the cpu backend (float32) against the fp64 ref backend
(float64) within the cpu backend's probe tolerance (src/ops/*/op.cpp `tolerance`), the ref backend
against plain-torch float64 formulas of src/ops/*/op.h, gradcheck in float64, and errors."""
import pytest
import torch
import torch.nn.functional as F

import gdntrain.torch as gt
from _support import assert_close_rel, grads_of

torch.manual_seed(0)


def rnd(*shape, scale=1.0, shift=0.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


# --- plain-torch float64 formulas (the op.h definitions) --------------------------------------

def rmsnorm_formula(x, w, eps=1e-6, zero_centred=False):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * r * ((1 + w) if zero_centred else w)


def gated_rmsnorm_formula(x, z, w, eps=1e-6):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * r * w * F.silu(z)


def swiglu_formula(gate, up):
    return F.silu(gate) * up


def conv_formula(x, weight, bias, cu, initial_state, silu):
    """Per document: left-pad with the initial state (or zeros), depthwise conv1d."""
    T, C = x.shape[1], x.shape[2]
    W = weight.shape[1]
    bounds = cu.tolist()
    ys, finals = [], []
    for n in range(len(bounds) - 1):
        seg = x[0, bounds[n]:bounds[n + 1]].t()  # [C, L]
        st = initial_state[n] if initial_state is not None else seg.new_zeros(C, W - 1)
        ext = torch.cat([st, seg], dim=1)  # [C, L + W - 1]
        if seg.shape[1] == 0:  # an empty document: no output, the state passes through
            y = seg
        else:
            y = F.conv1d(ext.unsqueeze(0), weight.unsqueeze(1), bias, groups=C)[0]  # [C, L]
        ys.append(F.silu(y) if silu else y)
        finals.append(ext[:, ext.shape[1] - (W - 1):])
    return torch.cat(ys, dim=1).t().unsqueeze(0), torch.stack(finals)


def gdr_formula(q, k, v, g, beta, scale, h0, l2, cu):
    """Token-by-token recurrence of src/ops/gated_delta_rule/op.h (decay first, output reads the
    updated state), q, k [1, T, H, K], v [1, T, HV, V], GVA value head h -> key head h // r."""
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    b = cu.tolist()
    outs, finals = [], []
    for n in range(len(b) - 1):
        heads = []
        fin = []
        for h in range(HV):
            S = h0[n, h] if h0 is not None else q.new_zeros(K, V)
            o_h = []
            for t in range(b[n], b[n + 1]):
                kt, qt = k[0, t, h // r], q[0, t, h // r]
                S = torch.exp(g[0, t, h]) * S
                d = beta[0, t, h] * (v[0, t, h] - S.t() @ kt)
                S = S + torch.outer(kt, d)
                o_h.append(S.t() @ (scale * qt))
            heads.append(torch.stack(o_h) if o_h else v.new_zeros(0, V))
            fin.append(S)
        outs.append(torch.stack(heads, dim=1))
        finals.append(torch.stack(fin))
    return torch.cat(outs, dim=0).unsqueeze(0), torch.stack(finals)


def lce_formula(x, w, t, zs, ls, reduction, ignore_index=-100):
    """torch's cross_entropy on materialised logits + lse_square_scale * lse^2 on non-ignored
    tokens, reduced the same way (Liger's LigerFusedLinearCrossEntropyLoss semantics)."""
    logits = x @ w.t()
    ce = F.cross_entropy(logits, t, ignore_index=ignore_index, label_smoothing=ls,
                         reduction="none")
    keep = (t != ignore_index).to(x.dtype)
    per = ce + zs * torch.logsumexp(logits, -1) ** 2 * keep
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / keep.sum().clamp(min=1)


# --- cases: (public fn, float64 inputs, formula, cpu tolerance (fwd, bwd)) ---------------------

def case_rmsnorm(zc):
    x = rnd(3, 5, 96, scale=2.0, seed=1)
    w = rnd(96, scale=0.1, seed=2) if zc else rnd(96, scale=0.3, shift=1.0, seed=2)
    fn = lambda x, w: gt.rmsnorm(x, w, eps=1e-6, zero_centred=zc)  # noqa: E731
    ref = lambda x, w: rmsnorm_formula(x, w, 1e-6, zc)  # noqa: E731
    return fn, [x, w], ref, (1e-5, 1e-5)


def case_gated_rmsnorm():
    x, z, w = rnd(4, 3, 64, seed=3), rnd(4, 3, 64, scale=2, seed=4), rnd(64, scale=0.3, shift=1.0, seed=5)
    return gt.gated_rmsnorm, [x, z, w], gated_rmsnorm_formula, (1e-5, 1e-5)


def case_swiglu():
    return gt.swiglu, [rnd(6, 80, scale=3, seed=6), rnd(6, 80, seed=7)], swiglu_formula, (2e-6, 2e-6)


def case_conv(silu, varlen, state, bias=True, W=4):
    C, T = 40, 37
    x = rnd(1, T, C, seed=8)
    weight, b = rnd(C, W, scale=0.5, seed=9), (rnd(C, scale=0.2, seed=10) if bias else None)
    cu = torch.tensor([0, 5, 5, 7, 30, 37] if varlen else [0, T], dtype=torch.int64)
    N = cu.numel() - 1
    init = rnd(N, C, W - 1, seed=11) if state else None
    act = "silu" if silu else None

    def fn(x, weight, b, init):
        return gt.causal_conv1d(x, weight, b, act, cu if varlen else None, init,
                                output_final_state=True)

    def ref(x, weight, b, init):
        return conv_formula(x, weight, b, cu, init, silu)
    return fn, [x, weight, b, init], ref, (1e-5, 1e-5)


def case_gdr(l2, state, varlen, T=100, H=2, HV=4, K=16, V=24):
    q, k, v = rnd(1, T, H, K, seed=12), rnd(1, T, H, K, seed=13), rnd(1, T, HV, V, seed=14)
    if not l2:  # keep the state bounded without the l2norm: |k| ~ 1
        q, k = q / K ** 0.5, k / K ** 0.5
    g = -(0.02 + F.softplus(rnd(1, T, HV, seed=15) - 2))
    beta = torch.sigmoid(rnd(1, T, HV, seed=16))
    cu = torch.tensor([0, T // 20, T // 20, 7 * T // 10, T] if varlen else [0, T],
                      dtype=torch.int32)
    N = cu.numel() - 1
    h0 = rnd(N, HV, K, V, scale=0.3, seed=17) if state else None
    scale = 0.7

    def fn(q, k, v, g, beta, h0):
        return gt.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                         cu_seqlens=cu if varlen else None)

    def ref(q, k, v, g, beta, h0):
        return gdr_formula(q, k, v, g, beta, scale, h0, l2, cu)
    return fn, [q, k, v, g, beta, h0], ref, (1e-6, 2e-6)


def case_lce(reduction, zs, ls, ignore_index=-100):
    N, D, V = 29, 24, 50
    x, w = rnd(N, D, seed=18), rnd(V, D, scale=0.5, seed=19)
    g = torch.Generator().manual_seed(20)
    t = torch.randint(0, V, (N,), generator=g)
    t[[0, 5, 6, 20]] = ignore_index

    def fn(x, w):
        return gt.linear_cross_entropy(x, w, t, ignore_index, zs, ls, reduction)

    def ref(x, w):
        return lce_formula(x, w, t, zs, ls, reduction, ignore_index)
    return fn, [x, w], ref, (1e-5, 1e-5)


CASES = {
    "rmsnorm": lambda: case_rmsnorm(False),
    "rmsnorm_zero_centred": lambda: case_rmsnorm(True),
    "gated_rmsnorm": case_gated_rmsnorm,
    "swiglu": case_swiglu,
    "conv_silu_varlen_state": lambda: case_conv(True, True, True),
    "conv_silu_one_doc": lambda: case_conv(True, False, False),
    "conv_nosilu_varlen_nobias": lambda: case_conv(False, True, False, bias=False),
    "conv_w1": lambda: case_conv(True, True, False, W=1),
    "gdr_l2_state_varlen": lambda: case_gdr(True, True, True),
    "gdr_plain_one_doc": lambda: case_gdr(False, False, False),
    "lce_mean_zloss_smooth": lambda: case_lce("mean", 1e-3, 0.1),
    "lce_sum": lambda: case_lce("sum", 0.0, 0.0),
    "lce_none_zloss_ignore7": lambda: case_lce("none", 1e-2, 0.0, ignore_index=7),
}
# gradcheck (numerical Jacobians) on smaller shapes for the gated delta rule
GRADCHECK_CASES = dict(CASES, **{
    "gdr_l2_state_varlen": lambda: case_gdr(True, True, True, T=9, H=1, HV=2, K=3, V=4),
    "gdr_plain_one_doc": lambda: case_gdr(False, False, False, T=7, H=1, HV=2, K=3, V=2),
})


def _cast(ts, dtype):
    return [None if t is None else t.to(dtype) for t in ts]


@pytest.mark.parametrize("name", list(CASES))
def test_ref_matches_formula(name):
    """float64 runs gdntrain's ref backend: it matches the float64 formula to rounding."""
    fn, inputs, formula, _ = CASES[name]()
    outs, grads = grads_of(fn, inputs)
    routs, rgrads = grads_of(formula, inputs)
    for i, (o, r) in enumerate(zip(outs, routs)):
        if o is not None:
            assert_close_rel(f"{name} output {i}", o, r, 1e-12)
    for i, (g, r) in enumerate(zip(grads, rgrads)):
        assert (g is None) == (r is None), f"{name}: grad {i} presence differs"
        if g is not None:
            assert_close_rel(f"{name} grad {i}", g, r, 1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_matches_ref(name):
    """float32 runs the cpu backend: forward and gradients within its probe tolerance of ref."""
    fn, inputs, _, (tf, tb) = CASES[name]()
    outs32, grads32 = grads_of(fn, _cast(inputs, torch.float32))
    outs64, grads64 = grads_of(fn, inputs)
    for i, (a, b) in enumerate(zip(outs32, outs64)):
        if a is not None:
            assert a.dtype == torch.float32
            assert_close_rel(f"{name} output {i}", a, b, tf)
    for i, (a, b) in enumerate(zip(grads32, grads64)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == torch.float32
            assert_close_rel(f"{name} grad {i}", a, b, tb)


@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck_float64(name):
    fn, inputs, _, _ = GRADCHECK_CASES[name]()
    small = [None if t is None else t.detach().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(fn, small, eps=1e-6, atol=1e-7, rtol=1e-6)


OPS = {
    "rmsnorm": lambda dt: (torch.ops.gdntrain.rmsnorm_fwd,
                           (rnd(4, 32, seed=1, dtype=dt), rnd(32, scale=0.1, seed=2, dtype=dt), 1e-6,
                            True)),
    "gated_rmsnorm": lambda dt: (torch.ops.gdntrain.gated_rmsnorm_fwd,
                                 (rnd(2, 3, 16, seed=1, dtype=dt), rnd(2, 3, 16, seed=2, dtype=dt),
                                  rnd(16, seed=3, dtype=dt), 1e-5)),
    "swiglu": lambda dt: (torch.ops.gdntrain.swiglu_fwd,
                          (rnd(5, 24, seed=1, dtype=dt), rnd(5, 24, seed=2, dtype=dt))),
    "causal_conv1d": lambda dt: (torch.ops.gdntrain.causal_conv1d_fwd,
                                 (rnd(20, 8, seed=1, dtype=dt), rnd(8, 4, seed=2, dtype=dt),
                                  rnd(8, seed=3, dtype=dt),
                                  torch.tensor([0, 3, 20], dtype=torch.int32),
                                  rnd(2, 8, 3, seed=4, dtype=dt), True, True)),
    "chunk_gated_delta_rule": lambda dt: (
        torch.ops.gdntrain.gated_delta_rule_fwd,
        (rnd(9, 1, 4, seed=1, dtype=dt), rnd(9, 1, 4, seed=2, dtype=dt),
         rnd(9, 2, 3, seed=3, dtype=dt), -F.softplus(rnd(9, 2, seed=4, dtype=dt)),
         torch.sigmoid(rnd(9, 2, seed=5, dtype=dt)), torch.tensor([0, 4, 9], dtype=torch.int32),
         rnd(2, 2, 4, 3, seed=6, dtype=dt), 0.5, True, True)),
    "linear_cross_entropy": lambda dt: (
        torch.ops.gdntrain.linear_cross_entropy_fwd,
        (rnd(7, 8, seed=1, dtype=dt), rnd(11, 8, seed=2, dtype=dt),
         torch.tensor([1, 2, -100, 10, 0, 3, 3]), 0, 1e-3, 0.0, True)),
    "linear_cross_entropy_none": lambda dt: (
        torch.ops.gdntrain.linear_cross_entropy_fwd,
        (rnd(7, 8, seed=1, dtype=dt), rnd(11, 8, seed=2, dtype=dt),
         torch.tensor([1, 2, -100, 10, 0, 3, 3]), 2, 1e-3, 0.1, False)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name, dtype):
    """torch.library.opcheck: schema, fake (register_fake) and autograd registration, AOT
    dispatch, on the forward op with inputs requiring grad (which exercises the backward op)."""
    op, args = OPS[name](dtype)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    """register_fake lets torch.compile trace the ops without a graph break."""
    x, z, w = rnd(2, 8, 32, seed=1, dtype=torch.float32), rnd(2, 8, 32, seed=2,
                                                              dtype=torch.float32), \
        rnd(32, scale=0.1, shift=1.0, seed=3, dtype=torch.float32)
    cw = rnd(32, 4, seed=4, dtype=torch.float32)

    def f(x, z, w, cw):
        h, _ = gt.causal_conv1d(x, cw)
        return gt.swiglu(gt.rmsnorm(h, w, zero_centred=True), gt.gated_rmsnorm(x, z, w))
    eager = f(x, z, w, cw)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, z, w, cw)
    assert torch.equal(eager, compiled)


def test_bad_dtype_names_op_argument_dtype():
    x = torch.randn(4, 8, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"gdntrain\.rmsnorm: argument 'x' has dtype torch\.float16"):
        gt.rmsnorm(x, torch.ones(8, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"gdntrain\.swiglu: argument 'up' is torch\.float64"):
        gt.swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"causal_conv1d: argument 'x' has dtype torch\.bfloat16"):
        gt.causal_conv1d(torch.randn(1, 4, 8, dtype=torch.bfloat16), torch.randn(8, 4))


def test_lce_z_loss_and_all_ignored():
    x, w = rnd(6, 8, seed=1), rnd(5, 8, seed=2)
    t = torch.tensor([0, 1, 2, 3, 4, -100])
    loss, z = gt.linear_cross_entropy(x, w, t, lse_square_scale=0.5, return_z_loss=True)
    lse = torch.logsumexp(x @ w.t(), -1)[:5]
    assert abs(z.item() - 0.5 * (lse ** 2).mean().item()) < 1e-12
    assert abs(loss.item() - lce_formula(x, w, t, 0.5, 0.0, "mean").item()) < 1e-12
    xs = x.clone().requires_grad_()
    ign = gt.linear_cross_entropy(xs, w, torch.full((6,), -100))
    ign.backward()
    assert ign.item() == 0.0 and torch.count_nonzero(xs.grad) == 0


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"gdntrain\.rmsnorm: weight \[7\]"):
        gt.rmsnorm(torch.randn(4, 8), torch.ones(7))
    with pytest.raises(ValueError, match=r"gdntrain\.causal_conv1d: with cu_seqlens x must be"):
        gt.causal_conv1d(torch.randn(2, 4, 8), torch.randn(8, 4),
                         cu_seqlens=torch.tensor([0, 4]))


def test_bad_cu_seqlens_is_libgdn_error():
    """cu_seqlens not ending at T: libgdn's own validation (src/ops/causal_conv1d/op.cpp) raises."""
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        gt.causal_conv1d(torch.randn(1, 6, 8), torch.randn(8, 4),
                         cu_seqlens=torch.tensor([0, 2, 5]))
