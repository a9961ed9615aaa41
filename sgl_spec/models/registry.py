"""Names of the models shipped inside the package, resolved to local directories.

``--model-path sgl-spec/tiny-code`` must work on a machine with no network: the names are
resolved here to directories inside the installed package, before SGLang or transformers ever see
them, so nothing tries to reach a model hub (safe under ``HF_HUB_OFFLINE=1``). A name that looks
like ours but is unknown is refused with the list of known names instead of being passed on as a
hub id, which would fail later with a far less helpful network error.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
NAMESPACE = "sgl-spec/"

SHIPPED_MODELS: dict[str, Path] = {
    "sgl-spec/tiny-code": WEIGHTS_DIR / "tiny-code",
    # Draft models of tiny-code, one layer each: half the target's width (the default: a third
    # of the bytes per decode, the higher acceptance of the two), and the target's width.
    "sgl-spec/tiny-code-draft-narrow": WEIGHTS_DIR / "tiny-code-draft-narrow",
    "sgl-spec/tiny-code-draft": WEIGHTS_DIR / "tiny-code-draft",
    # Not a model: the gated-LoRA MTP adapter of tiny-code (sgl_spec/mtp), loaded on top of it.
    "sgl-spec/tiny-code-mtp": WEIGHTS_DIR / "tiny-code-mtp",
    # SpecBlock drafters of tiny-code (sgl_spec/specblock), K = 4: one layer of width 256 (the
    # default: a fifth of the weights of the next, nearly its acceptance), two layers of the
    # target's width 512 (the paper's design), and the latter trained with K = 1 (an EAGLE-style
    # autoregressive drafter, for the comparison).
    "sgl-spec/tiny-code-specblock-narrow": WEIGHTS_DIR / "tiny-code-specblock-narrow",
    "sgl-spec/tiny-code-specblock": WEIGHTS_DIR / "tiny-code-specblock",
    "sgl-spec/tiny-code-specblock-k1": WEIGHTS_DIR / "tiny-code-specblock-k1",
}
DEFAULT_TARGET = "sgl-spec/tiny-code"
DEFAULT_DRAFT = "sgl-spec/tiny-code-draft-narrow"
DEFAULT_MTP_ADAPTER = "sgl-spec/tiny-code-mtp"
DEFAULT_SPECBLOCK_DRAFTER = "sgl-spec/tiny-code-specblock-narrow"
# The file whose presence marks a shipped directory as installed (models: config.json).
_MARKER_FILE = {DEFAULT_MTP_ADAPTER: "adapter_config.json"}


def known_names() -> list[str]:
    """Registered model names, sorted."""
    return sorted(SHIPPED_MODELS)


def resolve_artifact_dir(
    value: str | None, flag: str, marker: str, algorithm: str, trainer: str
) -> str:
    """The directory a ``flag`` names (a shipped name or a local path) holding ``marker``;
    ``ValueError`` naming ``flag`` otherwise (``algorithm`` needs it, ``trainer`` makes one)."""
    if value is None:
        raise ValueError(
            f"{algorithm} needs {flag} (a directory trained with `python -m {trainer}`);"
            " launch through `python -m sgl_spec.launch_server`"
        )
    try:
        path = Path(resolve_model_path(value))
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from exc
    if not (path / marker).is_file():
        raise ValueError(f"{flag}: {value!r} has no {marker}")
    return str(path)


def resolve_model_path(name_or_path: str) -> str:
    """Map a registered name to its shipped directory; pass an existing directory through.

    Raises ``ValueError`` naming the bad value and the known names when the name is unknown, the
    path does not exist, or a registered model's files are missing from this installation.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model path must be a non-empty string, got {name_or_path!r}; {_known()}")
    if name_or_path in SHIPPED_MODELS:
        path = SHIPPED_MODELS[name_or_path]
        if not (path / _MARKER_FILE.get(name_or_path, "config.json")).is_file():
            raise ValueError(
                f"shipped model {name_or_path!r} is missing its files at {path} "
                "(broken installation: reinstall sgl-spec)"
            )
        return str(path)
    if name_or_path.startswith(NAMESPACE):
        raise ValueError(f"unknown model name {name_or_path!r}; {_known()}")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise ValueError(f"model path {name_or_path!r} is a file, expected a model directory")
    raise ValueError(f"model path {name_or_path!r} does not exist; {_known()}")


def is_shipped(path: str | Path) -> bool:
    """True if ``path`` (a name or a directory) is one of the models shipped with the package."""
    if str(path) in SHIPPED_MODELS:
        return True
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return False
    return any(resolved == p.resolve() for p in SHIPPED_MODELS.values())


def _known() -> str:
    return "known names: " + ", ".join(known_names())
