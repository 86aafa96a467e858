"""One table from bench/stack_bench.sh's output folder: gdntrain's runs (train_bench.sh logs) and
the PyTorch stack's (hf_stack.py JSON), tokens/s, MFU, memory, launch to first step, ratios."""
import glob
import json
import os
import re
import statistics
import sys


def gdn_run(log):
    text = open(log).read()
    steps = re.findall(r"step +(\d+)/(\d+) \|.*?\| ([0-9.]+) tok/s \| MFU ([0-9.]+)%", text)
    steady = [(float(t), float(m)) for s, n, t, m in steps if int(s) > 4]
    mem = re.search(r"device memory in use after the first step: ([0-9.]+) GiB", text)
    first = re.search(r"first step finished ([0-9.]+) s after launch", text)
    return dict(tok_s=statistics.median(t for t, _ in steady) if steady else None,
                mfu=statistics.median(m for _, m in steady) if steady else None,
                mem_gib=float(mem.group(1)) if mem else None,
                first_s=float(first.group(1)) if first else None)


def main(out):
    hf = {}
    for f in glob.glob(os.path.join(out, "hf_*.json")):
        shape = os.path.basename(f)[3:-5]
        hf[shape.lower()] = json.load(open(f))
    print(f"{'run':<40} {'tokens/s':>9} {'MFU':>6} {'memory GiB':>11} {'1st step s':>10}"
          f" {'x tok/s':>8} {'x mem':>6}")
    for log in sorted(glob.glob(os.path.join(out, "gdn", "train_*.log"))):
        name = os.path.basename(log)[len("train_"):-4]
        shape = name.split("_")[0]
        r = gdn_run(log)
        p = hf.get(shape, {})
        xt = r["tok_s"] / p["tok_s"] if r["tok_s"] and p.get("tok_s") else float("nan")
        xm = r["mem_gib"] / p["peak_GiB"] if r["mem_gib"] and p.get("peak_GiB") else float("nan")
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"gdntrain {name:<31} {fmt(r['tok_s'], '9.0f')} {fmt(r['mfu'], '5.1f')}% "
              f"{fmt(r['mem_gib'], '11.2f')} {fmt(r['first_s'], '10.1f')} {xt:8.2f} {xm:6.2f}")
    for shape, p in sorted(hf.items()):
        if "tok_s" not in p:
            print(f"PyTorch stack {shape}: {p}")
            continue
        print(f"{'PyTorch stack (HF + fla) ' + shape + ' 1doc':<40} {p['tok_s']:9.0f} "
              f"{100 * p['mfu_vs_989']:5.1f}% {p['peak_GiB']:11.2f} "
              f"{p.get('launch_to_first_step_s') or float('nan'):10.1f} {1.0:8.2f} {1.0:6.2f}")
    print("x tok/s, x mem: gdntrain over the PyTorch stack of the same shape (1 sequence/step). "
          "Memory: gdntrain = device memory in use (cudaMemGetInfo, context included); "
          "PyTorch = torch.cuda.max_memory_allocated.")


if __name__ == "__main__":
    main(sys.argv[1])
