"""What a verify block costs in the linear layers on this CPU: T(n)/T(1) for n-row GEMMs.

Speculation pays when verifying n tokens costs little more than decoding one. On a GPU a small
GEMM is bound by reading the weights, so T(n) ~ T(1) for small n; on a CPU it need not be.
This prints, for the shipped target's linear shapes (and larger ones for reference), the time of
an [n x in] x [in x out] float32 GEMM through PyTorch's default path (MKL here) and through
oneDNN with a prepacked weight, the ratio T(n)/T(1), the single-thread peak GEMM rate and the
memory read bandwidth: the roofline that bounds T(n)/T(1) from below.

    .venv/bin/python benchmarks/gemm_rows.py [--threads 1] [--json out.json]

``--forward`` instead times every linear layer of one forward of the shipped target (8 layers:
fused q/k/v, o, fused gate/up, down; 104 MB of float32 weights, more than the last-level cache
holds, as in serving) at 1-64 rows, through ``F.linear``, through MKL's GEMM on weights packed
ahead of time (``torch.ops.mkl._mkl_linear``, the ``mkl`` kind of the ``cpu_packed_linear``
patch) and, where it is built, through our native kernel (its default kind), alternating the
paths forward by forward.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

ROWS = (1, 2, 4, 8, 16)
# (out, in): the shipped target's q/k/v/o, gate/up, down and tied output head; then larger
# layers for reference (weights that do not fit the last-level cache).
SHAPES = ((512, 512), (1280, 512), (512, 1280), (4096, 512), (4096, 4096), (11008, 2048))


def timed(fn, x: torch.Tensor, min_s: float = 0.2) -> float:
    """Median seconds per call over batches of calls lasting about ``min_s`` in all."""
    for _ in range(5):
        fn(x)
    reps = 10
    while True:
        tic = time.perf_counter()
        for _ in range(reps):
            fn(x)
        if time.perf_counter() - tic > min_s / 5 or reps > 10_000:
            break
        reps *= 2
    samples = []
    for _ in range(5):
        tic = time.perf_counter()
        for _ in range(reps):
            fn(x)
        samples.append((time.perf_counter() - tic) / reps)
    return sorted(samples)[2]


def peak_gflops() -> float:
    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    return 2 * 512 * 2048 * 2048 / timed(lambda x: x @ b, a) / 1e9


def read_gbps() -> float:
    x = torch.randn(64 * 1024 * 1024 // 4)  # 64 MiB, larger than any last-level cache here
    return x.numel() * 4 / timed(torch.sum, x) / 1e9


def measure(shape: tuple[int, int]) -> dict:
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features)
    packed = weight.to_mkldnn()
    rows = {}
    for n in ROWS:
        x = torch.randn(n, in_features)
        dense = timed(lambda v: F.linear(v, weight), x)
        onednn = timed(lambda v: torch._C._nn.mkldnn_linear(v, packed), x.to_mkldnn())
        rows[n] = {"default_us": dense * 1e6, "onednn_us": onednn * 1e6}
    for path in ("default", "onednn"):
        base = rows[1][f"{path}_us"]
        for n in ROWS:
            rows[n][f"{path}_ratio"] = rows[n][f"{path}_us"] / base
    return {"shape": list(shape), "weight_mb": weight.numel() * 4 / 1e6, "rows": rows}


# one forward of the shipped target: 8 x (fused q/k/v, o, fused gate/up, down)
FORWARD_SHAPES = ((1536, 512), (512, 512), (2560, 512), (512, 1280)) * 8
FORWARD_ROWS = (1, 2, 4, 6, 9, 16, 32, 64)  # 6, 9: MTP_LORA's gated rows and width at k = 2


def forward_set(threads: int, reps: int = 40) -> list[dict]:
    """Median ms per forward's linears: ``F.linear``, packed MKL and our native kernel (where
    built), alternating."""
    import statistics

    from sgl_spec.cpu_kernels import native

    ops = native.ops()
    torch.set_num_threads(threads)
    weights = [torch.randn(o, i) * 0.02 for o, i in FORWARD_SHAPES]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in weights]
    panels = [ops.pack_linear_weight(w) for w in weights] if ops is not None else None
    rows_out = []
    for n in FORWARD_ROWS:
        xs = {i: torch.randn(n, i) for _, i in FORWARD_SHAPES}
        paths = {
            "default": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
            "packed": lambda xs=xs, n=n: [
                torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, n)
                for w, p in zip(weights, packed, strict=True)
            ],
        }
        if panels is not None:
            paths["native"] = lambda xs=xs: [
                ops.packed_linear(xs[w.shape[1]], p, w.shape[0], None)
                for w, p in zip(weights, panels, strict=True)
            ]
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(reps):
            for name in list(paths)[:: 1 if r % 2 else -1]:
                tic = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - tic)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows_out.append({"rows": n, **{f"{k}_ms": v for k, v in ms.items()}})
        others = "  ".join(f"{k} {v:6.2f} ms ({v / ms['default']:.3f}x)"
                           for k, v in ms.items() if k != "default")  # fmt: skip
        print(f"rows {n:2d}: F.linear {ms['default']:6.2f} ms  {others}")
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--forward", action="store_true", help="one target forward's linears")
    args = parser.parse_args()
    if args.forward:
        from sgl_spec.cpu_kernels.native import _cpu_flags

        isa = [f for f in ("avx2", "fma", "avx512f", "amx_tile") if f in _cpu_flags().split()]
        result = {"threads": args.threads, "isa": isa, "forward": forward_set(args.threads)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    torch.set_num_threads(args.threads)
    host = {"cpu": platform.processor() or platform.machine(), "threads": args.threads}
    try:
        host["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    peak, bandwidth = peak_gflops(), read_gbps()
    print(f"host: {host}  torch {torch.__version__}")
    print(f"peak GEMM {peak:.1f} GFLOP/s, memory read {bandwidth:.1f} GB/s")
    print("shape (out x in)  MB    path     " + "  ".join(f"T({n})/T(1)" for n in ROWS[1:]))
    results = []
    for shape in SHAPES:
        r = measure(shape)
        results.append(r)
        for path in ("default", "onednn"):
            ratios = "  ".join(f"{r['rows'][n][f'{path}_ratio']:9.2f}" for n in ROWS[1:])
            label = f"{shape[0]}x{shape[1]}"
            print(f"{label:<16} {r['weight_mb']:5.1f}  {path:<8} {ratios}")
        print(f"{'':<22} T(1): default {r['rows'][1]['default_us']:.0f} us,"
              f" oneDNN {r['rows'][1]['onednn_us']:.0f} us")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"host": host, "peak_gflops": peak, "read_gbps": bandwidth, "shapes": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
