"""The gated delta rule of the peers and ours, timed eagerly and under CUDA graphs on the same
inputs in one process, with each one's error against an fp64 reference (issue 27).

    PYTHONPATH=PEERS:build/cuda/python python3 bench/gdn_graphs.py --out OUT.json [--impls ours,fla,qla]

Implementations (each skipped with a recorded error when its package does not import):
  ours  gdntrain.torch.chunk_gated_delta_rule (native GVA: q, k at Hk heads, v at Hv)
  fla   fla.ops.gated_delta_rule.chunk_gated_delta_rule with FLA_FLASH_QLA=0 (Triton; q and k
        repeated to Hv heads, as fla takes one head count)
  qla   flash_qla.chunk_gated_delta_rule (native GVA)
Cases: Hk 16, Hv 32, d 128, bf16, the in-kernel q/k l2norm, T 8192 as 1 and 4 documents and T
32768 as 1 (the issue's table). Timings: median of CUDA-event timings after warm-up of forward and
forward + backward, eager (every host call made) and as a replayed torch.cuda.CUDAGraph of the same
calls (host overhead removed). Errors: max |x - ref| / max |ref| of o against an fp64 recurrence
(gdn_spec.md section 2) at every case; of dq, dk, dv, dg, dbeta against fp64 autograd through the
recurrence at T 1024 (4 documents), which fits in memory (the recurrence saves a state per token).
The idea of timing both ways is the issue's: FlashQLA publishes CUDA-graph numbers.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

BF, DEV = torch.bfloat16, "cuda"
HK, HV, D = 16, 32, 128
R = {}
REF = {}


def inputs(T, nseq, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, T, HK, D, dtype=BF, device=DEV, generator=gen)
    k = torch.randn(1, T, HK, D, dtype=BF, device=DEV, generator=gen)
    v = torch.randn(1, T, HV, D, dtype=BF, device=DEV, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, dtype=torch.float32, device=DEV, generator=gen))
    beta = torch.rand(1, T, HV, dtype=torch.float32, device=DEV, generator=gen).sigmoid()
    cu = torch.linspace(0, T, nseq + 1, device=DEV).round().to(torch.int32)
    do = torch.randn(1, T, HV, D, dtype=BF, device=DEV, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, do=do)


def make_impl(name):
    """fn(q, k, v, g, beta, cu) -> o for leaf tensors in the peer's layout."""
    if name == "ours":
        import gdntrain.torch as gt
        return lambda q, k, v, g, beta, cu: gt.chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
    if name == "qla":
        import flash_qla
        return lambda q, k, v, g, beta, cu: flash_qla.chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)[0]
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    r = HV // HK
    return lambda q, k, v, g, beta, cu: chunk_gated_delta_rule(
        q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, g, beta,
        cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)[0]


def leaves(x, name):
    """The inputs as fresh leaves in the dtypes the implementation takes."""
    out = {}
    for key in ("q", "k", "v", "g", "beta"):
        t = x[key]
        if key == "beta" and name != "ours":
            t = t.to(BF)  # fla and FlashQLA take beta in the activation dtype
        out[key] = t.detach().clone().requires_grad_(True)
    return out


