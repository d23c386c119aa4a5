# attnres — two commands set everything up: `make run` and `make test`.
#
# Set-up never replaces an installed torch and never pulls a CUDA build onto a
# machine without one: where no torch is importable, TORCH_SPEC (a CPU build
# that lies on this machine's disk) is installed; every later install is
# constrained to the torch that is there.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnres-installed
PYTEST_ARGS ?=
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup run test test-deep golden bench bench-sp fuzz lint typecheck docs clean test-sglang bench-sglang \
	kernels-env test-kernels gpu-check test-vllm-omni bench-vllm-omni test-oldest test-floor

setup: $(STAMP)

# tests/tested-versions.txt: the governed libraries' releases the committed tables
# were made with (the extras declare the ranges users may install)
$(STAMP): pyproject.toml tests/tested-versions.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt
	$(PIP) install -c $(VENV)/torch-pin.txt -c tests/tested-versions.txt -e ".[dev]"
	touch $@

run: $(STAMP)
	$(PY) -m attnres plan examples/audio-video.toml
	$(PY) -m attnres plan examples/audio-video.toml --platform "cuda:sm90+all" --attention-backend sage_attn
	$(PY) -m attnres plan examples/flux.1-dev --platform "cuda:sm90+flash_attn+sageattention" \
		--attention-backend sage_attn --dtype bf16 --dtype vae=fp32

# --- Kernel adapters against the kernel packages' real wrappers (issue 31) ---
# The kernel distributions' Python layer, downloaded from the package registry
# (`pip download --no-deps`, nothing installed, nothing committed) and unpacked,
# Python files only, into $(KERNELS_ENV)/dists/<project>/ by tests/kernels/build_env.py;
# their compiled layer is stubbed by tests/kernels/stubs/ (docs/layers.md,
# "How the adapters are tested"). flash-attn's sdist gives flash_attn (with its
# early flash_attn.cute) and hopper/flash_attn_interface.py (FlashAttention-3);
# its metadata step imports torch, hence --no-build-isolation with the CUDA
# build skipped. torch-npu gives no wrapper to run (its npu_fusion_attention is a
# compiled operator): its wheel's published schema defines the stand-in operator
# (tests/kernels/stubs/npu). tests/kernels runs only with ATTNRES_KERNEL_DISTS set (both
# targets below set it; `make test` includes it).
KERNELS_ENV ?= .venv-kernels
KERNEL_DISTS ?= flash-attn==2.8.3 flash-attn-4==4.0.0b36 amd-aiter==0.1.7.post2.dev18 \
	xformers==0.0.35 sageattention==1.0.6 torch-npu==2.13.0
KERNELS_STAMP := $(KERNELS_ENV)/.attnres-kernels
KERNELS_RUN := ATTNRES_KERNEL_DISTS="$(abspath $(KERNELS_ENV))/dists"

$(KERNELS_STAMP): tests/kernels/build_env.py $(STAMP)
	rm -rf $(KERNELS_ENV) && mkdir -p $(KERNELS_ENV)/downloads
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $(PIP) download --no-deps --no-build-isolation \
		-d $(KERNELS_ENV)/downloads $(KERNEL_DISTS)
	$(PY) tests/kernels/build_env.py $(KERNELS_ENV)/downloads $(KERNELS_ENV)/dists
	touch $@

kernels-env: $(KERNELS_STAMP)

test-kernels: $(KERNELS_STAMP)
	$(KERNELS_RUN) $(PY) -m pytest tests/kernels -p no:cacheprovider $(PYTEST_ARGS)

# Linters and the type check are not tests: `make lint` runs them, and
# `make test` runs `make lint` first (CI calls `make test` only, so they stay
# enforced; mypy is incremental, so a warm .mypy_cache costs seconds).
# The suite runs on TEST_WORKERS processes (pytest-xdist; 2 on the 2-core machines
# it is sized for: `make test TEST_WORKERS=0` runs it in one process). Benchmarks
# are not tests: `make bench` runs them (pytest-benchmark's fixture is off here).
TEST_WORKERS ?= 2
test: lint $(KERNELS_STAMP)
	$(KERNELS_RUN) $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --benchmark-disable $(PYTEST_ARGS)

