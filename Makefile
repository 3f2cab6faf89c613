# The two commands of the README: `make demo` (install + main job) and `make test` (install + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml setup.py scripts/install.sh scripts/constraints.txt
	bash scripts/install.sh
	touch $@

install: $(VENV)/.installed

# The main job: align the tiny Qwen3.5-MoE across the fp64 reference and our fsdp2 engine
# (2 gloo ranks), table on the terminal, report + plots in align_out/.
demo: install
	$(VENV)/bin/verl-moe align --preset tiny-qwen3.5-moe --backends reference,fsdp2 --steps 5 --out align_out

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q
