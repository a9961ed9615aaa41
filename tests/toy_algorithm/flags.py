from dataclasses import dataclass

from sgl_spec.flags import flag


@dataclass(frozen=True)
class ToyFlags:
    toy_drafts: int = flag(
        3, "--toy-drafts", "TOY_LOOKUP: drafts per step.", kind=int, bounds=(1, 8),
        requires="TOY_LOOKUP",
    )  # fmt: skip


FLAGS = ToyFlags
