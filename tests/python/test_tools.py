"""gdntrain.Tokenizer and gdntrain.probe (python/gdntrain/tools.py): the tokenizer gives HF
`tokenizers`' ids and decode on a Qwen3.5-style tokenizer.json; the probe reports every op of a
training step of the tiny model, each within its tolerance of the fp64 reference; bad input
raises with the cause named."""
import os

import pytest
from tokenizers import Tokenizer as HfTokenizer

import gdntrain

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "data", "tokenizer",
                       "qwen35_style_2k.json")
TEXTS = ["Hello, world! It's 2026-12-01.", "  leading spaces and\ttabs\nnew lines\r\n",
         "Grüße aus Köln — naïve café", "数字 123456 和 中文 混合", "emoji 🙂🙃 and <|im_start|>user",
         ""]


def test_tokenizer_matches_hf():
    ours, hf = gdntrain.Tokenizer(FIXTURE), HfTokenizer.from_file(FIXTURE)
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text).ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), text
    assert ours.token_to_id("<|im_start|>") == hf.token_to_id("<|im_start|>") == 1
    assert ours.token_to_id("no such token at all") is None
    assert "BPE" in repr(ours)


def test_tokenizer_errors_name_the_cause(tmp_path):
    with pytest.raises(RuntimeError, match="missing.json"):
        gdntrain.Tokenizer(tmp_path / "missing.json")
    ours = gdntrain.Tokenizer(FIXTURE)
    with pytest.raises(RuntimeError, match="id"):
        ours.decode([10 ** 9])


def test_probe_reports_every_op_of_the_tiny_model():
    decisions = gdntrain.probe("tiny", "cpu")
    ops = {d["op"] for d in decisions}
    for op in ("embedding", "rmsnorm", "causal_conv1d", "gated_delta_rule", "gated_rmsnorm",
               "gated_attention", "linear_cross_entropy", "gemm"):
        assert op in ops, f"{op} missing from {sorted(ops)}"
    for d in decisions:
        assert d["backend"] == "cpu" and d["impl"].startswith("cpu"), d
        # every fp32 (cpu) tolerance is at most 1e-5 (each op's tolerance() in src/ops/*/op.cpp),
        # but axpy's and mul's backward, which the probe does not measure (tolerance 1)
        assert 0 <= d["fwd_err"] <= 1e-5, d
        if d["op"] not in ("axpy", "mul"):
            assert 0 <= d["bwd_err"] <= 1e-5, d


def test_probe_bad_input():
    with pytest.raises(RuntimeError, match="backend"):
        gdntrain.probe("tiny", "tpu")
    with pytest.raises(RuntimeError, match="recompute"):
        gdntrain.probe("tiny", "cpu", recompute="sometimes")


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "golden", "r1_tied")


def test_dump_matches_hf_float64_without_copies():
    """gdntrain.dump of the r1_tied fixture (scripts/make_golden.py: HF transformers in float64,
    document by document) on the fp64 ref backend: logits, losses and every gradient within the
    C++ golden test's bounds (tests/model/test_golden.cpp), as arrays over gdntrain's memory."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file
    res = gdntrain.dump(GOLDEN, os.path.join(GOLDEN, "docs.safetensors"), "ref")
    want = load_file(os.path.join(GOLDEN, "out.safetensors"))
    got = res["tensors"]
    assert set(got) == set(want)
    assert res["docs"] == 4 and res["tokens"] == 5 + 1 + 70 + 13
    for name, w in want.items():
        g = got[name]
        assert g.dtype == np.float32 and g.shape == w.shape, name
        d = np.linalg.norm(g.astype(np.float64) - w) / max(np.linalg.norm(w), 1e-300)
        bound = 1e-6 if not name.startswith("grad.") else 2e-6
        if name.endswith("loss_sum") and w.item() == 0:
            assert g.item() == 0, name
            continue
        assert d <= bound, f"{name}: relative error {d:.3e} > {bound:.0e}"
    # no copy: torch shares the array's memory, and the array outlives the result dict
    a = got["doc0.logits"]
    t = torch.from_numpy(a)
    assert t.data_ptr() == a.__array_interface__["data"][0]
    del res, got
    assert torch.isfinite(t).all()


def test_dump_bad_input_names_the_cause(tmp_path):
    with pytest.raises(RuntimeError, match="no_such_dir"):
        gdntrain.dump(tmp_path / "no_such_dir", os.path.join(GOLDEN, "docs.safetensors"))
