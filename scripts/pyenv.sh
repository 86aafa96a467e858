#!/usr/bin/env bash
# Creates build/pyenv, a Python virtual environment with the pinned packages of
# scripts/pyenv-requirements.txt (PyPI): Hugging Face `tokenizers` for the tokenizer exactness test
# (tests/text/check_tokenizer_vs_hf.py), torch, nanobind, scikit-build-core, pytest and
# transformers for gdntrain's Python package and its tests (tests/python). The tests that need it
# fail when it is absent. Safe to run repeatedly: it does nothing when the environment already has
# exactly these pins (a copy of the requirements file is kept in the venv as a stamp).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/build/pyenv"
req="$root/scripts/pyenv-requirements.txt"
stamp="$venv/gdntrain-requirements.txt"
if [ -x "$venv/bin/python" ] && cmp -s "$req" "$stamp"; then
  exit 0
fi
echo "setup: creating/updating $venv with the packages of $req (PyPI; torch is ~4.7 GB, ~2 min)" >&2
mkdir -p "$root/build"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
cp "$req" "$stamp"
