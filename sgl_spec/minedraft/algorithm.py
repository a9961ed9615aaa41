"""``--speculative-algorithm MINEDRAFT``: batch-parallel speculative decoding. Requests are
split into two batches; a draft server on a device of its own drafts one while the target
verifies the other (``minedraft/worker.py``, paper §5).
"""

from __future__ import annotations

from typing import Any

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm
from sgl_spec.config import SpecConfig
from sgl_spec.minedraft.settings import MineDraftSettings, feature_bytes_per_token, load_settings


class MineDraft(Algorithm):
    name = "MINEDRAFT"
    uses_draft_model = True
    # the shipped draft model drafts a chain of 3 (the draft server's device defaults to cpu:1
    # or the last GPU: settings.py)
    shipped_argv = {"--speculative-num-steps": "3"}
    cuda_graph_off_reason = "the batch is split every step"
    # tp: rank 0 drives the replica's one draft server and shares its drafts (rank_link.py);
    # dp: each replica has its own draft server on its own device (settings.py)
    parallel = frozenset({"tp_size", "dp_size"})

    def with_shipped_defaults(self, config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
        """Hosting a SpecBlock drafter on the shipped target: the shipped drafter."""
        if config.minedraft_drafter != "specblock":
            return config
        from sgl_spec.model_defaults import fill_unset_for_shipped
        from sgl_spec.models.registry import DEFAULT_SPECBLOCK_DRAFTER

        defaults = {"specblock_drafter_path": DEFAULT_SPECBLOCK_DRAFTER}
        return fill_unset_for_shipped(config, launch, self.name, defaults)

    def settings(self, config: SpecConfig, launch: LaunchArgs) -> MineDraftSettings:
        settings = load_settings(config, launch)
        if launch.eagle_topk not in (None, 1):
            raise ValueError(
                f"MINEDRAFT drafts chains: --speculative-eagle-topk 1, not {launch.eagle_topk}"
            )
        if launch.num_draft_tokens not in (None, settings.width):
            raise ValueError(
                "MINEDRAFT: --speculative-num-draft-tokens must be --speculative-num-steps + 1"
                f" = {settings.width} for a chain, got {launch.num_draft_tokens}"
            )
        return settings

    def cpu_cores_apart(
        self, config: SpecConfig, launch: LaunchArgs, environ: dict[str, str]
    ) -> list[int]:
        """Each replica's ``cpu:N`` draft server: N cores the ranks leave alone."""
        from sgl_spec.minedraft.settings import plan_draft_cores

        return plan_draft_cores(config.speculative_draft_device, launch, environ)

    def verify_shape(self, settings: MineDraftSettings) -> tuple[int, int]:
        return settings.num_steps, settings.width

    def extra_kv_bytes_per_token(self, settings: MineDraftSettings, dtype: Any) -> int:
        """Hosting a SpecBlock drafter: one row of the target's features per target KV
        location (``TargetFeatureCache``); a draft model costs the target nothing."""
        return feature_bytes_per_token(settings, dtype)

    def worker_class(self) -> type:
        from sgl_spec.minedraft.worker import MineDraftWorker

        return MineDraftWorker


ALGORITHM = MineDraft()
