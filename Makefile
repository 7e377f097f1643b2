# trident: `make demo` runs the main job on the built-in default, `make test` runs the tests.
# Both create the virtual environment they need (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= out/demo

.PHONY: install test demo benchmarks clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

demo: install
	@mkdir -p $(OUT)
	@echo "== 1. a hand-made plan for Llama 2 70B on 8 DGX A100 nodes, predicted =="
	$(VENV)/bin/trident plan --model llama2-70b --cluster dgx-a100-80gb --nodes 8 --global-batch 512 \
	    --micro-batch 1 --seq-len 4096 --tp 8 --pp 4 --schedule interleaved-1f1b --virtual-stages 5 \
	    --recompute selective --sequence-parallel --zero 1 -o $(OUT)/llama2-70b.plan.json
	@echo
	@echo "== 2. the tiny model as a 4-process CPU job: plan, then train it with torchrun =="
	$(VENV)/bin/trident plan --model tiny --cluster dgx-a100-80gb --gpus 4 --global-batch 8 --micro-batch 1 \
	    --tp 2 --pp 2 --schedule 1f1b --dtype fp32 -o $(OUT)/tiny.plan.json
	OMP_NUM_THREADS=1 $(VENV)/bin/trident run $(OUT)/tiny.plan.json --steps 10 --out $(OUT)/tiny.run.json
	@echo
	@echo "demo outputs are in $(OUT)/"

benchmarks: install
	$(PY) benchmarks/published.py

clean:
	rm -rf $(VENV) out .pytest_cache
