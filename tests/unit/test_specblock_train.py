"""SpecBlock drafter training (paper §3.3, Eqs. 5-7, App. A.1-A.2, App. C): valid-prefix masks,
rank buckets, the chain layout against block-by-block inference, training, ablations, resume,
save/load and the CLI, on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sgl_spec.models.build.export import load_model_dir
from sgl_spec.specblock.layout import IGNORE_INDEX, block_labels, chain_attention_mask
from sgl_spec.specblock.mask import block_attention_mask, cross_block_visibility
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.data import aux_hidden_states, draft_vocab
from sgl_spec.specblock.training.evaluate import (
    bucket_report,
    chain_acceptance,
    chain_rates,
    replay_tau,
)
from sgl_spec.specblock.training.losses import (
    block_draft_loss,
    bucket_labels,
    chain_loss,
    chain_masks,
    target_to_draft_map,
    valid_prefix_mask,
)
from sgl_spec.specblock.training.trainer import (
    SpecBlockTrainConfig,
    build_drafter,
    chain_forward,
    sample_step,
    step_loss,
    train_drafter,
)
from sgl_spec.training.greedy_data import greedy_continuation
from sgl_spec.training.loop import RunOptions
from tests.helpers.tiny_models import (
    SPECBLOCK_D,
    SPECBLOCK_K,
    SPECBLOCK_V,
    build_corpus,
    specblock_drafter,
)

torch.set_num_threads(1)

B = torch.tensor  # shorthand for constructed cases
QUIET = RunOptions(progress=False)


# ---- valid-prefix mask (Eq. 5) and rank buckets (§3.3) ------------------------------------------


def test_valid_prefix_mask_constructed():
    correct = B([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    initial = B([1, 1, 0, 1]).bool()
    expected = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert valid_prefix_mask(correct, initial).int().tolist() == expected


def test_chain_masks_follow_the_path_through_the_cut():
    k = 3
    first = B([[[1, 1, 0], [1, 1, 0], [0, 1, 1]]]).bool()  # [bs=1, C=3, K]
    second = B([[[1, 0, 1], [1, 1, 1], [1, 1, 1]]]).bool()
    labelled = [
        torch.ones(1, 3, k, dtype=torch.bool),
        B([[[1, 1, 1], [1, 1, 0], [1, 1, 1]]]).bool(),
    ]
    cuts = B([[[2], [3], [2]]])  # block 2 starts from the (ground-truth) token at slot s
    masks = chain_masks([first, second], labelled, cuts)
    assert masks[0].int().tolist() == [[[1, 1, 1], [1, 1, 1], [1, 0, 0]]]
    # chain 0: slot 1 right -> block 2 admitted, until its slot 2 is wrong; chain 1: slots 1-2
    # right, slot 3 wrong but a sibling there carries the path; chain 2: slot 1 wrong -> nothing
    assert masks[1].int().tolist() == [[[1, 1, 0], [1, 1, 0], [0, 0, 0]]]
    off = chain_masks([first, second], labelled, cuts, valid_prefix=False)
    assert off[0].all() and off[1].int().tolist() == labelled[1].int().tolist()


def test_bucket_labels_from_constructed_ranks():
    v = 16
    order = torch.arange(v, 0, -1).float()  # draft id i has rank i + 1
    logits = order.expand(6, v)
    labels = B([0, 1, 3, 4, 9, 10])  # ranks 1, 2, 4, 5, 10, 11
    assert bucket_labels(logits, labels).tolist() == [0, 1, 1, 2, 2, 3]
    assert bucket_labels(logits[:1], B([-1])).tolist() == [3]  # outside the draft vocabulary


def test_draft_loss_counts_only_admitted_in_vocab_positions():
    torch.manual_seed(0)
    logits = torch.randn(1, 2, 3, 10, requires_grad=True)
    labels = B([[[1, 2, -1], [4, 5, 6]]])  # -1: target token outside the draft vocabulary
    mask = B([[[1, 1, 1], [1, 0, 0]]]).bool()
    loss, per_slot, counts = block_draft_loss(logits, labels, mask)
    ce = torch.nn.functional.cross_entropy
    expected = [ce(logits[0, :, 0], B([1, 4])), ce(logits[0, :1, 1], B([2]))]
    torch.testing.assert_close(loss, expected[0] + expected[1])
    assert per_slot[2] != per_slot[2] and counts == [2, 1, 1]  # nan: no in-vocab admitted label
    loss.backward()
    assert logits.grad[0, 1, 1:].abs().sum() == 0 and logits.grad[0, 0, 2].abs().sum() == 0


def test_chain_loss_valid_prefix_ablation_changes_the_objective():
    torch.manual_seed(0)
    logits = [torch.randn(2, 5, 3, 12) for _ in range(2)]
    labels = [logits[0].argmax(-1), torch.randint(0, 12, (2, 5, 3))]
    labels[0][:, :, 0] = (labels[0][:, :, 0] + 1) % 12  # slot 1 always wrong
    t2d = target_to_draft_map(torch.arange(12), 12)
    cuts = torch.full((2, 5, 1), 2)
    on = chain_loss(logits, [None, None], labels, t2d, cuts, valid_prefix=True)
    off = chain_loss(logits, [None, None], labels, t2d, cuts, valid_prefix=False)
    assert on.num_masked[0] == [10, 0, 0] and on.num_masked[1] == [0, 0, 0]
    assert off.num_masked[1] == [10, 10, 10] and not torch.isclose(on.total, off.total)


# ---- layout == block-by-block inference (App. A.2) ----------------------------------------------

K, D, V = SPECBLOCK_K, SPECBLOCK_D, SPECBLOCK_V


def test_chain_attention_mask_constructed():
    # K=2, pass 1 over 3 starts, one chain from start 1 cut after slot 1, second block
    mask = chain_attention_mask(2, 3, B([1]), B([[[1]]]))
    assert mask.int().tolist() == [[[1, 1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 1, 1]]]
    # third block: additionally its own second block, on-path slots < cut 2
    third = chain_attention_mask(2, 3, B([1]), B([[[1, 2]]]))
    assert third[0, :, 6:8].all() and third[0, 0, 8:].tolist() == [True, False]


def _cat(a, b):
    if a is None:
        return b
    return [
        (torch.cat([x, y], 2), torch.cat([u, w], 2)) for (x, u), (y, w) in zip(a, b, strict=True)
    ]


@pytest.mark.parametrize("draft_tokens", [False, True])
def test_chain_layout_equals_block_by_block_inference(draft_tokens):
    model = specblock_drafter()
    gen = torch.Generator().manual_seed(3)
    t = 12
    feats, toks = (
        torch.randn(1, t, 3 * D, generator=gen),
        torch.randint(0, V, (1, t), generator=gen),
    )
    starts, cuts = B([4, 5, 6]), B([[[2, 1], [3, 3], [1, 2]]])
    with torch.no_grad():
        out = chain_forward(model, feats, toks, starts, cuts, draft_tokens=draft_tokens)
        kv, blocks = None, []
        for p in range(7):  # each committed position's block sees all earlier ones (source 1)
            blocks.append(
                model.draft_block(feats[:, p], toks[:, p], positions=B([p]), context_kv=kv)
            )
            kv = _cat(kv, blocks[-1].kv)
        for c, a in enumerate(starts.tolist()):
            prev, context, path, pos = blocks[a], None, [], a
            for p in range(a + 1):
                context = _cat(context, blocks[p].kv)
            torch.testing.assert_close(out.logits[0][0, c], prev.logits[0])
            for m in (1, 2):
                s = int(cuts[0, c, m - 1])
                path, pos = [*path, s - 1], pos + s
                visible = cross_block_visibility(a * K, K, path)
                mask = block_attention_mask(K, 1, visible.numel(), visible)
                token = (
                    model.d2t[prev.logits[:, s - 1].argmax(-1)] if draft_tokens else toks[:, pos]
                )
                args = dict(from_draft=True, positions=B([pos]), context_kv=context)
                prev = model.draft_block(prev.hidden[:, s - 1], token, attention_mask=mask, **args)
                torch.testing.assert_close(out.logits[m][0, c], prev.logits[0])
                assert out.labels[m][0, c].tolist() == [
                    toks[0, pos + 1 + j].item() if pos + 1 + j < t else IGNORE_INDEX
                    for j in range(K)
                ]
                context = _cat(context, prev.kv)


def test_block_labels_past_the_end_are_ignored():
    toks = torch.arange(10).view(1, 10)
    assert block_labels(toks, B([[0, 7]]), 3).tolist() == [[[1, 2, 3], [8, 9, IGNORE_INDEX]]]


# ---- training on a tiny target -------------------------------------------------------------------

PROMPT = 8


@pytest.fixture(scope="module")
def tiny(tiny_models):
    target = load_model_dir(tiny_models["target"])
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, target.config.vocab_size, (10, PROMPT), generator=gen)
    seqs = torch.cat([prompts, greedy_continuation(target, prompts, 20)], dim=1)
    d2t, _ = draft_vocab(seqs, PROMPT, target.config.vocab_size, 64)
    return target, seqs[:6], seqs[6:], d2t


def _cfg(**kw) -> SpecBlockTrainConfig:
    base = dict(steps=30, batch_size=4, first_start=PROMPT - 1, lr=3e-3, warmup_steps=2)
    return SpecBlockTrainConfig(**{**dict(rank_warmup_steps=10, bf16_autocast=False), **base, **kw})


def _drafter(tiny, **flags) -> SpecBlockDrafter:
    target, _, _, d2t = tiny
    return build_drafter(target, d2t, seed=0, block_size=3, rank_hidden_size=32, **flags)


@torch.no_grad()
def _fixed_loss(drafter, tiny) -> float:
    """Draft loss of every labelled position of the train sequences (no mask, fixed cuts)."""
    target, train, _, _ = tiny
    cfg = _cfg(valid_prefix=False, batch_size=train.shape[0], rank_warmup_steps=10**6)
    _, starts, cuts = sample_step(train, cfg, 3, 0)
    return float(step_loss(drafter, target, train, starts, cuts, cfg, 0).draft)


def _assert_same_held_out_chains(a: SpecBlockDrafter, b: SpecBlockDrafter, tiny) -> None:
    """Both drafters give bit-identical draft and rank logits on the held-out chains."""
    target, _, held_out, _ = tiny
    feats = aux_hidden_states(target, held_out, a.config.aux_layer_ids)
    starts, cuts = torch.arange(PROMPT - 1, 20), torch.full((4, 13, 1), 2)
    with torch.no_grad():
        x = chain_forward(a, feats, held_out, starts, cuts)
        y = chain_forward(b, feats, held_out, starts, cuts)
    for u, v in zip(x.logits + x.rank_logits, y.logits + y.rank_logits, strict=True):
        assert torch.equal(u, v)


@pytest.fixture(scope="module")
def trained(tiny):
    drafter = _drafter(tiny)
    before = _fixed_loss(drafter, tiny)
    head = {k: v.clone() for k, v in drafter.rank_head.state_dict().items()}
    log = train_drafter(drafter, tiny[0], tiny[1], _cfg(steps=60), QUIET)
    return drafter, log, before, head


def test_training_reduces_loss_and_rank_head_waits_for_warmup(trained, tiny):
    drafter, log, before, head = trained
    after = _fixed_loss(drafter, tiny)
    assert after < 0.55 * before, (before, after)  # seeded: 12.9 -> 5.7
    assert all(x is None for x in log["rank_losses"][:10])
    assert all(x is not None and math.isfinite(x) for x in log["rank_losses"][10:])
    assert any(not torch.equal(v, drafter.rank_head.state_dict()[k]) for k, v in head.items())
    assert torch.equal(drafter.embed_tokens.weight, tiny[0].get_input_embeddings().weight)


def test_aux_hidden_states_are_the_layer_outputs(tiny):
    target, train, _, _ = tiny
    with torch.no_grad():
        hf = target(input_ids=train[:2], output_hidden_states=True).hidden_states
    feats = aux_hidden_states(target, train[:2], (0, 0, 0))
    torch.testing.assert_close(feats, torch.cat([hf[1]] * 3, dim=-1))  # hf[0] is the embedding


def test_save_load_round_trip_of_trained_drafter(trained, tiny, tmp_path):
    from sgl_spec.specblock.train import save_drafter

    drafter, _, _, _ = trained
    save_drafter(drafter, tmp_path / "fp32", torch.float32)
    loaded = SpecBlockDrafter.from_pretrained(tmp_path / "fp32").eval()
    _assert_same_held_out_chains(drafter, loaded, tiny)
    save_drafter(drafter, tmp_path / "bf16", torch.bfloat16)
    half = SpecBlockDrafter.from_pretrained(tmp_path / "bf16")
    for name, value in drafter.state_dict().items():
        stored = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
        assert torch.equal(half.state_dict()[name], stored), name


def test_evaluation_reports_alpha_tau_and_buckets(trained, tiny):
    drafter, _, _, _ = trained
    target, _, held_out, _ = tiny
    ev = chain_acceptance(drafter, target, held_out, PROMPT - 1, num_blocks=2)
    assert len(ev["alpha"]) == 6 and ev["num_chains"] == 4 * (28 - 6 - 7)
    assert 1.0 <= ev["tau"] <= 7.0 and ev["rank_head"]["num_positions"] > 0
    assert ev["expected_acceptance_length"][-1] == pytest.approx(1 + sum(ev["prefix_correct"]))


def test_chain_rates_replay_and_bucket_report_constructed():
    correct = B([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]]).bool()
    rates = chain_rates(correct)
    assert rates["prefix_correct"] == [0.75, 0.5, 0.25]
    assert rates["alpha"] == [0.75, pytest.approx(0.6667), 0.5]
    # one sequence, chains 0..3: accept 2 (+bonus) from chain 0 -> next chain 3 -> accept 3 (+1)
    assert replay_tau(correct[None]) == (3 + 4, 2)
    report = bucket_report(B([0, 0, 1, 3]), B([0, 1, 1, 3]))
    assert report["accuracy"] == 0.75 and report["buckets"][0]["precision"] == 0.5
    assert report["buckets"][1]["recall"] == 0.5 and report["buckets"][2]["precision"] is None


# ---- ablations (Table 2) -------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["prefix_broadcast", "layer_shift", "rank_head", "valid_prefix"])
def test_each_ablation_changes_the_model_or_the_loss(tiny, flag):
    target, train, _, _ = tiny
    base = _drafter(tiny)
    with torch.no_grad():  # a trained shift: a fresh one is the identity (no-op)
        for shift in base.shifts:
            noise = torch.randn(shift.weight.shape, generator=torch.Generator().manual_seed(3))
            shift.weight.add_(noise * 0.05)
    cfg = _cfg(rank_warmup_steps=0)
    tokens, starts, cuts = sample_step(train, cfg, 3, 0)
    ref = step_loss(base, target, tokens, starts, cuts, cfg, 0)
    if flag == "valid_prefix":
        ablated, cfg = base, _cfg(rank_warmup_steps=0, valid_prefix=False)
    else:
        ablated = _drafter(tiny, **{flag: False})
        assert getattr(ablated.config, flag) is False
        missing, unexpected = ablated.load_state_dict(base.state_dict(), strict=False)
        assert not missing and bool(unexpected) == (flag in ("layer_shift", "rank_head"))
    out = step_loss(ablated, target, tokens, starts, cuts, cfg, 0)
    if flag == "rank_head":
        assert out.rank is None and ref.rank is not None
        torch.testing.assert_close(out.draft, ref.draft)  # the head never feeds drafting
    else:
        assert not torch.isclose(out.total, ref.total), flag


@pytest.mark.parametrize(
    "flag",
    ["--no-prefix-broadcast", "--no-layer-shift", "--no-rank-head", "--no-valid-prefix"],
)
def test_cli_ablation_flags_switch_exactly_their_field(flag):
    from dataclasses import asdict

    from sgl_spec.specblock.train import build_parser, drafter_overrides, train_config

    def fields(argv):
        args = build_parser().parse_args(["--out", "x", *argv])
        return {**drafter_overrides(args), **asdict(train_config(args))}

    base, ablated = fields([]), fields([flag])
    field = flag.removeprefix("--no-").replace("-", "_")
    assert base[field] is True and ablated[field] is False
    assert {k for k in base if base[k] != ablated[k]} == {field}


def test_cli_width_flags_build_a_narrower_drafter(tiny):
    from sgl_spec.specblock.train import build_parser, drafter_overrides

    target, _, _, d2t = tiny
    d = target.config.hidden_size
    args = build_parser().parse_args(
        ["--out", "x", "--hidden-size", str(d // 2), "--num-heads", "2"]
        + ["--intermediate-size", "48", "--num-layers", "1"]
    )
    drafter = build_drafter(target, d2t, seed=0, **drafter_overrides(args))
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.num_layers) == (d // 2, d, 1)
    layer = drafter.layers[0]
    assert layer.mlp.gate_proj.weight.shape == (48, d // 2)
    head_dim = target.config.hidden_size // target.config.num_attention_heads
    assert layer.self_attn.k_proj.weight.shape == (2 * head_dim, d // 2)
    assert drafter.cond_proj.weight.shape == (d // 2, 3 * d)
    assert drafter.embed_tokens.weight.shape[1] == d  # the frozen target embedding stays
    default = drafter_overrides(build_parser().parse_args(["--out", "x"]))
    assert "hidden_size" not in default and default["layer_overrides"] == {}
    with pytest.raises(ValueError, match="unknown per-layer keys"):
        build_drafter(target, d2t, layer_overrides={"hidden_size": 8})


def test_narrower_drafter_trains_and_round_trips(tiny, tmp_path):
    target, train, _, _ = tiny
    narrow = dict(hidden_size=target.config.hidden_size // 2, num_layers=1)
    drafter = _drafter(tiny, layer_overrides={"intermediate_size": 40}, **narrow)
    before = _fixed_loss(drafter, tiny)
    train_drafter(drafter, target, train, _cfg(steps=30), QUIET)
    assert _fixed_loss(drafter, tiny) < 0.8 * before  # seeded: 12.8 -> 9.0
    drafter.save_pretrained(tmp_path)
    loaded = SpecBlockDrafter.from_pretrained(tmp_path).eval()
    _assert_same_held_out_chains(drafter.eval(), loaded, tiny)


# ---- resume --------------------------------------------------------------------------------------


def test_resume_continues_exactly(tiny, tmp_path):
    target, train, _, _ = tiny
    cfg = _cfg(steps=6, rank_warmup_steps=2)
    full = _drafter(tiny)
    log = train_drafter(full, target, train, cfg, QUIET)
    part = _drafter(tiny)
    ckpt = tmp_path / "run.ckpt"
    train_drafter(part, target, train, cfg, RunOptions(ckpt, progress=False, stop_after=3))
    resumed = _drafter(tiny)
    log2 = train_drafter(resumed, target, train, cfg, RunOptions(ckpt, resume=True, progress=False))
    assert log2["losses"] == log["losses"] and len(log["losses"]) == 6
    for name, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    again = RunOptions(ckpt, resume=True, progress=False)
    with pytest.raises(ValueError, match="hyper-parameters"):
        train_drafter(_drafter(tiny), target, train, _cfg(steps=6, lr=1e-2), again)


def test_shift_lr_scale_scales_only_the_shift_steps(tiny):
    target, train, _, _ = tiny
    moved = {}
    for scale in (1.0, 0.01):
        drafter = _drafter(tiny)
        before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
        train_drafter(drafter, target, train, _cfg(steps=3, shift_lr_scale=scale), QUIET)
        moved[scale] = {
            n: (p.detach() - before[n]).abs().max().item()
            for n, p in drafter.named_parameters()
            if n.startswith(("shifts.", "fuse."))
        }
    for name, step in moved[0.01].items():
        if name.startswith("shifts."):
            assert 0 < step < 0.05 * moved[1.0][name], name
        else:
            assert step > 0.5 * moved[1.0][name], name
    with pytest.raises(ValueError, match="shift_lr_scale"):
        _cfg(shift_lr_scale=0)


# ---- CLI -----------------------------------------------------------------------------------------


def test_training_cli_writes_drafter_metrics_card_and_resumes(tiny_models, tmp_path):
    from sgl_spec.specblock.train import main

    common = [
        "--target", str(tiny_models["target"]), "--corpus", str(build_corpus(tmp_path / "c")),
        "--greedy-cache", str(tmp_path / "greedy"), "--work", str(tmp_path / "work"),
        "--k", "3", "--draft-vocab", "64", "--rank-hidden", "16", "--steps", "4",
        "--num-prompts", "4", "--eval-prompts", "3", "--prompt-len", "8", "--num-new", "16",
        "--batch-size", "2", "--warmup-steps", "1", "--rank-warmup-steps", "2", "--fp32",
        "--storage-dtype", "fp32", "--no-progress", "--no-layer-shift",
    ]  # fmt: skip
    full = main([*common, "--out", str(tmp_path / "a")])
    out = tmp_path / "a"
    for name in ("config.json", "model.safetensors", "metrics.json", "README.md", "training.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["layer_shift"] is False and config["block_size"] == 3
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["alpha"]) == 6 and metrics["tau"] >= 1.0
    assert metrics["rank_bucket_accuracy"] is not None
    assert "layer-wise shift" in (out / "README.md").read_text()
    main([*common, "--out", str(tmp_path / "b"), "--stop-after", "2"])
    resumed = main([*common, "--out", str(tmp_path / "b"), "--resume"])
    assert resumed["losses"] == full["losses"] and len(full["losses"]) == 4
    a = SpecBlockDrafter.from_pretrained(out).state_dict()
    b = SpecBlockDrafter.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
