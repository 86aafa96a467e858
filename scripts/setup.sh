#!/usr/bin/env bash
# Installs what gdntrain needs to build and test, from Debian packages, when it is missing.
# Nothing is downloaded at build time. Safe to run repeatedly; does nothing when all is present.
# On machines without apt (or without network) it only checks and reports what is missing.
set -euo pipefail

# Header or tool each package provides, so we can also detect installs done outside dpkg.
declare -A NEED=(
  [cmake]="cmake"
  [ccache]="ccache"
  [ninja-build]="ninja"
  [g++]="g++"
  [libgtest-dev]="/usr/include/gtest/gtest.h"
  [libgmock-dev]="/usr/include/gmock/gmock.h"
  [libbenchmark-dev]="/usr/include/benchmark/benchmark.h"
  [libopenblas-dev]="openblas"
  [nlohmann-json3-dev]="/usr/include/nlohmann/json.hpp"
  [libcli11-dev]="/usr/include/CLI/CLI.hpp"
  [libfmt-dev]="/usr/include/fmt/format.h"
  [libpcre2-dev]="/usr/include/pcre2.h"
  [libutf8proc-dev]="/usr/include/utf8proc.h"
  [zlib1g-dev]="/usr/include/zlib.h"
  [libzstd-dev]="/usr/include/zstd.h"
  [pkg-config]="pkg-config"
  [python3-venv]="/usr/lib/python3.11/ensurepip/__init__.py"
)

have() {
  local what=$1
  case "$what" in
    /*) [ -e "$what" ] ;;
    openblas) ls /usr/lib/x86_64-linux-gnu/libopenblas.so* /usr/lib/*/libopenblas.so* \
                 /usr/lib64/libopenblas.so* >/dev/null 2>&1 ;;
    *) command -v "$what" >/dev/null 2>&1 ;;
  esac
}

missing=()
for pkg in "${!NEED[@]}"; do
  have "${NEED[$pkg]}" || missing+=("$pkg")
done
# Optional: clang and its runtime for the debug (ASan/UBSan + libFuzzer) preset.
if [ "${GDN_SETUP_DEBUG_TOOLS:-0}" = 1 ]; then
  have clang++ || missing+=(clang)
  [ -e /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a ] ||
    missing+=(libclang-rt-14-dev)
fi

pyenv() {  # build/pyenv with HF tokenizers, for the tokenizer exactness test
  "$(dirname "$0")/pyenv.sh" || echo "setup: build/pyenv could not be made; test_tokenizer_vs_hf will fail" >&2
}
if [ ${#missing[@]} -eq 0 ]; then
  pyenv
  exit 0
fi
echo "setup: installing missing packages: ${missing[*]}" >&2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get is not available; install these packages by hand: ${missing[*]}" >&2
  exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done" >&2
pyenv
