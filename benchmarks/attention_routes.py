"""Which extend attention serves a verify faster: the native kernel or the PyTorch path.

    .venv/bin/python benchmarks/attention_routes.py [--iters 40] [--json out.json]

``attention_native.takes_extend`` routes an extend to the native kernel (each request's paged
K/V read once for all its rows) or to the PyTorch path (K/V gathered into a padded copy, then
PyTorch's fused attention). This times both on the same calls -- the shipped target's shapes
(8 heads, head dim 64, float32), 256 cached tokens per request on scattered pool rows, every
request extending by n tokens, causal (a chain's verify) and with a tree mask -- for batches of
1-32 requests and n of 2-128, in alternating blocks of calls (``cpu_attention._time``), and
prints the median per call and which path the routing takes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_lib import host_info
from cpu_attention import _time, extend_call

from sgl_spec.cpu_kernels import attention, attention_native, native

SHAPES = [(bs, n) for bs in (1, 4, 8, 16, 32) for n in (2, 4, 8, 9, 12, 16)]
SHAPES += [(1, 64), (1, 128), (4, 32)]


@contextlib.contextmanager
def _path(kind: str) -> Iterator[None]:
    """Every extend on the native kernel (``native``) or on the PyTorch path (``torch``)."""
    saved_ops, saved_limit = native._state.get("ops"), attention_native.NATIVE_MAX_EXTEND_TOKENS
    if kind == "torch":
        native._state["ops"] = None
    else:
        attention_native.NATIVE_MAX_EXTEND_TOKENS = 1 << 30
    try:
        yield
    finally:
        native._state["ops"] = saved_ops
        attention_native.NATIVE_MAX_EXTEND_TOKENS = saved_limit


def _timed(kind: str, bs: int, n: int, tree: bool, iters: int) -> float:
    """Median milliseconds per call; a path's calls run in blocks while it is set."""
    call = extend_call(attention.extend_attention, bs, 256, n, tree)
    with _path(kind):
        return statistics.median(_time([call], iters)[0]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.ops() is None:
        raise SystemExit("the native kernels are not built on this host (./setup.sh builds them)")
    rows = []
    print(f"{'bs':>3} {'n':>4} {'mask':>6} {'native ms':>10} {'torch ms':>9} {'torch/native':>13}"
          f" {'routed to':>10}")  # fmt: skip
    for bs, n in SHAPES:
        for tree in (False, True):
            # two passes, ABBA, so that drift over the run hits both paths alike
            native_ms = [_timed("native", bs, n, tree, args.iters // 2)]
            torch_ms = [_timed("torch", bs, n, tree, args.iters // 2)]
            torch_ms.append(_timed("torch", bs, n, tree, args.iters // 2))
            native_ms.append(_timed("native", bs, n, tree, args.iters // 2))
            row = {"batch_size": bs, "tokens": n, "tree": tree,
                   "native_ms": statistics.mean(native_ms), "torch_ms": statistics.mean(torch_ms),
                   "routed_native": attention_native.takes_extend(bs * n, n)}  # fmt: skip
            rows.append(row)
            print(f"{bs:>3} {n:>4} {'tree' if tree else 'causal':>6} {row['native_ms']:>10.2f}"
                  f" {row['torch_ms']:>9.2f} {row['torch_ms'] / row['native_ms']:>13.2f}"
                  f" {'native' if row['routed_native'] else 'torch':>10}")  # fmt: skip
    if args.json:
        result = {"command": " ".join(["benchmarks/attention_routes.py", *sys.argv[1:]]),
                  "host": host_info(), "threads": args.threads, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
