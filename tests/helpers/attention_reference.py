"""Reference paged decode / extend attention: dense, padded, float64 (the fast path's oracle).

Same signatures as ``attention.decode_attention`` / ``attention.extend_attention``: every call
gathers each request's whole paged KV into a padded ``[bs, L, Hkv, D]`` float64 tensor, repeats
grouped KV heads and builds a dense ``[bs, n, L]`` visibility mask. Scores, softmax and the
weighted sum run in float64 and are rounded once to the output dtype. Slow, but short and
plain; tests compare the fast path against it.

Paged layout: ``req_to_token[req_pool_indices[b], j]`` is the KV-pool row of token ``j`` of
request ``b``; ``k_buffer``/``v_buffer`` are ``[pool_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

_ACC = torch.float64


def _kv_rows(
    req_to_token: torch.Tensor,  # [num_reqs_in_pool, max_context]
    req_pool_indices: torch.Tensor,  # [bs]
    lengths: torch.Tensor,  # [bs] keys per request
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows of every request's first ``lengths[b]`` tokens, padded: ([bs, L], valid [bs, L])."""
    max_len = int(lengths.max()) if lengths.numel() else 0
    cols = torch.arange(max_len, device=lengths.device)
    valid = cols[None, :] < lengths[:, None].to(cols.dtype)
    rows = req_to_token[req_pool_indices.long()][:, :max_len].long()
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def _gather(buffer: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    out = buffer[rows].to(_ACC)  # [bs, L, Hkv, D]
    return out * scale if scale != 1.0 else out


def attend(
    q: torch.Tensor,  # [bs, n, H, D]
    k: torch.Tensor,  # [bs, L, Hkv, D]
    v: torch.Tensor,  # [bs, L, Hkv, Dv]
    visible: torch.Tensor,  # [bs, n, L] bool
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:
    """Dense masked attention with grouped KV heads; returns ``[bs, n, H, Dv]`` in float64.

    ``logit_cap > 0`` applies ``cap * tanh(s / cap)`` after scaling; ``sinks`` adds one
    per-head logit to the softmax denominator only (attention-sink models).
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    group = num_heads // num_kv_heads
    qh = q.to(_ACC).permute(0, 2, 1, 3)  # [bs, H, n, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [bs, H, L, D]
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [bs, H, L, Dv]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * sm_scale  # [bs, H, n, L]
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(_ACC).view(1, num_heads, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(-1e300)
    probs = torch.exp(scores - row_max)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, vh).permute(0, 2, 1, 3)  # [bs, n, H, Dv]


def _window_mask(
    query_pos: torch.Tensor,  # [bs, n]
    key_pos: torch.Tensor,  # [L]
    window: int,
) -> torch.Tensor:
    """``window`` = keys visible counting the query itself (SGLang passes sliding_window_size + 1)."""
    return (query_pos[:, :, None] - key_pos[None, None, :]) < window


def decode_attention_reference(
    query: torch.Tensor,  # [bs, H, D]
    k_cache: torch.Tensor,  # [pool, Hkv, D]
    v_cache: torch.Tensor,  # [pool, Hkv, Dv]
    key_scale: float,
    value_scale: float,
    output: torch.Tensor,  # [bs, H, Dv]
    key: torch.Tensor | None,  # [bs, Hkv, D] new token's key (written at loc)
    value: torch.Tensor | None,  # [bs, Hkv, Dv]
    loc: torch.Tensor,  # [bs]
    attn_logits: torch.Tensor,  # scratch of the native kernel; unused
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] including the new token
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One new query token per request attends to its whole paged context."""
    if is_cross_attention:
        raise NotImplementedError("sgl_spec CPU fallback: cross-attention decode is not supported")
    if key is not None and value is not None:
        k_cache[loc.long()] = key.to(k_cache.dtype)
        v_cache[loc.long()] = value.to(v_cache.dtype)
    bs = query.shape[0]
    if bs == 0:
        return
    seq_lens = seq_lens.long()
    rows, valid = _kv_rows(req_to_token, req_pool_indices, seq_lens)
    k = _gather(k_cache, rows, key_scale)
    v = _gather(v_cache, rows, value_scale)
    visible = valid[:, None, :]  # [bs, 1, L]
    if sliding_window > 0:
        key_pos = torch.arange(rows.shape[1], device=rows.device)
        visible = visible & _window_mask((seq_lens - 1)[:, None], key_pos, sliding_window)
    out = attend(query[:, None], k, v, visible, sm_scale, logit_cap, sinks)
    output.copy_(out[:, 0].to(output.dtype))


def extend_attention_reference(
    q_extend: torch.Tensor,  # [num_extend_tokens, H, D]
    k_extend: torch.Tensor | None,  # [num_extend_tokens, Hkv, D]
    v_extend: torch.Tensor | None,  # [num_extend_tokens, Hkv, Dv]
    o_extend: torch.Tensor,  # [num_extend_tokens, H, Dv]
    k_buffer: torch.Tensor,  # [pool, Hkv, D]
    v_buffer: torch.Tensor,
    key_scale: float,
    value_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] prefix + extend
    extend_seq_lens: torch.Tensor,  # [bs]
    extend_start_loc: torch.Tensor,  # [bs]
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,  # flat, per request [ext, ext] (QLEN_ONLY layout)
    is_causal: bool,
) -> None:
    """Each request's extend tokens attend to its cached prefix and (causally, or through the
    draft-tree mask) to each other. Prefix K/V come from the pool, extend K/V from the
    arguments when given (the backend may skip saving them)."""
    if is_cross_attention:
        raise NotImplementedError("sgl_spec CPU fallback: cross-attention extend is not supported")
    bs = seq_lens.shape[0]
    if bs == 0 or q_extend.shape[0] == 0:
        return
    if tree_mask is not None and sliding_window > 0:
        raise NotImplementedError("sgl_spec CPU fallback: tree mask with sliding window")
    seq_lens = seq_lens.long()
    ext_lens = extend_seq_lens.long()
    starts = extend_start_loc.long()
    prefix_lens = seq_lens - ext_lens
    device = q_extend.device
    ext_idx = torch.arange(int(ext_lens.max()), device=device)
    ext_valid = ext_idx[None, :] < ext_lens[:, None]  # [bs, E]
    token_idx = torch.where(ext_valid, starts[:, None] + ext_idx[None, :], 0)  # [bs, E]
    q = q_extend[token_idx]  # [bs, E, H, D]
    rows, valid = _kv_rows(req_to_token, req_pool_indices, seq_lens)  # [bs, L]
    k = _gather(k_buffer, rows, key_scale)
    v = _gather(v_buffer, rows, value_scale)
    key_pos = torch.arange(rows.shape[1], device=device)  # [L]
    if k_extend is not None and v_extend is not None:
        # positions prefix_len + e take the passed-in extend K/V
        in_ext = (key_pos[None, :] >= prefix_lens[:, None]) & valid  # [bs, L]
        src = (starts[:, None] + key_pos[None, :] - prefix_lens[:, None]).clamp_min(0)
        src = torch.where(in_ext, src, 0)
        k = _replace(k, in_ext, k_extend[src], key_scale)
        v = _replace(v, in_ext, v_extend[src], value_scale)
    visible = _extend_visibility(
        valid, ext_valid, key_pos, prefix_lens, ext_lens, tree_mask, is_causal, sliding_window
    )
    out = attend(q, k, v, visible, sm_scale, logit_cap, sinks)  # [bs, E, H, Dv]
    o_extend[token_idx[ext_valid]] = out[ext_valid].to(o_extend.dtype)


def _replace(
    kv: torch.Tensor,  # [bs, L, Hkv, D] in _ACC
    where: torch.Tensor,  # [bs, L]
    values: torch.Tensor,  # [bs, L, Hkv, D]
    scale: float,
) -> torch.Tensor:
    return torch.where(where[..., None, None], values.to(_ACC) * scale, kv)


def _extend_visibility(
    valid: torch.Tensor,  # [bs, L] key exists
    ext_valid: torch.Tensor,  # [bs, E] query exists
    key_pos: torch.Tensor,  # [L]
    prefix_lens: torch.Tensor,  # [bs]
    ext_lens: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor | None,
    is_causal: bool,
    sliding_window: int,
) -> torch.Tensor:
    """``[bs, E, L]`` bool: key ``l`` visible to extend query ``e`` of request ``b``."""
    ext_idx = torch.arange(ext_valid.shape[1], device=key_pos.device)
    query_pos = prefix_lens[:, None] + ext_idx[None, :]  # [bs, E]
    visible = valid[:, None, :] & ext_valid[:, :, None]  # [bs, E, L]
    is_prefix_key = key_pos[None, None, :] < prefix_lens[:, None, None]  # [bs, 1, L]
    if tree_mask is not None:
        visible = visible & (
            is_prefix_key | _tree_visibility(tree_mask, ext_lens, prefix_lens, key_pos.shape[0])
        )
    elif is_causal:
        visible = visible & (key_pos[None, None, :] <= query_pos[:, :, None])
    if sliding_window > 0:
        visible = visible & _window_mask(query_pos, key_pos, sliding_window)
    return visible


def _tree_visibility(
    tree_mask: torch.Tensor,  # flat bool/int: sum_b ext_b * ext_b
    ext_lens: torch.Tensor,  # [bs]
    prefix_lens: torch.Tensor,  # [bs]
    max_keys: int,
) -> torch.Tensor:
    """Scatter each request's ``[ext, ext]`` draft-tree mask into key columns ``prefix_len + j``."""
    bs = ext_lens.shape[0]
    max_ext = int(ext_lens.max())
    out = torch.zeros((bs, max_ext, max_keys), dtype=torch.bool, device=tree_mask.device)
    offset = 0
    for b in range(bs):
        n, p = int(ext_lens[b]), int(prefix_lens[b])
        block = tree_mask[offset : offset + n * n].view(n, n).bool()
        out[b, :n, p : p + n] = block
        offset += n * n
    return out
