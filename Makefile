# The README's two commands are `make demo` (install + run the demo) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-duckdb test-postgres lint bench

$(BIN)/mergepipe: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/mergepipe

install: $(BIN)/mergepipe

demo: install
	$(BIN)/mergepipe demo

# The whole suite on the embedded DuckDB catalog, then the catalog tests again on a real PostgreSQL server
# (installed from Debian's packages and started by .ci/start-postgres.sh; needs root, as on CI).
test: install test-duckdb test-postgres

# Chromium (Debian's package) for the audit report's browser test, installed like PostgreSQL below.
test-duckdb:
	bash .ci/install-chromium.sh
	$(BIN)/python -m pytest -q -n 2 -m "not fuzz and not slow"

# Fails when the server does not start or no URL comes back: no silent fall-back to DuckDB
# (tests/integration/test_backend.py checks the backend from inside the run).
test-postgres:
	@out=$$(bash .ci/start-postgres.sh) || { echo "test-postgres: .ci/start-postgres.sh failed" >&2; exit 1; }; \
	url=$$(printf '%s\n' "$$out" | tail -n 1); \
	case "$$url" in postgresql*://*) ;; \
	  *) echo "test-postgres: .ci/start-postgres.sh printed no PostgreSQL URL (last line: '$$url')" >&2; exit 1;; \
	esac; \
	echo "MERGEPIPE_TEST_CATALOG=$$url"; \
	MERGEPIPE_TEST_CATALOG="$$url" $(BIN)/python -m pytest -q -n 2 -m "catalog and not fuzz and not slow"

# ruff, and the layer rules of docs/ARCHITECTURE.md (import-linter; function-local imports count)
lint: install
	$(BIN)/ruff check mergepipe_db tests benchmarks
	$(BIN)/lint-imports

bench: install
	$(BIN)/python -m benchmarks.run