# Everything make test samples, whole: more property-test examples, every diffusers
# class and transformers type at their full configs, every interface type run
# tiny, then every row of the generated coverage tables (make test checks
# one row in four of those; tests/generated_docs.py).
test-deep: $(STAMP) $(KERNELS_STAMP)
	HYPOTHESIS_PROFILE=deep ATTNRES_COVERAGE_FULL=1 $(KERNELS_RUN) \
		$(PY) -m pytest -n $(TEST_WORKERS) --benchmark-disable $(PYTEST_ARGS)
	ATTNRES_COVERAGE_TABLE=1 $(PY) -m pytest -n $(TEST_WORKERS) --benchmark-disable \
		tests/test_integrations_coverage.py tests/test_integrations_coverage_hf.py -k every_exported

golden: $(STAMP)
	$(PY) -m pytest tests/test_golden.py tests/test_autotune_golden.py \
		tests/test_integrations_golden.py --update-golden -q

$(VENV)/.attnres-bench: $(STAMP)
	$(PIP) install -c $(VENV)/torch-pin.txt -c tests/tested-versions.txt -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.attnres-bench
	mkdir -p benchmarks/results
	$(PY) -m pytest benchmarks -p no:randomly --benchmark-only \
		--benchmark-json=benchmarks/results/latest.json --benchmark-storage=benchmarks/results -q

# Issue 35's bars for a ring (2 gloo ranks, 16k tokens, CPU): per-rank time and
# training memory against one process, a one-line summary last (about 15 minutes
# on an idle 2-core machine; SP_ARGS="--what time --rounds 5" for timings alone).
SP_ARGS ?=
bench-sp: $(STAMP)
	PYTHONPATH=src $(PY) benchmarks/sp_measure.py $(SP_ARGS)

# Coverage-guided fuzzing of every loader (issue 20): not part of `make test`.
# FUZZ_SECONDS per target (13 targets; each also pays its imports, and the folder
# and config targets' first input builds a model: about 5 minutes in all by default,
# measured on 2 busy cores; `make fuzz FUZZ_SECONDS=600` for a long run, or
# FUZZ_TARGETS=cli for one target). Issue 32 added the command line (explain, and
# plan --trace-out DIR: every trace written reads back and replays), backend
# options, schedules, layouts, --platform and --dtype, each accepting only its
# documented error type. A crash is written to fuzz/crashes/TARGET-crash-* and
# stops the run (an input slower than 30 s is kept as TARGET-slow-unit-*; the
# first one pays the imports). atheris is installed here (ATHERIS_SPEC: a release
# with a manylinux wheel for the venv's Python, so no compiler is needed).
FUZZ_SECONDS ?= 10
FUZZ_TARGETS ?= trace replay pipeline folder config header results cli option schedule layout platform dtype
ATHERIS_SPEC ?= atheris==3.0.0

$(VENV)/.attnres-fuzz: $(STAMP)
	$(PIP) install -c $(VENV)/torch-pin.txt "$(ATHERIS_SPEC)"
	$(PY) -c "import atheris"
	touch $@

fuzz: $(VENV)/.attnres-fuzz
	mkdir -p fuzz/crashes
	for t in $(FUZZ_TARGETS); do \
		mkdir -p fuzz/work/$$t && \
		$(PY) fuzz/fuzz_attnres.py $$t -max_total_time=$(FUZZ_SECONDS) -timeout=120 \
			-rss_limit_mb=4096 -report_slow_units=30 -artifact_prefix=fuzz/crashes/$$t- fuzz/work/$$t fuzz/corpus/$$t \
			|| exit 1; \
	done

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks scripts
	$(PY) -m ruff format --check src  # issue 20: src stays formatted
	$(PY) -m mypy src  # strict = true in pyproject.toml

# --- SGLang (issue 23; docs/sglang.md) -------------------------------------
# Its own environment: SGLang pinned, installed without its CUDA dependencies
# (--no-deps), the CPU torch, the light dependencies its selection tests import
# (tests/sglang/requirements.txt), attnres itself (for the entry point), and
# stand-ins for triton and torchvision at test time. SGLang's unit test files
# run verbatim from the installed wheel: once as SGLang ships, once with the
# attnres plugin loaded through SGLang's own plugin lifecycle.
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SPY := $(SGLANG_VENV)/bin/python
SPIP := $(SPY) -m pip --disable-pip-version-check -q
SGLANG_STAMP := $(SGLANG_VENV)/.attnres-sglang-installed
SGLANG_SELECTION_TESTS := test_attention_backend_selector.py test_attention_backend_override.py \
	test_attention_backend_autotune.py test_cross_attention_backend_roles.py test_qwen3vl_text.py
