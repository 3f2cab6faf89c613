# The two commands of the README: `make demo` (install + main job) and `make test` (install + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml setup.py scripts/install.sh scripts/constraints.txt
	bash scripts/install.sh
	touch $@

install: $(VENV)/.installed

# The main job: align the tiny Qwen3.5-MoE across the fp64 reference, our fsdp2 engine and our
# veomni engine with the experts split over its ranks (2 gloo ranks each); megatron is listed with
# the reason it is skipped on CPU. Table on the terminal, report + plots in align_out/.
demo: install
	$(VENV)/bin/verl-moe align --preset tiny-qwen3.5-moe --backends reference,fsdp2,veomni:ep=2,megatron --steps 5 --out align_out

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q
