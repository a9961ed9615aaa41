"""Fills in model paths and speculative settings for the models shipped with sgl-spec.

Runs on the launcher's argv before SGLang parses it, so SGLang only ever sees real directories:
registry names (``sgl-spec/tiny-code``) are resolved, bad paths are refused naming the flag, and
with no ``--model-path`` the shipped target is served with speculative decoding on. Any flag the
user gives wins.
"""

from __future__ import annotations

from pathlib import Path

from sgl_spec.argv import flag_value, set_flag_value
from sgl_spec.config import SPECBLOCK_SHIPPED_MAX_NODES, ConfigError, SpecConfig

PATH_FLAGS = ("--model-path", "--speculative-draft-model-path", "--tokenizer-path")
DEFAULT_ALGORITHM = "STANDALONE"
# Measured on the shipped models (benchmarks/RESULTS.md); a chain of 3 drafts.
STANDALONE_DEFAULTS = {
    "--speculative-num-steps": "3",
    "--speculative-eagle-topk": "1",
    "--speculative-num-draft-tokens": "4",
}

# MINEDRAFT on the shipped models: the shipped draft model drafts a chain of 3 (the draft
# server's device defaults to cpu:1 / the last GPU, sgl_spec/minedraft/algorithm.py).
MINEDRAFT_DEFAULTS = {"--speculative-num-steps": "3"}


# Measured on the shipped target + adapter (benchmarks/RESULTS.md): a fixed k is slower than
# plain decoding on the CPU hosts measured; the controller keeps drafts off there (0.88-1.03x of
# plain decoding) and turns them on where a step with drafts is cheap enough to pay.
MTP_DEFAULT_K = "auto"


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


def fill_shipped_defaults(argv: list[str]) -> list[str]:
    """No --model-path: the shipped target with STANDALONE. A shipped target with STANDALONE or
    MINEDRAFT and no draft: the shipped draft. Step/width defaults only where the user gave
    none."""
    from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, is_shipped

    if flag_value(argv, "--model-path") is None:
        argv = argv + ["--model-path", DEFAULT_TARGET]
        if flag_value(argv, "--speculative-algorithm") is None:
            argv += ["--speculative-algorithm", DEFAULT_ALGORITHM]
    algorithm = (flag_value(argv, "--speculative-algorithm") or "").upper()
    defaults = {"STANDALONE": STANDALONE_DEFAULTS, "MINEDRAFT": MINEDRAFT_DEFAULTS}.get(algorithm)
    if defaults is not None and is_shipped(flag_value(argv, "--model-path") or ""):
        if flag_value(argv, "--speculative-draft-model-path") is None:
            argv += ["--speculative-draft-model-path", DEFAULT_DRAFT]
        for flag, value in defaults.items():
            if flag_value(argv, flag) is None:
                argv += [flag, value]
    return argv


def prepare_model_args(argv: list[str]) -> list[str]:
    return resolve_paths(fill_shipped_defaults(argv))


def fill_unset_for_shipped(
    config: SpecConfig, argv: list[str], algorithm: str, defaults: dict[str, object]
) -> SpecConfig:
    """``algorithm`` serving the shipped target: each ``SpecConfig`` field in ``defaults`` the
    user left unset (None) gets its default. ``argv`` is SGLang's (after
    ``prepare_model_args``)."""
    from dataclasses import replace

    from sgl_spec.models.registry import is_shipped

    chosen = (flag_value(argv, "--speculative-algorithm") or "").upper()
    if chosen != algorithm or not is_shipped(flag_value(argv, "--model-path") or ""):
        return config
    unset = {name: value for name, value in defaults.items() if getattr(config, name) is None}
    return replace(config, **unset)


def fill_mtp_defaults(config: SpecConfig, argv: list[str]) -> SpecConfig:
    """MTP_LORA on the shipped target: the shipped adapter and the measured-best k, unless given."""
    from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER

    defaults = {"mtp_lora_path": DEFAULT_MTP_ADAPTER, "mtp_k": MTP_DEFAULT_K}
    return fill_unset_for_shipped(config, argv, "MTP_LORA", defaults)


def fill_specblock_defaults(config: SpecConfig, argv: list[str]) -> SpecConfig:
    """SPECBLOCK on the shipped target: the shipped drafter and the measured-best node budget
    (``SPECBLOCK_SHIPPED_MAX_NODES``), unless given. MINEDRAFT hosting a SpecBlock drafter
    (``--minedraft-drafter specblock``) on the shipped target: the shipped drafter."""
    from sgl_spec.models.registry import DEFAULT_SPECBLOCK_DRAFTER

    drafter = {"specblock_drafter_path": DEFAULT_SPECBLOCK_DRAFTER}
    defaults = {**drafter, "specblock_max_nodes": SPECBLOCK_SHIPPED_MAX_NODES}
    config = fill_unset_for_shipped(config, argv, "SPECBLOCK", defaults)
    if config.minedraft_drafter == "specblock":
        config = fill_unset_for_shipped(config, argv, "MINEDRAFT", drafter)
    return config
