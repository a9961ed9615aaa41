"""Model card (README.md + loss curve + metrics.json + training.json) of a SpecBlock drafter.

Generated from the training log written by ``train.py`` and the held-out metrics of the stored
weights, never hand-edited, so the card always states the numbers of the weights next to it. The
layout shared with the other cards is in ``sgl_spec.training.card``; this module keeps the
drafter's own prose and tables.
"""

from __future__ import annotations

import math
from pathlib import Path

from sgl_spec.specblock.config import WEIGHTS_NAME
from sgl_spec.training.card import ModuleCard, field_table, md_table, section, tail_mean

_BUCKET_NAMES = ("b0 (rank 1)", "b1 (rank 2-4)", "b2 (rank 5-10)", "b3 (rank > 10)")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _alpha_table(ev: dict) -> str:
    k = ev["block_size"]
    return md_table(
        (
            "chain position k",
            "block, slot",
            "α_k",
            "P(1..k all right)",
            "tokens/call with k drafts",
        ),
        [
            (i + 1, f"{i // k + 1}, {i % k + 1}", f"{a:.3f}", f"{p:.3f}", f"{e:.2f}")
            for i, (a, p, e) in enumerate(
                zip(
                    ev["alpha"], ev["prefix_correct"], ev["expected_acceptance_length"], strict=True
                )
            )
        ],
    )


def _rank_table(rank: dict | None) -> str:
    if rank is None:
        return "No rank head (the `--no-rank-head` ablation): every position gets a fixed width."
    table = md_table(
        ("bucket", "frequency", "precision", "recall"),
        [
            (name, f"{row['frequency']:.3f}", _fmt(row["precision"]), _fmt(row["recall"]))
            for row, name in zip(rank["buckets"], _BUCKET_NAMES, strict=True)
        ],
    )
    return (
        f"Accuracy {rank['accuracy']:.3f} over {rank['num_positions']} held-out positions whose "
        f"valid-prefix mask is one (every earlier chain position drafted right).\n\n{table}"
    )


def _ablations(drafter: dict, train: dict) -> str:
    off = [
        name
        for name, on in (
            ("prefix broadcast", drafter["prefix_broadcast"]),
            ("layer-wise shift", drafter["layer_shift"]),
            ("valid-prefix curriculum", train["valid_prefix"]),
            ("rank head", drafter["rank_head"]),
        )
        if not on
    ]
    return "none (the full method)" if not off else "without " + ", ".join(off)


def _intro(log: dict) -> str:
    dc = log["drafter_config"]
    return f"""A SpecBlock block-iterative drafter (SpecBlock paper §3, `sgl_spec/specblock/model.py`) for the
target `{log["target"]}`. One drafter forward drafts a block of K = {dc["block_size"]} dependent
positions from the target's low/mid/top hidden states (layers {list(dc["aux_layer_ids"])}), the
last verified token and K learned position queries; a layer-wise shift carries position k-1's
state into position k between decoder layers, later blocks start from the drafter's own cached
state (Algorithm 2), and a rank head predicts per position the bucket of the target token's rank
(§3.2), which sets the tree's branching."""


def _layer_design(dc: dict) -> str:
    """``L / d`` and whether the layers are the target's design (App. A.1) or narrower."""
    layer = dc["layer_config"]
    shape = f"{dc['num_layers']} / {dc['hidden_size']}"
    if dc["hidden_size"] == dc["target_hidden_size"]:
        return f"{shape} (the target's layer design, App. A.1)"
    return (
        f"{shape} (narrower than the target's {dc['target_hidden_size']}: MLP "
        f"{layer.get('intermediate_size')}, {layer.get('num_attention_heads')} heads)"
    )


def _drafter(log: dict, size_mb: float) -> str:
    dc, n = log["drafter_config"], log["num_parameters"]
    rank_head = (
        f"MLP over [sg(h), sg(psi(p))], width {dc['rank_hidden_size']}"
        if dc["rank_head"]
        else "none"
    )
    table = field_table(
        [
            (
                "decoder layers L / hidden size d",
                _layer_design(dc),
            ),
            ("block size K", dc["block_size"]),
            (
                "draft vocabulary",
                f"{dc['draft_vocab_size']} most frequent label tokens of the training data ({log['data']['draft_vocab_coverage']:.2%} of them), `d2t` stored in the weights",
            ),
            ("rank head", rank_head),
            ("ablations", _ablations(dc, log["train_config"])),
            (
                "trainable parameters",
                f"{n / 1e6:.2f}M (target: {log['target_parameters'] / 1e6:.1f}M; the frozen target embedding is stored too)",
            ),
            (
                "on disk",
                f"{size_mb:.1f} MB (`{WEIGHTS_NAME}`, {log['storage_dtype']} storage; loading upcasts to fp32)",
            ),
        ]
    )
    return section("Drafter", table)


