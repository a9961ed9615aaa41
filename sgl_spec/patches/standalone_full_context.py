"""Patch: STANDALONE's draft model sees the whole sequence, token 0 included.

Upstream target: ``sglang.srt.speculative.standalone_worker_v2.StandaloneDraftWorker``
(SGLang 0.5.23), which inherits EAGLE's draft layout from ``EagleDraftWorker``:
``_draft_extend_for_prefill`` shifts each request's ids left by one
(``cat(input_ids[1:], tail)``) so that draft position ``p`` holds token ``p + 1``. EAGLE's
draft needs that pairing (it reads the target's hidden state ``p`` next to token ``p + 1``),
but a STANDALONE draft is a plain language model that reads tokens only: the shift silently
drops token 0 (for Llama-family models the BOS token, their attention sink) from the draft's
context, and an identical draft then disagrees with the target.

The patched worker keeps the draft's KV unshifted: the slot of position ``p`` holds the draft
KV of token ``p``. The invariant between rounds is EAGLE's, moved by one position: the draft
KV covers every committed token *and* the bonus token ``b`` (at position ``seq_len``), and the
carried ``topk_p``/``topk_index`` are the draft's proposals for the token after ``b``.

- prefill: the draft extends the prompt as is; the bonus token has no draft KV yet, so the
  request is marked and the next ``draft`` first runs one decode forward of the bonus tokens;
- ``draft``: EAGLE's draft loop with ``seq_lens`` one larger (drafts are written after ``b``);
- after verify: one extend per request of ``[root, accepted..., bonus, rejected...]`` (the
  verified root followed by the verify's outputs, ``num_draft_tokens + 1`` tokens at positions
  ``seq_len .. seq_len + num_draft_tokens``); the bonus row's logits propose the next draft.

The forward count per round is EAGLE's (one extend, ``num_steps - 1`` draft decodes), plus one
decode in the first round after a prefill. Slots past ``seq_len`` come from the decode
over-allocation (``2 * max(num_steps * topk, num_draft_tokens)`` per request), which holds the
``num_draft_tokens + 1`` window. Verify is untouched: the target still checks every draft.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.speculative.standalone_worker_v2"
_METHODS = {
    "_draft_extend_for_prefill": {
        "self",
        "batch",
        "target_hidden_states",
        "next_token_ids",
        "mm_input_embeds",
        "kv_loc_plan",
    },
    "draft": {"self", "batch", "with_topology"},
    "_draft_extend_for_decode": {"self", "batch", "batch_result", "kv_loc_plan"},
}


def enabled(config: SpecConfig) -> bool:
    return config.standalone_full_context


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    from sglang.srt.speculative import eagle_worker_common

    cls = getattr(_module(), "StandaloneDraftWorker", None)
    if cls is None:
        raise RuntimeError(f"{TARGET} lacks StandaloneDraftWorker: patch needs updating")
    for name, expected in _METHODS.items():
        params = set(inspect.signature(getattr(cls, name)).parameters)
        if params != expected:
            raise RuntimeError(f"{TARGET}.StandaloneDraftWorker.{name} params: {sorted(params)}")
    for name in ("prepare_for_draft", "prepare_for_draft_extend", "build_eagle_verify_input"):
        if not hasattr(eagle_worker_common, name):
            raise RuntimeError(f"eagle_worker_common lacks {name}: patch needs updating")


def apply() -> bool:
    """Install the full-context draft methods on ``StandaloneDraftWorker``."""
    check()
    cls = _module().StandaloneDraftWorker
    if getattr(cls, "_sgl_spec_full_context", False):
        return True
    from sgl_spec.patches import standalone_draft

    for name in _METHODS:
        setattr(cls, name, getattr(standalone_draft, name))
    cls._sgl_spec_full_context = True
    return True
