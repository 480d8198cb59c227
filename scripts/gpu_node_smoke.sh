#!/usr/bin/env bash
# The GPU node smoke test (issue 17): on a machine with a CUDA GPU, bring up Redis and the
# lab's database, start one worker with `-Q gpu,inference` as a GPU node would, then
# through the lab's own services create an RL job that asks for one GPU, wait for it, and
# check that it ran on CUDA on this node (the node's card is named), that metrics and
# rollouts landed in the database, that its checkpoint is playable (a Play move on the
# inference queue), and, where vLLM is installed, that an eval on the vllm engine ran.
#
#   scripts/gpu_node_smoke.sh            # everything under var/gpu-smoke, SQLite
#   SMOKE_GPUS=2 scripts/gpu_node_smoke.sh   # the RL job data-parallel over two GPUs
#   DATABASE_URL=postgres://... REDIS_URL=redis://... scripts/gpu_node_smoke.sh
#
# Redis: one answering at REDIS_URL, else redis-server from PATH, else from the Debian
# packages in $REDIS_DEBS (default shared/debs: redis-server_*.deb and redis-tools_*.deb,
# unpacked with dpkg-deb -x, no root needed). Prints one line per check and exits non-zero
# on the first that fails; the worker's log is $RLLAB_VAR_DIR/worker-gpu.log.
set -euo pipefail
cd "$(dirname "$0")/.."
export RLLAB_VAR_DIR=${RLLAB_VAR_DIR:-$PWD/var/gpu-smoke}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6390/0}
export RLCORE_HOME=${RLCORE_HOME:-$RLLAB_VAR_DIR/rlcore}
export DJANGO_SETTINGS_MODULE=webapp.settings
export PY=${PY:-.venv/bin/python}
REDIS_DEBS=${REDIS_DEBS:-shared/debs}
SMOKE_STEPS=${SMOKE_STEPS:-3}
SMOKE_GPUS=${SMOKE_GPUS:-1}  # 2 or more: the RL job runs data-parallel over that many GPUs
mkdir -p "$RLLAB_VAR_DIR"

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch: this is the GPU node smoke test')"

if ! command -v redis-server >/dev/null 2>&1 && ls "$REDIS_DEBS"/redis-server_*.deb >/dev/null 2>&1; then
  root="$RLLAB_VAR_DIR/redis-debs"
  mkdir -p "$root"
  for deb in "$REDIS_DEBS"/redis-*.deb "$REDIS_DEBS"/liblzf*.deb "$REDIS_DEBS"/libjemalloc*.deb; do
    [ -e "$deb" ] && dpkg-deb -x "$deb" "$root"
  done
  export PATH="$root/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "redis: unpacked $(ls "$REDIS_DEBS"/redis-server_*.deb) under $root"
fi
source scripts/services.sh
ensure_redis "$REDIS_URL"
"$PY" manage.py migrate --noinput -v0
"$PY" -c "from rlcore.policy.tiny import ensure_tiny_model; print('tiny model:', ensure_tiny_model())"

node="gpu-smoke@$(hostname)"
env DB_POOL_MAX_SIZE=0 "$PY" -m celery -A workers worker -Q gpu,inference -c 1 -n "$node" \
  -l INFO >>"$RLLAB_VAR_DIR/worker-gpu.log" 2>&1 &
worker=$!
trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT

"$PY" - "$node" "$SMOKE_STEPS" "$SMOKE_GPUS" "$worker" "$RLLAB_VAR_DIR/worker-gpu.log" <<'PYEOF'
import os, sys, time, django

django.setup()
from django.contrib.auth import get_user_model
from webapp.jobs import services
from webapp.jobs.models import Job, Metric, Rollout, WorkerNode
from webapp.play import services as play
from webapp.play.models import Game

