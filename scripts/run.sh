#!/usr/bin/env bash
# `make run`: brings up Redis, the database, a Celery worker and the web server, and
# serves the lab on the built-in tiny model. Ctrl-C stops the worker and the server.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh

export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export RLLAB_VAR_DIR=${RLLAB_VAR_DIR:-$PWD/var}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
mkdir -p "$RLLAB_VAR_DIR"

ensure_redis "$REDIS_URL"
"$PY" manage.py migrate --noinput
"$PY" manage.py ensure_admin
"$PY" manage.py seed_lab
"$PY" -c "from rlcore.policy.tiny import ensure_tiny_model; print('tiny model:', ensure_tiny_model())"

queues=cpu,inference
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then queues=cpu,gpu,inference; fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

.venv/bin/celery -A workers worker -Q "$queues" --concurrency 2 --loglevel INFO \
  --hostname "rllab-$(hostname)@%h" >"$RLLAB_VAR_DIR/worker.log" 2>&1 &
pids+=($!)
echo "celery worker: queues $queues (log: $RLLAB_VAR_DIR/worker.log)"
echo
echo "  The lab is at http://$HOST:$PORT/  (log in as 'admin'; the password is printed above)"
echo
.venv/bin/uvicorn webapp.asgi:application --host "$HOST" --port "$PORT" &
pids+=($!)
wait -n "${pids[@]}"
