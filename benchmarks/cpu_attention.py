"""Per-call cost of the CPU fallback attention ops: fast path against the float64 reference.

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--iters 200] [--served]

Shapes of the shipped model (8 query heads, 8 KV heads, head_dim 64, fp32) on a context of
256 cached tokens whose pool rows are scattered (as after many decode steps): decode (1 query
per request), target-verify of a 4-token chain (causal) and of a 32-token draft tree
(``tree_mask``), at batch 1 and 8, plus one 256-token prefill; ``--served`` adds SPECBLOCK's
8-node tree and MTP_LORA's 9-token verify at batch 1, and decodes and 2- and 4-token verifies
at batch 16 and 32. The two versions run in alternating blocks of 10 calls, so drift from
other load on the host hits both alike; printed per case are the median and the minimum over
``--iters`` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sgl_spec.cpu_kernels import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the reference lives in tests/
from tests.helpers import attention_reference

HEADS, KV_HEADS, HEAD_DIM, POOL = 8, 8, 64, 20000


def _pool(bs: int, keys: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    req_to_token = torch.zeros(bs + 1, 4096, dtype=torch.int32)
    perm = torch.randperm(POOL - 1, generator=gen)[: bs * keys] + 1
    req_to_token[1:, :keys] = perm.view(bs, keys).to(torch.int32)
    return {
        "req_to_token": req_to_token,
        "req_pool_indices": torch.arange(1, bs + 1),
        "k": torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen),
        "v": torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen),
    }


def decode_call(impl: Callable, bs: int, context: int) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    p = _pool(bs, context + 1, gen)
    query = torch.randn(bs, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(query)
    seq_lens = torch.full((bs,), context + 1, dtype=torch.int64)
    loc = p["req_to_token"][1:, context].long()
    key = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen)
    args = (query, p["k"], p["v"], 1.0, 1.0, out, key, value, loc, torch.empty(0))
    rest = (p["req_to_token"], p["req_pool_indices"], seq_lens, HEAD_DIM**-0.5, 0.0, False, 0)
    return lambda: impl(*args, *rest, None, None)


def extend_call(impl: Callable, bs: int, context: int, n: int, tree: bool) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    p = _pool(bs, context + n, gen)
    q = torch.randn(bs * n, HEADS, HEAD_DIM, generator=gen)
    k_ext = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    v_ext = torch.randn(bs * n, KV_HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    seq_lens = torch.full((bs,), context + n, dtype=torch.int64)
    ext_lens = torch.full((bs,), n, dtype=torch.int32)
    starts = torch.arange(0, bs * n, n, dtype=torch.int32)
    mask = None
    if tree:  # each draft token sees itself and a random subset of earlier ones
        block = torch.tril(torch.rand(n, n, generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool)
        mask = block.flatten().repeat(bs)
    args = (q, k_ext, v_ext, out, p["k"], p["v"], 1.0, 1.0, p["req_to_token"])
    rest = (p["req_pool_indices"], seq_lens, ext_lens, starts, n, HEAD_DIM**-0.5, 0.0, False, 0)
    return lambda: impl(*args, *rest, None, None, mask, True)


def cases(served: bool = False) -> list[tuple[str, Callable[[Callable], Callable[[], None]]]]:
    out: list[tuple[str, Callable[[Callable], Callable[[], None]]]] = []
    for bs in (1, 8):
        out.append((f"decode bs={bs}", lambda f, bs=bs: decode_call(f, bs, 256)))
        out.append((f"verify 4 bs={bs}", lambda f, bs=bs: extend_call(f, bs, 256, 4, False)))
        out.append((f"tree 32 bs={bs}", lambda f, bs=bs: extend_call(f, bs, 256, 32, True)))
    out.append(("prefill 256 bs=1", lambda f: extend_call(f, 1, 0, 256, False)))
    if served:  # the shipped algorithms' verifies: SPECBLOCK's 8 nodes, MTP_LORA k = 2
        out.append(("tree 8 bs=1", lambda f: extend_call(f, 1, 256, 8, True)))
        # MTP_LORA's (1 + k)^2 rows: each draft followed by its own k mask tokens
        out.append(("verify 9 bs=1", lambda f: extend_call(f, 1, 256, 9, True)))
        for bs in (16, 32):  # and the chains at a large batch, beside its decode
            out.append((f"decode bs={bs}", lambda f, bs=bs: decode_call(f, bs, 256)))
            for n in (2, 4):
                out.append(
                    (f"verify {n} bs={bs}", lambda f, bs=bs, n=n: extend_call(f, bs, 256, n, False))
                )
    return out


def _time(fns: list[Callable[[], None]], iters: int, block: int = 10) -> list[list[float]]:
    """Times ``iters`` calls of each function, in alternating blocks of ``block`` calls (a
    block is what a served step does: the same op again, not the other version's memory)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, iters // block)):
        for fn, ts in zip(fns, times, strict=True):
            for _ in range(block):
                start = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--served", action="store_true", help="add the verifies the shipped algorithms serve"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} iters={args.iters}; microseconds per call")
    print(f"{'case':18} {'ref median':>11} {'fast median':>11} {'ref min':>9} {'fast min':>9}")
    for name, make in cases(args.served):
        ref = make(attention_reference.decode_attention_reference)
        fast = make(attention.decode_attention)
        if not name.startswith("decode"):
            ref = make(attention_reference.extend_attention_reference)
            fast = make(attention.extend_attention)
        iters = max(10, args.iters // 8) if "prefill" in name else args.iters
        t_ref, t_fast = _time([ref, fast], iters)
        print(
            f"{name:18} {statistics.median(t_ref):11.0f} {statistics.median(t_fast):11.0f}"
            f" {min(t_ref):9.0f} {min(t_fast):9.0f}"
        )


if __name__ == "__main__":
    main()
