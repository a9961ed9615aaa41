"""A fourth algorithm is its own folder plus one registry entry: ``tests/toy_algorithm``
(TOY_LOOKUP, a chain of tokens looked up in the request's own sequence, on
``sgl_spec.common.chain_worker``) is named in ``SGLSPEC_EXTRA_ALGORITHMS`` and nothing else, then
launched through the public launcher, served, and checked greedy-equal to the non-speculative
server with its own flag and ``sglang:spec_*`` metrics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sgl_spec.algorithm_list import EXTRA_ENV
from tests.helpers.lossless import PROMPTS
from tests.helpers.metrics import check_spec_metrics
from tests.helpers.server_utils import Server

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]


def test_toy_algorithm_registers_launches_and_serves_greedy_equal(
    tiny_models, baseline_greedy, tmp_path
) -> None:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {EXTRA_ENV: "tests.toy_algorithm", "PYTHONPATH": path}
    args = ["--model-path", str(tiny_models["target"]), "--speculative-algorithm", "TOY_LOOKUP",
            "--toy-drafts", "4", "--enable-metrics"]  # fmt: skip
    server = Server(args, tmp_path / "toy.log", env=env)
    try:
        out = server.generate(
            {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
        )
        assert [o["output_ids"] for o in out] == baseline_greedy["short"]
        meta = [o["meta_info"] for o in out]
        assert all(m["spec_verify_ct"] > 0 for m in meta)
        # the random target repeats itself, so looked-up drafts are accepted
        assert max(m["spec_accept_length"] for m in meta) > 1.0, meta
        check_spec_metrics(server, "TOY_LOOKUP", PROMPTS, max_drafts=4)
    finally:
        server.stop()
