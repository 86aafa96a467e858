"""Issue 26's GPU measurement: Hugging Face transformers' Qwen3.5 trained with gdntrain's kernels
(gdntrain.torch.apply_to_qwen3_5) against the same model with the peers' kernels (fla's GDN, with
its FlashQLA backend when flash_qla imports, + Liger's apply_liger_kernel_to_qwen3_5), one variant
per process so that neither patch sees the other's:

    PYTHONPATH=PEERS:build/cuda/python python3 bench/hf_patched.py --shape 0.8B --variant peers --out A.json
    PYTHONPATH=PEERS:build/cuda/python python3 bench/hf_patched.py --shape 0.8B --variant gdntrain --out B.json
    python3 bench/hf_patched.py --compare A.json B.json

Same model and steps as ../shared/bench/hf_baseline.py (its SHAPES and flops formula, copied into
PEERS): random init with seed 0, bf16 weights, fused AdamW, one 8192-token sequence a step, here
with fresh random ids every step (the same on both sides) and the loss of every step recorded.
Without --lift-fla-guard, fla refuses its Triton GDN backward on Hopper with Triton < 3.7.1
(PEERS.md), so the peers' variant needs its FlashQLA backend. Prints and writes tokens/s (median
of steps 3..N), MFU by hf_baseline's formula, peak memory, the losses.
"""
import argparse
import json
import sys
import time


def run(shape, variant, steps, T, lift_guard):
    import torch
    import hf_baseline
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    c = hf_baseline.SHAPES[shape]
    cfg = Qwen3_5TextConfig(vocab_size=248320, **c)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).to("cuda", torch.bfloat16)
    if variant == "peers":
        if lift_guard:  # as hf_stack.py and PEERS.md: fla's Hopper/Triton < 3.7.1 backward guard
            import fla.ops.common.chunk_o as co
            co.TRITON_ABOVE_3_7_1 = True
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_qwen3_5
        apply_liger_kernel_to_qwen3_5(model=model)
    else:
        import gdntrain.torch as gt
        gt.apply_to_qwen3_5(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 248320, (1, T), device="cuda", generator=gen) for _ in range(steps)]
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for ids in batches:
        t0 = time.time()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))  # waits for the step
        times.append(time.time() - t0)
    steady = sorted(times[2:])[len(times[2:]) // 2]
    tps = T / steady
    return dict(shape=shape, variant=variant, steps=steps, tokens_per_step=T,
                tok_s=tps, mfu_vs_989=hf_baseline.flops_per_token(c, T) * tps / 989e12,
                peak_GiB=torch.cuda.max_memory_allocated() / 2**30, first_step_s=times[0],
                losses=losses, torch=torch.__version__)


def compare(a_path, b_path):
    a, b = json.load(open(a_path)), json.load(open(b_path))
    n = min(len(a["losses"]), len(b["losses"]))
    diffs = [abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a["losses"][:n], b["losses"][:n])]
    print(f"{a['shape']}: {a['variant']} {a['tok_s']:.0f} tok/s {a['peak_GiB']:.2f} GiB | "
          f"{b['variant']} {b['tok_s']:.0f} tok/s {b['peak_GiB']:.2f} GiB | speed ratio "
          f"{b['tok_s'] / a['tok_s']:.3f}, memory ratio {b['peak_GiB'] / a['peak_GiB']:.3f} | "
          f"losses over {n} steps: max relative difference {max(diffs):.3g} (step "
          f"{diffs.index(max(diffs)) + 1}), final {a['losses'][n - 1]:.5f} vs {b['losses'][n - 1]:.5f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["0.8B", "4B"])
    ap.add_argument("--variant", choices=["peers", "gdntrain"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out")
    ap.add_argument("--lift-fla-guard", action="store_true",
                    help="let fla run its Triton GDN backward on Hopper with Triton < 3.7.1 (fla "
                         "issue 640: its gradients may be wrong; timings only)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    a = ap.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    if not (a.shape and a.variant and a.out):
        ap.error("--shape, --variant and --out are required (or --compare A B)")
    r = run(a.shape, a.variant, a.steps, a.tokens, a.lift_fla_guard)
    json.dump(r, open(a.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
