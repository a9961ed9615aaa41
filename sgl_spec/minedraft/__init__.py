"""MineDraft: batch-parallel speculative decoding (paper §5).

Two request batches alternate each SD step: the draft server drafts one while the target
verifies the other. This package holds the pure parts (the Batch Manager of §5.1); the
SGLang-facing scheduler, worker and draft server build on them.
"""

from sgl_spec.minedraft.batch_manager import POLICIES, BatchManager, CoverageStats, StepPlan

__all__ = ["POLICIES", "BatchManager", "CoverageStats", "StepPlan"]
