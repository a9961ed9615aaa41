"""SpecBlock drafter (paper §3.1-3.2, App. A.2, App. B): shapes, psi, masks, freezing, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sgl_spec.specblock.config import CheckpointError
from sgl_spec.specblock.mask import block_attention_mask, cross_block_visibility
from sgl_spec.specblock.model import SpecBlockDrafter, draft_vocab_from_counts
from sgl_spec.specblock.rank import psi_features, rank_to_bucket, target_rank
from tests.helpers.tiny_models import (
    SPECBLOCK_D,
    SPECBLOCK_K,
    SPECBLOCK_V,
    SPECBLOCK_VD,
    specblock_config,
    specblock_drafter,
)

K, D, V, VD = SPECBLOCK_K, SPECBLOCK_D, SPECBLOCK_V, SPECBLOCK_VD


def inputs(bs: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bs, 3 * D, generator=gen), torch.randint(0, V, (bs,), generator=gen)


# ---- shapes and config -------------------------------------------------------------------------


def test_block_shapes_first_and_later_blocks():
    model = specblock_drafter()
    cond, ids = inputs()
    out = model.draft_block(cond, ids)
    assert out.logits.shape == (2, K, VD)
    assert out.rank_logits.shape == (2, K, 4)
    assert out.hidden.shape == (2, K, D)
    assert len(out.kv) == 2 and out.kv[0][0].shape == (2, 2, K, D // 4)
    # later block (Algorithm 2): condition on the cached h^(L) of slot 1, bypassing W_cond
    later = model.draft_block(out.hidden[:, 1], ids, from_draft=True, context_kv=out.kv)
    assert later.logits.shape == (2, K, VD)
    with pytest.raises(ValueError, match="from_draft"):
        model.draft_block(out.hidden[:, 1], ids)  # a drafter state is not a target feature
    many = model(torch.randn(2, 5, 3 * D), torch.randint(0, V, (2, 5)))
    assert many.logits.shape == (2, 5, K, VD) and many.rank_logits.shape == (2, 5, K, 4)


def test_forward_without_heads_keeps_states_and_keys():
    """A context-filling pass (the drafter extend) skips the lm_head and rank head; its states
    and keys are those of the full forward."""
    model = specblock_drafter()
    cond, ids = torch.randn(2, 3, 3 * D), torch.randint(0, V, (2, 3))
    full = model(cond, ids)
    bare = model(cond, ids, heads=False)
    assert bare.logits is None and bare.rank_logits is None
    assert torch.equal(bare.hidden, full.hidden)
    for (k1, v1), (k2, v2) in zip(bare.kv, full.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_inference_fuse_matches_training_and_follows_weight_updates():
    """Without autograd the fuse weight's column blocks and the query term are cached; the
    forward equals the training path's, and an in-place weight update is seen at once."""
    model = specblock_drafter()
    cond, ids = inputs()
    reference = model.draft_block(cond, ids).hidden.detach()
    with torch.no_grad():
        torch.testing.assert_close(model.draft_block(cond, ids).hidden, reference)
        model.fuse.weight.mul_(1.5)
        model.position_queries.add_(0.1)
        changed = model.draft_block(cond, ids).hidden
    torch.testing.assert_close(changed, model.draft_block(cond, ids).hidden.detach())
    assert not torch.allclose(changed, reference)
    half = specblock_drafter().to(torch.bfloat16)
    with torch.no_grad():
        out = half.draft_block(cond.to(torch.bfloat16), ids)
    assert out.hidden.dtype == torch.bfloat16 and out.logits.dtype == torch.bfloat16


def test_config_defaults_and_validation():
    cfg = specblock_config()
    assert (cfg.block_size, cfg.num_layers, cfg.hidden_size) == (K, 2, D)
    assert cfg.layer_config["num_key_value_heads"] == 2
    assert cfg.llama_config().num_hidden_layers == 2
    with pytest.raises(ValueError, match="draft_vocab_size"):
        specblock_config(draft_vocab_size=5)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        specblock_config(aux_layer_ids=(0, 1, 9))


def test_draft_vocab_is_frequency_ranked():
    counts = torch.tensor([5, 9, 0, 9, 1, 7, 3, 2, 8, 4, 6, 0])
    assert draft_vocab_from_counts(counts, 4).tolist() == [1, 3, 8, 5]
    model = specblock_drafter()
    with pytest.raises(ValueError, match="distinct"):
        model.set_draft_vocab(torch.zeros(VD, dtype=torch.long))


# ---- psi features and buckets (App. B, §3.3) ---------------------------------------------------


