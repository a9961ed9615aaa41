"""The start-up hook: on this CPU-only host `import sgl_kernel` works only because of it, in a
fresh interpreter (as SGLang's spawned schedulers are), SGLang sees its CPU kernels as available
even on a CPU without AMX tiles (AMD EPYC), and turning it off restores the
original failure."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = (
    "import sgl_kernel, torch; "
    "from sglang.srt.utils.common import cpu_has_amx_support; "
    "assert hasattr(torch.ops.sgl_kernel, 'extend_attention_cpu'); "
    "assert callable(sgl_kernel.verify_tree_greedy_cpu); "
    "print('amx', cpu_has_amx_support())"
)


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600
    )


def test_fresh_interpreter_gets_fallback_ops() -> None:
    proc = _run({})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "amx True" in proc.stdout  # SGLang now enables its CPU-kernel paths


def test_disabling_the_hook_restores_upstream_failure() -> None:
    proc = _run({"SGLSPEC_CPU_KERNELS": "0"})
    assert proc.returncode != 0
    assert "libcuda" in proc.stderr or "common_ops" in proc.stderr
