"""What gathering a step's drafter context costs: ``DrafterKVPool.gather`` against one
whole-batch index-and-copy.

    .venv/bin/python benchmarks/drafter_gather.py [--iters 30] [--json out.json]

Each SPECBLOCK decode step that drafts gathers every request's committed positions (K key and
value slots each, per drafter layer) from the drafter's KV pool into the step's workspace
(``draft_kv``). The served gather writes each request's row straight into the workspace
(``index_select`` per request); the reference here indexes the pool with the whole batch's
locations (a fresh tensor of the batch) and copies that into the workspace, as the served code
did before. Shipped drafter's shapes (1 layer, K = 4, 4 KV heads, head dim 64, float32), 250
committed positions per request on scattered pool rows, batches of 1-32; both variants
alternate per iteration and the median per call is printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_lib import host_info
from cpu_attention import _time

from sgl_spec.specblock.draft_kv import DrafterKVPool

BATCHES = (1, 4, 8, 16, 32)
POSITIONS = 250
POOL_ROWS = 20000


def _whole_batch(pool: DrafterKVPool, locs: torch.Tensor) -> None:
    """The reference: index the pool with every location at once, then copy into the
    workspace."""
    bs, t = locs.shape
    k = pool.block_size
    _, _, n_kv, hd = pool.keys[0].shape
    flat = locs.reshape(-1)
    workspace = pool._workspace(bs, t * k)
    for pools, buffers in ((pool.keys, workspace.keys), (pool.values, workspace.values)):
        for rows, buffer in zip(pools, buffers, strict=True):
            buffer[:, : t * k].view(bs, t, k, n_kv, hd).copy_(rows[flat].view(bs, t, k, n_kv, hd))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drafter_gather.py", allow_abbrev=False)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    pool = DrafterKVPool(1, POOL_ROWS, 4, 4, 64, torch.float32, "cpu")
    for store in (*pool.keys, *pool.values):
        store.normal_()
    rows = []
    print(f"{'requests':>8} {'served ms':>10} {'whole-batch ms':>15} {'ratio':>6}")
    for bs in BATCHES:
        locs = torch.randperm(POOL_ROWS)[: bs * POSITIONS].view(bs, POSITIONS)
        lens = torch.full((bs,), POSITIONS)
        served = functools.partial(pool.gather, locs, lens, last_slot_only=True)
        reference = functools.partial(_whole_batch, pool, locs)
        # one warm-up call each (the workspace grows once), then calls alternating one by one
        served_us, reference_us = _time([served, reference], args.iters, block=1)
        med = {
            "served": statistics.median(served_us) / 1e3,
            "whole_batch": statistics.median(reference_us) / 1e3,
        }
        ratio = med["whole_batch"] / med["served"]
        print(f"{bs:>8} {med['served']:>10.2f} {med['whole_batch']:>15.2f} {ratio:>6.2f}")
        rows.append(
            {"batch_size": bs, "served_ms": med["served"], "whole_batch_ms": med["whole_batch"]}
        )
    if args.json:
        payload = {"host": host_info(), "positions": POSITIONS, "iters": args.iters, "rows": rows}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
