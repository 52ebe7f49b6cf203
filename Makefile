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
# The JAX trainers (Tunix, MaxText): a third environment, the newest set and their pins.
VENV_TRAINERS := .venv-jax-trainers
STAMP_TRAINERS := $(VENV_TRAINERS)/.installed
# maxtext 0.2.5 declares no dependency outside its extras: what its train step imports on a CPU
MAXTEXT_IMPORTS := pathwaysutils aqtp tokamax drjax tiktoken

# The wheel installs jaxaccum, torch_ref and bigbatch; the repository's own packages
# (tinygpt, testkit, parity_tests, benchmarks) are put on the environment's path by a
# .pth file naming this clone, as an editable install does for the others.
define repository_on_path
	echo "$(CURDIR)" > "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/jaxaccum-repository.pth"
endef

.PHONY: demo test test-fast test-latest jax-trainers jax-trainers-record lint docs docs-check parity trl-audit bench audit-gpt2 fuzz stress clean

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
# suite's, a checkpointed run's) is computed once (and the files that read the lessons' runs
# go to one worker together: conftest.py's scheduler).
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

# The documentation site, out/docs/index.html: the Markdown pages, the API reference from the
# docstrings, the lessons run as a gallery (a failing assertion fails the build). Warnings are
# errors, every cross-reference resolves (-W -n). docs/_site/conf.py assembles the source tree
# in out/docs-src from the repository.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	mkdir -p out/docs-src
	$(PY) -m sphinx -b html -W --keep-going -n -q -c docs/_site out/docs-src out/docs

# The built site in headless Chromium (Debian's, installed here when missing and root may;
# without it the browser checks skip and say why): screenshots in out/docs-check/ (copy them
# to docs/_static/ to update the committed ones), math typeset, links, images, search.
docs-check: docs
	command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q chromium; } || echo "[docs-check] chromium could not be installed"
	$(PY) -m pytest -q -n 0 -m full docs/_site/site_test.py

$(STAMP_TRAINERS): pyproject.toml constraints-latest.txt constraints-jax-trainers.txt
	test -x $(VENV_TRAINERS)/bin/python || $(PYTHON_LATEST) -m venv $(VENV_TRAINERS)
	$(VENV_TRAINERS)/bin/python -m pip install -q --upgrade pip
	$(VENV_TRAINERS)/bin/python -m pip install -q -c constraints-latest.txt \
		-c constraints-jax-trainers.txt -e '.[flax,test]' google-tunix maxtext $(MAXTEXT_IMPORTS)
	$(call repository_on_path,$(VENV_TRAINERS)/bin/python)
	touch $(STAMP_TRAINERS)

# Tunix's PeftTrainer and GRPOLearner, MaxText's train step and SFT trainer, as they ship, under
# jaxaccum.audit: each verdict, the fixes, docs/jax-trainers.json against a fresh run, lesson 11
# and the numbers of docs/jax-trainers.md (CI runs it beside `make test`: .ci/run; see the README for its time).
jax-trainers: $(STAMP_TRAINERS)
	$(VENV_TRAINERS)/bin/python -m pytest -q -n 2 --dist loadfile jax_trainers \
		examples/lessons_test.py examples/docs_numbers_test.py -k "trainers or record or 11_"

# Runs the table again and records it: docs/jax-trainers.json and docs/jax-trainers.md's table.
jax-trainers-record: $(STAMP_TRAINERS)
	$(VENV_TRAINERS)/bin/python -m jax_trainers --write

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
# TRL's GRPO audit; torchrun: a parity scenario) beside two CPU burners: launches, deaths and
# wrong answers per kind, a non-zero exit on any, each death's error printed (about 8 minutes on
# 2 cores). Not in CI.
stress: $(STAMP)
	$(PY) -m parity_tests.stress --launches 50 --burners 2

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(VENV_TRAINERS) build *.egg-info
