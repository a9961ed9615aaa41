"""Lossless-test harness: exact target distributions from transformers and a chi-square
goodness-of-fit test on the joint distribution of completion tokens 1 and 2.

Token 2 of a speculative completion is produced by the first draft/verify step (token 1 comes
from the prefill), so its distribution is what a wrong acceptance rule would distort. We test
the joint law p(t1) * p(t2 | t1) against the counts of (t1, t2) pairs; cells with expected count
below ``MIN_EXPECTED`` are pooled into one "rest" cell. The p-value is not read off the
chi-square distribution (an approximation whose tail is least reliable exactly where the test
decides, with many cells of small expected count); it is computed by simulating ``NULL_DRAWS``
multinomial samples of the same size from the law itself, so alpha is the real false-positive
rate up to the simulation's resolution.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from scipy import stats

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self):",
    "for i in range(10):\n",
    "# compute the sum\ntotal = 0\n",
    "x = [1, 2, 3]\n",
    "with open(path) as f:\n",
    "if __name__ == '__main__':\n",
]


def _long_prompts(num: int = 6, chars: int = 800) -> list[str]:
    """Code excerpts long enough that the first token barely matters to a draft model."""
    import textwrap

    src = Path(textwrap.__file__).read_text()
    return [src[i * 1000 : i * 1000 + chars] for i in range(num)]


LONG_PROMPTS = _long_prompts()
MIN_EXPECTED = 5.0
NULL_DRAWS = 200_000


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
) -> dict[tuple[int, ...], float]:
    """p(t1, t2) for every pair whose expected count could reach MIN_EXPECTED."""
    return joint_law(model_dir, prompt_ids, temperature, num_samples, num_tokens=2)


def joint_law(
    model_dir: Path,
    prompt_ids: list[int],
    temperature: float,
    num_samples: int,
    num_tokens: int,
) -> dict[tuple[int, ...], float]:
    """p(t1..tn) for every completion prefix whose expected count could reach MIN_EXPECTED
    (a prefix below that cannot have an extension above it, so the search is exact)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(num_tokens):
        prefixes = list(law)
        probs = next_token_probs(model_dir, [prompt_ids + list(p) for p in prefixes], temperature)
        grown: dict[tuple[int, ...], float] = {}
        for prefix, row in zip(prefixes, probs, strict=True):
            joint = row * law[prefix]
            for t in torch.nonzero(joint * num_samples >= MIN_EXPECTED).flatten().tolist():
                grown[(*prefix, t)] = float(joint[t])
        law = grown
    return law


def chi_square_gof(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> GofResult:
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
    stat = float(stats.chisquare(observed, expected).statistic)
    return GofResult(stat, len(observed) - 1, null_p_value(stat, expected), len(observed))


def null_p_value(stat: float, expected: list[float], seed: int = 0) -> float:
    """P(Pearson statistic >= stat) for multinomial samples drawn from the law itself."""
    import numpy as np

    exp = np.asarray(expected, dtype=np.float64)
    n = int(round(exp.sum()))
    rng = np.random.default_rng(seed)
    exceed, chunk = 0, 20_000
    for _ in range(NULL_DRAWS // chunk):
        draws = rng.multinomial(n, exp / exp.sum(), size=chunk)
        exceed += int(np.count_nonzero(((draws - exp) ** 2 / exp).sum(axis=1) >= stat))
    return float((1 + exceed) / (1 + NULL_DRAWS))


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


def assert_speculative_sampling_law(
    server,
    input_ids: list[int],
    law: dict[tuple[int, ...], float],
    *,
    temperature: float,
    num_samples: int,
    alpha: float,
    min_cells: int,
    min_accepted_share: float = 0.1,
    payload: dict | None = None,
) -> None:
    """Sample 3 tokens ``num_samples`` times from a speculative server and test them against the
    target's exact joint law (chi-square at ``alpha``); at least ``min_accepted_share`` of the
    samples must have accepted a draft, or the test would not exercise speculative sampling
    (0 for a server meant to run without drafts, e.g. MTP_LORA at k = 0). ``payload``: more
    request fields (``routed_dp_rank``)."""
    out = server.generate(
        {
            "input_ids": [input_ids] * num_samples,
            "sampling_params": {
                "temperature": temperature,
                "max_new_tokens": 3,
                "ignore_eos": True,
            },
            **(payload or {}),
        }
    )
    accepted = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in out)
    if min_accepted_share > 0:
        assert accepted > num_samples * min_accepted_share, (
            f"only {accepted} accepted drafts: too few to test"
        )
    result = chi_square_gof([tuple(o["output_ids"][:3]) for o in out], law)
    assert result.num_cells >= min_cells, "law too peaked for a meaningful test"
    assert result.p_value > alpha, result


def assert_three_token_law(
    server,
    target_dir: Path,
    input_ids: list[int],
    *,
    temperature: float,
    num_samples: int,
    alpha: float,
) -> None:
    """:func:`assert_speculative_sampling_law` for completion tokens 1-3 against the target's
    exact joint law (``joint_law``), cells of expected count >= 10."""
    law = joint_law(target_dir, input_ids, temperature, num_samples, 3)
    assert_speculative_sampling_law(
        server,
        input_ids,
        law,
        temperature=temperature,
        num_samples=num_samples,
        alpha=alpha,
        min_cells=10,
    )


def assert_greedy_under_concurrent_load(server, baseline: dict[str, list]) -> float:
    """Greedy ids equal the non-speculative server's (``baseline_greedy``) for ``PROMPTS`` in one
    batched request and ``LONG_PROMPTS`` sent as separate requests at once; every request was
    verified. Returns the mean ``spec_accept_length``."""
    from concurrent.futures import ThreadPoolExecutor

    params = {"temperature": 0, "max_new_tokens": 48}
    out = server.generate({"text": PROMPTS, "sampling_params": params})
    assert [o["output_ids"] for o in out] == baseline["short"]
    with ThreadPoolExecutor(len(LONG_PROMPTS)) as pool:
        single = list(
            pool.map(
                lambda p: server.generate({"text": p, "sampling_params": params}), LONG_PROMPTS
            )
        )
    assert [o["output_ids"] for o in single] == baseline["long"]
    meta = [o["meta_info"] for o in [*out, *single]]
    assert all(m["spec_verify_ct"] > 0 for m in meta)
    return sum(m["spec_accept_length"] for m in meta) / len(meta)


def assert_compiled_forwards_served(log: str, labels: list[str]) -> None:
    """A server's log (``--log-level info``) shows each of ``labels`` (the model, then
    ``compiled_forwards._label``: ``target: target_verify (tree) bs=8 n=4``) run on its compiled
    graph, and no captured shape left to eager (its compile failed, or its guards refused it
    for good)."""
    for label in labels:
        model, _, shape = label.partition(": ")
        assert f"{model}: first forward on the compiled graph of {shape}" in log, label
    assert "served eager from now on" not in log and "stays eager" not in log
