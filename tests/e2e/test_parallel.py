"""Two ranks on the CPU engine through the public launcher, ``--tp-size 2`` and
``--dp-size 2`` with no core binding given (``SGLANG_CPU_OMP_THREADS_BIND`` unset: the launcher
gives each rank its cores), for ``none`` and STANDALONE_FULL. Lossless with two ranks: the
speculative server's greedy ids equal the tp = 2 ``none`` server's and (sharded float sums
permitting, as on this tiny fp32 target) the one-rank server's; its T = 1 samples of tokens
1-2 follow the target's exact joint law (Pearson chi-square with a simulated null,
alpha = 1e-4 per server: a correct server fails 1 run in 10 000).

SGLang seeds every data-parallel replica with the same ``--random-seed``: two replicas given
the same batch draw the same samples (a round-robin batch comes back as identical pairs), so
with dp = 2 each replica's samples are drawn through ``routed_dp_rank`` and tested on their
own, at alpha / 2 each."""

from __future__ import annotations

import pytest

from tests.helpers.lossless import PROMPTS, chi_square_gof, joint_two_token_law
from tests.helpers.server_utils import Server

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
    """tp = 2 shards every layer (its ``none`` server is run too); dp = 2 runs two replicas
    under SGLang's data-parallel controller, each with its own speculative state."""
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
