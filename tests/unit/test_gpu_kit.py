"""The GPU kit's parts that run anywhere (docs/gpu.md): wheel slimming, the kit list, the CUDA
path's PyTorch ops (on CPU tensors; the device is not what they test), the launcher's settings
for a CUDA host without sgl_kernel, and the optional-kernel patch. The kit itself is proven by
``launch/gpu/dryrun_cpu.sh``, which CI does not run (it downloads ~4 GB)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sgl_spec.cpu_kernels import cuda_ops

ROOT = Path(__file__).resolve().parents[2]
import slim_wheel  # noqa: E402


def _wheel(path: Path) -> Path:
    members = {
        "pkg/__init__.py": b"x = 1\n",
        "pkg/fast.so": b"\0" * 64,
        "pkg/sub/big.so": b"\0" * 64,
        "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n",
        "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\n",
    }
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    record += "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def test_slim_wheel_drops_members_and_their_record_lines(tmp_path: Path) -> None:
    src = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    report = slim_wheel.slim(src, tmp_path / "out", ["pkg/*.so"])
    assert report["dropped"] == {"pkg/*.so": 2}
    with zipfile.ZipFile(tmp_path / "out" / src.name) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
        note = z.read("pkg-1.0.dist-info/SLIMMED").decode()
    assert "pkg/__init__.py" in names and not {"pkg/fast.so", "pkg/sub/big.so"} & names
    assert ".so" not in record and "pkg/__init__.py" in record
    assert "pkg-1.0.dist-info/SLIMMED,," in record and "pkg/*.so\t2 files" in note
    assert record.rstrip().endswith("RECORD,,")


def test_slim_wheel_refuses_stale_patterns_and_metadata(tmp_path: Path) -> None:
    src = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match="match nothing"):
        slim_wheel.slim(src, tmp_path / "out", ["pkg/*.so", "pkg/gone/*"])
    with pytest.raises(SystemExit, match="would drop"):
        slim_wheel.slim(src, tmp_path / "out", ["*/WHEEL"])


def _names(path: Path) -> list[tuple[str, str]]:
    """(normalised name, rest of the line) of each requirement line."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[=<>~! ]", line, maxsplit=1)[0]
            out.append((re.sub(r"[-_.]+", "-", name).lower(), line))
    return out


def test_kit_list_pins_one_version_of_what_the_gpu_machine_lacks() -> None:
    kit = _names(ROOT / "launch" / "gpu" / "kit.txt")
    image = {name for name, _ in _names(ROOT / "launch" / "gpu" / "gpu_image.txt")}
    names = [name for name, _ in kit]
    assert len(names) == len(set(names)), "a package listed twice"
    for name, line in kit:
        assert re.fullmatch(r"[\w.-]+==[\w.]+", line.split()[0]), line
        assert name not in image, f"{name} is on the GPU machine already"
    assert {"sglang", "sglang-kernel", "fastapi", "uvicorn", "pyzmq"} <= set(names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_norms_match_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    ref = F.rms_norm(x.float(), (64,), weight.float(), 1e-6).to(dtype)
    out = torch.empty_like(x)
    cuda_ops.rmsnorm(out, x, weight, 1e-6, False)
    torch.testing.assert_close(out, ref, **tol)
    inp, res = x.clone(), residual.clone()
    cuda_ops.fused_add_rmsnorm(inp, res, weight, 1e-6, False)
    summed = (x.float() + residual.float()).to(dtype)
    torch.testing.assert_close(res, summed, **tol)
    ref2 = F.rms_norm(summed.float(), (64,), weight.float(), 1e-6).to(dtype)
    torch.testing.assert_close(inp, ref2, **tol)


def test_cuda_path_ops_register_with_their_schemas() -> None:
    """Defined under a scratch namespace with the upstream schemas, called through torch.ops:
    the out-arguments are written in place."""
    lib = torch.library.Library("sglspec_kit_test", "DEF")
    for op in cuda_ops.OPS:
        lib.define(op.name + op.schema)
        lib.impl(op.name, op.impl, "CompositeExplicitAutograd")
    ops = torch.ops.sglspec_kit_test
    x = torch.randn(3, 16)
    out = torch.empty(3, 8)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :8]) * x[:, 8:])
    normed = torch.empty_like(x)
    ops.rmsnorm(normed, x, torch.ones(16), 1e-6, False)
    torch.testing.assert_close(normed, F.rms_norm(x, (16,), torch.ones(16), 1e-6))
    inp, res = x.clone(), torch.ones_like(x)
    ops.fused_add_rmsnorm(inp, res, torch.ones(16), 1e-6, False)
    torch.testing.assert_close(res, x + 1)


