"""MTP with gated LoRA: exactness of the gate-0 path, the step layout, the training layout, the
adapter file format and a training smoke run (paper §4.3)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from sgl_spec.models.build.export import load_model_dir
from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER, DEFAULT_TARGET, resolve_model_path
from sgl_spec.mtp.adapter_io import load_adapter, save_adapter
from sgl_spec.mtp.gated_lora import (
    AdapterError,
    BaseDims,
    GatedLoRA,
    MtpAdapter,
    MtpAdapterConfig,
    attach_to_hf_model,
    gated_lora_reference,
)
from sgl_spec.mtp.layout import (
    IGNORE_INDEX,
    MaskFormat,
    build_input_ids,
    mtp_layout,
    training_layout,
    tree_mask,
)
from sgl_spec.mtp.training.trainer import hf_attention_mask, mask_logits
from tests.helpers.references import build_positions, tree_mask_reference
from tests.helpers.tiny_models import build_corpus

# --- gated LoRA on the shipped target -------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    torch.manual_seed(0)
    model = load_model_dir(resolve_model_path(DEFAULT_TARGET))
    adapter, config = load_adapter(resolve_model_path(DEFAULT_MTP_ADAPTER), model.config)
    ids = torch.randint(16, model.config.vocab_size, (3, 24))  # [bs, T]
    with torch.no_grad():
        base = model(input_ids=ids).logits
    return model, adapter, config, ids, base


@torch.no_grad()
def test_gate_zero_is_bit_identical_to_the_shipped_target(shipped):
    model, adapter, _, ids, base = shipped
    with attach_to_hf_model(model, adapter) as handle:
        assert torch.equal(model(input_ids=ids).logits, base)  # attached, no gate set
        with handle.gates(torch.zeros(ids.shape), torch.full(ids.shape, -1)):
            assert torch.equal(model(input_ids=ids).logits, base)
    assert torch.equal(model(input_ids=ids).logits, base)  # detached


@torch.no_grad()
def test_gated_rows_change_and_only_they_do(shipped):
    model, adapter, config, ids, base = shipped
    gate = torch.zeros(ids.shape)
    gate[1, 16:] = 1.0
    mask_index = torch.full(ids.shape, -1)
    mask_index[1, 16:] = torch.arange(8) % config.k_max
    with attach_to_hf_model(model, adapter) as handle, handle.gates(gate, mask_index):
        out = model(input_ids=ids).logits
    # other requests of the batch, and earlier positions of the gated one, are untouched bitwise
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2])
    assert torch.equal(out[1, :16], base[1, :16])
    assert (out[1, 16:] - base[1, 16:]).abs().amax(-1).min() > 1e-2


def test_gate_shape_mismatch_is_refused(shipped):
    model, adapter, _, ids, _ = shipped
    with attach_to_hf_model(model, adapter) as handle, handle.gates(torch.zeros(5)):
        with pytest.raises(ValueError, match="gate has 5 entries"):
            model(input_ids=ids)


def test_delta_matches_dense_reference_and_skips_gate_zero_rows():
    torch.manual_seed(0)
    lora = GatedLoRA(12, 7, rank=4, alpha=8.0)
    torch.nn.init.normal_(lora.lora_B)
    x = torch.randn(6, 12)
    gate = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5, 0.0])
    ref = gated_lora_reference(x, gate, lora.lora_A, lora.lora_B, lora.scaling)
    got = lora.delta(x, gate)
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[gate == 0], torch.zeros(3, 7)) and got[gate != 0].abs().min() > 0
    y = torch.randn(6, 7)
    rows = gate.nonzero().squeeze(1)
    out = lora.add_to(y, x, rows, gate[rows])
    assert torch.equal(out[gate == 0], y[gate == 0])
    torch.testing.assert_close(lora.add_to(y, x, None, gate), y + ref)


# --- step layout ----------------------------------------------------------------------------


def _brute_force_slots(k: int) -> list[tuple[str, int, int]]:
    """The slot-order contract spelled out: anchors 0..k, then mask j of group i, i-major."""
    return [("anchor", i, 0) for i in range(k + 1)] + [
        ("mask", i, j) for i in range(k + 1) for j in range(1, k + 1)
    ]


def _brute_force_sees(q: tuple[str, int, int], c: tuple[str, int, int]) -> bool:
    (q_kind, qi, qj), (c_kind, ci, cj) = q, c
    if c_kind == "anchor":
        return ci <= qi  # anchors 0..i, for an anchor and for the masks of group i alike
    return q_kind == "mask" and ci == qi and cj <= qj


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_layout_matches_brute_force_definition(k):
    layout = mtp_layout(k)
    slots = _brute_force_slots(k)
    assert layout.width == len(slots) == (k + 1) ** 2
    for s, (kind, i, j) in enumerate(slots):
        assert bool(layout.is_mask[s]) == (kind == "mask")
        assert int(layout.group[s]) == i
        assert int(layout.position_offsets[s]) == i + j
        assert int(layout.mask_index[s]) == (j - 1 if kind == "mask" else -1)
        if kind == "mask":
            assert layout.mask_slot(i, j) == s == k + 1 + i * k + (j - 1)
        else:
            assert layout.anchor_slot(i) == s
    for i in range(k + 1):
        assert layout.mask_slots(i).tolist() == [layout.mask_slot(i, j) for j in range(1, k + 1)]
    expected = torch.tensor([[_brute_force_sees(q, c) for c in slots] for q in slots])
    assert torch.equal(layout.visibility, expected)


def test_layout_inputs_and_positions():
    layout = mtp_layout(2)
    anchors = torch.tensor([[10, 11, 12], [20, 21, 22]])
    ids = build_input_ids(anchors, [900, 901])
    assert ids.tolist()[0] == [10, 11, 12, 900, 901, 900, 901, 900, 901]
    pos = build_positions(torch.tensor([5, 40]), layout)
    assert pos.tolist() == [[5, 6, 7, 6, 7, 7, 8, 8, 9], [40, 41, 42, 41, 42, 42, 43, 43, 44]]
    with pytest.raises(ValueError, match="k"):
        mtp_layout(-1)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_full_mask_and_qlen_only_agree(k):
    layout, w = mtp_layout(k), (k + 1) ** 2
    seq_lens = torch.tensor([3, 0, 7])
    qlen = tree_mask(layout, 3, MaskFormat.QLEN_ONLY)
    full = tree_mask(layout, 3, "FULL_MASK", seq_lens)
    assert torch.equal(qlen, tree_mask_reference(layout, 3, MaskFormat.QLEN_ONLY))
    assert torch.equal(full, tree_mask_reference(layout, 3, 0, seq_lens))
    assert full.numel() == w * (int(seq_lens.sum()) + 3 * w)
    offset = 0
    for b, s in enumerate(seq_lens.tolist()):
        block = full[offset : offset + w * (s + w)].view(w, s + w)
        assert block[:, :s].all()
        assert torch.equal(block[:, s:], qlen[b * w * w : (b + 1) * w * w].view(w, w))
        offset += w * (s + w)
    with pytest.raises(ValueError, match="not supported"):
        tree_mask(layout, 3, 2)


def test_mask_format_values_match_installed_sglang():
    spec = importlib.util.find_spec("sglang")
    src = Path(spec.origin).parent / "kernels" / "ops" / "speculative" / "spec_tree.py"
    text = src.read_text()
    for fmt in MaskFormat:
        assert re.search(rf"^\s*{fmt.name} = {fmt.value}\s*$", text, re.M), fmt


# --- training layout == inference layout, on a tiny random Llama ----------------------------


def _random_adapter(model, k_max: int, mask_ids: tuple[int, ...], seed: int = 0) -> MtpAdapter:
    gen = torch.Generator().manual_seed(seed)
    config = MtpAdapterConfig(rank=4, alpha=8.0, k_max=k_max, mask_token_ids=mask_ids)
    adapter = MtpAdapter(config, BaseDims.from_hf_config(model.config))
    adapter.reset_parameters(model.get_input_embeddings().weight, gen)
    with torch.no_grad():
        for layer in adapter.layers:
            for lora in layer.values():
                lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=gen) * 0.3)
    return adapter


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_training_layout_equals_inference_layout(tiny_models, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_models["target"], dtype=torch.float32, attn_implementation=attn
    ).eval()
    k, s, mask_ids = 3, 7, (1, 2, 3)
    adapter = _random_adapter(model, k, mask_ids)
    x = torch.randint(
        5, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)
    )
    plain = model(input_ids=x).logits  # [1, 16, vocab]

    # inference: prefix x[0..s) in the KV cache, then one step with anchors x[s..s+k]
    layout = mtp_layout(k)
    w = layout.width
    cache = model(input_ids=x[:, :s], use_cache=True).past_key_values
    full = tree_mask(layout, 1, MaskFormat.FULL_MASK, torch.tensor([s])).view(1, w, s + w)
    handle = attach_to_hf_model(model, adapter)
    with handle.gates(layout.is_mask[None].float(), layout.mask_index[None]):
        step = model(
            input_ids=build_input_ids(x[:, s : s + k + 1], mask_ids),
            position_ids=build_positions(torch.tensor([s]), layout),
            attention_mask=hf_attention_mask(model, full),
            past_key_values=cache,
            use_cache=True,
        ).logits[0]  # [W, vocab]

    # training: the whole sequence, then k masks for each of the same anchors
    train = training_layout(x, torch.arange(s, s + k + 1), k, mask_ids)
    with handle.gates(train.gate, train.mask_index):
        seq_logits = model(
            input_ids=train.input_ids,
            position_ids=train.position_ids,
            attention_mask=hf_attention_mask(model, train.visibility),
        ).logits[0]  # [16 + (k+1)*k, vocab]
    cached = mask_logits(model, handle, train)[0]  # the trainer's KV-cache path
    handle.detach()

    t = x.shape[1]
    for i in range(k + 1):
        torch.testing.assert_close(step[layout.anchor_slot(i)], plain[0, s + i], atol=1e-4, rtol=0)
        for j in range(1, k + 1):
            ref = seq_logits[t + i * k + (j - 1)]
            torch.testing.assert_close(step[layout.mask_slot(i, j)], ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(cached[i * k + (j - 1)], ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(seq_logits[:t], plain[0], atol=1e-4, rtol=0)
    assert (step[layout.mask_slot(0, 1)] - plain[0, s + 1]).abs().max() > 1e-2
    labels = train.labels[0, t:].view(k + 1, k)
    assert labels[0].tolist() == x[0, s + 2 : s + k + 2].tolist()
    assert labels[k].tolist() == [
        IGNORE_INDEX if s + k + j + 1 >= t else int(x[0, s + k + j + 1]) for j in range(1, k + 1)
    ]


# --- adapter files --------------------------------------------------------------------------


@pytest.fixture()
def tiny_adapter(tiny_models):
    model = load_model_dir(tiny_models["target"])
    return model, _random_adapter(model, 2, (1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip(tiny_adapter, tmp_path, dtype):
    model, adapter = tiny_adapter
    save_adapter(tmp_path, adapter, adapter.config, {"note": "test"}, storage_dtype=dtype)
    loaded, config = load_adapter(tmp_path, model.config)
    assert config == adapter.config
    for key, value in adapter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(dtype).float()), key
    assert json.loads((tmp_path / "adapter_config.json").read_text())["metadata"] == {
        "note": "test"
    }


def test_bad_adapter_files_are_clear_errors(tiny_adapter, tmp_path):
    model, adapter = tiny_adapter
    save_adapter(tmp_path, adapter, adapter.config, {})
    weights = tmp_path / "adapter.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(AdapterError, match="adapter.safetensors"):
        load_adapter(tmp_path)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="adapter.safetensors"):
        load_adapter(tmp_path)
    weights.write_bytes(good)
    other = model.config.__class__(**{**model.config.to_dict(), "hidden_size": 128})
    with pytest.raises(AdapterError, match="hidden_size=64"):
        load_adapter(tmp_path, other)
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_adapter(tmp_path)
    cfg.unlink()
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_adapter(tmp_path)
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(tmp_path / "nope")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"alpha": -1.0}, "alpha"),
        ({"k_max": 2, "mask_token_ids": (1,)}, "mask_token_ids"),
        ({"k_max": 2, "mask_token_ids": (1, 1)}, "mask_token_ids"),
        ({"target_modules": ("q_proj", "lm_head")}, "target_modules"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    base = {"k_max": 1, "mask_token_ids": (1,)}
    with pytest.raises(ValueError, match=field):
        MtpAdapterConfig(**{**base, **kwargs})


# --- training CLI smoke run -----------------------------------------------------------------


def test_training_cli_smoke_and_exact_resume(tiny_models, tmp_path):
    """One train sequence and every anchor of it: each step sees the same batch, so the loss of
    a working optimiser must fall at every step (random targets are hard to learn otherwise)."""
    from sgl_spec.mtp.train import main

    corpus = build_corpus(tmp_path / "corpus")
    common = [
        "--target", str(tiny_models["target"]), "--corpus", str(corpus),
        "--work", str(tmp_path / "work"), "--k-max", "2", "--rank", "4", "--alpha", "8",
        "--mask-token-ids", "1,2", "--steps", "5", "--num-prompts", "1", "--eval-prompts", "4",
        "--prompt-len", "12", "--num-new", "20", "--gen-batch", "8", "--batch-size", "2",
        "--anchors-per-seq", "100", "--lr", "3e-3", "--warmup-steps", "1", "--fp32",
        "--no-progress", "--storage-dtype", "fp32",
    ]  # fmt: skip
    full = main([*common, "--out", str(tmp_path / "a")])
    losses = full["losses"]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    for name in ("adapter.safetensors", "adapter_config.json", "README.md", "metrics.json"):
        assert (tmp_path / "a" / name).is_file(), name
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    held_out = metrics["held_out"]
    assert len(held_out["prefix_correct"]) == 2 and held_out["num_anchors"] > 0
    assert metrics["alpha_prefix"] == held_out["prefix_correct"]  # read by the MTP server

    main([*common, "--out", str(tmp_path / "b"), "--stop-after", "3"])
    resumed = main([*common, "--out", str(tmp_path / "b"), "--resume"])
    assert resumed["losses"] == losses
    a, _ = load_adapter(tmp_path / "a")
    b, _ = load_adapter(tmp_path / "b")
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key
