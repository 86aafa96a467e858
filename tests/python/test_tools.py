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
