# Two commands do all the set-up: `make demo` runs the embedded demo, `make test` the tests.
# Each creates .venv and installs what is missing. torch is pinned to the CPU build on disk
# (torch==2.13.0); installing it first keeps pip from pulling a CUDA build for transformers.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)

.PHONY: demo test test-all lint format clean sandbox-tools

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[ml,envs,rewards,dev,ray]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/decentrl demo

# The code sandbox runs untrusted programs under bubblewrap with the system's /usr/bin/python3
# (docs/sandbox.md); CI runs as root with no stdin, so what is missing is installed with apt;
# anyone else is told the command.
SANDBOX_READY := command -v bwrap >/dev/null && test -x /usr/bin/python3
sandbox-tools:
	@$(SANDBOX_READY) || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3 >/dev/null; }
	@$(SANDBOX_READY) || { echo "the code sandbox needs bubblewrap and /usr/bin/python3: run 'sudo apt-get install -y bubblewrap python3' (docs/sandbox.md)" >&2; exit 1; }

# The CI suite: everything except tests marked slow (run those with `make test-all`).
test: $(STAMP) sandbox-tools
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP) sandbox-tools
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
