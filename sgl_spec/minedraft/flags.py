"""MINEDRAFT's command-line flags (a group of ``sgl_spec.config.SpecConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import CHAIN_STEPS_MODES, ConfigError, flag

MINEDRAFT_DRAFTERS = ("model", "specblock")
MINEDRAFT_POLICIES = ("balanced", "paper")  # batch assignment (sgl_spec.minedraft.batch_manager)


@dataclass(frozen=True)
class MineDraftFlags:
    speculative_draft_device: str | None = flag(
        None,
        "--speculative-draft-device",
        "MINEDRAFT: device of the draft-server process (one per --dp-size replica): cuda:N"
        " (a GPU of its own), or on a CPU host cpu:N (the last N cores, N per replica, which"
        " the target's ranks then leave alone) or cpu. Default: the last GPU the target's"
        " ranks leave free, else cpu:1 where the ranks keep a core each, else cpu.",
        requires="MINEDRAFT",
    )
    minedraft_drafter: str = flag(
        "model",
        "--minedraft-drafter",
        "MINEDRAFT: what the draft server hosts: 'model' (the draft LM of"
        " --speculative-draft-model-path) or 'specblock' (the SpecBlock drafter of"
        " --specblock-drafter-path, drafting chains of --speculative-num-steps; on the"
        " shipped target the shipped drafter).",
        choices=MINEDRAFT_DRAFTERS,
    )
    minedraft_policy: str = flag(
        "balanced",
        "--minedraft-policy",
        "MINEDRAFT: batch assignment, 'balanced' (every new request joins the smaller"
        " batch, App. A) or 'paper' (§5.1 as published).",
        choices=MINEDRAFT_POLICIES,
    )
    minedraft_draft_timeout: float = flag(
        30.0,
        "--minedraft-draft-timeout",
        "MINEDRAFT: seconds without a reply from the draft server, while drafts are awaited,"
        " before it is treated as hung and restarted (default 30); meanwhile a sync point"
        " waits at most a short budget, and its batch is decoded target-only.",
        kind=float,
        bounds=(1e-3, 86400.0),
    )
    minedraft_overlap: str = flag(
        "on",
        "--minedraft-overlap",
        "MINEDRAFT: 'on' (default) drafts one batch while the target verifies the other;"
        " 'off' runs every step as standard SD through the same draft server (draft, then"
        " verify): the like-for-like baseline that measures what the overlap gains.",
        choices=("on", "off"),
    )
    minedraft_steps: str = flag(
        "auto",
        "--minedraft-steps",
        "MINEDRAFT: drafts verified per request each step: 'fixed' all"
        " --speculative-num-steps; 'auto' (default) lets the speculation controller (sgl_spec/control)"
        " choose each step's number among 0 (a plain decode step of the whole batch that"
        " waits for nothing from the draft server; a few steps before a drafted one it sends"
        " the server, unawaited, the tokens of requests it lags by 16 or more) .."
        " --speculative-num-steps, from the measured"
        " step time and the running acceptance"
        " per position at the current batch size; 'cycle' takes 0 .. --speculative-num-steps"
        " in turn, one step each (for tests); 'off' verifies no drafts (the floor 'auto' falls"
        " back to; for measuring it).",
        choices=CHAIN_STEPS_MODES,
        requires="MINEDRAFT",
    )

    def validate(self) -> None:
        """Checks beyond the declared ones; ``ConfigError`` naming the flag."""
        if self.speculative_draft_device is not None:
            from sgl_spec.minedraft.devices import parse_device

            try:
                parse_device(self.speculative_draft_device)
            except ValueError as exc:
                raise ConfigError(f"--speculative-draft-device: {exc}") from None


FLAGS = MineDraftFlags
