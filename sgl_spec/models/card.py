"""Model cards (README.md + loss curve) for the shipped target and draft directories, and the
card files every trained MTP adapter or SpecBlock drafter gets (``write_card_files``).

The card is generated, never hand-edited, so it always states the numbers of the weights next
to it: sizes, the corpus hash, the exact commands, held-out metrics and timings. It reads the
``training.json`` that ``train.py`` wrote into each directory and the metrics of ``evaluate``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sgl_spec.models.export import read_json

LOSS_PNG = "loss_curve.png"
METRICS_JSON = "metrics.json"
TRAINING_JSON = "training.json"


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean, so the plotted curve is readable despite per-batch noise."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(losses: list[float], title: str, path: Path) -> bool:
    """Write a loss curve PNG; returns False (and writes nothing) if matplotlib is unavailable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, alpha=0.3, linewidth=0.8, label="per step")
    ax.plot(steps, moving_average(losses, 25), linewidth=1.5, label="mean of 25")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_card_files(
    out_dir: Path,
    log: dict,
    metrics: dict,
    *,
    loss_title: str,
    render: Callable[[Path, dict, dict], str],
) -> None:
    """The card of a trained MTP adapter or SpecBlock drafter: ``training.json``,
    ``metrics.json``, ``loss_curve.png`` and ``README.md`` (``render(out_dir, log, metrics)``),
    all from one log and one set of metrics so the card cannot disagree with the JSON beside it."""
    out_dir = Path(out_dir)
    (out_dir / TRAINING_JSON).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    (out_dir / METRICS_JSON).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    plot_losses(log["losses"], loss_title, out_dir / LOSS_PNG)
    (out_dir / "README.md").write_text(render(out_dir, log, metrics), encoding="utf-8")


def _fmt_alpha(metrics: dict) -> str:
    a = metrics["agreement"]
    head = "| " + " | ".join(f"α_{k + 1}" for k in range(len(a["alpha"]))) + " |"
    sep = "|" + "---|" * len(a["alpha"])
    row = "| " + " | ".join(f"{x:.3f}" for x in a["alpha"]) + " |"
    acc = ", ".join(f"K={k + 1}: {x:.2f}" for k, x in enumerate(a["expected_acceptance_length"]))
    return f"{head}\n{sep}\n{row}\n\nExpected acceptance length (bonus token included) of a chain draft of K tokens: {acc}."


def _timing_table(metrics: dict) -> str:
    t = metrics["timing"]
    lines = [
        "| torch threads | target (ms) | 1-layer draft, same vocab (ms) | ratio |",
        "|---|---|---|---|",
    ]
    for key, v in t.items():
        if key.startswith("threads_"):
            lines.append(
                f"| {key.split('_')[1]} | {v['target_ms']} | {v['draft_1layer_ms']} | {v['ratio']} |"
            )
    return "\n".join(lines)


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


