"""Lossless-test harness: exact target distributions from transformers and a chi-square
goodness-of-fit test on the joint distribution of completion tokens 1 and 2.

Token 2 of a speculative completion is produced by the first draft/verify step (token 1 comes
from the prefill), so its distribution is what a wrong acceptance rule would distort. We test
the joint law p(t1) * p(t2 | t1) against the counts of (t1, t2) pairs; cells with expected count
below ``MIN_EXPECTED`` are pooled into one "rest" cell so the chi-square approximation holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from scipy import stats

MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class GofResult:
    statistic: float
    dof: int
    p_value: float
    num_cells: int


def next_token_probs(
    model_dir: Path, prefixes: list[list[int]], temperature: float
) -> torch.Tensor:
    """Exact target next-token distributions, fp32, via transformers: [len(prefixes), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prefixes:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            out.append(torch.softmax(logits / temperature, dim=-1))
    return torch.stack(out)


def joint_two_token_law(
    model_dir: Path, prompt_ids: list[int], temperature: float, num_samples: int
) -> dict[tuple[int, int], float]:
    """p(t1, t2) for every pair whose expected count could reach MIN_EXPECTED."""
    p1 = next_token_probs(model_dir, [prompt_ids], temperature)[0]
    firsts = [int(t) for t in torch.nonzero(p1 * num_samples >= MIN_EXPECTED).flatten()]
    p2 = next_token_probs(model_dir, [prompt_ids + [t] for t in firsts], temperature)
    law: dict[tuple[int, int], float] = {}
    for row, t1 in enumerate(firsts):
        joint = p1[t1] * p2[row]
        for t2 in torch.nonzero(joint * num_samples >= MIN_EXPECTED).flatten().tolist():
            law[(t1, t2)] = float(joint[t2])
    return law


def chi_square_gof(samples: list[tuple[int, int]], law: dict[tuple[int, int], float]) -> GofResult:
    """Pearson chi-square of observed pair counts against ``law`` (+ one pooled rest cell)."""
    n = len(samples)
    counts = Counter(samples)
    observed = [counts.get(cell, 0) for cell in law]
    expected = [p * n for p in law.values()]
    rest_expected = n - sum(expected)
    if rest_expected >= MIN_EXPECTED:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    else:  # fold the tiny remainder into the largest cell to keep totals equal
        big = max(range(len(expected)), key=expected.__getitem__)
        expected[big] += rest_expected
        observed[big] += n - sum(observed)
    stat, p_value = stats.chisquare(observed, expected)
    return GofResult(float(stat), len(observed) - 1, float(p_value), len(observed))


def sample_pairs_from_law(
    model_dir: Path,
    prompt_ids: list[int],
    temperature: float,
    num_samples: int,
    seed: int,
    *,
    sample_temperature: float | None = None,
    greedy_second: bool = False,
) -> list[tuple[int, int]]:
    """Draw (t1, t2) pairs on the host — deliberately biased when asked — to check the test's
    power: ``sample_temperature`` != ``temperature`` tempers the law; ``greedy_second`` commits
    argmax for token 2 (what SGLang's unpatched CPU verify does)."""
    gen = torch.Generator().manual_seed(seed)
    t_used = sample_temperature or temperature
    p1 = next_token_probs(model_dir, [prompt_ids], t_used)[0]
    t1s = torch.multinomial(p1.float(), num_samples, replacement=True, generator=gen).tolist()
    uniq = sorted(set(t1s))
    p2 = next_token_probs(model_dir, [prompt_ids + [t] for t in uniq], t_used)
    pairs = []
    for t1 in t1s:
        row = p2[uniq.index(t1)].float()
        if greedy_second:
            t2 = int(row.argmax())
        else:
            t2 = int(torch.multinomial(row, 1, generator=gen))
        pairs.append((t1, t2))
    return pairs
