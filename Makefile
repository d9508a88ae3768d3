# The README's two commands, `make demo` and `make test`, each set up from nothing.
# The environment lives in .venv; it is rebuilt when pyproject.toml changes.
# Every step of `make test` prints how long it took (`[phase] NAME: N s`, tools/phase).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PHASE  := tools/phase

.PHONY: setup operator-env demo finetune test go-tools go-tools-early test-prerequisites \
        test-packages container-images bench bench-smoke gpu-check clean

setup: $(VENV)/.installed

CHECK_PYTHON := $(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "DynaTrain needs Python >= 3.11, found " + sys.version.split()[0]'

$(VENV)/.installed: pyproject.toml
	@$(CHECK_PYTHON)
	@$(PHASE) "setup: .venv and Python packages" sh -c '\
	  $(PYTHON) -m venv $(VENV) && tools/pip-install $(VENV) -e ".[test]"'
	@touch $@

# The operator's environment as its slim image has it (Dockerfile target `operator`): only
# operator/requirements.txt, and the project itself without its dependencies, so no torch. The
# operator tests run `dynatrain operator` from it (tests/harness/operator_process.py): an import of
# torch on the operator's path fails them, as it would fail the image.
operator-env: .venv-operator/.installed

.venv-operator/.installed: operator/requirements.txt pyproject.toml
	@$(PHASE) "setup: .venv-operator (the operator image's packages, no torch)" sh -c '\
	  rm -rf .venv-operator && $(PYTHON) -m venv .venv-operator && \
	  tools/pip-install .venv-operator -r operator/requirements.txt && \
	  tools/pip-install .venv-operator --no-deps -e .'
	@touch $@

# The main job: a small elastic job on this machine. Four workers train gpt-tiny; one is
# preempted with notice (the job shrinks live), one joins (it grows live), then a user fixes
# the layout (a live re-layout). Each switch moves only the shards that change. The picture of
# the run (loss and tokens/s, each switch marked) goes to runs/demo/quickstart-run.png.
demo: setup
	$(BIN)/dynatrain run examples/quickstart.yaml --scenario examples/scenario.yaml --report runs/demo

# Real workloads: a tiny random Llama and tokenizer made offline from the shipped corpus,
# fine-tuned on it with a schedule, clipping and live switches, then exported in Hugging Face
# format (examples/finetune-hf.yaml; README "Real workloads").
finetune: setup
	$(BIN)/python examples/make_tiny_hf.py
	rm -rf examples/tiny-llama/finetuned
	$(BIN)/dynatrain run examples/finetune-hf.yaml --scenario examples/finetune-scenario.yaml

# The dev cluster's real node (tests/k8s/test_real_node.py): containerd, runc, CNI plugins, and
# debootstrap and busybox-static for the images it runs (dynatrain/devcluster/kubelet.py).
RUNTIME_DEBS := containerd runc containernetworking-plugins debootstrap busybox-static

# Tests need a real Prometheus and the real node's runtime (Debian's packages; installed once,
# root or sudo), the control plane, helm and Kueue built from their pinned Go modules, and the
# dev cluster's container images (both cached under ~/.cache/dynatrain). tools/pytest-shards
# (standard library only, so the system's Python runs it) orders the work for 2 cores:
# - the venv and the packages are set up side by side (downloads and unpacking), then the
#   operator's venv (after the venv: both editable installs write dynatrain.egg-info here);
#   beside them the control plane's and helm's Go builds start (go-tools-early, niced: they
#   need only the standard library);
# - only the cluster suites need the Go builds and the images, so the rest of them (Kueue, the
#   images beside: CPU beside network and disk) are built in the cluster lane while the
#   process tests run in the other; with sharding off they are built first;
# - the benchmark smoke (bench-smoke) is the last floating session: it fills the tail of the
#   lane that ends first.
test:
	@$(CHECK_PYTHON)
	@$(PHASE) "test" $(PYTHON) tools/pytest-shards --python $(BIN)/python \
	  --setup "$(MAKE) --no-print-directory -j2 setup test-packages && \
	           $(MAKE) --no-print-directory operator-env" \
	  --early "nice -n 10 $(MAKE) --no-print-directory go-tools-early" \
	  --prerequisites "nice -n 10 $(MAKE) --no-print-directory -j2 go-tools container-images" \
	  --also "bench-smoke=$(MAKE) --no-print-directory bench-smoke"

# Everything the tests need, built here at once (what `make test` builds on the way).
test-prerequisites: test-packages go-tools container-images

test-packages:
	@$(PHASE) "test: prometheus" tools/install-prometheus.sh
	@$(PHASE) "test: container runtime" tools/install-debs.sh $(RUNTIME_DEBS)

# The images are built here only as root (debootstrap, chroot); otherwise the real-node and
# image tests say why they cannot run.
container-images: setup test-packages
	@if [ "$$(id -u)" = 0 ]; then \
	  $(PHASE) "test: container images" $(BIN)/python -m dynatrain.devcluster.images \
	    pause worker operator; \
	else echo "[test] container images: not root, so not built here"; fi

# Without a Go on PATH that can build them (Go >= 1.21 fetches the toolchain go.mod names
# itself), the first build downloads that toolchain (about 70 MB from the Go module proxy,
# checked against the checksum database) into ~/.cache/dynatrain/go (devcluster/goinstall.py).
# Before the venv exists: -I keeps the checkout's operator/ package from shadowing the
# standard library's `operator`; the repository is appended for `dynatrain.devcluster`.
go-tools-early:
	@$(PHASE) "setup: control plane and helm, beside the Python setup" $(PYTHON) -I -c \
	  'import sys; sys.path.append("."); from dynatrain.devcluster.build import main; sys.exit(main(["--helm"]))'

go-tools: setup
	@$(PHASE) "setup: control plane from tools/k8s" $(BIN)/dynatrain dev cluster --build-only
	@$(PHASE) "setup: helm from tools/helm" $(BIN)/dynatrain chart build-helm
	@$(PHASE) "setup: kueue from tools/kueue" $(BIN)/dynatrain dev cluster --kueue --build-only

# A few minutes, for CI: small live switches (bit-exact against DCP, losses equal to a
# restart's) and the plan-quality suite; a correctness failure fails, timings are printed only.
bench-smoke: setup
	@$(PHASE) "bench smoke" $(BIN)/python benchmarks/smoke.py

# Figures, not pass/fail on timing: plan quality (bytes and modelled pause against their
# bounds, exact; the fixed suite and held-out random switches), plan speed, the agent's and
# the redundancy's cost on step time, a live agent under 20000 fuzzed requests (0 crashes,
# documented codes only, losses unchanged; it fails on a finding), recovery from killed
# workers vs checkpoint-and-restart, the live switch's pause vs its floors and vs
# checkpoint-and-restart (gpt-125m, ~4 min), gloo's cost per message, goodput under a spot
# trace vs restarts (~8 min), and TorchFT on the same job (its package is the optional `bench`
# extra, installed here).
bench: setup
	$(BIN)/pip install --quiet -e ".[test,bench]"
	$(BIN)/python benchmarks/plan_quality.py
	$(BIN)/python benchmarks/plan_held_out.py --examples 150
	$(BIN)/python benchmarks/plan_speed.py
	$(BIN)/dynatrain plan --estimate
	$(BIN)/python benchmarks/agent_overhead.py
	$(BIN)/python benchmarks/agent_fuzz.py --requests 20000
	$(BIN)/python benchmarks/redundancy_cost.py --model gpt-tiny --layout dp=2,zero=1 --steps 20
	$(BIN)/dynatrain bench chaos --trials 10 --restart-trials 3
	$(BIN)/python benchmarks/switch_speed.py
	$(BIN)/python benchmarks/gloo_messages.py
	$(BIN)/dynatrain bench goodput --trace examples/spot-trace.yaml
	$(BIN)/python benchmarks/vs_torchft.py
	$(BIN)/python benchmarks/vs_native.py
	$(BIN)/python benchmarks/operator_scale.py --jobs 20 --seconds 60

# On a machine with an NVIDIA GPU: the CUDA paths (training, the engine's local copies and
# adoption, one-rank NCCL groups, pinned snapshots, DCP, four processes sharing the GPU over gloo
# that switch live and recover from one of them killed, a live switch under `dynatrain run`)
# pass or fail, and a local-only switch's pause is printed against the GPU's memcpy floor; each
# check's time and the total against its 10-minute budget are printed. Exit 2 without CUDA.
# Then the cost model's predicted step time and peak memory next to the GPU's (about a minute).
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py
	$(BIN)/python benchmarks/gpu_cost_model.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
