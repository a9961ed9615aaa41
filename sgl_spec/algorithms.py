"""The speculative algorithms sgl-spec adds to SGLang, and what the launcher does with them.

Each entry implements ``sgl_spec.common.algorithm.Algorithm``; adding an algorithm is one line here.
"""

from __future__ import annotations

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm
from sgl_spec.config import ConfigError, SpecConfig


def all_algorithms() -> list[Algorithm]:
    from sgl_spec.minedraft.algorithm import ALGORITHM as MINEDRAFT
    from sgl_spec.mtp.algorithm import ALGORITHM as MTP_LORA
    from sgl_spec.specblock.algorithm import ALGORITHM as SPECBLOCK

    return [MTP_LORA, SPECBLOCK, MINEDRAFT]


def find(name: str | None) -> Algorithm | None:
    """Ours named ``name`` (upper case), or None (``none`` and SGLang's own algorithms)."""
    return next((a for a in all_algorithms() if a.name == name), None)


def register_all() -> None:
    for algorithm in all_algorithms():
        algorithm.register()


def with_shipped_defaults(config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
    for algorithm in all_algorithms():
        config = algorithm.with_shipped_defaults(config, launch)
    return config


def check_launch(config: SpecConfig, launch: LaunchArgs) -> None:
    """In the launcher, before SGLang starts: every flag belongs to the chosen algorithm, and the
    chosen algorithm's check passes; ``ConfigError`` naming the flag or file otherwise."""
    config.check_algorithm(launch.algorithm)
    algorithm = find(launch.algorithm)
    if algorithm is None:
        return
    try:
        algorithm.check(config, launch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
