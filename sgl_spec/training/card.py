"""What every generated model card has in common: the files beside it (``training.json``,
``metrics.json``, ``loss_curve.png``, ``README.md``), the markdown building blocks (sections,
tables, code blocks), the "Training" section with the command and the loss curve, and the layout
of an adapter or drafter card (``ModuleCard``: its own sections, then "Training", the held-out
section, "Use" and "Reproduce").

The cards of the shipped target/draft pair (``sgl_spec.models.build.card``), of an MTP adapter
(``sgl_spec.mtp.training.card``) and of a SpecBlock drafter (``sgl_spec.specblock.training.card``) keep only their
own prose and tables and build them from these, so the three stay laid out alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def tail_mean(values: Sequence[float | None], n: int = 25) -> float:
    """Mean of the last ``n`` logged values (skipping steps that logged none), the "final loss"
    every card states: a single last step is too noisy to quote. NaN when there is none."""
    tail = [v for v in values[-n:] if v is not None]
    return sum(tail) / len(tail) if tail else float("nan")


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table (cells rendered with ``str``), so every card's tables share one layout."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def field_table(rows: Iterable[tuple[str, object]]) -> str:
    """The ``field | value`` table that describes a model's architecture and storage."""
    return md_table(("field", "value"), rows)


def code_block(text: str, lang: str = "") -> str:
    """A fenced code block: commands and snippets that are meant to be copied verbatim."""
    return f"```{lang}\n{text}\n```"


def section(heading: str, *paragraphs: str) -> str:
    """One ``## heading`` section: its paragraphs (blocks of text, tables, code) separated by a
    blank line; ``render_markdown`` puts a blank line between sections."""
    return f"## {heading}\n\n" + "\n\n".join(paragraphs) + "\n"


def render_markdown(title: str, intro: str, sections: Iterable[str]) -> str:
    """The whole card: ``# title``, the introduction, then the sections."""
    return f"# {title}\n\n{intro}\n\n" + "\n".join(sections)


def training_section(command: str, run: str) -> str:
    """The "Training" section: the exact command, what the run did (``run``, the pipeline's own
    prose), then the loss curve that ``write_card_files`` / ``plot_losses`` wrote beside it."""
    return section("Training", code_block(command), run, f"![loss curve]({LOSS_PNG})")


def use_and_reproduce(python: str, command: str, seeded: str) -> list[str]:
    """The closing sections of an adapter or drafter card: how to load it, and the one command
    that trains it again; ``seeded`` says what the seed fixes, so the claim of determinism is
    checkable."""
    return [
        section("Use", code_block(python, "python")),
        section(
            "Reproduce",
            code_block(command),
            f"Deterministic for a given seed and thread count ({seeded}); "
            "`--resume` continues a stopped run exactly.",
        ),
    ]


@dataclass(frozen=True)
class ModuleCard:
    """What the card of a trained MTP adapter or SpecBlock drafter says of its own; ``render``
    lays it out like every other card: the title and introduction, the module's own sections,
    "Training" (the command, what the run did, the loss curve), the held-out section, then "Use"
    and "Reproduce"."""

    title: str
    intro: str
    sections: Sequence[str]  # the module's own sections (architecture, data), before "Training"
    run: str  # what the training run did, under the command in "Training"
    held_out: str  # the held-out metrics section
    use: str  # Python that loads the module
    seeded: str  # what the seed fixes, for the determinism claim of "Reproduce"
    loss_title: str  # title of the loss-curve plot

    def render(self, command: str) -> str:
        """The card's markdown; ``command`` is the training command as run."""
        return render_markdown(
            self.title,
            self.intro,
            [
                *self.sections,
                training_section(command, self.run),
                self.held_out,
                *use_and_reproduce(self.use, command, self.seeded),
            ],
        )


def write_card_files(
    out_dir: Path, log: dict, metrics: dict, card: Callable[[Path, dict, dict], ModuleCard]
) -> None:
    """The card of a trained MTP adapter or SpecBlock drafter: ``training.json``,
    ``metrics.json``, ``loss_curve.png`` and ``README.md`` (``card(out_dir, log, metrics)``), all
    from one log and one set of metrics so the card cannot disagree with the JSON beside it."""
    out_dir = Path(out_dir)
    (out_dir / TRAINING_JSON).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    (out_dir / METRICS_JSON).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    text = card(out_dir, log, metrics)
    plot_losses(log["losses"], text.loss_title, out_dir / LOSS_PNG)
    (out_dir / "README.md").write_text(text.render(log["command"]), encoding="utf-8")
