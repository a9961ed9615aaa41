"""STANDALONE_FULL's draft head on a hot vocabulary (``sgl_spec/standalone/hot_vocab.py``):
the head keeps exactly the map's rows in the map's order (a tied input embedding stays whole),
the draft's q goes back to the target's vocabulary at the map's ids, and a bad map is refused
naming the flag. Served losslessness is ``tests/e2e/test_lossless_standalone.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sgl_spec.standalone import hot_vocab


def _worker(hot) -> SimpleNamespace:
    torch.manual_seed(0)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(10, 4)
    model.lm_head = model.embed_tokens  # tied, as SGLang's Llama with tie_word_embeddings
    return SimpleNamespace(draft_runner=SimpleNamespace(model=model), hot_token_id=hot)


def test_head_keeps_the_maps_rows_in_its_order() -> None:
    worker = _worker(torch.tensor([7, 2, 9]))
    embed = worker.draft_runner.model.embed_tokens.weight.detach().clone()
    hot_vocab.install(worker)
    model = worker.draft_runner.model
    assert torch.equal(model.lm_head.weight, embed[[7, 2, 9]])
    assert torch.equal(model.embed_tokens.weight, embed)  # the input embedding is untouched
    assert worker.hot_token_id.dtype == torch.int64
    hidden = torch.randn(5, 4)
    hot_logits = hidden @ model.lm_head.weight.T  # what the logits processor computes
    full_logits = hidden @ embed.T
    assert torch.allclose(hot_logits, full_logits[:, [7, 2, 9]])
    best_hot = full_logits[:, [7, 2, 9]].argmax(-1)
    assert torch.equal(
        worker.hot_token_id[hot_logits.argmax(-1)], torch.tensor([7, 2, 9])[best_hot]
    )


def test_no_map_leaves_the_head() -> None:
    worker = _worker(None)
    head = worker.draft_runner.model.lm_head
    hot_vocab.install(worker)
    assert worker.draft_runner.model.lm_head is head


@pytest.mark.parametrize(
    ("hot", "match"),
    [(torch.tensor([[1, 2]]), "list of token ids"), (torch.tensor([1.0, 2.0]), "list of token ids"),
     (torch.tensor([], dtype=torch.int64), "list of token ids"), (torch.tensor([3, 10]), r"\[0, 10\)"),
     (torch.tensor([-1, 3]), r"\[0, 10\)"), (torch.tensor([4, 4]), "distinct")],
)  # fmt: skip
def test_bad_maps_are_refused_naming_the_flag(hot, match) -> None:
    with pytest.raises(ValueError, match=match) as info:
        hot_vocab.install(_worker(hot))
    assert hot_vocab.FLAG in str(info.value)


def test_q_goes_back_to_the_maps_ids() -> None:
    hot = torch.tensor([7, 2, 9])
    probs = torch.tensor([[[0.5, 0.3, 0.2]], [[0.0, 1.0, 0.0]]])  # [bs, steps, hot]
    full = hot_vocab.full_vocab(probs, hot, 12)
    assert full.shape == (2, 1, 12)
    assert torch.equal(full[..., hot], probs)
    assert full.sum().item() == pytest.approx(2.0) and full[..., [0, 1, 3, 11]].abs().sum() == 0
    assert hot_vocab.full_vocab(None, hot, 12) is None
    assert hot_vocab.full_vocab(probs, None, 12) is probs
