# trident: `make demo` runs the main job on the built-in default, `make test` runs the tests.
# Both create the virtual environment they need (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TRIDENT := OMP_NUM_THREADS=1 $(VENV)/bin/trident
OUT ?= out/demo

.PHONY: install test demo benchmarks clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[runtime,test]'
	touch $@

install: $(VENV)/.installed

# the tests that start no ranks side by side, a worker a core (4 at most); then those that start ranks
# but check nothing speed or load moves, two at a time; then the rest one at a time (tests/conftest.py)
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m in_process -n auto --maxprocesses 4
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m side_by_side -n 2
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not in_process and not side_by_side"

demo: install
	@mkdir -p $(OUT)
	@echo "== 1. profile this machine as a 4-process CPU cluster (gloo) =="
	$(TRIDENT) profile cluster --nproc 4 -o $(OUT)/cpu4.json
	@echo "== 2. profile the tiny model on it (real runtime modules, TP 1/2/4) =="
	$(TRIDENT) profile model --nproc 4 --model tiny --cluster-profile $(OUT)/cpu4.json --seq-len 64 \
	    --tp 1,2,4 --micro-batches 1,2,4 -o $(OUT)/tiny.model.json
	@echo "== 3. search the fastest plan that fits, priced by the measured profiles =="
	$(TRIDENT) search --model tiny --cluster $(OUT)/cpu4.json --model-profile $(OUT)/tiny.model.json --gpus 4 \
	    --global-batch 16 --dtype fp32 --top 5 -o $(OUT)/plan.json
	@echo "== 4. train that plan with torchrun (a validation loss every 10 steps, a checkpoint at the end) =="
	rm -rf $(OUT)/ckpt $(OUT)/hf
	$(TRIDENT) run $(OUT)/plan.json --steps 30 --eval-every 10 --checkpoint-dir $(OUT)/ckpt --out $(OUT)/run.json
	@echo "== 5. predicted vs measured =="
	$(TRIDENT) compare $(OUT)/plan.json $(OUT)/run.json --cluster-profile $(OUT)/cpu4.json \
	    --model-profile $(OUT)/tiny.model.json --plot $(OUT)/compare.png
	@echo "== 6. the trained model as a Hugging Face transformers directory (AutoModelForCausalLM loads it) =="
	$(TRIDENT) export $(OUT)/ckpt -o $(OUT)/hf
	@echo
	@echo "== and planning for a cluster you do not have: Llama 2 70B on 8 DGX A100 nodes =="
	$(TRIDENT) search --model llama2-70b --cluster dgx-a100-80gb --nodes 8 --global-batch 512 --seq-len 4096 \
	    --top 3 -o $(OUT)/llama2-70b.plan.json
	@echo
	@echo "== and which nodes, how many: A100 nodes, A100 nodes with 100 Gb/s NICs, H100 nodes, 2 to 16 of each =="
	$(TRIDENT) cluster derive dgx-a100-80gb --nic-gbps 100 -o $(OUT)/a100-100g.json
	$(TRIDENT) search --model llama2-70b --cluster dgx-a100-80gb,$(OUT)/a100-100g.json,dgx-h100-80gb \
	    --nodes 2,4,8,16 --global-batch 512 --seq-len 4096
	@echo
	@echo "demo outputs (profiles, plans, run record, picture) are in $(OUT)/"

benchmarks: install
	$(PY) benchmarks/published.py

clean:
	rm -rf $(VENV) out .pytest_cache
