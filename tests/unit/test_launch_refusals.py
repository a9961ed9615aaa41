"""Every bad launch is refused by the launcher's check path (``algorithms.prepare_launch``, what
``launch_server.main`` runs before SGLang starts) with a ``ConfigError`` naming the flag, for
STANDALONE, MTP_LORA, SPECBLOCK and MINEDRAFT; and the same launch with the one bad part fixed
passes, so that each refusal is the bad part's doing.

Models are tiny and built once per module (``tests/helpers/tiny_models``); nothing here starts
SGLang. ``tests/e2e/test_launch_refusals_server.py`` covers what only SGLang's own start sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_spec.algorithms import prepare_launch
from sgl_spec.config import ConfigError

ALG = "--speculative-algorithm"
DRAFT = "--speculative-draft-model-path"
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
CHAIN += ["--speculative-num-draft-tokens", "4"]
CPU = ["--device", "cpu"]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The tiny target and draft, and one broken or mismatched directory per case."""
    from sgl_spec.models.registry import resolve_model_path
    from tests.helpers.tiny_models import (
        build_llama,
        random_mtp_adapter,
        random_specblock_drafter,
        swapped_tokenizer_copy,
    )

    root = tmp_path_factory.mktemp("refusals")
    target, draft = tiny_models["target"], tiny_models["draft"]
    paths = {"target": target, "draft": draft, "missing": root / "missing"}
    (root / "empty").mkdir()
    paths["empty"] = root / "empty"
    paths["draft_vocab"] = build_llama(root / "draft_vocab", seed=2, num_layers=1, vocab_size=384)
    paths["draft_tokenizer"] = swapped_tokenizer_copy(draft, root / "draft_tokenizer")
    paths["mtp"] = random_mtp_adapter(target, root / "mtp")
    paths["mtp_layers"] = random_mtp_adapter(target, root / "mtp_layers", num_layers=4)
    paths["mtp_hidden"] = resolve_model_path("sgl-spec/tiny-code-mtp")  # hidden 512, not 64
    paths["specblock"] = random_specblock_drafter(target, root / "specblock")
    paths["specblock_layers"] = random_specblock_drafter(
        target, root / "specblock_layers", num_target_layers=4
    )
    paths["specblock_hidden"] = resolve_model_path("sgl-spec/tiny-code-specblock")
    weights = {"draft": "model.safetensors", "mtp": "adapter.safetensors"}
    weights["specblock"] = "model.safetensors"
    for name, file in weights.items():
        src = Path(paths[name])
        for defect in ("no_weights", "truncated", "garbage", "no_config"):
            broken = root / f"{name}_{defect}"
            shutil.copytree(src, broken)
            data = (broken / file).read_bytes()
            if defect == "no_weights":
                (broken / file).unlink()
            elif defect == "truncated":
                (broken / file).write_bytes(data[: len(data) // 2])
            elif defect == "garbage":
                (broken / file).write_bytes(os.urandom(256))
            else:
                config = "adapter_config.json" if name == "mtp" else "config.json"
                (broken / config).write_text("{not json")
            paths[f"{name}_{defect}"] = broken
    import torch

    torch.save(list(range(10, 60)), root / "hot.pt")  # a hot vocabulary (--speculative-token-map)
    paths["hot"] = root / "hot.pt"
    return {name: str(path) for name, path in paths.items()}


def standalone(draft: str, *extra: str, algorithm: str = "STANDALONE") -> list[str]:
    return ["--model-path", "{target}", ALG, algorithm, DRAFT, f"{{{draft}}}", *CHAIN, *extra]


def standalone_full(draft: str, *extra: str) -> list[str]:
    return standalone(draft, *extra, algorithm="STANDALONE_FULL")


def minedraft(draft: str, *extra: str) -> list[str]:
    return ["--model-path", "{target}", ALG, "MINEDRAFT", DRAFT, f"{{{draft}}}",
            "--speculative-draft-device", "cpu", *extra]  # fmt: skip


def mtp(adapter: str, *extra: str) -> list[str]:
    return ["--model-path", "{target}", ALG, "MTP_LORA", "--mtp-lora-path", f"{{{adapter}}}",
            *extra]  # fmt: skip


def specblock(drafter: str, *extra: str) -> list[str]:
    return ["--model-path", "{target}", ALG, "SPECBLOCK", "--specblock-drafter-path",
            f"{{{drafter}}}", *extra]  # fmt: skip


def minedraft_specblock(drafter: str, *extra: str) -> list[str]:
    return ["--model-path", "{target}", ALG, "MINEDRAFT", "--minedraft-drafter", "specblock",
            "--specblock-drafter-path", f"{{{drafter}}}", "--speculative-draft-device", "cpu",
            "--speculative-num-steps", "2", *extra]  # fmt: skip


LAUNCHERS = {
    "STANDALONE": (standalone, "draft"),
    "STANDALONE_FULL": (standalone_full, "draft"),
    "MINEDRAFT": (minedraft, "draft"),
    "MTP_LORA": (mtp, "mtp"),
    "SPECBLOCK": (specblock, "specblock"),
    "MINEDRAFT-specblock": (minedraft_specblock, "specblock"),
}
# The good launch of each algorithm: the cases below each change one thing in one of these.
GOOD = {name: build(good) for name, (build, good) in LAUNCHERS.items()}
FILES = {
    "--speculative-draft-model-path": ("STANDALONE", "STANDALONE_FULL", "MINEDRAFT"),
    "--mtp-lora-path": ("MTP_LORA",),
    "--specblock-drafter-path": ("SPECBLOCK", "MINEDRAFT-specblock"),
}
DEFECTS = ("missing", "empty", "no_weights", "truncated", "garbage", "no_config")
MISMATCHES = {
    "--speculative-draft-model-path": ("vocab", "tokenizer"),
    "--mtp-lora-path": ("layers", "hidden"),
    "--specblock-drafter-path": ("layers", "hidden"),
}

CASES: dict[str, tuple[list[str], str]] = {
    "unknown_algorithm": (["--model-path", "{target}", ALG, "FOO"], "--speculative-algorithm"),
}
for flag, names in FILES.items():
    for name in names:
        build, good = LAUNCHERS[name]
        for defect in DEFECTS:
            own = f"{good}_{defect}" if defect not in ("missing", "empty") else defect
            CASES[f"{name}-{flag.strip('-')}-{defect}"] = (build(own), flag)
        for mismatch in MISMATCHES[flag]:
            CASES[f"{name}-{flag.strip('-')}-{mismatch}"] = (build(f"{good}_{mismatch}"), flag)

STEPS, TOPK, TOKENS = (
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)
SHAPES = {
    # STANDALONE: SGLang's own checks come late, silently rewrite, or fail mid-serving
    "STANDALONE-chain-tokens": (standalone("draft", TOKENS, "6"), TOKENS),
    "STANDALONE-tree-too-wide": (standalone("draft", STEPS, "2", TOPK, "2", TOKENS, "9"), TOKENS),
    "STANDALONE-tree-no-tokens": (
        ["--model-path", "{target}", ALG, "STANDALONE", DRAFT, "{draft}", STEPS, "2", TOPK, "2"],
        TOKENS,
    ),
    "STANDALONE-steps-0": (standalone("draft", STEPS, "0", TOKENS, "1"), STEPS),
    "STANDALONE-topk-0": (standalone("draft", TOPK, "0"), TOPK),
    "STANDALONE-steps-only": (
        ["--model-path", "{target}", ALG, "STANDALONE", DRAFT, "{draft}", STEPS, "3"],
        TOPK,
    ),
    "STANDALONE-topk-only": (
        ["--model-path", "{target}", ALG, "STANDALONE", DRAFT, "{draft}", TOPK, "1"],
        STEPS,
    ),
    "STANDALONE-no-draft": (["--model-path", "{target}", ALG, "STANDALONE", *CHAIN], DRAFT),
    # --standalone-steps: STANDALONE_FULL's, a chain's length only, one of its modes
    "STANDALONE-standalone-steps": (
        standalone("draft", "--standalone-steps", "auto"),
        "--standalone-steps",
    ),
    "STANDALONE_FULL-standalone-steps-tree": (
        [
            "--model-path",
            "{target}",
            ALG,
            "STANDALONE_FULL",
            DRAFT,
            "{draft}",
            STEPS,
            "2",
            TOPK,
            "2",
            TOKENS,
            "5",
            "--standalone-steps",
            "auto",
        ],
        "--standalone-steps",
    ),  # fmt: skip
    "STANDALONE_FULL-standalone-steps-overlap": (
        standalone_full("draft", "--standalone-steps", "auto", "--enable-overlap-schedule"),
        "--enable-overlap-schedule",
    ),
    "STANDALONE_FULL-standalone-steps-value": (
        standalone_full("draft", "--standalone-steps", "sometimes"),
        "--standalone-steps",
    ),
    "MINEDRAFT-minedraft-steps-value": (
        minedraft("draft", "--minedraft-steps", "sometimes"),
        "--minedraft-steps",
    ),
    "STANDALONE_FULL-minedraft-steps": (
        standalone_full("draft", "--minedraft-steps", "fixed"),
        "--minedraft-steps",
    ),
    # MTP_LORA and SPECBLOCK size drafts with their own flags; SGLang's would be overwritten
    "MTP_LORA-steps": (mtp("mtp", STEPS, "3"), STEPS),
    "MTP_LORA-tokens": (mtp("mtp", TOKENS, "4"), TOKENS),
    "SPECBLOCK-topk": (specblock("specblock", TOPK, "4"), TOPK),
    "SPECBLOCK-steps": (specblock("specblock", STEPS, "3"), STEPS),
    "SPECBLOCK-adapt-tp": (
        specblock("specblock", "--specblock-adapt", "--tp-size", "2"),
        "--specblock-adapt",
    ),
    "MINEDRAFT-topk": (minedraft("draft", TOPK, "2"), TOPK),
    "MINEDRAFT-tokens": (minedraft("draft", STEPS, "3", TOKENS, "6"), TOKENS),
    "MINEDRAFT-steps-0": (minedraft("draft", STEPS, "0"), STEPS),
}
CASES.update(SHAPES)
# --speculative-token-map: STANDALONE_FULL cuts its draft's head to the map (the file must be
# there: SGLang would look for a missing one on a model hub); the others draft no such head
MAP = "--speculative-token-map"
CASES["STANDALONE_FULL-token-map-missing"] = (standalone_full("draft", MAP, "{missing}"), MAP)
CASES["STANDALONE-token-map"] = (standalone("draft", MAP, "{hot}"), MAP)  # SGLang's: no cut
for name in ("MINEDRAFT", "MTP_LORA", "SPECBLOCK", "MINEDRAFT-specblock"):
    build, good = LAUNCHERS[name]
    CASES[f"{name}-token-map"] = (build(good, MAP, "{hot}"), MAP)
NUM_CORES = len(os.sched_getaffinity(0))
DEVICES = {
    "MINEDRAFT-cuda7": ["--speculative-draft-device", "cuda:7"],
    "MINEDRAFT-cpu99": ["--speculative-draft-device", "cpu:99"],
    "MINEDRAFT-all-cores": ["--speculative-draft-device", f"cpu:{NUM_CORES}"],
    # two ranks keep a core each: a draft server of all but one core does not fit beside them
    "MINEDRAFT-tp-cores": ["--tp-size", "2", "--speculative-draft-device", f"cpu:{NUM_CORES - 1}"],
}
for name, extra in DEVICES.items():
    CASES[name] = (minedraft("draft", *extra), "--speculative-draft-device")
PARALLEL = {"--tp-size": "2", "--pp-size": "2", "--dp-size": "2", "--enable-dp-attention": None}
# the parallel sizes each serves above 1 (tests/e2e/test_parallel.py serves them)
SERVED = {"STANDALONE": ("--tp-size", "--dp-size"), "STANDALONE_FULL": ("--tp-size", "--dp-size"),
          "MTP_LORA": ("--tp-size", "--dp-size"), "SPECBLOCK": ("--tp-size", "--dp-size"),
          "MINEDRAFT": ("--tp-size", "--dp-size"),
          "MINEDRAFT-specblock": ("--tp-size", "--dp-size")}  # fmt: skip
for name, argv in GOOD.items():
    for flag, value in PARALLEL.items():
        extra = [flag] if value is None else [flag, value]
        if flag not in SERVED.get(name, ()):
            CASES[f"{name}{flag}"] = ([*argv, *extra], flag)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_parallel_sizes_served_pass(name, models, monkeypatch) -> None:
    from sgl_spec import algorithms

    monkeypatch.delenv(algorithms.CPU_BIND_ENV, raising=False)
    monkeypatch.setattr(algorithms.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for flag in SERVED[name]:
        prepare_launch(fill([*GOOD[name], flag, "2", *CPU], models))


def fill(argv: list[str], models: dict[str, str]) -> list[str]:
    return [arg.format(**models) for arg in argv]


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        prepare_launch(argv)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_good_launches_pass(name, models) -> None:
    config, sglang_argv = prepare_launch(fill([*GOOD[name], *CPU], models))
    served_as = {"STANDALONE_FULL": "STANDALONE"}  # ours, served as SGLang's (runs_as)
    algorithm = name.split("-")[0]
    assert sglang_argv[sglang_argv.index(ALG) + 1] == served_as.get(algorithm, algorithm)


def test_standalone_full_takes_a_token_map(models) -> None:
    prepare_launch(fill([*standalone_full("draft", MAP, "{hot}"), *CPU], models))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_launch_is_refused_naming_the_flag(case, models) -> None:
    argv, flag = CASES[case]
    message = refusal(fill([*argv, *CPU], models))
    assert flag in message, message


def test_a_parallel_flag_is_read_under_its_alias(models) -> None:
    message = refusal(fill([*mtp("mtp", "--pipeline-parallel-size", "2"), *CPU], models))
    assert "--pp-size 2" in message and "MTP_LORA" in message


@pytest.mark.parametrize(
    "algorithm", ["", "STANDALONE", "STANDALONE_FULL", "MTP_LORA", "SPECBLOCK", "MINEDRAFT"]
)
def test_device_cuda_without_a_gpu(algorithm, monkeypatch) -> None:
    """The shipped models, so each algorithm's own check would pass; only the device is bad."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [ALG, algorithm] if algorithm else ["--model-path", "sgl-spec/tiny-code"]
    if algorithm == "MINEDRAFT":
        argv += ["--speculative-draft-device", "cpu"]
    assert prepare_launch([*argv, *CPU])  # the same launch on the CPU
    assert "--device cuda" in refusal([*argv, "--device", "cuda"])


def test_gpus_the_host_lacks(monkeypatch) -> None:
    """On a one-GPU host (simulated: only the device count is read): a draft GPU or a base GPU
    beyond it, and the target's own GPU as the draft's."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = [ALG, "MINEDRAFT", "--device", "cuda", "--speculative-draft-device"]
    assert prepare_launch([*cuda, "cpu"])  # the draft server on the CPU: fine
    assert "this host has 1 GPU" in refusal([*cuda, "cuda:7"])
    assert "is one of the target's GPUs" in refusal([*cuda, "cuda:0"])
    assert "--base-gpu-id 3" in refusal([*cuda, "cpu", "--base-gpu-id", "3"])


def test_minedraft_draft_cores_overlapping_the_target(models, monkeypatch) -> None:
    if NUM_CORES < 2:
        pytest.skip("needs two cores: one for the target, one for the draft server")
    argv = fill([*minedraft("draft", "--speculative-draft-device", "cpu:1"), *CPU], models)
    last = max(os.sched_getaffinity(0))
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))
    prepare_launch(argv)  # the target on the first core, the draft on the last
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"0-{last}")
    message = refusal(argv)
    assert "--speculative-draft-device" in message and "SGLANG_CPU_OMP_THREADS_BIND" in message


