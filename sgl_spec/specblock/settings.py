"""``--speculative-algorithm SPECBLOCK``: registration, start-up validation, runtime settings.

SGLang sizes each decode step's KV reservation from ``speculative_num_steps`` (the depth bound
M*K) and ``speculative_num_draft_tokens`` (the verified tree width, ``--specblock-max-nodes``).
Our own flags come from ``SpecConfig`` (``sgl_spec/config.py``); every problem with them, the
drafter checkpoint or its fit to the target is refused at start-up with one message naming the
flag or file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_spec.config import SPECBLOCK_DEFAULT_MAX_NODES, SpecConfig
from sgl_spec.spec_algo import OwnDraftStateSpecAlgo, require_single_rank
from sgl_spec.specblock.adapt import AdaptConfig
from sgl_spec.specblock.drafting import DraftSettings

logger = logging.getLogger(__name__)
NAME = "SPECBLOCK"


@dataclass(frozen=True)
class SpecBlockSettings:
    drafter_path: str
    block_size: int  # K positions used per block (<= the drafter's trained K)
    draft: DraftSettings
    adapt: AdaptConfig | None = None  # --specblock-adapt (cost-aware adaptation, §3.4)

    @property
    def max_depth(self) -> int:
        return self.draft.max_depth(self.block_size)

    @property
    def verify_depth(self) -> int:
        """Deepest node a verified tree can hold: M*K, or fewer when the node budget is
        smaller (a tree of N nodes is at most N - 1 deep). SGLang sizes the accepted path
        (``speculative_num_steps + 1``) from it, and it must fit the verify width."""
        return min(self.max_depth, self.draft.max_nodes - 1)


def resolve_drafter_path(value: str | None) -> str:
    if value is None:
        raise ValueError(
            "SPECBLOCK needs --specblock-drafter-path (a drafter directory trained with"
            " `python -m sgl_spec.specblock.train`); launch through"
            " `python -m sgl_spec.launch_server`"
        )
    from sgl_spec.models.registry import resolve_model_path

    try:
        path = Path(resolve_model_path(value))
    except ValueError as exc:
        raise ValueError(f"--specblock-drafter-path: {exc}") from exc
    if not (path / "config.json").is_file():
        raise ValueError(f"--specblock-drafter-path: {value!r} has no config.json")
    return str(path)


def read_drafter_config(path: str) -> Any:
    from sgl_spec.specblock.model import CONFIG_NAME, SpecBlockConfig

    try:
        return SpecBlockConfig.from_dict(json.loads((Path(path) / CONFIG_NAME).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--specblock-drafter-path: bad {path}/{CONFIG_NAME}: {exc}") from exc


def check_target_fit(drafter_config: Any, target_config: Any, path: str) -> None:
    """The drafter must read this target's features and tokens (Eq. 1, App. A.1)."""
    problems = []
    if drafter_config.target_hidden_size != target_config.hidden_size:
        problems.append(
            f"target hidden size {target_config.hidden_size} != drafter's"
            f" {drafter_config.target_hidden_size}"
        )
    if drafter_config.target_vocab_size != target_config.vocab_size:
        problems.append(
            f"target vocab {target_config.vocab_size} != drafter's"
            f" {drafter_config.target_vocab_size}"
        )
    # SGLang captures a layer's *input*: the output of the last layer is not available.
    last = int(target_config.num_hidden_layers) - 2
    if max(drafter_config.aux_layer_ids) > last:
        problems.append(
            f"aux_layer_ids {tuple(drafter_config.aux_layer_ids)} need layer outputs up to"
            f" {last} (SGLang cannot capture the last layer's output)"
        )
    if problems:
        raise ValueError(
            f"--specblock-drafter-path: {path} does not fit the target: " + "; ".join(problems)
        )


def load_settings(config: SpecConfig) -> SpecBlockSettings:
    path = resolve_drafter_path(config.specblock_drafter_path)
    drafter_config = read_drafter_config(path)
    k = drafter_config.block_size if config.specblock_k is None else config.specblock_k
    if k > drafter_config.block_size:
        raise ValueError(
            f"--specblock-k {k} exceeds the drafter's trained block size"
            f" {drafter_config.block_size} ({path})"
        )
    draft = DraftSettings(
        num_blocks=config.specblock_m,
        bucket_map=config.specblock_bucket_map,
        max_nodes=(
            SPECBLOCK_DEFAULT_MAX_NODES
            if config.specblock_max_nodes is None
            else config.specblock_max_nodes
        ),
        use_rank_head=config.specblock_rank_head == "on",
    )
    adapt = None
    if config.specblock_adapt:
        adapt = AdaptConfig.parse(config.specblock_adapt_options)
    return SpecBlockSettings(path, k, draft, adapt)


def runtime_settings() -> SpecBlockSettings:
    """Settings inside the scheduler process (the config travels in the environment)."""
    return load_settings(SpecConfig.from_env())


class SpecBlockSpecAlgo(OwnDraftStateSpecAlgo):
    """Duck-typed SGLang algorithm: the drafter's KV lives in the worker, not in SGLang."""

    def handle_server_args(self, server_args: Any) -> None:
        settings = load_settings(SpecConfig.from_env())
        if server_args.speculative_draft_model_path is not None:
            raise ValueError(
                "SPECBLOCK drafts with --specblock-drafter-path; drop"
                " --speculative-draft-model-path"
            )
        require_single_rank("SPECBLOCK", server_args)
        if server_args.model_path is not None:
            _check_model_dir(settings.drafter_path, server_args.model_path)
        server_args.speculative_num_steps = settings.verify_depth
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = settings.draft.max_nodes
        if str(server_args.device).startswith("cuda") and not server_args.disable_cuda_graph:
            logger.warning("SPECBLOCK: disabling CUDA graphs (data-dependent trees)")
            server_args.disable_cuda_graph = True


def check_launch_args(config: SpecConfig, argv: list[str]) -> None:
    """In the launcher, before SGLang starts: refuse bad SPECBLOCK settings with one message
    (``ConfigError``) naming the flag or file."""
    from sgl_spec.argv import flag_value
    from sgl_spec.config import ConfigError

    if (flag_value(argv, "--speculative-algorithm") or "").upper() != NAME:
        if config.specblock_adapt:
            raise ConfigError("--specblock-adapt needs --speculative-algorithm SPECBLOCK")
        return
    try:
        settings = load_settings(config)
        model_path = flag_value(argv, "--model-path")
        if model_path is not None:
            _check_model_dir(settings.drafter_path, model_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _check_model_dir(drafter_path: str, model_path: str) -> None:
    """Refuse a drafter trained for another target, when the target is a local directory."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model_path)
    check_target_fit(read_drafter_config(drafter_path), target, drafter_path)


def register() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    @SpeculativeAlgorithm.register(NAME, supports_overlap=False, spec_class=SpecBlockSpecAlgo)
    def _factory(server_args: Any) -> type:
        from sgl_spec.specblock.worker import SpecBlockWorker

        return SpecBlockWorker