def median_ms(fn, warmup=3, rep=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def graphed(fn):
    """fn captured once into a CUDA graph (after warm-up on a side stream, as the PyTorch docs'
    whole-network capture does); returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def reference(x, with_grads):
    """fp64 recurrence of gdn_spec.md section 2 (l2norm of q and k first), per document; o [1, T,
    HV, D] and, with_grads, the gradients of sum(o * do) with respect to q, k, v, g, beta."""
    p = {key: x[key].detach().double().requires_grad_(with_grads)
         for key in ("q", "k", "v", "g", "beta")}
    r, scale = HV // HK, 1.0 / math.sqrt(D)
    qn = p["q"] / torch.sqrt((p["q"] ** 2).sum(-1, keepdim=True) + 1e-6)
    kn = p["k"] / torch.sqrt((p["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    qn, kn = qn.repeat_interleave(r, dim=2)[0], kn.repeat_interleave(r, dim=2)[0]  # [T, HV, D]
    v, g, beta = p["v"][0], p["g"][0], p["beta"][0]
    outs = []
    cu = x["cu"].tolist()
    with torch.set_grad_enabled(with_grads):
        for a, b in zip(cu[:-1], cu[1:]):
            S = torch.zeros(HV, D, D, dtype=torch.float64, device=DEV)  # [HV, dk, dv]
            for t in range(a, b):
                S = S * torch.exp(g[t])[:, None, None]
                pred = torch.einsum("hkv,hk->hv", S, kn[t])
                delta = beta[t][:, None] * (v[t] - pred)
                S = S + kn[t][:, :, None] * delta[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", S, scale * qn[t]))
        o = torch.stack(outs)[None]
        grads = {}
        if with_grads:
            (o * x["do"].double()).sum().backward()
            grads = {key: p[key].grad for key in p}
    return o.detach(), grads


def rel(a, ref):
    return (a.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-300)


def run_case(name, fn, T, nseq):
    x = inputs(T, nseq)
    lv = leaves(x, name)
    args = lambda: (lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"], x["cu"])

    def fwd():
        with torch.no_grad():
            return fn(*args())

    def fwdbwd():
        for t in lv.values():
            t.grad = None
        fn(*args()).backward(x["do"])

    t0 = time.time()
    fwdbwd()
    torch.cuda.synchronize()
    first = time.time() - t0
    res = dict(first_call_s=first, eager_fwd_ms=median_ms(fwd), eager_fwdbwd_ms=median_ms(fwdbwd))
    try:
        res["graph_fwd_ms"] = median_ms(graphed(fwd))
        # Under capture the gradients must exist already (accumulated in place, not set to None).
        def fwdbwd_static():
            fn(*args()).backward(x["do"])
        fwdbwd_static()
        res["graph_fwdbwd_ms"] = median_ms(graphed(fwdbwd_static))
    except Exception as e:  # a peer that cannot be captured is recorded, not fatal
        res["graph_error"] = repr(e)[:300]
    o = fwd()
    if (T, nseq) not in REF:  # the same inputs for every implementation: one reference per case
        REF[(T, nseq)] = reference(x, False)[0]
    res["o_rel_err"] = rel(o, REF[(T, nseq)])
    return res


def grad_errors(name, fn):
    x = inputs(1024, 4, seed=1)
    lv = leaves(x, name)
    fn(lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"], x["cu"]).backward(x["do"])
    _, ref = reference(x, True)
    return {f"d{key}_rel_err": rel(lv[key].grad, ref[key]) for key in ref}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default="ours,fla,qla")
    a = ap.parse_args()
    R["env"] = dict(torch=torch.__version__, device=torch.cuda.get_device_name())
    print(R["env"], flush=True)
    for name in a.impls.split(","):
        try:
            fn = make_impl(name)
        except Exception as e:
            R[f"{name}.error"] = repr(e)[:300]
            print(name, "unavailable:", R[f"{name}.error"], flush=True)
            continue
        for T, n in ((8192, 1), (8192, 4), (32768, 1)):
            key = f"{name}.T{T}.n{n}"
            try:
                R[key] = run_case(name, fn, T, n)
            except Exception as e:
                R[key] = dict(error=repr(e)[:300])
            print(key, R[key], flush=True)
            json.dump(R, open(a.out, "w"), indent=1)
        try:
            R[f"{name}.grads.T1024.n4"] = grad_errors(name, fn)
        except Exception as e:
            R[f"{name}.grads.T1024.n4"] = dict(error=repr(e)[:300])
        print(f"{name}.grads.T1024.n4", R[f"{name}.grads.T1024.n4"], flush=True)
        json.dump(R, open(a.out, "w"), indent=1)
