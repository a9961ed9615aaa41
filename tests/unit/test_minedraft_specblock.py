"""The SpecBlock drafter hosted by the MineDraft draft server (``specblock_host.py``), without a
server: incremental drafting (features arriving step by step, extend chunks, batches of
requests) gives the chain a from-scratch computation with the drafting functions gives, and
requests with incomplete features are never drafted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sgl_spec.minedraft import specblock_host
from sgl_spec.minedraft.codec import decode, encode
from sgl_spec.minedraft.draft_model import DraftStateError
from sgl_spec.minedraft.messages import DraftEntry, Hello, MessageError
from sgl_spec.minedraft.specblock_host import SpecBlockChainModel
from sgl_spec.specblock.drafting import PrefixContext, extend_prefix, grow_trees
from sgl_spec.verify.packing import context_visibility
from tests.helpers.tiny_models import SPECBLOCK_V, specblock_drafter

NUM_STEPS = 5  # more than one block of K = SPECBLOCK_K


def _drafter():
    return specblock_drafter(seed=3).double()


def _sequence(length: int, seed: int) -> tuple[list[int], np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SPECBLOCK_V, (length,), generator=gen).tolist()
    width = 3 * _drafter().config.target_hidden_size
    features = torch.randn(length, width, generator=gen).numpy().astype(np.float32)
    return tokens, features


def _reference_chain(drafter, tokens: list[int], features: np.ndarray, num_steps: int) -> list[int]:
    """One extend over every featured position (all tokens but the last), then the chain of
    ``grow_trees`` from the last token, written out with the drafting functions."""
    n = len(tokens) - 1
    k = drafter.config.block_size
    empty = PrefixContext([], torch.zeros(1, 0, dtype=torch.bool))
    out = extend_prefix(
        drafter,
        empty,
        torch.from_numpy(features[:n]).double()[None],
        torch.tensor(tokens[:n])[None],
        torch.arange(n)[None],
        torch.tensor([n]),
    )
    kv = [(key, value) for key, value in out.kv]
    visible = context_visibility(torch.tensor([n]), n, k, last_slot_only=True)
    host = SpecBlockChainModel(drafter, num_steps, 10_000)
    result = grow_trees(
        drafter,
        PrefixContext(kv, visible),
        out.root_cond,
        [tokens[-1]],
        torch.tensor([n]),
        host.settings,
    )
    tree = result.trees[0]
    chain, node = [], 0
    while len(chain) < num_steps and node in tree.parents[1:]:
        node = tree.parents.index(node, 1)
        chain.append(tree.tokens[node])
    return chain


def test_first_chain_equals_the_reference() -> None:
    drafter = _drafter()
    tokens, features = _sequence(12, seed=0)
    host = SpecBlockChainModel(drafter, NUM_STEPS, 10_000)
    host.add("a", tokens, features[: len(tokens) - 1])
    [(ids, probs)] = host.draft(["a"], [0.0])
    assert probs is None
    assert ids.tolist() == _reference_chain(drafter, tokens, features, NUM_STEPS)
    assert len(ids) == NUM_STEPS
    host.check_kv_accounting()


def test_incremental_chunked_and_batched_drafting_equals_from_scratch(monkeypatch) -> None:
    monkeypatch.setattr(specblock_host, "EXTEND_CHUNK", 4)  # prompts span several chunks
    drafter = _drafter()
    host = SpecBlockChainModel(drafter, NUM_STEPS, 10_000)
    seqs = {rid: _sequence(30, seed=i) for i, rid in enumerate("abc")}
    held = {"a": 9, "b": 3, "c": 14}  # different prompt lengths in one batch
    for rid, n in held.items():
        tokens, features = seqs[rid]
        host.add(rid, tokens[:n], features[: n - 1])
    for growth in ([3, 1, 6], [0, 4, 2], [5, 5, 1]):  # 0: drafted again without news
        for (rid, n), more in zip(list(held.items()), growth, strict=True):
            tokens, features = seqs[rid]
            host.append(rid, tokens[n : n + more], features[n - 1 : n - 1 + more])
            held[rid] = n + more
        drafts = host.draft(list(held), [0.0, 1.0, 0.0])
        host.check_kv_accounting()
        for (rid, n), (ids, _) in zip(held.items(), drafts, strict=True):
            tokens, features = seqs[rid]
            assert ids.tolist() == _reference_chain(drafter, tokens[:n], features, NUM_STEPS), (
                rid,
                n,
            )


def test_requests_without_complete_features_get_no_drafts() -> None:
    host = SpecBlockChainModel(_drafter(), NUM_STEPS, 10_000)
    tokens, features = _sequence(10, seed=1)
    host.add("none", tokens[:6], None)  # re-sent after a restart: no history
    host.add("short", tokens[:6], features[:3])  # rows missing
    host.add("ok", tokens[:6], features[:5])
    host.add("one", tokens[:1], features[:0])  # nothing to condition on yet
    out = dict(
        zip(
            ["none", "short", "ok", "one"],
            host.draft(["none", "short", "ok", "one"], [0.0] * 4),
            strict=True,
        )
    )
    assert [len(out[r][0]) for r in ("none", "short", "ok", "one")] == [0, 0, NUM_STEPS, 0]
    assert host.is_blind("none") and host.is_blind("short") and not host.is_blind("ok")
    host.append("none", tokens[6:8], features[5:7])  # stays blind
    host.append("ok", tokens[6:8], None)  # the scheduler lost its rows: blind from now on
    assert [len(ids) for ids, _ in host.draft(["none", "ok"], [0.0, 0.0])] == [0, 0]
    with pytest.raises(DraftStateError, match="2 feature rows for 1 appended"):
        host.append("one", tokens[1:2], features[0:2])
    with pytest.raises(DraftStateError, match="unknown request"):
        host.append("gone", tokens[:1], features[:1])
    with pytest.raises(DraftStateError, match="feature rows must be"):
        host.add("bad", tokens[:3], features[:2, :7])
    host.free("ok")
    assert "ok" not in host and len(host) == 4


def test_context_limit_is_refused() -> None:
    host = SpecBlockChainModel(_drafter(), NUM_STEPS, 12)
    tokens, features = _sequence(10, seed=2)
    with pytest.raises(DraftStateError, match="context length 12"):
        host.add("a", tokens[:8], features[:7])


def test_entry_features_travel_and_are_checked() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    entry = DraftEntry("r", np.array([1, 2, 3], np.int32), 9, features=rows)
    hello = Hello("d", "cpu:1", 3, 4, 1, 8, drafter="specblock")
    from sgl_spec.minedraft.messages import DraftRequest

    back = decode(encode(DraftRequest(1, 0, (entry,))))
    assert np.array_equal(back.entries[0].features, rows)
    assert decode(encode(hello)).drafter == "specblock"
    assert (
        decode(encode(DraftRequest(1, 0, (DraftEntry("r", [1], 1),)))).entries[0].features is None
    )
    with pytest.raises(MessageError, match="4 feature rows for a sequence of 3"):
        DraftEntry("r", np.array([1], np.int32), 3, features=np.zeros((4, 2), np.float32))
    with pytest.raises(MessageError, match="features must have 2"):
        DraftEntry("r", np.array([1], np.int32), 3, features=np.zeros(4, np.float32))
    with pytest.raises(MessageError, match="Hello.drafter"):
        Hello("d", "cpu:1", 3, 4, 1, 8, drafter="eagle")
