"""MINEDRAFT served end to end on the tiny models (draft server on its own core, ``cpu:1``).

(a) greedy: MINEDRAFT returns the non-speculative server's token ids for prompts sent
    concurrently (one batched request, and separate requests arriving together), and most
    steps ran in parallel (both batches non-empty);
(b) sampling: the joint law of completion tokens 1-3 at temperature 1 matches the target's exact
    law (tokens 2 and 3 are verified against drafts; chi-square with a simulated null,
    alpha = 1e-4, the method of ``test_lossless_standalone.py``);
(c) faults: the draft server is SIGKILLed during an ``sglang.bench_serving`` run of 64 requests
    (all in flight): all 64 complete without error, with the non-speculative server's texts; the
    draft server is restarted and parallel steps resume (SIGSTOP: ``test_faults.py``);
(e) ``--minedraft-drafter specblock``: the draft server hosts the SpecBlock drafter trained for
    the tiny target, fed the target's features; greedy equals the non-speculative server under
    concurrent load with drafts accepted, and the sampling law test above passes with it.
(d) §5.3: the target's peak KV usage on a workload is no higher than STANDALONE's with the same
    chain (SGLang's own ``#token`` count, logged every decode step). Both draft with a model
    whose drafts are constant, so requests advance by the same tokens per step under either
    algorithm and any difference in held KV is allocation, not acceptance.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.invalid_prompts import assert_invalid_prompts_rejected
from tests.helpers.lossless import (
    LONG_PROMPTS,
    PROMPTS,
    assert_greedy_under_concurrent_load,
    assert_speculative_sampling_law,
    assert_three_token_law,
    joint_law,
)
from tests.helpers.metrics import check_spec_metrics, decode_log_suffixes, scrape, total
from tests.helpers.server_utils import Server, ServerPool, finish_bench_serving, start_bench_serving
from tests.helpers.tiny_models import constant_draft

ALPHA = 1e-4
NUM_SAMPLES = 6000
TEMPERATURE = 1.0
SAMPLING_PROMPT_IDS = [12, 40, 7, 99, 3]
CHAIN = ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
GREEDY = {"temperature": 0, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def servers(tiny_models, tiny_specblock_drafter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("minedraft_logs")
    constant = constant_draft(tiny_models["target"], logs / "constant_draft")

    def args(algorithm: str, draft) -> list[str]:
        flags = [
            "--model-path", str(tiny_models["target"]),
            "--speculative-draft-model-path", str(draft),
            *CHAIN,
            "--speculative-algorithm", algorithm,
            "--max-running-requests", "128",
            "--log-level", "info",
            "--decode-log-interval", "1",
            "--enable-metrics",
        ]  # fmt: skip
        if algorithm == "MINEDRAFT":  # the full chain every step unless a server says otherwise
            return [*flags, "--speculative-draft-device", "cpu:1", "--minedraft-steps", "fixed"]
        return [*flags, "--speculative-eagle-topk", "1"]

    pool = ServerPool(
        {
            "none": ["--model-path", str(tiny_models["target"])],
            "minedraft": args("MINEDRAFT", tiny_models["draft"]),
            "minedraft_sequential": [
                *args("MINEDRAFT", tiny_models["draft"]),
                "--minedraft-overlap",
                "off",
            ],
            "minedraft_constant": args("MINEDRAFT", constant),
            "minedraft_specblock": [
                *args("MINEDRAFT", tiny_models["draft"]),
                "--minedraft-drafter",
                "specblock",
                "--specblock-drafter-path",
                str(tiny_specblock_drafter),
            ],
            # drafts verified per step 0, 1, 2, 3 in turn (0: a plain decode step, nothing
            # sent to the draft server), with the drafter that reads the target's features
            "minedraft_specblock_cycle": [
                *args("MINEDRAFT", tiny_models["draft"]),
                "--minedraft-drafter",
                "specblock",
                "--specblock-drafter-path",
                str(tiny_specblock_drafter),
                "--minedraft-steps",
                "cycle",
            ],
            "standalone_constant": args("STANDALONE", constant),
        },
        logs,
    )
    yield pool
    pool.close()


def _metrics(server: Server) -> list[dict[str, float]]:
    lines = [x for x in server.tail(20000).splitlines() if "MINEDRAFT: steps=" in x]
    return [{k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", x)} for x in lines]


def _peak_kv_tokens(server: Server, since: int) -> int:
    text = server.log_path.read_text(errors="replace")[since:]
    counts = [int(n) for n in re.findall(r"Decode batch.*?#token: (\d+)", text)]
    assert counts, "no decode log lines"
    return max(counts)


def test_greedy_equals_baseline_under_concurrent_load(servers, baseline_greedy) -> None:
    server = servers("minedraft")
    accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
    assert accept > 1.2, f"drafts are rarely accepted: {accept}"
    last = _metrics(server)[-1]
    assert last["coverage"] > 0.5, last  # most steps drafted one batch while verifying the other
    assert last["faults"] == 0, last


def test_sampling_matches_target(servers, tiny_models) -> None:
    law = joint_law(tiny_models["target"], SAMPLING_PROMPT_IDS, TEMPERATURE, NUM_SAMPLES, 3)
    assert_speculative_sampling_law(
        servers("minedraft"),
        SAMPLING_PROMPT_IDS,
        law,
        temperature=TEMPERATURE,
        num_samples=NUM_SAMPLES,
        alpha=ALPHA,
        min_cells=10,
    )


def _draft_pid(server: Server) -> int:
    found = re.findall(r"draft server (?:restarted \()?pid (\d+)", server.tail(20000))
    assert found, server.tail()
    return int(found[-1])


def test_draft_server_killed_during_bench_serving(
    servers, baseline_greedy, tiny_models, tmp_path
) -> None:
    """``sglang.bench_serving`` sends 64 greedy requests, all in flight; the draft server is
    SIGKILLed a few steps in. All 64 complete without error and return the non-speculative
    server's texts for the same prompts; the draft server is restarted and parallel steps
    resume (then short prompts again equal the baseline's token ids)."""
    tokenizer = tiny_models["target"]
    expected = finish_bench_serving(
        _bench(servers("none"), tokenizer, tmp_path / "none.jsonl"), tmp_path / "none.jsonl"
    )
    assert expected["completed"] == 64 and not any(expected["errors"]), expected["errors"]
    assert all(expected["generated_texts"])  # something to compare
    server = servers("minedraft")
    before = len(_metrics(server))
    pid = _draft_pid(server)
    out = tmp_path / "minedraft.jsonl"
    proc = _bench(server, tokenizer, out)
    deadline = time.monotonic() + 180
    while len(_metrics(server)) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)  # a few steps into the run
    assert proc.poll() is None, "bench_serving finished before the kill"
    os.kill(pid, signal.SIGKILL)
    result = finish_bench_serving(proc, out)
    assert result["completed"] == 64, result["completed"]
    assert not any(result["errors"]), result["errors"]
    assert result["generated_texts"] == expected["generated_texts"]
    deadline = time.monotonic() + 300
    while "draft server restarted" not in server.tail(20000) and time.monotonic() < deadline:
        time.sleep(1)
    assert "draft server restarted" in server.tail(20000), server.tail()
    assert _draft_pid(server) != pid
    resumed_from = _metrics(server)[-1]
    with ThreadPoolExecutor(8) as pool:
        again = list(
            pool.map(lambda p: server.generate({"text": p, "sampling_params": GREEDY}), PROMPTS)
        )
    assert [o["output_ids"] for o in again] == baseline_greedy["short"]
    last = _metrics(server)[-1]
    assert last["faults"] >= 1 and last["restarts"] >= 1, last
    restarts = total(scrape(server), "sglang:spec_draft_server_restarts_total")
    assert restarts >= 1
    assert last["parallel_steps"] > resumed_from["parallel_steps"], (resumed_from, last)


