"""Runs the PyTorch stack's training step for one shape through ../shared/bench/hf_baseline.py
(copied into the peers folder) and records the wall time from this process's start to the end of
the first step as well as the script's own numbers. Used by bench/stack_bench.sh."""
import argparse
import json
import sys
import time

T_START = time.time()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", required=True, help="folder with fla, liger_kernel, hf_baseline.py")
    ap.add_argument("--shape", required=True, choices=["0.8B", "4B"])
    ap.add_argument("--liger", action="store_true", help="also patch in Liger kernels")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, a.peers)
    import hf_baseline  # noqa: E402

    # As PEERS.md: lift fla's Hopper/Triton backward guard (timing only).
    import fla.ops.common.chunk_o as co  # noqa: E402

    co.TRITON_ABOVE_3_7_1 = True
    t_import = time.time() - T_START
    # hf_baseline.run's first step ends with the first optimizer step and the
    # torch.cuda.synchronize() after it: record when that synchronisation returns, from this
    # process's start (earlier synchronisations, e.g. while building the model, do not count).
    import torch  # noqa: E402

    opt_steps, first_sync = [], []
    real_sync, real_opt_step = torch.cuda.synchronize, torch.optim.AdamW.step

    def opt_step(self, *args, **kwargs):
        out = real_opt_step(self, *args, **kwargs)
        opt_steps.append(1)
        return out

    def sync(*args, **kwargs):
        real_sync(*args, **kwargs)
        if opt_steps and not first_sync:
            first_sync.append(time.time() - T_START)

    torch.optim.AdamW.step = opt_step
    torch.cuda.synchronize = sync
    r = hf_baseline.run(a.shape, a.liger)
    # hf_baseline's first_step_s counts the first step only; add the time before it (imports,
    # model construction) measured from this process's start, so it compares with gdntrain's
    # launch-to-first-step.
    r["imports_s"] = t_import
    r["launch_to_first_step_s"] = first_sync[0] if first_sync else None
    r["process_s"] = time.time() - T_START
    json.dump(r, open(a.out, "w"), indent=1)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
