"""Rollout actors on the CPU: processes that roll out and score batches with the learner's
newest weights while the learner trains on the batches they finished (rlcore/train/actors.py)."""

import os
import signal
from pathlib import Path

import pytest
import torch

from rlcore.events import RecordingSink
from rlcore.train.actors import Board, new_board_path
from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.config import ConfigError, RLConfig, build_config
from rlcore.train.distributed import RankFailed, data_parallel_processes, launch, run_rl_ranks
from rlcore.train.grpo import build_learner, run_rl, update_policy
from rlcore.train.sequences import TrainingSequence
from tests.rl_fixtures import StopAfterFirstStep, rl_config
from tests.test_distributed import final_weights


def boards() -> set[str]:
    """The boards in shared memory and the temporary directory (a run removes its own)."""
    found = set()
    for root in (Path("/dev/shm"), Path("/tmp")):
        if root.is_dir():
            found |= {str(p) for p in root.glob("rlcore-board-*")}
    return found


def test_actors_feed_the_learner_batches_played_by_recent_weights(formatted_model, tmp_path):
    before = boards()
    sink = RecordingSink()
    cfg = rl_config(
        formatted_model, tmp_path, "actors", max_steps=4, lr=1e-3, actors=2, log_rollouts=8
    )
    final = run_rl_ranks(cfg, sink)

    assert [step for step, _ in sink.metrics] == [1, 2, 3, 4]
    lags = []
    for step, metrics in sink.metrics:
        assert metrics["optim/grad_norm"] > 0, step
        # Played by weights published after an earlier step: never newer than the last.
        assert 0 <= metrics["async/lag"] <= step - 1, step
        lags.append(metrics["async/lag"])
        assert metrics["perf/rollout_seconds"] > 0 and metrics["perf/wait_seconds"] >= 0
        assert 0 <= metrics["reward/mean"] <= 1
    # The first batch was played by the starting weights, as one process's first step is.
    assert lags[0] == 0 and sink.metrics[0][1]["policy/logprob_mismatch"] < 1e-5
    # Every step logs its sample, spread over the batch's examples.
    assert [step for step, _ in sink.rollout_batches] == [1, 2, 3, 4]
    assert all(len(rollouts) == 8 for _, rollouts in sink.rollout_batches)
    assert any("2 actor processes rolling out" in message for _, message in sink.logs)
    assert final.endswith("final") and final_weights(final).keys()
    for actor in (1, 2):
        log = (tmp_path / "actors" / "ranks" / f"rank_{actor}.log").read_text()
        assert "Traceback" not in log, log
    assert boards() == before  # the run removed its board