@pytest.mark.parametrize("flag", ["--tp-size", "--pp-size", "--dp-size"])
def test_cpu_ranks_need_a_core_each_or_core_lists(flag, monkeypatch) -> None:
    """SGLang's CPU engine runs a rank per NUMA node, or per core list in
    SGLANG_CPU_OMP_THREADS_BIND; where the user gives none the launcher gives each rank its
    cores (``rank_cores``), so a launch is refused only without a core per rank or with fewer
    lists than ranks."""
    import sglang.srt.utils.common as sglang_common

    from sgl_spec import algorithms

    argv = ["--model-path", "sgl-spec/tiny-code", flag, "2", *CPU]
    monkeypatch.setattr(sglang_common, "get_cpu_ids_by_node", lambda: ["0"])
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(algorithms.os, "sched_getaffinity", lambda pid: {0})
    assert flag in refusal(argv) and "core" in refusal(argv)
    monkeypatch.setattr(algorithms.os, "sched_getaffinity", lambda pid: {0, 1})
    prepare_launch(argv)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0")
    assert flag in refusal(argv)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    prepare_launch(argv)


def test_shipped_standalone_steps_bring_their_chain_length() -> None:
    """On the shipped target the launcher fills the draft shape in; a user's steps alone set
    the chain's verified tokens (steps + 1), not the refused default of 4."""
    from sgl_spec.argv import flag_value

    _, argv = prepare_launch([ALG, "STANDALONE", STEPS, "5", *CPU])
    assert flag_value(argv, TOKENS) == "6"


