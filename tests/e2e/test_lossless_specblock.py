"""Lossless harness applied to SPECBLOCK (block-iterative drafter, rank-guided trees).

The drafter is trained in the session for the tiny random target (``tiny_models.
train_specblock_drafter``, ~200 steps on the target's own greedy continuations), so drafts are
really accepted and the acceptance branch of the verifier is exercised; losslessness does not
depend on the drafter's quality.

(a) greedy: SPECBLOCK returns the non-speculative server's token ids for prompts sent
    concurrently (one batched request, and separate requests arriving together), with trees of
    up to 16 nodes from M = 2 blocks, with the node budget changing every step (cycle) and
    chosen by the speculation controller (auto);
(c) adaptation on (``--specblock-adapt``, paper §3.4, with tiny warm-up and buffers so updates
    really reach the serving drafter within the test): greedy output still equals the
    non-speculative server's, before and after updates were applied; this server's trees hold
    at most 5 nodes, fewer than the depth M*K + 1 (a budget that once crashed the worker).
(b) sampling: the joint law of completion tokens 1-3 at temperature 1 matches the target's exact
    law; tokens 2 and 3 are verified against tree drafts (the first decode step already has a
    tree, drafted from the prefill), on a server whose node budget changes every step
    (``--specblock-budget cycle``: 1 to 16 nodes, the root alone included). Pearson chi-square with a simulated null, alpha = 1e-4
    (false-positive rate 0.01% per run), the method of ``test_lossless_standalone.py``.
(d) the n-gram branch (``--specblock-ngram``): greedy and the same sampling law with SGLang's
    n-gram corpus drafts merged into the trees, budgets cycling.
"""

from __future__ import annotations

import pytest

from tests.helpers.invalid_prompts import assert_invalid_prompts_rejected
from tests.helpers.lossless import (
    LONG_PROMPTS,
    PROMPTS,
    assert_compiled_forwards_served,
    assert_greedy_under_concurrent_load,
    assert_speculative_sampling_law,
    joint_law,
)
from tests.helpers.metrics import check_spec_metrics, decode_log_suffixes, scrape, total
from tests.helpers.server_utils import Server, ServerPool

ALPHA = 1e-4
NUM_SAMPLES = 6000
TEMPERATURE = 1.0
SAMPLING_PROMPT_IDS = [12, 40, 7, 99, 3]


@pytest.fixture(scope="module")
def drafter(tiny_specblock_drafter):
    return tiny_specblock_drafter


def _specblock_args(target, drafter, max_nodes: int = 16, budget: str = "fixed") -> list[str]:
    """A budget of ``max_nodes`` every step unless ``budget`` says otherwise (the default,
    auto, may rightly keep drafting off on this host: these tests need drafted steps)."""
    return [
        "--model-path", str(target),
        "--speculative-algorithm", "SPECBLOCK",
        "--specblock-drafter-path", str(drafter),
        "--specblock-m", "2",
        "--specblock-max-nodes", str(max_nodes),
        "--specblock-budget", budget,
        # Each request reserves 2 x 16 KV slots per step; bound the 6000-request batch.
        "--max-running-requests", "256",
        "--log-level", "info",
        "--enable-metrics",
        "--decode-log-interval", "5",
    ]  # fmt: skip


# Tiny adaptation settings: an update after 2 warm-up queries and one routed query.
ADAPT_OPTIONS = "warmup_queries=2,measure_queries=2,buffer_queries=1,window=8,steps_per_update=1"


@pytest.fixture(scope="module")
def servers(tiny_models, drafter, tmp_path_factory):
    args = _specblock_args(tiny_models["target"], drafter)
    # A node budget below the depth M*K + 1 (here 5 < 7): SGLang's accepted path must still fit
    # the verify width (it once crashed the first decode step).
    small = _specblock_args(tiny_models["target"], drafter, max_nodes=5)
    adapt = [*small, "--specblock-adapt", "--specblock-adapt-options", ADAPT_OPTIONS]
    pool = ServerPool(
        {
            "specblock": args,
            "specblock_adapt": adapt,
            "specblock_cycle": _specblock_args(tiny_models["target"], drafter, budget="cycle"),
            "specblock_auto": _specblock_args(tiny_models["target"], drafter, budget="auto"),
            # the drafter's trees merged with SGLang's n-gram corpus drafts, every budget in turn
            "specblock_ngram": [
                *_specblock_args(tiny_models["target"], drafter, budget="cycle"),
                "--specblock-ngram",
                "8",
            ],
            # every budget's tree verify and the plain decode compiled at start-up for the
            # batch sizes of assert_greedy_under_concurrent_load
            "specblock_compiled": [
                *_specblock_args(tiny_models["target"], drafter, budget="cycle"),
                "--enable-torch-compile",
                "--cuda-graph-bs-decode",
                str(len(LONG_PROMPTS)),
                str(len(PROMPTS)),
            ],
        },
        tmp_path_factory.mktemp("specblock_logs"),
    )
    yield pool
    pool.close()


