"""MTP_LORA's settings, built from ``--mtp-lora-path``, ``--mtp-k`` and ``--mtp-gamma-table``
(``SpecConfig``), each problem refused naming its flag; read by the launch check
(``mtp/algorithm.py``) and by the worker in the scheduler process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_spec.config import SpecConfig


@dataclass(frozen=True)
class MtpSettings:
    adapter_path: str
    k_max: int  # the adapter's trained mask count
    fixed_k: int  # drafts per step when the controller is off
    mask_token_ids: list[int]
    controller: Any | None  # sgl_spec.control.controller.SpeculationController when --mtp-k auto

    @property
    def max_k(self) -> int:
        return self.k_max if self.controller is not None else self.fixed_k


def resolve_adapter_path(value: str | None) -> str:
    from sgl_spec.models.registry import resolve_artifact_dir

    return resolve_artifact_dir(
        value, "--mtp-lora-path", "adapter_config.json", "MTP_LORA", "sgl_spec.mtp.train"
    )


def read_adapter(path: str) -> tuple[Any, Any]:
    """``(MtpAdapterConfig, BaseDims)`` of the adapter directory ``path``, its weights file
    checked against them (header only: names and shapes); ``ValueError`` naming the flag."""
    from sgl_spec.common.checkpoints import check_state_dict_file, module_shapes
    from sgl_spec.mtp.adapter_io import WEIGHTS_FILE, read_adapter_config
    from sgl_spec.mtp.gated_lora import MtpAdapter

    try:
        adapter_config, dims, _ = read_adapter_config(path)
    except ValueError as exc:
        raise ValueError(f"--mtp-lora-path: {exc}") from exc
    expected = module_shapes(lambda: MtpAdapter(adapter_config, dims))
    check_state_dict_file(Path(path) / WEIGHTS_FILE, expected, "--mtp-lora-path")
    return adapter_config, dims


def check_target_fit(adapter_path: str, model_path: str) -> None:
    """Refuse an adapter trained for another target (layer count, hidden and projection sizes,
    mask ids inside the vocabulary), when the target is a local directory."""
    if not (Path(model_path) / "config.json").is_file():
        return
    from transformers import AutoConfig

    from sgl_spec.mtp.adapter_io import check_base_compatible

    adapter_config, dims = read_adapter(adapter_path)
    target = AutoConfig.from_pretrained(model_path)
    try:
        check_base_compatible(dims, adapter_config, target, adapter_path)
    except ValueError as exc:
        raise ValueError(f"--mtp-lora-path: {exc} ({model_path})") from exc


def load_settings(config: SpecConfig, model_path: str | None = None) -> MtpSettings:
    """MTP_LORA's settings from its flags; with ``model_path``, the adapter is checked against
    that target too."""
    path = resolve_adapter_path(config.mtp_lora_path)
    if model_path is not None:
        check_target_fit(path, model_path)
    adapter_config, _ = read_adapter(path)
    k_max = adapter_config.k_max
    mask_token_ids = list(adapter_config.mask_token_ids)
    if len(mask_token_ids) < k_max:
        raise ValueError(f"--mtp-lora-path: {k_max=} but only {len(mask_token_ids)} mask ids")
    controller = None
    fixed_k = k_max
    if config.mtp_k == "auto":
        controller = build_controller(config.mtp_gamma_table, k_max, alpha_prior(path, k_max))
    elif config.mtp_k is not None:
        fixed_k = int(config.mtp_k)
        if fixed_k > k_max:
            raise ValueError(f"--mtp-k {fixed_k} exceeds the adapter's k_max {k_max} ({path})")
    return MtpSettings(path, k_max, fixed_k, mask_token_ids, controller)


def alpha_prior(adapter_path: str, k_max: int) -> float | tuple[float, ...]:
    """The adapter's held-out conditional acceptance per mask position, if its card has it."""
    metrics = Path(adapter_path) / "metrics.json"
    try:
        data = json.loads(metrics.read_text())
        chain = [float(a) for a in data["alpha_prefix"][:k_max]]
    except (OSError, ValueError, KeyError, TypeError):
        return 0.5
    if len(chain) < k_max:
        return 0.5
    # P(masks 1..j all right) -> P(mask j right | 1..j-1 right)
    conditional = [chain[0]] + [
        b / a if a > 0 else 0.0 for a, b in zip(chain, chain[1:], strict=False)
    ]
    return tuple(min(max(a, 0.0), 1.0) for a in conditional)


def build_controller(table_path: str | None, k_max: int, prior: float | tuple[float, ...]) -> Any:
    from sgl_spec.control.config import CHAIN_TUNING, ControllerConfig
    from sgl_spec.control.controller import SpeculationController
    from sgl_spec.control.cost_model import GammaTable, MTPGatedLoRACost

    table = None
    if table_path is not None:
        if not Path(table_path).is_file():
            raise ValueError(f"--mtp-gamma-table: {table_path!r} is not a file")
        try:
            table = GammaTable.load(table_path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--mtp-gamma-table: cannot use {table_path}: {exc}") from exc
    config = ControllerConfig(k_max=k_max, alpha_prior=prior, **CHAIN_TUNING)
    try:
        return SpeculationController(table, MTPGatedLoRACost(), config)
    except ValueError as exc:
        raise ValueError(f"--mtp-gamma-table: {exc}") from exc
