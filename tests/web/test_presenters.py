"""What the rollout pages draw from a rollout's stored state: the views the env declares
(`Environment.state_views`), shaped by the generic presenter."""

from rlcore.envs.calculator import CalculatorEnv
from rlcore.envs.tictactoe import TicTacToeEnv
from webapp.jobs.presenters import state_views


def notes(view: dict, name: str) -> list[dict]:
    return [{"ok": n["ok"], "text": n["text"]} for n in view["notes"] if n["name"] == name]


def test_the_board_views_mute_the_random_opening_apart_from_the_models_moves():
    env = TicTacToeEnv(opening_moves=2, model_mark="X")
    example = next(e for e in env.examples(50, seed=1) if len(e.info["opening"]) == 4)
    state = env.setup_state(example)
    views = state_views(TicTacToeEnv, state)
    opening = [view for view in views if view["muted"]]
    assert [view["title"].split(" → ")[1] for view in opening] == [
        str(cell) for cell in example.info["opening"]
    ]
    assert ["random for model X" in view["title"] for view in opening] == [True, False] * 2
    # The last view shows every mark played so far, the latest cell highlighted, X and O
    # in their own tones.
    last = views[-1]
    cells = [cell for row in last["rows"] for cell in row]
    assert "".join(cell["text"] or "." for cell in cells) == "".join(state["board"])
    assert [cell["highlight"] for cell in cells].count(True) == 1
    assert {cell["tone"] for cell in cells if cell["text"]} == {1, 2}
    assert all(view["notes"] == [] for view in opening)  # random moves are not judged


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
    verdicts = [notes(view, "verdict") for view in state_views(TicTacToeEnv, state)]
    assert verdicts == [
        [{"ok": True, "text": "sound: keeps the draw"}],
        [],  # the opponent's moves are not judged
        [{"ok": True, "text": "sound: keeps the draw"}],
    ]
    lost = opponent_first(0, 1)
    (_, verdict) = [notes(view, "verdict") for view in state_views(TicTacToeEnv, lost)]
    assert verdict == [{"ok": False, "text": "unsound: the draw became a loss"}]
    # A move that leaves the opponent's line open says which cell would have blocked it.
    unblocked = opponent_first(0, 4, 1, 8)
    verdict = notes(state_views(TicTacToeEnv, unblocked)[3], "verdict")
    assert verdict == [
        {"ok": False, "text": "unsound: the draw became a loss (missed the block at 2)"}
    ]
    # Opening moves are random, not the model's choice; an impossible state is not judged.
    opening = {"moves": [{"player": "model", "mark": "X", "cell": 4, "opening": True}]}
    assert state_views(TicTacToeEnv, opening)[0]["notes"] == []
    # In a lost position every move is sound, and the verdict says why.
    lost_anyway = opponent_first(0, 1, 4, 8)
    assert notes(state_views(TicTacToeEnv, lost_anyway)[3], "verdict") == [
        {"ok": True, "text": "sound: already lost, no move saves it"}
    ]
    broken = {"moves": [{"player": "model", "mark": "Z", "cell": 4}, "junk", {"cell": "4"}]}
    (view,) = state_views(TicTacToeEnv, broken)
    assert view["notes"] == []
    assert state_views(TicTacToeEnv, {"moves": "not a list"}) == []


def test_an_env_that_declares_no_views_and_an_unknown_env_draw_nothing():
    env = CalculatorEnv()
    state = env.setup_state(env.make_example(0, seed=0))
    assert state and state_views(CalculatorEnv, state) == []
    assert state_views(None, {"moves": [{"player": "model", "mark": "X", "cell": 0}]}) == []


async def test_each_model_move_says_whether_its_think_block_read_the_board_right():
    from rlcore.envs.tictactoe_players import OraclePolicy
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
    # The invalid second reply played nothing, so it has no view; the oracle reads right.
    assert rollout.state["think_correct"][:2] == [False, False]
    views = state_views(TicTacToeEnv, rollout.state)
    model = [notes(view, "think-verdict") for view in views if " model " in view["title"]]
    assert model[0] == [{"ok": False, "text": "think: misreads the board"}]
    assert len(model) >= 2 and all(
        n == [{"ok": True, "text": "think: reads the board right"}] for n in model[1:]
    )
    assert all(notes(view, "think-verdict") == [] for view in views if "opponent" in view["title"])
    # A state without the record (older runs) shows no think verdicts.
    del rollout.state["think_correct"]
    assert all(notes(v, "think-verdict") == [] for v in state_views(TicTacToeEnv, rollout.state))


def opponent_first(*cells: int) -> dict:
    """A tic-tac-toe state whose moves alternate the opponent's X and the model's O."""
    players = [("opponent", "X"), ("model", "O")]
    return {
        "moves": [
            {"player": players[i % 2][0], "mark": players[i % 2][1], "cell": cell}
            for i, cell in enumerate(cells)
        ]
    }
