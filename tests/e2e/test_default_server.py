"""`python -m sgl_spec.launch_server` with no model flags serves the shipped target with
speculative decoding (shipped draft) and continues held-out code plausibly.

Every server here starts as a user starts it (``preloaded=False``): a fresh launcher whose
scheduler SGLang *spawns*, so the spawn path of every algorithm is served and checked against
the greedy ids of the session's preloaded ``none`` server (``tests/helpers/preloaded.py``)."""

from __future__ import annotations

import re

import pytest

from tests.helpers.invalid_prompts import assert_invalid_prompts_rejected
from tests.helpers.server_utils import DEFAULT_POOL_ARGS, Server
from tests.helpers.shipped import shipped_greedy_request

HELD_OUT_PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return "
# A held-out prompt whose continuation the shipped draft predicts evenly from its first tokens
# (HELD_OUT_PROMPT's first dozen are mostly rejected: a controller may rightly run them plain
# and then wait out its probe interval, which says nothing about what it settled on).
EVEN_PROMPT = "import os\n\n\ndef list_files(root):\n    "


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    # No memory flags: the launcher sizes the KV pool (checked below).
    log = tmp_path_factory.mktemp("logs") / "default.log"
    server = Server(["--sleep-on-idle"], log, common=DEFAULT_POOL_ARGS, preloaded=False)
    yield server
    server.stop()


def test_default_server_speculates_on_shipped_models(default_server) -> None:
    """The default chain length is the controller's: a fresh server's first decode steps are
    plain (their times would mislead it), so the second request shows what it settled on; the
    greedy output is the same either way."""
    body = {"text": EVEN_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 64}}
    first = default_server.generate(body)
    out = default_server.generate(body)
    assert out["output_ids"] == first["output_ids"]
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0
    # Which chain length pays is the host's: on one CI host the controller settled on shorter
    # chains (accept 1.73) where this host runs 3 drafts (2.5-3.2). Most steps must draft.
    decode_lines = [ln for ln in default_server.tail(400).splitlines() if " k {" in ln]
    assert meta["spec_accept_length"] >= 1.5, (meta, decode_lines[-4:])
    text = out["text"]
    assert len(set(out["output_ids"])) > 5, text  # not a degenerate repetition
    assert any(ch.isalpha() for ch in text)


def test_spawned_default_server_equals_preloaded_none(default_server, shipped_greedy) -> None:
    """The spawned speculative server serves the greedy ids of the preloaded ``none`` server
    that most other modules compare with: both ways of starting a server serve the same."""
    out = default_server.generate(shipped_greedy_request())
    assert [o["output_ids"] for o in out] == shipped_greedy["prompts"]


def test_default_server_chat_template(default_server) -> None:
    import requests

    resp = requests.post(
        default_server.url + "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "print hello"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text


@pytest.mark.server
def test_invalid_prompts_rejected_server_keeps_serving(default_server) -> None:
    """STANDALONE (no flags): empty and out-of-vocabulary prompts get a 400, not a crash."""
    assert_invalid_prompts_rejected(default_server.url)


# What a default server may hold resident, all its processes together: the interpreter and
# libraries of the launcher, scheduler and detokenizer (about 1.1 GiB each), the weights, and
# the KV pool the launcher chose (with slack for allocator rounding).
FIXED_RSS_GIB = 4.5
POOL_RSS_SLACK = 1.25


@pytest.mark.server
def test_default_server_sizes_kv_pool_from_the_model(default_server) -> None:
    """No memory flag: the pool holds what the model and context need, not 72% of the host's
    RAM; the start-up log says what was chosen, the server uses it, and its processes stay
    under the stated bound."""
    import psutil
    import requests

    log = default_server.log_path.read_text(errors="replace")
    match = re.search(r"CPU KV pool: --max-total-tokens (\d+) .*?, ([\d.]+) GiB\)", log)
    assert match, log[-3000:]
    tokens, pool_gib = int(match.group(1)), float(match.group(2))
    info = requests.get(default_server.url + "/get_server_info", timeout=30).json()
    assert info["max_total_num_tokens"] == tokens
    root = psutil.Process(default_server.proc.pid)
    rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**30
    assert rss < FIXED_RSS_GIB + POOL_RSS_SLACK * pool_gib, (rss, pool_gib)


@pytest.fixture(scope="module")
def reference(default_server) -> dict:
    """The default server's greedy continuation of the held-out prompt; the server is then
    stopped (one server at a time on a small host)."""
    params = {"temperature": 0, "max_new_tokens": 64}
    out = default_server.generate({"text": HELD_OUT_PROMPT, "sampling_params": params})
    default_server.stop()
    return out


def _only_algorithm_flag(algorithm: str, log_path, *extra: str) -> dict:
    server = Server(["--speculative-algorithm", algorithm, *extra], log_path, preloaded=False)
    try:
        params = {"temperature": 0, "max_new_tokens": 64}
        return server.generate({"text": HELD_OUT_PROMPT, "sampling_params": params})
    finally:
        server.stop()


def test_specblock_needs_no_other_flag(reference, tmp_path) -> None:
    """`--speculative-algorithm SPECBLOCK` alone: the shipped target and the shipped SpecBlock
    drafter under the node-budget controller (the default), whose calibration drafts at every
    budget on a fresh server whatever the host (so drafts are accepted, if not as many as the
    fixed budget's); greedy output equals the (lossless) default server's."""
    log = tmp_path / "specblock.log"
    out = _only_algorithm_flag("SPECBLOCK", log, "--log-level", "info")  # (to see the budget)
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] > 1.0, out["meta_info"]
    assert "node budget per step (auto)" in log.read_text(errors="replace")


def test_minedraft_needs_no_other_flag(reference, tmp_path) -> None:
    """`--speculative-algorithm MINEDRAFT` alone: the shipped draft model in a draft server on
    its own core (cpu:1), under the controller (the default), whose calibration drafts on a
    fresh server whatever the host; greedy output equals the default server's, drafts are
    accepted."""
    out = _only_algorithm_flag("MINEDRAFT", tmp_path / "minedraft.log")
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] > 1.0, out["meta_info"]


def test_minedraft_hosting_specblock_needs_no_other_flag(reference, tmp_path) -> None:
    """`--minedraft-drafter specblock` on the shipped target: the shipped SpecBlock drafter in
    the draft server, fed the target's features; drafts accepted, greedy output unchanged."""
    log = tmp_path / "minedraft_specblock.log"
    # (--log-level info only to see which drafter the draft server hosts)
    out = _only_algorithm_flag(
        "MINEDRAFT", log, "--minedraft-drafter", "specblock", "--minedraft-steps", "fixed",
        "--log-level", "info",
    )  # fmt: skip
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] >= 1.5, out["meta_info"]
    assert "(specblock " in log.read_text(errors="replace")


def test_mtp_lora_with_its_shipped_adapter(reference, tmp_path) -> None:
    """`--speculative-algorithm MTP_LORA` on the shipped target and its shipped adapter, three
    mask tokens a step: drafts accepted, greedy output equals the default server's."""
    out = _only_algorithm_flag("MTP_LORA", tmp_path / "mtp_lora.log", "--mtp-k", "3")
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] >= 1.2, out["meta_info"]
