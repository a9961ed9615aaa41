"""Two ranks on the CPU engine through the public launcher, with no core binding given
(``SGLANG_CPU_OMP_THREADS_BIND`` unset: the launcher gives each rank its cores).

``--tp-size 2`` and ``--dp-size 2`` for ``none`` and STANDALONE_FULL (tiny models): the
speculative server's greedy ids equal the tp = 2 ``none`` server's and (sharded float sums
permitting, as on this tiny fp32 target) the one-rank server's; its T = 1 samples of tokens 1-2
follow the target's exact joint law. ``--tp-size 2`` and ``--dp-size 2`` for MTP_LORA,
SPECBLOCK and MINEDRAFT (shipped models): greedy-equal to the one-rank ``none`` server (both
replicas with dp = 2), and tokens 1-3 at T = 1 follow the law (2 500 samples a server or replica:
what these runs add to the one-rank law tests, which draw 6 000, is that ranks and replicas keep
the sampler's law, and the 27 cells still catch a departure of chi-square effect size ~0.12 at
least half the time). Pearson chi-square with a simulated null, alpha = 1e-4 per server: a
correct server fails 1 run in 10 000.

SGLang seeds every data-parallel replica with the same ``--random-seed``: two replicas given
the same batch draw the same samples (a round-robin batch comes back as identical pairs), so
with dp = 2 each replica's samples are drawn through ``routed_dp_rank`` and tested on their
own, at alpha / 2 each."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path
from tests.helpers.lossless import (
    PROMPTS,
    assert_speculative_sampling_law,
    chi_square_gof,
    joint_law,
    joint_two_token_law,
)
from tests.helpers.metrics import scrape, total
from tests.helpers.server_utils import COMMON_ARGS, Server, pick_port, tail
from tests.helpers.shipped import SHIPPED_PROMPTS, shipped_greedy_request

pytestmark = pytest.mark.server

ALPHA = 1e-4
NUM_SAMPLES = 6000
SAMPLING_PROMPT_IDS = [12, 40, 7, 99, 3]
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]  # fmt: skip


def _greedy(server: Server) -> list[list[int]]:
    out = server.generate(
        {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
    )
    return [o["output_ids"] for o in out]


def _sample_pairs(server: Server, rank: int | None) -> list[tuple[int, int]]:
    payload = {
        "input_ids": [SAMPLING_PROMPT_IDS] * NUM_SAMPLES,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True},
    }
    if rank is not None:
        payload["routed_dp_rank"] = rank
    out = server.generate(payload)
    assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in out), "token 2 must be verified"
    return [tuple(o["output_ids"][:2]) for o in out]


@pytest.mark.parametrize("flag", ["--tp-size", "--dp-size"])
def test_two_ranks_lossless(flag, tiny_models, baseline_greedy, tmp_path):
    """tp = 2 shards every layer (its ``none`` server is run too) and the chain's length is
    the controller's (``--standalone-steps auto``, the default), chosen on rank 0 for both;
    dp = 2 runs two replicas under SGLang's data-parallel controller, each with its own
    speculative state."""
    target = ["--model-path", str(tiny_models["target"]), flag, "2"]
    reference = baseline_greedy["short"]
    if flag == "--tp-size":
        server = Server(target, tmp_path / "none.log")
        try:
            reference = _greedy(server)
        finally:
            server.stop()
        assert reference == baseline_greedy["short"]
    spec = ["--speculative-algorithm", "STANDALONE_FULL",
            "--speculative-draft-model-path", str(tiny_models["draft"]), *CHAIN]  # fmt: skip
    server = Server([*target, *spec], tmp_path / "standalone_full.log")
    try:
        out = server.generate(
            {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
        )
        assert [o["output_ids"] for o in out] == reference
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
        ranks = [0, 1] if flag == "--dp-size" else [None]
        samples = {rank: _sample_pairs(server, rank) for rank in ranks}
    finally:
        server.stop()
    law = joint_two_token_law(tiny_models["target"], SAMPLING_PROMPT_IDS, 1.0, NUM_SAMPLES)
    for rank, pairs in samples.items():
        result = chi_square_gof(pairs, law)
        assert result.num_cells >= 10, "law too peaked for a meaningful test"
        assert result.p_value > ALPHA / len(ranks), (rank, result)


# MTP_LORA, SPECBLOCK and MINEDRAFT under --tp-size 2 and --dp-size 2, on the shipped target
# with their shipped adapter and drafters (a draft only agrees with the target it was trained for, so
# drafts are accepted)
SHIPPED_SAMPLING_PROMPT = "def __init__(self"
SHIPPED_TEMPERATURE = 1.0
SHIPPED_NUM_SAMPLES = 2500
TWO_RANK_ALGORITHMS = {
    "MTP_LORA": ["--mtp-k", "3", "--max-running-requests", "256"],
    "SPECBLOCK": [
        "--specblock-budget",
        "fixed",
        "--specblock-ngram",
        "8",
        "--max-running-requests",
        "256",
    ],
    "MINEDRAFT": ["--minedraft-steps", "fixed", "--max-running-requests", "256"],
}


def _shipped_greedy(server: Server, rank: int | None) -> list[dict]:
    body = shipped_greedy_request()
    return server.generate(body if rank is None else {**body, "routed_dp_rank": rank})


@pytest.fixture(scope="module")
def shipped_reference(shipped_greedy) -> dict:
    """The one-rank ``none`` server's greedy ids on the shipped target (the session's), and
    the target's exact law of completion tokens 1-3 for the sampling prompt."""
    from transformers import AutoTokenizer

    target = resolve_model_path(DEFAULT_TARGET)
    ids = AutoTokenizer.from_pretrained(target)(SHIPPED_SAMPLING_PROMPT)["input_ids"]
    law = joint_law(target, ids, SHIPPED_TEMPERATURE, SHIPPED_NUM_SAMPLES, 3)
    return {"greedy": shipped_greedy["prompts"], "ids": ids, "law": law}


