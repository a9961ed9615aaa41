"""The surfaces users drive SGLang through, on every algorithm: for greedy requests each returns
what the non-speculative server (``none``) returns.

Shipped models, each algorithm with the benchmark's flags (``_bench_lib.server_flags``; the
launcher fills in the shipped draft, adapter or drafter). Through each surface:

(a) an SGLang frontend program (``sgl.function``: ``gen`` at temperature 0, ``select`` among
    choices, a ``fork`` into two ``gen`` branches) run against ``RuntimeEndpoint``;
(b) the ``openai`` client: chat and text completions, each streamed and not;
(c) one ``sglang.bench_serving`` run (offline ``random-ids``, a few prompts all in flight at
    once): every request completes, with ``none``'s texts;
(d) ``/flush_cache`` after that traffic, then the ``openai`` outputs again.

``none``'s results are recorded first, then each algorithm's server is started once and every
surface compared (one server alive at a time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _bench_lib import server_flags

from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path
from tests.helpers.server_utils import (
    Server,
    ServerPool,
    finish_bench_serving,
    start_bench_serving,
)

pytestmark = pytest.mark.server

SPECULATIVE = ("standalone", "mtp_lora", "specblock", "minedraft")
MAX_TOKENS = 16
PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return "
CHOICES = ["list", "string", "dict"]
CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]
BENCH_PROMPTS = 4


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    flags = ["--model-path", DEFAULT_TARGET]
    pool = ServerPool(
        {name: server_flags(name, flags) for name in ("none", *SPECULATIVE)},
        tmp_path_factory.mktemp("surfaces_logs"),
    )
    yield pool
    pool.close()


def frontend_program(server: Server) -> dict:
    """``gen`` -> ``select`` -> ``fork`` into two ``gen`` branches, one program run."""
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    @sgl.function
    def program(s, prompt: str):
        s += prompt + sgl.gen("body", max_tokens=MAX_TOKENS, temperature=0)
        s += "\n# returns a " + sgl.select("kind", choices=CHOICES)
        branches = s.fork(2)
        for branch, head in zip(branches, ("\n\ndef ", "\n\nclass "), strict=True):
            branch += head + sgl.gen("branch", max_tokens=MAX_TOKENS, temperature=0)
        branches.join()
        return [branch.error() for branch in branches]

    state = program.run(PROMPT, backend=RuntimeEndpoint(server.url))
    assert state.error() is None and state.ret_value == [None, None], (
        state.error(),
        state.ret_value,
    )
    return {
        "body": state["body"],
        "kind": state["kind"],
        "branch": state["branch"],
        "kind_logprobs": state.get_meta_info("kind")["normalized_prompt_logprobs"],
        "body_verify_ct": state.get_meta_info("body").get("spec_verify_ct", 0),
    }


def openai_outputs(server: Server) -> dict:
    """Chat and text completions, streamed and not: ``(text, finish_reason)`` of each."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)
    common = {"model": "default", "max_tokens": MAX_TOKENS, "temperature": 0}
    chat = client.chat.completions.create(messages=CHAT, **common)
    text = client.completions.create(prompt=PROMPT, **common)
    outputs = {
        "chat": (chat.choices[0].message.content, chat.choices[0].finish_reason),
        "completions": (text.choices[0].text, text.choices[0].finish_reason),
    }
    assert chat.usage.completion_tokens > 0 and text.usage.completion_tokens > 0
    pieces, finish = [], None
    for chunk in client.chat.completions.create(messages=CHAT, stream=True, **common):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    outputs["chat_stream"] = ("".join(pieces), finish)
    pieces, finish = [], None
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **common):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    outputs["completions_stream"] = ("".join(pieces), finish)
    return outputs


def bench_serving(server: Server, out_dir: Path) -> dict:
    """One ``sglang.bench_serving`` run, every prompt in flight at once; its per-request details."""
    out = out_dir / "bench.jsonl"
    tokenizer = Path(resolve_model_path(DEFAULT_TARGET))
    proc = start_bench_serving(
        server, tokenizer, out, num_prompts=BENCH_PROMPTS, concurrency=BENCH_PROMPTS, length=16
    )
    result = finish_bench_serving(proc, out, timeout=600)
    assert result["completed"] == BENCH_PROMPTS, result["completed"]
    assert not any(result["errors"]), result["errors"]
    return result


@pytest.fixture(scope="module")
def expected(servers, tmp_path_factory) -> dict:
    """``none``'s results on every surface, recorded before any speculative server starts."""
    server = servers("none")
    results = {
        "frontend": frontend_program(server),
        "openai": openai_outputs(server),
        "bench": bench_serving(server, tmp_path_factory.mktemp("bench_none")),
    }
    frontend = results["frontend"]
    # something to compare: text came out, and select's choices are told apart by a margin
    assert frontend["body"] and all(frontend["branch"]), frontend
    top, second = sorted(frontend["kind_logprobs"], reverse=True)[:2]
    assert top - second > 1e-2, frontend["kind_logprobs"]
    assert all(text for text, _ in results["openai"].values()), results["openai"]
    assert all(results["bench"]["generated_texts"]), results["bench"]
    return results


@pytest.fixture(scope="module", params=SPECULATIVE)
def algorithm(request) -> str:
    """One algorithm at a time: pytest runs every test of one before the next's server starts."""
    return request.param


def test_frontend_program(servers, expected, algorithm: str) -> None:
    got = frontend_program(servers(algorithm))
    want = expected["frontend"]
    assert got["body_verify_ct"] > 0, f"{algorithm} did not speculate: {got}"
    assert (got["body"], got["kind"], got["branch"]) == (want["body"], want["kind"], want["branch"])
    # select ranks the choices by prefill logprobs: the target's, whatever the algorithm
    assert got["kind_logprobs"] == pytest.approx(want["kind_logprobs"], abs=1e-3)


def test_openai_client(servers, expected, algorithm: str) -> None:
    got = openai_outputs(servers(algorithm))
    assert got == expected["openai"]
    assert got["chat_stream"] == got["chat"] and got["completions_stream"] == got["completions"]


def test_bench_serving(servers, expected, algorithm: str, tmp_path) -> None:
    got = bench_serving(servers(algorithm), tmp_path)
    assert got["generated_texts"] == expected["bench"]["generated_texts"]
    assert got["output_lens"] == expected["bench"]["output_lens"]


def test_flush_cache_keeps_the_outputs(servers, expected, algorithm: str) -> None:
    """SGLang's ``/flush_cache`` (bench_serving's ``--flush-cache``; it empties the radix
    cache and the KV pools, and calls the draft worker's ``clear_cache_pool``) after this
    server's traffic: it succeeds, and the outputs after it are still ``none``'s."""
    import requests

    server = servers(algorithm)
    resp = requests.post(server.url + "/flush_cache", params={"timeout": 60}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert openai_outputs(server) == expected["openai"]
