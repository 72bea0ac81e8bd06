#!/usr/bin/env bash
# Runs the whole test suite the way CI does: lint, then pytest with a throwaway PostgreSQL cluster
# (started here, stopped by its pid on exit) so the catalog tests also run against PostgreSQL.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
mkdir -p .scratch
"$VENV/bin/ruff" check .

PG_DIR=.scratch/pg-test
if [ "${CKPTFLOW_SKIP_POSTGRES:-0}" != "1" ]; then
  if bash scripts/postgres.sh start "$PG_DIR"; then
    trap 'bash scripts/postgres.sh stop "$PG_DIR" || true' EXIT
    CKPTFLOW_TEST_POSTGRES_URL="$(bash scripts/postgres.sh url "$PG_DIR")"
    export CKPTFLOW_TEST_POSTGRES_URL
  else
    echo "run_tests: PostgreSQL could not be started; PostgreSQL variants will be skipped" >&2
  fi
fi

# Headless Chromium for the Prefect UI check (tests/integration/services/test_ui_browser.py).
if CKPTFLOW_CHROMIUM="$(bash scripts/chromium.sh)"; then
  export CKPTFLOW_CHROMIUM
else
  unset CKPTFLOW_CHROMIUM
  echo "run_tests: Chromium is not available; the browser check will be skipped" >&2
fi

# Flow-run logs are not shipped to the test servers: a test stops its server while the log worker
# may still hold lines, which then end up as retry noise after pytest's summary.
export PREFECT_LOGGING_TO_API_ENABLED=false
"$VENV/bin/python" -m pytest -q -ra "$@"
