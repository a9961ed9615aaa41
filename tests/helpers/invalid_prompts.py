"""Prompts the model cannot run (empty, ids outside the vocabulary) sent to a running server:
each gets a 400 naming the reason (``sgl_spec.patches.prompt_validation``), and the
server keeps serving with unchanged greedy output. Before the patch each crashed the scheduler
and took the server down."""

from __future__ import annotations

import json
import re

import requests

PROMPT = "def add(a, b):\n    return "
GREEDY = {"temperature": 0, "max_new_tokens": 12}
BIG_ID = 10**6  # past any vocabulary
EMPTY = r"the prompt is empty \(0 tokens\)"
OUT_OF_VOCAB = rf"input_ids contains {BIG_ID}, outside the vocabulary \[0, \d+\)"
NEGATIVE = r"input_ids contains -1, outside the vocabulary \[0, \d+\)"

# (endpoint, JSON body, pattern the error message must match). A batch with one bad element
# fails as a whole, as SGLang's own too-long prompt does.
_COMPLETION = {"model": "default", "max_tokens": 4, "temperature": 0}
REJECTED = [
    ("/generate", {"text": "", "sampling_params": GREEDY}, EMPTY),
    ("/generate", {"input_ids": [1, 2, BIG_ID], "sampling_params": GREEDY}, OUT_OF_VOCAB),
    ("/generate", {"input_ids": [-1, 2], "sampling_params": GREEDY}, NEGATIVE),
    ("/generate", {"text": [PROMPT, ""], "sampling_params": GREEDY}, EMPTY),
    ("/generate", {"input_ids": [[1, 2], [1, BIG_ID]], "sampling_params": GREEDY}, OUT_OF_VOCAB),
    ("/v1/completions", {**_COMPLETION, "prompt": ""}, "Prompt cannot be empty"),  # SGLang's
    ("/v1/completions", {**_COMPLETION, "prompt": ["x", ""]}, EMPTY),
    ("/v1/completions", {**_COMPLETION, "prompt": [1, BIG_ID]}, OUT_OF_VOCAB),
    ("/v1/completions", {**_COMPLETION, "prompt": [1, BIG_ID], "stream": True}, OUT_OF_VOCAB),
]


def _error_message(resp: requests.Response) -> str:
    body = resp.json()
    error = body.get("error", body)  # /generate: {"error": {...}}; OpenAI: the error itself
    return error["message"] if isinstance(error, dict) else str(error)


def _greedy_ids(url: str) -> list[int]:
    resp = requests.post(
        url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=300
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _streamed_error(url: str) -> dict:
    """A streamed /generate answers 200 before tokenizing: SGLang reports its validation
    errors (its own too-long prompt too) as the stream's first event, then ``[DONE]``."""
    payload = {"text": "", "sampling_params": GREEDY, "stream": True}
    resp = requests.post(url + "/generate", json=payload, timeout=60)
    events = [x[len("data: ") :] for x in resp.text.splitlines() if x.startswith("data: ")]
    assert events and events[-1] == "[DONE]", resp.text
    return json.loads(events[0])["error"]


def assert_invalid_prompts_rejected(url: str) -> None:
    """Every ``REJECTED`` request gets a 400 with its reason; a streamed empty prompt gets the
    error event; an empty chat message still works (the template adds tokens); the greedy
    output of a normal request is the same before and after."""
    before = _greedy_ids(url)
    for path, body, pattern in REJECTED:
        resp = requests.post(url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, body, resp.status_code, resp.text)
        assert re.search(pattern, _error_message(resp)), (path, body, resp.text)
    streamed = _streamed_error(url)
    assert streamed["code"] == 400 and re.search(EMPTY, streamed["message"]), streamed
    chat = requests.post(
        url + "/v1/chat/completions",
        json={**_COMPLETION, "messages": [{"role": "user", "content": ""}]},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert _greedy_ids(url) == before
