"""Held-out metrics of a target/draft pair and their decode-step timings.

alpha_k is what speculative decoding actually gets from the pair: the probability that the
draft's k-th greedy token equals the target's k-th greedy token given the first k-1 matched.
When the first k-1 matched, the draft's own inputs *are* the target's greedy tokens, so one
teacher-forced draft forward over the target's greedy continuation gives every alpha_k at once,
averaged over all draft start positions (``sgl_spec.training.acceptance``, shared with the
adapter and drafter evaluations). Everything runs in fp32 on the stored weights.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from sgl_spec.models.build.data import eval_windows
from sgl_spec.models.build.export import load_model_dir, weights_megabytes
from sgl_spec.models.build.specs import count_parameters
from sgl_spec.training.acceptance import acceptance_rates, expected_acceptance_length
from sgl_spec.training.greedy_data import greedy_continuation


@torch.no_grad()
def next_token_metrics(
    model: torch.nn.Module,
    windows: torch.Tensor,  # [n, seq_len + 1]
    batch_size: int = 8,
) -> dict:
    """Top-1 next-token accuracy and perplexity over every position of ``windows``."""
    total_nll, correct, count = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i : i + batch_size]
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # [b, seq_len, vocab]
        labels = chunk[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
        total_nll += float(nll)
        correct += int((logits.argmax(-1) == labels).sum())
        count += labels.numel()
    return {
        "top1_accuracy": correct / count,
        "perplexity": float(torch.exp(torch.tensor(total_nll / count))),
        "num_tokens": count,
    }


@torch.no_grad()
def draft_agreement(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: torch.Tensor,  # [n, prompt_len]
    num_new: int = 64,
    max_k: int = 5,
) -> dict:
    """alpha_1..alpha_K of ``draft`` against ``target``'s greedy continuation of ``prompts``."""
    cont = greedy_continuation(target, prompts, num_new)  # [n, num_new]
    seq = torch.cat([prompts, cont], dim=1)
    logits = draft(input_ids=seq[:, :-1]).logits  # [n, p + g - 1, vocab]
    p = prompts.shape[1]
    draft_pred = logits[:, p - 1 :].argmax(-1)  # [n, g]
    alphas = acceptance_rates(draft_pred == cont, max_k)
    return {
        "alpha": alphas,
        "expected_acceptance_length": expected_acceptance_length(alphas),
        "num_prompts": prompts.shape[0],
        "prompt_len": p,
        "num_new": num_new,
        "distinct_tokens_per_continuation": float(
            statistics.mean(len(set(row.tolist())) for row in cont)
        ),
    }


@torch.no_grad()
def decode_step_ms(
    model: torch.nn.Module,
    batch_size: int = 16,
    context: int = 256,
    threads: int = 1,
    repeats: int = 20,
) -> float:
    """Best-of-``repeats`` wall time of one fp32 decode forward (plain transformers) at a
    ``context``-token KV length; the minimum, because on a shared host the other processes only
    ever add time."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prefill = torch.randint(0, vocab, (batch_size, context), generator=gen)
        cache = model(input_ids=prefill, use_cache=True).past_key_values
        step = torch.randint(0, vocab, (batch_size, 1), generator=gen)
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            model(input_ids=step, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)
        return 1000 * min(times[2:])
    finally:
        torch.set_num_threads(old)


def _prompts(stream: torch.Tensor, num_prompts: int, prompt_len: int) -> torch.Tensor:
    windows = eval_windows(stream, prompt_len, num_prompts)  # [n, prompt_len + 1]
    return windows[:, :prompt_len]


def evaluate_pair(
    target_dir: Path,
    draft_dir: Path,
    eval_stream: torch.Tensor,  # [num_tokens] held-out token stream
    num_prompts: int = 64,
    prompt_len: int = 128,
    num_new: int = 64,
    seq_len: int = 512,
    max_windows: int = 128,
    timing_threads: str = "1,2",
) -> dict:
    """All card metrics for a target/draft pair, loaded from disk in fp32."""
    target, draft = load_model_dir(target_dir), load_model_dir(draft_dir)
    windows = eval_windows(eval_stream, seq_len, max_windows)
    metrics = {
        "target": {
            **next_token_metrics(target, windows),
            "params": count_parameters(target),
            "weights_mb": weights_megabytes(Path(target_dir)),
        },
        "draft": {
            **next_token_metrics(draft, windows),
            "params": count_parameters(draft),
            "weights_mb": weights_megabytes(Path(draft_dir)),
        },
        "agreement": draft_agreement(
            target, draft, _prompts(eval_stream, num_prompts, prompt_len), num_new
        ),
        "eval_windows": {"num": int(windows.shape[0]), "seq_len": seq_len},
        "target_hidden_size": int(target.config.hidden_size),
    }
    timing = {}
    for threads in [int(t) for t in timing_threads.split(",") if t]:
        t_ms, d_ms = decode_step_ms(target, threads=threads), decode_step_ms(draft, threads=threads)
        timing[f"threads_{threads}"] = {
            "target_ms": round(t_ms, 2),
            "draft_1layer_ms": round(d_ms, 2),
            "ratio": round(t_ms / d_ms, 2),
        }
    metrics["timing"] = {"batch_size": 16, "context": 256, "dtype": "float32", **timing}
    return metrics
