"""Our flags: parsing, validation messages naming the flag, transport to child processes, and
the CPU defaults the launcher adds only where the user chose nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sgl_spec.config import ENV_VAR, ConfigError, SpecConfig, split_argv
from sgl_spec.cpu_kernels import native
from sgl_spec.cpu_kernels.native import graph_cache_key
from sgl_spec.launch_server import apply_cpu_defaults


def test_split_argv_keeps_sglang_flags() -> None:
    cfg, rest = split_argv(["--model-path", "m", "--sgl-spec-cpu-defaults", "off", "--port", "1"])
    assert cfg.cpu_defaults == "off"
    assert rest == ["--model-path", "m", "--port", "1"]


def test_bad_value_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--sgl-spec-cpu-defaults"):
        split_argv(["--sgl-spec-cpu-defaults", "sometimes"])


def test_specblock_rank_head_switch() -> None:
    from sgl_spec.specblock.settings import load_settings

    assert split_argv([])[0].specblock_rank_head == "on"
    cfg = split_argv(["--specblock-rank-head", "off", "--specblock-drafter-path", "x"])[0]
    assert cfg.specblock_rank_head == "off"
    assert SpecConfig.from_env({ENV_VAR: cfg.to_env()}).specblock_rank_head == "off"
    shipped = SpecConfig(specblock_drafter_path="sgl-spec/tiny-code-specblock")
    assert load_settings(shipped).draft.use_rank_head
    off = SpecConfig(
        specblock_drafter_path="sgl-spec/tiny-code-specblock", specblock_rank_head="off"
    )
    assert not load_settings(off).draft.use_rank_head
    with pytest.raises(ConfigError, match="--specblock-rank-head"):
        split_argv(["--specblock-rank-head", "fixed"])


def test_specblock_drafter_dtype_rule() -> None:
    from sgl_spec.specblock.settings import drafter_dtype

    assert split_argv([])[0].specblock_drafter_dtype == "auto"
    with pytest.raises(ConfigError, match="--specblock-drafter-dtype"):
        split_argv(["--specblock-drafter-dtype", "int8"])
    assert drafter_dtype("auto", torch.float32) == torch.float32
    assert drafter_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert drafter_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert drafter_dtype("float32", torch.float16) == torch.float32


def test_env_round_trip_and_unknown_keys() -> None:
    cfg = SpecConfig(cpu_defaults="on", cpu_lossless_sampling=False)
    assert SpecConfig.from_env({ENV_VAR: cfg.to_env()}) == cfg
    assert SpecConfig.from_env({}) == SpecConfig()
    with pytest.raises(ConfigError, match="unknown keys"):
        SpecConfig.from_env({ENV_VAR: '{"nope": 1}'})


def test_cpu_defaults_respect_user_choices() -> None:
    env: dict[str, str] = {}
    argv = apply_cpu_defaults(["--model-path", "m"], env)
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--attention-backend") + 1] == "intel_amx"
    assert "--disable-overlap-schedule" in argv
    assert argv.count("--sleep-on-idle") == 1
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert env["SGLANG_EAGER_INPUT_NO_COPY"] == "1"
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith(f"inductor-sgl-spec-{graph_cache_key()}")
    user = [
        "--device=cpu",
        "--attention-backend",
        "torch_native",
        "--enable-overlap-schedule",
        "--sleep-on-idle",
    ]
    user_env = {
        "SGLANG_USE_CPU_ENGINE": "0",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "THP_MEM_ALLOC_ENABLE": "0",
        "SGLANG_EAGER_INPUT_NO_COPY": "0",
        "TORCHINDUCTOR_CACHE_DIR": "/somewhere/of/mine",
    }
    argv = apply_cpu_defaults(user, user_env)
    assert argv == user
    assert (
        user_env["SGLANG_USE_CPU_ENGINE"] == "0" and user_env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    )
    assert user_env["THP_MEM_ALLOC_ENABLE"] == "0"
    assert user_env["SGLANG_EAGER_INPUT_NO_COPY"] == "0"
    assert user_env["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/of/mine"


def test_compiled_graphs_are_cached_per_build_of_our_ops(monkeypatch, tmp_path) -> None:
    assert graph_cache_key() == graph_cache_key()
    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "sgl_spec_native_other.so")
    other = graph_cache_key()
    monkeypatch.undo()
    assert other != graph_cache_key()


def test_cpu_defaults_serve_a_float32_checkpoint_in_float32(tmp_path) -> None:
    """SGLang's ``--dtype auto`` would halve a float32 checkpoint to float16; on CPU the launcher
    keeps float32 unless the user chose, and leaves other checkpoints to ``auto``."""
    import json

    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    for path, dtype in ((fp32, "float32"), (bf16, "bfloat16")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    argv = apply_cpu_defaults(["--model-path", str(fp32)], {})
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--dtype" not in apply_cpu_defaults(["--model-path", str(bf16)], {})
    assert "--dtype" not in apply_cpu_defaults(["--model-path", "no/such/dir"], {})
    user = apply_cpu_defaults(["--model-path", str(fp32), "--dtype", "bfloat16"], {})
    assert user.count("--dtype") == 1 and user[user.index("--dtype") + 1] == "bfloat16"


def test_launcher_help_lists_sglang_and_our_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sgl_spec.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "--speculative-algorithm" in out and "--sgl-spec-cpu-defaults" in out


def test_launcher_rejects_bad_flag_with_clear_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_spec.launch_server", "--sgl-spec-cpu-defaults", "maybe"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--sgl-spec-cpu-defaults" in proc.stderr and "Traceback" not in proc.stderr


def test_model_defaults_fill_only_what_is_missing() -> None:
    from sgl_spec.algorithms import prepare_model_args
    from sgl_spec.argv import flag_value
    from sgl_spec.models.registry import resolve_model_path

    argv = prepare_model_args([])
    assert flag_value(argv, "--model-path") == resolve_model_path("sgl-spec/tiny-code")
    assert flag_value(argv, "--speculative-algorithm") == "STANDALONE_FULL"
    assert flag_value(argv, "--speculative-draft-model-path") == resolve_model_path(
        "sgl-spec/tiny-code-draft-narrow"
    )
    assert flag_value(argv, "--speculative-num-draft-tokens") == "4"
    user = prepare_model_args(
        [
            "--model-path=sgl-spec/tiny-code",
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-num-steps",
            "5",
        ]
    )
    assert flag_value(user, "--speculative-num-steps") == "5"
    assert flag_value(user, "--model-path") == resolve_model_path("sgl-spec/tiny-code")
    plain = prepare_model_args(["--model-path", "sgl-spec/tiny-code"])
    assert flag_value(plain, "--speculative-algorithm") is None
    assert flag_value(plain, "--speculative-draft-model-path") is None  # no draft without one
    assert flag_value(plain, "--speculative-num-steps") is None


def test_bad_model_path_names_the_flag(tmp_path) -> None:
    from sgl_spec.algorithms import prepare_model_args

    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        prepare_model_args(
            [
                "--model-path",
                str(tmp_path),
                "--speculative-draft-model-path",
                str(tmp_path / "missing"),
            ]
        )
    with pytest.raises(ConfigError, match="--model-path.*known names"):
        prepare_model_args(["--model-path", "sgl-spec/nope"])
    with pytest.raises(ConfigError, match="--model-path"):
        prepare_model_args(["--model-path", "./no/such/dir"])
    hub = prepare_model_args(["--model-path", "Qwen/Qwen3-8B"])  # left to SGLang / the hub
    assert "Qwen/Qwen3-8B" in hub


def test_argv_helpers_follow_argparse_last_wins() -> None:
    from sgl_spec.argv import flag_value, has_flag, set_flag_value

    argv = ["--port", "1", "--model-path=a", "--port", "2", "--flag"]
    assert flag_value(argv, "--port") == "2" and flag_value(argv, "--model-path") == "a"
    assert flag_value(argv, "--flag") is None and has_flag(argv, "--flag")
    assert set_flag_value(argv, "--port", "3") == [
        "--port",
        "1",
        "--model-path=a",
        "--port",
        "3",
        "--flag",
    ]
    assert set_flag_value(argv, "--model-path", "b")[2] == "--model-path=b"
    assert set_flag_value([], "--x", "1") == ["--x", "1"]


def test_minedraft_flags_are_validated() -> None:
    cfg, rest = split_argv(
        ["--speculative-draft-device", "cpu:1", "--minedraft-draft-timeout", "2.5", "--port", "1"]
    )
    assert (cfg.speculative_draft_device, cfg.minedraft_draft_timeout) == ("cpu:1", 2.5)
    assert cfg.minedraft_overlap == "on"
    assert split_argv(["--minedraft-overlap", "off"])[0].minedraft_overlap == "off"
    assert rest == ["--port", "1"]
    for argv, flag in (
        (["--speculative-draft-device", "gpu:1"], "--speculative-draft-device"),
        (["--speculative-draft-device", "cpu:0"], "--speculative-draft-device"),
        (["--minedraft-drafter", "eagle"], "--minedraft-drafter"),
        (["--minedraft-policy", "random"], "--minedraft-policy"),
        (["--minedraft-draft-timeout", "0"], "--minedraft-draft-timeout"),
        (["--minedraft-draft-timeout", "soon"], "--minedraft-draft-timeout"),
        (["--minedraft-overlap", "maybe"], "--minedraft-overlap"),
    ):
        with pytest.raises(ConfigError, match=flag):
            split_argv(argv)


def check_launch_args(config: SpecConfig, argv: list[str]) -> None:
    from sgl_spec.algorithms import check_launch
    from sgl_spec.argv import LaunchArgs

    check_launch(config, LaunchArgs.from_argv(argv))


def fill_specblock_defaults(config: SpecConfig, argv: list[str]) -> SpecConfig:
    from sgl_spec.algorithms import with_shipped_defaults
    from sgl_spec.argv import LaunchArgs

    return with_shipped_defaults(config, LaunchArgs.from_argv(argv))


def test_minedraft_defaults_and_launch_checks() -> None:
    from sgl_spec.algorithms import prepare_model_args
    from sgl_spec.argv import flag_value
    from sgl_spec.models.registry import resolve_model_path

    argv = prepare_model_args(["--speculative-algorithm", "MINEDRAFT"])
    assert flag_value(argv, "--speculative-draft-model-path") == resolve_model_path(
        "sgl-spec/tiny-code-draft-narrow"
    )
    assert flag_value(argv, "--speculative-num-steps") == "3"
    cpu = [*argv, "--device", "cpu"]
    check_launch_args(SpecConfig(), cpu)  # the draft server defaults to cpu:1
    user = prepare_model_args(
        ["--speculative-algorithm", "MINEDRAFT", "--speculative-num-steps", "5"]
    )
    assert flag_value(user, "--speculative-num-steps") == "5"
    for config, extra, message in (
        (SpecConfig(speculative_draft_device="cuda:1"), [], "the target runs on cpu"),
        (SpecConfig(minedraft_drafter="specblock"), [], "--minedraft-drafter specblock"),
        (SpecConfig(), ["--speculative-eagle-topk", "2"], "topk 1"),
        (SpecConfig(), ["--speculative-num-draft-tokens", "6"], "must be"),
        (SpecConfig(speculative_draft_device="cpu:64"), [], "cores"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_launch_args(config, [*cpu, *extra])
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        check_launch_args(SpecConfig(), ["--model-path", "/m", "--device", "cpu",
                                         "--speculative-algorithm", "MINEDRAFT"])  # fmt: skip
    with pytest.raises(ConfigError, match="needs --speculative-algorithm MINEDRAFT"):
        check_launch_args(SpecConfig(speculative_draft_device="cpu:1"), ["--device", "cpu"])


def test_minedraft_hosting_specblock_gets_the_shipped_drafter(tmp_path) -> None:
    from sgl_spec.algorithms import prepare_model_args
    from sgl_spec.models.registry import DEFAULT_SPECBLOCK_DRAFTER

    argv = [*prepare_model_args(["--speculative-algorithm", "MINEDRAFT"]), "--device", "cpu"]
    config = fill_specblock_defaults(SpecConfig(minedraft_drafter="specblock"), argv)
    assert config.specblock_drafter_path == DEFAULT_SPECBLOCK_DRAFTER
    check_launch_args(config, argv)
    assert fill_specblock_defaults(SpecConfig(), argv).specblock_drafter_path is None
    mine = SpecConfig(minedraft_drafter="specblock", specblock_drafter_path=str(tmp_path))
    assert fill_specblock_defaults(mine, argv).specblock_drafter_path == str(tmp_path)
    with pytest.raises(ConfigError, match="--minedraft-drafter specblock: .* no config.json"):
        check_launch_args(mine, argv)


def test_settings_are_built_once_per_process_and_handed_to_the_worker(monkeypatch) -> None:
    """The plugin binds this process's config to each algorithm; SGLang's handle_server_args
    and the worker factory share one settings object, built by one check."""
    import functools
    from types import SimpleNamespace

    from sgl_spec.specblock.algorithm import SpecBlock
    from tests.helpers.server_args import fake_server_args

    algorithm = SpecBlock()
    with pytest.raises(RuntimeError, match="no config"):
        algorithm.process_settings(SimpleNamespace())
    algorithm.bind(SpecConfig(specblock_drafter_path="sgl-spec/tiny-code-specblock-narrow"))
    checks = []
    original = algorithm.check
    monkeypatch.setattr(algorithm, "check", lambda *a: checks.append(a) or original(*a))
    server_args = fake_server_args(speculative_algorithm="SPECBLOCK")
    first = algorithm.process_settings(server_args)
    worker = algorithm.bound_worker(server_args)
    assert isinstance(worker, functools.partial) and worker.keywords == {"settings": first}
    assert worker.func is algorithm.worker_class()
    assert len(checks) == 1
    assert first.drafter_path.endswith("tiny-code-specblock-narrow")


def test_only_the_config_module_reads_the_config_variable() -> None:
    """Workers and patches get their settings from the process's config, never from the
    environment themselves; the launcher writes the variable."""
    from pathlib import Path

    import sgl_spec

    root = Path(sgl_spec.__file__).parent
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if any(name in path.read_text() for name in ("from_env(", ENV_VAR, "ENV_VAR"))
    ]
    assert sorted(readers) == ["config.py", "launch_server.py"]  # the launcher writes it


def test_each_algorithm_owns_its_flag_group() -> None:
    """``SpecConfig`` is the core flags plus one group per algorithm package, each flag in the
    group of the algorithm its help names."""
    import importlib
    from dataclasses import fields

    from sgl_spec.algorithm_list import PACKAGES
    from sgl_spec.algorithms import all_algorithms
    from sgl_spec.config import FLAG_GROUPS, CoreFlags
    from sgl_spec.flags import flag_of

    groups = [importlib.import_module(f"{package}.flags").FLAGS for package in PACKAGES]
    assert FLAG_GROUPS == (CoreFlags, *groups)
    for group, algorithm in zip(groups, all_algorithms(), strict=True):
        for f in fields(group):
            spec = flag_of(f)
            assert spec.help.startswith(algorithm.name), spec.name
            assert spec.requires in (None, algorithm.name), spec.name
    names = [f.name for group in FLAG_GROUPS for f in fields(group)]
    assert [f.name for f in fields(SpecConfig)] == names and len(set(names)) == len(names)
    with pytest.raises(ConfigError, match="--mtp-k"):
        SpecConfig(mtp_k="99")  # a group's own check runs on the assembled config
    with pytest.raises(ConfigError, match="--specblock-branching"):
        SpecConfig(specblock_branching="1,2")


def test_extra_algorithm_packages_come_from_the_environment(monkeypatch) -> None:
    """An out-of-tree algorithm package (``SGLSPEC_EXTRA_ALGORITHMS``) joins the registry after
    ours; one that cannot be imported is refused naming the package and the variable."""
    from sgl_spec.algorithm_list import EXTRA_ENV, PACKAGES, packages
    from sgl_spec.config import flag_groups

    monkeypatch.delenv(EXTRA_ENV, raising=False)
    assert packages() == PACKAGES
    monkeypatch.setenv(EXTRA_ENV, " tests.toy_algorithm, ")
    assert packages() == (*PACKAGES, "tests.toy_algorithm")
    assert flag_groups()[-1].__name__ == "ToyFlags"
    monkeypatch.setenv(EXTRA_ENV, "no_such_pkg")
    with pytest.raises(ConfigError, match=f"no_such_pkg.*{EXTRA_ENV}"):
        flag_groups()
