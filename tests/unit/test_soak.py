"""The soak benchmark's pure parts (``benchmarks/soak.py``): the traffic mix, what counts as a
failed request, the tally, the process roles and the pass/fail verdict. No server."""

from __future__ import annotations

import itertools

import pytest
import soak
from soak import Outcome, RequestSpec


def _take(n: int, seed: int = 0, **kw) -> list[RequestSpec]:
    mix = {"max_prompt_len": 64, "max_output_len": 32, "abort_share": 0.05, **kw}
    return list(itertools.islice(soak.traffic(seed, **mix), n))


def test_traffic_is_seeded_mixed_and_bounded() -> None:
    specs = _take(4000)
    assert specs == _take(4000) and specs != _take(4000, seed=1)
    rids = sorted(s.rid for s in specs)  # unique, and none begins another (SGLang's abort)
    assert all(not b.startswith(a) for a, b in itertools.pairwise(rids))
    assert all(1 <= len(s.input_ids) <= 64 and 1 <= s.max_new_tokens <= 32 for s in specs)
    low, high = soak.TOKEN_RANGE
    assert all(low <= t < high for s in specs for t in s.input_ids)

    def share(pred) -> float:
        return sum(map(pred, specs)) / len(specs)

    assert 0.03 < share(lambda s: s.abort is not None) < 0.07  # 5% aborted
    assert 0.25 < share(lambda s: s.temperature == 0) < 0.42  # greedy and sampled
    assert 0.4 < share(lambda s: s.stream) < 0.6  # streaming and not
    aborted = [s for s in specs if s.abort]
    assert all(s.stream and 1 <= s.abort_after <= 4 for s in aborted)
    assert {s.abort for s in aborted} == set(soak.ABORT_MODES)
    lengths = {len(s.input_ids) for s in specs}
    assert min(lengths) < 8 and max(lengths) > 56  # random prompt lengths
    prefixes = [s.input_ids[:16] for s in specs if len(s.input_ids) >= 16]
    assert max(prefixes.count(p) for p in set(prefixes)) > 50  # shared prefixes: cache hits


def test_payload_of_a_sampled_streamed_request() -> None:
    spec = RequestSpec("r", (11, 12), 8, 0.7, True)
    assert spec.payload() == {
        "input_ids": [11, 12],
        "rid": "r",
        "stream": True,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 8, "top_p": 0.95},
    }
    greedy = RequestSpec("g", (11,), 8, 0.0, False).payload()["sampling_params"]
    assert greedy == {"temperature": 0.0, "max_new_tokens": 8}


@pytest.mark.parametrize(
    ("spec", "outcome", "ok"),
    [
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, "length", [1, 2, 3, 4]), True),
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, "stop", [1]), True),
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, "abort", [1]), False),
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, "length", [1] * 5), False),
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, "length", []), False),
        (RequestSpec("a", (1,), 4, 0, False), Outcome("a", False, error="HTTP 500"), False),
        # aborted by /abort_request: the abort, or finishing first, are both fine
        (
            RequestSpec("a", (1,), 4, 0, True, "abort_request", 1),
            Outcome("a", False, "abort", [1], aborted=True),
            True,
        ),
        (
            RequestSpec("a", (1,), 4, 0, True, "abort_request", 1),
            Outcome("a", False, "length", [1] * 4),
            True,
        ),
        # an abort the client never sent is a failure
        (
            RequestSpec("a", (1,), 4, 0, True, "abort_request", 3),
            Outcome("a", False, "abort", [1]),
            False,
        ),
    ],
)
def test_a_request_fails_unless_served_as_asked(spec, outcome, ok) -> None:
    assert soak._judge(spec, outcome).ok is ok


def test_tally_counts_completed_aborted_and_failed() -> None:
    greedy, sampled = RequestSpec("g", (1,), 4, 0, False), RequestSpec("s", (1,), 4, 1.0, True)
    results = [
        (greedy, Outcome("g", True, "length", [1, 2])),
        (sampled, Outcome("s", True, None, [1], aborted=True)),
        (sampled, Outcome("s", False, error="boom")),
    ]
    tallied = soak.tally(results)
    assert {k: tallied[k] for k in ("sent", "completed", "aborted", "failed")} == {
        "sent": 3,
        "completed": 1,
        "aborted": 1,
        "failed": 1,
    }
    assert tallied["greedy"] == 1 and tallied["streamed"] == 2 and tallied["output_tokens"] == 3
    assert tallied["failures"] == ["s: boom"]


def test_process_roles_and_stat_lines() -> None:
    assert soak.role_of("/x/python -m sgl_spec.launch_server --port 1") == "launcher"
    assert soak.role_of("sglang::scheduler") == "scheduler"
    assert soak.role_of("sglang::detokenizer") == "detokenizer"
    assert soak.role_of("python -m sgl_spec.minedraft.draft_server --instance-id 1") == (
        "draft_server"
    )
    assert soak.role_of("python -c from multiprocessing.spawn import spawn_main") == "other"
    assert soak.parse_stat("42 (sglang::sched uler) S 1 4000 4000 0 -1") == (42, 4000)


def _snapshot(used: int, **rss: int) -> dict:
    return {"idle_used_tokens": used, "rss_bytes": rss}


def test_verdict() -> None:
    clean = {"sent": 10, "completed": 9, "failed": 0}
    start = _snapshot(0, launcher=1000, scheduler=2000, other=10)
    assert soak.verdict(clean, start, _snapshot(0, launcher=1040, scheduler=2090), 0.05) == []
    reasons = soak.verdict(
        {"sent": 10, "completed": 0, "failed": 2},
        start,
        _snapshot(16, launcher=1000, scheduler=2100, other=500),
        0.05,
    )
    assert reasons == [
        "2 of 10 requests failed",
        "no request completed",
        "idle KV usage 0 -> 16 tokens",
        "scheduler RSS grew 5.0%",
        "total RSS grew 19.6%",
    ]
    gone = soak.verdict(clean, start, _snapshot(0, launcher=1000), 0.05)
    assert gone == ["scheduler process gone"]


def test_command_line_defaults_and_pass_through() -> None:
    args, extra = soak.parse_args(["--minutes", "2", "--max-total-tokens", "8192"])
    assert args.algorithms == list(soak.DEFAULT_ALGORITHMS) and args.minutes == 2
    assert args.concurrency == 8 and args.abort_share == 0.05
    assert extra == ["--max-total-tokens", "8192"]
    with pytest.raises(SystemExit):
        soak.parse_args(["--minutes", "0"])
