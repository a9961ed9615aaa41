"""SPECBLOCK's drafter reading committed tokens late: steps without drafts and deferred prompts
keep their tokens' rows per target KV location (``specblock/target_rows.py``), and one catch-up
extend (``specblock/follow.py``) leaves the drafter where reading them one step at a time would
have -- in request groups of any size, and for the unread prefix a radix-cache hit brings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_spec.specblock import follow
from sgl_spec.specblock.draft_kv import DrafterKVPool
from sgl_spec.specblock.follow import DrafterFollowing
from sgl_spec.specblock.info import SpecBlockDraftInput
from sgl_spec.specblock.target_rows import TargetRows, target_rows_bytes_per_row
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V, specblock_drafter

torch.set_num_threads(1)
F = 3 * SPECBLOCK_D  # captured features per token (low, mid, top layers)
SLOTS = 20  # positions per request


class Follower(DrafterFollowing):
    """The drafter-following half of the worker, on a tiny drafter; request r's position p
    lives at location 1 + r * SLOTS + p (``slots`` permutes those if given)."""

    def __init__(self, num_reqs: int = 2, lazy: bool = True, slots=None) -> None:
        self.drafter = specblock_drafter()
        self.drafter_dtype = torch.float32
        self.device = "cpu"
        self.feature_index = torch.arange(F)  # hidden states are the features themselves
        if slots is None:
            slots = torch.arange(num_reqs * SLOTS).reshape(num_reqs, SLOTS) + 1
        rows = int(slots.max()) + 1
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
        self._rows = TargetRows(rows, F, torch.float32, "cpu") if lazy else None
        self.model_runner = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=slots),
            token_to_kv_pool=SimpleNamespace(size=rows - 2, page_size=1),
        )


def _read_now(follower: Follower, reqs, committed, n, feats, toks) -> torch.Tensor:
    """The drafter reads positions committed .. committed+n-1 of each request at once."""
    bs = reqs.shape[0]
    rows = torch.cat([feats[b, committed[b] : committed[b] + n[b]] for b in range(bs)])
    tokens = torch.cat([toks[b, committed[b] : committed[b] + n[b]] for b in range(bs)])
    starts = torch.cumsum(n, 0) - n
    return follower._drafter_extend(reqs, committed, n, rows, tokens, starts)


def _same_drafter_state(a: Follower, b: Follower, locs: torch.Tensor) -> None:
    for x, y in zip(a._pool.keys + a._pool.values, b._pool.keys + b._pool.values, strict=True):
        torch.testing.assert_close(x[locs], y[locs])


def _stream(seed: int = 7, bs: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bs, SLOTS, F, generator=gen), torch.randint(
        0, SPECBLOCK_V, (bs, SLOTS), generator=gen
    )


@torch.no_grad()
@pytest.mark.parametrize("pairs", [1 << 22, 1])  # one group; one request per group
def test_deferred_prompt_and_plain_steps_leave_the_drafter_where_eager_reads_would(
    monkeypatch, pairs
) -> None:
    """Two requests, prompts of 3 and 2 tokens, then 3 steps without drafts: read at once
    (eager) or kept as rows -- prompt included -- and caught up before the next drafting step."""
    monkeypatch.setattr(follow, "CATCH_UP_PAIRS", pairs)
    feats, toks = _stream()
    reqs, lens = torch.tensor([0, 1]), torch.tensor([3, 2])
    eager, lazy = Follower(lazy=False), Follower()
    lazy.drafter.load_state_dict(eager.drafter.state_dict())
    zero = torch.zeros(2, dtype=torch.long)
    root_e = _read_now(eager, reqs, zero, lens, feats, toks)
    prompt_rows = torch.cat([feats[b, : lens[b]] for b in range(2)])
    prompt_toks = torch.cat([toks[b, : lens[b]] for b in range(2)])
    lazy._store_committed(reqs, zero, lens, prompt_rows, prompt_toks)
    pending = lazy._rows.unread_tail(lazy.model_runner.req_to_token_pool.req_to_token, reqs, lens)
    assert pending.tolist() == [3, 2]
    committed = lens.clone()
    one = torch.ones(2, dtype=torch.long)
    for _ in range(3):
        root_e = _read_now(eager, reqs, committed, one, feats, toks)
        rows = torch.stack([feats[b, committed[b]] for b in range(2)])
        tokens = torch.stack([toks[b, committed[b]] for b in range(2)])
        lazy._store_committed(reqs, committed, one, rows, tokens)
        committed, pending = committed + 1, pending + 1
    root_l = lazy._catch_up(reqs, committed, pending, torch.zeros_like(root_e))
    torch.testing.assert_close(root_l, root_e)
    locs = torch.cat([1 + b * SLOTS + torch.arange(int(committed[b])) for b in range(2)])
    _same_drafter_state(eager, lazy, locs)
    assert bool(lazy._rows.read[locs].all())


@torch.no_grad()
def test_catch_up_reads_only_requests_with_unread_tokens() -> None:
    """A request with nothing unread keeps its root condition; the other's is caught up."""
    feats, toks = _stream(seed=3)
    reqs, lens = torch.tensor([0, 1]), torch.tensor([4, 4])
    follower = Follower()
    follower._store_committed(reqs, torch.zeros(2, dtype=torch.long), lens,
                              feats[:, :4].reshape(8, F), toks[:, :4].reshape(-1))  # fmt: skip
    before = torch.full((2, SPECBLOCK_D), 5.0)
    after = follower._catch_up(reqs, lens, torch.tensor([0, 4]), before)
    assert after[0].tolist() == before[0].tolist()
    assert not torch.equal(after[1], before[1])
    assert not bool(follower._rows.read[1:5].any()) and bool(follower._rows.read[21:25].all())