def _bench(server: Server, tokenizer: Path, out: Path) -> subprocess.Popen:
    return start_bench_serving(server, tokenizer, out, num_prompts=64, concurrency=64, length=32)


def test_abort_a_third_of_one_batch_rebalances(servers, baseline_greedy) -> None:
    """12 requests admitted together are assigned alternately (the balanced policy: batch 0 on a
    tie, then the smaller batch), so the even-numbered ones form batch 0. Two of them (a third
    of that batch) are aborted mid-run: the batches are rebalanced (one request moves), and the
    others still return the baseline's tokens."""
    import requests

    server = servers("minedraft")
    prompts = [*PROMPTS, *LONG_PROMPTS[:4]]
    expected = [*baseline_greedy["short"], *baseline_greedy["long"][:4]]
    rids = [f"rebalance-{i}" for i in range(len(prompts))]
    before = len(_metrics(server))
    moved_before = _metrics(server)[-1]["moved"] if before else 0
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            server.generate, {"text": prompts, "rid": rids, "sampling_params": GREEDY}
        )
        deadline = time.monotonic() + 120
        while len(_metrics(server)) < before + 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        for rid in rids[0:4:2]:
            resp = requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=30)
            assert resp.status_code == 200, resp.text
        outputs = future.result()
    aborted = {0, 2}
    for i, out in enumerate(outputs):
        if i in aborted:
            assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        else:
            assert out["output_ids"] == expected[i]
    after = [m for m in _metrics(server)[before:] if m["moved"] > moved_before]
    assert after, "no rebalance after the aborts"
    assert all(abs(m["balance"]) <= 1 for m in after), after


def test_metrics_logged_and_bad_request_keeps_serving(servers) -> None:
    server = servers("minedraft")
    server.check_bad_request_keeps_serving()
    last = _metrics(server)[-1]
    for key in ("coverage", "mean_accept_length", "draft_ms", "verify_ms", "overlap_ms"):
        assert key in last, last


