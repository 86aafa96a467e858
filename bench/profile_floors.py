"""Each op's share of a profiled training step and its distance from its own floor (issue 27):

    python3 bench/profile_floors.py RUN_DIR/profile_stepN.json --model bench/configs/qwen35_4b.json \
        --tokens 8192 --copy-gbs 4000 --gemm-tflops 700 [--peer gdr.fwd=0.28 --peer gdr.bwd=0.79]

The JSON is what `gdntrain train --profile-step N` writes (CUDA-event times of the step's named
ranges, summed over their calls). For every range the floor is the larger of its minimum bytes over
--copy-gbs (the device's measured copy rate, e.g. `cuda_bench_ops`' ceilings) and its matmul FLOPs
over --gemm-tflops (cuBLAS's measured rate at the model's GEMM shapes; 989 = the H200's bf16 dense
peak if not given), or a peer's measured time given with --peer (the gated delta rule's floor is
FlashQLA's time: its sequential recurrence is far from both rates). Minimum bytes count each input
read once and each output written once in the dtypes the kernels use (bf16 activations, fp32
gates, statistics and weight gradients); FLOPs count 2 m n k per matmul (causal attention: half
the square). One micro-batch of `--tokens` tokens in one document a step is assumed (attention's
FLOPs grow with the document length). The table is sorted by time: the top rows are where the
step's time goes, and time / floor says how far each is from what the hardware allows.
"""
import argparse
import json


def shapes(c, T):
    g = dict(T=T, D=c["hidden_size"], I=c["intermediate_size"], V=c["vocab_size"],
             L=c["num_hidden_layers"], Hq=c["num_attention_heads"], Hkv=c["num_key_value_heads"],
             hd=c.get("head_dim", 256), Hk=c["linear_num_key_heads"], Hv=c["linear_num_value_heads"],
             dk=c["linear_key_head_dim"], dv=c["linear_value_head_dim"],
             W=c.get("linear_conv_kernel_dim", 4))
    interval = c.get("full_attention_interval", 4)
    g["n_attn"] = g["L"] // interval
    g["n_gdn"] = g["L"] - g["n_attn"]
    g["C"] = 2 * g["Hk"] * g["dk"] + g["Hv"] * g["dv"]  # conv channels (q, k, v)
    return g


def param_count(s):
    D, I, V = s["D"], s["I"], s["V"]
    gdn = (D * (s["C"] + s["Hv"] * s["dv"] + 2 * s["Hv"]) + s["C"] * s["W"] + s["Hv"] * s["dv"] * D
           + 2 * s["Hv"] + s["dv"])  # A_log, dt_bias, the gated norm's weight
    attn = (D * (2 * s["Hq"] * s["hd"] + 2 * s["Hkv"] * s["hd"]) + s["Hq"] * s["hd"] * D
            + 2 * s["hd"])  # q_norm, k_norm
    return s["L"] * (3 * D * I + 2 * D) + s["n_gdn"] * gdn + s["n_attn"] * attn + V * D + D


