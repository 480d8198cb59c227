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


def test_each_model_move_carries_the_solvers_verdict():
    # The model (X) opens in a corner and, after the opponent takes the centre, plays an
    # edge: both keep the draw. In the second game the model (O) answers a corner opening
    # on an edge, which loses: only the centre holds the draw there.
    state = {
        "moves": [
            {"player": "model", "mark": "X", "cell": 0},
            {"player": "opponent", "mark": "O", "cell": 4},
            {"player": "model", "mark": "X", "cell": 1},
        ]
    }
    verdicts = [frame["verdict"] for frame in board_frames(state)]
    assert verdicts == [
        {"sound": True, "text": "sound: keeps the draw"},
        None,  # the opponent's moves are not judged
        {"sound": True, "text": "sound: keeps the draw"},
    ]
    lost = {
        "moves": [
            {"player": "opponent", "mark": "X", "cell": 0},
            {"player": "model", "mark": "O", "cell": 1},
        ]
    }
    (_, verdict) = [frame["verdict"] for frame in board_frames(lost)]
    assert verdict == {"sound": False, "text": "unsound: the draw became a loss"}
    # Opening moves are random, not the model's choice; an impossible state is not judged.
    opening = {"moves": [{"player": "model", "mark": "X", "cell": 4, "opening": True}]}
    assert board_frames(opening)[0]["verdict"] is None
    # In a lost position every move is sound, and the verdict says why.
    lost_anyway = {
        "moves": [
            {"player": "opponent", "mark": "X", "cell": 0},
            {"player": "model", "mark": "O", "cell": 1},
            {"player": "opponent", "mark": "X", "cell": 4},
            {"player": "model", "mark": "O", "cell": 8},
        ]
    }
    assert board_frames(lost_anyway)[3]["verdict"] == {
        "sound": True,
        "text": "sound: already lost, no move saves it",
    }
    broken = {"moves": [{"player": "model", "mark": "Z", "cell": 4}]}
    assert board_frames(broken)[0]["verdict"] is None


async def test_each_model_move_says_whether_its_think_block_read_the_board_right():
    from rlcore.envs.tictactoe import OraclePolicy
    from rlcore.policy.base import Policy
    from rlcore.types import Generation, SamplingParams

    class MisreadThenOracle(Policy):
        """First a misread board with a legal move, then an invalid reply, then the oracle."""

        name = "misread-then-oracle"

        def __init__(self):
            self.replies = ["<think>Empty: 0.</think><move>4</move>", "<move>4</move>"]

        async def generate(self, messages, sampling, *, tools=None, state=None):
            if self.replies:
                return Generation(text=self.replies.pop(0))
            return await OraclePolicy().generate(messages, sampling, state=state)

    env = TicTacToeEnv(model_mark="X", max_turns=30)
    example = next(e for e in env.examples(64, seed=0) if e.info["model_starts"])
    rollout = await env.rollout(MisreadThenOracle(), example, SamplingParams())
    # The invalid second reply played nothing, so it has no frame; the oracle reads right.
    assert rollout.state["think_correct"][:2] == [False, False]
    frames = board_frames(rollout.state)
    model = [frame["think"] for frame in frames if frame["player"] == "model"]
    assert model[0] is False and len(model) >= 2 and all(model[1:])
    assert all(frame["think"] is None for frame in frames if frame["player"] == "opponent")
    # A state without the record (older runs) shows no think verdicts.
    del rollout.state["think_correct"]
    assert all(frame["think"] is None for frame in board_frames(rollout.state))