def test_prometheus_metrics_match_responses(servers) -> None:
    """SGLang's spec gauges and ours (per-position acceptance, step times, overlap ratio, batch
    sizes, draft-server restarts) after traffic agree with the responses' meta_info."""
    server = servers("minedraft")
    after = check_spec_metrics(server, "MINEDRAFT", PROMPTS[:4], max_drafts=8)
    assert 1.0 <= total(after, "sglang:spec_overlap_ratio", algorithm="MINEDRAFT") <= 2.0
    sizes = total(after, "sglang:spec_batch_size_count", algorithm="MINEDRAFT", role="verify")
    assert sizes > 0
    assert decode_log_suffixes(server, "MINEDRAFT"), server.tail()


@pytest.mark.server
def test_invalid_prompts_rejected_server_keeps_serving(servers) -> None:
    """MINEDRAFT: empty and out-of-vocabulary prompts get a 400, not a crash."""
    assert_invalid_prompts_rejected(servers("minedraft").url)


def test_overlap_off_is_standard_sd(servers, baseline_greedy) -> None:
    """``--minedraft-overlap off`` (the benchmark's like-for-like baseline): every step drafts
    and then verifies the whole batch through the same draft server; no step runs in parallel,
    drafts are still accepted and greedy output is the baseline's."""
    server = servers("minedraft_sequential")
    accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
    assert accept > 1.2, f"drafts are rarely accepted: {accept}"
    last = _metrics(server)[-1]
    assert last["parallel_steps"] == 0 and last["coverage"] == 0, last
    assert last["steps"] > 0 and last["faults"] == 0, last


def _peak_on_workload(server: Server) -> tuple[int, list[list[int]]]:
    since = len(server.log_path.read_text(errors="replace"))
    params = {**GREEDY, "ignore_eos": True}
    out = server.generate({"text": [*PROMPTS, *LONG_PROMPTS], "sampling_params": params})
    return _peak_kv_tokens(server, since), [o["output_ids"] for o in out]


def test_peak_kv_no_higher_than_standalone(servers) -> None:
    """Runs last (two more server starts)."""
    minedraft, minedraft_ids = _peak_on_workload(servers("minedraft_constant"))
    assert _metrics(servers("minedraft_constant"))[-1]["coverage"] > 0.5
    standalone, standalone_ids = _peak_on_workload(servers("standalone_constant"))
    assert minedraft_ids == standalone_ids
    assert minedraft <= standalone, (minedraft, standalone)


def test_specblock_drafter_greedy_equals_baseline(servers, baseline_greedy) -> None:
    """The hosted SpecBlock drafter drafts from the target's features: drafts are accepted
    (a broken feature path drafts noise, accepted ~never), and output is the baseline's."""
    server = servers("minedraft_specblock")
    accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
    assert accept > 1.2, f"drafts are rarely accepted: {accept}"
    last = _metrics(server)[-1]
    assert last["coverage"] > 0.5 and last["faults"] == 0, last
    assert "(specblock " in server.tail(200000), "the draft server hosts another drafter"


def test_specblock_drafter_sampling_matches_target(servers, tiny_models) -> None:
    server = servers("minedraft_specblock")
    kwargs = dict(temperature=TEMPERATURE, num_samples=NUM_SAMPLES, alpha=ALPHA)
    assert_three_token_law(server, tiny_models["target"], SAMPLING_PROMPT_IDS, **kwargs)


def test_steps_cycle_greedy_equals_baseline(servers, baseline_greedy) -> None:
    """``--minedraft-steps cycle``: every number of drafts from 0 to the chain's, one step each.
    Steps at 0 are plain decode steps that wait for nothing from the draft server: its next
    job carries the tokens committed meanwhile and their features (stored by the plain step),
    or a plain step sends them unawaited (a request's first step: its prompt); drafts are
    still accepted on the steps that verify them, and output is the baseline's."""
    server = servers("minedraft_specblock_cycle")
    before = total(scrape(server), "sglang:spec_plain_steps_total", algorithm="MINEDRAFT")
    accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
    assert accept > 1.1, f"drafts are rarely accepted: {accept}"
    samples = scrape(server)
    assert total(samples, "sglang:spec_plain_steps_total", algorithm="MINEDRAFT") > before
    count = total(samples, "sglang:spec_chosen_k_count", algorithm="MINEDRAFT")
    mean_k = total(samples, "sglang:spec_chosen_k_sum", algorithm="MINEDRAFT") / max(count, 1)
    assert count > 0 and 1.0 < mean_k < 2.0, (count, mean_k)  # 0, 1, 2, 3 in turn
    last = _metrics(server)[-1]
    # a request whose first decode step is plain has its prompt sent then, unawaited
    assert last["faults"] == 0 and last["catch_ups"] > 0, last


def test_steps_cycle_sampling_matches_target(servers, tiny_models) -> None:
    server = servers("minedraft_specblock_cycle")
    kwargs = dict(temperature=TEMPERATURE, num_samples=NUM_SAMPLES, alpha=ALPHA)
    assert_three_token_law(server, tiny_models["target"], SAMPLING_PROMPT_IDS, **kwargs)
