#!/usr/bin/env python3
"""Checks that a checkpoint written by gdntrain loads in Hugging Face transformers and gives the
same logits as gdntrain.

  python3 scripts/check_hf_load.py CHECKPOINT_DIR GDNTRAIN_BINARY [--backend ref|cpu]

It writes a few random documents, runs `gdntrain dump` on them, loads CHECKPOINT_DIR with
transformers (AutoModelForCausalLM, or Qwen3_5ForConditionalGeneration for the nested layout) in
float64, runs each document, and prints the relative L2 error of the logits per document. Exits
non-zero when any error exceeds the tolerance (1e-6 against the fp64 `ref` backend, 1e-4 against
`cpu`).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("gdntrain")
    ap.add_argument("--backend", default="ref", choices=["ref", "cpu", "cuda"])
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    nested = cfg.get("model_type") == "qwen3_5"
    vocab = (cfg["text_config"] if nested else cfg)["vocab_size"]
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in (7, 1, 66, 20)]
    with tempfile.TemporaryDirectory() as tmp:
        docs_path = os.path.join(tmp, "docs.safetensors")
        out_path = os.path.join(tmp, "out.safetensors")
        save_file({f"doc{i}.input_ids": d for i, d in enumerate(docs)}, docs_path)
        subprocess.run([args.gdntrain, "dump", "--model", args.checkpoint, "--docs", docs_path,
                        "--out", out_path, "--backend", args.backend], check=True)
        ours = load_file(out_path)
    if nested:
        model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
            args.checkpoint, dtype=torch.float64, attn_implementation="eager")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    tol = 1e-6 if args.backend == "ref" else 1e-4 if args.backend == "cpu" else 3e-2
    worst = 0.0
    with torch.no_grad():
        for i, d in enumerate(docs):
            hf = model(input_ids=d[None]).logits[0].double().numpy()
            gd = ours[f"doc{i}.logits"].astype(np.float64)
            err = np.linalg.norm(hf - gd) / np.linalg.norm(hf)
            worst = max(worst, err)
            print(f"doc{i} ({len(d)} tokens): relative L2 error of logits {err:.2e}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: worst {worst:.2e} "
          f"(tolerance {tol:g}, backend {args.backend})")
    sys.exit(0 if worst <= tol else 1)


if __name__ == "__main__":
    main()
