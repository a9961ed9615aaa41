"""SPECBLOCK's n-gram branch (``specblock/ngram_branch.py``, ``ngram_choice.py``): the corpus's
trees merged into the drafter's, the cut to the node budget, and when a step skips the drafter."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from sgl_spec.specblock.drafting import DraftResult
from sgl_spec.specblock.ngram_branch import (
    NgramBranch,
    mask_parents,
    match_depth,
    merge_ngram_tree,
    ngram_holds,
)
from sgl_spec.specblock.ngram_choice import EXPLORE_FIRST, EXPLORE_MAX, DrafterChoice
from sgl_spec.verify.tree import DraftTree
from tests.helpers.references import ancestor_mask


def _mask(parents: list[int]) -> np.ndarray:
    return ancestor_mask(parents).numpy().astype(np.int64)


def test_mask_parents_inverts_the_ancestor_mask() -> None:
    parents = [-1, 0, 1, 0, 3, 3, 1]
    assert mask_parents(_mask(parents)).tolist() == parents
    chain = [-1, 0, 1, 2, 3, 4, 5]
    batch = np.stack([_mask(parents), _mask(chain)])  # a batch's masks at once
    assert mask_parents(batch).tolist() == [parents, chain]


def test_merge_shares_the_drafters_nodes_and_adds_the_rest() -> None:
    tree = DraftTree.chain(5, [6, 7])  # 5 -> 6 -> 7
    tree.score = [0.0, -0.1, -0.3]
    # n-gram tree: 5 -> 6 -> 9, 5 -> 8, and padding (token 0 under the root)
    added = merge_ngram_tree(tree, [5, 6, 9, 8, 0], [-1, 0, 1, 0, 0], math.log(0.5), 7)
    assert tree.tokens == [5, 6, 7, 9, 8]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert added == [3, 4]
    assert tree.score[3] == pytest.approx(-0.1 + math.log(0.5))  # parent's score + log rate
    assert tree.score[4] == pytest.approx(math.log(0.5))


def test_merge_keeps_the_depth_bound_and_needs_the_same_root() -> None:
    tree = DraftTree.rooted_at(5)
    added = merge_ngram_tree(tree, [5, 1, 2, 3], [-1, 0, 1, 2], -1.0, 2)
    assert tree.tokens == [5, 1, 2] and added == [1, 2]  # the node at depth 3 is not added
    other = DraftTree.rooted_at(4)
    assert merge_ngram_tree(other, [5, 1], [-1, 0], -1.0, 7) == []
    assert other.num_nodes == 1


def test_ngram_holds_walks_the_accepted_tokens_down_the_tree() -> None:
    tokens, parents = [9, 4, 5, 6, 0], [-1, 0, 1, 0, 0]  # 9 -> 4 -> 5, 9 -> 6, padding
    assert ngram_holds(tokens, parents, [4, 5, 7]) == 2
    assert ngram_holds(tokens, parents, [6, 5]) == 1
    assert ngram_holds(tokens, parents, [0]) == 0  # padding holds nothing
    assert ngram_holds(tokens, parents, []) == 0


def test_match_depth_ignores_padding() -> None:
    assert match_depth([9, 0, 0, 0], [-1, 0, 0, 0]) == 0
    assert match_depth([9, 4, 5, 0], [-1, 0, 1, 0]) == 2
    assert match_depth([9, 4, 5, 6], [-1, 0, 0, 2]) == 2


def _req(rid: str, prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids_unpadded=prompt, output_ids=output)


def test_branch_drafts_from_the_prompt_and_cuts_to_the_budget() -> None:
    """With SGLang's corpus: a prompt that repeats yields its continuation under the root; the
    merged tree holds at most the budget's nodes, shared with the drafter's where they agree."""
    branch = NgramBranch(6)
    prompt = [11, 12, 13, 14, 15, 16, 17, 11, 12]
    req = _req("a", prompt, [])
    drafter_tree = DraftTree.chain(12, [13, 99])
    drafter_tree.score = [0.0, -0.2, -0.4]
    assert not branch.plan([req])  # nothing measured: the drafter runs
    drafted, context = branch.draft([12], 4, 7, lambda: (DraftResult([drafter_tree], 2), "ctx"))
    assert context == "ctx" and not branch.skipped
    (tree,) = drafted.trees
    assert tree.num_nodes <= 4
    assert tree.tokens[:3] == [12, 13, 99]  # the drafter's nodes, 13 shared with the n-grams
    assert 14 in tree.tokens  # the prompt's continuation after 12, 13
    # the verify accepted 12 -> 13 -> 14: the n-gram node counts as offered and accepted
    path = [0, 1, tree.tokens.index(14)]
    branch.observe(drafted.trees, [path], 0.01)
    assert sum(branch.accepted) > 0 and sum(branch.offered) > 0
    assert drafted.node_source == []  # the drafter's per-node records no longer apply


def test_branch_alone_and_flush_keeps_the_rates() -> None:
    """A step the choice runs without the drafter verifies the n-gram trees alone, cut to the
    shape the worker passes; ``reset`` (``/flush_cache``) empties the corpus but keeps what was
    measured."""
    branch = NgramBranch(6)
    branch.choice.skips = lambda buckets: True
    req = _req("a", [11, 12, 13, 14, 15, 16, 17, 11, 12], [])
    no_drafter = lambda: pytest.fail("the drafter ran")  # noqa: E731
    assert branch.plan([req]) and branch.skipped
    drafted, context = branch.draft([12], 6, 5, no_drafter)
    assert context is None
    assert drafted.trees[0].tokens[:4] == [12, 13, 14, 15]
    branch.observe(drafted.trees, [[0, 1, 2, 3]], 0.01)
    assert branch.choice.skipped == 1
    offered, accepted = list(branch.offered), list(branch.accepted)
    assert sum(accepted) > 0
    branch.reset()
    assert (branch.offered, branch.accepted) == (offered, accepted)
    assert branch.plan([_req("b", [20, 21, 12], [])])
    drafted, _ = branch.draft([12], 6, 5, no_drafter)
    assert 13 not in drafted.trees[0].tokens  # the first prompt is gone from the corpus


def test_plan_skips_only_where_allowed_and_as_rank_zero_says() -> None:
    """``may_skip`` False (the node-budget controller would not draft): the choice is not asked,
    the corpus is matched only if the step drafts after all (a step the controller runs without
    drafts pays no match), and the drafter runs; under tensor parallelism ``agree`` (rank 0's
    choice) decides."""
    req = _req("a", [11, 12, 13, 11, 12], [])
    branch = NgramBranch(4)
    branch.choice.skips = lambda buckets: pytest.fail("the choice was asked")
    matches = []
    match = branch._match
    branch._match = lambda reqs: matches.append(len(reqs)) or match(reqs)
    assert not branch.plan([req], may_skip=False)
    assert matches == []  # a plain step would follow: nothing matched
    assert not branch.plan([req], may_skip=False)
    tree = DraftTree.chain(12, [13])
    drafted, _ = branch.draft([12], 4, 3, lambda: (DraftResult([tree], 1), None))
    assert matches == [1]  # this step drafts: matched now
    assert drafted.trees[0].tokens[:2] == [12, 13]
    assert 11 in drafted.trees[0].tokens  # the prompt's continuation after 11, 12 -> 13
    asked = []
    ranked = NgramBranch(4, agree=lambda mine: asked.append(mine) or True)
    assert ranked.plan([req], may_skip=False) and asked == [False]  # rank 0 skips: so do we


def test_branch_failure_leaves_the_drafters_trees() -> None:
    class Broken:
        def synchronize(self):
            raise RuntimeError("corpus down")

        def batch_put(self, tokens):
            pass

        def erase_match_state(self, rids):
            pass

    tree = DraftTree.chain(3, [4])
    for agree in (None, lambda mine: True):  # even where rank 0 would skip
        branch = NgramBranch(4, corpus=Broken(), agree=agree)
        assert not branch.plan([_req("a", [1, 2, 3], [])])
        drafted, _ = branch.draft([3], 4, 3, lambda: (DraftResult([tree], 1), None))
        assert drafted.trees == [tree] and not branch.skipped
    branch.observe(drafted.trees, [[0, 1]], 0.01)  # nothing recorded, no error


def _fill(
    choice: DrafterChoice, bucket: int, merged: int, ngram: int, step_s: float, draft_s: float
):
    for _ in range(5):
        choice.observe([bucket], False, [merged], [ngram], step_s, draft_s)


def test_choice_skips_the_drafter_only_where_the_ngrams_pay_more() -> None:
    choice = DrafterChoice(4)
    assert not choice.skips([3])  # nothing measured: draft
    # deep matches: the n-grams alone hold what the merged trees accept, at 60% of the time
    _fill(choice, 3, merged=4, ngram=4, step_s=0.010, draft_s=0.004)
    # shallow matches: the drafter's nodes carry the step
    _fill(choice, 1, merged=4, ngram=1, step_s=0.010, draft_s=0.004)
    assert not choice.skips([1])
    assert not choice.skips([3, 3])  # another batch size: its times are not measured yet
    # skips, but drafts now and then to keep the merged figures current: after EXPLORE_FIRST
    # would-skip steps, then after twice as many each time
    decisions = [choice.skips([3]) for _ in range(7 * EXPLORE_FIRST)]
    drafted = [i + 1 for i, skipped in enumerate(decisions) if not skipped]
    assert drafted == [EXPLORE_FIRST, 3 * EXPLORE_FIRST, 7 * EXPLORE_FIRST]
    # ... up to EXPLORE_MAX apart; a step that drafts by choice starts over
    for _ in range(4 * EXPLORE_MAX):
        choice.skips([3])
    assert choice._explore_after == EXPLORE_MAX
    assert not choice.skips([1]) and choice._explore_after == EXPLORE_FIRST
    # a measured step without the drafter that costs as much as a merged one ends the skipping
    for _ in range(20):
        choice.observe([3], True, [3], [3], 0.011, 0.0)
    assert not choice.skips([3])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"specblock_ngram": 1}, "0 (off) or >= 2"),
        ({"specblock_ngram": 8, "specblock_adapt": True}, "drop one"),
        ({"specblock_ngram": 8, "specblock_budget": "off"}, "root alone"),
    ],
)
def test_bad_ngram_flags_are_refused(fields: dict, message: str) -> None:
    from sgl_spec.flags import ConfigError
    from sgl_spec.specblock.flags import SpecBlockFlags

    with pytest.raises(ConfigError, match=re.escape(message)):
        SpecBlockFlags(**fields).validate()
    SpecBlockFlags(specblock_ngram=8).validate()  # on its own: fine


def test_flush_waits_for_the_running_insert() -> None:
    """``reset`` (``/flush_cache``) lets an insert still running on the corpus's thread finish
    before it empties the corpus, so that insert cannot land in the emptied corpus."""
    calls = []

    class Recording:
        def synchronize(self):
            calls.append("synchronize")

        def reset(self):
            calls.append("reset")

    NgramBranch(4, corpus=Recording()).reset()
    assert calls == ["synchronize", "reset"]
