"""A draft identical to the target agrees with it on every token, so it must accept (nearly)
the maximum: STANDALONE_FULL chain and full tree, and MINEDRAFT, on short prompts (where a draft
that misses token 0 loses most), on the shipped model and on a random-weight one.

The maximum accept length (bonus token included) is ``num_steps + 1`` for a chain; the
full tree verifies every proposed node (2 + 2 * 2 candidates), so the target's greedy path of
depth 2 is always in it. 5% slack covers argmax ties broken differently by a 1-token draft
forward and a multi-token verify forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_spec.models.registry import DEFAULT_TARGET
from tests.helpers.lossless import PROMPTS
from tests.helpers.server_utils import ServerPool

pytestmark = pytest.mark.server

MIN_SHARE = 0.95
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]  # fmt: skip
MINEDRAFT_CHAIN = ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4",
                   "--speculative-draft-device", "cpu:1", "--minedraft-steps", "fixed"]  # fmt: skip
FULL_TREE = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
             "--speculative-num-draft-tokens", "7"]  # fmt: skip
FIXED = ["--standalone-steps", "fixed"]
CASES = {  # name: (model, algorithm, shape, maximum accept length)
    # the fixed chain: the controller (the default) would rightly not draft with a draft that
    # costs what the target does
    "shipped_standalone_chain": ("shipped", "STANDALONE_FULL", [*CHAIN, *FIXED], 4),
    "shipped_standalone_tree": ("shipped", "STANDALONE_FULL", FULL_TREE, 3),
    "shipped_minedraft": ("shipped", "MINEDRAFT", MINEDRAFT_CHAIN, 4),
    "random_minedraft": ("random", "MINEDRAFT", MINEDRAFT_CHAIN, 4),
}


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    models = {"shipped": DEFAULT_TARGET, "random": str(tiny_models["target"])}
    args = {}
    for name, (model, algorithm, shape, _) in CASES.items():
        args[name] = ["--model-path", models[model], "--speculative-algorithm", algorithm,
                      "--speculative-draft-model-path", models[model], *shape]  # fmt: skip
    pool = ServerPool(args, Path(tmp_path_factory.mktemp("logs")))
    yield pool
    pool.close()


@pytest.mark.parametrize("name", list(CASES))
def test_identical_draft_accepts_the_maximum(servers, name: str) -> None:
    out = servers(name).generate(
        {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
    )
    accept = [o["meta_info"]["spec_accept_length"] for o in out]
    maximum = CASES[name][3]
    assert sum(accept) / len(accept) >= MIN_SHARE * maximum, accept