def test_cuda_fallback_defaults_fill_only_what_the_user_left_open() -> None:
    from sgl_spec.launch_server import apply_cuda_fallback_defaults

    env: dict[str, str] = {}
    argv = apply_cuda_fallback_defaults(["--model-path", "m"], env, graphs=False)
    assert argv == ["--model-path", "m", "--attention-backend", "triton",
                    "--sampling-backend", "pytorch", "--disable-cuda-graph"]  # fmt: skip
    assert env == {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch"}
    env = {"SGLANG_FORCE_FUSED_OP_BACKEND": "auto"}
    argv = apply_cuda_fallback_defaults(["--attention-backend", "fa3"], env, graphs=False)
    assert argv == ["--attention-backend", "fa3", "--sampling-backend", "pytorch",
                    "--disable-cuda-graph"]  # fmt: skip
    assert env["SGLANG_FORCE_FUSED_OP_BACKEND"] == "auto"
    # weak_ref_tensor served: graphs stay on; a user's graph flag is never overridden
    argv = apply_cuda_fallback_defaults(["--model-path", "m"], {}, graphs=True)
    assert "--disable-cuda-graph" not in argv
    user = ["--cuda-graph-backend-decode", "full"]
    assert "--disable-cuda-graph" not in apply_cuda_fallback_defaults(user, {}, graphs=False)


def test_flashmla_backend_stand_in_where_flash_mla_is_missing() -> None:
    """In a fresh interpreter: without the flash_mla package the backend module imports as a
    stand-in whose FlashMLABackend nothing is an instance of and which cannot be built."""
    code = """
import json, sys
sys.modules["flash_mla"] = None  # as if the package were missing: its import raises
from sgl_spec.patches import cuda_optional_kernels as p
p.apply(cuda=True, missing=["flash_mla"])
from sglang.srt.layers.attention.flashmla_backend import FlashMLABackend
try:
    FlashMLABackend()
    built = True
except ImportError:
    built = False
print(json.dumps({"instance": isinstance(object(), FlashMLABackend), "built": built}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"instance": False, "built": False}


def test_algorithms_turn_cuda_graphs_off_in_the_resolved_config() -> None:
    """SGLang resolves cuda_graph_config before an algorithm sees the arguments: the legacy
    flag alone left graphs on (seen on an H200); both phases must end up disabled, the
    caller's config object untouched."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig

    from sgl_spec.common.algorithm import disable_cuda_graphs

    resolved = CudaGraphConfig()
    args = SimpleNamespace(cuda_graph_config=resolved, disable_cuda_graph=False)
    disable_cuda_graphs(args)
    assert args.cuda_graph_config.decode.backend == Backend.DISABLED
    assert args.cuda_graph_config.prefill.backend == Backend.DISABLED
    assert args.disable_cuda_graph and resolved.decode.backend == Backend.FULL
    unset = SimpleNamespace(cuda_graph_config=None, disable_cuda_graph=False)
    disable_cuda_graphs(unset)
    assert unset.cuda_graph_config.decode.backend == Backend.DISABLED


def test_weak_ref_tensor_views_without_owning() -> None:
    """Same memory, sizes, strides and dtype as its input (a strided view too); writes show
    through both ways; the view's storage holds no reference to the owner's."""
    lib = torch.library.Library("sglspec_weakref_test", "DEF")
    op = next(op for op in cuda_ops.OPS if op.name == "weak_ref_tensor")
    lib.define(op.name + op.schema)
    lib.impl(op.name, op.impl, "CompositeExplicitAutograd")
    owner = torch.randn(5, 8, dtype=torch.bfloat16)
    x = owner[1:, ::3]
    ref = torch.ops.sglspec_weakref_test.weak_ref_tensor(x)
    assert ref.data_ptr() == x.data_ptr() and ref.shape == x.shape
    assert ref.stride() == x.stride() and ref.dtype == x.dtype
    assert torch.equal(ref, x)
    ref.fill_(2.0)
    assert torch.equal(x, torch.full_like(x, 2.0))
    assert not ref.untyped_storage()._cdata == owner.untyped_storage()._cdata
    assert ref.untyped_storage().nbytes() < owner.untyped_storage().nbytes()
    assert torch.ops.sglspec_weakref_test.weak_ref_tensor(torch.empty(0, 3)).shape == (0, 3)


def test_optional_kernel_patch_stands_in_for_missing_packages() -> None:
    """In a fresh interpreter (the patch changes SGLang modules): told CUDA is there and
    cutlass / flashinfer are not, dense MLPs skip the dual GEMM and the sampled verify uses the
    PyTorch tree sampler; told nothing is missing, it changes nothing."""
    code = """
import json
from sgl_spec.patches import cuda_optional_kernels as p
from sglang.srt.layers.dual_gemm import DualGemm
import sglang.srt.speculative.eagle_utils as eu
from sgl_spec.verify import tree_sampling
before = eu.tree_speculative_sampling_target_only
untouched = not p.apply(cuda=True, missing=[]) and not p.apply(cuda=False, missing=["cutlass"])
untouched = untouched and eu.tree_speculative_sampling_target_only is before
applied = p.apply(cuda=True, missing=["cutlass", "flashinfer"])
print(json.dumps({
    "untouched": untouched,
    "applied": applied,
    "dual_gemm_off": DualGemm._select_mode(object(), None, 64) is None,
    "sampler": eu.tree_speculative_sampling_target_only
        is tree_sampling.tree_speculative_sampling_target_only,
    "renorm": eu.top_k_renorm_prob is tree_sampling.top_k_renorm_prob
        and eu.top_p_renorm_prob is tree_sampling.top_p_renorm_prob,
}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"untouched": True, "applied": True, "dual_gemm_off": True,
                      "sampler": True, "renorm": True}  # fmt: skip


def test_profile_summary_of_a_known_trace(tmp_path: Path) -> None:
    """``profile_step.summarize`` on a hand-written chrome trace: GPU busy time is the union of
    overlapping kernels, host self times subtract nested children, runtime calls are counted."""
    import gzip

    import profile_step

    def ev(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [
        ev("cpu_op", "outer", 0, 100),
        ev("cpu_op", "inner", 10, 30),
        ev("cpu_op", "inner", 50, 20),
        ev("cuda_runtime", "cudaStreamSynchronize", 80, 10),
        ev("cuda_runtime", "cudaStreamSynchronize", 90, 5),
        ev("kernel", "gemm", 20, 40, tid=7),
        ev("kernel", "gemm", 50, 20, tid=7),  # overlaps the first: busy 20..70
        ev("gpu_memcpy", "copy", 80, 10, tid=7),
        {"ph": "i", "name": "instant", "ts": 5},  # not a complete event: ignored
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    out = profile_step.summarize(path, num_steps=2)
    assert out["window_ms"] == 0.1 and out["window_ms_per_step"] == 0.05
    assert out["gpu_busy_ms"] == 0.06 and out["gpu_busy_share"] == 0.6
    assert out["top_gpu"][0] == ["gemm", 0.06, 2]
    assert out["top_runtime"] == [["cudaStreamSynchronize", 0.015, 2]]
    assert out["top_cpu_op_self"] == [["inner", 0.05, None], ["outer", 0.05, None]]
    assert profile_step.union_us([(0, 10), (5, 20), (30, 40)]) == 30