SGLANG_RELATED_TESTS := test_ring_admission.py test_dynamic_cudnn_sdpa_selection.py \
	test_dynamic_cudnn_sdpa_routing.py test_cuda_attention_backend.py \
	test_hybrid_window_h3_attention.py test_diffusion_plugins.py
# $(call sglang_pytest,PLUGIN): pytest in SGLang's unit folder; PLUGIN=1 loads the attnres plugin
sglang_pytest = cd "$$($(SPY) -c 'import importlib.util as u; print(u.find_spec("sglang").submodule_search_locations[0])')/multimodal_gen/test/unit" && \
	PYTHONPATH="$(CURDIR)/tests/sglang" ATTNRES_SGLANG_PLUGIN=$(1) $(abspath $(SPY)) -m pytest -c "$(CURDIR)/tests/sglang/pytest.ini" \
	--rootdir . -p sglang_standins -p no:cacheprovider -q

$(SGLANG_STAMP): pyproject.toml tests/sglang/requirements.txt
	test -x $(SPY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SPY) -c "import torch" 2>/dev/null || $(SPIP) install "$(TORCH_SPEC)"
	$(SPY) -c "import torch; print('torch==' + torch.__version__)" > $(SGLANG_VENV)/torch-pin.txt
	$(SPIP) install --no-deps "$(SGLANG_SPEC)"
	$(SPIP) install -c $(SGLANG_VENV)/torch-pin.txt -r tests/sglang/requirements.txt
	$(SPIP) install --no-deps -e .
	touch $@

test-sglang: $(SGLANG_STAMP)
	@echo "== SGLang's selection tests, as SGLang ships (no attnres plugin)"
	$(call sglang_pytest,0) $(SGLANG_SELECTION_TESTS) $(SGLANG_RELATED_TESTS)
	@echo "== the same files with the attnres plugin deciding every backend"
	$(call sglang_pytest,1) $(SGLANG_SELECTION_TESTS) $(SGLANG_RELATED_TESTS)
	@echo "== attnres's own tests against SGLang (tests/sglang: backend facts, verify_consensus on 2 ranks)"
	cd tests/sglang && PYTHONPATH="$(CURDIR)/tests/sglang" $(abspath $(SPY)) -m pytest -c pytest.ini \
		--rootdir . -p sglang_standins -p no:cacheprovider -q test_attnres_plugin.py

# the plugin's decision cost against SGLang's own selector (benchmarks/bench_sglang.py)
bench-sglang: $(SGLANG_STAMP)
	$(SPIP) install -c $(SGLANG_VENV)/torch-pin.txt "pytest-benchmark>=4"
	mkdir -p benchmarks/results
	$(SPY) -m pytest benchmarks/bench_sglang.py -p no:randomly -p no:cacheprovider --benchmark-only \
		--benchmark-json=benchmarks/results/sglang.json -q

# --- vLLM-Omni (issue 36; docs/vllm-omni.md) ---------------------------------
# Its own environment: vLLM-Omni and vLLM pinned, installed without their CUDA
# dependencies (--no-deps), the CPU torch, the light packages their import
# needs (tests/vllm_omni/requirements.txt) and attnres itself (for the entry
# point in vllm_omni.general_plugins). vLLM-Omni's selection tests are not in
# its wheel: they are read from its GitHub repository at VLLM_OMNI_TESTS_REV
# into $(VLLM_OMNI_TESTS) (git-ignored, never committed), or taken from a
# checkout at that revision given as VLLM_OMNI_TESTS_DIR=path. They run
# verbatim: once as vLLM-Omni ships, once with the attnres plugin loaded
# through vLLM-Omni's own plugin lifecycle.
VLLM_OMNI_VENV ?= .venv-vllm-omni
VLLM_OMNI_SPEC ?= vllm-omni==0.30.0
VLLM_SPEC ?= vllm==0.30.0
VPY := $(VLLM_OMNI_VENV)/bin/python
VPIP := $(VPY) -m pip --disable-pip-version-check -q
VLLM_OMNI_STAMP := $(VLLM_OMNI_VENV)/.attnres-vllm-omni-installed
#: the commit of vllm-project/vllm-omni whose test files match the 0.30.0 wheel
VLLM_OMNI_TESTS_REV ?= 2693a42e2c6b4466ddcfaa7c848c5b0184a581b9
VLLM_OMNI_TEST_FILES ?= tests/diffusion/attention/test_selector.py
VLLM_OMNI_TESTS := .vllm-omni-tests/$(VLLM_OMNI_TESTS_REV)
VLLM_OMNI_TESTS_DIR ?= $(VLLM_OMNI_TESTS)
# $(call vllm_omni_pytest,PLUGIN): vLLM-Omni's test files; PLUGIN=1 loads the attnres plugin
vllm_omni_pytest = cd "$(VLLM_OMNI_TESTS_DIR)" && PYTHONPATH="$(CURDIR)/tests/vllm_omni" \
	ATTNRES_VLLM_OMNI_PLUGIN=$(1) $(abspath $(VPY)) -m pytest -c "$(CURDIR)/tests/vllm_omni/pytest.ini" \
	--rootdir . -p vllm_omni_plugin -p no:cacheprovider -q -m cpu $(VLLM_OMNI_TEST_FILES)

