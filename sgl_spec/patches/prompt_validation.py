"""Patch: reject prompts the model cannot run (empty, or ids outside the vocabulary) with a 400.

Upstream target: ``sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request``
(SGLang 0.5.23). SGLang checks a prompt's length against the context but not its lower end nor
its ids, so two requests reach the scheduler and crash it, taking the whole server down:

- a prompt of 0 tokens (``{"text": ""}`` with a tokenizer that adds no BOS, ``"input_ids": []``,
  an empty element of a batch): ``cannot reshape tensor of 0 elements`` in the rotary embedding;
- an id ``< 0`` or ``>= vocab_size`` in ``input_ids``: an index error in the embedding.

Every request SGLang tokenizes, single or batched, native or OpenAI, passes through
``_validate_one_request`` in the HTTP server's process, whose ``ValueError`` the endpoints answer
with HTTP 400 (a batch fails as a whole, as it does for SGLang's own too-long prompt). The patch
runs ``check_prompt`` there first, for every algorithm, speculative or not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from types import ModuleType

from sgl_spec.config import SpecConfig

TARGET = "sglang.srt.managers.tokenizer_manager"
# The TokenizerManager paths that hand a request's ids to the method this patch wraps.
_CALLERS = ("_tokenize_one_request", "_batch_tokenize_and_process")


def enabled(config: SpecConfig) -> bool:
    return True  # a crash fix: no algorithm or setting wants the crash


def check_prompt(
    input_ids: Sequence[int] | None,
    vocab_size: int,
    *,
    num_embeds: int | None = None,
    check_ids: bool = True,
    allow_empty: bool = False,
) -> None:
    """Raise ``ValueError`` (SGLang answers it with HTTP 400) for a prompt the model cannot run.

    ``num_embeds``: the prompt's length when it is given as ``input_embeds`` (its ids are then
    placeholders and go unchecked); ``check_ids=False`` for multimodal prompts, whose ids may
    hold placeholder values past the vocabulary; ``allow_empty`` for a session continuation,
    which extends the session's earlier tokens.
    """
    num_tokens = num_embeds if num_embeds is not None else len(input_ids or ())
    if num_tokens == 0 and not allow_empty:
        raise ValueError(
            "the prompt is empty (0 tokens): generation needs at least one input token"
        )
    if num_embeds is not None or not check_ids or not input_ids:
        return
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {vocab_size})")


def check_request(obj: object, input_ids: Sequence[int] | None, vocab_size: int) -> None:
    """``check_prompt`` for one (already split) Generate/EmbeddingReqInput and its ids."""
    embeds = getattr(obj, "input_embeds", None)
    contains_mm = getattr(obj, "contains_mm_input", None)
    session = getattr(obj, "session_params", None)
    check_prompt(
        input_ids,
        vocab_size,
        num_embeds=len(embeds) if embeds is not None else None,
        check_ids=not (callable(contains_mm) and contains_mm()),
        allow_empty=session is not None and _session_id(session) is not None,
    )


def _session_id(session_params: object) -> object:
    if isinstance(session_params, dict):
        return session_params.get("id")
    return getattr(session_params, "id", None)


def _module() -> ModuleType:
    import importlib

    return importlib.import_module(TARGET)


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape this patch expects."""
    cls = getattr(_module(), "TokenizerManager", None)
    method = getattr(cls, "_validate_one_request", None)
    if method is None:
        raise RuntimeError(f"{TARGET}.TokenizerManager._validate_one_request is gone")
    params = list(inspect.signature(getattr(method, "__wrapped__", method)).parameters)
    if params != ["self", "obj", "input_ids"]:
        raise RuntimeError(f"{TARGET}.TokenizerManager._validate_one_request params: {params}")
    for name in _CALLERS:
        if "self._validate_one_request(" not in inspect.getsource(getattr(cls, name)):
            raise RuntimeError(
                f"{TARGET}.TokenizerManager.{name} no longer calls _validate_one_request;"
                " patch prompt_validation needs updating"
            )


def validating(original: Callable) -> Callable:
    """``original`` (``_validate_one_request``) preceded by ``check_request``."""

    @functools.wraps(original)
    def validate_one_request(self, obj, input_ids) -> None:
        check_request(obj, input_ids, self.model_config.vocab_size)
        original(self, obj, input_ids)

    validate_one_request._sgl_spec_prompt_validation = True  # type: ignore[attr-defined]
    return validate_one_request


def apply() -> bool:
    """Wrap ``TokenizerManager._validate_one_request`` (subclasses inherit it); idempotent."""
    check()
    cls = _module().TokenizerManager
    if not getattr(cls._validate_one_request, "_sgl_spec_prompt_validation", False):
        cls._validate_one_request = validating(cls._validate_one_request)
    return True