@pytest.mark.parametrize("flag", ["--tp-size", "--dp-size"])
@pytest.mark.parametrize("algorithm", sorted(TWO_RANK_ALGORITHMS))
def test_our_algorithms_on_two_ranks_lossless(algorithm, flag, shipped_reference, tmp_path):
    """tp = 2: both ranks run the step rank 0's controller chose on their shard (MTP_LORA's
    LoRA path sharded like its base layers, SPECBLOCK's drafter replicated and its n-gram
    branch's choice to skip it rank 0's, MINEDRAFT's one
    draft server driven by rank 0, which shares its drafts); dp = 2: each replica builds its
    own worker and speculative state (MINEDRAFT: its own draft server). Either serves the
    one-rank ``none`` server's greedy ids (the workers' accepted drafts reach the one
    ``/metrics``, counted once per step), and its samples of tokens 1-3 follow the target's
    law (with dp = 2 each replica's, drawn apart on both at once, at alpha / 2 each)."""
    args = ["--model-path", DEFAULT_TARGET, flag, "2",
            "--speculative-algorithm", algorithm, *TWO_RANK_ALGORITHMS[algorithm]]  # fmt: skip
    server = Server([*args, "--enable-metrics"], tmp_path / f"{algorithm}.log")
    ranks = (0, 1) if flag == "--dp-size" else (None,)
    try:
        accepted = "sglang:spec_position_accepted_total"
        before = total(scrape(server), accepted, algorithm=algorithm)
        verify_ct = drafts_in_responses = 0
        for rank in ranks:
            out = _shipped_greedy(server, rank)
            assert [o["output_ids"] for o in out] == shipped_reference["greedy"], rank
            for o in out:
                meta = o["meta_info"]
                verify_ct += meta["spec_verify_ct"]
                drafts_in_responses += meta["completion_tokens"] - 1 - meta["spec_verify_ct"]
        # accepted drafts at least those in the responses (a last step may accept drafts past
        # max_new_tokens that SGLang drops: at most one tree's depth per request)
        grown = total(scrape(server), accepted, algorithm=algorithm) - before
        slack = 16 * len(ranks) * len(SHIPPED_PROMPTS)
        assert verify_ct > 0 and 0 < drafts_in_responses <= grown <= drafts_in_responses + slack
        if algorithm == "MINEDRAFT":  # one draft server per replica, none per extra tensor rank
            assert server.draft_servers() == len(ranks)

        def law_of(rank: int | None) -> None:
            assert_speculative_sampling_law(
                server,
                shipped_reference["ids"],
                shipped_reference["law"],
                temperature=SHIPPED_TEMPERATURE,
                num_samples=SHIPPED_NUM_SAMPLES,
                alpha=ALPHA / len(ranks),
                min_cells=20,
                payload={} if rank is None else {"routed_dp_rank": rank},
            )

        with ThreadPoolExecutor(len(ranks)) as pool:
            list(pool.map(law_of, ranks))
    finally:
        server.stop()


@pytest.mark.parametrize("algorithm", ["none", "STANDALONE_FULL"])
def test_two_nodes_over_loopback(algorithm, tiny_models, baseline_greedy, tmp_path):
    """``--tp-size 2`` over two node processes of this host (``--nnodes 2``, ``--node-rank
    0|1``, ``--dist-init-addr`` on loopback), one core each: SGLang's multi-node path with the
    plugin in every node's schedulers serves the one-rank server's greedy ids."""
    flags = [*COMMON_ARGS, "--model-path", str(tiny_models["target"]), "--tp-size", "2",
             "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{pick_port()}"]  # fmt: skip
    if algorithm != "none":
        flags += ["--speculative-algorithm", algorithm,
                  "--speculative-draft-model-path", str(tiny_models["draft"]), *CHAIN]  # fmt: skip
    bind = "SGLANG_CPU_OMP_THREADS_BIND"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two node processes need a core each")
    follower = Server(
        [*flags, "--node-rank", "1"], tmp_path / "node1.log", common=[],
        env={bind: str(cores[1])}, wait=False,
    )  # fmt: skip
    try:
        try:
            leader = Server(
                [*flags, "--node-rank", "0"], tmp_path / "node0.log", common=[],
                env={bind: str(cores[0])},
            )  # fmt: skip
        except Exception as exc:
            raise AssertionError(f"node 1's log:\n{tail(follower.log_path)}") from exc
        try:
            out = leader.generate(
                {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
            )
            assert follower.proc.poll() is None, "node 1 exited while serving"
        finally:
            leader.stop()
    finally:
        # a node-rank >= 1 process ignores SIGTERM (SGLang waits for its leader): kill it
        if follower.proc.poll() is None:
            os.killpg(follower.proc.pid, signal.SIGKILL)
        follower.stop()
    assert [o["output_ids"] for o in out] == baseline_greedy["short"]
    if algorithm != "none":
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
