"""Speculative-decoding bookkeeping ops: KV slot tables, accepted-token compaction, input rotation.

PyTorch versions of the ``sgl_kernel`` CPU ops that SGLang's EAGLE workers call on a CPU host
(``sglang/kernels/ops/speculative/{cache_locs,eagle,multi_layer_eagle}.py``,
``sglang/srt/mem_cache/allocation.py``, ``IntelAMXMultiStepDraftBackend``); the Triton kernels
next to those call sites define the semantics. ``req_to_token`` is the request-to-KV-slot table
``[max_num_reqs, pool_len]``; rows are addressed with the ``pool_len`` the caller passes.
Draft KV slots are laid out contiguously after the committed prefix, candidate-major: draft
step ``s`` of candidate ``k`` of a request with ``seq_len`` committed tokens lives at column
``seq_len + k * num_steps + s``. The tree ops (build / verify / reconstruct) are in
``tree_ops.py``; ``OPS`` here lists both modules.
"""

from __future__ import annotations

import torch

from sgl_spec.cpu_kernels import native, tree_ops
from sgl_spec.cpu_kernels.opdef import OpDef


def _segment_columns(
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner request and column of every element of the packed segments ``[start, end)``."""
    lengths = (end.long() - start.long()).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first_out = torch.cumsum(lengths, 0) - lengths
    columns = start.long()[owner] + torch.arange(owner.numel()) - first_out[owner]
    return owner, columns


def _table_offsets(
    req_pool_indices: torch.Tensor,  # [bs]
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    pool_len: int,
) -> torch.Tensor:
    owner, columns = _segment_columns(start_offset, end_offset)
    return req_pool_indices.long()[owner] * pool_len + columns


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # out: [max_num_reqs, pool_len] int32
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int64, packed per request
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed segment i]``.

    The native kernel serves a contiguous table where built (one call in place of a dozen
    ATen ops on every speculative step)."""
    ops = native.ops()
    if ops is not None and req_to_token.is_contiguous():
        ops.assign_req_to_token_pool(
            req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
        )
        return
    offsets = _table_offsets(req_pool_indices, start_offset, end_offset, pool_len)
    values = out_cache_loc.reshape(-1)[: offsets.numel()]
    req_to_token.view(-1)[offsets] = values.to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [max_num_reqs, pool_len] int32
    start_offset: torch.Tensor,  # [bs]
    end_offset: torch.Tensor,  # [bs]
    out_cache_loc: torch.Tensor,  # out: [sum(end - start)] int64, packed per request
    pool_len: int,
) -> None:
    """Inverse of ``assign_req_to_token_pool``: gather the slots of ``[start, end)`` per request."""
    offsets = _table_offsets(req_pool_indices, start_offset, end_offset, pool_len)
    slots = req_to_token.reshape(-1)[offsets]
    out_cache_loc.view(-1)[: offsets.numel()] = slots.to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [max_num_reqs, pool_len] int32
    seq_lens: torch.Tensor,  # [bs] committed tokens
    out_cache_loc: torch.Tensor,  # out: [bs * topk * num_steps] int64
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Read back the ``topk * num_steps`` draft slots reserved after each committed prefix."""
    bs, width = req_pool_indices.numel(), topk * num_steps
    row_start = req_pool_indices.long() * pool_len + seq_lens.long()  # [bs]
    offsets = row_start[:, None] + torch.arange(width)  # [bs, topk*num_steps]
    slots = req_to_token.reshape(-1)[offsets.reshape(-1)]
    out_cache_loc.view(-1)[: bs * width] = slots.to(out_cache_loc.dtype)


def build_draft_decode_metadata(
    req_to_token: torch.Tensor,  # [max_num_reqs, pool_len] int32
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs] committed tokens
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:  # [bs * topk, pool_len], dtype of req_to_token
    """Per-candidate slot table for multi-step draft decode.

    Row ``b * topk + k`` is request ``b``'s committed prefix followed by candidate ``k``'s
    ``num_steps`` draft slots, so a draft-decode step reads ``seq_len + step + 1`` entries of
    it as an ordinary request row. Entries past ``seq_len + num_steps`` are 0.
    """
    bs = req_pool_indices.numel()
    rows = req_to_token.reshape(-1, pool_len)[req_pool_indices.long()]  # [bs, pool_len]
    lens = seq_lens.long()[:, None, None]  # [bs, 1, 1]
    step = torch.arange(num_steps)
    src = lens + torch.arange(topk)[None, :, None] * num_steps + step  # [bs, topk, num_steps]
    draft_slots = rows.gather(1, src.reshape(bs, -1)).view(bs, topk, num_steps)
    out = rows[:, None, :].repeat(1, topk, 1)  # [bs, topk, pool_len]
    out.scatter_(2, (lens + step).expand(bs, topk, num_steps), draft_slots)
    out.masked_fill_(torch.arange(pool_len) >= lens + num_steps, 0)
    return out.view(bs * topk, pool_len)


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,  # [bs, accept_stride] int32, predict[accept_index]
    accept_lens: torch.Tensor,  # [bs] int32, acceptance length (bonus included)
    bonus_tokens: torch.Tensor,  # out: [bs] int32
    accept_stride: int,
) -> None:
    """The bonus token is the last accepted one: ``accept_tokens[b, accept_lens[b] - 1]``."""
    bs = accept_lens.numel()
    last = torch.arange(bs) * accept_stride + accept_lens.long() - 1
    bonus_tokens.view(-1)[:bs] = accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor,  # [bs, num_spec_step] flat node ids, -1 = not accepted
    out_cache_loc: torch.Tensor,  # [bs * n] int64, verify-window KV slots
    accept_out_cache_loc: torch.Tensor,  # out: [>= num accepted] int64
) -> None:
    """Pack the KV slots of the accepted nodes, in ``accept_index`` order, skipping -1."""
    index = accept_index.reshape(-1).long()
    accepted = index[index > -1]
    slots = out_cache_loc.reshape(-1)[accepted]
    accept_out_cache_loc.view(-1)[: accepted.numel()] = slots.to(accept_out_cache_loc.dtype)


def rotate_input_ids(
    input_ids: torch.Tensor,  # in/out: [num_extend_tokens] int64
    extend_start_loc: torch.Tensor,  # [bs]
    extend_seq_lens: torch.Tensor,  # [bs]
    topk_index: torch.Tensor,  # [bs] (or [bs, 1]) next draft token per request
    select_index: torch.Tensor | None = None,  # [bs] flat slot for the new token
) -> None:
    """Shift each extend segment left by one and write the new token at its end.

    Multi-layer EAGLE feeds layer ``i+1`` the tokens of layer ``i`` advanced by one position.
    Segments are disjoint, so all shifts read the old ids before any write.
    """
    bs = extend_seq_lens.numel()
    if bs == 0:
        return
    start, lens = extend_start_loc.long(), extend_seq_lens.long()
    ids = input_ids.view(-1)
    owner, columns = _segment_columns(start, start + (lens - 1).clamp(min=0))
    ids[columns] = ids[columns + 1]
    has_tokens = lens > 0
    if select_index is not None:
        target = select_index.reshape(-1)[:bs].long()
    else:
        target = start + lens - 1
    new_tokens = topk_index.reshape(-1)[:bs].to(ids.dtype)
    ids[target[has_tokens]] = new_tokens[has_tokens]


OPS = [
    *tree_ops.OPS,
    OpDef(
        "assign_req_to_token_pool_cpu",
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool,
    ),
    OpDef(
        "build_draft_decode_metadata_cpu",
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
        "int num_steps, int pool_len) -> Tensor",
        build_draft_decode_metadata,
    ),
    OpDef(
        "fill_bonus_tokens_cpu",
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()",
        fill_bonus_tokens,
    ),
    OpDef(
        "fill_accept_out_cache_loc_cpu",
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        fill_accept_out_cache_loc,
    ),
    OpDef(
        "assign_draft_cache_locs_contiguous_cpu",
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
        "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()",
        assign_draft_cache_locs_contiguous,
    ),
    OpDef(
        "assign_extend_cache_locs_cpu",
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()",
        assign_extend_cache_locs,
    ),
    OpDef(
        "rotate_input_ids_cpu",
        "(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, "
        "Tensor topk_index, Tensor? select_index) -> ()",
        rotate_input_ids,
    ),
]
