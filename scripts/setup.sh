#!/usr/bin/env bash
# Installs what gdntrain needs to build and test, from Debian packages, when it is missing.
# Nothing is downloaded at build time. Safe to run repeatedly: when every package is installed it
# does nothing (no apt-get update, no install).
#   scripts/setup.sh           install what is missing (as root; otherwise print the command)
#   scripts/setup.sh --check   only report: list what is missing, exit 1 if anything is
# GDN_SETUP_DEBUG_TOOLS=1 adds clang and its sanitizer/libFuzzer runtime (the `debug` preset).
set -euo pipefail

# One Debian package a line (other branches add lines here; keep it a plain list).
PACKAGES=(
  cmake
  ccache
  ninja-build
  g++
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libopenblas-dev
  nlohmann-json3-dev
  libcli11-dev
  libfmt-dev
  libpcre2-dev
  libutf8proc-dev
  zlib1g-dev
  libzstd-dev
  pkg-config
  python3-venv
  libopenmpi-dev
  openmpi-bin
)
DEBUG_PACKAGES=(
  clang
  libclang-rt-14-dev
)

check_only=0
for arg in "$@"; do
  case "$arg" in
    --check) check_only=1 ;;
    -h | --help)
      sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "setup: unknown argument '$arg' (use --check or nothing)" >&2
      exit 2
      ;;
  esac
done

wanted=("${PACKAGES[@]}")
[ "${GDN_SETUP_DEBUG_TOOLS:-0}" = 1 ] && wanted+=("${DEBUG_PACKAGES[@]}")

# dpkg's own record of what is installed ("install ok installed"), not a guess from file paths.
installed() {
  [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" = "ii " ]
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "setup: dpkg-query is not available (not a Debian system?); install the equivalents of:" \
    "${wanted[*]}" >&2
  exit 1
fi

pyenv() {  # build/pyenv with HF tokenizers, for the tokenizer exactness test
  "$(dirname "$0")/pyenv.sh" || echo "setup: build/pyenv could not be made; test_tokenizer_vs_hf will fail" >&2
}
missing=()
for pkg in "${wanted[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
  [ $check_only = 1 ] && echo "setup: every package is installed" && exit 0
  pyenv
  exit 0
fi

install_line="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
if [ $check_only = 1 ]; then
  echo "setup: missing packages: ${missing[*]}"
  echo "setup: to install them, run as root: $install_line"
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get is not available; install these packages by hand: ${missing[*]}" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing packages: ${missing[*]}" >&2
  echo "setup: installing needs root; run this line as root (e.g. with sudo), then again:" >&2
  echo "  $install_line" >&2
  exit 1
fi
echo "setup: installing missing packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done" >&2
pyenv