$(VLLM_OMNI_STAMP): pyproject.toml tests/vllm_omni/requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_OMNI_VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPIP) install "$(TORCH_SPEC)"
	$(VPY) -c "import torch; print('torch==' + torch.__version__)" > $(VLLM_OMNI_VENV)/torch-pin.txt
	$(VPIP) install --no-deps "$(VLLM_OMNI_SPEC)" "$(VLLM_SPEC)"
	$(VPIP) install --no-deps -c $(VLLM_OMNI_VENV)/torch-pin.txt -r tests/vllm_omni/requirements.txt
	$(VPIP) install --no-deps -e .
	touch $@

$(VLLM_OMNI_TESTS):
	@for f in $(VLLM_OMNI_TEST_FILES); do mkdir -p "$@.part/$$(dirname $$f)" && \
		curl -fsSL "https://raw.githubusercontent.com/vllm-project/vllm-omni/$(VLLM_OMNI_TESTS_REV)/$$f" \
		-o "$@.part/$$f" || { rm -rf "$@.part"; echo "make test-vllm-omni: cannot read $$f at \
	vllm-project/vllm-omni@$(VLLM_OMNI_TESTS_REV) from GitHub (no registry ships vLLM-Omni's tests); \
	give a checkout at that revision: make test-vllm-omni VLLM_OMNI_TESTS_DIR=path" >&2; exit 1; }; done
	mv "$@.part" "$@"

test-vllm-omni: $(VLLM_OMNI_STAMP) $(if $(filter $(VLLM_OMNI_TESTS),$(VLLM_OMNI_TESTS_DIR)),$(VLLM_OMNI_TESTS))
	@echo "== vLLM-Omni's selection tests ($(VLLM_OMNI_TESTS_REV)), as vLLM-Omni ships (no attnres plugin)"
	$(call vllm_omni_pytest,0)
	@echo "== the same files with the attnres plugin deciding every backend"
	$(call vllm_omni_pytest,1)
	@echo "== attnres's own tests against vLLM-Omni (tests/vllm_omni: backend facts, answers on this platform, a tiny pipeline on a simulated Hopper)"
	cd tests/vllm_omni && $(abspath $(VPY)) -m pytest -c pytest.ini --rootdir . -p no:cacheprovider -q \
		test_attnres_plugin.py test_pipeline_hopper.py

# the plugin's decision cost against vLLM-Omni's own selector (benchmarks/bench_vllm_omni.py)
bench-vllm-omni: $(VLLM_OMNI_STAMP)
	$(VPIP) install -c $(VLLM_OMNI_VENV)/torch-pin.txt "pytest-benchmark>=4"
	mkdir -p benchmarks/results
	$(VPY) -m pytest benchmarks/bench_vllm_omni.py -p no:randomly -p no:cacheprovider --benchmark-only \
		--benchmark-json=benchmarks/results/vllm-omni.json -q $(VLLM_OMNI_BENCH_ARGS)

# --- The oldest library versions attnres declares (issue 30) -------------------
# Issue 30's harness on the oldest diffusers and transformers the extras admit:
# the low ends of attnres.integrations._plan.SUPPORTED_VERSIONS (a test keeps
# that table equal to pyproject.toml's extras), each at its first release
# (transformers 5 -> 5.0.0, diffusers 0.42 -> 0.42.0), in a venv of their own
# beside the same torch. It runs the by-hand battery, the sound-route tests, every
# transformers model type with interface sites built tiny (no flag bit-identical,
# eager and torch_sdpa strict, outputs compared) and the diffusers tiny sweep
# (no flag bit-identical, remove exact, eager everywhere): the sweeps' slice, as
# make test takes it; ATTNRES_COVERAGE_FULL=1 make test-oldest runs every type and
# class. make test runs the same files on the versions .venv holds (the newest).
OLDEST_VENV ?= .venv-oldest
OPY := $(OLDEST_VENV)/bin/python
OPIP := $(OPY) -m pip --disable-pip-version-check -q
OLDEST_STAMP := $(OLDEST_VENV)/.attnres-oldest
OLDEST_TESTS ?= tests/test_differential.py tests/test_sound_routes.py tests/test_integrations_runtime_hf.py \
	tests/test_integrations_coverage.py::test_tiny_build_apply_is_bit_identical_remove_exact_facts_spied_eager_everywhere
