"""Paged decode / extend attention: PyTorch versions of ``decode_attention_cpu`` and
``extend_attention_cpu`` as SGLang 0.5.23's ``IntelAMXAttnBackend`` calls them. Float32
decodes and short extends go to the native kernels first where they are built
(``attention_native``), with the same semantics; what is here serves every other call.

Paged layout: ``req_to_token[req_pool_indices[b], j]`` is the KV-pool row of token ``j`` of
request ``b``; ``k_buffer``/``v_buffer`` are ``[pool_size, num_kv_heads, head_dim]``. This module
holds the ops and the attention arithmetic (query layout, masks, softmax); ``paged_kv.py``
groups requests into batches and gathers their K/V from the pool.

Cost: at served sizes time goes to memory traffic and per-op overhead, not arithmetic. K and
V are gathered once (``index_select``), or read in place when a lone request's pool rows are
consecutive, as a head-major view; grouped query heads become extra query rows of their KV
head (a view); a mask only where some key is hidden; without logit cap or sinks the product
runs in PyTorch's fused CPU attention. A batch whose padding would waste most of the work
(``MAX_PAD``) runs request by request.

Precision: float32, as the linear layers. A token decoded alone and inside a verify block
agree up to float32 rounding (blocking depends on how many rows share a call, as for the
GEMMs); each algorithm's greedy test checks what that means for served tokens against the
non-speculative server. ``tests/helpers/attention_reference.py`` keeps the plain dense version
as the tests' oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import attention_native, paged_kv
from sgl_spec.cpu_kernels.memo import LastCall
from sgl_spec.cpu_kernels.opdef import OpDef
from sgl_spec.cpu_kernels.paged_kv import (
    ACC,
    Batch,
    consecutive_start,
    gather_heads,
    make_batch,
    pad_is_cheap,
    pool_rows,
)


@dataclass(frozen=True)
class _Params:
    """The per-layer scalars of one call."""

    key_scale: float
    value_scale: float
    sm_scale: float
    logit_cap: float
    window: int  # keys visible counting the query itself (SGLang passes sliding_window + 1)
    sinks: torch.Tensor | None  # [H]


def _queries(q: torch.Tensor, num_kv_heads: int, sm_scale: float) -> torch.Tensor:
    """``[B, n, H, D]`` -> ``[B, Hkv, n * g, D]`` in ``ACC`` times ``sm_scale``: the ``g``
    query heads sharing a KV head become rows of that head, ordered (query, head in group)."""
    num, n, heads, dim = q.shape
    group = heads // num_kv_heads
    if n == 1:  # a decode: the layout is already (KV head, head in group), one op
        return q.to(ACC).view(num, num_kv_heads, group, dim).mul(sm_scale)
    out = torch.empty((num, num_kv_heads, n, group, dim), dtype=ACC, device=q.device)
    out.copy_(q.view(num, n, num_kv_heads, group, dim).permute(0, 2, 1, 3, 4))
    return out.mul_(sm_scale).view(num, num_kv_heads, n * group, dim)


def attend(
    q: torch.Tensor,  # [B, Hkv, n * g, D] scaled (see _queries)
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, Dv]
    hidden: torch.Tensor | None,  # [B, n or 1, L] bool: key not visible to the query
    logit_cap: float,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:
    """Masked attention per KV head; returns ``[B, Hkv, n * g, Dv]``.

    ``logit_cap > 0`` applies ``cap * tanh(s / cap)`` to the scaled scores; ``sinks`` adds one
    per-head logit to the softmax denominator only (attention-sink models). A query that
    sees no key at all gets NaN (only padding rows, which callers drop)."""
    if logit_cap <= 0 and sinks is None:
        mask = None
        if hidden is not None:
            num, n, length = hidden.shape
            group = q.shape[2] // n
            visible = ~hidden[:, None, :, None, :]  # [B, 1, n, 1, L]
            mask = visible.expand(num, 1, n, group, length).reshape(num, 1, n * group, length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, R, L]
    num, kv_heads, rows, length = scores.shape
    if logit_cap > 0:
        scores.div_(logit_cap).tanh_().mul_(logit_cap)
    if hidden is not None:
        n = hidden.shape[1]
        scores.view(num, kv_heads, n, rows // n, length).masked_fill_(
            hidden[:, None, :, None, :], float("-inf")
        )
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    group = sinks.shape[0] // kv_heads
    sink = sinks.to(ACC).view(1, kv_heads, 1, group).expand(num, kv_heads, rows // group, group)
    scores = torch.cat([scores, sink.reshape(num, kv_heads, rows, 1)], dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1)[..., :length], v)


def decode_attention(
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
    req_to_token: torch.Tensor,  # [num_reqs_in_pool, max_context]
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] including the new token
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,  # [H]
) -> None:
    """One new query token per request attends to its whole paged context."""
    if is_cross_attention:
        raise NotImplementedError("sgl_spec CPU fallback: cross-attention decode is not supported")
    if attention_native.decode(
        query, k_cache, v_cache, output, key, value, loc, req_to_token, req_pool_indices,
        seq_lens, (sm_scale, key_scale, value_scale), logit_cap, sliding_window, sinks,
    ):  # fmt: skip
        return
    if key is not None and value is not None:
        loc = loc.long()
        k_cache.index_copy_(0, loc, key.to(k_cache.dtype))
        v_cache.index_copy_(0, loc, value.to(v_cache.dtype))
    bs = query.shape[0]
    if bs == 0:
        return
    params = _Params(key_scale, value_scale, sm_scale, logit_cap, sliding_window, sinks)
    plan = _DECODE_PLANS.get(
        (req_pool_indices, seq_lens),
        (req_to_token,),
        (bs, sliding_window, paged_kv.POOL_VIEW),
        lambda: _decode_plan(req_to_token, req_pool_indices, seq_lens, sliding_window),
    )
    for part in plan:
        _decode(query[part.query_rows], k_cache, v_cache, output[part.query_rows], part, params)


@dataclass(frozen=True)
class _DecodePart:
    """What one padded decode call reads, the same for every layer of a forward."""

    query_rows: slice
    rows: torch.Tensor  # [B, L] pool rows
    hidden: torch.Tensor | None  # [B, 1, L] key not visible
    start: int | None  # first pool row when read in place (``consecutive_start``)


_DECODE_PLANS: LastCall[list[_DecodePart]] = LastCall()


def _decode_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs]
    window: int,
) -> list[_DecodePart]:
    bs = req_pool_indices.shape[0]
    ones = torch.ones(bs, dtype=torch.int64, device=seq_lens.device)
    batch = make_batch(req_pool_indices, seq_lens, ones, torch.arange(bs, device=seq_lens.device))
    plan = []
    for query_rows, _, part in batch.parts(pad_is_cheap(batch)):
        rows, key_pos = pool_rows(req_to_token, part)
        hidden = None
        if min(part.lens_list) < key_pos.shape[0]:
            hidden = (key_pos[None, :] >= part.lens[:, None])[:, None, :]
        if 0 < window < max(part.lens_list):
            far = key_pos[None, :] <= (part.lens - window - 1)[:, None]
            hidden = far[:, None, :] if hidden is None else hidden | far[:, None, :]
        plan.append(_DecodePart(query_rows, rows, hidden, consecutive_start(rows)))
    return plan


def _decode(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [pool, Hkv, D]
    v_cache: torch.Tensor,  # [pool, Hkv, Dv]
    output: torch.Tensor,  # [B, H, Dv]
    part: _DecodePart,
    params: _Params,
) -> None:
    k = gather_heads(k_cache, part.rows, params.key_scale, start=part.start)
    v = gather_heads(v_cache, part.rows, params.value_scale, start=part.start)
    q = _queries(query[:, None], k.shape[1], params.sm_scale)
    out = attend(q, k, v, part.hidden, params.logit_cap, params.sinks)  # [B, Hkv, g, Dv]
    output.copy_(out.reshape(output.shape))


def extend_attention(
    q_extend: torch.Tensor,  # [num_extend_tokens, H, D]
    k_extend: torch.Tensor | None,  # [num_extend_tokens, Hkv, D]
    v_extend: torch.Tensor | None,  # [num_extend_tokens, Hkv, Dv]
    o_extend: torch.Tensor,  # [num_extend_tokens, H, Dv]
    k_buffer: torch.Tensor,  # [pool, Hkv, D]
    v_buffer: torch.Tensor,  # [pool, Hkv, Dv]
    key_scale: float,
    value_scale: float,
    req_to_token: torch.Tensor,  # [num_reqs_in_pool, max_context]
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
    sinks: torch.Tensor | None,  # [H]
    tree_mask: torch.Tensor | None,  # flat, per request [ext, ext] (QLEN_ONLY layout)
    is_causal: bool,
) -> None:
    """Each request's extend tokens attend to its cached prefix and (causally, or through the
    draft-tree mask) to each other. Prefix K/V come from the pool, extend K/V from the
    arguments when given (the backend may skip saving them)."""
    if is_cross_attention:
        raise NotImplementedError("sgl_spec CPU fallback: cross-attention extend is not supported")
    if seq_lens.shape[0] == 0 or q_extend.shape[0] == 0:
        return
    if tree_mask is not None and sliding_window > 0:
        raise NotImplementedError("sgl_spec CPU fallback: tree mask with sliding window")
    lens = (req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc)
    if attention_native.extend(
        q_extend, (k_extend, v_extend), o_extend, (k_buffer, v_buffer), req_to_token, lens,
        (sm_scale, key_scale, value_scale), logit_cap, sliding_window, sinks, tree_mask,
        is_causal, max_len_extend,
    ):  # fmt: skip
        return
    params = _Params(key_scale, value_scale, sm_scale, logit_cap, sliding_window, sinks)
    plan = _EXTEND_PLANS.get(
        (*lens, tree_mask),
        (req_to_token,),
        (is_causal, sliding_window, paged_kv.POOL_VIEW),
        lambda: _extend_plan(req_to_token, make_batch(*lens), tree_mask, is_causal, sliding_window),
    )
    given = k_extend is not None and v_extend is not None
    for part in plan:
        rows = part.query_rows
        kv = (k_extend[rows], v_extend[rows]) if given else None
        _extend(q_extend[rows], kv, o_extend[rows], (k_buffer, v_buffer), part, params)


@dataclass(frozen=True)
class _ExtendPart:
    """What one padded extend call reads, the same for every layer of a forward."""

    query_rows: slice
    num: int  # requests
    n: int  # queries of the longest request
    rows: torch.Tensor  # [B, L] pool rows
    token: torch.Tensor | None  # [B, n] query row of (request, j); None when uniform
    valid: torch.Tensor | None  # [B, n] whether that query exists; None when uniform
    new_keys: tuple[torch.Tensor, torch.Tensor, slice | torch.Tensor]  # (b, j, source row)
    hidden: torch.Tensor | None  # [B, n or 1, L] key not visible
    start: int | None  # first pool row when read in place (``consecutive_start``)


_EXTEND_PLANS: LastCall[list[_ExtendPart]] = LastCall()


def _extend_plan(
    req_to_token: torch.Tensor,
    batch: Batch,
    tree_mask: torch.Tensor | None,  # flat, per request [ext, ext]
    is_causal: bool,
    window: int,
) -> list[_ExtendPart]:
    batched = pad_is_cheap(batch) and (tree_mask is None or batch.uniform)
    plan = []
    for query_rows, mask_rows, part in batch.parts(batched):
        if part.ext_list == [0]:
            continue
        num, n = len(part.lens_list), max(part.ext_list)
        rows, key_pos = pool_rows(req_to_token, part)
        prefix = part.lens - part.ext  # [B]
        j = torch.arange(n, device=rows.device)
        b_idx = torch.arange(num, device=rows.device)[:, None].expand(num, n)
        pos = prefix[:, None] + j  # [B, n] key position of each extend token
        token = valid = None
        if part.uniform:
            new_keys = (b_idx.reshape(-1), pos.reshape(-1), slice(0, num * n))
        else:
            valid = j[None, :] < part.ext[:, None]
            token = torch.where(valid, part.starts[:, None] + j, 0)
            new_keys = (b_idx[valid], pos[valid], token[valid])
        tree = None if tree_mask is None else tree_mask[mask_rows]
        hidden = _extend_hidden(part, key_pos, prefix, n, tree, is_causal, window)
        start = consecutive_start(rows)
        plan.append(_ExtendPart(query_rows, num, n, rows, token, valid, new_keys, hidden, start))
    return plan


def _extend(
    q: torch.Tensor,  # [tokens, H, D]
    kv_extend: tuple[torch.Tensor, torch.Tensor] | None,  # [tokens, Hkv, D], [tokens, Hkv, Dv]
    o: torch.Tensor,  # [tokens, H, Dv]
    kv_buffer: tuple[torch.Tensor, torch.Tensor],  # [pool, Hkv, D], [pool, Hkv, Dv]
    part: _ExtendPart,
    params: _Params,
) -> None:
    num, n, token = part.num, part.n, part.token
    if token is None:
        queries = q[: num * n].view(num, n, *q.shape[1:])
    else:
        queries = q[token]
    k_new = v_new = None
    if kv_extend is not None:
        b_idx, pos, src = part.new_keys
        k_new, v_new = (b_idx, pos, kv_extend[0][src]), (b_idx, pos, kv_extend[1][src])
    k = gather_heads(kv_buffer[0], part.rows, params.key_scale, k_new, part.start)
    v = gather_heads(kv_buffer[1], part.rows, params.value_scale, v_new, part.start)
    out = attend(
        _queries(queries, k.shape[1], params.sm_scale),
        k,
        v,
        part.hidden,
        params.logit_cap,
        params.sinks,
    )  # [B, Hkv, n * g, Dv]
    heads, dim_v = o.shape[1], o.shape[2]
    out = out.reshape(num, k.shape[1], n, heads // k.shape[1], dim_v).transpose(1, 2)
    if token is None:
        o[: num * n].view(out.shape).copy_(out)
    else:
        o[token[part.valid]] = out[part.valid].reshape(-1, heads, dim_v).to(o.dtype)


def _extend_hidden(
    batch: Batch,
    key_pos: torch.Tensor,  # [L]
    prefix: torch.Tensor,  # [B]
    n: int,
    tree: torch.Tensor | None,  # flat [B * n * n]
    is_causal: bool,
    window: int,
) -> torch.Tensor | None:
    """``[B, n or 1, L]`` bool, True where query ``j`` of request ``b`` must not see the key;
    None when every query sees every key of its request."""
    num = len(batch.lens_list)
    query_pos = prefix[:, None] + torch.arange(n, device=key_pos.device)  # [B, n]
    hidden = None
    if tree is not None:
        # hide every extend key (and the padding after them), then show each query's
        # ancestors: key prefix + j is visible to query i where tree[b, i, j]
        hidden = (key_pos[None, :] >= prefix[:, None])[:, None, :].repeat(1, n, 1)
        cols = query_pos[:, None, :].expand(num, n, n)
        hidden.scatter_(2, cols, ~tree.view(num, n, n).bool())
    elif is_causal:
        hidden = key_pos[None, None, :] > query_pos[:, :, None]
    elif min(batch.lens_list) < key_pos.shape[0]:
        hidden = (key_pos[None, :] >= batch.lens[:, None])[:, None, :]
    if 0 < window < max(batch.lens_list):
        far = (query_pos[:, :, None] - key_pos[None, None, :]) >= window
        hidden = far if hidden is None else hidden | far
    return hidden


OPS = [
    OpDef(
        "decode_attention_cpu",
        "(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float key_scale, float value_scale,"
        " Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits,"
        " Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale,"
        " float logit_cap, bool is_cross_attention, int sliding_window, Tensor? encoder_lens,"
        " Tensor? sinks) -> ()",
        decode_attention,
    ),
    OpDef(
        "extend_attention_cpu",
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend,"
        " Tensor k_buffer, Tensor v_buffer, float key_scale, float value_scale,"
        " Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens,"
        " Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap,"
        " bool is_cross_attention, int sliding_window, Tensor? encoder_lens, Tensor? sinks,"
        " Tensor? tree_mask, bool is_causal) -> ()",
        extend_attention,
    ),
]
