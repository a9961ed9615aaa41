"""What gathering a step's drafter context costs: ``DrafterKVPool.gather`` from scratch, a
step's gather for the same requests, and one whole-batch index-and-copy.

    .venv/bin/python benchmarks/drafter_gather.py [--iters 30] [--json out.json]

Each SPECBLOCK decode step that drafts gathers every request's committed positions (K key and
value slots each, per drafter layer) from the drafter's KV pool into the step's workspace
(``draft_kv``). On the CPU the served gather writes each request's row straight into the
workspace (``index_select`` per request), and for the same requests as the last gather copies
only the positions committed since. Timed here: a gather from scratch (``forget`` first: a new
batch), a step's gather (3 positions committed per request since the last gather), and the
reference, which indexes the pool with the whole batch's locations (a fresh tensor of the
batch) and copies that into a workspace, as the served code did before session 62. Shipped
drafter's shapes (1 layer, K = 4, 4 KV heads, head dim 64, float32), 250 committed positions
per request on scattered pool rows, batches of 1-32; the variants alternate per iteration and
the median per call is printed.
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
from sgl_spec.specblock.workspace import KVWorkspace

BATCHES = (1, 4, 8, 16, 32)
POSITIONS = 250
STEP_POSITIONS = 3
POOL_ROWS = 20000


def _whole_batch(pool: DrafterKVPool, workspace: KVWorkspace, locs: torch.Tensor) -> None:
    """The reference: index the pool with every location at once, then copy into the
    workspace."""
    bs, t = locs.shape
    k = pool.block_size
    _, _, n_kv, hd = pool.keys[0].shape
    flat = locs.reshape(-1)
    for pools, buffers in ((pool.keys, workspace.keys), (pool.values, workspace.values)):
        for rows, buffer in zip(pools, buffers, strict=True):
            buffer[:, : t * k].view(bs, t, k, n_kv, hd).copy_(rows[flat].view(bs, t, k, n_kv, hd))


def _from_scratch(pool: DrafterKVPool, locs: torch.Tensor, lens: torch.Tensor) -> None:
    pool.forget()
    pool.gather(locs, lens, last_slot_only=True)


class _Steps:
    """A step's gather: each call sees ``STEP_POSITIONS`` more committed positions per request
    than the one before (the pool's rows for them unchanged: written before timing)."""

    def __init__(self, pool: DrafterKVPool, locs: torch.Tensor) -> None:
        self.pool, self.locs, self.calls = pool, locs, 0

    def __call__(self) -> None:
        t = POSITIONS + STEP_POSITIONS * self.calls
        self.calls += 1
        lens = torch.full((self.locs.shape[0],), t)
        self.pool.gather(self.locs[:, :t], lens, last_slot_only=True)


def _pool() -> DrafterKVPool:
    """The shipped drafter's pool shape, rows filled with noise."""
    pool = DrafterKVPool(1, POOL_ROWS, 4, 4, 64, torch.float32, "cpu")
    for store in (*pool.keys, *pool.values):
        store.normal_()
    return pool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drafter_gather.py", allow_abbrev=False)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    pool = _pool()
    # the step gathers on a pool of their own: the scratch gathers forget the pool's last
    step_pool = _pool()
    _, k, n_kv, hd = pool.keys[0].shape
    rows = []
    print(f"{'requests':>8} {'scratch ms':>11} {'step ms':>8} {'whole-batch ms':>15}")
    for bs in BATCHES:
        longest = POSITIONS + STEP_POSITIONS * (args.iters + 1)
        locs = torch.randperm(POOL_ROWS)[: bs * longest].view(bs, longest)
        lens = torch.full((bs,), POSITIONS)
        workspace = KVWorkspace.empty(1, bs, POSITIONS * k, n_kv, hd, torch.float32, "cpu")
        scratch = functools.partial(_from_scratch, pool, locs[:, :POSITIONS], lens)
        steps = _Steps(step_pool, locs)
        reference = functools.partial(_whole_batch, pool, workspace, locs[:, :POSITIONS])
        # one warm-up call each (the workspace grows once), then calls alternating one by one
        times = _time([scratch, steps, reference], args.iters, block=1)
        med = [statistics.median(us) / 1e3 for us in times]
        print(f"{bs:>8} {med[0]:>11.2f} {med[1]:>8.2f} {med[2]:>15.2f}")
        rows.append(
            {"batch_size": bs, "scratch_ms": med[0], "step_ms": med[1], "whole_batch_ms": med[2]}
        )
    if args.json:
        payload = {
            "host": host_info(),
            "positions": POSITIONS,
            "step_positions": STEP_POSITIONS,
            "iters": args.iters,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
