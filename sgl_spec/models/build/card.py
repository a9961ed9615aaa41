"""Model cards (README.md + loss curve + metrics.json) for the shipped target and draft
directories.

The card is generated, never hand-edited, so it always states the numbers of the weights next
to it: sizes, the corpus hash, the exact commands, held-out metrics and timings. It reads the
``training.json`` that ``train.py`` wrote into each directory and the metrics of ``evaluate``.
The layout every card shares (and the card files of adapters and drafters) is in
``sgl_spec.training.card``; this module keeps the pair's own prose and tables.
"""

from __future__ import annotations

import json
from pathlib import Path

from sgl_spec.models.build.export import read_json
from sgl_spec.training.card import (
    LOSS_PNG,
    METRICS_JSON,
    code_block,
    field_table,
    md_table,
    plot_losses,
    render_markdown,
    section,
    tail_mean,
    training_section,
)

_VOCAB_NOTE = (
    "(byte-level BPE, specials `<\\|endoftext\\|>` eos/pad, `<\\|im_start\\|>`, `<\\|im_end\\|>`, "
    "`<\\|reserved_0..15\\|>`)"
)

_WHY_THIS_SIZE = """Why this size: see `sgl_spec/models/build/specs.py` (the target's batch-16 decode forward must be a
real cost next to SGLang's per-step overhead while training in about an hour on one CPU core;
tied embeddings keep target + draft under the 64 MB package budget)."""


def _fmt_alpha(metrics: dict) -> str:
    a = metrics["agreement"]
    table = md_table(
        [f"α_{k + 1}" for k in range(len(a["alpha"]))], [[f"{x:.3f}" for x in a["alpha"]]]
    )
    acc = ", ".join(f"K={k + 1}: {x:.2f}" for k, x in enumerate(a["expected_acceptance_length"]))
    return f"{table}\n\nExpected acceptance length (bonus token included) of a chain draft of K tokens: {acc}."


def _timing_table(metrics: dict) -> str:
    return md_table(
        ("torch threads", "target (ms)", "1-layer draft, same vocab (ms)", "ratio"),
        [
            (key.split("_")[1], v["target_ms"], v["draft_1layer_ms"], v["ratio"])
            for key, v in metrics["timing"].items()
            if key.startswith("threads_")
        ],
    )


def manifest_tokens(manifest: dict) -> float:
    """Approximate train-split token count (3.6 bytes per token, measured for the 4096-token BPE)."""
    return manifest["num_bytes"]["train"] / 3.6


def _resume_note(log: dict) -> str:
    if "--resume" not in log["command"]:
        return ""
    return (
        "\nThe run was stopped and resumed on a CPU shared with other work, with `--steps` changed "
        "while the learning rate was still in its constant phase (allowed exactly then: the LRs of "
        "all steps so far do not depend on `--steps`). The same command without `--resume` is "
        "meant to train the same model in one go (resume exactness is tested on a tiny model).\n"
    )


def _intro(name: str, role: str, cfg: dict, log: dict, manifest: dict, target_width: int) -> str:
    from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    if role == "target":
        standing = "the default target" if name == DEFAULT_TARGET else "a target"
        pair = f"the default draft `{DEFAULT_DRAFT}` (or another draft of the same family)"
    else:
        standing = "the default draft model" if name == DEFAULT_DRAFT else "a draft model"
        pair = f"the target `{DEFAULT_TARGET}`"
    distilled = "then distilled on the target's logits (forward KL + 0.1 x next-token loss)"
    if role == "target":
        how = "trained from scratch with the next-token loss"
    elif cfg["hidden_size"] == target_width:
        how = f"initialised from the target's embeddings, final norm and first {cfg['num_hidden_layers']} layer(s), {distilled}"
    else:
        how = f"initialised from the target's embeddings projected onto their {cfg['hidden_size']} leading singular directions (its layers from scratch), {distilled}"
    return f"""A small Llama-architecture (`LlamaForCausalLM`) code model, {how}, on the Python standard
library source. It is {standing} shipped inside
sgl-spec, so speculative decoding can be served and tested on machines that cannot download
weights; pair it with {pair}. Not a useful code assistant: it is small and undertrained (it saw
~{log["tokens_seen"] / 1e6:.1f}M tokens, {log["tokens_seen"] / manifest_tokens(manifest):.2f} epochs of the corpus at ~3.6 bytes per token)."""


def _architecture(own: dict, cfg: dict, tc: dict) -> str:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    table = field_table(
        [
            ("parameters (tied embedding counted once)", f"{own['params'] / 1e6:.2f}M"),
            (
                "weights on disk",
                f"{own['weights_mb']:.1f} MB (`model.safetensors`, bf16 storage, fp32 `dtype` in config)",
            ),
            (
                "hidden / layers / heads / head dim",
                f"{hidden} / {cfg['num_hidden_layers']} / {heads} / {hidden // heads}",
            ),
            ("MLP intermediate (SwiGLU)", cfg["intermediate_size"]),
            ("vocabulary", f"{cfg['vocab_size']} {_VOCAB_NOTE}"),
            (
                "max positions / trained context",
                f"{cfg['max_position_embeddings']} / {tc['seq_len']}",
            ),
            ("tied embeddings", cfg["tie_word_embeddings"]),
        ]
    )
    return section("Architecture", table, _WHY_THIS_SIZE)


