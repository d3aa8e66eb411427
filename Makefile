# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the release on this machine's disk (a plain `torch` pulls a CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,docs,tensorboard,examples]'
	# the host allocator a CPU budget uses, compiled now rather than at the first budget
	# (best effort: without a C++ compiler deepsolve falls back to glibc's thresholds)
	-$(PY) -c "from deepsolve.memory import hostalloc; print(hostalloc.build())"
	touch $(STAMP)

# each demo run gets its own directory; runs/navier_stokes-latest points at the newest
DEMO_OUT := runs/navier_stokes-$(shell date +%Y%m%d-%H%M%S)
demo: $(STAMP)
	$(PY) -m deepsolve train problems/navier_stokes.py --out $(DEMO_OUT) $(DEMO_ARGS)
	ln -sfn $(notdir $(DEMO_OUT)) runs/navier_stokes-latest
	@echo "summary and plots: $(PY) -m deepsolve report runs/navier_stokes-latest"

# two workers (pytest-xdist), one torch thread each: the suite's tests are small, and two
# processes use two cores better than one process with two threads; tests that share a
# resource (the checkout's build/) carry an xdist_group and run in one worker
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check deepsolve tests benchmarks problems examples docs/site
	$(VENV)/bin/mypy deepsolve

# the API reference site in build/site (strict: a broken link or reference fails)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "site: build/site/index.html (serve: $(VENV)/bin/mkdocs serve)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