def work(s):
    """Per range: (FLOPs, bytes) of the whole step (all layers)."""
    T, D, I, V = s["T"], s["D"], s["I"], s["V"]
    ng, na = s["n_gdn"], s["n_attn"]
    HvDv, HqHd = s["Hv"] * s["dv"], s["Hq"] * s["hd"]
    gdn_in = s["C"] + HvDv + 2 * s["Hv"]
    attn_in = 2 * HqHd + 2 * s["Hkv"] * s["hd"]

    def gemm(m, n, k, calls=1):  # forward: C[m, n] = A[m, k] B[k, n], bf16 in and out
        return 2.0 * m * n * k * calls, 2.0 * (m * k + k * n + m * n) * calls

    def gemm_bwd(m, n, k, calls=1):  # dA = dC B^T and dB = A^T dC (fp32 dB)
        return 4.0 * m * n * k * calls, (2.0 * (2 * m * n + m * k + k * n) + 4.0 * k * n
                                          + 2.0 * m * k) * calls

    def add(a, b):
        return a[0] + b[0], a[1] + b[1]

    P = param_count(s)
    attn_flops = 2.0 * T * T * HqHd  # QK^T and PV, causal half: 2 * 2 * T^2/2 * Hq hd
    r = {
        "embedding.fwd": (0, 4.0 * T * D),
        "embedding.bwd": (0, 2.0 * T * D + 8.0 * T * D),
        "rmsnorm.fwd": (0, 4.0 * T * D * (2 * s["L"] + 1)),
        "rmsnorm.bwd": (0, 6.0 * T * D * (2 * s["L"] + 1)),
        "gdn.in_proj.fwd": gemm(T, gdn_in, D, ng),
        "gdn.in_proj.bwd": gemm_bwd(T, gdn_in, D, ng),
        "conv.fwd": (0, 4.0 * T * s["C"] * ng),
        "conv.bwd": (0, 6.0 * T * s["C"] * ng),
        "gdn_gates.fwd": (0, 12.0 * T * s["Hv"] * ng),
        "gdn_gates.bwd": (0, 24.0 * T * s["Hv"] * ng),
        "gated_rmsnorm.fwd": (0, 6.0 * T * HvDv * ng),
        "gated_rmsnorm.bwd": (0, 10.0 * T * HvDv * ng),
        "out_proj.fwd": add(gemm(T, D, HvDv, ng), gemm(T, D, HqHd, na)),
        "out_proj.bwd": add(gemm_bwd(T, D, HvDv, ng), gemm_bwd(T, D, HqHd, na)),
        "mlp.gate_up.fwd": gemm(T, 2 * I, D, s["L"]),
        "mlp.gate_up.bwd": gemm_bwd(T, 2 * I, D, s["L"]),
        "swiglu.fwd": (0, 6.0 * T * I * s["L"]),
        "swiglu.bwd": (0, 10.0 * T * I * s["L"]),
        "mlp.down.fwd": gemm(T, D, I, s["L"]),
        "mlp.down.bwd": gemm_bwd(T, D, I, s["L"]),
        "attn.in_proj.fwd": gemm(T, attn_in, D, na),
        "attn.in_proj.bwd": gemm_bwd(T, attn_in, D, na),
        "attn.core.fwd": (attn_flops * na, 2.0 * T * (3 * HqHd + 2 * 2 * s["Hkv"] * s["hd"]) * na),
        "attn.core.bwd": (2.5 * attn_flops * na, 2.0 * T * (6 * HqHd + 4 * 2 * s["Hkv"] * s["hd"]) * na),
        # the 3-GEMM floor: logits, dX and dW (fp32), without the [T, V] logits ever in memory
        "lm_head_loss": (6.0 * T * V * D, 2.0 * (2 * T * D + V * D) + 4.0 * V * D),
        "gdr.fwd": (11.0 * s["dk"] * s["dk"] * s["Hv"] * T * ng,
                    2.0 * T * (2 * s["Hk"] * s["dk"] + 2 * HvDv) * ng),
        "gdr.bwd": (22.0 * s["dk"] * s["dk"] * s["Hv"] * T * ng,
                    2.0 * T * (4 * s["Hk"] * s["dk"] + 4 * HvDv) * ng),
        "grad_norm": (0, 4.0 * P),
        "optimizer": (0, 30.0 * P),  # master, grad, m, v read; master, m, v, bf16 param written
    }
    return r, P


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--model", required=True, help="HF config.json of the profiled model")
    ap.add_argument("--tokens", type=int, required=True, help="tokens of the profiled step")
    ap.add_argument("--copy-gbs", type=float, required=True, help="measured device copy GB/s")
    ap.add_argument("--gemm-tflops", type=float, default=989.0, help="measured bf16 GEMM TFLOP/s")
    ap.add_argument("--peer", action="append", default=[], metavar="RANGE=MS",
                    help="a range's floor taken from a peer's measured time")
    a = ap.parse_args()
    prof = json.load(open(a.profile))
    s = shapes(json.load(open(a.model)), a.tokens)
    w, P = work(s)
    peers = {}
    for p in a.peer:
        name, ms = p.split("=")
        peers[name] = float(ms)
    total = sum(r["ms"] for r in prof["ranges"])
    rows = []
    for r in prof["ranges"]:
        name, ms = r["name"], r["ms"]
        if name in peers:
            floor, basis = peers[name], "peer"
        elif name in w:
            flops, nbytes = w[name]
            f_gemm, f_copy = flops / (a.gemm_tflops * 1e9), nbytes / (a.copy_gbs * 1e6)
            floor, basis = (f_gemm, "gemm") if f_gemm >= f_copy else (f_copy, "copy")
        else:
            floor, basis = None, "-"
        rows.append((name, r["calls"], ms, floor, basis))
    rows.sort(key=lambda x: -x[2])
    print(f"step {prof['step']}: {prof['tokens']} tokens, {prof['step_wall_ms']:.2f} ms wall, "
          f"ranges {total:.2f} ms; {P / 1e9:.3f} B parameters; copy {a.copy_gbs:.0f} GB/s, GEMM "
          f"{a.gemm_tflops:.0f} TFLOP/s")
    print(f"| range | calls | ms | share | floor ms | basis | ms / floor |")
    print("|---|---|---|---|---|---|---|")
    floor_sum = 0.0
    for name, calls, ms, floor, basis in rows:
        fl = "" if floor is None else f"{floor:.3f}"
        ratio = "" if not floor else f"{ms / floor:.2f}"
        floor_sum += floor or 0.0
        print(f"| {name} | {calls} | {ms:.3f} | {100 * ms / total:.1f}% | {fl} | {basis} | {ratio} |")
    print(f"sum of floors {floor_sum:.2f} ms against {total:.2f} ms of ranges")


if __name__ == "__main__":
    main()