def test_psi_features_hand_computed():
    p = [0.5, 0.2, 0.1, 0.06, 0.04, 0.04, 0.03, 0.02, 0.01, 0.0, 0.0, 0.0]
    probs = torch.tensor(p, dtype=torch.float64)[torch.randperm(12)]
    psi = psi_features(probs)
    tiny = torch.finfo(torch.float64).tiny
    top10 = [math.log(x) for x in p[:9]] + [math.log(tiny)]
    gaps = [math.log(0.5 / 0.2), math.log(0.5 / 0.1), math.log(0.5 / 0.04)]
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    expected = torch.tensor([*top10, *gaps, 0.5, entropy], dtype=torch.float64)
    assert psi.shape == (15,)
    torch.testing.assert_close(psi, expected)


def test_psi_features_uniform_and_one_hot_batched():
    uniform = torch.full((16,), 1 / 16)
    one_hot = torch.zeros(16)
    one_hot[3] = 1.0
    psi = psi_features(torch.stack([uniform, one_hot]))
    assert psi.shape == (2, 15)
    lg = math.log(1 / 16)
    torch.testing.assert_close(psi[0], torch.tensor([lg] * 10 + [0.0] * 3 + [1 / 16, -lg]))
    assert psi[1, 0] == 0 and psi[1, 13] == 1 and psi[1, 14] == 0
    assert torch.isfinite(psi).all() and psi[1, 10] > 80  # gap to a zero-probability runner-up
    with pytest.raises(ValueError, match="at least 10"):
        psi_features(torch.full((5,), 0.2))


def test_rank_buckets_follow_paper_rule():
    ranks = torch.tensor([1, 2, 4, 5, 10, 11, 500])
    assert rank_to_bucket(ranks).tolist() == [0, 1, 1, 2, 2, 3, 3]
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [0.0, 1.0, 2.0, 3.0]])
    assert target_rank(logits, torch.tensor([0, 1])).tolist() == [1, 3]
    assert target_rank(logits, torch.tensor([-1, 3])).tolist() == [5, 1]  # -1: outside V_d


# ---- gradients ---------------------------------------------------------------------------------


def test_embedding_frozen_and_rank_head_detached():
    model = specblock_drafter().train()
    model.set_target_embedding(torch.randn(V, D))
    cond, ids = inputs()
    out = model.draft_block(cond, ids)
    out.logits.logsumexp(-1).sum().backward(retain_graph=True)
    assert not model.embed_tokens.weight.requires_grad and model.embed_tokens.weight.grad is None
    assert model.cond_proj.weight.grad is not None and model.fuse.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.rank_head.parameters())
    model.zero_grad(set_to_none=True)
    out.rank_logits.sum().backward()  # Eq. (4): the rank loss reaches only the head
    assert all(p.grad is not None for p in model.rank_head.parameters())
    assert model.cond_proj.weight.grad is None and model.lm_head.weight.grad is None


# ---- attention mask (App. A.2) -----------------------------------------------------------------


def test_block_mask_k3_matches_appendix():
    causal = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(block_attention_mask(3), causal)
    # context = [prefix, on-path slot of an earlier block, off-path slot of it]
    visible = torch.tensor([True, True, False])
    mask = block_attention_mask(3, num_context=3, context_visible=visible)
    assert mask.tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]]
    # two consecutive starts (training layout): the later block sees all of the earlier one
    two = block_attention_mask(3, num_starts=2).int()
    assert two[3:, :3].all() and not two[:3, 3:].any() and torch.equal(two[3:, 3:].bool(), causal)
    # Figure 3 (K=4): block 2 branches from B_{1,1}; B_{1,0}, B_{1,1} visible, B_{1,2..3} masked
    fig3 = cross_block_visibility(num_prefix=2, block_size=4, path_slots=[1])
    assert fig3.tolist() == [True, True, True, True, False, False]
    batched = block_attention_mask(3, num_context=3, context_visible=visible.expand(2, 3))
    assert batched.shape == (2, 3, 6) and torch.equal(batched[1], mask)


def test_forward_is_causal_within_block():
    model = specblock_drafter()
    cond, ids = inputs()
    base = model.draft_block(cond, ids)
    with torch.no_grad():
        model.position_queries[K - 1] += 5.0  # only the last slot's input changes
    moved = model.draft_block(cond, ids)
    torch.testing.assert_close(moved.logits[:, : K - 1], base.logits[:, : K - 1])
    assert not torch.allclose(moved.logits[:, K - 1], base.logits[:, K - 1])


