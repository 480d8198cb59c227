#!/usr/bin/env bash
# `make run`: brings up Redis (persistent, AOF), the database, two Celery workers and the web
# server, and serves the lab on the built-in tiny model.
#
# Workers: one for jobs (queues cpu, and gpu when torch sees CUDA; WORKER_CONCURRENCY
# processes, default 2, at nice 10, each with JOBS_THREADS torch threads: the cores shared
# among them) and one for Play moves (queue inference; a thread pool of
# INFERENCE_CONCURRENCY, default 16, whose moves a local model generates as one batch, on
# INFERENCE_THREADS torch threads, default 1), so a game never waits behind training. The web server runs WEB_CONCURRENCY
# uvicorn processes (default: the number of cores, between 2 and 4); websockets work across
# them through the Redis channel layer.
#
# Each of the three is supervised: one that exits is reported and started again (after 1 s,
# doubling up to 30 s while it keeps dying young), and never takes the others down; what a
# dead worker leaves behind (its pool processes) is killed first.
# Ctrl-C stops them all and exits 0. Logs: $RLLAB_VAR_DIR/{web,worker-jobs,worker-inference}.log
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh

export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export RLLAB_VAR_DIR=${RLLAB_VAR_DIR:-$PWD/var}
# Everything the lab writes lives under RLLAB_VAR_DIR, the built-in tiny model included,
# unless RLCORE_HOME says where rlcore keeps its models.
export RLCORE_HOME=${RLCORE_HOME:-$RLLAB_VAR_DIR/rlcore}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
cores=$(nproc 2>/dev/null || echo 2)
WEB_CONCURRENCY=${WEB_CONCURRENCY:-$((cores < 2 ? 2 : (cores > 4 ? 4 : cores)))}
WORKER_CONCURRENCY=${WORKER_CONCURRENCY:-2}
# torch threads: the jobs share the cores between them; Play moves run on one thread (a
# second one waits on the first whenever training or the web holds a core, which cost
# moves several times their time under load: bench/load.py, docs/BENCHMARKS.md).
jobs_threads=$(( cores / WORKER_CONCURRENCY > 1 ? cores / WORKER_CONCURRENCY : 1 ))
INFERENCE_CONCURRENCY=${INFERENCE_CONCURRENCY:-16}
mkdir -p "$RLLAB_VAR_DIR"

ensure_redis "$REDIS_URL"
"$PY" manage.py migrate --noinput
"$PY" manage.py ensure_admin
"$PY" manage.py seed_lab
"$PY" -c "from rlcore.policy.tiny import ensure_tiny_model; print('tiny model:', ensure_tiny_model())"

queues=cpu
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then queues=cpu,gpu; fi

stop_flag="$RLLAB_VAR_DIR/run.stopping"
rm -f "$stop_flag"

# supervise NAME LOG COMMAND...: run COMMAND, and run it again whenever it exits, until
# run.sh stops. Then COMMAND gets SIGTERM (a worker's warm shutdown: running jobs may finish)
# and, if still there after STOP_GRACE_SECONDS, SIGQUIT (cold shutdown; its running jobs are
# marked lost when the worker starts again, and a retry resumes from their last checkpoint).
STOP_GRACE_SECONDS=${STOP_GRACE_SECONDS:-10}
supervise() {
  local name=$1 log=$2
  shift 2
  local child="" delay=1 started rc timer
  # Ctrl-C is run.sh's to handle (it stops the supervisors in turn); SIGTERM stops this one.
  trap '' INT
  trap 'touch "$stop_flag"; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true' TERM
  while [ ! -e "$stop_flag" ]; do
    started=$SECONDS
    # A session of its own: Ctrl-C reaches only run.sh, which stops each command in order,
    # and whatever a command leaves behind (a killed worker's pool processes) is found by
    # its process group and killed.
    setsid "$@" >>"$log" 2>&1 &
    child=$!
    rc=0
    wait "$child" || rc=$?
    if [ -e "$stop_flag" ]; then
      (sleep "$STOP_GRACE_SECONDS"; kill -QUIT "$child"; sleep 5; kill -KILL "$child") 2>/dev/null &
      timer=$!
      wait "$child" 2>/dev/null || true
      kill "$timer" 2>/dev/null || true
      kill -KILL -- "-$child" 2>/dev/null || true
      break
    fi
    kill -KILL -- "-$child" 2>/dev/null || true
    if ((SECONDS - started > 60)); then delay=1; fi
    echo "run.sh: $name (pid $child) exited with status $rc; starting it again in ${delay}s (log: $log)"
    sleep "$delay" &
    wait $! || true
    delay=$((delay * 2 > 30 ? 30 : delay * 2))
  done
}

supervisors=()
stop() {
  trap - INT TERM EXIT
  touch "$stop_flag"
  echo
  echo "run.sh: stopping"
  for pid in "${supervisors[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -f "$stop_flag"
  exit 0
}
trap stop INT TERM EXIT

# Workers use no PostgreSQL connection pool: a prefork worker forks pool processes from a
# main process that uses the database (watchdog), and a forked child must not inherit its
# pooled connections. (The pool is for the web server's bursts.)
celery_worker=(env DB_POOL_MAX_SIZE=0 .venv/bin/celery -A workers worker --loglevel INFO)
# Training yields the CPU to Play moves and pages: a person waits on those, not on a step.
# Each supervised command is a session of its own, and where the kernel groups sessions
# for scheduling (autogroup, on by default in most desktop and cloud kernels) a process's
# nice value only ranks it inside its own session's group: the group's nice is set too.
# (lower_priority NICE COMMAND...: a program, since setsid runs it.)
lower_priority=(bash -c 'echo "$0" >/proc/self/autogroup 2>/dev/null || true; exec nice -n "$0" "$@"')
supervise "worker jobs" "$RLLAB_VAR_DIR/worker-jobs.log" \
  "${lower_priority[@]}" "${JOBS_NICE:-10}" env OMP_NUM_THREADS="${JOBS_THREADS:-$jobs_threads}" \
  "${celery_worker[@]}" -Q "$queues" --concurrency "$WORKER_CONCURRENCY" --hostname "jobs@%h" &
supervisors+=($!)
supervise "worker inference" "$RLLAB_VAR_DIR/worker-inference.log" \
  env OMP_NUM_THREADS="${INFERENCE_THREADS:-1}" \
  "${celery_worker[@]}" -Q inference -P threads --concurrency "$INFERENCE_CONCURRENCY" \
  --hostname "inference@%h" &
supervisors+=($!)
supervise "web server" "$RLLAB_VAR_DIR/web.log" \
  env DB_POOL_MAX_SIZE="${DB_POOL_MAX_SIZE:-8}" .venv/bin/uvicorn webapp.asgi:application --host "$HOST" --port "$PORT" --workers "$WEB_CONCURRENCY" &
supervisors+=($!)
echo "celery workers: jobs on $queues x$WORKER_CONCURRENCY, Play moves on inference x$INFERENCE_CONCURRENCY (logs: $RLLAB_VAR_DIR/worker-*.log)"
echo "web server: $WEB_CONCURRENCY processes (log: $RLLAB_VAR_DIR/web.log)"
echo
echo "  The lab is at http://$HOST:$PORT/  (log in as 'admin'; the password is printed above)"
echo
# Only Ctrl-C (or SIGTERM) ends this: the supervisors never return on their own.
while true; do
  wait || true
  sleep 1
done