@torch.no_grad()
def test_radix_prefix_left_unread_is_read_with_the_new_request() -> None:
    """Request 1 shares request 0's first 5 locations (a radix-cache hit) which request 0 never
    had read: the new request's unread count covers the shared prefix too, and its catch-up
    leaves the drafter as reading the whole sequence at once."""
    feats, toks = _stream(seed=11, bs=1)
    slots = torch.arange(2 * SLOTS).reshape(2, SLOTS) + 1
    slots[1, :5] = slots[0, :5]
    lazy, eager = Follower(slots=slots), Follower(slots=slots, lazy=False)
    eager.drafter.load_state_dict(lazy.drafter.state_dict())
    r0, r1 = torch.tensor([0]), torch.tensor([1])
    lazy._store_committed(r0, torch.tensor([0]), torch.tensor([5]), feats[0, :5], toks[0, :5])
    # request 1: the 5 cached positions, then 3 new ones of its own
    lazy._store_committed(r1, torch.tensor([5]), torch.tensor([3]), feats[0, 5:8], toks[0, 5:8])
    req_to_token = slots
    assert lazy._rows.unread_tail(req_to_token, r1, torch.tensor([8])).tolist() == [8]
    root_l = lazy._catch_up(r1, torch.tensor([8]), torch.tensor([8]), torch.zeros(1, SPECBLOCK_D))
    root_e = _read_now(eager, r1, torch.tensor([0]), torch.tensor([8]), feats, toks)
    torch.testing.assert_close(root_l, root_e)
    _same_drafter_state(eager, lazy, slots[1, :8])
    # all read now: a third request on the same prefix has only its own new tokens unread
    assert lazy._rows.unread_tail(req_to_token, r1, torch.tensor([8])).tolist() == [0]


def test_unread_tail_and_rows_of_a_stored_range() -> None:
    rows = TargetRows(16, 2, torch.float32, "cpu")
    req_to_token = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    rows.store(torch.tensor([1, 2, 3, 6, 7]), torch.arange(10.0).view(5, 2),
               torch.tensor([11, 12, 13, 16, 17]))  # fmt: skip
    rows.mark_read(torch.tensor([1, 6, 7]))
    reqs = torch.tensor([0, 1])
    assert rows.unread_tail(req_to_token, reqs, torch.tensor([3, 2])).tolist() == [2, 0]
    features, tokens = rows.rows(req_to_token, reqs, torch.tensor([1, 0]), torch.tensor([2, 1]))
    assert tokens.tolist() == [[12, 13], [16, 0]]
    assert features[0].tolist() == [[2.0, 3.0], [4.0, 5.0]] and features[1, 1].tolist() == [0, 0]
    rows.store(torch.tensor([6]), torch.zeros(1, 2), torch.tensor([99]))  # location reused
    assert rows.unread_tail(req_to_token, reqs, torch.tensor([3, 2])).tolist() == [2, 2]
    assert target_rows_bytes_per_row(2, torch.float32) == 2 * 4 + 8 + 1
    assert rows.nbytes() == 16 * (2 * 4 + 8 + 1)


def test_catch_up_groups_fit_the_pair_budget(monkeypatch) -> None:
    monkeypatch.setattr(follow, "CATCH_UP_PAIRS", 100)
    count = torch.tensor([1, 0, 2, 1, 3])
    committed = torch.tensor([1, 9, 2, 1, 3])
    todo = torch.nonzero(count > 0).squeeze(1)
    groups = [g.tolist() for g in follow._groups(todo, count, committed, 2)]
    # pairs per request: s=2n, s*(2c+s): [8, -, 32, 8, 72]
    assert groups == [[0, 2, 3], [4]]
    monkeypatch.setattr(follow, "CATCH_UP_PAIRS", 1)
    assert [g.tolist() for g in follow._groups(todo, count, committed, 2)] == [[0], [2], [3], [4]]


def test_unread_counts_survive_filter_and_merge() -> None:
    def state(root, count):
        bs = root.shape[0]
        return SpecBlockDraftInput(
            bonus_tokens=torch.zeros(bs, dtype=torch.int64),
            new_seq_lens=torch.zeros(bs, dtype=torch.int64),
            root_cond=root,
            pending_count=count,
        )

    a = state(torch.zeros(2, 4), torch.tensor([0, 1]))
    a.merge_batch(state(torch.ones(1, 4), torch.tensor([3])))
    assert a.pending_count.tolist() == [0, 1, 3]
    a.filter_batch(torch.tensor([2]))
    assert a.pending_count.tolist() == [3] and a.root_cond.tolist() == [[1.0] * 4]


@torch.no_grad()
def test_follow_after_a_verify_keeps_the_accepted_rows_read() -> None:
    """A drafting step's follow (the extend after its verify) keeps each accepted position's
    features and token at its location, marked read, and nothing of the rejected ones; the
    drafter ends where a worker without rows (``lazy=False``) leaves it."""
    bs, width = 2, 4
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(bs * width, F, generator=gen)
    path_tokens = torch.randint(0, SPECBLOCK_V, (bs, width), generator=gen)
    lazy, eager = Follower(), Follower(lazy=False)
    eager.drafter.load_state_dict(lazy.drafter.state_dict())
    reqs, seq_lens, accept = torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([3, 1])
    carried_l = lazy._follow(reqs, seq_lens, accept, hidden, path_tokens)
    carried_e = eager._follow(reqs, seq_lens, accept, hidden, path_tokens)
    torch.testing.assert_close(carried_l["root_cond"], carried_e["root_cond"])
    slots = lazy.model_runner.req_to_token_pool.req_to_token
    for b in range(bs):
        n = int(accept[b])
        locs = slots[b, :n]
        torch.testing.assert_close(lazy._rows.features[locs], hidden.view(bs, width, F)[b, :n])
        assert lazy._rows.tokens[locs].tolist() == path_tokens[b, :n].tolist()
        assert bool(lazy._rows.read[locs].all())
        assert not bool(lazy._rows.features[slots[b, n:width]].any())  # rejected: not kept
        _same_drafter_state(eager, lazy, locs)