def _training_data(data: dict, num_blocks: int) -> str:
    train = data["train"]
    return section(
        "Training data",
        f"""The target's own fp32 greedy continuations: {train["num_prompts"]} prompts of
{train["prompt_len"]} tokens from the train split of the target's corpus, each continued by
{train["num_new"]} greedy tokens ({data["gen_wall_s"] / 60:.1f} min to generate; the cache
under `--greedy-cache` is shared with the MTP adapter's pipeline). The drafter conditions on the frozen
target's hidden states, recomputed for every batch. Every position of the generated part starts a
chain of {num_blocks} blocks whose later blocks start at a uniformly drawn cut (§3.3).""",
    )


def _training_run(log: dict, metrics: dict) -> str:
    tc = log["train_config"]
    total_min = (log["data"]["gen_wall_s"] + log["train_wall_s"] + metrics["eval_wall_s"]) / 60
    return f"""{log["steps_done"]} steps x {tc["batch_size"]} sequences (all chains of each), Eq. (7): per-slot
cross-entropy against the target's tokens under the valid-prefix mask
({"on" if tc["valid_prefix"] else "off: ablation"}), plus the rank-head loss from step
{tc["rank_warmup_steps"]} on. AdamW (betas 0.9/0.999, weight decay {tc["weight_decay"]}), lr
{tc["lr"]} (warm-up {tc["warmup_steps"]}, constant, cosine to {tc["min_lr_ratio"]} x lr over the
last {tc["decay_fraction"]:.0%}), clip {tc["grad_clip"]}, {"bf16 autocast" if tc["bf16_autocast"] else "fp32"},
seed {tc["seed"]}, {log["threads"]} torch thread(s). Training took {log["train_wall_s"] / 60:.1f} min
({log["s_per_step"]:.2f} s/step); {total_min:.1f} min with data and evaluation. Final loss (mean
of the last 25 steps): {tail_mean(log["losses"]):.3f}, draft part {tail_mean(log["draft_losses"]):.3f},
rank part {_fmt(tail_mean(log["rank_losses"]))}. The Eq. (7) loss need not fall monotonically: as
early slots get drafted right, the valid-prefix mask admits later, harder slots into the sum."""


def _held_out(ev: dict) -> str:
    depth = len(ev["alpha"])
    return section(
        "Held-out acceptance (fp32, stored weights)",
        f"""{ev["num_sequences"]} held-out prompts, {ev["num_chains"]} greedy chains of {ev["num_blocks"]}
blocks (depth {depth}); block 2 starts from the last slot of block 1 with its drafted token. α_k
is P(chain position k right | positions 1..k-1 right) against the target's greedy tokens
(App. C); {ev["label_coverage"]:.2%} of the held-out labels are in the draft vocabulary.""",
        _alpha_table(ev),
        f"""**τ = {ev["tau"]:.3f}** tokens per verifier call (accepted drafts + bonus) when greedy decoding is
replayed along the held-out sequences with chain drafts of depth {depth} ({ev["num_verify_calls"]}
calls).""",
        "### Rank head (Table 3)",
        _rank_table(ev["rank_head"]),
    )


def drafter_card(out_dir: Path, log: dict, metrics: dict) -> ModuleCard:
    """The card of the drafter in ``out_dir``, trained as ``log`` says, with held-out ``metrics``."""
    return ModuleCard(
        title=log["name"],
        intro=_intro(log),
        sections=[
            _drafter(log, (out_dir / WEIGHTS_NAME).stat().st_size / 1e6),
            _training_data(log["data"], log["train_config"]["num_blocks"]),
        ],
        run=_training_run(log, metrics),
        held_out=_held_out(metrics["held_out"]),
        use="from sgl_spec.specblock.model import SpecBlockDrafter\n\n"
        f'drafter = SpecBlockDrafter.from_pretrained("{out_dir}")',
        seeded="greedy data, drafter init and every batch and\ncut are functions of the seed",
        loss_title="SpecBlock drafter: training loss (Eq. 7)",
    )
