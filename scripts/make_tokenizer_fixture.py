#!/usr/bin/env python3
"""Writes tests/data/tokenizer/qwen35_style_2k.json: a byte-level BPE tokenizer.json with Qwen3.5's
normalizer (NFC), pre-tokenizer (Split with Qwen3.5's pattern, isolated; ByteLevel without prefix
space or regex) and decoder (ByteLevel), 2,048 ids, trained with HF tokenizers on this
repository's English docs. The C++ tests (test_prepare_text: prepare + training end to end) use
it. Run in build/pyenv: build/pyenv/bin/python scripts/make_tokenizer_fixture.py
"""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "text"))
import check_tokenizer_vs_hf as tv  # noqa: E402

texts = [open(f, encoding="utf-8").read()
         for f in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
tok = tv.train("qwen35", texts, 2048)
out = os.path.join(ROOT, "tests", "data", "tokenizer", "qwen35_style_2k.json")
tok.save(out)
print(f"wrote {out}: {tok.get_vocab_size()} ids")