def test_forward_respects_context_visibility():
    model = specblock_drafter()
    cond, ids = inputs()
    first = model.draft_block(cond, ids)
    visible = cross_block_visibility(0, K, [0])  # on-path: slot 0 only
    mask = block_attention_mask(K, num_context=K, context_visible=visible)

    def run(kv):
        args = dict(from_draft=True, context_kv=kv, attention_mask=mask)
        return model.draft_block(first.hidden[:, 0], ids, **args).logits

    base = run(first.kv)
    off_path = [(k.clone(), v.clone()) for k, v in first.kv]
    for k, v in off_path:
        k[:, :, 1:] += 3.0
        v[:, :, 1:] -= 3.0
    torch.testing.assert_close(run(off_path), base)
    on_path = [(k.clone(), v + 3.0) for k, v in first.kv]
    assert not torch.allclose(run(on_path), base)


# ---- ablations (Table 2) -----------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["prefix_broadcast", "layer_shift", "rank_head"])
def test_each_ablation_changes_forward_and_runs(flag):
    base = specblock_drafter()
    with torch.no_grad():  # a trained shift: a fresh one is the identity (see below)
        for shift in base.shifts:
            noise = torch.randn(shift.weight.shape, generator=torch.Generator().manual_seed(3))
            shift.weight.add_(noise * 0.05)
    ablated = specblock_drafter(**{flag: False})
    missing, unexpected = ablated.load_state_dict(base.state_dict(), strict=False)
    assert not missing
    cond, ids = inputs()
    ref, out = base.draft_block(cond, ids), ablated.draft_block(cond, ids)
    assert torch.isfinite(out.logits).all() and out.logits.shape == ref.logits.shape
    if flag == "rank_head":
        assert out.rank_logits is None and unexpected
        torch.testing.assert_close(out.logits, ref.logits)  # the rank head never feeds drafting
    else:
        assert not torch.allclose(out.logits, ref.logits)
        assert torch.isfinite(out.rank_logits).all()
    if flag == "prefix_broadcast":
        ids2 = (ids + 1) % V  # without broadcast only slot 1 reads the start token
        fused = ablated.fuse_inputs(cond[:, None], ids2[:, None], False)
        fused_ref = ablated.fuse_inputs(cond[:, None], ids[:, None], False)
        torch.testing.assert_close(fused[:, :, 1:], fused_ref[:, :, 1:])
        assert not torch.allclose(fused[:, :, 0], fused_ref[:, :, 0])


def test_fresh_layer_shift_starts_as_identity():
    shifted, plain = specblock_drafter(), specblock_drafter(layer_shift=False)
    plain.load_state_dict(shifted.state_dict(), strict=False)
    cond, ids = inputs()
    d = shifted.config.hidden_size
    for shift in shifted.shifts:
        torch.testing.assert_close(shift.weight[:, :d], torch.eye(d))
        assert not shift.weight[:, d:].any()
    torch.testing.assert_close(
        shifted.draft_block(cond, ids).logits, plain.draft_block(cond, ids).logits
    )


# ---- checkpoints -------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    model = specblock_drafter()
    model.set_target_embedding(torch.randn(V, D))
    model.save_pretrained(tmp_path)
    loaded = SpecBlockDrafter.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    assert torch.equal(loaded.d2t, model.d2t) and not loaded.embed_tokens.weight.requires_grad
    cond, ids = inputs()
    a, b = model.draft_block(cond, ids), loaded.draft_block(cond, ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.rank_logits, b.rank_logits)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "specblock_drafter"


def test_missing_and_corrupt_checkpoints_raise_clear_errors(tmp_path):
    specblock_drafter().save_pretrained(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="missing file .*config.json"):
        SpecBlockDrafter.from_pretrained(tmp_path / "nowhere")
    for name in ("config.json", "model.safetensors"):
        broken = tmp_path / f"no_{name}"
        specblock_drafter().save_pretrained(broken)
        (broken / name).unlink()
        with pytest.raises(CheckpointError, match=f"missing file .*{name}"):
            SpecBlockDrafter.from_pretrained(broken)
    garbage = tmp_path / "garbage"
    specblock_drafter().save_pretrained(garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt .*model.safetensors"):
        SpecBlockDrafter.from_pretrained(garbage)
    (garbage / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="bad .*config.json"):
        SpecBlockDrafter.from_pretrained(garbage)
    mismatch = tmp_path / "mismatch"
    specblock_drafter().save_pretrained(mismatch)
    cfg = json.loads((mismatch / "config.json").read_text())
    cfg["layer_shift"] = False
    (mismatch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match.*shifts"):
        SpecBlockDrafter.from_pretrained(mismatch)
    cfg["model_type"] = "llama"
    (mismatch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type"):
        SpecBlockDrafter.from_pretrained(mismatch)
