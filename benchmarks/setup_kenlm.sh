#!/usr/bin/env bash
# Build KenLM's `lmplz` (and `build_binary`, `query`) from the kenlm source distribution on PyPI,
# into benchmarks/.kenlm/ (git-ignored, outside the package), and install the `kenlm` Python
# module used to query ARPA files. Only benchmarks/bench_ngram.py needs this; the test suite
# checks the n-gram models against NLTK instead.
#
#   bash benchmarks/setup_kenlm.sh            # needs apt (root) for the boost dev packages
#   PYTHON=.venv/bin/python bash benchmarks/setup_kenlm.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
DEST="$HERE/.kenlm"
JOBS="${JOBS:-2}"

if [ -x "$DEST/bin/lmplz" ]; then
  echo "lmplz already built: $DEST/bin/lmplz"
else
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev \
      zlib1g-dev libbz2-dev liblzma-dev cmake g++ make
  else
    echo "apt-get not found: install boost (program_options, system, thread, test), zlib, bz2, lzma dev packages and cmake yourself" >&2
  fi
  mkdir -p "$DEST/src"
  cd "$DEST/src"
  # The sdist of the `kenlm` package holds the whole C++ source tree, lmplz included.
  # --no-build-isolation: without it pip builds its build requirements (cmake!) from source too
  "$PYTHON" -m pip download kenlm --no-binary kenlm --no-deps --no-build-isolation -d . -q
  tarball="$(ls kenlm-*.tar.gz | head -n1)"
  rm -rf kenlm-src && mkdir kenlm-src && tar -xzf "$tarball" -C kenlm-src --strip-components=1
  cmake -S kenlm-src -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/dev/null
  cmake --build build --target lmplz build_binary query -j "$JOBS"
  mkdir -p "$DEST/bin"
  cp build/bin/lmplz build/bin/build_binary build/bin/query "$DEST/bin/"
  echo "built $DEST/bin/lmplz"
fi

if "$PYTHON" -c "import kenlm" 2>/dev/null; then
  echo "kenlm Python module already installed"
else
  "$PYTHON" -m pip install kenlm -q  # builds from source (~90 s); it only queries, it cannot estimate
  echo "installed the kenlm Python module"
fi
