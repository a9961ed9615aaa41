"""``--speculative-algorithm MTP_LORA``: the target drafts its own next tokens through mask
tokens that only a gated LoRA sees (``mtp/worker.py``).

For k drafts a step feeds (k+1)² tokens per request, so SGLang's verify buffers are sized from
the largest k this server may use (the adapter's k_max under ``--mtp-k auto``).
"""

from __future__ import annotations

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm
from sgl_spec.config import SpecConfig
from sgl_spec.mtp.settings import MtpSettings, load_settings

# On the shipped target + adapter a fixed k is slower than plain decoding on the CPU hosts
# measured (benchmarks/RESULTS.md); the controller keeps drafts off where they do not pay and
# turns them on where a step with drafts is cheap enough.
MTP_DEFAULT_K = "auto"


class MtpLora(Algorithm):
    name = "MTP_LORA"
    cuda_graph_off_reason = "per-step LoRA gates"
    parallel = frozenset({"tp_size", "dp_size"})
    own_draft_shape = "--mtp-k"

    def with_shipped_defaults(self, config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
        from sgl_spec.model_defaults import fill_unset_for_shipped
        from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER

        defaults = {"mtp_lora_path": DEFAULT_MTP_ADAPTER, "mtp_k": MTP_DEFAULT_K}
        return fill_unset_for_shipped(config, launch, self.name, defaults)

    def settings(self, config: SpecConfig, launch: LaunchArgs) -> MtpSettings:
        return load_settings(config, launch.model_path)

    def verify_shape(self, settings: MtpSettings) -> tuple[int, int]:
        k = settings.max_k
        return max(k, 1), (k + 1) ** 2

    def worker_class(self) -> type:
        from sgl_spec.mtp.worker import MtpLoraWorker

        return MtpLoraWorker


ALGORITHM = MtpLora()
