"""Sound mass: at every move the env judges, all of the position's legal moves judged, and
the policy's probability of the best of them raised directly.

A policy sure of a wrong move samples it every time, so the group never disagrees there and
the policy gradient of a move of probability p (which scales with 1 - p) barely pushes it
off (docs/mastery.md, rounds 22-38). The deleted second choices (rounds 39-44) drew the
policy's own next choice among the other legal moves at an unsound move and trained it up
when the env judged it sound: a one-sample estimate of the gradient of log P(sound), the
policy's probability of playing one of the position's sound moves. Here that gradient is
taken exactly: the env judges every legal move of the position (`Environment.move_options`),
and the loss adds `weight` x -log(the summed probability, at the sampling temperature, of
the moves judged best). Its gradient is the mean of the best moves' log-probability
gradients, each weighed by its share of their mass, so the policy's own preference among the
sound moves decides which gains most, and it stays near its largest however sure the policy
is of a wrong move. It applies at sound moves too, where it takes mass off the unsound moves
the sample did not show. It reads the logits at the move token of the rollout's own training
sequences: no extra forward pass and no extra sequence.

A judge that grades more than two ways (tic-tac-toe's `win_chances`: the oracle's moves
above the other sound ones, above the unsound ones) adds a second set at the same token:
every move above the worst grade. The loss then raises both the mass of the moves better
than the worst and that of the best, so learning to keep the value loses none of its signal
to the choice among the moves that keep it.
"""

from __future__ import annotations

from rlcore.envs.base import Environment
from rlcore.train.sequences import TrainingSequence, token_pieces
from rlcore.types import Rollout


def attach_move_sets(
    env: Environment,
    rollout: Rollout,
    sequences: list[TrainingSequence],
    tokenizer,
    pieces: dict[int, str],
    single: dict[str, int | None],
) -> int:
    """Record in `sequences` (the rollout's, from `training_sequences`) every judged move:
    the target index whose next token is the move, and the token ids of the moves the env
    judges best in its position (and, for a graded judge, of those above its worst grade).
    Returns how many moves were recorded. A move that is not
    one token of its own, or whose options are not, is left out. `pieces` and `single`
    cache token texts and option ids across calls."""
    recorded = 0
    for index, turn in enumerate(rollout.turns):
        texts = token_pieces(turn.completion_ids, pieces, tokenizer)
        options = env.move_options(rollout, index, "".join(texts))
        if options is None:
            continue
        at = move_token_index(texts, options.prefix, options.played)
        sequence = next((s for s in sequences if index in s.turn_starts), None)
        if at is None or sequence is None:
            continue
        moves = [options.played, *options.others]
        for text in moves:
            if text not in single:
                single[text] = single_token(tokenizer, text)
        if any(single[text] is None for text in moves):
            continue
        verdicts = [options.judge(text) for text in moves]
        worst, top = min(verdicts), max(verdicts)
        graded = list(zip((single[text] for text in moves), verdicts, strict=True))
        position = sequence.turn_starts[index] + at
        sequence.move_sets.append((position - 1, [i for i, v in graded if v == top]))
        if any(worst < v < top for v in verdicts):  # graded: the mass above the worst too
            sequence.move_sets.append((position - 1, [i for i, v in graded if v > worst]))
        recorded += 1
    return recorded


def move_token_index(texts: list[str], prefix: str, played: str) -> int | None:
    """The index of the token that is exactly `played` and starts right after `prefix` in
    a reply whose tokens' texts are `texts`; None when the move is not such a token."""
    length = 0
    for index, text in enumerate(texts):
        if length == len(prefix):
            return index if text == played else None
        length += len(text)
        if length > len(prefix):
            return None
    return None


def single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer makes it one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
