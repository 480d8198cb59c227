"""Supervised fine-tuning of a causal LM on conversations, with the loss on assistant tokens.

The dataset is JSONL, one `{"messages": [...]}` conversation per line (what `synth`
writes). Each conversation is rendered with the tokenizer's chat template turn by turn, so
the tokens of every assistant message, through its closing end-of-turn token, get loss
mask 1 and everything else (system, user, environment and tool messages, the
`<|im_start|>assistant` headers) gets 0: the model learns to answer, not to predict the
environment. The loop is plain PyTorch: AdamW, linear warm-up then cosine or constant
decay, gradient accumulation over micro-batches sorted by length, gradient clipping,
bf16 autocast on CUDA, checkpoints in Hugging Face format.

Model loading, the optimizer and its schedule, and checkpoints come from
`rlcore.train.common`, shared with the RL trainer. In a data-parallel run
(rlcore/train/distributed.py) every rank runs this loop over the same batches, trains on
its share of each, and the gradients are summed over the ranks; rank 0 reports and saves.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlcore.events import EventSink, NullSink
from rlcore.train.common import (
    Milestones,
    autocast,
    build_optimizer,
    checkpoint_dir,
    clip_gradients,
    describe_device,
    load_model_and_tokenizer,
    pad_batch,
    resolve_device,
    save_checkpoint,
    saves_after,
    seed_everything,
)
from rlcore.train.config import SFTConfig, save_config
from rlcore.train.distributed import check_same_weights, current_ranks
from rlcore.types import Message

# ---------------------------------------------------------------------------------------
# Data


def load_sft_dataset(path: str | Path) -> list[list[Message]]:
    """Conversations from a JSONL file; errors name the file, the line and the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"SFT dataset {str(path)!r} does not exist; expected a JSONL file with one "
            '{"messages": [{"role": ..., "content": ...}, ...]} per line (see `rlcore synth`)'
        )
    conversations = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ValueError(
                    f"{path}:{number}: expected an object with a non-empty 'messages' list"
                )
            for position, message in enumerate(messages):
                if not isinstance(message, dict) or "role" not in message:
                    raise ValueError(
                        f"{path}:{number}: message {position} must be an object with 'role' "
                        f"and 'content', got {message!r:.80}"
                    )
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{path}:{number}: conversation has no assistant message to learn")
            conversations.append(messages)
    if not conversations:
        raise ValueError(f"SFT dataset {str(path)!r} has no conversations")
    return conversations


