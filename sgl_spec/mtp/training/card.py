"""Model card (README.md + loss curve + metrics.json) of a trained MTP adapter directory.

Generated from ``training.json`` (written by ``train.py``) and the held-out metrics, never
hand-edited, so the card always states the numbers of the weights next to it. The layout shared
with the other cards is in ``sgl_spec.training.card``; this module keeps the adapter's own prose.
"""

from __future__ import annotations

from pathlib import Path

from sgl_spec.models.build.export import read_json
from sgl_spec.mtp.adapter_io import CONFIG_FILE, WEIGHTS_FILE
from sgl_spec.training.card import ModuleCard, field_table, md_table, section, tail_mean


def _rates_table(m: dict) -> str:
    return md_table(
        (
            "mask j",
            "mask j correct",
            "masks 1..j all correct",
            "P(j correct given 1..j-1)",
            "tokens/step with k=j drafts",
        ),
        [
            (
                j + 1,
                f"{m['mask_correct'][j]:.3f}",
                f"{m['prefix_correct'][j]:.3f}",
                f"{m['conditional'][j]:.3f}",
                f"{m['expected_acceptance_length'][j]:.2f}",
            )
            for j in range(m["k_max"])
        ],
    )


def _intro(cfg: dict) -> str:
    return f"""A multi-token-prediction adapter with gated LoRA (large-batch speculative decoding paper §4.3,
after Samragh et al. 2025) for the target `{cfg["base_model"]}`. One target forward over
`k + 1` anchors, each followed by `k` mask tokens (`(k+1)²` positions, layout in
`sgl_spec/mtp/layout.py`), verifies the current drafts on the anchors (gate 0: the unmodified
target, bit for bit) and proposes the next `k` drafts on the masks of the last accepted anchor
(gate 1: `Y = XW + (g ⊙ X)ABᵀ · alpha/rank`, plus a learned input embedding per mask slot).
The target's weights, embeddings included, are untouched."""


def _adapter(doc: dict, log: dict, size_mb: float) -> str:
    cfg, dims = doc["config"], doc["base_dims"]
    n, base = log["num_parameters"], log["base_parameters"]
    table = field_table(
        [
            (
                "LoRA rank / alpha (scaling)",
                f"{cfg['rank']} / {cfg['alpha']} ({cfg['alpha'] / cfg['rank']:g})",
            ),
            ("target modules (every decoder layer)", ", ".join(cfg["target_modules"])),
            (
                "k_max (mask slots)",
                f"{cfg['k_max']}; any `k <= k_max` uses the first `k` slots (masks are causal within a group)",
            ),
            (
                "mask token ids (slot 1..k_max)",
                f"{cfg['mask_token_ids']} (reserved tokens; their embeddings are replaced by the adapter's)",
            ),
            (
                "trainable parameters",
                f"{n / 1e6:.3f}M ({n / base:.1%} of the target's {base / 1e6:.1f}M)",
            ),
            (
                "on disk",
                f"{size_mb:.2f} MB (`{WEIGHTS_FILE}`, {doc['storage_dtype']} storage; loading upcasts to fp32)",
            ),
            (
                "base dims checked at load",
                f"hidden {dims['hidden_size']}, layers {dims['num_layers']}, intermediate {dims['intermediate_size']}, q {dims['q_dim']}, kv {dims['kv_dim']}",
            ),
        ]
    )
    return section("Adapter", table)


def _training_data(data: dict) -> str:
    train = data["train"]
    return section(
        "Training data",
        f"""The target's own fp32 greedy continuations: {train["num_prompts"]} prompts of
{train["prompt_len"]} tokens drawn from the train split of the target's corpus, each
continued by {train["num_new"]} greedy tokens ({data["gen_wall_s"] / 60:.1f} min to generate, cached in
`~/.cache/sgl_spec/mtp/`). Anchors are positions of the generated part; the label of mask `j`
of anchor `p` is `x[p+j+1]`, which along a greedy sequence is exactly the token the target would
write there. Held-out evaluation uses {data["eval"]["num_prompts"]} prompts from the held-out split.""",
    )


def _training_run(log: dict, metrics: dict, k_max: int) -> str:
    tc = log["train_config"]
    gen, train, ev = log["gen_wall_s"], log["train_wall_s"], metrics["eval_wall_s"]
    per_j = [tail_mean([r[j] for r in log["losses_per_j"]]) for j in range(k_max)]
    return f"""{log["steps_done"]} steps x {tc["batch_size"]} sequences x {tc["anchors_per_seq"]} anchors x {k_max} masks
(base frozen in fp32, {"bf16 autocast" if tc["bf16_autocast"] else "fp32 compute"}), AdamW lr {tc["lr"]} (warm-up {tc["warmup_steps"]},
constant, cosine to {tc["min_lr_ratio"]} x lr over the last {tc["decay_fraction"]:.0%}), clip {tc["grad_clip"]}, seed {tc["seed"]},
{log["threads"]} torch thread(s), on a 2-core CPU shared with other work. Wall time: greedy data
{gen / 60:.1f} min + training {train / 60:.1f} min ({log["train_cpu_s"] / 60:.1f} min of CPU) + held-out
evaluation {ev / 60:.1f} min = {(gen + train + ev) / 60:.1f} min in all. Final training loss (mean of
the last 25 steps): {tail_mean(log["losses"]):.3f}; per mask slot: {", ".join(f"{x:.2f}" for x in per_j)}."""


def _held_out(ev: dict, k_max: int) -> str:
    return section(
        "Held-out agreement with the target (fp32, stored weights)",
        f"""{ev["num_sequences"]} held-out prompts, {ev["num_anchors"]} anchors (every position of the generated part
with all {k_max} labels inside the sequence):""",
        _rates_table(ev),
        """"tokens/step" is `1 + Σ_(i≤j) P(masks 1..i all correct)`: the expected tokens per MTP step
(bonus included) with `k = j` drafts, if the anchors were uniformly spread.""",
    )


def _use_code(base_model: str, name: str) -> str:
    return f"""from sgl_spec.models.build.export import load_model_dir
from sgl_spec.models.registry import resolve_model_path
from sgl_spec.mtp.adapter_io import load_adapter
from sgl_spec.mtp.gated_lora import attach_to_hf_model

target = load_model_dir(resolve_model_path("{base_model}"))
adapter, config = load_adapter(resolve_model_path("{name}"), target.config)
handle = attach_to_hf_model(target, adapter)  # then: with handle.gates(gate, mask_index): ..."""


def adapter_card(out_dir: Path, log: dict, metrics: dict) -> ModuleCard:
    """The card of the adapter in ``out_dir``, trained as ``log`` says, with held-out ``metrics``."""
    doc = read_json(out_dir / CONFIG_FILE)
    cfg = doc["config"]
    size_mb = (out_dir / WEIGHTS_FILE).stat().st_size / 1e6
    return ModuleCard(
        title=log.get("name", out_dir.name),
        intro=_intro(cfg),
        sections=[_adapter(doc, log, size_mb), _training_data(log["data"])],
        run=_training_run(log, metrics, cfg["k_max"]),
        held_out=_held_out(metrics["held_out"], cfg["k_max"]),
        use=_use_code(cfg["base_model"], log.get("name", str(out_dir))),
        seeded="the greedy data, the adapter init and every\nbatch are functions of the seed",
        loss_title="MTP adapter: training loss (masks)",
    )
