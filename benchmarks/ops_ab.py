"""The CPU fallback ops of this checkout against those of another git revision, in one process.

    .venv/bin/python benchmarks/ops_ab.py --base REV [--batch-sizes 1,8] [--num-tokens 1,4,16]

Loads ``attention``, ``layers`` and ``paged_kv`` of ``sgl_spec/cpu_kernels`` as they are at
``--base`` (``git show``) beside this checkout's, registers one trampoline per op that calls
either, and times SGLang's served forward of the shipped target (``forward_cost.py``'s shapes:
256 cached tokens, DECODE for 1 new token, EXTEND with logits at every position for more),
alternating base and current call by call (ABBA), so host drift hits both alike. Prints the
median served forward of each and their ratio, and per op the time spent in it per forward.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

OP_MODULES = ("paged_kv", "attention", "layers")  # paged_kv first: attention imports it


def load_base_ops(rev: str) -> dict:
    """``{op name: implementation}`` of the fallback ops at git revision ``rev``."""
    tmp = Path(tempfile.mkdtemp(prefix="ops_ab_"))
    impls = {}
    for name in OP_MODULES:
        source = subprocess.run(
            ["git", "show", f"{rev}:sgl_spec/cpu_kernels/{name}.py"],
            cwd=REPO, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        source = source.replace("sgl_spec.cpu_kernels.paged_kv", "_base_paged_kv")
        source = source.replace(
            "from sgl_spec.cpu_kernels import paged_kv", "import _base_paged_kv as paged_kv"
        )
        path = tmp / f"_base_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"_base_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"_base_{name}"] = module
        spec.loader.exec_module(module)
        impls.update({op.name: op.impl for op in getattr(module, "OPS", [])})
    return impls


def install_trampolines(base: dict, mode: dict, spent: dict) -> None:
    """Before SGLang loads the ops: every op that exists at both revisions dispatches on
    ``mode["v"]`` ("base" or "head") and adds its wall time to ``spent``."""
    import sgl_spec.cpu_kernels.registry as registry
    from sgl_spec.cpu_kernels.opdef import OpDef

    all_ops = registry.all_ops

    def ops() -> list[OpDef]:
        out = []
        for op in all_ops():
            if op.name not in base:
                out.append(op)
                continue

            def call(*args, _head=op.impl, _base=base[op.name], _name=op.name):
                tic = time.perf_counter()
                result = (_head if mode["v"] == "head" else _base)(*args)
                key = (mode["v"], _name)
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - tic
                return result

            out.append(OpDef(op.name, op.schema, call))
        return out

    registry.all_ops = ops


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ops_ab.py", allow_abbrev=False)
    p.add_argument("--base", required=True, help="git revision of the ops to compare against")
    p.add_argument("--model", default=None, help="default: the shipped target")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-tokens", default="1,4,16")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    mode, spent = {"v": "head"}, {}
    install_trampolines(load_base_ops(args.base), mode, spent)

    import forward_cost as fc

    from sgl_spec.models.registry import DEFAULT_TARGET, resolve_model_path

    ns = fc.parse_args(["--batch-sizes", args.batch_sizes, "--num-tokens", args.num_tokens])
    runner = fc._load_runner(resolve_model_path(args.model or DEFAULT_TARGET), ns)
    print(f"base {args.base} vs this checkout; median served forward, ABBA by call")
    for bs in ns.batch_sizes:
        reqs = fc.prefilled(runner, bs, ns.ctx_len, max(ns.num_tokens), random.Random(0))
        for n in ns.num_tokens:
            times: dict[str, list[float]] = {"base": [], "head": []}
            spent.clear()
            warmup = 5
            for i in range(warmup + args.iters):
                for v in ("head", "base") if i % 2 else ("base", "head"):
                    mode["v"] = v
                    elapsed = fc._served_forward(runner, reqs, ns.ctx_len, n)
                    if i >= warmup:
                        times[v].append(elapsed * 1e3)
            base, head = statistics.median(times["base"]), statistics.median(times["head"])
            calls = warmup + args.iters
            per_op = " ".join(
                f"{name.removesuffix('_cpu')} {spent[('base', name)] / calls * 1e3:.2f}"
                f"->{spent[('head', name)] / calls * 1e3:.2f}"
                for name in sorted({name for _, name in spent})
            )
            print(f"bs={bs} n={n}: base {base:.2f} ms, this {head:.2f} ms, this/base"
                  f" {head / base:.3f}; ms per forward: {per_op}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
