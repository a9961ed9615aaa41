"""The speculative algorithms sgl-spec adds to SGLang, and what the launcher does with them.

Each implements ``sgl_spec.common.algorithm.Algorithm``; adding one is a package of its own plus
one line in ``sgl_spec/algorithm_list.py``.
``prepare_launch`` is everything the launcher runs before SGLang starts: a bad launch, whichever
the algorithm (SGLang's own included, where one of ours is served as it), is refused there with
a ``ConfigError`` naming the flag, in seconds, instead of failing once SGLang has spawned its
scheduler and loaded models.
"""

from __future__ import annotations

import os

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm, unserved_size
from sgl_spec.config import ConfigError, SpecConfig, split_argv

SHAPE_FLAGS = ("num_steps", "eagle_topk", "num_draft_tokens")
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def all_algorithms() -> list[Algorithm]:
    """Ours, in ``sgl_spec.algorithm_list.packages()`` order (each package's
    ``algorithm.ALGORITHM``)."""
    import importlib

    from sgl_spec.algorithm_list import packages

    return [importlib.import_module(f"{p}.algorithm").ALGORITHM for p in packages()]


def find(name: str | None) -> Algorithm | None:
    """Ours named ``name`` (upper case), or None (``none`` and SGLang's own algorithms)."""
    return next((a for a in all_algorithms() if a.name == name), None)


def checker_of(name: str | None) -> Algorithm | None:
    """Ours named ``name``, or ours served as SGLang's ``name`` (``Algorithm.runs_as``), whose
    launch checks and shipped defaults then serve SGLang's algorithm as well."""
    if name is None:
        return None
    return find(name) or next((a for a in all_algorithms() if a.runs_as == name), None)


def register_all(config: SpecConfig) -> None:
    """Register every algorithm with SGLang, bound to this process's ``config``."""
    for algorithm in all_algorithms():
        algorithm.register(config)


def with_shipped_defaults(config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
    for algorithm in all_algorithms():
        config = algorithm.with_shipped_defaults(config, launch)
    return config


def prepare_model_args(argv: list[str]) -> list[str]:
    """SGLang's argv with the shipped models and each algorithm's settings for them filled in
    where the user gave none, and registry names resolved to directories."""
    from sgl_spec.algorithm_list import DEFAULT
    from sgl_spec.model_defaults import fill_shipped_defaults, resolve_paths

    draft_defaults = {}
    for algorithm in all_algorithms():
        if algorithm.uses_draft_model:
            for name in filter(None, (algorithm.name, algorithm.runs_as)):
                draft_defaults.setdefault(name, algorithm.shipped_argv)
    return resolve_paths(fill_shipped_defaults(argv, DEFAULT, draft_defaults))


def prepare_launch(argv: list[str]) -> tuple[SpecConfig, list[str]]:
    """The launcher's argv -> (our validated config, SGLang's argv): our flags split off, the
    shipped models filled in, ``check_launch``, then an algorithm served as one of SGLang's
    (``Algorithm.runs_as``) renamed to it and recorded in the config. Pure apart from reading
    the files named."""
    from sgl_spec.argv import drop_flags, set_flag_value

    config, sglang_argv = split_argv(argv)
    sglang_argv = prepare_model_args(sglang_argv)
    if LaunchArgs.from_argv(sglang_argv).algorithm == "NONE":
        # SGLang's own name for no speculation: served as if the flag were not given (SGLang
        # 0.5.23 would keep the string and fail sizing its speculative reservation)
        sglang_argv = drop_flags(sglang_argv, "--speculative-algorithm")
    launch = LaunchArgs.from_argv(sglang_argv)
    config = with_shipped_defaults(config, launch)
    check_launch(config, launch)
    algorithm = find(launch.algorithm)
    if algorithm is not None and algorithm.runs_as is not None:
        sglang_argv = set_flag_value(sglang_argv, "--speculative-algorithm", algorithm.runs_as)
        config = algorithm.mark(config)
        try:
            sglang_argv = algorithm.sglang_argv(config, sglang_argv)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return config, sglang_argv


def check_launch(config: SpecConfig, launch: LaunchArgs) -> None:
    """In the launcher, before SGLang starts: a known algorithm, a device this host has,
    parallel settings it supports, every flag belonging to the chosen algorithm, and the chosen
    algorithm's check; ``ConfigError`` naming the flag or file otherwise."""
    algorithm = checker_of(launch.algorithm)
    if find(launch.algorithm) is None:
        check_sglang_algorithm(launch.algorithm)
    config.check_algorithm(launch.algorithm)
    check_device(launch)
    check_parallel(launch, algorithm)
    if algorithm is None:
        return
    try:
        for name in SHAPE_FLAGS if algorithm.own_draft_shape else ():
            if getattr(launch, name) is not None:
                flag = "--speculative-" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag}: {algorithm.name} sizes its drafts with"
                    f" {algorithm.own_draft_shape}; drop {flag}"
                )
        algorithm.check(config, launch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def check_sglang_algorithm(name: str | None) -> None:
    """``--speculative-algorithm`` names ours or one SGLang knows (its error comes late)."""
    if name is None:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(name)
    except ValueError:
        known = [a.name for a in all_algorithms()]
        known += [a.name for a in SpeculativeAlgorithm if a.name != "NONE"]
        raise ConfigError(
            f"--speculative-algorithm {name} is unknown; choose one of {', '.join(known)}"
        ) from None


def check_device(launch: LaunchArgs) -> None:
    """``--device cuda`` on a host whose PyTorch sees no GPU fails deep in SGLang's start."""
    if not launch.device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {launch.device}: this host has no CUDA GPU that PyTorch can use"
            " (torch.cuda.is_available() is False); serve with --device cpu"
        )
    count = torch.cuda.device_count()
    if launch.base_gpu_id >= count:
        raise ConfigError(f"--base-gpu-id {launch.base_gpu_id}: this host has {count} GPU(s)")


