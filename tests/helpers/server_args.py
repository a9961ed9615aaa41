"""A stand-in for SGLang's ``ServerArgs`` carrying just what ``LaunchArgs.from_server_args``
reads, for unit tests of code that takes server arguments."""

from __future__ import annotations

from types import SimpleNamespace


def fake_server_args(**overrides: object) -> SimpleNamespace:
    values = {
        "speculative_algorithm": None,
        "model_path": None,
        "tokenizer_path": None,
        "speculative_draft_model_path": None,
        "device": "cpu",
        "base_gpu_id": 0,
        "load_format": "auto",
        "speculative_num_steps": None,
        "speculative_eagle_topk": None,
        "speculative_num_draft_tokens": None,
        "max_running_requests": None,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "enable_dp_attention": False,
    }
    values.update(overrides)
    return SimpleNamespace(**values)
