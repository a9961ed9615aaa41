"""Two gloo ranks in spawned processes, for the tensor-parallel unit tests."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch.multiprocessing as mp


def run_two_ranks(target: Callable[[int, str, dict], None]) -> dict:
    """Run ``target(rank, store_file, results)`` in two spawned processes (they join one gloo
    group through ``store_file``) and return what they put in ``results``, by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        results = manager.dict()
        procs = [
            ctx.Process(target=target, args=(r, os.path.join(tmp, "store"), results))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        return dict(results)
