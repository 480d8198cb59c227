"""Training on more than one device, on the CPU: two gloo ranks take the same SFT step and
the same RL update as one process, and the split placement's generation copy follows the
trainer's weights."""

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcore.events import RecordingSink
from rlcore.policy.local import LocalEngine
from rlcore.train import distributed
from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.config import ConfigError, RLConfig, SFTConfig, build_config
from rlcore.train.distributed import (
    RankFailed,
    copy_weights,
    current_ranks,
    data_parallel_processes,
    generation_model,
    launch,
    never,
    placement_devices,
    run_rl_ranks,
    run_sft_ranks,
)
from rlcore.train.grpo import build_learner, learn, loss_normalizer, run_rl
from rlcore.train.sequences import TrainingSequence
from rlcore.types import SamplingParams
from tests.rl_fixtures import StopAfterFirstStep, rl_config


def final_weights(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def assert_same_weights(one, other):
    """Equal up to numerical noise: a gradient entry near 0 that differs in its last bits
    between one process and two can move its weight by a visible fraction of a step in
    Adam (lr 1e-2 here), so the tolerance is 1% of a step."""
    assert one.keys() == other.keys()
    for name in one:
        torch.testing.assert_close(
            one[name],
            other[name],
            rtol=1e-4,
            atol=1e-4,
            msg=lambda text, name=name: f"{name}: {text}",
        )


def assert_same_metrics(one: dict, other: dict, names: list[str]):
    for name in names:
        assert one[name] == pytest.approx(other[name], rel=1e-4, abs=1e-6), name


@pytest.fixture
def sft_data(tmp_path):
    path = tmp_path / "data.jsonl"
    with path.open("w") as out:
        for index in range(12):
            reply = "<move>" + str(index % 9) + "</move>" + " ok" * index
            messages = [
                {"role": "user", "content": "Board " + "X.O" * (index % 4 + 1)},
                {"role": "assistant", "content": reply},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_two_ranks_take_the_same_sft_step_as_one_process(tiny_model, sft_data, tmp_path):
    def config(name: str) -> SFTConfig:
        settings = dict(
            model=tiny_model,
            dataset=str(sft_data),
            output_dir=str(tmp_path / name),
            device="cpu",
            max_steps=1,
            batch_size=10,
            micro_batch_size=2,
            lr=1e-3,
        )
        return build_config(SFTConfig, [("test", settings)])

    alone, together = RecordingSink(), RecordingSink()
    one = run_sft_ranks(config("one"), alone, processes=1)
    two = run_sft_ranks(config("two"), together, processes=2)

    assert_same_metrics(
        alone.metrics[0][1], together.metrics[0][1], ["loss/sft", "optim/grad_norm"]
    )
    assert_same_weights(final_weights(one), final_weights(two))
    assert "Traceback" not in (tmp_path / "two" / "ranks" / "rank_1.log").read_text()
    logs = [m for _, m in together.logs]
    for when in ("at the start", "after step 1", "at the end"):
        assert f"sft: {when} the 2 data-parallel ranks hold the same weights" in logs
    assert not [m for _, m in alone.logs if "data-parallel" in m]


def fixed_batch(vocabulary: int) -> list[TrainingSequence]:
    """Ten sequences of different lengths, their last tokens trained with advantage +-1."""
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for index in range(10):
        length, trained = 6 + 3 * index, 2 + index % 4
        advantage = 1.0 if index % 2 else -1.0
        sequences.append(
            TrainingSequence(
                input_ids=torch.randint(3, vocabulary, (length,), generator=generator).tolist(),
                weights=[0.0] * (length - trained) + [1.0] * trained,
                advantages=[0.0] * (length - trained) + [advantage] * trained,
                sampled_logprobs=None,
            )
        )
    return sequences


def fixed_update(settings: dict) -> tuple[dict, dict]:
    """One RL update of `settings` on the fixed batch, each rank on its share of the
    sequences, the loss over the whole batch's normalizer; also the follower's entry."""
    cfg = build_config(RLConfig, [("test", settings)])
    learner, tokenizer, _ = build_learner(cfg, torch.device("cpu"), never)
    sequences = fixed_batch(len(tokenizer))
    normalizer = loss_normalizer(sequences, cfg.loss, cfg.sampling.max_tokens)
    metrics = learn(learner, current_ranks().deal(sequences), normalizer, cfg)
    return metrics, {k: v.clone() for k, v in learner.model.state_dict().items()}


def test_two_ranks_take_the_same_rl_update_as_one_process(tiny_model, tmp_path):
    # Two updates per batch and a KL term: the scoring pass and the reference run too.
    settings = rl_config(tiny_model, tmp_path, "fixed", num_iterations=2, beta=0.1).to_dict()

    alone, alone_weights = fixed_update(settings)
    together, together_weights = launch(
        lambda: fixed_update(settings),
        "tests.test_distributed:fixed_update",
        settings,
        processes=2,
        backend="gloo",
    )

    names = ["loss/policy", "loss/total", "loss/kl", "optim/grad_norm"]
    names += ["policy/entropy", "policy/clip_fraction"]
    assert_same_metrics(alone, together, names)
    assert alone["optim/grad_norm"] > 0 and alone["loss/kl"] > 0
    assert_same_weights(alone_weights, together_weights)


def test_a_split_run_trains_like_a_colocated_one(formatted_model, tmp_path):
    runs = {"colocated": RecordingSink(), "split": RecordingSink()}
    finals = {
        "colocated": run_rl_ranks(
            rl_config(formatted_model, tmp_path, "colocated", max_steps=2, lr=1e-3),
            runs["colocated"],
        ),
        "split": run_rl_ranks(
            rl_config(formatted_model, tmp_path, "split", max_steps=2, lr=1e-3, placement="split"),
            runs["split"],
        ),
    }

    names = ["reward/mean", "loss/policy", "optim/grad_norm", "policy/logprob_mismatch"]
    for (_, alone), (_, other) in zip(
        runs["colocated"].metrics, runs["split"].metrics, strict=True
    ):
        assert alone["optim/grad_norm"] > 0
        assert_same_metrics(alone, other, names)
    assert_same_weights(final_weights(finals["colocated"]), final_weights(finals["split"]))
    # Step 2's rollouts came from the weights after step 1: the logprobs they were sampled
    # with match the trainer's only if the split run's generation copy got those weights.
    assert runs["split"].metrics[1][1]["policy/logprob_mismatch"] < 1e-5


def test_data_parallel_ranks_each_roll_out_their_share_and_take_the_same_steps(
    formatted_model, tmp_path
):
    sink = RecordingSink()
    cfg = rl_config(
        formatted_model, tmp_path, "parallel", max_steps=2, lr=1e-3, processes=2, log_rollouts=16
    )
    final = run_rl_ranks(cfg, sink)  # the config's processes

    # Rank 0 rolled out examples 0 and 2 of each step, rank 1 examples 1 and 3: rank 0 logs
    # all 16 rollouts, each example's group whole.
    assert [step for step, _ in sink.rollout_batches] == [1, 2]
    for step, rollouts in sink.rollout_batches:
        assert len(rollouts) == 16, step
        # The sample lists the first rollout of each example, then the second...
        rounds = [[r.example_id for r in rollouts[i : i + 4]] for i in (0, 4, 8, 12)]
        # ... and rank 0's examples come before rank 1's: 0 and 2 of the step, then 1 and 3.
        first = 4 * (step - 1)
        assert all(ids == [first, first + 2, first + 1, first + 3] for ids in rounds), rounds
    assert [step for step, _ in sink.metrics] == [1, 2]
    for _, metrics in sink.metrics:
        assert metrics["optim/grad_norm"] > 0
        # Every rank's replies were sampled from its own model with the weights it trains.
        assert metrics["policy/logprob_mismatch"] < 1e-5
    # The final weights are rank 0's, and rank 1 checked in the same ones at the start,
    # after the first step's rollout and the step itself, and at the end.
    logs = [m for _, m in sink.logs]
    for when in ("at the start", "after step 1's rollout", "after step 1", "at the end"):
        assert f"rl: {when} the 2 data-parallel ranks hold the same weights" in logs
    assert final_weights(final).keys()
    assert "Traceback" not in (tmp_path / "parallel" / "ranks" / "rank_1.log").read_text()


def follow_rl_at_another_rate(payload: dict) -> None:
    """Rank 1 of a run whose ranks step apart: the run's own follower with ten times the
    learning rate, a rank whose update comes out otherwise than rank 0's."""
    payload["settings"]["optimizer"]["lr"] *= 10
    distributed.follow_rl(payload)


@pytest.mark.parametrize("limit", [None, "75"])
def test_ranks_that_step_apart_fail_the_run_after_the_first_step(
    formatted_model, tmp_path, monkeypatch, limit
):
    if limit:  # the MPS thread limit that made ranks drift apart on an H100: named
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", limit)
    sink = RecordingSink()
    cfg = rl_config(formatted_model, tmp_path, "apart", max_steps=4, save_every=2, processes=2)
    with pytest.raises(
        (distributed.RanksDiverged, RankFailed),
        match=r"rl: after step 1 data-parallel ranks \[1\] hold weights other than rank 0's",
    ) as failure:
        launch(
            lambda: run_rl(cfg, sink),
            "tests.test_distributed:follow_rl_at_another_rate",
            {"settings": cfg.to_dict(), "engine": "local"},
            processes=2,
            backend="gloo",
            log_dir=tmp_path / "ranks",
        )
    assert ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='75' is set" in str(failure.value)) == bool(limit)
    # Named: the first parameter whose sums differ (every one moved at another rate).
    assert "the first that differs is model.embed_tokens.weight (its sum " in str(failure.value)
    # Found before step 1 was logged or anything saved: not after all four steps.
    assert sink.metrics == [] and sink.checkpoints == []
    assert not (tmp_path / "apart" / "final").exists()


def follow_rl_from_another_model(payload: dict) -> None:
    """Rank 1 of a run whose ranks start apart: the run's follower from another checkpoint
    of the same architecture."""
    payload["settings"]["model"] = payload["other_model"]
    distributed.follow_rl(payload)


def test_ranks_that_start_apart_fail_the_run_before_its_first_step(
    tiny_model, formatted_model, tmp_path
):
    sink = RecordingSink()
    cfg = rl_config(formatted_model, tmp_path, "start", max_steps=2, processes=2)
    with pytest.raises(
        (distributed.RanksDiverged, RankFailed),
        match=r"rl: at the start data-parallel ranks \[1\] hold weights other than rank 0's",
    ):
        launch(
            lambda: run_rl(cfg, sink),
            "tests.test_distributed:follow_rl_from_another_model",
            {"settings": cfg.to_dict(), "engine": "local", "other_model": tiny_model},
            processes=2,
            backend="gloo",
            log_dir=tmp_path / "ranks",
        )
    assert sink.metrics == [] and sink.checkpoints == [] and sink.rollout_batches == []


def test_the_generation_copy_follows_the_trainer_in_place(tiny_model):
    train_device, generation_device = placement_devices("split", torch.device("cpu"))
    model, tokenizer = load_model_and_tokenizer(tiny_model, train_device)
    copy = generation_model(model, "split", generation_device)
    assert generation_model(model, "colocated", generation_device) is model
    assert copy is not model and not any(p.requires_grad for p in copy.parameters())
    addresses = [p.data_ptr() for p in copy.parameters()]
    engine = LocalEngine(None, model=copy, tokenizer=tokenizer)
    prompt = [{"role": "user", "content": "ab"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    def reply(policy):
        return asyncio.run(policy.generate(prompt, greedy)).logprobs

    before = reply(engine)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    # The copy is the model before the step (a second pass may sum in another order).
    assert reply(engine) == pytest.approx(before, abs=1e-5)
    copy_weights(model, copy)

    assert [p.data_ptr() for p in copy.parameters()] == addresses
    after = reply(engine)
    assert after != pytest.approx(before, abs=1e-3)
    assert after == pytest.approx(reply(LocalEngine(None, model=model, tokenizer=tokenizer)))


def test_split_placement_on_one_gpu_or_none_names_what_it_needs():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the two GPUs split placement needs")
    with pytest.raises(ValueError, match="placement='split' needs two CUDA GPUs"):
        placement_devices("split", torch.device("cuda"))
    with pytest.raises(ConfigError, match="placement must be one of"):
        build_config(RLConfig, [("test", {"placement": "both"})])


def test_a_job_on_several_gpus_runs_data_parallel_unless_it_splits_placement(tiny_model, tmp_path):
    assert data_parallel_processes(1, rl_config(tiny_model, tmp_path, "a")) == 1
    assert data_parallel_processes(2, rl_config(tiny_model, tmp_path, "a")) == 2
    split = rl_config(tiny_model, tmp_path, "a", placement="split")
    assert data_parallel_processes(2, split) == 1
    with pytest.raises(ValueError, match="data-parallel run"):
        run_rl_ranks(split, processes=2)


@pytest.mark.django_db(transaction=True)
def test_an_sft_job_on_two_gpus_runs_data_parallel_in_the_worker(
    alice, tiny_model, sft_data, tmp_path
):
    from webapp.jobs.models import Job, Metric
    from workers.sink import DatabaseSink
    from workers.tasks import execute

    # The device is the CPU (gloo) here; on a GPU node the same path runs NCCL over n cards.
    config = dict(
        model=tiny_model,
        dataset=str(sft_data),
        output_dir=str(tmp_path / "job"),
        device="cpu",
        max_steps=2,
        batch_size=4,
        micro_batch_size=2,
    )
    job = Job.objects.create(owner=alice, kind="sft", status="running", config=config, gpus=2)
    sink = DatabaseSink(job).start()
    _, result = execute(job, sink)
    sink.close()

    assert result["checkpoint"] == str(tmp_path / "job" / "final")
    assert (tmp_path / "job" / "ranks" / "rank_1.log").is_file()  # a second rank trained
    assert Metric.objects.filter(job=job, name="loss/sft").count() == 2


def test_a_rank_that_fails_fails_the_run_with_the_end_of_its_log(tiny_model, tmp_path):
    cfg = rl_config(tiny_model, tmp_path, "broken")
    broken = cfg.to_dict() | {"model": str(tmp_path / "no-such-model")}

    def main():
        return current_ranks().gather(None)  # waits for a follower that is gone

    with pytest.raises(RankFailed, match="rank 1 exited with 1") as failure:
        launch(
            main,
            "rlcore.train.distributed:follow_rl",
            {"settings": broken, "engine": "local"},
            processes=2,
            backend="gloo",
            log_dir=tmp_path / "ranks",
        )
    assert "cannot load model" in str(failure.value)


def test_a_rank_that_cannot_start_fails_the_run_at_once(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the follower exits at once
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 exited with 1"):
        launch(
            lambda: None,
            "rlcore.train.distributed:follow_rl",
            {},
            processes=2,
            backend="gloo",
            log_dir=tmp_path / "ranks",
        )
    assert time.monotonic() - started < 30  # not the collective timeout (30 minutes)


def test_a_stop_request_ends_every_data_parallel_rank_after_the_step(formatted_model, tmp_path):
    sink = StopAfterFirstStep()
    cfg = rl_config(formatted_model, tmp_path, "stopped", max_steps=5, processes=2)
    path = run_rl_ranks(cfg, sink)

    assert [step for step, _ in sink.metrics] == [1]
    assert path.endswith("step_000001")
    assert any("stopped on request inside step 2" in m for _, m in sink.logs)
    assert "Traceback" not in (tmp_path / "stopped" / "ranks" / "rank_1.log").read_text()


def test_processes_name_what_they_need(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="processes .*placement 'split'") as split:
        rl_config(tiny_model, tmp_path, "a", processes=2, placement="split")
    assert "processes" in split.value.errors
    # 16 rollouts in groups of 4 are 4 examples: 5 processes would leave one without any.
    with pytest.raises(ConfigError, match="processes each process rolls out at least one"):
        rl_config(tiny_model, tmp_path, "a", processes=5)
    with pytest.raises(ConfigError, match="processes must be at most 64"):
        rl_config(tiny_model, tmp_path, "a", processes=65)
    assert data_parallel_processes(0, rl_config(tiny_model, tmp_path, "a", processes=4)) == 4
    assert data_parallel_processes(2, rl_config(tiny_model, tmp_path, "a", processes=4)) == 4


# ---------------------------------------------------------------------------------------
# A run's processes sharing one card through MPS. The card and NVIDIA's control program are
# the outside world here: the machine's GPU count is patched, and the control program is a
# script that records how it was called.

FAKE_CONTROL = """#!/bin/sh
if [ "$1" = -d ]; then
    echo "-d pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {record}
    {failure}
    echo on > {state}
    exit 0
fi
read -r command
if [ "$command" = get_server_list ]; then
    read -r now < {state}
    [ "$now" = on ]
    exit $?
fi
echo "$command pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {record}
echo off > {state}
"""


@pytest.fixture
def one_card(monkeypatch, tmp_path):
    """A machine with one CUDA card, no MPS daemon of its own, and `install(failure)` to put
    a control program on PATH; this process's MPS state is put back afterwards."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed, "MPS_DEFAULT_PIPE", tmp_path / "no-daemon")
    for name in (*distributed.MPS_ENV, "RLCORE_MPS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_mps_daemon", {})
    monkeypatch.setattr(distributed, "MPS_LOCK", tmp_path / "mps.lock")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    record = tmp_path / "calls.txt"

    def install(failure: str = "") -> Path:
        control = bin_dir / distributed.MPS_CONTROL
        state = tmp_path / "daemon-state"
        control.write_text(FAKE_CONTROL.format(record=record, failure=failure, state=state))
        control.chmod(0o755)
        return record

    yield install
    for watcher in distributed._mps_watchers:  # they watch this test process
        watcher.kill()
        watcher.wait()
    distributed._mps_watchers.clear()
    if "lock" in distributed._mps_daemon:
        os.close(int(distributed._mps_daemon["lock"]))


def test_ranks_sharing_a_card_start_a_private_mps_daemon_and_stop_it(one_card):
    record = one_card()
    line = distributed.share_card("cuda", 4)
    assert line.startswith("4 processes share 1 CUDA card through MPS (a daemon of this process's")
    pipe, log = (os.environ[name] for name in distributed.MPS_ENV)
    home = Path(pipe).parent
    assert home.name.startswith("rlcore-mps-") and Path(log).parent == home
    assert Path(pipe).is_dir() and Path(log).is_dir()
    assert record.read_text().splitlines() == [f"-d pipe={pipe} log={log}"]
    assert distributed.mps_serving()
    # the ranks `launch` starts inherit the daemon's environment: they join it too
    assert distributed.share_card("cuda", 4) == (
        "4 processes share 1 CUDA card through MPS (a daemon already running)"
    )
    # one daemon, and one watcher to stop it once this process is gone
    assert len(record.read_text().splitlines()) == 1
    assert len(distributed._mps_watchers) == 1


def locked(path: Path) -> bool:
    """Whether another open file holds the flock on `path`."""
    probe = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(probe)
    return False


def test_the_watcher_stops_the_daemon_once_its_process_is_gone(one_card, tmp_path):
    record = one_card()
    control = str(tmp_path / "bin" / distributed.MPS_CONTROL)
    home = tmp_path / "mps"
    env = {
        name: str(home / part)
        for name, part in zip(distributed.MPS_ENV, ("pipe", "log"), strict=True)
    }
    for folder in env.values():
        Path(folder).mkdir(parents=True)
    subprocess.run([control, "-d"], env=os.environ | env, check=True)
    lock = os.open(distributed.MPS_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = distributed.watch_exit(process.pid, control, home, env, lock, wait_s=10)
    os.close(lock)  # the watcher holds it now
    time.sleep(1.5)
    assert watcher.poll() is None and home.exists()  # still waiting for the process
    assert len(record.read_text().splitlines()) == 1 and locked(distributed.MPS_LOCK)
    process.kill()
    process.wait()
    assert watcher.wait(timeout=20) == 0
    pipe, log = env.values()
    assert record.read_text().splitlines() == [
        f"-d pipe={pipe} log={log}",
        f"quit pipe={pipe} log={log}",
    ]
    assert not home.exists() and not locked(distributed.MPS_LOCK)


def test_one_daemon_of_ours_a_machine_at_a_time(one_card):
    """Two runs in two processes: the second, finding the first's lock held, runs without."""
    record = one_card()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(distributed.MPS_LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert distributed.share_card("cuda", 4) == (
            "4 processes share 1 CUDA card without MPS: another run's MPS daemon is running "
            "on this machine"
        )
        assert not record.exists() and not distributed.mps_serving()
    finally:
        holder.kill()
        holder.wait()
    assert distributed.share_card("cuda", 4).startswith(
        "4 processes share 1 CUDA card through MPS (a daemon of this process's"
    )


def test_no_card_shared_no_mps(one_card, monkeypatch):
    record = one_card()
    assert distributed.share_card("cpu", 4) is None
    assert distributed.share_card("cuda", 1) is None  # one process
    assert distributed.share_card("auto", 1) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a GPU each
    assert distributed.share_card("cuda", 4) is None
    assert not record.exists() and not distributed.mps_serving()


def test_mps_turned_off_missing_or_failing_says_so_and_the_run_goes_on(one_card, monkeypatch):
    assert distributed.share_card("cuda", 2) == (
        "2 processes share 1 CUDA card without MPS: nvidia-cuda-mps-control is not on PATH"
    )
    one_card(failure='echo "An instance of this daemon is already running" >&2; exit 1')
    line = distributed.share_card("cuda", 2)
    assert line == (
        "2 processes share 1 CUDA card without MPS: nvidia-cuda-mps-control -d failed "
        "(An instance of this daemon is already running)"
    )
    assert not distributed.mps_serving() and not distributed._mps_daemon
    assert not locked(distributed.MPS_LOCK)  # a failed start leaves the machine's lock free
    # a process that already opened the CUDA driver (torch.cuda.is_available() does) cannot
    # join a daemon started after: on a card it ran outside MPS while its ranks joined
    monkeypatch.setattr(distributed, "cuda_driver_opened", lambda: True)
    one_card()
    assert distributed.share_card("cuda", 2) == (
        "2 processes share 1 CUDA card without MPS: this process opened CUDA before MPS could start"
    )
    assert not distributed.mps_serving()
    monkeypatch.setenv("RLCORE_MPS", "0")
    assert distributed.share_card("cuda", 2) is None
    assert not distributed.mps_serving()


def test_a_machine_wide_mps_daemon_is_used_as_it_is(one_card, tmp_path, monkeypatch):
    record = one_card()
    (tmp_path / "no-daemon").mkdir()
    (tmp_path / "no-daemon" / "control").write_text("")  # the machine's daemon's pipe
    assert distributed.share_card("cuda", 8) == (
        "8 processes share 1 CUDA card through MPS (a daemon already running)"
    )
    assert not record.exists()


def test_a_data_parallel_run_logs_how_its_ranks_share_the_card(one_card):
    """On the CPU no card is shared and nothing is said; the log line comes from the same
    call a run on a card makes (`run_rl_ranks` before its ranks start)."""
    sink = RecordingSink()
    distributed._note_sharing(sink, "cuda", 3)
    assert sink.logs == [
        (
            "info",
            "3 processes share 1 CUDA card without MPS: nvidia-cuda-mps-control is not on PATH",
        )
    ]
    distributed._note_sharing(sink, "cpu", 3)
    assert len(sink.logs) == 1
