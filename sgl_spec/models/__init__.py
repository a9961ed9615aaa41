"""Embedded default models: corpus, tokenizer, training pipeline and the registry of shipped weights."""

from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, is_shipped, resolve_model_path

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "is_shipped", "resolve_model_path"]
