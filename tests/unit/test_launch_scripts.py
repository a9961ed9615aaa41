"""The launch scripts (``launch/*.sh``, docs/cpu.md and docs/gpu.md): each prints its usage on
``--help``, and on ``--dry-run`` a ``python -m sgl_spec.launch_server`` command whose arguments
our flag parser, SGLang's ``ServerArgs`` parser and the launcher's own pre-start checks accept,
with the algorithm and layout the script names. No server starts; no GPU is needed (the GPU
scripts' commands are parsed and checked as on a host with 8 GPUs, not run)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sgl_spec.algorithms import prepare_model_args
from sgl_spec.argv import LaunchArgs
from sgl_spec.config import SpecConfig, split_argv

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
# What the scripts read from the environment: cleared so the host's own settings cannot leak in.
SCRIPT_ENV = ("PYTHON", "HOST", "PORT", "DRY_RUN", "GPU", "TP", "NUM_STEPS", "DRAFT_CORES")
SCRIPT_ENV += ("DRAFT_DEVICE",)


@dataclass(frozen=True)
class Case:
    algorithm: str | None
    gpu: bool
    # ServerArgs fields the default command must set (beyond the algorithm and device).
    server_args: dict[str, object] = field(default_factory=dict)
    # SpecConfig fields after the launcher filled the shipped defaults.
    config: dict[str, object] = field(default_factory=dict)
    # Where the second positional argument goes: a ServerArgs or SpecConfig field.
    second: str | None = None


CHAIN = {"speculative_num_steps": 3}
STANDALONE_CHAIN = {**CHAIN, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
ONE_GPU = {"base_gpu_id": 0, "tp_size": 1}
MTP = {"mtp_lora_path": "sgl-spec/tiny-code-mtp", "mtp_k": "auto"}
SPECBLOCK = {
    "specblock_drafter_path": "sgl-spec/tiny-code-specblock-narrow",
    "specblock_max_nodes": 8,
}

CASES = {
    "none_cpu.sh": Case(None, gpu=False),
    "none_gpu.sh": Case(None, gpu=True, server_args=ONE_GPU),
    "standalone_cpu.sh": Case(
        "STANDALONE_FULL", False, STANDALONE_CHAIN, second="speculative_draft_model_path"
    ),
    "standalone_gpu.sh": Case(
        "STANDALONE_FULL",
        True,
        {**STANDALONE_CHAIN, **ONE_GPU},
        second="speculative_draft_model_path",
    ),
    "mtp_lora_cpu.sh": Case("MTP_LORA", False, config=MTP, second="mtp_lora_path"),
    "mtp_lora_gpu.sh": Case("MTP_LORA", True, ONE_GPU, MTP, second="mtp_lora_path"),
    "specblock_cpu.sh": Case("SPECBLOCK", False, config=SPECBLOCK, second="specblock_drafter_path"),
    "specblock_gpu.sh": Case(
        "SPECBLOCK", True, ONE_GPU, SPECBLOCK, second="specblock_drafter_path"
    ),
    "minedraft_cpu.sh": Case(
        "MINEDRAFT",
        False,
        CHAIN,
        {"speculative_draft_device": "cpu:1"},
        second="speculative_draft_model_path",
    ),
    "minedraft_gpu.sh": Case(
        "MINEDRAFT",
        True,
        {**CHAIN, **ONE_GPU},
        {"speculative_draft_device": "cuda:1"},
        second="speculative_draft_model_path",
    ),
}


def run_script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    return subprocess.run(
        ["bash", str(LAUNCH / name), *args],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=30,
    )


def dry_run(name: str, *args: str, **env: str) -> list[str]:
    """The launcher arguments of the command ``name`` prints on --dry-run."""
    result = run_script(name, "--dry-run", *args, **env)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:3] == [str(ROOT / ".venv" / "bin" / "python"), "-m", "sgl_spec.launch_server"]
    return argv[3:]


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[SpecConfig, object]:
    """As the launcher splits them: (our config, SGLang's namespace); nothing left unparsed."""
    config, sglang_argv = split_argv(argv)
    ns, unknown = parser.parse_known_args(sglang_argv)
    assert unknown == [], f"SGLang does not know {unknown}"
    return config, ns


def test_every_launch_script_has_a_case_and_a_docs_page() -> None:
    scripts = {p.name for p in LAUNCH.glob("*.sh")} - {"_common.sh"}
    assert scripts == set(CASES), "a launch/*.sh script without a test case, or a stale case"
    assert all(os.access(LAUNCH / name, os.X_OK) for name in scripts), "not executable"
    docs = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    undocumented = [name for name in sorted(scripts) if f"launch/{name}" not in docs]
    assert not undocumented, f"not named in docs/*.md: {undocumented}"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_runs_nothing(name: str, flag: str) -> None:
    result = run_script(name, "sgl-spec/tiny-code", flag, PYTHON="/nonexistent/python")
    assert result.returncode == 0, result.stderr
    assert f"usage: launch/{name} [TARGET" in result.stdout
    assert "sgl_spec.launch_server" not in result.stdout


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_command_is_accepted_by_the_launcher(
    name: str, sglang_parser, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sgl_spec.algorithms import check_launch, with_shipped_defaults

    case = CASES[name]
    if case.gpu:  # the launcher checks a GPU command against the host's GPUs: pretend 8
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    argv = dry_run(name, "--max-running-requests", "7", HOST="0.0.0.0", PORT="31234")
    assert (
        run_script(name, "--max-running-requests", "7", DRY_RUN="1").stdout
        == run_script(name, "--dry-run", "--max-running-requests", "7").stdout
    )
    config, ns = parse(sglang_parser, argv)
    assert ns.speculative_algorithm == case.algorithm
    assert ns.model_path == "sgl-spec/tiny-code"
    assert (ns.device == "cuda") if case.gpu else ns.device is None
    assert (ns.host, ns.port, ns.max_running_requests) == ("0.0.0.0", 31234, 7)
    for key, value in case.server_args.items():
        assert getattr(ns, key) == value, key

    # What `python -m sgl_spec.launch_server` does before SGLang starts (launch_server.main).
    sglang_argv = prepare_model_args(split_argv(argv)[1])
    launch = LaunchArgs.from_argv(sglang_argv)
    config = with_shipped_defaults(config, launch)
    check_launch(config, launch)
    assert launch.device == ("cuda" if case.gpu else "cpu")
    for key, value in case.config.items():
        assert getattr(config, key) == value, key


@pytest.mark.parametrize("name", sorted(CASES))
def test_positional_models_and_user_flags_win(name: str, sglang_parser) -> None:
    case = CASES[name]
    models = ["/models/target"] + (["/models/second"] if case.second else [])
    argv = dry_run(name, *models, "--port", "9", PORT="31234")
    config, ns = parse(sglang_parser, argv)
    assert ns.model_path == "/models/target"
    assert ns.port == 9  # the user's flag comes after the script's
    if case.second:
        value = getattr(ns if hasattr(ns, case.second) else config, case.second)
        assert value == "/models/second"
    else:
        assert "/models/second" not in argv


def test_minedraft_gpu_layout_is_n_plus_one_gpus(sglang_parser) -> None:
    config, ns = parse(sglang_parser, dry_run("minedraft_gpu.sh", TP="2", GPU="4"))
    assert (ns.tp_size, ns.base_gpu_id) == (2, 4)  # target on GPUs 4, 5
    assert config.speculative_draft_device == "cuda:6"
    config, _ = parse(sglang_parser, dry_run("minedraft_gpu.sh", DRAFT_DEVICE="cuda:7"))
    assert config.speculative_draft_device == "cuda:7"
    config, ns = parse(sglang_parser, dry_run("minedraft_cpu.sh", DRAFT_CORES="3", NUM_STEPS="5"))
    assert (config.speculative_draft_device, ns.speculative_num_steps) == ("cpu:3", 5)


@pytest.mark.parametrize("name", ["standalone_cpu.sh", "minedraft_gpu.sh"])
def test_bad_numbers_are_refused_naming_the_variable(name: str) -> None:
    result = run_script(name, "--dry-run", NUM_STEPS="three")
    assert result.returncode == 2
    assert "NUM_STEPS must be a non-negative integer" in result.stderr
    assert result.stdout == ""
