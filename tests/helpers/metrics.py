"""``/metrics`` after traffic, checked against the responses' ``meta_info`` (servers started
with ``--enable-metrics``). Counters are compared as before/after differences, so a module's
other tests may share the server."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server_utils import Server


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    """Every sample on ``/metrics``: (sample name, sorted labels without model_name) -> value."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def _generate(server: Server, prompt: str, max_new_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    return server.generate({"text": prompt, "sampling_params": params})


def check_spec_metrics(
    server: Server,
    algorithm: str,
    prompts: list[str],
    max_new_tokens: int = 32,
    max_drafts: int = 16,  # upper bound on drafts accepted in one step
) -> dict:
    """Send ``prompts`` concurrently (greedy) and check SGLang's and our speculative series.

    Each request's tokens are its prefill token plus, per verify step, the accepted drafts and
    one bonus token; the last step may accept drafts past ``max_new_tokens`` that SGLang
    drops. So accepted drafts on ``/metrics`` lie between the responses' count and that count
    plus ``max_drafts`` per request. Returns the scrape after traffic."""
    before = scrape(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: _generate(server, p, max_new_tokens), prompts))
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    verify_ct = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert verify_ct > 0, outs[0]["meta_info"]
    assert delta("sglang:spec_verify_calls_total") == verify_ct
    # SGLang's gauge: the last log interval's mean acceptance length (drafts + bonus token).
    gauge = total(after, "sglang:spec_accept_length")
    assert 1.0 <= gauge <= 1 + max_drafts, gauge  # 0 before any step
    accepted = delta("sglang:spec_position_accepted_total", algorithm=algorithm)
    from_responses = tokens - len(outs) - verify_ct
    assert from_responses <= accepted <= from_responses + max_drafts * len(outs), (
        accepted,
        from_responses,
    )
    first_offered = delta("sglang:spec_position_drafts_total", algorithm=algorithm, position="1")
    assert 0 < first_offered <= verify_ct
    rate = total(after, "sglang:spec_position_accept_rate", algorithm=algorithm, position="1")
    offered_1 = total(after, "sglang:spec_position_drafts_total", algorithm=algorithm, position="1")
    accepted_1 = total(
        after, "sglang:spec_position_accepted_total", algorithm=algorithm, position="1"
    )
    assert abs(rate - accepted_1 / offered_1) < 1e-9
    steps = delta("sglang:spec_verify_seconds_count", algorithm=algorithm)
    assert 0 < steps <= verify_ct
    assert delta("sglang:spec_draft_seconds_count", algorithm=algorithm) == steps
    assert delta("sglang:spec_verify_seconds_sum", algorithm=algorithm) > 0
    return after


def decode_log_suffixes(server: Server, algorithm: str) -> list[str]:
    """Our figures on SGLang's ``Decode batch`` log lines (needs ``--log-level info``)."""
    text = server.log_path.read_text(errors="replace")
    return re.findall(rf"Decode batch.*?, ({algorithm}: pos accept \[.*)", text)
