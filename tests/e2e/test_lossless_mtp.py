"""Lossless harness applied to MTP_LORA (draft and verify in one target forward, gated LoRA).

Runs on the shipped target with its shipped adapter: the drafts must really be accepted for
the sampling test to exercise the acceptance branch, and an adapter only predicts well for a
target it was trained on (one trained for a random tiny model agrees with it ~3% of the time).

(a) greedy: MTP_LORA returns the non-speculative server's token ids for prompts sent
    concurrently, with k = 3 drafts per step and with k = 0 (speculation off: the worker's
    plain decode step, which the controller falls back to), and with k = 3's forward compiled
    (``--enable-torch-compile``), its drafts accepted as the eager server's;
(b) sampling: the joint law of completion tokens 1-3 at temperature 0.7 matches the target's
    exact law, with k = 3 and with k = 0. Token 3 is the first token verified against real mask
    drafts (the first decode step after prefill has none yet), so a wrong acceptance rule shows
    there. Pearson chi-square with a simulated null, alpha = 1e-4 (false-positive rate 0.01% per
    run).
"""

from __future__ import annotations

import pytest

from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER, DEFAULT_TARGET, resolve_model_path
from tests.helpers.invalid_prompts import assert_invalid_prompts_rejected
from tests.helpers.lossless import (
    assert_compiled_forwards_served,
    assert_speculative_sampling_law,
    joint_law,
)
from tests.helpers.metrics import check_spec_metrics, decode_log_suffixes, total
from tests.helpers.server_utils import Server, ServerPool
from tests.helpers.shipped import SHIPPED_PROMPTS, shipped_greedy_request

ALPHA = 1e-4
NUM_SAMPLES = 6000
TEMPERATURE = 0.7
SAMPLING_PROMPT = "def __init__(self"
PROMPTS = SHIPPED_PROMPTS


def _mtp_args(k: int) -> list[str]:
    return [
        "--model-path", DEFAULT_TARGET,
        "--speculative-algorithm", "MTP_LORA",
        "--mtp-lora-path", DEFAULT_MTP_ADAPTER,
        "--mtp-k", str(k),
        # Each request reserves 2 (k+1)^2 KV slots per step; with the tests' small pool an
        # unbounded batch of 6000 would be retracted over and over (correct, but slow).
        "--max-running-requests", "256",
        "--enable-metrics",
        "--log-level", "info",
        "--decode-log-interval", "5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pool = ServerPool(
        {
            "k3": _mtp_args(3),
            "k0": _mtp_args(0),
            # k = 3's verify (16 tokens a request, mask rows gated) compiled at start-up for
            # the batch of shipped_greedy_request
            "k3_compiled": [
                *_mtp_args(3),
                "--enable-torch-compile",
                "--cuda-graph-bs-decode",
                str(len(PROMPTS)),
            ],
        },
        tmp_path_factory.mktemp("mtp_logs"),
    )
    yield pool
    pool.close()


def _greedy(server: Server) -> tuple[list, list]:
    out = server.generate(shipped_greedy_request())
    return [o["output_ids"] for o in out], [o["meta_info"] for o in out]


@pytest.fixture(scope="module")
def baseline(shipped_greedy) -> list:
    """The non-speculative server's greedy ids for ``PROMPTS`` (the session's)."""
    return shipped_greedy["prompts"]


def test_greedy_equals_baseline(servers, baseline) -> None:
    got, meta = _greedy(servers("k3"))
    assert got == baseline
    accept = [m["spec_accept_length"] for m in meta]
    assert sum(accept) / len(accept) > 1.2, f"masks' drafts are rarely accepted: {accept}"


def test_prometheus_metrics_match_responses(servers) -> None:
    """SGLang's spec gauges and ours (per-position acceptance, step times, the chosen k) after
    traffic agree with the responses' meta_info; the decode log line carries our figures."""
    server = servers("k3")
    after = check_spec_metrics(server, "MTP_LORA", PROMPTS[:4], max_drafts=3)
    assert total(after, "sglang:spec_chosen_k_count", algorithm="MTP_LORA") > 0
    assert total(after, "sglang:spec_chosen_k_sum", algorithm="MTP_LORA") > 0  # k = 3 steps
    assert decode_log_suffixes(server, "MTP_LORA"), server.tail()


@pytest.mark.server
def test_invalid_prompts_rejected_server_keeps_serving(servers) -> None:
    """MTP_LORA: empty and out-of-vocabulary prompts get a 400, not a crash."""
    assert_invalid_prompts_rejected(servers("k3").url)


@pytest.mark.parametrize("name", ["k3", "k0"], scope="module")  # k3 tests, then k0
def test_sampling_matches_target(servers, name: str) -> None:
    from transformers import AutoTokenizer

    target = resolve_model_path(DEFAULT_TARGET)
    ids = AutoTokenizer.from_pretrained(target)(SAMPLING_PROMPT)["input_ids"]
    law = joint_law(target, ids, TEMPERATURE, NUM_SAMPLES, 3)
    assert_speculative_sampling_law(
        servers(name),
        ids,
        law,
        temperature=TEMPERATURE,
        num_samples=NUM_SAMPLES,
        alpha=ALPHA,
        min_cells=20,
        min_accepted_share=0.1 if name == "k3" else 0.0,
    )


@pytest.mark.parametrize("name", ["k3", "k0"], scope="module")  # k3 tests, then k0
def test_openai_api_logprobs_and_bad_request(servers, name: str) -> None:
    import requests

    server = servers(name)
    comp = requests.post(
        server.url + "/v1/completions",
        json={
            "model": "default",
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 2,
        },
        timeout=120,
    )
    assert comp.status_code == 200, comp.text
    body = comp.json()
    assert body["usage"]["completion_tokens"] == 8
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 8
    server.check_bad_request_keeps_serving()


def test_k0_is_plain_decoding(servers, baseline) -> None:
    got, meta = _greedy(servers("k0"))
    assert got == baseline
    # SGLang leaves the spec_* fields out when no draft was ever proposed
    assert all(m.get("spec_num_correct_drafts", 0) == 0 for m in meta)


def test_compiled_greedy_equals_baseline(servers, baseline) -> None:
    """``--enable-torch-compile``: k = 3's verify, compiled at start-up with its mask rows
    gated (``MtpLoraWorker.compiled_state``), serves the baseline's tokens on its graph, and
    its masks draft as the eager server's do (a graph without the gated path would draft from
    the base weights and be accepted far less often)."""
    server = servers("k3_compiled")
    got, meta = _greedy(server)
    assert got == baseline
    compiled = [m["spec_accept_length"] for m in meta]
    eager = [m["spec_accept_length"] for m in _greedy(servers("k3"))[1]]
    assert sum(compiled) >= 0.9 * sum(eager), (compiled, eager)
    label = f"target: target_verify (tree) bs={len(PROMPTS)} n=16"
    assert_compiled_forwards_served(server.log_path.read_text(), [label])
