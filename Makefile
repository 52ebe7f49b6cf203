# Two set-up commands: `make demo` and `make test`. Both create .venv when it is
# missing and install the project with the pins in $(CONSTRAINTS).
PYTHON ?= python3
CONSTRAINTS ?= constraints.txt
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The newest JAX (needs Python >= 3.12): a second environment, without torch.
PYTHON_LATEST ?= $(shell p=$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python; \
	[ -x "$$p" ] && echo "$$p" || echo python3.12)
VENV_LATEST := .venv-latest
STAMP_LATEST := $(VENV_LATEST)/.installed

# The wheel installs jaxaccum, torch_ref and bigbatch; the repository's own packages
# (tinygpt, testkit, parity_tests, benchmarks) are put on the environment's path by a
# .pth file naming this clone, as an editable install does for the others.
define repository_on_path
	echo "$(CURDIR)" > "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/jaxaccum-repository.pth"
endef

.PHONY: demo test test-fast test-latest lint parity trl-audit bench audit-gpt2 fuzz stress clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[torch,flax,hf,trl,test]'
	$(call repository_on_path,$(PY))
	touch $(STAMP)

# The main job: the quick parity report (JAX vs PyTorch vs the big batch, and
# every known bug flagged) on the embedded corpus; table + plot under out/.
demo: $(STAMP)
	$(PY) -m parity_tests --device cpu --quick --out out/parity-quick

# Everything: unit tests, processes, the parity suite, the lessons, benchmark smoke runs, on 2
# workers; loadfile hands each test file to one worker, so a module's shared run (the parity
# suite's, a checkpointed run's) is computed once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not full"

# The unit tests, about a minute on 2 cores (`slow` marks the rest), on 2 workers.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2

$(STAMP_LATEST): pyproject.toml constraints-latest.txt
	test -x $(VENV_LATEST)/bin/python || $(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q -c constraints-latest.txt -e '.[flax,test]'
	$(call repository_on_path,$(VENV_LATEST)/bin/python)
	touch $(STAMP_LATEST)

# Every test that does not need torch, on the newest JAX/Flax/NumPy (torch's skip).
test-latest: $(STAMP_LATEST)
	$(VENV_LATEST)/bin/python -m pytest -q -n 2 --dist loadfile -m "not full"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

parity: $(STAMP)
	$(PY) -m parity_tests --device cpu --out out/parity

# TRL's GRPOTrainer, every loss type x GA 1/2/4 x steps_per_generation GA/2 GA x 1 or 2
# gloo ranks (and the entropy bonus): each verdict checked against TRL's code, the table
# written into docs/trl-invariance.md (a few minutes on 2 cores).
trl-audit: $(STAMP)
	$(PY) -m parity_tests.trl_table --write docs/trl-invariance.md
	$(PY) -m pytest -q -m full parity_tests/trl_table_test.py

bench: $(STAMP)
	$(PY) -m benchmarks --out docs/benchmarks.md

# The audit on GPT-2 small (124M parameters) in JAX and torch, 1 process and 2 gloo ranks, the
# Hugging Face Trainer too: each against its verdict, 5 minutes and 4 x the model + 1.5 GB of
# memory (about 6 minutes on 2 cores); records docs/audit-cost.json. Not in CI.
audit-gpt2: $(STAMP)
	$(PY) -m benchmarks.audit_cost --gpt2

# The property tests (any split of a window is the big batch) with 1000 hypothesis
# examples per mode (vmap, shard_map, plain jit) instead of 40. Not in CI.
fuzz: $(STAMP)
	JAXACCUM_FUZZ_EXAMPLES=1000 $(PY) -m pytest -q -s jaxaccum/_property_test.py

# 50 launches of two gloo ranks (torch_ref.ddp.run: the DDP reference loop, the HF Trainer audit,
# TRL's GRPO audit) beside two CPU burners: launches, deaths and wrong answers per kind, a non-zero
# exit on any, each death's error printed (about 20 minutes on 2 cores). Not in CI.
stress: $(STAMP)
	$(PY) -m torch_ref.stress --launches 50 --burners 2

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info
