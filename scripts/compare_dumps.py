#!/usr/bin/env python3
"""Per-tensor relative L2 errors between two `gdntrain dump` outputs (or a dump and a golden
out.safetensors): which logits, losses or gradients differ, worst first.

  python3 scripts/compare_dumps.py A.safetensors B.safetensors [--top N]
"""
import argparse

import numpy as np
from safetensors.numpy import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    a, b = load_file(args.a), load_file(args.b)
    rows = []
    for k in sorted(set(a) & set(b)):
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        den = np.linalg.norm(y)
        err = np.linalg.norm(x - y) / den if den > 0 else np.linalg.norm(x - y)
        rows.append((err, k, float(np.abs(x).max()), float(np.abs(y).max())))
    for err, k, ma, mb in sorted(rows, reverse=True)[: args.top]:
        print(f"{err:10.3e}  {k:70s} max|a| {ma:.3e}  max|b| {mb:.3e}")
    only = sorted(set(a) ^ set(b))
    if only:
        print("in one file only:", only[:10])


if __name__ == "__main__":
    main()