node_name, steps, gpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
worker_pid, worker_log = int(sys.argv[4]), sys.argv[5]


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def worker_alive():
    try:
        with open(f"/proc/{worker_pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not worker_alive():
            tail = open(worker_log, errors="replace").read()[-3000:]
            check(False, f"{what}: the worker exited; the end of {worker_log}:\n{tail}")
        value = predicate()
        if value:
            return value
        time.sleep(1)
    check(False, f"{what} within {seconds} s")


node = wait(lambda: WorkerNode.objects.filter(name=node_name).first(), 300, "the worker announced itself")
check(bool(node.gpus), f"node {node.name}: {node.gpus} · {node.versions}")
owner, _ = get_user_model().objects.get_or_create(username="gpu-smoke")
env = services.env_config_save(owner=owner, name=f"smoke-{time.time():.0f}", env_name="tictactoe", params={})
tiny = services.model_create(owner=owner, name=f"tiny-{time.time():.0f}", kind="tiny")
started = time.monotonic()
job = services.job_create(
    owner=owner, kind="rl", env_config=env, model=tiny,
    options={"gpus": gpus, "device": "cuda", "max_steps": steps, "batch_size": 64,
             "rollouts_per_example": 8, "save_every": 0},
)
check(job.queue == "gpu", f"rl job #{job.pk} queued on {job.queue}")
wait(lambda: Job.objects.get(pk=job.pk).status in Job.TERMINAL, 1800, f"rl job #{job.pk} ended")
job.refresh_from_db()
check(job.status == "succeeded", f"rl job #{job.pk} {job.status} in {time.monotonic() - started:.0f} s {job.error}")
first = job.log_lines.first().message
parallel = gpus < 2 or f"{gpus} data-parallel ranks" in first
check(job.worker == node_name and "training on cuda" in first and parallel,
      f"ran on {job.worker}, engine {job.engine_used}: {first!r}")
metrics, rollouts = Metric.objects.filter(job=job).count(), Rollout.objects.filter(job=job).count()
check(metrics > 0 and rollouts > 0, f"{metrics} metric points, {rollouts} rollouts stored")
for name in ("perf/step_seconds", "reward/mean"):
    values = list(Metric.objects.filter(job=job, name=name).order_by("step").values_list("value", flat=True))
    print(f"     {name}: {values}")
checkpoint = job.current_checkpoints().order_by("-step").first()
if gpus >= 2:
    # SFT data-parallel too: a small dataset of the random player's games, then SFT on it.
    player = services.model_create(owner=owner, name=f"random-{time.time():.0f}", kind="builtin", location="random")
    synth = services.job_create(owner=owner, kind="synth", env_config=env, model=player,
                                options={"gpus": 1, "device": "cuda", "num_examples": 64, "max_kept": 32,
                                         "exclude_outcomes": ["loss"]})
    wait(lambda: Job.objects.get(pk=synth.pk).status in Job.TERMINAL, 600, f"synth #{synth.pk} ended")
    synth.refresh_from_db()
    check(synth.status == "succeeded", f"synth #{synth.pk} {synth.status}: {synth.result and synth.result.get('kept')} games kept {synth.error}")
    sft = services.job_create(owner=owner, kind="sft", env_config=None, model=tiny,
                              options={"gpus": gpus, "device": "cuda", "dataset": synth.result["path"],
                                       "max_steps": 4, "batch_size": 8, "micro_batch_size": 2})
    wait(lambda: Job.objects.get(pk=sft.pk).status in Job.TERMINAL, 600, f"sft #{sft.pk} ended")
    sft.refresh_from_db()
    losses = list(Metric.objects.filter(job=sft, name="loss/sft").order_by("step").values_list("value", flat=True))
    first = sft.log_lines.first().message
    check(sft.status == "succeeded" and f"{gpus} data-parallel ranks" in first and len(losses) == 4,
          f"sft #{sft.pk} {sft.status} {sft.error}: {first!r}; loss/sft {[round(v, 3) for v in losses]}")
check(checkpoint is not None, f"checkpoint {checkpoint and checkpoint.path}")
game = play.game_create(owner=owner, player_key=f"model-{checkpoint.model_entry.pk}", human_mark="O", human_starts=False)
game = wait(lambda: Game.objects.exclude(status=Game.Status.MODEL_TURN).filter(pk=game.pk).first(), 300, "the checkpoint played its first move")
check(game.status != "model_failed", f"play: game #{game.pk} {game.status} {game.outcome} after the checkpoint's move, "
      f"{len(game.replies)} replies, the first {str(game.replies[:1])[:160]}")
if "vllm" in node.engines:
    job = services.job_create(owner=owner, kind="eval", env_config=env, model=checkpoint.model_entry,
                              options={"gpus": 1, "engine": "vllm", "num_examples": 32})
    wait(lambda: Job.objects.get(pk=job.pk).status in Job.TERMINAL, 1800, f"eval #{job.pk} on vllm ended")
    job.refresh_from_db()
    check(job.status == "succeeded" and job.engine_used == "vllm", f"eval #{job.pk} on {job.engine_used}: {job.status} {job.error}")
else:
    print("skip vllm: not installed on this node")
PYEOF