def _training_data(manifest: dict) -> str:
    nb = manifest["num_bytes"]
    return section(
        "Training data",
        f"""Python {manifest["python_version"]} standard library, `*.py` files without test suites,
`encodings/` and `pydoc_data/` ({manifest["num_files"]} files; train {nb["train"]:,} bytes,
held out {nb["eval"]:,} bytes; a file is held out when sha256 of its path mod 100 < {manifest["eval_percent"]}).
Corpus manifest sha256: `{manifest["total_sha256"]}`.""",
    )


def _training_run(log: dict) -> str:
    tc = log["train_config"]
    return f"""{log.get("steps_done", tc["steps"])} of {tc["steps"]} scheduled steps x {tc["batch_size"]} x {tc["seq_len"]} tokens, AdamW (lr {tc["lr"]}, linear warm-up
{tc["warmup_steps"]} steps, constant, then cosine to {tc["min_lr_ratio"]} x lr over the last {tc.get("decay_fraction", 0.25):.0%}
of the steps; weight decay {tc["weight_decay"]}, clip {tc["grad_clip"]}), bf16 autocast, seed {tc["seed"]},
{log["threads"]} torch thread(s): {log["wall_s"] / 60:.1f} min of training wall time on a CPU shared with other
work. Final training loss (mean of the last 25 steps): {tail_mean(log["losses"]):.3f}.
{_resume_note(log)}"""


def _held_out(metrics: dict) -> str:
    win, ag = metrics["eval_windows"], metrics["agreement"]
    table = md_table(
        ("model", "next-token top-1 accuracy", "perplexity"),
        [
            (role, f"{metrics[role]['top1_accuracy']:.3f}", f"{metrics[role]['perplexity']:.2f}")
            for role in ("target", "draft")
        ],
    )
    return section(
        "Held-out metrics (fp32, stored weights)",
        f"On {win['num']} windows of {win['seq_len']} tokens of the held-out files:",
        table,
        f"""Draft/target greedy agreement on {ag["num_prompts"]} held-out prompts of
{ag["prompt_len"]} tokens, over the target's {ag["num_new"]}-token greedy
continuation (α_k = P(draft's k-th greedy token = target's | first k-1 matched), averaged over all start positions):""",
        _fmt_alpha(metrics),
        f"""α_k grows with k because conditioning on k-1 matches selects the predictable stretches (the
greedy continuations of a model this small are repetitive: {ag["distinct_tokens_per_continuation"]:.1f}
distinct tokens per {ag["num_new"]}-token continuation on average).""",
    )


def _timing(metrics: dict) -> str:
    return section(
        "Decode-step timing (plain transformers, fp32, batch 16, "
        f"{metrics['timing']['context']}-token KV context)",
        _timing_table(metrics),
        "Best of 20 steps, measured on the shared 2-core dev CPU while other work was running: "
        "indicative only.",
    )


def _reproduce(pipeline: list[str]) -> str:
    return section(
        "Reproduce",
        f"""The whole pipeline, as run for these weights (from the repository root, `--work` defaulting to
`~/.cache/sgl_spec/tiny-code`; the last command regenerates this card and `{METRICS_JSON}`):""",
        code_block("\n".join(pipeline)),
        """The same seed and thread count give the same losses; a different Python version gives a
different corpus (check the manifest hash above).
License of the training data: the Python Software Foundation License (Python standard library).""",
    )


def render_card(
    role: str, model_dir: Path, metrics: dict, manifest: dict, pipeline: list[str]
) -> str:
    """The markdown of one card; ``pipeline`` is every command that produced the pair, in order."""
    cfg = read_json(model_dir / "config.json")
    log = read_json(model_dir / "training.json")
    target_width = metrics.get("target_hidden_size", cfg["hidden_size"])
    name = f"sgl-spec/{Path(model_dir).name}"
    return render_markdown(
        name,
        _intro(name, role, cfg, log, manifest, target_width),
        [
            _architecture(metrics[role], cfg, log["train_config"]),
            _training_data(manifest),
            training_section(log["command"], _training_run(log)),
            _held_out(metrics),
            _timing(metrics),
            _reproduce(pipeline),
        ],
    )


def write_cards(target_dir: Path, draft_dir: Path, metrics: dict, manifest: dict) -> None:
    """README.md, loss_curve.png and metrics.json into both model directories."""
    dirs = {"target": Path(target_dir), "draft": Path(draft_dir)}
    logs = {role: read_json(d / "training.json") for role, d in dirs.items()}
    pipeline = [
        "python -m sgl_spec.models.train corpus",
        "python -m sgl_spec.models.train tokenizer --vocab-size 4096",
        logs["target"]["command"],
        logs["draft"]["command"],
        metrics.get("eval_command", "python -m sgl_spec.models.train eval"),
    ]
    if " all" in logs["target"]["command"].split(" train", 1)[-1][:40]:
        pipeline = [logs["target"]["command"]]
    for role, d in dirs.items():
        plot_losses(logs[role]["losses"], f"{role}: training loss", d / LOSS_PNG)
        card = render_card(role, d, metrics, manifest, pipeline)
        (d / "README.md").write_text(card, encoding="utf-8")
        (d / METRICS_JSON).write_text(json.dumps(metrics, indent=1) + "\n")
