"""``--speculative-algorithm STANDALONE_FULL``: SGLang's STANDALONE with the draft reading the
whole sequence (package docstring); the launcher's default on the shipped models.

Served as SGLang's STANDALONE (``runs_as``), so its launch checks and shipped-model defaults
are SGLang's STANDALONE's as well: a whole draft model with the target's tokens, an EAGLE draft
shape SGLang neither rewrites silently nor crashes on, no DP attention, no pipeline parallelism
(SGLang drafts under PP with EAGLE only).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.algorithm import Algorithm
from sgl_spec.config import SpecConfig
from sgl_spec.standalone import NAME

# On the shipped target and draft: a chain of 3 (measured best, benchmarks/RESULTS.md).
SHIPPED_ARGV = {
    "--speculative-num-steps": "3",
    "--speculative-eagle-topk": "1",
    "--speculative-num-draft-tokens": "4",
}


class StandaloneFull(Algorithm):
    name = NAME
    runs_as = "STANDALONE"
    uses_draft_model = True
    takes_token_map = True  # the draft's head cut to the map's rows (``hot_vocab.py``)
    parallel = frozenset({"tp_size", "dp_size"})
    parallel_why = {"pp_size": "SGLang's pipeline parallelism drafts with EAGLE only"}
    shipped_argv = SHIPPED_ARGV
    patches = ("sgl_spec.standalone.hook",)

    def with_shipped_defaults(self, config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
        """``--standalone-steps`` resolved where the user gave none (``default_steps_mode``)."""
        from sgl_spec.standalone.flags import default_steps_mode

        if launch.algorithm != NAME or config.standalone_steps is not None:
            return config
        mode = default_steps_mode(launch.eagle_topk, launch.overlap_schedule, launch.device)
        return replace(config, standalone_steps=mode)

    def mark(self, config: SpecConfig) -> SpecConfig:
        return replace(config, standalone_full_context=True)

    def marked(self, config: SpecConfig) -> bool:
        return config.standalone_full_context

    def settings(self, config: SpecConfig, launch: LaunchArgs) -> tuple[int | None, int | None]:
        """SGLang's STANDALONE checks; the draft shape (steps, verified tokens) as given."""
        from sgl_spec.algorithms import check_eagle_shape
        from sgl_spec.common.checkpoints import check_draft_model

        name = launch.algorithm
        if launch.enable_dp_attention:
            raise ValueError(f"--enable-dp-attention: {name} does not support DP attention")
        if launch.draft_model_path is None:
            raise ValueError(f"{name} needs --speculative-draft-model-path (the draft model)")
        check_draft_model(launch.draft_model_path, launch)
        if launch.token_map is not None and name == self.runs_as and not self.marked(config):
            raise ValueError(
                "--speculative-token-map: SGLang's STANDALONE keeps its draft's whole LM head"
                " and would read its proposals as indices into the map; use"
                f" --speculative-algorithm {NAME}, which cuts the head to the map"
            )
        if launch.token_map is not None and not Path(launch.token_map).is_file():
            raise ValueError(
                f"--speculative-token-map {launch.token_map}: no such file (a torch.save'd list"
                " of token ids: `python -m sgl_spec.standalone.hot_vocab`)"
            )
        check_eagle_shape(launch.num_steps, launch.eagle_topk, launch.num_draft_tokens)
        mode = config.standalone_steps
        if mode not in (None, "fixed"):  # SGLang's adaptive step switching: chains (control.py)
            if launch.eagle_topk not in (None, 1):
                raise ValueError(
                    f"--standalone-steps {mode} chooses a chain's length: it needs"
                    f" --speculative-eagle-topk 1, got {launch.eagle_topk}"
                )
        return launch.num_steps, launch.num_draft_tokens

    def sglang_argv(self, config: SpecConfig, argv: list[str]) -> list[str]:
        """``--standalone-steps`` other than fixed runs steps in order: the chosen length of a
        step and its verify result must meet (the CPU launcher turns overlap off anyway)."""
        from sgl_spec.argv import has_flag

        mode = config.standalone_steps
        if mode in (None, "fixed") or has_flag(argv, "--disable-overlap-schedule"):
            return argv
        if has_flag(argv, "--enable-overlap-schedule"):
            raise ValueError(
                f"--standalone-steps {mode} runs steps in order: drop --enable-overlap-schedule"
            )
        return [*argv, "--disable-overlap-schedule"]

    def verify_shape(self, settings: tuple[int | None, int | None]) -> tuple[int, int]:
        """SGLang sizes STANDALONE's shape itself; this is the shape the launch gave."""
        steps, tokens = settings
        return steps or 0, tokens or 0

    def worker_class(self) -> type:
        """Our draft worker; SGLang's ``StandaloneWorkerV2`` builds it (``hook.py``)."""
        from sgl_spec.standalone.draft import FullContextDraftWorker

        return FullContextDraftWorker


ALGORITHM = StandaloneFull()
