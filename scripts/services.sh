#!/usr/bin/env bash
# Makes sure the services the lab talks to answer: Redis (broker + channel layer) always,
# PostgreSQL when DATABASE_URL points at one. Starts a local one when none answers, and
# says clearly what to do when it cannot. Sourced by run.sh and test.sh.

PY=${PY:-.venv/bin/python}

redis_answers() {
  "$PY" - "$1" <<'PYEOF' >/dev/null 2>&1
import sys, redis
redis.Redis.from_url(sys.argv[1], socket_connect_timeout=2).ping()
PYEOF
}

ensure_redis() {
  local url=${1:-redis://127.0.0.1:6379/0}
  if redis_answers "$url"; then echo "redis: answering at $url"; return 0; fi
  echo "redis: nothing answers at $url; starting one"
  if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1; }) || true
    fi
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis: cannot start one: redis-server is not installed. Install it (apt-get install redis-server) or set REDIS_URL to a running Redis." >&2
    return 1
  fi
  local port
  port=$(echo "$url" | sed -E 's#^redis://[^:/]*:?([0-9]*).*#\1#'); port=${port:-6379}
  # Persistent (append-only file, fsync every second): queued jobs' messages survive a Redis
  # restart. Its files live in RLLAB_VAR_DIR/redis-<port>.
  local dir="${RLLAB_VAR_DIR:-$PWD/var}/redis-$port"
  mkdir -p "$dir"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly yes \
    --appendfsync everysec --dir "$dir" --logfile "$dir/redis.log"
  for _ in $(seq 1 50); do redis_answers "$url" && { echo "redis: started on port $port, append-only file in $dir"; return 0; }; sleep 0.2; done
  echo "redis: started redis-server but it does not answer at $url; see $dir/redis.log" >&2
  return 1
}

postgres_answers() {
  "$PY" - "$1" <<'PYEOF' >/dev/null 2>&1
import sys, psycopg
psycopg.connect(sys.argv[1].replace("postgres://", "postgresql://", 1), connect_timeout=3).close()
PYEOF
}

ensure_postgres() {
  # $1: a URL to a database that exists (the maintenance db), e.g. postgres://postgres@127.0.0.1:5432/postgres
  local url=$1
  if postgres_answers "$url"; then echo "postgres: answering at ${url%%\?*}"; return 0; fi
  echo "postgres: nothing answers at $url; trying to start the local cluster"
  if ! command -v pg_ctlcluster >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q postgresql >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q postgresql >/dev/null 2>&1; }) || true
  fi
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    local version; version=$(ls /etc/postgresql | head -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >/dev/null 2>&1 || true
    # Local trust auth for 127.0.0.1, as on the CI machines.
    for _ in $(seq 1 50); do postgres_answers "$url" && { echo "postgres: started cluster $version/main"; return 0; }; sleep 0.2; done
  fi
  echo "postgres: cannot reach or start PostgreSQL at $url. Install PostgreSQL or set TEST_DATABASE_URL to a server that accepts user postgres." >&2
  return 1
}