def test_the_launcher_process_exits_naming_the_flag(models) -> None:
    """Through ``python -m sgl_spec.launch_server``: non-zero, a message naming the flag and
    no traceback."""
    argv = fill(standalone("draft_truncated"), models)
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_spec.launch_server", *argv, *CPU],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--speculative-draft-model-path" in proc.stderr and "truncated" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_standalone_steps_run_steps_in_order(models) -> None:
    """A chain length chosen per step must meet its verify result: the launch turns SGLang's
    overlap scheduler off (its CUDA default) unless told so already."""
    _, argv = prepare_launch(fill([*GOOD["STANDALONE_FULL"], "--standalone-steps", "auto"], models))
    assert "--disable-overlap-schedule" in argv
    _, argv = prepare_launch(
        fill([*GOOD["STANDALONE_FULL"], "--standalone-steps", "fixed"], models)
    )
    assert "--disable-overlap-schedule" not in argv  # fixed: SGLang's own choice stands


def test_standalone_steps_default_to_the_controller_where_it_runs(models, monkeypatch) -> None:
    """Unset, ``--standalone-steps`` is auto on a CPU chain launch, tensor-parallel ones too
    (rank 0 decides for every rank), and fixed where auto would change the launch (a tree,
    the overlap scheduler asked for)."""
    from sgl_spec import algorithms
    from sgl_spec.standalone.flags import default_steps_mode

    config, argv = prepare_launch(fill(GOOD["STANDALONE_FULL"], models))
    assert config.standalone_steps == "auto" and "--disable-overlap-schedule" in argv
    overlap = fill([*GOOD["STANDALONE_FULL"], "--enable-overlap-schedule"], models)
    config, argv = prepare_launch(overlap)
    assert config.standalone_steps == "fixed" and "--disable-overlap-schedule" not in argv
    assert default_steps_mode(2, False, "cpu") == "fixed"  # a tree
    assert default_steps_mode(1, None, "cuda") == "fixed"  # SGLang's overlap default
    assert default_steps_mode(None, False, "cuda") == "auto"
    monkeypatch.setattr(algorithms.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    tp = fill([*GOOD["STANDALONE_FULL"], "--tp-size", "2"], models)
    assert prepare_launch(tp)[0].standalone_steps == "auto"


@pytest.mark.parametrize("spelling", [[ALG, "NONE"], [f"{ALG}=none"]])
def test_speculative_algorithm_none_is_plain_decoding(spelling) -> None:
    """SGLang's own ``NONE`` means no speculation: the launcher serves it as the flag absent
    (SGLang 0.5.23 would keep the string and fail at start), also without a model path, where
    the launcher's default algorithm must not take its place."""
    for argv in ([*spelling, *CPU], ["--model-path", "sgl-spec/tiny-code", *spelling, *CPU]):
        _, sglang_argv = prepare_launch(argv)
        assert not any(arg.startswith(ALG) for arg in sglang_argv), sglang_argv
