# The torch pin takes the local CPU wheel; an unpinned torch would pull GBs of CUDA packages. The
# transformers pin is the version the tests' expectations were recorded with (tests/test_coverage.py).
PYTHON ?= python3

.PHONY: install test test-fast test-isa test-bench example speed docs

# The install runs once per environment and clone: a stamp named after the interpreter's prefix
# (in .install-stamps/, git-ignored) records it, and a change to pyproject.toml or this file runs it
# again. pip's resolution of the test extras alone takes about 30 s on 2 cores, which every
# make test-fast would otherwise pay.
STAMP := .install-stamps/$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:16])")

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m pip install -q torch==2.13.0 transformers==5.23.0
	$(PYTHON) -m pip install -q -e '.[test]'
	mkdir -p .install-stamps && touch $@ $(CORE_STAMP)

# make example needs memcheck alone, not the test extras (lightning, PEFT, TRL, ...): its own stamp,
# which the full install above also marks done.
CORE_STAMP := .install-stamps/core-$(notdir $(STAMP))

$(CORE_STAMP): pyproject.toml Makefile
	$(PYTHON) -m pip install -q torch==2.13.0 transformers==5.23.0
	$(PYTHON) -m pip install -q -e .
	mkdir -p .install-stamps && touch $@

# Two workers (pytest-xdist): CI's machine has 2 cores; each test still runs its real run and its
# estimate in one process, so the comparisons are unchanged.
test: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 --durations=25 -m "not bench"

# The benchmark lane (tests/lanes.txt, benchmarks/suite_lanes.py): the long real-run sweeps beyond
# their cheapest case, the longest single real-run checks, the whole coverage census and the
# 70B-scale plans; about half an hour on 2 cores, so not in make test.
test-bench: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 --durations=25 -m bench

# The CPU-kernel and convolution accuracy tests again, with ATen and oneDNN capped one instruction
# set below the host's (AVX-512 hosts run the AVX2 paths, AVX2 hosts the SSE4.1 ones): the CPU rules
# must hold on whatever the running process reports, not only on the machine they were checked on.
test-isa: install
	eval "$$($(PYTHON) benchmarks/cpu_rules.py --lower-cap-env)" && HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 \
		tests/test_cpu_kernels.py tests/test_conv_models.py

# The edit-test loop: everything but the tests marked slow (over about 0.5 s) or bench (CI runs
# `make test` and `make test-isa`).
test-fast: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 -m "not slow and not bench"

# The README's first example: GPT-2 small at 8 x 1024 tokens in amp-bf16 on an RTX 4090, with its verdict.
example: $(CORE_STAMP)
	HF_HUB_OFFLINE=1 $(PYTHON) -m memcheck examples/gpt2_small.py --max-len 1024 -b 8 --precision amp-bf16 \
		--gpu RTX-4090 --top 3

speed: install
	HF_HUB_OFFLINE=1 $(PYTHON) benchmarks/speed.py

# The documentation site (mkdocs.yml, docs/): MkDocs with the Material theme, built with --strict
# so that a broken link or anchor fails; CI runs it after make test. Only the docs extra's own
# requirements are installed (read from pyproject.toml; tomli on Python 3.10 comes with make
# install), not memcheck again: the site imports nothing of memcheck (docs/reference.md is
# committed, tests/test_docs.py checks it). Its own stamp, as make install's.
DOCS_STAMP := .install-stamps/docs-$(notdir $(STAMP))
DOCS_REQUIREMENTS = $(PYTHON) -c "import sys; toml = __import__('tomllib' if sys.version_info >= (3, 11) else 'tomli'); \
	print(' '.join(toml.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))"

$(DOCS_STAMP): $(STAMP)
	$(PYTHON) -m pip install -q $$($(DOCS_REQUIREMENTS))
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet
