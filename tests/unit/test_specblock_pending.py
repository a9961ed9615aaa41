"""SPECBLOCK steps without drafts: the drafter reads their tokens later, in one extend
(``specblock/pending.py``, ``specblock/follow.py``), and ends where reading them one step at a
time would have left it; the pending rows survive SGLang's batch filter and merge."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_spec.specblock import follow
from sgl_spec.specblock.draft_kv import DrafterKVPool
from sgl_spec.specblock.follow import DrafterFollowing
from sgl_spec.specblock.info import SpecBlockDraftInput
from sgl_spec.specblock.pending import appended, no_pending, padded
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V, specblock_drafter

torch.set_num_threads(1)
F = 3 * SPECBLOCK_D  # captured features per token (low, mid, top layers)


class Follower(DrafterFollowing):
    """The drafter-following half of the worker, on a tiny drafter and one request's slots."""

    def __init__(self, num_reqs: int = 2, rows: int = 64) -> None:
        self.drafter = specblock_drafter()
        self.drafter_dtype = torch.float32
        self.device = "cpu"
        self.feature_index = torch.arange(F)  # hidden states are the features themselves
        cfg = self.drafter.config.llama_config()
        self._pool = DrafterKVPool(
            self.drafter.config.num_layers,
            rows,
            SPECBLOCK_K,
            cfg.num_key_value_heads,
            cfg.head_dim or SPECBLOCK_D // cfg.num_attention_heads,
            torch.float32,
            "cpu",
        )
        slots = torch.arange(num_reqs * 20).reshape(num_reqs, 20) + 1  # request r's locations
        self.model_runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=slots))


def _state(follower: Follower, root_cond: torch.Tensor, **pending) -> SpecBlockDraftInput:
    bs = root_cond.shape[0]
    fields = {**follower._no_pending(bs), **pending}
    return SpecBlockDraftInput(
        bonus_tokens=torch.zeros(bs, dtype=torch.int64),
        new_seq_lens=torch.zeros(bs, dtype=torch.int64),
        root_cond=root_cond,
        **fields,
    )


def _prompt(follower: Follower, reqs, feats, toks, lens) -> torch.Tensor:
    bs, t = toks.shape
    return follower._drafter_extend(
        reqs, torch.zeros(bs, dtype=torch.long), lens, feats.reshape(bs * t, F),
        toks.reshape(-1), torch.arange(bs) * t,
    )  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("limit", [16, 2])
def test_deferred_tokens_leave_the_drafter_where_eager_extends_would(monkeypatch, limit) -> None:
    """Two requests, prompts of 3 and 2 tokens, then 3 steps without drafts: read one step at
    a time (eager) or deferred and caught up before the next drafting step -- or, with a
    pending limit of 2, caught up at the end of the step that reached it."""
    monkeypatch.setattr(follow, "PENDING_LIMIT", limit)
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(2, 6, F, generator=gen)
    toks = torch.randint(0, SPECBLOCK_V, (2, 6), generator=gen)
    reqs, lens = torch.tensor([0, 1]), torch.tensor([3, 2])
    eager, deferred = Follower(), Follower()
    deferred.drafter.load_state_dict(eager.drafter.state_dict())
    root_e = _prompt(eager, reqs, feats, toks, lens)
    root_d = _prompt(deferred, reqs, feats, toks, lens)
    state = _state(deferred, root_d)
    committed = lens.clone()
    for step in range(3):
        rows = torch.stack([feats[b, committed[b]] for b in range(2)])  # [2, F]
        tokens = torch.stack([toks[b, committed[b]] for b in range(2)])
        root_e = eager._drafter_extend(
            reqs, committed, torch.ones(2, dtype=torch.long), rows, tokens, torch.arange(2)
        )
        carried = deferred._defer(reqs, committed + 1, state, state.root_cond, rows, tokens)
        committed = committed + 1
        state = _state(deferred, carried.pop("root_cond"), **carried)
        expected = (step + 1) % limit if limit < 16 else step + 1
        assert state.pending_count.tolist() == [expected, expected]
    root_d = deferred._catch_up(
        reqs, committed, state.pending_count, state.pending_tokens, state.pending_features,
        state.root_cond,
    )  # fmt: skip
    torch.testing.assert_close(root_d, root_e)
    for a, b in zip(
        eager._pool.keys + eager._pool.values,
        deferred._pool.keys + deferred._pool.values,
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_pending_rows_are_appended_per_request_and_padded() -> None:
    features, tokens, count = appended(
        torch.zeros(3, 1, 2), torch.tensor([[5], [0], [6]]), torch.tensor([1, 0, 1]),
        torch.ones(3, 2), torch.tensor([7, 8, 9]),
    )  # fmt: skip
    assert tokens.tolist() == [[5, 7], [8, 0], [6, 9]]
    assert count.tolist() == [2, 1, 2]
    assert features[1, 0].tolist() == [1.0, 1.0] and features[1, 1].tolist() == [0.0, 0.0]
    assert padded(tokens, 2) is tokens and padded(tokens, 4).shape == (3, 4)
    empty = no_pending(2, 5, torch.float32, "cpu")
    assert empty["pending_features"].shape == (2, 0, 5) and empty["pending_count"].sum() == 0


def test_pending_rows_survive_filter_and_merge() -> None:
    follower = Follower()
    a = _state(follower, torch.zeros(2, 4))
    b = _state(
        follower,
        torch.ones(1, 4),
        pending_features=torch.ones(1, 3, F),
        pending_tokens=torch.tensor([[1, 2, 3]]),
        pending_count=torch.tensor([3]),
    )
    a.merge_batch(b)
    assert a.pending_tokens.tolist() == [[0, 0, 0], [0, 0, 0], [1, 2, 3]]
    assert a.pending_features.shape == (3, 3, F) and a.pending_count.tolist() == [0, 0, 3]
    a.filter_batch(torch.tensor([2]))
    assert a.pending_tokens.tolist() == [[1, 2, 3]] and a.root_cond.tolist() == [[1.0] * 4]