# the pins, read from the one table: "transformers==5.0.0 diffusers==0.42.0"
oldest_pins = $(PY) -c "from attnres.integrations._plan import SUPPORTED_VERSIONS as S; \
	print(' '.join(p + '==' + '.'.join((low.split('.') + ['0', '0'])[:3]) for p, (low, _) in S.items()))"

$(OLDEST_STAMP): pyproject.toml src/attnres/integrations/_plan.py $(STAMP)
	test -x $(OPY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OPIP) install -c $(VENV)/torch-pin.txt "$$(cat $(VENV)/torch-pin.txt)"
	$(OPIP) install -c $(VENV)/torch-pin.txt -e ".[dev]" $$($(oldest_pins))
	touch $@

test-oldest: $(OLDEST_STAMP)
	@$(OPY) -c "import diffusers, torch, transformers as t; \
		print('== the oldest versions: transformers', t.__version__, 'diffusers', diffusers.__version__, 'torch', torch.__version__)"
	$(OPY) -m pytest -n $(TEST_WORKERS) --benchmark-disable -p no:cacheprovider $(OLDEST_TESTS) $(PYTEST_ARGS)

# --- The oldest torch attnres declares (the floor) ------------------------------
# The whole suite on FLOOR_TORCH_SPEC, the release pyproject.toml's torch>= names
# (attnres._torch_floor.MIN_TORCH; a test keeps the three equal), in a venv of its
# own; every other install there is constrained to that torch, and diffusers and
# transformers to the releases the tables were made with (tests/tested-versions.txt). PyPI's Linux wheel of torch 2.6.0 is its
# CUDA build (about 5 GB with its nvidia packages; it runs on the CPU too). Not part
# of make test: 3,435 tests in about 4 minutes on an idle 2-core machine (9 on busy
# cores; measured), plus about 2 minutes of install the first time. One file is left out: tests/kernels/
# test_real_xformers.py runs xformers 0.0.35's own Python layer (KERNEL_DISTS), which
# declares torch>=2.10 and refuses 2.6 at its import ("doesnt have a compatible
# aten::_flash_attention_forward schema"): pip never installs the two together.
FLOOR_VENV ?= .venv-floor
FLOOR_TORCH_SPEC ?= torch==2.6.0
FLOOR_SLICE ?= --ignore=tests/kernels/test_real_xformers.py
FPY := $(FLOOR_VENV)/bin/python
FPIP := $(FPY) -m pip --disable-pip-version-check -q
FLOOR_STAMP := $(FLOOR_VENV)/.attnres-floor

$(FLOOR_STAMP): pyproject.toml tests/tested-versions.txt
	test -x $(FPY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FPIP) install "$(FLOOR_TORCH_SPEC)"
	echo "$(FLOOR_TORCH_SPEC)" > $(FLOOR_VENV)/torch-pin.txt
	$(FPIP) install -c $(FLOOR_VENV)/torch-pin.txt -c tests/tested-versions.txt -e ".[dev]"
	touch $@

test-floor: $(FLOOR_STAMP) $(KERNELS_STAMP)
	@$(FPY) -c "import diffusers, torch, transformers as t; \
		print('== the floor: torch', torch.__version__, 'transformers', t.__version__, 'diffusers', diffusers.__version__)"
	$(KERNELS_RUN) $(FPY) -m pytest -n $(TEST_WORKERS) --benchmark-disable -p no:cacheprovider \
		$(FLOOR_SLICE) $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) scripts/gen_state_diagram.py --write

# Issue 31: what to run the first time a CUDA GPU is available: every installed
# adapter against float64 (forward, backward, varlen, lse, options), the masks
# gather route's and the generic route's cost, NCCL consensus and sequence
# parallel on 2+ GPUs; one report (gpu-check-report.json and .txt), under 5
# minutes. Without a CUDA GPU it says what it would run and exits 0.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out gpu-check-report.json

clean:
	rm -rf $(VENV) $(KERNELS_ENV) $(OLDEST_VENV) $(FLOOR_VENV) build dist .vllm-omni-tests src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