def test_greedy_equals_baseline_under_concurrent_load(servers, baseline_greedy) -> None:
    server = servers("specblock")
    accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
    assert accept > 1.2, f"trained drafter's trees are rarely accepted: {accept}"


def test_metrics_logged_and_bad_request_keeps_serving(servers) -> None:
    server: Server = servers("specblock")
    server.check_bad_request_keeps_serving()
    lines = [line for line in server.tail(400).splitlines() if "SPECBLOCK: steps=" in line]
    assert lines, server.tail()
    for key in ("mean_accept_length=", "drafter_forwards_per_iter=", "T_D%=", "alpha_k=["):
        assert key in lines[-1]


def test_prometheus_metrics_match_responses(servers) -> None:
    """SGLang's spec gauges and ours (per-position acceptance, step times, tree sizes) after
    traffic agree with the responses' meta_info; the decode log line carries our figures."""
    server: Server = servers("specblock")
    after = check_spec_metrics(server, "SPECBLOCK", PROMPTS[:4], max_drafts=8)
    trees = total(after, "sglang:spec_tree_size_count", algorithm="SPECBLOCK")
    assert trees > 0
    assert decode_log_suffixes(server, "SPECBLOCK"), server.tail()


@pytest.mark.server
def test_invalid_prompts_rejected_server_keeps_serving(servers) -> None:
    """SPECBLOCK: empty and out-of-vocabulary prompts get a 400, not a crash."""
    assert_invalid_prompts_rejected(servers("specblock").url)


# The servers whose node budget changes from step to step (one server alive at a time: the
# tests are grouped by server).


def test_greedy_equals_baseline_when_cycling_budgets(servers, baseline_greedy) -> None:
    accept = assert_greedy_under_concurrent_load(servers("specblock_cycle"), baseline_greedy)
    assert accept > 1.1, f"trained drafter's trees are rarely accepted: {accept}"  # 1/5 no drafts


