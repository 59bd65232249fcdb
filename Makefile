# Every target creates .venv and installs the pinned dependencies itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python bench/loader.py

clean:
	rm -rf $(VENV) .pytest_cache data
