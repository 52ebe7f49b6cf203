# Two set-up commands: `make demo` and `make test`. Both create .venv when it is
# missing and install the project with the pins in $(CONSTRAINTS).
PYTHON ?= python3
CONSTRAINTS ?= constraints.txt
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test parity bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[torch,test]'
	touch $(STAMP)

# The main job: the quick parity report (JAX vs PyTorch vs the big batch, and
# every known bug flagged) on the embedded corpus; table + plot under out/.
demo: $(STAMP)
	$(PY) -m parity_tests --device cpu --quick --out out/parity-quick

test: $(STAMP)
	$(PY) -m pytest -q

parity: $(STAMP)
	$(PY) -m parity_tests --device cpu --out out/parity

bench: $(STAMP)
	$(PY) -m benchmarks --out docs/benchmarks.md

clean:
	rm -rf $(VENV) build *.egg-info
