# Two commands on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench quick clean gc

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	# torch is pinned to the CPU build (torch==2.13.0); GPU extras are installed only where a GPU is present.
	$(BIN)/python -m pip install -q -e '.[torch,bench,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m client_sdk.demo

# PYTHONDONTWRITEBYTECODE emptied (as if unset): where the environment sets it, every
# broker, worker and client process a test starts compiled the project from its sources
# again (about 0.15 s per broker and worker pair here, hundreds of times a run).
# Two pytest-xdist workers (the 2 cores CI has): about 7 minutes instead of 14 in one
# process (BENCHMARKS.md, "The test suite's time").  `make test XDIST=` runs one process;
# `--dist loadgroup` keeps the tests of one `xdist_group` on one worker.
XDIST ?= -n 2 --dist loadgroup
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q $(XDIST)

quick: $(STAMP)
	$(BIN)/python -m bench quick

gc: $(STAMP)
	$(BIN)/python -m shm gc

clean:
	rm -rf $(VENV) build *.egg-info
