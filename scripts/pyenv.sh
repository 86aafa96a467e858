#!/usr/bin/env bash
# Creates build/pyenv, a Python virtual environment with Hugging Face `tokenizers` (PyPI), when it
# is missing. The tokenizer exactness test (tests/text/check_tokenizer_vs_hf.py) runs in it and
# fails when it is absent. Safe to run repeatedly.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/build/pyenv"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import tokenizers" 2>/dev/null; then
  exit 0
fi
echo "setup: creating $venv with the tokenizers package (PyPI)" >&2
mkdir -p "$root/build"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check tokenizers
