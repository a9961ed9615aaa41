"""Tensor parallelism on the CPU engine through the public launcher: ``--tp-size 2`` with no
core binding given (``SGLANG_CPU_OMP_THREADS_BIND`` unset: the launcher gives each rank its cores), for ``none`` and STANDALONE_FULL.
Lossless at tp = 2: the speculative server's greedy ids equal the tp = 2 ``none`` server's,
and (sharded float sums permitting, as on this tiny fp32 target) the tp = 1 server's."""

from __future__ import annotations

import pytest

from tests.helpers.lossless import PROMPTS
from tests.helpers.server_utils import Server

pytestmark = pytest.mark.server


def _greedy(args: list[str], log) -> list[list[int]]:
    server = Server([*args, "--tp-size", "2"], log)
    try:
        out = server.generate(
            {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
        )
        if "--speculative-algorithm" in args:
            assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)
        return [o["output_ids"] for o in out]
    finally:
        server.stop()


def test_tp2_none_and_standalone_full_greedy_equal(tiny_models, baseline_greedy, tmp_path):
    target = ["--model-path", str(tiny_models["target"])]
    none_tp2 = _greedy(target, tmp_path / "none_tp2.log")
    spec = ["--speculative-algorithm", "STANDALONE_FULL", "--speculative-draft-model-path",
            str(tiny_models["draft"]), "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    spec_tp2 = _greedy([*target, *spec], tmp_path / "standalone_full_tp2.log")
    assert spec_tp2 == none_tp2
    assert none_tp2 == baseline_greedy["short"]
