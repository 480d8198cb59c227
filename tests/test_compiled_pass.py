"""The update's compiled pass (`RLConfig.compile`, used on CUDA) against the eager one: one
graph for every batch shape (the head at the trained targets, as the update runs it), the
same logprobs, entropy, judged-move mass and gradients. Compiled here on the CPU (~45 s on
2 cores): the CUDA kernels differ, and the card's figures are in docs/BENCHMARKS.md, but the
graph, its dynamic shapes and its inductor options are the same."""

import torch

from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.config import RLConfig, build_config
from rlcore.train.grpo import compiled_token_logprobs, token_logprobs, training_pass


def test_the_cpu_keeps_the_eager_pass_even_when_compile_is_asked():
    cfg = build_config(RLConfig, [("test", {"compile": True})])
    assert training_pass(cfg, torch.device("cpu")) is token_logprobs
    assert training_pass(cfg, torch.device("cuda")) is compiled_token_logprobs()


def test_one_compiled_graph_matches_the_eager_pass_as_the_batch_shape_changes():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    compiled = compiled_token_logprobs()
    generator = torch.Generator().manual_seed(0)
    # The rows and the width change from step to step, as a real step's batches do (the
    # card's failure of the thirty-ninth session came at a batch's second width).
    for rows, width in [(16, 64), (16, 128), (12, 192)]:
        ids = torch.randint(0, 400, (rows, width), generator=generator)
        count = 2 * rows
        move_sets = (
            torch.randint(0, rows, (count,), generator=generator),
            torch.randint(0, width - 1, (count,), generator=generator),
            torch.randint(-1, 400, (count, 3), generator=generator),
        )
        # The head at a third of the targets (grpo.token_logprobs' `trained`), as the update runs.
        trained = torch.randperm(rows * (width - 1), generator=generator)[: rows * width // 3]
        trained = trained.sort().values
        results = []
        for forward in (token_logprobs, compiled):
            model.zero_grad(set_to_none=True)
            logprobs, entropy, best = forward(model, ids, 0.8, True, move_sets, None, trained)
            (logprobs.sum() + entropy.sum() + best.sum()).backward()  # zeros off `trained`
            gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
            results.append((logprobs.detach(), entropy.detach(), best.detach(), gradient))
        # fp32 both ways; fused kernels sum in another order (gradients: ~1e-4 of 1.1 M sums).
        for eager, fused, tolerance in zip(*results, (1e-4, 1e-4, 1e-4, 1e-3), strict=True):
            torch.testing.assert_close(fused, eager, rtol=tolerance, atol=tolerance)
        assert results[0][0].shape == (rows, width - 1)
