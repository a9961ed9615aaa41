"""MineDraft: batch-parallel speculative decoding (paper §5).

Two request batches alternate each SD step: the draft server drafts one while the target
verifies the other. This package holds the pure parts (the Batch Manager of §5.1), the
draft-server process (``draft_server.py`` over ``draft_model.py``: the Drafter of §5.2 on its own
device) and its scheduler-side ``client.py``; the SGLang-facing scheduler and worker build on
them. The draft-server modules are not imported here: they pull in SGLang and torch.
"""

from sgl_spec.minedraft.batch_manager import POLICIES, BatchManager, CoverageStats, StepPlan

__all__ = ["POLICIES", "BatchManager", "CoverageStats", "StepPlan"]
