"""SPECBLOCK serving metrics (paper §4.1 and App. C), logged by the worker.

- acceptance length τ: accepted drafts + 1 bonus token per request and verifier call (the
  definition in ``sgl_spec/verify``), the same number SGLang reports as
  ``meta_info.spec_accept_length``;
- drafter forwards per iteration: the extend forward plus the tree forwards;
- T_D%: share of the decode step's wall time spent in drafter forwards (tree + extend);
- α_k: P(the node at depth k of the accepted path is accepted | depth k-1 was, and the tree had
  candidates there), per depth k = 1..M*K (App. C, Figure 5a, measured on served trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SpecBlockStats:
    max_depth: int
    steps: int = 0
    requests: int = 0  # request-iterations (sum of batch sizes)
    accepted: int = 0  # accepted drafts
    draft_forwards: int = 0  # drafter forwards over all steps
    tree_nodes: int = 0  # real tree nodes verified (roots included)
    draft_s: float = 0.0
    step_s: float = 0.0
    reached: list[int] = field(default_factory=list)  # [depth] paths that offered depth k
    hit: list[int] = field(default_factory=list)  # [depth] paths accepted at depth k

    def __post_init__(self) -> None:
        self.reached = [0] * self.max_depth
        self.hit = [0] * self.max_depth

    def record_step(
        self,
        num_accepted: Sequence[int],  # per request, drafts only
        offered_depth: Sequence[int],  # per request: deepest depth with candidates on the path
        num_nodes: Sequence[int],
        draft_forwards: int,
        draft_s: float,
        step_s: float,
    ) -> None:
        self.steps += 1
        self.requests += len(num_accepted)
        self.accepted += sum(num_accepted)
        self.tree_nodes += sum(num_nodes)
        self.draft_forwards += draft_forwards
        self.draft_s += draft_s
        self.step_s += step_s
        for a, offered in zip(num_accepted, offered_depth, strict=True):
            for depth in range(1, min(offered, self.max_depth) + 1):
                self.reached[depth - 1] += 1
                if a >= depth:
                    self.hit[depth - 1] += 1

    @property
    def accept_length(self) -> float:
        return 1 + self.accepted / max(self.requests, 1)

    @property
    def alpha(self) -> list[float | None]:
        return [h / r if r else None for h, r in zip(self.hit, self.reached, strict=True)]

    def summary(self, extra: str = "") -> str:
        """The metrics log line; ``extra`` appends the adaptation's decisions when it is on
        (``CostAwareBandit.summary``: action counts, last s, v_head/v_full, updates, rollbacks)."""
        alpha = ",".join("-" if a is None else f"{a:.2f}" for a in self.alpha)
        return (
            f"SPECBLOCK: steps={self.steps} mean_accept_length={self.accept_length:.3f}"
            f" drafter_forwards_per_iter={self.draft_forwards / max(self.steps, 1):.2f}"
            f" T_D%={100 * self.draft_s / max(self.step_s, 1e-9):.1f}"
            f" mean_tree_nodes={self.tree_nodes / max(self.requests, 1):.1f}"
            f" alpha_k=[{alpha}]"
            f" mean_step_ms={1000 * self.step_s / max(self.steps, 1):.2f}"
            + (f" {extra}" if extra else "")
        )


def offered_depth(parents: Sequence[int], path: Sequence[int]) -> int:
    """Deepest depth at which the tree offered candidates along the accepted ``path`` (root
    first): the path's own length, plus one when its last node has children (a rejection)."""
    last = path[-1]
    has_children = any(p == last for p in parents)
    return len(path) - 1 + (1 if has_children else 0)