def check_parallel(launch: LaunchArgs, algorithm: Algorithm | None) -> None:
    """Ours serve the parallel sizes above 1 they name (``Algorithm.parallel``); SGLang's CPU
    engine runs one rank per NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND`` gives each rank
    its cores."""
    sizes = {"tp_size": launch.tp_size, "pp_size": launch.pp_size, "dp_size": launch.dp_size}
    given = [f"--{flag.replace('_', '-')} {value}" for flag, value in sizes.items() if value != 1]
    if algorithm is not None:
        name = launch.algorithm  # as the user named it (SGLang's STANDALONE has our checks)
        flag = unserved_size(algorithm, sizes)
        if flag is not None:
            served = ", ".join(f"--{f.replace('_', '-')}" for f in sorted(algorithm.parallel))
            why = algorithm.parallel_why.get(flag)
            raise ConfigError(
                f"--{flag.replace('_', '-')} {sizes[flag]}: {name} serves one rank on that axis"
                + (f": {why}" if why else f" (sizes it serves above 1: {served or 'none'})")
            )
        if launch.enable_dp_attention:  # each splits its own attention work per rank
            raise ConfigError(f"--enable-dp-attention: {name} does not support DP attention")
    local = launch.local_ranks  # SGLang indexes the core lists by this node's rank
    if launch.device != "cpu" or launch.num_ranks == 1:
        return
    bind = os.environ.get(CPU_BIND_ENV) or "all"
    if bind == "all":
        cores = len(os.sched_getaffinity(0))
        if local > cores:
            raise ConfigError(
                f"{' x '.join(given)}: {local} ranks on this node's CPU need a core each and"
                f" this process may use {cores}; serve fewer ranks"
            )
    elif len(bind.split("|")) < local:
        raise ConfigError(
            f"{' x '.join(given)}: {local} ranks on this node's CPU need {local}"
            f" '|'-separated core lists in {CPU_BIND_ENV}, got {bind!r}"
        )


def cores_set_apart(
    config: SpecConfig | None, launch: LaunchArgs, environ: dict[str, str]
) -> list[int]:
    """The cores the chosen algorithm keeps for processes of its own beside the target's
    ranks (``Algorithm.cpu_cores_apart``: MINEDRAFT's draft servers); none without one."""
    algorithm = find(launch.algorithm) if config is not None else None
    if algorithm is None:
        return []
    try:
        return algorithm.cpu_cores_apart(config, launch, environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def rank_cores(
    num_ranks: int,
    environ: dict[str, str],
    local_ranks: int | None = None,
    apart: list[int] | None = None,
) -> None:
    """SGLang's CPU engine binds one rank per NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND``
    gives each rank its cores (and asserts at start when all nodes' ``num_ranks`` outnumber
    this host's NUMA nodes): where the user set nothing and they do, or an algorithm keeps
    cores ``apart`` for processes of its own, split this process's other cores into one
    contiguous list per rank it runs (``local_ranks``, default all: ``0-7|8-15``)."""
    if num_ranks <= 1 or (environ.get(CPU_BIND_ENV) or "all") != "all":
        return
    from sglang.srt.utils.common import get_cpu_ids_by_node

    if not apart and num_ranks <= (len(get_cpu_ids_by_node()) or 1):
        return
    local = num_ranks if local_ranks is None else local_ranks
    cores = sorted(set(os.sched_getaffinity(0)) - set(apart or ()))
    share, extra = divmod(len(cores), local)
    lists, start = [], 0
    for rank in range(local):
        part = cores[start : start + share + (rank < extra)]
        start += len(part)
        if len(part) == 1 or part[-1] - part[0] != len(part) - 1:
            lists.append(",".join(map(str, part)))
        else:
            lists.append(f"{part[0]}-{part[-1]}")
    environ[CPU_BIND_ENV] = "|".join(lists)


def check_eagle_shape(steps: int | None, topk: int | None, tokens: int | None) -> None:
    """SGLang's EAGLE-family draft shape: ``steps`` draft forwards, ``topk`` branches each,
    ``tokens`` verified per request (root included). SGLang picks all three when none is given;
    a chain (topk 1) verifies steps + 1; a tree at most 1 + topk + (steps - 1) * topk², the
    candidates its draft forwards produce."""
    values = {
        "--speculative-num-steps": (steps, 1),
        "--speculative-eagle-topk": (topk, 1),
        "--speculative-num-draft-tokens": (tokens, 2),
    }
    for flag, (value, low) in values.items():
        if value is not None and value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    if steps is None:
        given = [flag for flag, (value, _) in values.items() if value is not None]
        if given:
            raise ConfigError(f"{given[0]} needs --speculative-num-steps as well")
        return
    if topk is None:
        raise ConfigError("--speculative-num-steps needs --speculative-eagle-topk as well")
    if topk == 1 and tokens not in (None, steps + 1):
        raise ConfigError(
            f"--speculative-num-draft-tokens {tokens}: a chain (--speculative-eagle-topk 1)"
            f" of --speculative-num-steps {steps} verifies {steps + 1}"
        )
    most = 1 + topk + (steps - 1) * topk * topk
    if topk > 1 and (tokens is None or tokens > most):
        raise ConfigError(
            f"--speculative-num-draft-tokens {tokens}: a tree of --speculative-eagle-topk"
            f" {topk} and --speculative-num-steps {steps} verifies 2..{most} tokens"
        )
