# nmtserve — the two entry points of a fresh machine:
#   make demo   data → train → evaluate → export (verified) → serve → a translation over gRPC
#               (about 30 minutes on 2 cores)
#   make test   lint (ruff) and the test suite
# Both install Debian packages (prometheus, openssl, g++) with apt-get where missing, and say so first;
# SYSTEM_PACKAGES=no installs none (make test then skips the tests that need a missing one, saying which)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
NMT    := $(VENV)/bin/nmtserve
DATA   ?= data/default
RUN    ?= runs/default
BUNDLE ?= bundles/default
PORT   ?= 50051
PAIRS  ?= 200000
TRAIN_MINUTES ?= 20
PYTEST_ARGS ?=

.PHONY: install tools kernels lint demo test mutations clean protos loadtest bench-offline bench-served soak bench-gpu bench-opus test-gpu

install: $(VENV)/.installed

# system tools the tests use, from Debian's prometheus package: promtool lints the /metrics page and
# the prometheus server runs the Grafana dashboard's queries; openssl makes the TLS tests' certificates;
# g++ builds the decoding kernels; chromium and chromium-driver run the web page's test (Selenium); haproxy is the
# limiter in front (deploy/kubernetes/overlays/limiter). Installed with apt-get when missing, said before it starts;
# SYSTEM_PACKAGES=no installs nothing (the tests that need a missing tool are then skipped, each saying which)
SYSTEM_PACKAGES ?= yes
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools:
ifeq ($(SYSTEM_PACKAGES),no)
	@echo "SYSTEM_PACKAGES=no: no Debian package is installed; tests that need a missing promtool, prometheus, openssl, g++, chromium, chromedriver or haproxy are skipped"
else
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v openssl >/dev/null \
	  && command -v g++ >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	  && command -v haproxy >/dev/null || { \
	  echo "installing Debian packages with apt-get: prometheus (server + promtool), openssl, g++, chromium, chromium-driver and haproxy (SYSTEM_PACKAGES=no skips this)"; \
	  $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus openssl g++ chromium chromium-driver haproxy; }
endif

# nmtserve's decoding kernels for ONNX Runtime's CPU provider (export/runtime/kernels.py): built with
# pinned ONNX Runtime C API headers (Debian's libonnxruntime-dev, downloaded once, checked, not installed)
# into $NMTSERVE_KERNELS_DIR (default ~/.cache/nmtserve/kernels), under a name keyed by the source: a no-op
# when that library is there
kernels: install tools
	$(PY) -m nmtserve.export.runtime.kernels || [ "$(SYSTEM_PACKAGES)" = no ]

# pip finds the pinned CPU torch wheel through the machine's pip configuration (find-links)
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

$(DATA)/train.tsv: | install
	$(NMT) data --out $(DATA) --pairs $(PAIRS) --seed 1

$(RUN)/average.pt: $(DATA)/train.tsv
	$(NMT) train --data $(DATA) --out $(RUN) --max-minutes $(TRAIN_MINUTES)

# bundle.py holds the bundle schema this nmtserve reads: a checkout that changes it exports the bundle again
$(BUNDLE)/manifest.json: $(RUN)/average.pt export/runtime/bundle.py
	$(NMT) export $(RUN)/average.pt --out $(BUNDLE) --variants fp32,int8,fp16 --verify

demo: kernels $(BUNDLE)/manifest.json
	$(NMT) evaluate $(RUN)/average.pt --split test --json
	$(NMT) evaluate $(RUN)/average.pt --split novel --json
	$(NMT) serve $(BUNDLE) --port $(PORT) & pid=$$!; \
	$(NMT) translate --server localhost:$(PORT) --wait 120 "The old cat did not eat the red apples." \
	  "Will my sister read a book in the garden?" "We are happy."; rc=$$?; \
	kill -TERM $$pid; wait $$pid; exit $$rc

# a locust scenario (steady, step, spike, overload) against a server started on loopback with the
# default bundle; results (CSV, HTML report, chart.png) in runs/loadtest/$(SCENARIO)
SCENARIO ?= steady
USERS ?= 32
LOADTEST_SECONDS ?= 60
loadtest: $(BUNDLE)/manifest.json
	$(NMT) loadtest $(BUNDLE) --scenario $(SCENARIO) --peak-users $(USERS) --seconds $(LOADTEST_SECONDS) \
	  --slo loadtests/slo.toml

