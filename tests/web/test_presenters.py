"""What the rollout pages draw from a rollout's stored state."""

from rlcore.envs.tictactoe import TicTacToeEnv
from webapp.jobs.presenters import board_frames


def test_board_frames_flag_the_random_opening_apart_from_the_models_moves():
    env = TicTacToeEnv(opening_moves=2, model_mark="X")
    example = next(e for e in env.examples(50, seed=1) if len(e.info["opening"]) == 4)
    state = env.setup_state(example)
    frames = board_frames(state)
    opening = [frame for frame in frames if frame["opening"]]
    assert [frame["cell"] for frame in opening] == example.info["opening"]
    assert [frame["player"] for frame in opening] == ["model", "opponent"] * 2
    # The last frame shows every mark played so far, the latest cell highlighted.
    last = frames[-1]
    marks = "".join(cell["mark"] for row in last["rows"] for cell in row)
    assert marks == "".join(state["board"])
    assert [cell["last"] for row in last["rows"] for cell in row].count(True) == 1
