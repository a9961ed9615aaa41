"""MineDraft: batch-parallel speculative decoding (paper §5).

Two request batches alternate each SD step: the draft server drafts one while the target
verifies the other. This package holds the pure parts (the Batch Manager of §5.1, ``stats.py``),
the draft-server process (``draft_server.py`` over ``draft_model.py``: the Drafter of §5.2 on its
own device), its scheduler-side ``client.py`` and the supervised ``link.py``, and the SGLang side:
``algorithm.py`` (registration, flags) and ``worker.py`` (the two batches alternating inside
SGLang's decode step). Only the pure parts are imported here: the rest pull in SGLang and torch.
"""

from sgl_spec.minedraft.batch_manager import POLICIES, BatchManager, CoverageStats, StepPlan

__all__ = ["POLICIES", "BatchManager", "CoverageStats", "StepPlan"]
