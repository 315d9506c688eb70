# Two commands: `make demo` (the main job) and `make test` (the suite). Both create .venv if absent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Local CPU wheel of torch on these machines; never let pip fall back to a CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),-f /opt/wheels,)
STAMP  := $(VENV)/.installed

.PHONY: demo test install system-deps bench clean lint-docker

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(FIND_LINKS) torch==2.13.0
	$(BIN)/python -m pip install -q $(FIND_LINKS) -e ".[test,retrieval]"
	touch $(STAMP)

install: $(STAMP)

# redis-server is needed by the agent store tests (a real server, started by the fixtures).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null); \
	  else echo "redis-server is missing: install it (e.g. apt-get install redis-server)"; exit 1; fi; }
	@# A C compiler builds the DSA kernels on first use (openglm/model/native.py); without one the torch-op path runs.
	@command -v cc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null) \
	      || echo "note: could not install gcc: DSA will run its slower torch-op path"; \
	  else echo "note: no C compiler (cc): DSA runs its slower torch-op path, and its native-kernel tests skip"; fi; }
	@# Headless Chromium for the agent dashboard's browser tests (Playwright drives /usr/bin/chromium; nothing downloaded).
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null); \
	  else echo "chromium is missing: install it (e.g. apt-get install chromium chromium-driver)"; exit 1; fi; }

demo: $(STAMP)
	$(BIN)/openglm demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

# No container engine runs on the test machines: the Dockerfile is linted instead of built (docs/scaling.md).
lint-docker: $(STAMP)
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) runs .pytest_cache
