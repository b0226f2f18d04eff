# ds4 workbench. `make setup` then `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL := models/ds4-tiny.gguf
CUDA_ARCH ?= sm_90a

.PHONY: setup venv model test test-slow bench cuda clean clean-numba

setup: venv model

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	touch $@

model: $(MODEL)

$(MODEL): $(VENV)/.installed
	mkdir -p models
	$(VENV)/bin/ds4-quantize synth --preset tiny --seed 0 models/tiny-hf
	$(VENV)/bin/ds4-quantize convert models/tiny-hf $(MODEL) --type f16

test: venv
	$(VENV)/bin/ds4-eval --self-test-extractors
	$(VENV)/bin/pytest -q -x

test-slow: venv
	$(VENV)/bin/pytest -q -m slow

bench: venv
	$(PY) -m ds4.engine.bench_tokenizer

.PHONY: bench-engine
bench-engine: venv
	$(PY) -m ds4.engine.bench

.PHONY: bench-quants
bench-quants: venv
	$(PY) -m ds4.gguf_tools.quants.bench

.PHONY: bench-convert
bench-convert: venv
	$(PY) -m ds4.gguf_tools.quants.bench_convert

cuda: venv
	$(PIP) install -q pybind11
	CUDA_ARCH=$(CUDA_ARCH) $(PY) engine/gpu/build.py

clean: clean-numba
	rm -rf build *.egg-info models

# numba's on-disk cache notices edits to a function's own file only, not to the kernels it inlines
# from other files (quants/lanes.py into engine/kernels.py, ...): after editing those, clear it.
clean-numba:
	find . -path ./$(VENV) -prune -o \( -name '*.nbi' -o -name '*.nbc' \) -print | xargs rm -f
