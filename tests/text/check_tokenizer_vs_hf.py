#!/usr/bin/env python3
"""gdntrain's tokenizer against Hugging Face `tokenizers`, id for id.

Trains byte-level BPE tokenizers with HF `tokenizers` on deterministic synthetic multilingual text
(Qwen3.5's normalizer / pre-tokenizer / decoder settings with >= 32k merges, plus the Qwen2 and
GPT-2 pattern variants with smaller vocabularies), writes a multilingual test corpus, and checks:
  * `gdntrain tokenize --json` gives the ids HF gives, document by document;
  * `gdntrain tokenize --json --decode` gives HF's decode, which is NFC(x) (x itself when x is
    NFC): decode(encode(x)) == x;
  * `gdntrain prepare --tokenizer` writes exactly HF's ids + the EOS per document (.bin/.idx),
    with several threads.
The first mismatch is printed with context. Exit status 0 only when everything matches.

Run by ctest (test_tokenizer_vs_hf) with build/pyenv/bin/python (scripts/pyenv.sh makes it).
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time
import unicodedata

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<think>",
            "</think>"]

# --- deterministic synthetic text -------------------------------------------------------------

LATIN = "abcdefghijklmnopqrstuvwxyz"
SCRIPTS = {
    # (characters, combining marks or None, word length range, separator)
    "latin": (LATIN, None, (1, 10), " "),
    "latin_acc": (LATIN + "éèêàçöüßñå", None, (2, 9), " "),
    "cjk": ("".join(chr(c) for c in range(0x4E00, 0x4E00 + 2500)), None, (1, 4), ""),
    "hira": ("".join(chr(c) for c in range(0x3041, 0x3097)), None, (1, 6), ""),
    "kata": ("".join(chr(c) for c in range(0x30A1, 0x30FB)), None, (2, 6), ""),
    "hangul": ("".join(chr(c) for c in range(0xAC00, 0xAC00 + 1200)), None, (1, 5), " "),
    "arabic": ("".join(chr(c) for c in range(0x0627, 0x064B)),
               "".join(chr(c) for c in range(0x064B, 0x0653)), (2, 8), " "),
    "devanagari": ("".join(chr(c) for c in range(0x0915, 0x0939)),
                   "".join(chr(c) for c in [0x093E, 0x093F, 0x0940, 0x0941, 0x0947, 0x094B, 0x094D,
                                            0x0902, 0x093C]), (2, 7), " "),
    "thai": ("".join(chr(c) for c in range(0x0E01, 0x0E2F)),
             "".join(chr(c) for c in [0x0E31, 0x0E34, 0x0E35, 0x0E36, 0x0E37, 0x0E38, 0x0E48,
                                      0x0E49, 0x0E4A, 0x0E4B]), (2, 8), ""),
    "cyrillic": ("".join(chr(c) for c in range(0x0430, 0x0450)), None, (2, 9), " "),
}
PUNCT = list(".,;:!?()[]{}\"'-–—…«»、。！？「」") + ["'s", "'ll", "'re", "'VE", "'D", "'M", "'T"]
EMOJI = ["😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "🧑🏿‍💻", "✨", "🤖"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\t\t", "    \n", "\u3000", "\u00a0"]


def make_lexicon(rng, script, n):
    chars, marks, (lo, hi), _ = SCRIPTS[script]
    words = []
    for _ in range(n):
        w = []
        for _ in range(rng.randint(lo, hi)):
            w.append(rng.choice(chars))
            if marks and rng.random() < 0.5:
                w.append(rng.choice(marks))
        words.append("".join(w))
    return words


def make_text(rng, lexicons, n_words):
    out = []
    script = "latin"
    for _ in range(n_words):
        if rng.random() < 0.08:
            script = rng.choice(list(SCRIPTS))
        lex = lexicons[script]
        # Zipf-like: low indices much more often, so that frequent subwords exist.
        w = lex[min(int(rng.paretovariate(1.1)) - 1, len(lex) - 1)] if rng.random() < 0.8 \
            else rng.choice(lex)
        if script == "latin" and rng.random() < 0.1:
            w = w.capitalize() if rng.random() < 0.7 else w.upper()
        out.append(w)
        r = rng.random()
        if r < 0.08:
            out.append(rng.choice(PUNCT))
        elif r < 0.12:
            out.append(str(rng.randint(0, 10**rng.randint(1, 7))))
        elif r < 0.13:
            out.append(rng.choice(EMOJI))
        out.append(SCRIPTS[script][3] if rng.random() < 0.9 else rng.choice(SPACES))
    return "".join(out)


def training_text(seed, n_docs, words_per_doc):
    rng = random.Random(seed)
    lexicons = {s: make_lexicon(rng, s, 6000) for s in SCRIPTS}
    return [make_text(rng, lexicons, words_per_doc) for _ in range(n_docs)], lexicons


CODE = '''#include <vector>
int main(int argc, char** argv) {
\tstd::vector<int> v{1, 2, 3};   // comment with  two spaces
\tfor (auto& x : v) x *= 2;
\treturn v.size() == 3 ? 0 : 1;
}
'''
PY = '''def f(x):\r\n    """Docstring."""\r\n    if x >= 10:\r\n        return x ** 2\r\n    return [i for i in range(x)]  # trailing   \r\n'''

HAND_WRITTEN = [
    "Hello world! It's a test: we'll see, they're here, I'VE DONE IT, she'd go, I'm fine.",
    "The quick brown fox jumps over the lazy dog 1234567890 times; 3.14159, 1e-9, 0x1F, $12,345.67",
    "中文测试：今天天气很好，我们去公园散步吧。《红楼梦》是中国古典小说。",
    "日本語のテキストです。ひらがな、カタカナ、漢字が混ざっています。ｶﾀｶﾅ半角",
    "한국어 문장입니다. 안녕하세요! 반갑습니다.",
    "Korean jamo (NFC composes them): \u1100\u1161\u11a8 \u1112\u1161\u11ab",
    "مرحبا بالعالم. هَذَا نَصٌّ عَرَبِيٌّ مَعَ التَّشْكِيلِ ١٢٣٤٥",
    "नमस्ते दुनिया। यह हिन्दी का वाक्य है, क्षत्रिय ज्ञान श्री।",
    "ภาษาไทยมีวรรณยุกต์ เช่น ก่ ก้ ก๊ ก๋ และสระ กิ กี กึ กื กุ กู",
    "Decomposed: e\u0301 a\u0300 o\u0308 n\u0303 — composed: é à ö ñ; Å vs A\u030a; ﬁ ligature",
    "Emoji: 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 skin tone, 🇫🇷🇩🇪 flags, 🧑🏿‍💻 coder, ❤️‍🔥",
    CODE,
    PY,
    "Tabs\tand\t\tspaces    and\n\n\nnewlines\r\n\r\nmixed \t \n  \r\n   end   ",
    "   leading spaces, trailing spaces   ",
    "\n\n\nleading newlines",
    "Special tokens inside text: <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    "<think>\nhmm\n</think>\nHello!<|im_end|><|endoftext|>after",
    "Near misses: <|im_start <|endoftext| <|im_end|x <think >",
    "Whitespace zoo: a\u00a0b\u3000c\u2003d\u200be\u2028f\u0085g\u000bh\u000ci\u001cj\ufeffk",
    "Case folding: 'S 'ſ 'K 'Ll 'RE",
    "Numbers: 2024-01-01 12:34:56 ①②③ ½ ٣٤ ۵۶ ४५ ๕๖ Ⅻ",
    "Marks after non-letters: 1\u0301 -\u0301 \u0301start  \u0301\u0302 x\u20dd",
    "URLs: https://example.com/path?q=1&r=two#frag mail@example.org ~/.config/x.toml",
    "Long run: " + "a" * 300 + " " + "ab" * 150 + " " + " " * 50 + "x" + "\n" * 20,
    "Mixed: English中文日本語한국어العربيةहिन्दीไทย😀end",
    "Single chars: a . , 1 \t \n",
    "Control chars: \u0001\u0002\u007f\u0080\u009f",
    "Supplementary: 𝕳𝖊𝖑𝖑𝖔 𠀀𠀁 𓀀 🀄",
]


def test_corpus(lexicons):
    rng = random.Random(12345)
    docs = list(HAND_WRITTEN)
    for _ in range(150):
        docs.append(make_text(rng, lexicons, rng.randint(5, 200)))
    return docs


# --- tokenizers ---------------------------------------------------------------------------------

def train(kind, texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pattern = QWEN35_PATTERN if kind == "qwen35" else QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def report_ids(name, doc_i, doc, ours, theirs, tok):
    i = first_diff(ours, theirs)
    lo = max(0, i - 5)
    print(f"FAIL [{name}] document {doc_i}: ids differ at position {i} "
          f"(ours {len(ours)} ids, HF {len(theirs)})")
    print(f"  HF   ids[{lo}:{i + 5}] = {theirs[lo:i + 5]} "
          f"tokens {[tok.id_to_token(t) for t in theirs[lo:i + 5]]}")
    print(f"  ours ids[{lo}:{i + 5}] = {ours[lo:i + 5]} "
          f"tokens {[tok.id_to_token(t) if t is not None else None for t in ours[lo:i + 5]]}")
    print(f"  HF decode of the context: {tok.decode(theirs[lo:i + 5], skip_special_tokens=False)!r}")
    print(f"  document: {doc[:300]!r}")


def run(cmd, stdin_text):
    p = subprocess.run(cmd, input=stdin_text.encode(), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    if p.returncode != 0:
        print(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stderr.decode(errors='replace')}")
        sys.exit(1)
    return p.stdout.decode()


def read_indexed(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "bad magic"
    code = idx[17]
    s, d = struct.unpack_from("<QQ", idx, 18)
    lengths = struct.unpack_from(f"<{s}i", idx, 34)
    pointers = struct.unpack_from(f"<{s}q", idx, 34 + 4 * s)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    fmt, size = {4: ("i", 4), 8: ("H", 2)}[code]
    return code, [list(struct.unpack_from(f"<{n}{fmt}", data, p)) for n, p in zip(lengths, pointers)]


def check(name, tok, docs, args, check_prepare):
    path = os.path.join(args.workdir, f"{name}.tokenizer.json")
    tok.save(path)
    merges = len(json.load(open(path, encoding="utf-8"))["model"]["merges"])
    t0 = time.time()
    hf = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    t_hf = time.time() - t0
    stdin = "".join(json.dumps(d) + "\n" for d in docs)
    t0 = time.time()
    out = run([args.gdntrain, "tokenize", "--tokenizer", path, "--json"], stdin)
    t_ours = time.time() - t0
    ours = [json.loads(l) for l in out.split("\n")[:-1]]
    ok = True
    if len(ours) != len(docs):
        print(f"FAIL [{name}]: {len(ours)} results for {len(docs)} documents")
        return False
    n_ids = 0
    for i, (d, a, b) in enumerate(zip(docs, ours, hf)):
        n_ids += len(b)
        if a != b:
            report_ids(name, i, d, a, b, tok)
            return False
    # Decode: ours == HF's == NFC(x).
    dec_in = "".join(json.dumps(ids) + "\n" for ids in hf)
    dec = [json.loads(l) for l in run([args.gdntrain, "tokenize", "--tokenizer", path, "--json",
                                       "--decode"], dec_in).split("\n")[:-1]]
    for i, (d, ids, ours_text) in enumerate(zip(docs, hf, dec)):
        theirs = tok.decode(ids, skip_special_tokens=False)
        want = unicodedata.normalize("NFC", d)
        if ours_text != theirs or ours_text != want:
            j = first_diff(ours_text, want)
            print(f"FAIL [{name}] decode of document {i} differs at char {j}: ours "
                  f"{ours_text[max(0, j - 20):j + 20]!r} HF {theirs[max(0, j - 20):j + 20]!r} "
                  f"NFC(x) {want[max(0, j - 20):j + 20]!r}")
            return False
    if check_prepare:
        jsonl = os.path.join(args.workdir, f"{name}.corpus.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        prefix = os.path.join(args.workdir, f"{name}.prepared")
        run([args.gdntrain, "prepare", "--tokenizer", path, "--input", jsonl, "--output", prefix,
             "--threads", "3", "--batch-kb", "4"], "")
        eos = tok.token_to_id("<|endoftext|>")
        code, seqs = read_indexed(prefix)
        want_code = 8 if tok.get_vocab_size() <= 65536 else 4
        if code != want_code:
            print(f"FAIL [{name}] prepare wrote dtype code {code}, expected {want_code}")
            return False
        if len(seqs) != len(docs):
            print(f"FAIL [{name}] prepare wrote {len(seqs)} documents, expected {len(docs)}")
            return False
        for i, (d, s, b) in enumerate(zip(docs, seqs, hf)):
            if s != b + [eos]:
                report_ids(name + "/prepare", i, d, s, b + [eos], tok)
                return False
    print(f"ok [{name}]: {len(docs)} documents, {n_ids} ids, {merges} merges, vocab "
          f"{tok.get_vocab_size()}; HF encode_batch {t_hf:.2f}s, gdntrain tokenize {t_ours:.2f}s "
          f"(process included); decode round trip ok{'; prepare ok' if check_prepare else ''}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gdntrain", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--merges", type=int, default=32768)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    texts, lexicons = training_text(7, 1000, 300)
    docs = test_corpus(lexicons)
    ok = True
    for name, kind, merges in [("qwen35", "qwen35", args.merges), ("qwen2", "qwen2", 4000),
                               ("gpt2", "gpt2", 4000)]:
        tok = train(kind, texts if kind == "qwen35" else texts[:200], 256 + len(SPECIALS) + merges)
        n = tok.get_vocab_size() - 256 - len(SPECIALS)
        if kind == "qwen35" and n < 32000:
            print(f"FAIL: the trained Qwen3.5-style tokenizer has only {n} merges (< 32000)")
            sys.exit(1)
        ok = check(name, tok, docs, args, check_prepare=(kind == "qwen35")) and ok
    print(f"total {time.time() - t0:.1f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
