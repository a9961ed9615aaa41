"""On-disk format of an MTP adapter: ``adapter_config.json`` + ``adapter.safetensors``.

Every way a directory can be unusable (missing or corrupt file, wrong keys or shapes, non-finite
values, built for another base model) raises :class:`AdapterError` naming the file and the
field, at load time; a server must never start with an adapter that only fails mid-forward.
Weights may be stored in bf16 to keep the shipped file small; loading upcasts to fp32 (exact),
and the metrics of a model card are measured on the stored values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sgl_spec.common.checkpoints import read_json
from sgl_spec.mtp.config import AdapterError, BaseDims, MtpAdapterConfig

if TYPE_CHECKING:
    from sgl_spec.mtp.gated_lora import MtpAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter.safetensors"
FORMAT = "sgl-spec-mtp-gated-lora"
FORMAT_VERSION = 1


def save_adapter(
    out_dir: str | Path,
    adapter: MtpAdapter,
    config: MtpAdapterConfig,
    extra_metadata: dict[str, Any] | None = None,
    storage_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the two files into ``out_dir`` (created); returns the directory."""
    from safetensors.torch import save_file

    if config != adapter.config:
        raise ValueError(f"config {config} differs from the adapter's own {adapter.config}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(storage_dtype).contiguous().clone()
        for k, v in adapter.state_dict().items()
    }
    weights = out / WEIGHTS_FILE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # save_file creates 0600; package files must be world-readable
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": config.to_dict(),
        "base_dims": adapter.dims.__dict__,
        "storage_dtype": str(storage_dtype).removeprefix("torch."),
        "metadata": extra_metadata or {},
    }
    (out / CONFIG_FILE).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return out


def read_adapter_config(path: str | Path) -> tuple[MtpAdapterConfig, BaseDims, dict]:
    """Parse and validate ``adapter_config.json`` of a directory: ``(config, dims, metadata)``."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{file} is missing (not an MTP adapter directory)")
    doc = read_json(file, AdapterError)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AdapterError(f"{file}: 'format' must be {FORMAT!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise AdapterError(
            f"{file}: format_version {doc.get('format_version')!r} is not supported (expected {FORMAT_VERSION})"
        )
    try:
        config = MtpAdapterConfig.from_dict(doc["config"])
        dims = BaseDims(**doc["base_dims"])
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{file}: invalid adapter config: {e}") from e
    return config, dims, dict(doc.get("metadata") or {})


def check_base_compatible(dims: BaseDims, config: MtpAdapterConfig, base: Any, where: str) -> None:
    """Refuse a base model (HF config or :class:`BaseDims`) whose shapes differ from the adapter's."""
    base_dims = base if isinstance(base, BaseDims) else BaseDims.from_hf_config(base)
    for name, ours in dims.__dict__.items():
        theirs = getattr(base_dims, name)
        if ours != theirs:
            raise AdapterError(
                f"{where}: adapter was built for {name}={ours}, the base model has {name}={theirs}"
            )
    vocab = getattr(base, "vocab_size", None)
    if vocab is not None and max(config.mask_token_ids) >= vocab:
        raise AdapterError(
            f"{where}: mask_token_ids {list(config.mask_token_ids)} exceed the base vocab_size {vocab}"
        )


def load_adapter(path: str | Path, base_config: Any = None) -> tuple[MtpAdapter, MtpAdapterConfig]:
    """Load a saved adapter (fp32, eval mode); validate it against ``base_config`` if given."""
    from safetensors import safe_open

    from sgl_spec.mtp.gated_lora import MtpAdapter

    config, dims, _ = read_adapter_config(path)
    cfg_file, file = Path(path) / CONFIG_FILE, Path(path) / WEIGHTS_FILE
    if base_config is not None:
        check_base_compatible(dims, config, base_config, str(cfg_file))
    if not file.is_file():
        raise AdapterError(f"{file} is missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise AdapterError(f"{file} is not a readable safetensors file: {e}") from e
    adapter = MtpAdapter(config, dims)
    expected = adapter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise AdapterError(
            f"{file}: keys do not match {cfg_file.name} (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    for key, ref in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise AdapterError(
                f"{file}: {key} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{file}: {key} is not a finite floating-point tensor")
    adapter.load_state_dict({k: v.float() for k, v in tensors.items()})
    return adapter.eval(), config
