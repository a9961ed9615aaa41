"""``--speculative-algorithm SPECBLOCK``: a block-iterative drafter on the target's hidden
states grows a rank-shaped draft tree that the target verifies in one forward
(``specblock/worker.py``).

SGLang sizes a step's KV reservation from the deepest verifiable path (M*K, bounded by the node
budget) and its verify buffers from the tree width (``--specblock-max-nodes``).
"""

from __future__ import annotations

from typing import Any

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm
from sgl_spec.config import SpecConfig
from sgl_spec.specblock.flags import SPECBLOCK_SHIPPED_MAX_NODES, SPECBLOCK_SHIPPED_NGRAM
from sgl_spec.specblock.settings import SpecBlockSettings, load_settings


class SpecBlock(Algorithm):
    name = "SPECBLOCK"
    cuda_graph_off_reason = "data-dependent trees"
    parallel = frozenset({"tp_size", "dp_size"})
    own_draft_shape = "--specblock-k, --specblock-m and --specblock-max-nodes"

    def with_shipped_defaults(self, config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
        """The shipped drafter, and the node budget and n-gram branch measured best on the
        shipped models (the branch not under --specblock-adapt or --specblock-budget off,
        which it does not combine with)."""
        from sgl_spec.model_defaults import fill_unset_for_shipped
        from sgl_spec.models.registry import DEFAULT_SPECBLOCK_DRAFTER

        defaults: dict[str, object] = {
            "specblock_drafter_path": DEFAULT_SPECBLOCK_DRAFTER,
            "specblock_max_nodes": SPECBLOCK_SHIPPED_MAX_NODES,
        }
        if not config.specblock_adapt and config.specblock_budget != "off":
            defaults["specblock_ngram"] = SPECBLOCK_SHIPPED_NGRAM
        return fill_unset_for_shipped(config, launch, self.name, defaults)

    def settings(self, config: SpecConfig, launch: LaunchArgs) -> SpecBlockSettings:
        """Under tensor parallelism every rank runs its own replica of the drafter on the same
        inputs, so all ranks grow the same tree; online adaptation trains in a background
        thread, timed by each rank apart, and would let the replicas drift apart."""
        if config.specblock_adapt and launch.tp_size > 1:
            raise ValueError(
                f"--specblock-adapt with --tp-size {launch.tp_size}: each tensor rank would"
                " train its own copy of the drafter and their trees would differ; drop one"
            )
        return load_settings(config, launch.model_path)

    def verify_shape(self, settings: SpecBlockSettings) -> tuple[int, int]:
        return settings.verify_depth, settings.draft.max_nodes

    def extra_kv_bytes_per_token(self, settings: SpecBlockSettings, dtype: Any) -> int:
        """The drafter's KV: one row (K positions x drafter layers) per target KV location;
        with steps without drafts also the unread tokens' rows (``target_rows.py``)."""
        from sgl_spec.specblock.draft_kv import drafter_kv_bytes_per_row
        from sgl_spec.specblock.settings import drafter_dtype
        from sgl_spec.specblock.target_rows import target_rows_bytes_per_row

        config = settings.drafter_config
        extra = drafter_kv_bytes_per_row(config, dtype)
        if settings.runs_plain_steps:
            features = len(config.aux_layer_ids) * config.target_hidden_size
            rows_dtype = drafter_dtype(settings.drafter_dtype, dtype)
            extra += target_rows_bytes_per_row(features, rows_dtype)
        return extra

    def worker_class(self) -> type:
        from sgl_spec.specblock.worker import SpecBlockWorker

        return SpecBlockWorker


ALGORITHM = SpecBlock()
