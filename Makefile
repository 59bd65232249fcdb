# Every target creates .venv and installs the pinned dependencies itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench bench-data clean

$(STAMP): requirements.txt pyproject.toml setup.py zephon_stream/refit/_digest.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers (pytest-xdist), each taking whole test files: alone the suite keeps about one
# core busy (process starts, servers, waits), so on 2 cores two files at once take 2/3 of the time.
# TEST_WORKERS=0 runs it in one process. The tests marked `alone` (latency bounds, which the other
# worker's processes would break by taking the cores) run after, by themselves. "No tests" (exit
# code 5) fails, except in a part that a PYTEST_ARGS selection leaves empty.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" $(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]
	$(BIN)/python -m pytest -q -m alone $(PYTEST_ARGS) || [ $$? -eq 5 -a -n "$(PYTEST_ARGS)" ]

# The property tests (Hypothesis) draw fixed examples under `make test`; this draws new ones,
# FUZZ_RUNS times, and a failure prints how to reproduce it. Not part of `make test`.
FUZZ_RUNS ?= 5
.PHONY: fuzz
fuzz: $(STAMP)
	for i in $$(seq $(FUZZ_RUNS)); do \
	  $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --hypothesis-profile=fuzz \
	    $$(grep -rl "@given" tests | sort) $(PYTEST_ARGS) || exit 1; done

# The first run fetches two Debian documentation packages (about 50 MB, with apt-get download) into
# the cache below and says so, with the size, before it starts; later runs reuse them.
demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The one step that uses the network (Debian mirrors): benchmarks then talk only to loopback.
bench-data: $(STAMP)
	$(BIN)/python -c "from tools.corpus import ensure_debian_docs as e; p = e(); print(p); raise SystemExit(p is None)"

bench: bench-data
	$(BIN)/python bench/loader.py

# The download cache is tools/corpus.py's cache_dir(): $ZEPHON_DATA_CACHE, else $XDG_CACHE_HOME/zephon-stream,
# else ~/.cache/zephon-stream. `clean` keeps it (it saves a download) and says where it is.
CACHE = $(or $(ZEPHON_DATA_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/zephon-stream)

clean:
	rm -rf $(VENV) .pytest_cache data
	@if [ -d "$(CACHE)" ]; then echo "kept the download cache $(CACHE) ($$(du -sh "$(CACHE)" | cut -f1)): rm -rf $(CACHE) to remove it"; \
	else echo "no download cache at $(CACHE)"; fi

# Tux Paint's stamps (GPL-2; apt-get download into the cache) as image+caption tar shards in data/stamps.
.PHONY: vlm-data
vlm-data: $(STAMP)
	$(BIN)/python -m tools.stamps data/stamps

# Publishing from the trainer loop: steps/s on vs off (tiny and 256M GPT), loop lag while a 1B version publishes.
.PHONY: bench-rl
bench-rl: $(STAMP)
	$(BIN)/python bench/rl_loop.py

# Peers side by side (bench/peers.py): the public Zephon 0.2.0, torch's DataLoader and torchdata's
# StatefulDataLoader beside this loader, in a venv of their own so they never reach .venv or the package's
# dependencies. requirements.txt's pins (extras stripped: pip refuses them in a constraints file) constrain
# every package, torch (a CPU wheel) included: pip never resolves torch unpinned.
PEERS := .venv-peers
$(PEERS)/.installed: requirements.txt pyproject.toml
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	sed 's/\[[^]]*\]//' requirements.txt > $(PEERS)/constraints.txt
	$(PEERS)/bin/pip install --disable-pip-version-check -q -c $(PEERS)/constraints.txt -e '.[parquet]' \
		zephon==0.2.0 torchdata==0.11.0
	touch $@

.PHONY: bench-peers
bench-peers: bench-data $(PEERS)/.installed
	$(PEERS)/bin/python bench/peers.py $(PEERS_ARGS)
