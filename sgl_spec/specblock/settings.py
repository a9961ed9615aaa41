"""SPECBLOCK's settings, built from the ``--specblock-*`` flags (``SpecConfig``) and the
drafter checkpoint; every problem with them or with the drafter's fit to the target is refused
with one message naming the flag or file. Read by the launch check (``specblock/algorithm.py``),
the worker and the KV-budget patch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_spec.config import SpecConfig
from sgl_spec.specblock.adapt.policy import AdaptConfig
from sgl_spec.specblock.drafting import DraftSettings
from sgl_spec.specblock.flags import SPECBLOCK_DEFAULT_MAX_NODES


@dataclass(frozen=True)
class SpecBlockSettings:
    drafter_path: str
    drafter_config: Any  # sgl_spec.specblock.config.DrafterConfig, read once with the settings
    block_size: int  # K positions used per block (<= the drafter's trained K)
    draft: DraftSettings
    adapt: AdaptConfig | None = None  # --specblock-adapt (cost-aware adaptation, §3.4)
    drafter_dtype: str = "auto"  # --specblock-drafter-dtype (resolved by ``drafter_dtype``)
    budget: str = "fixed"  # --specblock-budget: fixed, auto (the controller), cycle or off
    ngram: int = 0  # --specblock-ngram: n-gram tree nodes merged per request (0: off)

    def budgets(self) -> tuple[int, ...]:
        """The node budgets the controller chooses from, cheapest first: 1 (the root alone, no
        drafts), then powers of two below ``max_nodes``, then ``max_nodes``."""
        top = self.draft.max_nodes
        return (*(1 << i for i in range(top.bit_length()) if 1 << i < top), top)

    def step_budgets(self) -> tuple[int, ...]:
        """The node budgets steps run with: ``budgets()`` under auto or cycle, else the one
        budget (1 under off: no drafts)."""
        if self.budget in ("auto", "cycle"):
            return self.budgets()
        return (1,) if self.budget == "off" else (self.draft.max_nodes,)

    @property
    def runs_plain_steps(self) -> bool:
        """Some steps verify the root alone: the drafter then reads committed tokens later,
        from rows kept per location (``target_rows.py``)."""
        return 1 in self.step_budgets()

    def budget_drafts(self) -> tuple[int, ...]:
        """The most drafts one request can accept under each of ``budgets()``."""
        return tuple(min(n - 1, self.max_depth) for n in self.budgets())

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
    from sgl_spec.models.registry import resolve_artifact_dir

    return resolve_artifact_dir(
        value, "--specblock-drafter-path", "config.json", "SPECBLOCK", "sgl_spec.specblock.train"
    )


def read_drafter_config(path: str) -> Any:
    from sgl_spec.specblock.config import CONFIG_NAME, SpecBlockConfig

    try:
        return SpecBlockConfig.from_dict(json.loads((Path(path) / CONFIG_NAME).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--specblock-drafter-path: bad {path}/{CONFIG_NAME}: {exc}") from exc


def read_drafter(path: str) -> Any:
    """The drafter's config, its weights file checked against it (header only: names and
    shapes); ``ValueError`` naming ``--specblock-drafter-path``."""
    from sgl_spec.common.checkpoints import check_state_dict_file, module_shapes
    from sgl_spec.specblock.config import WEIGHTS_NAME
    from sgl_spec.specblock.model import SpecBlockDrafter

    drafter_config = read_drafter_config(path)
    expected = module_shapes(lambda: SpecBlockDrafter(drafter_config))
    check_state_dict_file(Path(path) / WEIGHTS_NAME, expected, "--specblock-drafter-path")
    return drafter_config


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


def load_settings(config: SpecConfig, model_path: str | None = None) -> SpecBlockSettings:
    """SPECBLOCK's settings from its flags; with ``model_path``, the drafter is checked against
    that target too."""
    path = resolve_drafter_path(config.specblock_drafter_path)
    if model_path is not None:
        check_model_dir(path, model_path)
    drafter_config = read_drafter(path)
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
    return SpecBlockSettings(
        path,
        drafter_config,
        k,
        draft,
        adapt,
        config.specblock_drafter_dtype,
        budget=config.specblock_budget,
        ngram=config.specblock_ngram or 0,
    )


def drafter_dtype(choice: str, target_dtype: torch.dtype) -> torch.dtype:
    """The drafter's dtype for ``--specblock-drafter-dtype``: an explicit choice as given,
    ``auto`` the target's. (A bfloat16 drafter under a float32 target on an AMX-BF16 CPU drafted
    no faster in served steps, ``benchmarks/RESULTS.md``, so ``auto`` does not pick it.)"""
    return target_dtype if choice == "auto" else getattr(torch, choice)


def check_model_dir(drafter_path: str, model_path: str) -> None:
    """Refuse a drafter trained for another target, when the target is a local directory."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model_path)
    check_target_fit(read_drafter_config(drafter_path), target, drafter_path)
