#!/usr/bin/env python3
"""Tokens/s per core: `gdntrain prepare --tokenizer` against HF `tokenizers` on the same corpus.

Run in build/pyenv (scripts/pyenv.sh), from the repository root:
  build/pyenv/bin/python bench/tokenizer_bench.py [--tokenizer T.json] [--mb 20]
Without --tokenizer it trains the Qwen3.5-style byte-level BPE of tests/text/
check_tokenizer_vs_hf.py (32,768 merges). The corpus (JSONL, field "text") is half English prose
(the repository's docs and /usr/share/common-licenses, paragraph by paragraph) and half the
test's synthetic multilingual text, about --mb MB in all.
Measured side by side, one process at a time:
  * gdntrain prepare --threads 1 (its own timer: reading, JSON, tokenizing and writing; the
    tokenizer.json load is excluded) and with --threads N;
  * HF encode_batch with RAYON_NUM_THREADS=1 (a child process, so the variable takes effect),
    and with the default thread pool;
  * bpe-qwen (PyPI), when installed, on vocab.json/merges.txt of the same tokenizer.
Every engine's ids are checked against HF's (count of documents that differ).
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "text"))
import check_tokenizer_vs_hf as tv  # noqa: E402


def english_paragraphs():
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]
                   + sorted(glob.glob("/usr/share/common-licenses/*")))
    paras = []
    for f in files:
        try:
            text = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        paras += [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]
    return paras


def make_corpus(path, mb):
    import random
    rng = random.Random(1)
    paras = english_paragraphs()
    _, lexicons = tv.training_text(7, 1, 10)
    docs, size = [], 0
    while size < mb * 1e6:
        if rng.random() < 0.5:
            d = "\n\n".join(rng.choice(paras) for _ in range(rng.randint(1, 8)))
        else:
            d = tv.make_text(rng, lexicons, rng.randint(50, 800))
        docs.append(d)
        size += len(d.encode())
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    return docs


HF_CHILD = r'''
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
docs = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
t = time.perf_counter()
n = 0
ids = []
for i in range(0, len(docs), 1000):
    for e in tok.encode_batch(docs[i:i + 1000], add_special_tokens=False):
        n += len(e.ids)
        ids.append(e.ids)
dt = time.perf_counter() - t
json.dump({"tokens": n, "seconds": dt}, open(sys.argv[3], "w"))
json.dump(ids, open(sys.argv[3] + ".ids", "w"))
'''


def hf_run(tok_path, corpus, workdir, threads):
    env = dict(os.environ)
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    else:
        env.pop("RAYON_NUM_THREADS", None)
    out = os.path.join(workdir, f"hf_{threads}.json")
    subprocess.run([sys.executable, "-c", HF_CHILD, tok_path, corpus, out], env=env, check=True)
    r = json.load(open(out))
    return r["tokens"], r["seconds"], json.load(open(out + ".ids"))


def gdn_run(gdntrain, tok_path, corpus, workdir, threads):
    prefix = os.path.join(workdir, f"gdn_{threads}")
    p = subprocess.run([gdntrain, "prepare", "--tokenizer", tok_path, "--input", corpus,
                        "--output", prefix, "--threads", str(threads), "--no-progress"],
                       stdout=subprocess.PIPE, check=True)
    line = p.stdout.decode()
    m = re.search(r"prepared (\d+) documents, (\d+) tokens .*?; ([\d.]+) s", line)
    docs, tokens, secs = int(m.group(1)), int(m.group(2)), float(m.group(3))
    _, seqs = tv.read_indexed(prefix)
    return tokens - docs, secs, [s[:-1] for s in seqs]  # without the EOS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gdntrain", default=os.path.join(ROOT, "build/cpu/apps/gdntrain/gdntrain"))
    ap.add_argument("--tokenizer")
    ap.add_argument("--mb", type=float, default=20)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "tokenizer_bench"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tok_path = args.tokenizer
    if not tok_path:
        tok_path = os.path.join(args.workdir, "qwen35_style.tokenizer.json")
        texts, _ = tv.training_text(7, 1000, 300)
        tv.train("qwen35", texts, 256 + len(tv.SPECIALS) + 32768).save(tok_path)
    corpus = os.path.join(args.workdir, "corpus.jsonl")
    docs = make_corpus(corpus, args.mb)
    mb = os.path.getsize(corpus) / 1e6
    ncpu = os.cpu_count()
    print(f"corpus: {len(docs)} documents, {mb:.1f} MB JSONL; tokenizer {tok_path}; {ncpu} cores")
    rows = []
    hf_tok, hf_s, hf_ids = hf_run(tok_path, corpus, args.workdir, 1)
    rows.append(("HF tokenizers encode_batch, RAYON_NUM_THREADS=1", 1, hf_tok, hf_s, 0))
    t, s, _ = hf_run(tok_path, corpus, args.workdir, 0)
    rows.append((f"HF tokenizers encode_batch, default pool", ncpu, t, s, 0))
    for th in (1, ncpu):
        t, s, ids = gdn_run(args.gdntrain, tok_path, corpus, args.workdir, th)
        diff = sum(a != b for a, b in zip(ids, hf_ids)) + abs(len(ids) - len(hf_ids))
        rows.append((f"gdntrain prepare --threads {th}", th, t, s, diff))
    try:
        import bpe_qwen
        from tokenizers import Tokenizer
        d = os.path.join(args.workdir, "bpe_qwen_files")
        os.makedirs(d, exist_ok=True)
        Tokenizer.from_file(tok_path).model.save(d)
        q = bpe_qwen.QwenTokenizer(d)
        t0 = time.perf_counter()
        ids = [q.encode(x) for x in docs]
        s = time.perf_counter() - t0
        diff = sum(a != b for a, b in zip(ids, hf_ids))
        rows.append(("bpe-qwen QwenTokenizer.encode (one thread)", 1, sum(map(len, ids)), s, diff))
    except Exception as e:  # noqa: BLE001
        print(f"bpe-qwen: not measured ({type(e).__name__}: {e})")
    print(f"{'engine':52s} {'thr':>3s} {'tokens':>10s} {'s':>7s} {'tok/s':>10s} "
          f"{'tok/s/core':>10s} {'MB/s/core':>9s} {'docs≠HF':>7s}")
    for name, th, t, s, diff in rows:
        print(f"{name:52s} {th:3d} {t:10d} {s:7.2f} {t / s:10.0f} {t / s / th:10.0f} "
              f"{mb / s / th:9.2f} {diff:7d}")


if __name__ == "__main__":
    main()
