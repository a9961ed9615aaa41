"""STANDALONE_FULL's settings in ``sgl_spec.config.SpecConfig``: none of them is a flag of
its own (it takes SGLang's STANDALONE flags); the launcher records that the launch asked for it."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import flag


@dataclass(frozen=True)
class StandaloneFlags:
    standalone_full_context: bool = flag(
        False,
        "--speculative-algorithm STANDALONE_FULL",
        "STANDALONE_FULL: set by the launcher when the launch asks for it; SGLang serves"
        " STANDALONE with our draft worker in every process.",
        kind="internal",
    )


FLAGS = StandaloneFlags
