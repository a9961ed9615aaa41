"""`python -m sgl_spec.launch_server` with no model flags serves the shipped target with
speculative decoding (shipped draft) and continues held-out code plausibly."""

from __future__ import annotations

import pytest

from tests.helpers.invalid_prompts import assert_invalid_prompts_rejected
from tests.helpers.server_utils import Server

HELD_OUT_PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return "


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = Server([], tmp_path_factory.mktemp("logs") / "default.log")
    yield server
    server.stop()


def test_default_server_speculates_on_shipped_models(default_server) -> None:
    out = default_server.generate(
        {"text": HELD_OUT_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 64}}
    )
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] >= 1.8, meta
    text = out["text"]
    assert len(set(out["output_ids"])) > 5, text  # not a degenerate repetition
    assert any(ch.isalpha() for ch in text)


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


@pytest.fixture(scope="module")
def reference(default_server) -> dict:
    """The default server's greedy continuation of the held-out prompt; the server is then
    stopped (one server at a time on a small host)."""
    params = {"temperature": 0, "max_new_tokens": 64}
    out = default_server.generate({"text": HELD_OUT_PROMPT, "sampling_params": params})
    default_server.stop()
    return out


def _only_algorithm_flag(algorithm: str, log_path, *extra: str) -> dict:
    server = Server(["--speculative-algorithm", algorithm, *extra], log_path)
    try:
        params = {"temperature": 0, "max_new_tokens": 64}
        return server.generate({"text": HELD_OUT_PROMPT, "sampling_params": params})
    finally:
        server.stop()


def test_specblock_needs_no_other_flag(reference, tmp_path) -> None:
    """`--speculative-algorithm SPECBLOCK` alone: the shipped target and the shipped SpecBlock
    drafter, whose drafts are accepted; greedy output equals the (lossless) default server's."""
    out = _only_algorithm_flag("SPECBLOCK", tmp_path / "specblock.log")
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] >= 1.5, out["meta_info"]


def test_minedraft_needs_no_other_flag(reference, tmp_path) -> None:
    """`--speculative-algorithm MINEDRAFT` alone: the shipped draft model in a draft server on
    its own core (cpu:1); greedy output equals the default server's, drafts are accepted."""
    out = _only_algorithm_flag("MINEDRAFT", tmp_path / "minedraft.log")
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] >= 1.5, out["meta_info"]


def test_minedraft_hosting_specblock_needs_no_other_flag(reference, tmp_path) -> None:
    """`--minedraft-drafter specblock` on the shipped target: the shipped SpecBlock drafter in
    the draft server, fed the target's features; drafts accepted, greedy output unchanged."""
    log = tmp_path / "minedraft_specblock.log"
    # (--log-level info only to see which drafter the draft server hosts)
    out = _only_algorithm_flag(
        "MINEDRAFT", log, "--minedraft-drafter", "specblock", "--log-level", "info"
    )
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["spec_accept_length"] >= 1.5, out["meta_info"]
    assert "(specblock " in log.read_text(errors="replace")