def test_budget_switches_every_step_when_cycling(servers) -> None:
    """``--specblock-budget cycle`` ran every budget (1, 2, 4, 8, 16 nodes: 0-15 drafts)."""
    server = servers("specblock_cycle")
    server.generate({"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 24}})
    samples = scrape(server)
    name = "sglang:spec_chosen_k_bucket"
    below = [total(samples, name, algorithm="SPECBLOCK", le=f"{d}.0") for d in (0, 1, 3, 7, 15)]
    # cumulative buckets: each budget's steps raise the count from the one below
    assert all(b > a for a, b in zip([0.0, *below], below, strict=False)), below


def _assert_sampling_law(server: Server, tiny_models) -> None:
    """The joint law of completion tokens 1-3 at temperature 1 is the target's (module doc)."""
    law = joint_law(tiny_models["target"], SAMPLING_PROMPT_IDS, TEMPERATURE, NUM_SAMPLES, 3)
    assert_speculative_sampling_law(
        server,
        SAMPLING_PROMPT_IDS,
        law,
        temperature=TEMPERATURE,
        num_samples=NUM_SAMPLES,
        alpha=ALPHA,
        min_cells=10,
    )


def test_sampling_matches_target(servers, tiny_models) -> None:
    """On the cycling server: each batch's first decode step (tokens 2-3) runs another node
    budget, the root alone (no drafts) included, and a request's tokens 2 and 3 may come from
    steps of different budgets."""
    _assert_sampling_law(servers("specblock_cycle"), tiny_models)


def test_compiled_greedy_equals_baseline(servers, baseline_greedy) -> None:
    """``--enable-torch-compile``: the target's tree verify of every node budget and its plain
    decode, compiled at start-up (``common/compiled_forwards.py``; the tree mask's length
    follows the requests'), serve the baseline's tokens, each on its graph."""
    server = servers("specblock_compiled")
    assert_greedy_under_concurrent_load(server, baseline_greedy)
    bs = len(PROMPTS)
    labels = [f"target: target_verify (tree) bs={bs} n={n}" for n in (2, 4, 8, 16)]
    labels.append(f"target: decode bs={bs} n=1")
    assert_compiled_forwards_served(server.log_path.read_text(), labels)


def test_greedy_equals_baseline_with_controller_budgets(servers, baseline_greedy) -> None:
    """``--specblock-budget auto``: whatever budgets the controller picks (it may rightly keep
    drafting off on this host), outputs are the non-speculative server's."""
    server = servers("specblock_auto")
    assert_greedy_under_concurrent_load(server, baseline_greedy)
    # its first steps run without drafts (T(0) is measured first), and every chosen step
    # reports what the controller expected
    samples = scrape(server)
    assert total(samples, "sglang:spec_plain_steps_total", algorithm="SPECBLOCK") > 0
    for name in ("sglang:spec_predicted_accept_length", "sglang:spec_realised_accept_length"):
        assert total(samples, name, algorithm="SPECBLOCK") >= 1.0, name
    assert any("pred/real tokens" in x for x in decode_log_suffixes(server, "SPECBLOCK"))


def test_greedy_equals_baseline_with_ngram_branch(servers, baseline_greedy) -> None:
    """``--specblock-ngram 8``: the n-gram corpus's trees merged into the drafter's (and steps
    that verify them alone, where the branch expects those to pay more) serve the baseline's
    tokens; twice, the second time with every prompt and output already in the corpus."""
    server = servers("specblock_ngram")
    for _ in range(2):
        accept = assert_greedy_under_concurrent_load(server, baseline_greedy)
        assert accept > 1.1, f"trees are rarely accepted: {accept}"
    lines = [x for x in server.tail(4000).splitlines() if "SPECBLOCK: steps=" in x]
    assert lines and "ngram_rate=" in lines[-1], server.tail()
    failures = [x for x in server.tail(4000).splitlines() if "n-gram branch failed" in x]
    assert not failures, "\n".join(failures)


def test_sampling_matches_target_with_ngram_branch(servers, tiny_models) -> None:
    """The same law as ``test_sampling_matches_target`` with n-gram nodes in the trees: the
    verify is the target's alone, whoever proposed the nodes."""
    _assert_sampling_law(servers("specblock_ngram"), tiny_models)


def _adapt_counts(server: Server) -> list[int]:
    lines = [x for x in server.tail(4000).splitlines() if "SPECBLOCK: steps=" in x]
    return [int(x.split("adapt_updates=")[1].split()[0]) for x in lines if "adapt_updates=" in x]


def test_greedy_equals_baseline_with_adaptation(servers, baseline_greedy) -> None:
    """Runs last (one server start): requests one at a time so each is a finished query, then
    again once updates were applied."""
    server = servers("specblock_adapt")
    params = {"temperature": 0, "max_new_tokens": 48}
    prompts = [*PROMPTS, *LONG_PROMPTS]
    expected = [*baseline_greedy["short"], *baseline_greedy["long"]]
    first = [server.generate({"text": p, "sampling_params": params}) for p in prompts]
    assert [o["output_ids"] for o in first] == expected
    counts = _adapt_counts(server)
    assert counts and counts[-1] >= 1, f"no adaptation update was applied:\n{server.tail()}"
    updates = total(scrape(server), "sglang:spec_adapt_updates_total", algorithm="SPECBLOCK")
    assert updates >= 1
    second = [server.generate({"text": p, "sampling_params": params}) for p in prompts]
    assert [o["output_ids"] for o in second] == expected
    # Our own failure paths log "SPECBLOCK...failed" and carry on (adaptation must never fail a
    # request); none may have fired. (SGLang's start-up logs a benign warm-up traceback.)
    failures = [x for x in server.tail(4000).splitlines() if "SPECBLOCK" in x and "failed" in x]
    assert not failures, "\n".join(failures)
