"""The KV pool size a CPU server gets when the user names none.

SGLang sizes its KV pool from free memory: ``--mem-fraction-static`` (0.72 on a CPU host) of
the RAM left after the weights load. A GPU's memory belongs to its server; a CPU host's RAM is
shared with everything else on it, so a server of a 26M-parameter model would hold most of the
host (docs/cpu.md). On a CPU host, when the user gives neither ``--max-total-tokens`` nor
``--mem-fraction-static``, the launcher sizes the pool from what the served model needs:
enough tokens for every running request at the full context, at least ``FLOOR_CONTEXTS`` full
contexts, and no more than ``RAM_CAP_FRACTION`` of the host's RAM for the target's and the
draft's KV together. The choice and its reason go to the start-up log.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from sgl_spec.argv import flag_value, has_flag

# SGLang's default for --max-running-requests with speculative decoding (server_args).
DEFAULT_RUNNING_REQUESTS = 48
FLOOR_CONTEXTS = 4
RAM_CAP_FRACTION = 0.08
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "bf16": 2, "float16": 2}


@dataclass(frozen=True)
class KvPoolSizing:
    max_total_tokens: int
    reason: str  # one line for the start-up log: what was chosen and why


def read_model_config(model_path: str | None) -> dict | None:
    """A local model directory's config.json, or None (a hub id or an unreadable file)."""
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def kv_bytes_per_token(config: dict, element_bytes: int) -> int | None:
    """K and V bytes one token occupies over all layers of a decoder-only model, or None when
    the config does not name the attention shape."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * element_bytes


def _element_bytes(argv: list[str], config: dict) -> int:
    kv_dtype = flag_value(argv, "--kv-cache-dtype")
    if kv_dtype in _KV_DTYPE_BYTES:
        return _KV_DTYPE_BYTES[kv_dtype]
    dtype = flag_value(argv, "--dtype")
    if dtype in (None, "auto"):
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float16")
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)


def _int_flag(argv: list[str], name: str) -> int | None:
    try:
        value = int(flag_value(argv, name) or 0)
    except ValueError:
        return None  # SGLang's parser names the bad value
    return value if value > 0 else None


def size_cpu_kv_pool(argv: list[str], total_ram_bytes: int) -> KvPoolSizing | None:
    """The ``--max-total-tokens`` to add to a CPU server's ``argv``, or None when the user
    chose the pool (``--max-total-tokens`` / ``--mem-fraction-static``) or the model's config
    cannot be read (SGLang's own sizing then applies)."""
    if has_flag(argv, "--max-total-tokens", "--mem-fraction-static"):
        return None
    target = read_model_config(flag_value(argv, "--model-path"))
    if target is None:
        return None
    per_token = kv_bytes_per_token(target, _element_bytes(argv, target))
    if per_token is None:
        return None
    draft = read_model_config(flag_value(argv, "--speculative-draft-model-path"))
    draft_bytes = kv_bytes_per_token(draft, _element_bytes(argv, draft)) if draft else None
    per_token += draft_bytes or 0  # STANDALONE's draft pool has the target's token count
    context = _int_flag(argv, "--context-length") or int(target.get("max_position_embeddings") or 0)
    if context <= 0:
        return None
    requests = _int_flag(argv, "--max-running-requests") or DEFAULT_RUNNING_REQUESTS
    wanted = max(requests * context, FLOOR_CONTEXTS * context)
    cap = int(RAM_CAP_FRACTION * total_ram_bytes) // per_token
    tokens = max(min(wanted, cap), context)
    why = (
        f"{requests} running requests x {context} context tokens"
        if tokens == wanted
        else f"capped at {RAM_CAP_FRACTION:.0%} of {total_ram_bytes / 2**30:.1f} GiB RAM "
        f"(wanted {requests} requests x {context} tokens = {wanted})"
    )
    if tokens == context and cap < context:
        why = f"one full context ({context} tokens); {RAM_CAP_FRACTION:.0%} of RAM holds less"
    reason = (
        f"CPU KV pool: --max-total-tokens {tokens} ({why}; {per_token / 1024:.1f} KiB per "
        f"token, {tokens * per_token / 2**30:.2f} GiB). Pass --max-total-tokens or "
        "--mem-fraction-static to choose."
    )
    return KvPoolSizing(tokens, reason)


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
