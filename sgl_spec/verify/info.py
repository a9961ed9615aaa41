"""SGLang's ``EagleVerifyInput`` for trees of any shape: SpecBlock's rank head shapes each tree
and MineDraft's chains vary per request, so there is no fixed top-k per level; ``spec_steps``
is the depth bound (M*K for SpecBlock, the chain length for MineDraft)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.speculative.eagle_info import EagleVerifyInput


@dataclass
class IrregularTreeVerifyInput(EagleVerifyInput):
    """``spec_steps`` is the depth bound; the tree shape is data-dependent."""

    @property
    def tree_topk(self) -> int:
        return -1  # irregular tree: the CPU backend then applies the custom mask
