"""Second choices: where the env judged a sampled move unsound, the policy's own next choice
in that position, judged by the env, trained up when it is sound.

A policy sure of a wrong move samples it every time, so the group never disagrees there and
the policy gradient of a move of probability p (which scales with 1 - p) barely pushes it
off (docs/mastery.md, rounds 22-38). Here, for every turn whose move the env judged
unsound (`Environment.decision_options`), the policy is asked for its choice among the
position's other legal moves: one forward pass over the turn's prompt and its reply up to
the move gives the move's distribution, which is renormalised over the other moves (at the
sampling temperature) and drawn from. The env judges that one move (`judge`), as it judges
every sampled move; when it does better than the move played, the turn is trained again
with the drawn move in place of the played one: the same prompt and reply tokens, only the
move token changed and trained, with advantage `weight` times the verdicts' difference. No
other move is judged, and an unsound second choice is not trained (it is no worse than the
move it replaces). The push lands on a move the policy gave little probability, so its
log-probability's gradient is near its largest, where the played move's was near 0.
"""

from __future__ import annotations

import torch

from rlcore.envs.base import Environment
from rlcore.train.common import autocast
from rlcore.train.sequences import TrainingSequence, token_pieces
from rlcore.types import Rollout


def second_choice_sequences(
    env: Environment,
    rollouts: list[Rollout],
    model,
    tokenizer,
    weight: float,
    temperature: float,
    pieces: dict[int, str],
    rows_per_pass: int = 64,
) -> tuple[list[TrainingSequence], dict[str, float]]:
    """Training sequences for the sound second choices of a batch's unsound moves (one
    trained token each, carrying advantage `weight` x the gain in verdict), and metrics:
    how many unsound moves had a second choice tried (`second_choice/tried`) and the share
    of those that were sound (`second_choice/sound_rate`)."""
    candidates = []  # (input ids up to the move, the turn's reply tail, option ids, options)
    single: dict[str, int | None] = {}  # option text -> its one token id (None: not one)
    for rollout in rollouts:
        for index, turn in enumerate(rollout.turns):
            texts = token_pieces(turn.completion_ids, pieces, tokenizer)
            options = env.decision_options(rollout, index, "".join(texts))
            if options is None:
                continue
            at = _token_at(texts, options.prefix, options.played)
            for text in options.others:
                if text not in single:
                    single[text] = _single_token(tokenizer, text)
            ids = [single[text] for text in options.others]
            if at is None or not ids or None in ids:
                continue  # the move is not one token of its own: nothing to swap
            prefix = turn.prompt_ids + turn.completion_ids[:at]
            candidates.append((prefix, turn.completion_ids[at + 1 :], ids, options))
    sequences = []
    for start in range(0, len(candidates), rows_per_pass):
        chunk = candidates[start : start + rows_per_pass]
        logits = _last_logits(model, [prefix for prefix, *_ in chunk])
        for row, (prefix, tail, ids, options) in enumerate(chunk):
            scores = logits[row, ids] / max(temperature, 1e-6)
            choice = int(torch.multinomial(torch.softmax(scores, dim=-1), 1))
            gain = options.judge(options.others[choice]) - options.judge(options.played)
            if gain <= 0:
                continue
            input_ids = prefix + [ids[choice]] + tail
            trained = len(prefix)  # the position of the swapped move
            weights = [0.0] * len(input_ids)
            advantages = [0.0] * len(input_ids)
            weights[trained], advantages[trained] = 1.0, weight * gain
            sequences.append(TrainingSequence(input_ids, weights, advantages, None))
    metrics = {
        "second_choice/tried": float(len(candidates)),
        "second_choice/sound_rate": len(sequences) / len(candidates) if candidates else 0.0,
    }
    return sequences, metrics


def _token_at(texts: list[str], prefix: str, played: str) -> int | None:
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


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@torch.no_grad()
def _last_logits(model, prefixes: list[list[int]]) -> torch.Tensor:
    """Float32 logits after the last token of each prefix ([rows, vocab], on the CPU):
    left-padded rows, explicit positions, only the last position's logits computed."""
    device = next(model.parameters()).device
    width = max(len(prefix) for prefix in prefixes)
    ids = torch.zeros((len(prefixes), width), dtype=torch.long)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for row, prefix in enumerate(prefixes):
        ids[row, width - len(prefix) :] = torch.tensor(prefix)
        mask[row, width - len(prefix) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        with autocast(device):
            output = model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                logits_to_keep=1,
            )
    finally:
        model.train(was_training)
    return output.logits[:, -1].float().cpu()
