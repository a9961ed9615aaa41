"""Run one of ``tests/helpers/*_check.py`` on a model in a process of its own (SGLang's model
runner and torch.compile keep process-wide state) and read back the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_check(script: str, model: str, out_dir: Path, timeout: int = 600) -> dict:
    """``python tests/helpers/<script> MODEL OUT_JSON``; its result (asserting it exited 0)."""
    out = out_dir / f"{Path(script).stem}.json"
    cmd = [sys.executable, str(REPO / "tests" / "helpers" / script), model, str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
