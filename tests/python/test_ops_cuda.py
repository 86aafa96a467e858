"""gdntrain.torch's ops on CUDA (label gpu; needs an sm_90 GPU and a GDN_CUDA build): bfloat16
CUDA tensors run the cuda backend; they are compared with the fp64 ref backend on the same
(bf16-rounded) inputs within the bf16 probe tolerances of src/backend/tolerances.h; opcheck on
CUDA; the ops follow torch's current stream; float32 CUDA tensors are rejected."""
import pytest
import torch

import gdntrain
import gdntrain.torch as gt
from _support import assert_close_rel, grads_of
from test_ops_cpu import CASES, OPS

# src/backend/tolerances.h (fwd, bwd)
BF16_TOL = {"rmsnorm": (5e-3, 5e-3), "gated_rmsnorm": (5e-3, 5e-3), "swiglu": (5e-3, 5e-3),
            "conv": (5e-3, 5e-3), "gdr": (1.3e-2, 2.5e-2), "lce": (4.5e-3, 1.2e-2)}


def tol_of(name):
    for k, v in BF16_TOL.items():
        if name.startswith(k):
            return v
    raise KeyError(name)


def test_module_has_cuda():
    assert gdntrain._C.cuda_built(), "this gdntrain._C was built without CUDA"
    assert torch.cuda.is_available(), "no CUDA device visible to torch"


def _to_cuda_bf16(ts):
    return [None if t is None else t.to(torch.bfloat16).cuda() for t in ts]


def _rounded_f64(ts):
    return [None if t is None else t.to(torch.bfloat16).double() for t in ts]


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_bf16_matches_ref(name):
    fn, inputs, _, _ = CASES[name]()
    tf, tb = tol_of(name)
    outs, grads = grads_of(fn, _to_cuda_bf16(inputs), dy_round=torch.bfloat16)
    routs, rgrads = grads_of(fn, _rounded_f64(inputs), dy_round=torch.bfloat16)
    for i, (a, b) in enumerate(zip(outs, routs)):
        if a is not None:
            assert a.is_cuda and a.dtype == torch.bfloat16
            assert_close_rel(f"{name} output {i}", a.cpu(), b, tf)
    for i, (a, b) in enumerate(zip(grads, rgrads)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.is_cuda and a.dtype == torch.bfloat16
            assert_close_rel(f"{name} grad {i}", a.cpu(), b, tb)


# Arguments of the raw ops that are in the "state" dtype (float32 on cuda), not the activation one:
# g, beta and the initial state of the gated delta rule (src/ops/gated_delta_rule/op.h).
STATE_ARGS = {"chunk_gated_delta_rule": (3, 4, 6)}


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck_cuda(name):
    op, args = OPS[name](torch.float64)
    state = STATE_ARGS.get(name, ())

    def to_cuda(i, a):
        if not isinstance(a, torch.Tensor):
            return a
        if not a.is_floating_point():
            return a.cuda()
        dt = torch.float32 if i in state else torch.bfloat16
        return a.to(dt).cuda().requires_grad_()
    torch.library.opcheck(op, tuple(to_cuda(i, a) for i, a in enumerate(args)))


def test_current_stream_is_used():
    """Work queued on a side stream: our op on that stream reads the side stream's result (a
    wrong stream would race with the long matmul chain that produces x)."""
    s = torch.cuda.Stream()
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        x = a * 0 + 1  # all ones, only after the chain
        y = gt.rmsnorm(x, w)
    s.synchronize()
    assert torch.equal(y, torch.ones_like(y))


def test_float32_on_cuda_is_rejected():
    with pytest.raises(TypeError, match=r"gdntrain\.swiglu: argument 'gate' has dtype "
                       r"torch\.float32 on cuda"):
        gt.swiglu(torch.randn(2, 8, device="cuda"), torch.randn(2, 8, device="cuda"))


def test_apply_to_qwen3_5_bf16_cuda():
    """The patched tiny model in bf16 on CUDA: loss within bf16 noise of unpatched HF (bf16, torch
    fallbacks) on the same batch, every gradient present and finite."""
    import copy

    from test_qwen3_5_hf import tiny
    ref = tiny(["linear_attention", "full_attention", "linear_attention"], seed=3)
    ref = ref.to(device="cuda", dtype=torch.bfloat16)
    ours = gt.apply_to_qwen3_5(copy.deepcopy(ref))
    ids = torch.randint(0, 160, (2, 128), generator=torch.Generator().manual_seed(2)).cuda()
    a = ref(input_ids=ids, labels=ids, use_cache=False).loss
    b = ours(input_ids=ids, labels=ids, use_cache=False).loss
    b.backward()
    assert abs(a.item() - b.item()) <= 2e-2 * abs(a.item()), (a.item(), b.item())
    for n, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