def test_the_board_hands_actors_the_newest_weights(formatted_model, tmp_path):
    learner, _ = load_model_and_tokenizer(formatted_model, torch.device("cpu"))
    actor, _ = load_model_and_tokenizer(formatted_model, torch.device("cpu"))
    link = new_board_path()
    board = Board.create(link, 1, learner, start=5)
    try:
        seen = Board.attach(link, 1, actor, alive=lambda: True)
        assert seen.start == 5
        addresses = [p.data_ptr() for p in actor.parameters()]
        assert seen.load(actor, 5) == 5  # nothing newer than what it has
        with torch.no_grad():
            for param in learner.parameters():
                param.add_(0.5)
        board.publish(learner, 6)
        assert seen.load(actor, 5) == 6
        for mine, theirs in zip(actor.parameters(), learner.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        # In place: the engine's CUDA graphs read the parameters by address.
        assert [p.data_ptr() for p in actor.parameters()] == addresses
        assert not seen.stopped
        board.stop()
        assert seen.stopped
    finally:
        board.close(link)
    assert not os.path.exists(link) and not board.path.exists()


def stale_batch(vocabulary: int) -> list[TrainingSequence]:
    """Six sequences of three trained tokens (advantage 1) each, whose sampled logprobs
    (-30) sit far below any the policy gives now."""
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for index in range(6):
        length, trained = 8 + index, 3
        sequences.append(
            TrainingSequence(
                input_ids=torch.randint(3, vocabulary, (length,), generator=generator).tolist(),
                weights=[0.0] * (length - trained) + [1.0] * trained,
                advantages=[0.0] * (length - trained) + [1.0] * trained,
                sampled_logprobs=[-30.0] * length,
            )
        )
    return sequences


@pytest.mark.parametrize("actors", [0, 1])
def test_a_stale_batch_is_clipped_against_the_weights_that_played_it(
    formatted_model, tmp_path, actors
):
    cfg = rl_config(formatted_model, tmp_path, "clip", actors=actors, micro_batch_size=6)
    learner, tokenizer, _ = build_learner(cfg, torch.device("cpu"), lambda: False)
    metrics = update_policy(learner, stale_batch(len(tokenizer)), 18.0, cfg)
    if actors:
        # Against the weights that played the batch the ratio is huge: every token is
        # clipped at 1 + eps_high, the loss -(1.28 x A) a token.
        assert metrics["policy/clip_fraction"] == 1.0
        assert metrics["loss/policy"] == pytest.approx(-1.28, abs=1e-5)
    else:
        # Against the current weights (the batch taken as played by them) the ratio is 1.
        assert metrics["policy/clip_fraction"] == 0.0
        assert metrics["loss/policy"] == pytest.approx(-1.0, abs=1e-6)
    assert metrics["policy/logprob_mismatch"] > 20  # measured against the sampled ones


def test_a_stopped_run_with_actors_saves_and_resumes(formatted_model, tmp_path):
    sink = StopAfterFirstStep()
    cfg = rl_config(formatted_model, tmp_path, "stopped", max_steps=5, actors=1)
    path = run_rl_ranks(cfg, sink)
    assert [step for step, _ in sink.metrics] == [1]
    assert path.endswith("step_000001")
    assert any("stopped on request" in m for _, m in sink.logs)
    assert "Traceback" not in (tmp_path / "stopped" / "ranks" / "rank_1.log").read_text()

    resumed = RecordingSink()
    more = build_config(RLConfig, [("test", cfg.to_dict() | {"resume_from": path, "max_steps": 3})])
    final = run_rl_ranks(more, resumed)
    assert [step for step, _ in resumed.metrics] == [2, 3]
    # The actor started from the resumed weights (published as step 1's).
    assert all(0 <= m["async/lag"] <= step - 2 for step, m in resumed.metrics)
    assert final.endswith("final")


def test_an_actor_that_fails_fails_the_run_with_the_end_of_its_log(formatted_model, tmp_path):
    cfg = rl_config(formatted_model, tmp_path, "broken", max_steps=3, actors=1)
    broken = cfg.to_dict() | {"model": str(tmp_path / "no-such-model")}
    board = new_board_path()
    with pytest.raises(RankFailed, match="rank 1 exited with 1") as failure:
        launch(
            lambda: run_rl(cfg, RecordingSink(), board=board),
            "rlcore.train.actors:run_actor",
            {"settings": broken, "engine": "local", "board": board},
            processes=2,
            backend="none",
            log_dir=tmp_path / "ranks",
        )
    assert "cannot load model" in str(failure.value)
    assert not os.path.exists(board)


class KillTheActor(RecordingSink):
    """Kills the run's actor (SIGKILL) once the learner logged its first step."""

    def metric(self, step: int, values: dict[str, float]) -> None:
        super().metric(step, values)
        if step == 1:
            for pid in actor_pids():
                os.kill(pid, signal.SIGKILL)


def actor_pids() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for child in (task / "children").read_text().split():
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"rlcore.train.actors" in command:
                pids.append(int(child))
    return pids


def test_a_killed_actor_fails_the_run_naming_it(formatted_model, tmp_path):
    cfg = rl_config(formatted_model, tmp_path, "killed", max_steps=50, actors=1)
    with pytest.raises(RankFailed, match="rank 1 exited with -9"):
        run_rl_ranks(cfg, KillTheActor())


def test_actors_name_what_they_need(formatted_model, tmp_path):
    with pytest.raises(ConfigError, match="actors .*processes = 1") as both:
        rl_config(formatted_model, tmp_path, "a", actors=2, processes=2)
    assert "actors" in both.value.errors
    with pytest.raises(ConfigError, match="actors must be at most 64"):
        rl_config(formatted_model, tmp_path, "a", actors=65)
    with pytest.raises(ValueError, match="run_rl_ranks"):
        run_rl(rl_config(formatted_model, tmp_path, "a", actors=1))
    # A job on two GPUs feeds one learner from its actors, spread over the GPUs.
    assert data_parallel_processes(2, rl_config(formatted_model, tmp_path, "a", actors=3)) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_an_rl_job_with_actors_runs_on_the_worker(alice, ttt_config, tiny, celery_worker):
    """The web lab's path: a job whose config asks for a rollout actor, on the real Celery
    worker, trains its steps with the actor's batches, stores every step's metrics (the
    lag among them) and sampled rollouts, and leaves no board behind."""
    from tests.lab_fixtures import create_job_with_listener, wait_for_job
    from webapp.jobs.models import LogLine, Metric, Rollout

    before = boards()
    job, listener = create_job_with_listener(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny,
        options={"max_steps": 2, "device": "cpu", "actors": 1, "batch_size": 16,
                 "max_tokens": 24, "log_rollouts": 4},
    )  # fmt: skip
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    lags = Metric.objects.filter(job=job, name="async/lag").order_by("step")
    assert [m.step for m in lags] == [1, 2] and all(0 <= m.value <= 1 for m in lags)
    assert Rollout.objects.filter(job=job).count() == 8
    assert LogLine.objects.filter(job=job, message__contains="1 actor processes").exists()
    assert boards() == before


def test_an_actor_reads_again_a_slot_rewritten_during_its_copy(formatted_model):
    from rlcore.train.actors import WRITING

    learner, _ = load_model_and_tokenizer(formatted_model, torch.device("cpu"))
    actor, _ = load_model_and_tokenizer(formatted_model, torch.device("cpu"))
    link = new_board_path()
    board = Board.create(link, 1, learner)
    try:
        seen = Board.attach(link, 1, actor, alive=lambda: True)
        board.publish(learner, 1)
        # While the actor copies version 1 (slot 1) the learner publishes version 2 (slot 0)
        # and begins version 3 in slot 1: the copy is torn, so the actor must read again and
        # take version 2, whole.
        first = next(actor.parameters())
        original, calls = first.copy_, []

        def copy_then_rewrite(source, *args, **kwargs):
            result = original(source, *args, **kwargs)
            calls.append(1)
            if len(calls) == 1:
                with torch.no_grad():
                    for param in learner.parameters():
                        param.add_(1.0)
                board.publish(learner, 2)
                board.header[WRITING] = 3
                board.slots[1].fill_(float("nan"))  # half-written version 3
            return result

        first.copy_ = copy_then_rewrite
        assert seen.load(actor, 0) == 2
        for mine, theirs in zip(actor.parameters(), learner.parameters(), strict=True):
            assert torch.equal(mine, theirs)
    finally:
        board.close(link)


def test_the_board_is_the_run_user_s_alone(formatted_model):
    # The learner unpickles what it finds on the board: nobody else may write there.
    learner, _ = load_model_and_tokenizer(formatted_model, torch.device("cpu"))
    link = new_board_path()
    board = Board.create(link, 1, learner)
    try:
        for directory in (board.path, Path(link).parent):
            assert directory.stat().st_mode & 0o077 == 0, directory
    finally:
        board.close(link)