# sustained mixed, odd and invalid traffic against a server on loopback; exit 1 on a status code a call
# does not expect, a gauge not back at 0, memory growth or a changed translation (runs/soak/)
SOAK_SECONDS ?= 600
soak: $(BUNDLE)/manifest.json
	$(NMT) soak $(BUNDLE) --seconds $(SOAK_SECONDS) --clients 24 --out runs/soak

# PyTorch, ONNX Runtime and CTranslate2 on the same weights, each engine in its own process at its best
# thread count (a few minutes); JSON and chart in runs/bench/ (docs/bench keeps the current report of each
# benchmark kind and host family, KIND-HOST.json: copy a run there when it becomes the current one)
bench-offline: $(BUNDLE)/manifest.json
	$(NMT) bench offline $(BUNDLE) --report runs/bench/offline-greedy-cpu.json

# served throughput/latency, continuous vs static batching, each at its best layout of 1 and 2 threads (10 minutes)
bench-served: $(BUNDLE)/manifest.json
	$(NMT) bench served $(BUNDLE) --threads 1,2 --report runs/bench/served-greedy-cpu.json

# an OPUS-MT-size model (random weights, OPUS-MT's shapes; nothing downloaded): built, imported and exported,
# then offline greedy and beam 4 against CTranslate2 and served greedy int8, as the README's tables (about 80 minutes)
OPUS := runs/opus-shaped
bundles/opus-shaped/manifest.json: export/runtime/bundle.py | install
	$(PY) -m nmtserve.loadtests.marian_model $(OPUS)
	$(NMT) import $(OPUS) --out $(OPUS).pt --source-lang en --target-lang fr
	$(NMT) export $(OPUS).pt --out bundles/opus-shaped

bench-opus: bundles/opus-shaped/manifest.json
	for beam in 1 4; do $(NMT) bench offline bundles/opus-shaped --sentences-file $(OPUS)/sentences.txt --sentences 64 \
	  --threads 2 --max-decoding-length 32 --beam-size $$beam --engines ort_fp32,ort_int8,ct2_fp32,ct2_int8 \
	  --report runs/bench/marian-offline-beam$$beam.json || exit 1; done
	$(NMT) bench served bundles/opus-shaped --sentences-file $(OPUS)/sentences.txt --variant int8 --threads 1,2 \
	  --concurrency 1,8,64,128 --report runs/bench/served-marian-int8.json

# on a machine with a GPU, onnxruntime-gpu in place of onnxruntime (deploy/Dockerfile.gpu): the fp16 variant
# against PyTorch and transformers, and served on CUDA (docs/bench/*-gpu-h100.json and *-gpu-h200.json were made so)
bench-gpu: $(BUNDLE)/manifest.json
	$(NMT) bench offline $(BUNDLE) --device cuda --report runs/bench/offline-greedy-gpu.json
	$(NMT) bench served $(BUNDLE) --device cuda --variant fp16 --threads 1 --concurrency 1,8,32,64,128 \
	  --report runs/bench/served-greedy-gpu.json

# the same: the CUDA path's tests (IOBinding against the host path, the engine) on the GPU, fp16
test-gpu: install
	NMTSERVE_TEST_DEVICE=cuda $(PY) -m pytest tests/export/test_parity.py tests/export/test_search.py \
	  tests/server/test_engine.py -k "io_binding or io-binding"

# regenerate nmtserve/v1 and docs/api.md from protos/ (tests/server/test_protos.py checks they match)
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/nmtserve/v1/translation.proto
	$(PY) protos/apidoc.py > docs/api.md

# ruff: pyflakes, import order and pyupgrade rules (pyproject.toml)
lint: install
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collects no test: a failure of the whole suite, but not of a filter asked for
# (make test PYTEST_ARGS="-k name" that matches nothing says so and passes)
test: install tools kernels lint
	NMTSERVE_SYSTEM_PACKAGES=$(SYSTEM_PACKAGES) $(PY) -m pytest $(PYTEST_ARGS) || { rc=$$?; if [ $$rc -eq 5 ] && [ -n "$(strip $(PYTEST_ARGS))" ]; then \
	  echo "pytest collected no test for PYTEST_ARGS=$(PYTEST_ARGS)"; exit 0; fi; exit $$rc; }

# each deliberately broken variant in tests/mutants/mutants.py must fail the tests that guard against it, which
# pass on the code as it is (a few minutes; docs/testing.md)
mutations: install tools kernels
	$(PY) tests/mutants/run.py

clean:
	rm -rf $(VENV) data runs bundles .pytest_cache
