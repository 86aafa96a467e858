"""Prints the table of docs/PYTHON.md: per case of test_ops_cpu.py, the cpu backend's (float32)
relative L2 error against the ref backend (float64), forward and backward (max over outputs /
gradients), its tolerance, and the ref backend's error against the plain-torch formula. Run from
tests/python with build/pyenv/bin/python and PYTHONPATH=python:build/cpu/python."""
import sys

import torch
sys.path.insert(0, ".")
from test_ops_cpu import CASES, _cast
from _support import grads_of, rel_l2
for name, mk in CASES.items():
    fn, inputs, formula, tol = mk()
    o32, g32 = grads_of(fn, _cast(inputs, torch.float32))
    o64, g64 = grads_of(fn, inputs)
    of, gf = grads_of(formula, inputs)
    ef = max(rel_l2(a, b) for a, b in zip(o32, o64) if a is not None)
    eb = max(rel_l2(a, b) for a, b in zip(g32, g64) if a is not None)
    rf = max([rel_l2(a, b) for a, b in zip(o64, of) if a is not None]
             + [rel_l2(a, b) for a, b in zip(g64, gf) if a is not None])
    print(f"| {name} | {ef:.1e} | {eb:.1e} | {tol[0]:.0e} / {tol[1]:.0e} | {rf:.1e} |")
