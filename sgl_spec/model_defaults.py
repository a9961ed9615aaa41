"""Fills in model paths and speculative settings for the models shipped with sgl-spec.

Runs on the launcher's argv before SGLang parses it, so SGLang only ever sees real directories:
registry names (``sgl-spec/tiny-code``) are resolved, bad paths are refused naming the flag, and
with no ``--model-path`` the shipped target is served with speculative decoding on. Any flag the
user gives wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sgl_spec.argv import LaunchArgs, flag_value, set_flag_value
from sgl_spec.config import ConfigError, SpecConfig

PATH_FLAGS = ("--model-path", "--speculative-draft-model-path", "--tokenizer-path")


def looks_like_hub_id(value: str) -> bool:
    """``org/name`` with no local-path markers: left for SGLang to fetch (GPU hosts online)."""
    from sgl_spec.models.registry import NAMESPACE

    return (
        not value.startswith(("/", ".", "~", NAMESPACE))
        and value.count("/") == 1
        and not Path(value).exists()
    )


def resolve_paths(argv: list[str]) -> list[str]:
    """Registry names -> shipped dirs; a missing local path is refused with the flag's name;
    hub ids pass through untouched."""
    from sgl_spec.models.registry import resolve_model_path

    for flag in PATH_FLAGS:
        value = flag_value(argv, flag)
        if value is None or looks_like_hub_id(value):
            continue
        try:
            argv = set_flag_value(argv, flag, resolve_model_path(value))
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc}") from exc
    return argv


def fill_shipped_defaults(
    argv: list[str], default_algorithm: str, draft_defaults: Mapping[str, Mapping[str, str]]
) -> list[str]:
    """No --model-path: the shipped target with ``default_algorithm``. A shipped target with an
    algorithm of ``draft_defaults`` (name -> its SGLang flags there) and no draft: the shipped
    draft, and those flags only where the user gave none; a chain's draft tokens follow its
    steps (steps + 1)."""
    from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, is_shipped

    launch = LaunchArgs.from_argv(argv)
    if launch.model_path is None:
        argv = argv + ["--model-path", DEFAULT_TARGET]
        if launch.algorithm is None:
            argv += ["--speculative-algorithm", default_algorithm]
        launch = LaunchArgs.from_argv(argv)
    defaults = draft_defaults.get(launch.algorithm or "")
    if defaults is not None and is_shipped(launch.model_path or ""):
        if launch.draft_model_path is None:
            argv += ["--speculative-draft-model-path", DEFAULT_DRAFT]
        chain = flag_value(argv, "--speculative-eagle-topk") in (None, "1")
        for flag, value in defaults.items():
            steps = flag_value(argv, "--speculative-num-steps") or ""
            if flag == "--speculative-num-draft-tokens" and chain and steps.isdigit():
                value = str(int(steps) + 1)
            if flag_value(argv, flag) is None:
                argv += [flag, value]
    return argv


def fill_unset_for_shipped(
    config: SpecConfig, launch: LaunchArgs, algorithm: str, defaults: dict[str, object]
) -> SpecConfig:
    """``algorithm`` serving the shipped target: each ``SpecConfig`` field in ``defaults`` the
    user left unset (None) gets its default. ``launch`` is read from SGLang's argv after
    ``sgl_spec.algorithms.prepare_model_args``."""
    from dataclasses import replace

    from sgl_spec.models.registry import is_shipped

    if launch.algorithm != algorithm or not is_shipped(launch.model_path or ""):
        return config
    unset = {name: value for name, value in defaults.items() if getattr(config, name) is None}
    return replace(config, **unset)
