# The two commands a fresh machine needs: `make demo` and `make test`.
# Both install what is missing first (scripts/install.sh), into ./.venv.
SHELL := /bin/bash
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.redsync-installed
NP ?= 2
# Also install tensorflow-cpu 2.15.1 and build Horovod with it, so `make test` covers
# redsync_hvd.tensorflow; `make test REDSYNC_WITH_TF=0` installs torch only.
REDSYNC_WITH_TF ?= 1
# OpenMPI refuses to start as root without these (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PATH := $(VENV)/bin:$(PATH)

.PHONY: install demo test test-fast bench bench-sweep clean

$(STAMP): setup.py scripts/install.sh
	REDSYNC_VENV=$(VENV) REDSYNC_WITH_TF=$(REDSYNC_WITH_TF) bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

demo: install
	bash scripts/demo.sh $(NP)

test: install
	$(PY) -m pytest tests -q -ra --durations=60

test-fast: install
	$(PY) -m pytest tests -q -ra -m "not slow"

bench: install
	$(PY) scripts/bench_selection.py

# the end-to-end sweep on shaped links (root: network namespaces): the full grid, then the fast
# links; each prints its results table with the cost model's predicted-vs-measured error columns
bench-sweep: install
	$(PY) scripts/bench_end_to_end.py --config configs/bench/full.yaml
	$(PY) scripts/bench_end_to_end.py --config configs/bench/fast.yaml

clean:
	rm -rf runs build *.egg-info
