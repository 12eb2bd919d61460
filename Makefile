# The two commands of the README: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: run test test-integrations lint setup debs clean

setup: $(STAMP) debs

# The editable install also compiles the C kernels into src/sparsync/native (setup.py; without a
# working compiler the install goes on and the torch kernels run): the line after it says which.
$(STAMP): pyproject.toml setup.py src/sparsync/native/kernels.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,train]' $(TORCH)
	@$(PY) -c "from sparsync import native; i = native.info(); print('C kernels:', 'built at install' if i['enabled'] else 'off (' + i['why'] + ')')"
	touch $(STAMP)

# Debian packages: iproute2 for the emulated network (ip, tc), gcc for the C kernels
# (sparsync.native; without it the slower torch kernels run). Installed only when missing and we are root.
debs:
	@missing=""; \
	if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then missing="iproute2"; fi; \
	if ! command -v $${CC:-cc} >/dev/null 2>&1; then missing="$$missing gcc libc6-dev"; fi; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q $$missing; \
	  else echo "note: missing $$missing and not root (no iproute2: emulated-network tests skip;" \
	    "no gcc: the torch kernels run instead of the C ones)"; fi; fi

run: setup
	@$(PY) -c "from sparsync import native; i = native.info(); print('C kernels:', i['origin'] if i['enabled'] else 'off (' + i['why'] + ')')"
	$(VENV)/bin/sparsync run-default

# The reducer and engine suites run a second time with the torch kernels (SPARSYNC_NATIVE=0): the
# path of every machine without a C compiler, and of every dtype, device or layout the C kernels skip.
TORCH_KERNEL_TESTS := $(wildcard tests/reducers/test_*_reducer.py tests/reducers/test_*_reducers.py tests/engine/test_engine_*.py)

test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup
	SPARSYNC_NATIVE=0 $(PY) -m pytest -q -n 2 --dist loadgroup $(TORCH_KERNEL_TESTS)

# The trainer integrations with their real clients (Lightning, Accelerate, the HF Trainer): installed into
# the venv beside the pinned torch (a client that wants another torch fails here instead of replacing it),
# then their tests, which fail instead of skipping when a client is missing.
test-integrations: setup
	$(PY) -m pip install -q -e '.[integrations]' $(TORCH)
	SPARSYNC_REQUIRE_INTEGRATIONS=1 $(PY) -m pytest -q tests/hook/test_integrations.py

lint: setup
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info src/sparsync/native/libsparsync_kernels.*
