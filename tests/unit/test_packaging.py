"""What the wheel ships: every file the shipped models need, within a size budget, and no
training logs (loss curves, training.json)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sgl_spec"
WEIGHTS = PACKAGE / "models" / "weights"
# Every shipped weight file together (target, two drafts, MTP adapter, three SpecBlock drafters).
WEIGHTS_BUDGET_MB = 125
FILE_BUDGET_MB = 64  # one file (git and wheel friendliness)


def shipped_data_files() -> list[Path]:
    """Non-Python files of ``sgl_spec`` that setuptools' package-data settings put in the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = config["package-data"]["sgl_spec"]
    exclude = config.get("exclude-package-data", {}).get("sgl_spec", [])

    def matches(rel: str, patterns: list[str]) -> bool:
        # setuptools globs are relative to the package; "**/x" also matches "x" at any depth
        return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p.removeprefix("**/"))
                   for p in patterns)  # fmt: skip

    files = []
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.is_file() and path.suffix != ".py" and "__pycache__" not in rel:
            if matches(rel, include) and not matches(rel, exclude):
                files.append(path)
    return files


def test_the_shipped_models_files_are_in_the_wheel() -> None:
    shipped = {
        p.relative_to(WEIGHTS).as_posix() for p in shipped_data_files() if WEIGHTS in p.parents
    }
    for model in ("tiny-code", "tiny-code-draft-narrow", "tiny-code-draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"{model}/{name}" in shipped
    for drafter in ("tiny-code-specblock-narrow", "tiny-code-specblock", "tiny-code-specblock-k1"):
        assert {f"{drafter}/config.json", f"{drafter}/model.safetensors"} <= shipped
    # the adapter, and the held-out acceptance its controller prior reads
    for name in ("adapter_config.json", "adapter.safetensors", "metrics.json"):
        assert f"tiny-code-mtp/{name}" in shipped


def test_no_training_logs_in_the_wheel() -> None:
    logs = [p for p in shipped_data_files() if p.suffix == ".png" or p.name == "training.json"]
    assert not logs, logs


def test_every_shipped_weight_file_fits_the_budget() -> None:
    weights = [p for p in WEIGHTS.rglob("*") if p.is_file()]
    assert weights
    too_big = [p for p in weights if p.stat().st_size > FILE_BUDGET_MB * 1e6]
    assert not too_big, too_big
    total_mb = sum(p.stat().st_size for p in shipped_data_files()) / 1e6
    assert total_mb <= WEIGHTS_BUDGET_MB, f"{total_mb:.1f} MB shipped"
