"""Deterministic training corpus built from the running interpreter's standard library.

No host of this project can download data, but every host has a Python standard library: its
``*.py`` sources are a few MB of real, varied code, identical on every machine that runs the same
interpreter version. The manifest (relative path + sha256 per file, and one hash over all of them)
is written next to the data, so a model card can say exactly which corpus a model was trained on
and a rebuild on another machine can be checked byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names whose sources are left out: test suites (repetitive fixtures, some deliberately
# malformed files), third-party packages, and the generated tables in ``encodings`` and
# ``pydoc_data`` (huge literals that teach a code model nothing).
EXCLUDED_DIRS = frozenset(
    {
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
    }
)
EXCLUDED_DIR_PREFIXES = ("test",)

# A file goes to the eval split when the first 8 hex digits of sha256(relative path) mod 100 fall
# below this. Hashing the *path* (not the content) keeps a file on the same side of the split
# across interpreter patch releases that edit it.
EVAL_PERCENT = 5


@dataclass(frozen=True)
class CorpusFile:
    """One source file of the corpus (``path`` is relative to the stdlib root, POSIX style)."""

    path: str
    sha256: str
    num_bytes: int
    split: str


def default_stdlib_dir() -> Path:
    """The stdlib of the interpreter running this code (also correct inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    for part in rel.parts[:-1]:
        if part in EXCLUDED_DIRS or part.startswith(EXCLUDED_DIR_PREFIXES):
            return True
    return False


def split_of(rel_path: str) -> str:
    """Return ``"eval"`` or ``"train"`` for a relative path; fixed, independent of content."""
    bucket = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def list_source_files(stdlib_dir: Path) -> list[Path]:
    """All eligible ``*.py`` files under ``stdlib_dir``, sorted by relative POSIX path."""
    files = [p for p in stdlib_dir.rglob("*.py") if not _excluded(p.relative_to(stdlib_dir))]
    return sorted(files, key=lambda p: p.relative_to(stdlib_dir).as_posix())


def read_corpus(stdlib_dir: Path | None = None) -> tuple[list[CorpusFile], dict[str, str]]:
    """Read every eligible file; return its manifest entries and ``{relative path: text}``.

    Files that are not valid UTF-8 are skipped (the stdlib has none today); they are simply
    absent from the manifest, so the corpus hash still describes exactly what was used.
    """
    root = stdlib_dir or default_stdlib_dir()
    entries: list[CorpusFile] = []
    texts: dict[str, str] = {}
    for path in list_source_files(root):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        digest = hashlib.sha256(data).hexdigest()
        entries.append(CorpusFile(rel, digest, len(data), split_of(rel)))
        texts[rel] = text
    return entries, texts


def manifest_hash(entries: list[CorpusFile]) -> str:
    """One sha256 over ``path<TAB>sha256<TAB>split`` lines: the corpus identity in model cards."""
    h = hashlib.sha256()
    for e in entries:
        h.update(f"{e.path}\t{e.sha256}\t{e.split}\n".encode())
    return h.hexdigest()


def build_corpus(out_dir: Path, stdlib_dir: Path | None = None) -> dict:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``manifest.json`` into ``out_dir``.

    Returns the manifest. Each JSONL line is ``{"path": ..., "text": ...}`` in manifest order.
    """
    root = stdlib_dir or default_stdlib_dir()
    entries, texts = read_corpus(root)
    if not entries:
        raise ValueError(f"no eligible *.py files found under stdlib dir {root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for e in entries:
                if e.split == split:
                    f.write(json.dumps({"path": e.path, "text": texts[e.path]}) + "\n")
    manifest = {
        "source": "python-stdlib",
        "python_version": sys.version.split()[0],
        "stdlib_dir": str(root),
        "eval_percent": EVAL_PERCENT,
        "num_files": len(entries),
        "num_bytes": {
            s: sum(e.num_bytes for e in entries if e.split == s) for s in ("train", "eval")
        },
        "total_sha256": manifest_hash(entries),
        "files": [e.__dict__ for e in entries],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_split(corpus_dir: Path, split: str) -> list[str]:
    """Texts of one split, in manifest order; a missing corpus is a clear error."""
    path = corpus_dir / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus split {path} not found; build it with `python -m sgl_spec.models.train corpus`"
        )
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def load_manifest(corpus_dir: Path) -> dict:
    """The manifest written by :func:`build_corpus`."""
    path = corpus_dir / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"corpus manifest {path} not found")
    return json.loads(path.read_text())