def _render(tokenizer, messages: list[Message], *, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def build_sft_example(
    tokenizer, messages: list[Message], max_seq_len: int
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a loss mask that is 1 exactly on assistant tokens.

    The chat template is applied to growing prefixes of the conversation; each message
    adds the text between one rendering and the next. For an assistant message that text
    is split in three: the header the generation prompt would add (mask 0), the content
    through the end-of-turn token (mask 1), and whatever the template puts after it, such
    as a newline (mask 0). The result is truncated to `max_seq_len` tokens.
    """
    eos_text = tokenizer.eos_token or ""
    input_ids: list[int] = []
    loss_mask: list[int] = []

    def add(text: str, mask_value: int) -> None:
        ids = _ids(tokenizer, text)
        input_ids.extend(ids)
        loss_mask.extend([mask_value] * len(ids))

    rendered = ""
    for index, message in enumerate(messages):
        before = messages[:index]
        after = _render(tokenizer, messages[: index + 1])
        if not after.startswith(rendered):
            raise ValueError(
                f"the chat template rewrites earlier turns when message {index} is added "
                "(e.g. it drops past <think> blocks), so turns cannot be masked one by one; "
                "use a model whose template keeps the history verbatim"
            )
        if message.get("role") != "assistant":
            add(after[len(rendered) :], 0)
            rendered = after
            continue
        header = _render(tokenizer, before, generation_prompt=True)
        if not (header.startswith(rendered) and after.startswith(header)):
            header = rendered  # a template without a separate assistant header
        add(header[len(rendered) :], 0)
        body = after[len(header) :]
        end = body.rfind(eos_text) + len(eos_text) if eos_text and eos_text in body else len(body)
        add(body[:end], 1)
        add(body[end:], 0)
        rendered = after
    return input_ids[:max_seq_len], loss_mask[:max_seq_len]


def assistant_loss(
    model, examples: list[tuple[list[int], list[int]]], pad_id: int, device, normalizer: float
) -> torch.Tensor:
    """Cross-entropy summed over the assistant tokens of `examples` ((ids, mask) pairs from
    `build_sft_example`), divided by `normalizer` (the whole batch's assistant tokens, so
    micro-batches accumulate to the batch's mean)."""
    input_ids = pad_batch([ids for ids, _ in examples], pad_id).to(device)
    loss_mask = pad_batch([mask for _, mask in examples], 0).to(device)
    attention_mask = pad_batch([[1] * len(ids) for ids, _ in examples], 0).to(device)
    with autocast(device):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    token_loss = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none"
    )
    return (token_loss * loss_mask[:, 1:].flatten()).sum() / normalizer


def length_sorted_chunks(indices: list[int], lengths: list[int], size: int) -> list[list[int]]:
    """`indices` in micro-batches of `size`, neighbours in length, so padding stays small."""
    ordered = sorted(indices, key=lambda i: lengths[i])
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


# ---------------------------------------------------------------------------------------
# Training


def run_sft(cfg: SFTConfig, sink: EventSink | None = None) -> str:
    """Fine-tune `cfg.model` on `cfg.dataset`; returns the final checkpoint directory.

    `sink.should_stop()` is asked before each step and between its micro-batches; once it
    says True the run saves the weights after the last complete step and returns them."""
    sink = sink or NullSink()
    cfg.validate()
    ranks = current_ranks()  # one rank unless launched data-parallel
    device = ranks.device(resolve_device(cfg.device))
    seed_everything(cfg.seed)
    output_dir = Path(cfg.output_dir)
    if ranks.is_main:
        save_config(cfg, output_dir)

    # Data: tokenize every conversation once, masking everything but assistant turns.
    conversations = load_sft_dataset(cfg.dataset)
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    examples, truncated, dropped = [], 0, 0
    for messages in conversations:
        full_ids, full_mask = build_sft_example(tokenizer, messages, max_seq_len=10**9)
        input_ids, loss_mask = full_ids[: cfg.max_seq_len], full_mask[: cfg.max_seq_len]
        truncated += len(full_ids) > cfg.max_seq_len
        if sum(loss_mask) == 0:
            dropped += 1  # truncation cut away every assistant token
            continue
        examples.append((input_ids, loss_mask))
    if not examples:
        raise ValueError(
            f"no conversation of {cfg.dataset!r} keeps an assistant token within "
            f"max_seq_len={cfg.max_seq_len}"
        )
    sink.log(
        f"sft: {len(examples)} conversations from {cfg.dataset} ({truncated} truncated to "
        f"{cfg.max_seq_len} tokens, {dropped} dropped with no assistant token left), training on "
        f"{describe_device(device)}"
        + (f", {ranks.world_size} data-parallel ranks" if ranks.parallel else "")
    )

    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, total_steps)
    order_rng = random.Random(cfg.seed)
    order: list[int] = []
    lengths = [len(ids) for ids, _ in examples]
    model.train()
    # Every rank must stop at the same step: rank 0's answer is everyone's. Between
    # micro-batches only a run of one process stops.
    stop_requested = ranks.agreed(sink.should_stop)
    stop_inside_step = ranks.inside_step(sink.should_stop)

    def save(step: int, path: Path) -> str:
        """Rank 0 saves a checkpoint and reports it; the other ranks hold the same weights."""
        if ranks.is_main:
            save_checkpoint(model, tokenizer, cfg, path)
            sink.checkpoint(step, str(path))
        return str(path)

    def stop(step: int, where: str) -> str:
        """Save the weights after step `step` - 1 and say where the stop was heard. A stop
        inside a step drops that step's gradients: no optimizer step from a partial batch,
        so the weights saved are exactly those after the last complete step."""
        optimizer.zero_grad(set_to_none=True)
        path = save(step - 1, checkpoint_dir(output_dir, step - 1))
        sink.log(f"sft: stopped on request {where}; checkpoint {path}", "warning")
        return path

    milestones = Milestones(sink, "sft", 1, total_steps, ["loss/sft"])
    check_same_weights(model, "sft", "at the start", sink)
    for step in range(1, total_steps + 1):
        if stop_requested():
            return stop(step, f"after step {step - 1}")
        started = time.monotonic()

        # Next batch of conversations: a fresh shuffle every time the data runs out.
        batch: list[int] = []
        while len(batch) < cfg.batch_size:
            if not order:
                order = list(range(len(examples)))
                order_rng.shuffle(order)
            batch.append(order.pop())
        masked_tokens = sum(sum(examples[i][1]) for i in batch)

        # Forward and backward per micro-batch; the loss is the mean over every assistant
        # token of the whole batch, so accumulation gives the same gradient as one pass.
        # The loss stays on the device until the step ends: reading it per micro-batch
        # would make the host wait for the GPU each time. Each rank takes its share.
        total_loss, seen_tokens = torch.zeros((), device=device), 0
        chunks = length_sorted_chunks(ranks.deal(batch), lengths, cfg.micro_batch_size)
        for index, chunk in enumerate(chunks):
            if index and stop_inside_step():
                where = f"inside step {step}, micro-batch {index + 1} of {len(chunks)} not run"
                return stop(step, f"{where}; the step is dropped")
            chunk_examples = [examples[i] for i in chunk]
            loss = assistant_loss(
                model, chunk_examples, tokenizer.pad_token_id, device, masked_tokens
            )
            loss.backward()
            total_loss += loss.detach()
            seen_tokens += sum(len(ids) for ids, _ in chunk_examples)

        ranks.sum_gradients(model)
        grad_norm = clip_gradients(model, cfg.optimizer.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Loss and tokens added up over the ranks; the norm, alike on every rank, is
        # divided first so that the sum gives it back.
        step_sums = [total_loss, torch.tensor(float(seen_tokens)), grad_norm / ranks.world_size]
        step_sums = ranks.sum(torch.stack([value.to(device) for value in step_sums]))
        total_loss, seen_tokens, grad_norm = step_sums.tolist()

        seconds = time.monotonic() - started
        if step == 1 or saves_after(step, cfg.save_every, total_steps):
            check_same_weights(model, "sft", f"after step {step}", sink)
        sink.metric(
            step,
            {
                "loss/sft": total_loss,
                "optim/lr": lr,
                "optim/grad_norm": grad_norm,
                "perf/tokens_per_s": seen_tokens / max(seconds, 1e-9),
                "perf/step_seconds": seconds,
            },
        )
        milestones.step(step, {"loss/sft": total_loss}, seconds)
        sink.progress(step, total_steps, "sft")
        if saves_after(step, cfg.save_every, total_steps):
            save(step, checkpoint_dir(output_dir, step))

    path = save(total_steps, output_dir / "final")
    check_same_weights(model, "sft", "at the end", sink, saved=path)
    milestones.summary()
    sink.log(f"sft: final checkpoint {path}")
    return path
