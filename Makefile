# The two commands of the README: `make demo` (install + main job) and `make test` (install + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml setup.py scripts/install.sh scripts/constraints.txt
	bash scripts/install.sh
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m verl_moe.tools.demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q
