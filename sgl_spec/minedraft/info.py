"""What MINEDRAFT carries between decode steps in SGLang's batch.

Only the bonus token (verified, no KV yet, at position ``seq_len``) and the committed length:
the drafts themselves live in the worker, keyed by request id, because they are produced by the
draft server one step ahead for half of the batch (paper §5.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.common.draft_input import CarriedDraftInput


@dataclass
class MineDraftDraftInput(CarriedDraftInput):
    pass
