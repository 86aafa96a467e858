"""Helpers of the Python op tests (tests/python)."""
import torch


def rel_l2(a, b):
    """Relative L2 error ||a - b|| / ||b|| in float64 (the probe's metric, src/backend/probe.cpp);
    ||a - b|| when b is zero."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d


def grads_of(fn, inputs, dy_seed=0, dy_round=None):
    """Runs fn(*inputs) (leaf tensors that require grad), backpropagates a seeded random cotangent
    through every output and returns (outputs, [input.grad]). None inputs stay None. dy_round: a
    dtype the cotangents are rounded to first (so that a bf16 run and a float64 run of the same
    rounded inputs get the same cotangents)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())
              for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    g = torch.Generator().manual_seed(dy_seed)
    loss = 0
    for o in outs:
        if o is None:
            continue
        dy = torch.randn(o.shape, generator=g, dtype=torch.float64)
        if dy_round is not None:
            dy = dy.to(dy_round)
        dy = dy.to(device=o.device, dtype=o.dtype)
        loss = loss + (o * dy).sum()
    loss.backward()
    return ([o.detach() if o is not None else None for o in outs],
            [None if t is None or not t.requires_grad else t.grad for t in leaves])


def assert_close_rel(name, got, want, tol):
    err = rel_l2(got, want)
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol:.1e}"
    return err
