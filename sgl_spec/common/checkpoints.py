"""Launch-time checks of checkpoint directories, cheap enough to run before SGLang starts.

A safetensors file is read up to its header (tensor names, shapes, and the bytes its data must
span), never its tensors, so a truncated or garbled file is refused in milliseconds rather than
when a scheduler loads it. A draft LM must speak the target's tokens: the same vocabulary size
and, where both directories carry a ``tokenizer.json``, the same token ids.
Every ``ValueError`` names the flag the directory came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sgl_spec.argv import LaunchArgs

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from ``file``'s header; ``ValueError`` if ``file`` is missing, not
    safetensors, or shorter than its header says (a truncated download)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{file} is not a safetensors file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{file} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (unreadable header)")
    shapes, data_end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in entry["shape"])
            data_end = max(data_end, int(entry["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"{file}: bad header entry for {name!r}") from None
    if 8 + length + data_end > size:
        raise ValueError(
            f"{file} is truncated: {size} bytes, its header needs {8 + length + data_end}"
        )
    return shapes


def check_state_dict_file(file: Path, expected: dict[str, tuple[int, ...]], flag: str) -> None:
    """``file`` holds exactly the tensors ``expected`` names, with those shapes."""
    try:
        found = safetensors_shapes(file)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{n} {found[n]} != {shape}"
        for n, shape in expected.items()
        if found.get(n, shape) != shape
    ]
    if missing or unexpected or wrong:
        details = "; ".join(
            f"{what} {items[:3]}"
            for what, items in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
            if items
        )
        raise ValueError(f"{flag}: {file} does not match its config: {details}")


def module_shapes(build: Any) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of the module ``build()`` returns, built on the meta device (no
    memory allocated, whatever the size)."""
    import torch

    with torch.device("meta"):
        module = build()
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def read_json(file: Path, error: type[ValueError] = ValueError) -> Any:
    """The JSON document in ``file``; ``error`` naming the file where it cannot be read or
    parsed (``OSError``, bad UTF-8, bad JSON all mean the same to a caller: unusable)."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{file} is not readable JSON: {exc}") from exc


def read_model_config(path: str, flag: str) -> dict[str, Any]:
    """``path/config.json`` of a model directory, as a dict with a ``model_type``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{flag}: {path} has no config.json (not a model directory)")
    try:
        config = read_json(file)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{flag}: {file} has no model_type (not a transformers config)")
    return config


def check_model_weights(path: str, flag: str) -> None:
    """``path`` holds weights SGLang can load: every safetensors file (or every shard an index
    names) whole, or PyTorch ``.bin`` files (not opened: unpickling is not cheap)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({root / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{flag}: {index} is not a safetensors index: {exc}") from None
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            return
        raise ValueError(f"{flag}: {path} has no weights (*.safetensors or pytorch_model*.bin)")
    for file in files:
        try:
            safetensors_shapes(file)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None


def tokenizer_vocab(path: str) -> dict[str, int] | None:
    """Token -> id of ``path/tokenizer.json`` (added tokens included), or None without one."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)


def check_draft_fits_target(
    draft_path: str, target_path: str, tokenizer_path: str | None, flag: str
) -> None:
    """A draft LM proposes token ids the target verifies: the same vocabulary size, and where
    both directories have a ``tokenizer.json``, the same token ids (SGLang's STANDALONE worker
    checks both too, but only once its scheduler has loaded the two models)."""
    target_config = Path(target_path) / "config.json"
    if not target_config.is_file():
        return  # a hub id: SGLang reads it
    draft = read_model_config(draft_path, flag).get("vocab_size")
    try:
        target = json.loads(target_config.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return  # the target's own config: SGLang reports it
    if draft != target:
        raise ValueError(
            f"{flag}: the draft's vocabulary ({draft} tokens) differs from the target's"
            f" ({target}); a draft must use the target's tokenizer"
        )
    tokenizer_dir = tokenizer_path or target_path
    if _same_bytes(Path(draft_path, "tokenizer.json"), Path(tokenizer_dir, "tokenizer.json")):
        return
    try:
        draft_vocab = tokenizer_vocab(draft_path)
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise ValueError(f"{flag}: cannot read {draft_path}/tokenizer.json: {exc}") from None
    try:
        target_vocab = tokenizer_vocab(tokenizer_dir)
    except Exception:  # the target's own tokenizer: SGLang reports it
        target_vocab = None
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ValueError(
            f"{flag}: the draft's tokenizer maps tokens to other ids than the target's"
            f" ({tokenizer_dir}), e.g. {differ[:2]}"
        )


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def check_draft_model(draft_path: str, launch: LaunchArgs) -> None:
    """``--speculative-draft-model-path`` (a local directory) holds a whole model that drafts
    in the target's tokens. Hub ids are left to SGLang."""
    flag = "--speculative-draft-model-path"
    if not Path(draft_path).is_dir():
        return
    read_model_config(draft_path, flag)
    if launch.load_format != "dummy":
        check_model_weights(draft_path, flag)
    if launch.model_path is not None:
        check_draft_fits_target(draft_path, launch.model_path, launch.tokenizer_path, flag)
