#!/usr/bin/env bash
# `make test`: makes sure Redis, PostgreSQL and Debian's chromium are there, then runs
# every test (unit, worker, websocket and browser tests) against the real services.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh

export TEST_REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/14}
export REDIS_URL=$TEST_REDIS_URL
export DATABASE_URL=${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/rllab}
export RLCORE_HOME=${RLCORE_HOME:-$PWD/var/test-rlcore}

ensure_redis "$REDIS_URL"
ensure_postgres "${DATABASE_URL%/*}/postgres"

if ! command -v chromium >/dev/null 2>&1; then
  echo "chromium: installing Debian's chromium for the browser tests"
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  else
    sudo apt-get install -y -q chromium >/dev/null
  fi
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ]; then
  .venv/bin/pytest -q "$@"
else
  # Playwright's sync API keeps an event loop running in the main thread for as long as
  # its browser is open, so the browser tests get a pytest process of their own.
  # The slowest tests are listed at the end: make test is meant to stay well under 20
  # minutes on 2 cores. The rest run in TEST_WORKERS processes (pytest-xdist, a test file
  # to a process): much of the suite waits on workers, Redis and subprocesses, so two
  # processes on 2 cores take ~18 minutes where one took ~25. Each process has its own
  # PostgreSQL test database (pytest-django) and Redis database (tests/lab_fixtures.py).
  .venv/bin/pytest -q -m "not browser" -n "${TEST_WORKERS:-2}" --dist loadfile --durations=25
  .venv/bin/pytest -q -m browser tests/browser
fi
