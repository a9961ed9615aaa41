"""``python -m sgl_spec.launch_server``: SGLang's own server, with sgl-spec loaded.

Accepts every ``sglang.launch_server`` flag plus ours (``--help`` lists both). On a host
without CUDA it fills in the settings SGLang's CPU engine needs, unless the user gave them.
Work stays under ``__main__``: SGLang spawns its scheduler with multiprocessing *spawn*.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sgl_spec.argv import flag_value, has_flag
from sgl_spec.config import ENV_VAR, ConfigError, SpecConfig
from sgl_spec.cpu_memory import read_model_config, size_cpu_kv_pool, total_ram_bytes

logger = logging.getLogger("sgl_spec.launch_server")


def is_cpu_host() -> bool:
    import torch

    return not torch.cuda.is_available()


# glibc malloc settings for the CPU engine's processes (read by each spawned process at start).
# A forward's large temporaries (attention's gathered K/V, the MLP's activations: megabytes at
# batch 8) sit around glibc's *dynamic* mmap threshold; a process whose threshold has not
# risen past them maps and unmaps them on every call and pays a page fault per 4 KiB touched,
# and which state a server lands in varies from run to run (docs/cpu.md). Pinning the threshold at glibc's maximum (32 MiB) and keeping freed memory instead of
# trimming it serves those temporaries from the heap in every process from the start.
# THP_MEM_ALLOC_ENABLE makes PyTorch's CPU allocator ask for transparent huge pages
# (madvise) for its large buffers, the weights among them: a forward streams ~100 MB of
# weights, and with 4 KiB pages every 4 KiB is a TLB entry. It applies where the kernel's THP
# mode is `madvise` or `always`, the common defaults, and is ignored under `never`.
CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024 * 1024),
    "THP_MEM_ALLOC_ENABLE": "1",
}
# SGLang's eager model runner copies each forward's inputs into static buffers laid out for
# CUDA-graph replay (``EagerRunner.load_batch``); the CPU engine replays no such graph, so the
# copy is per-forward Python and tensor work for nothing (~80 us of a ~0.65 ms draft-model
# decode). ``SGLANG_EAGER_INPUT_NO_COPY``, SGLang's own switch, runs on the batch's tensors.
CPU_ENGINE_ENV = {"SGLANG_EAGER_INPUT_NO_COPY": "1"}


def keyed_inductor_cache(environ: dict[str, str]) -> None:
    """Point torch.compile's cache (SGLang's CPU graph runner) at a directory of its own per
    build of our ops (``native.graph_cache_key``) unless the user chose one: a graph cached
    with other fakes or another KV layout would be replayed as it is."""
    from sglang.srt.environ import third_party_cache_defaults

    from sgl_spec.cpu_kernels import native

    default = third_party_cache_defaults()["TORCHINDUCTOR_CACHE_DIR"]
    if environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-sgl-spec-{native.graph_cache_key()}"


def checkpoint_dtype(model_path: str | None) -> str | None:
    """The ``dtype`` (or legacy ``torch_dtype``) a local model directory's config.json names."""
    config = read_model_config(model_path) or {}
    value = config.get("dtype") or config.get("torch_dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else None


def apply_cpu_defaults(
    argv: list[str], environ: dict[str, str], config: SpecConfig | None = None
) -> list[str]:
    """SGLang's CPU-engine settings, each only where the user did not choose otherwise
    (``--sgl-spec-cpu-defaults off`` keeps SGLang's own, ``--sleep-on-idle`` off among them).

    A float32 checkpoint is served in float32: SGLang's ``--dtype auto`` would serve it in
    float16 (the GPU convention); on a CPU without native half-precision matrix units a
    half-precision GEMM runs in PyTorch's generic kernel, whose cost grows faster with the
    rows of a verify block than float32's BLAS does (benchmarks/RESULTS.md).
    The KV pool is sized from the model unless the user sized it (``cpu_memory``)."""
    argv = list(argv)
    if not has_flag(argv, "--device"):
        argv += ["--device", "cpu"]
    if not has_flag(argv, "--dtype") and checkpoint_dtype(flag_value(argv, "--model-path")) == (
        "float32"
    ):
        argv += ["--dtype", "float32"]
    environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sgl_spec.algorithms import cores_set_apart, rank_cores
    from sgl_spec.argv import LaunchArgs

    launch = LaunchArgs.from_argv(argv)
    apart = cores_set_apart(config, launch, environ)
    rank_cores(launch.num_ranks, environ, launch.local_ranks, apart)
    for name, value in {**CPU_MALLOC_ENV, **CPU_ENGINE_ENV}.items():
        environ.setdefault(name, value)
    keyed_inductor_cache(environ)
    if not has_flag(argv, "--attention-backend"):
        argv += ["--attention-backend", "intel_amx"]
    if not has_flag(argv, "--disable-overlap-schedule", "--enable-overlap-schedule"):
        argv += ["--disable-overlap-schedule"]
    if not has_flag(argv, "--sleep-on-idle"):
        # An idle scheduler otherwise loops without blocking and holds a whole core, which on
        # a CPU host is compute the other servers and processes lose; it blocks on its input
        # sockets instead and wakes the moment a request arrives.
        argv += ["--sleep-on-idle"]
    sizing = size_cpu_kv_pool(argv, total_ram_bytes())
    if sizing is not None:
        argv += ["--max-total-tokens", str(sizing.max_total_tokens)]
        logger.info("sgl_spec: %s", sizing.reason)
    return argv


def sgl_kernel_stands_in() -> bool:
    """True when the compiled ``sgl_kernel`` library could not load and our PyTorch ops serve
    in its place (``sgl_spec.cpu_kernels.boot``)."""
    try:
        import sgl_kernel  # noqa: F401  (the import is what decides)
    except ImportError:
        return False
    from sgl_spec.cpu_kernels.boot import fallback_active

    return fallback_active()


GRAPH_FLAGS = (
    "--disable-cuda-graph",
    "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill",
    "--disable-decode-cuda-graph",
    "--disable-prefill-cuda-graph",
    "--cuda-graph-config",
)


def cuda_graphs_served() -> bool:
    """Whether ``sgl_kernel.weak_ref_tensor`` (what SGLang's CUDA-graph capture calls) is
    defined: the compiled library's or sgl-spec's PyTorch one (``cpu_kernels/cuda_ops.py``)."""
    from sgl_spec.cpu_kernels.registry import op_defined

    return op_defined("weak_ref_tensor")


def apply_cuda_fallback_defaults(
    argv: list[str], environ: dict[str, str], graphs: bool | None = None
) -> list[str]:
    """Settings for a CUDA host without a loadable ``sgl_kernel`` (docs/gpu.md), each only where
    the user did not choose otherwise: SGLang's torch-native RMSNorm / SiluAndMul / RoPE, the
    triton attention backend, the PyTorch sampling backend; CUDA graphs stay on where
    ``weak_ref_tensor`` is served (``graphs``; default: asked of the op registry), else off."""
    if graphs is None:
        graphs = cuda_graphs_served()
    added = []
    for flags in (("--attention-backend", "triton"), ("--sampling-backend", "pytorch")):
        if not has_flag(argv, flags[0]):
            added += flags
    if not graphs and not has_flag(argv, *GRAPH_FLAGS):
        added += ["--disable-cuda-graph"]
    environ.setdefault("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")
    logger.warning(
        "sgl_spec: the compiled sgl_kernel library cannot load on this CUDA host; serving with "
        "PyTorch ops, SGLANG_FORCE_FUSED_OP_BACKEND=%s and %s",
        environ["SGLANG_FORCE_FUSED_OP_BACKEND"],
        " ".join(added) or "the user's flags",
    )
    return [*argv, *added]


def build_sglang_argv(argv: list[str], config: SpecConfig, environ: dict[str, str]) -> list[str]:
    cpu = is_cpu_host()
    if config.cpu_defaults == "on" or (config.cpu_defaults == "auto" and cpu):
        return apply_cpu_defaults(argv, environ, config)
    if not cpu and sgl_kernel_stands_in():
        argv = apply_cuda_fallback_defaults(argv, environ)
    return argv


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m sgl_spec.launch_server",
        description="SGLang server with the sgl-spec speculative decoding plugin.",
    )
    ServerArgs.add_cli_args(parser)
    SpecConfig.add_cli_args(parser)
    parser.print_help()


def main(argv: list[str]) -> None:
    if has_flag(argv, "-h", "--help"):
        print_help()
        return
    logging.basicConfig(  # SGLang configures its own logging later, in run_server
        level=(flag_value(argv, "--log-level") or "info").upper(),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    from sgl_spec.algorithms import prepare_launch

    try:
        config, sglang_argv = prepare_launch(argv)
    except ConfigError as exc:
        sys.exit(f"sgl_spec.launch_server: error: {exc}")
    from sgl_spec.cpu_kernels import native
    from sgl_spec.cpu_kernels.install import ensure_boot_hook

    ensure_boot_hook()
    native.ensure_built()  # once per host and source, before any server process loads it
    os.environ[ENV_VAR] = config.to_env()
    sglang_argv = build_sglang_argv(sglang_argv, config, os.environ)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
