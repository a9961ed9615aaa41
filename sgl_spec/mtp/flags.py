"""MTP_LORA's command-line flags (a group of ``sgl_spec.config.SpecConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_spec.flags import ConfigError, flag

MAX_MTP_K = 8


@dataclass(frozen=True)
class MtpFlags:
    mtp_lora_path: str | None = flag(
        None,
        "--mtp-lora-path",
        "MTP_LORA: directory of the gated-LoRA adapter (adapter_config.json +"
        " adapter.safetensors) or a shipped name such as sgl-spec/tiny-code-mtp.",
    )
    mtp_k: str | None = flag(
        None,
        "--mtp-k",
        "MTP_LORA: drafts per step (0 = no speculation), at most the adapter's k_max;"
        " 'auto' lets the speculation controller choose k per step from measured step times"
        " (and --mtp-gamma-table as a prior, if given) and the running acceptance.",
    )
    mtp_gamma_table: str | None = flag(
        None,
        "--mtp-gamma-table",
        "MTP_LORA with --mtp-k auto: optional prior, the JSON written by"
        " benchmarks/gamma_tolerance.py; served step times replace it once measured.",
    )

    def validate(self) -> None:
        """Checks beyond the declared ones; ``ConfigError`` naming the flag."""
        if self.mtp_k is not None and self.mtp_k != "auto":
            if not self.mtp_k.isdigit() or not 0 <= int(self.mtp_k) <= MAX_MTP_K:
                raise ConfigError(
                    f"--mtp-k must be 'auto' or an integer in 0..{MAX_MTP_K}; got {self.mtp_k!r}"
                )


FLAGS = MtpFlags