def render_card(
    role: str, model_dir: Path, metrics: dict, manifest: dict, pipeline: list[str]
) -> str:
    """The markdown of one card; ``pipeline`` is every command that produced the pair, in order."""
    cfg = read_json(model_dir / "config.json")
    log = read_json(model_dir / "training.json")
    own = metrics[role]
    tc = log["train_config"]
    name = "sgl-spec/tiny-code" if role == "target" else "sgl-spec/tiny-code-draft"
    other = (
        "the draft `sgl-spec/tiny-code-draft`"
        if role == "target"
        else "the target `sgl-spec/tiny-code`"
    )
    how = (
        "trained from scratch with the next-token loss"
        if role == "target"
        else f"initialised from the target's embeddings, final norm and first {cfg['num_hidden_layers']} layer(s), then distilled on the target's logits (forward KL + 0.1 x next-token loss)"
    )
    return f"""# {name}

A small Llama-architecture (`LlamaForCausalLM`) code model, {how}, on the Python standard
library source. It is the embedded default {"target" if role == "target" else "draft model"} of
sgl-spec, so speculative decoding can be served and tested on machines that cannot download
weights; pair it with {other}. Not a useful code assistant: it is small and undertrained (it saw
~{log["tokens_seen"] / 1e6:.1f}M tokens, {log["tokens_seen"] / manifest_tokens(manifest):.2f} epochs of the corpus at ~3.6 bytes per token).

## Architecture

| field | value |
|---|---|
| parameters (tied embedding counted once) | {own["params"] / 1e6:.2f}M |
| weights on disk | {own["weights_mb"]:.1f} MB (`model.safetensors`, bf16 storage, fp32 `dtype` in config) |
| hidden / layers / heads / head dim | {cfg["hidden_size"]} / {cfg["num_hidden_layers"]} / {cfg["num_attention_heads"]} / {cfg["hidden_size"] // cfg["num_attention_heads"]} |
| MLP intermediate (SwiGLU) | {cfg["intermediate_size"]} |
| vocabulary | {cfg["vocab_size"]} (byte-level BPE, specials `<\\|endoftext\\|>` eos/pad, `<\\|im_start\\|>`, `<\\|im_end\\|>`, `<\\|reserved_0..15\\|>`) |
| max positions / trained context | {cfg["max_position_embeddings"]} / {tc["seq_len"]} |
| tied embeddings | {cfg["tie_word_embeddings"]} |

Why this size: see `sgl_spec/models/specs.py` (the target's batch-16 decode forward must be a
real cost next to SGLang's per-step overhead while training in about an hour on one CPU core;
tied embeddings keep target + draft under the 64 MB package budget).

## Training data

Python {manifest["python_version"]} standard library, `*.py` files without test suites,
`encodings/` and `pydoc_data/` ({manifest["num_files"]} files; train {manifest["num_bytes"]["train"]:,} bytes,
held out {manifest["num_bytes"]["eval"]:,} bytes; a file is held out when sha256 of its path mod 100 < {manifest["eval_percent"]}).
Corpus manifest sha256: `{manifest["total_sha256"]}`.

## Training

```
{log["command"]}
```

{log.get("steps_done", tc["steps"])} of {tc["steps"]} scheduled steps x {tc["batch_size"]} x {tc["seq_len"]} tokens, AdamW (lr {tc["lr"]}, linear warm-up
{tc["warmup_steps"]} steps, constant, then cosine to {tc["min_lr_ratio"]} x lr over the last {tc.get("decay_fraction", 0.25):.0%}
of the steps; weight decay {tc["weight_decay"]}, clip {tc["grad_clip"]}), bf16 autocast, seed {tc["seed"]},
{log["threads"]} torch thread(s): {log["wall_s"] / 60:.1f} min of training wall time on a CPU shared with other
work. Final training loss (mean of the last 25 steps): {sum(log["losses"][-25:]) / len(log["losses"][-25:]):.3f}.
{_resume_note(log)}

![loss curve]({LOSS_PNG})

## Held-out metrics (fp32, stored weights)

On {metrics["eval_windows"]["num"]} windows of {metrics["eval_windows"]["seq_len"]} tokens of the held-out files:

| model | next-token top-1 accuracy | perplexity |
|---|---|---|
| target | {metrics["target"]["top1_accuracy"]:.3f} | {metrics["target"]["perplexity"]:.2f} |
| draft | {metrics["draft"]["top1_accuracy"]:.3f} | {metrics["draft"]["perplexity"]:.2f} |

Draft/target greedy agreement on {metrics["agreement"]["num_prompts"]} held-out prompts of
{metrics["agreement"]["prompt_len"]} tokens, over the target's {metrics["agreement"]["num_new"]}-token greedy
continuation (α_k = P(draft's k-th greedy token = target's | first k-1 matched), averaged over all start positions):

{_fmt_alpha(metrics)}

α_k grows with k because conditioning on k-1 matches selects the predictable stretches (the
greedy continuations of a model this small are repetitive: {metrics["agreement"]["distinct_tokens_per_continuation"]:.1f}
distinct tokens per {metrics["agreement"]["num_new"]}-token continuation on average).

## Decode-step timing (plain transformers, fp32, batch 16, {metrics["timing"]["context"]}-token KV context)

{_timing_table(metrics)}

Best of 20 steps, measured on the shared 2-core dev CPU while other work was running: indicative only.

## Reproduce

The whole pipeline, as run for these weights (from the repository root, `--work` defaulting to
`~/.cache/sgl_spec/tiny-code`; the last command regenerates this card and `{METRICS_JSON}`):

```
{chr(10).join(pipeline)}
```

The same seed and thread count give the same losses; a different Python version gives a
different corpus (check the manifest hash above).
License of the training data: the Python Software Foundation License (Python standard library).
"""


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
