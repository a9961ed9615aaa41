"""The upstream-ready diffs in ``patches/``: one per behaviour-changing runtime patch (the
shared ones and those algorithms declare, ``all_patches()``, then the start-up hook), each
touching the modules its patch names in ``TARGET``, each applying cleanly (alone and as a
series) to the pinned SGLang's files, the result still compiling.

The installed SGLang's files are the pristine base: runtime patches never rewrite files on
disk. Diffs are applied with ``git apply`` in a scratch git repository of copies.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from sgl_spec.patches import SGLANG_VERSION, all_patches, installed_sglang_version, patch_name

ROOT = Path(__file__).resolve().parents[2]
DIFF_DIR = ROOT / "patches"
DIFF_NAME = re.compile(r"^(\d{4})-([a-z0-9]+(?:-[a-z0-9]+)*)\.diff$")
FILE_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)

# Runtime patches that change no behaviour, so have no diff, and why.
NO_DIFF = {
    "spec_internals": "check-only: apply() installs nothing, it checks internals we lean on",
}
# Start-up hooks outside the patch list whose SGLang part has a diff (numbered last).
HOOKS = ("sgl_spec.cpu_kernels.boot",)
# Modules a patch targets that its diff leaves alone, and why.
UNTOUCHED_TARGETS = {
    ("spec_row_headroom", "sglang.srt.mem_cache.kv_cache_configurator"): (
        "it only imports get_req_to_token_extra_context_len by name: the runtime patch rebinds"
        " it there, a source change needs only the definition"
    ),
    ("cpu_kernels.boot", "sgl_kernel.load_utils"): "sgl_kernel is not SGLang: no diff for it",
    ("cpu_packed_linear", "sglang.srt.layers.logits_processor"): (
        "the LM head on the packed weight (cpu_packed_lm_head.py) is not in the diff yet: it"
        " carries the linear layers' mkl kind only"
    ),
}
# Modules a diff touches beyond its patch's TARGET, and why.
EXTRA_TOUCHED = {
    ("cuda_optional_kernels", "sglang.srt.speculative.eagle_worker_v2"): (
        "the runtime patch stands in for flashmla_backend in sys.modules (FLASHMLA_BACKEND,"
        " not in its TARGET); upstream guards that import where the draft graph capture makes it"
    ),
}


def sglang_root() -> Path:
    """The directory holding the installed ``sglang`` package (site-packages)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None, "sglang is not installed"
    return Path(spec.origin).parent.parent


def diff_paths() -> list[Path]:
    return sorted(DIFF_DIR.glob("*.diff"))


@functools.cache
def runtime_changes() -> dict[str, ModuleType]:
    """Every runtime patch and start-up hook by name, in the order their diffs are numbered."""
    modules = [*all_patches(), *(importlib.import_module(hook) for hook in HOOKS)]
    return {patch_name(module): module for module in modules}


def diff_stem(name: str) -> str:
    """``standalone.hook`` -> ``standalone-hook`` (the diff's name after its number)."""
    return name.replace("_", "-").replace(".", "-")


def owner(diff: Path) -> str:
    """The name of the runtime change a diff belongs to."""
    match = DIFF_NAME.match(diff.name)
    assert match, f"{diff.name}: expected NNNN-<patch-name>.diff"
    by_stem = {diff_stem(name): name for name in runtime_changes()}
    assert match.group(2) in by_stem, f"{diff.name} names no runtime patch"
    return by_stem[match.group(2)]


def header(text: str) -> str:
    """The text before the first file of a diff (which ``git apply`` skips)."""
    return text.split("diff --git ", 1)[0]


def touched_files(text: str) -> list[str]:
    """The files a diff changes, relative to site-packages."""
    files = []
    for old, new in FILE_HEADER.findall(text):
        assert old == new, f"rename {old} -> {new}"
        files.append(old)
    return files


def required_diffs(text: str) -> list[str]:
    """File names of the diffs this one needs applied first (its ``Requires:`` line)."""
    line = next(ln for ln in header(text).splitlines() if ln.startswith("Requires:"))
    value = line.removeprefix("Requires:").strip()
    return [] if value == "none" else [f"{name.strip()}.diff" for name in value.split(",")]


def expected_diffs() -> list[str]:
    """One diff per behaviour-changing runtime change, numbered in order from 0001."""
    names = [name for name in runtime_changes() if name not in NO_DIFF]
    return [f"{i:04d}-{diff_stem(name)}" for i, name in enumerate(names, start=1)]


def targets(name: str) -> set[str]:
    """The modules a runtime change names as its targets; for the start-up hook, the modules
    its import finder wraps (the keys of its ``_PATCHES``)."""
    module = runtime_changes()[name]
    target = module.TARGET if hasattr(module, "TARGET") else tuple(module._PATCHES)
    return set(target) if isinstance(target, tuple) else {target}


def runtime_module(name: str) -> str:
    return runtime_changes()[name].__name__.replace(".", "/") + ".py"


def git(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=False)


def apply(tree: Path, diff: Path) -> None:
    """``git apply --check`` then ``git apply``; fails the test with git's message."""
    for args in (("--check",), ()):
        done = git(tree, "apply", *args, "--whitespace=error", str(diff))
        assert done.returncode == 0, f"{diff.name} does not apply cleanly:\n{done.stderr}"


def pristine_tree(tree: Path, files: list[str]) -> Path:
    """``tree`` as a scratch git repository holding copies of the installed ``files``; its
    own repository, so that ``git apply`` takes the diff's paths relative to it."""
    tree.mkdir(parents=True, exist_ok=True)
    assert git(tree, "init", "-q").returncode == 0
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sglang_root() / rel, tree / rel)
    return tree


def assert_changed_and_compiles(tree: Path, files: list[str]) -> None:
    for rel in files:
        source = (tree / rel).read_text()
        assert source != (sglang_root() / rel).read_text(), f"{rel} is unchanged"
        compile(source, str(tree / rel), "exec")  # raises SyntaxError on a broken result


@pytest.fixture
def pinned_sglang() -> None:
    """The diffs are written against the pinned release; another one is no pristine base."""
    installed = installed_sglang_version()
    if installed != SGLANG_VERSION:
        pytest.skip(
            f"installed sglang {installed} is not the pinned {SGLANG_VERSION} the diffs in"
            " patches/ are written against"
        )


def test_installed_sglang_is_the_pinned_release(pinned_sglang: None) -> None:
    assert installed_sglang_version() == SGLANG_VERSION


def test_every_behaviour_changing_patch_has_exactly_one_diff() -> None:
    for diff in diff_paths():
        owner(diff)  # fails for a diff that names no runtime patch
    assert [diff.stem for diff in diff_paths()] == expected_diffs()
    assert set(NO_DIFF) <= set(runtime_changes()), "NO_DIFF names a patch that is gone"


def test_each_diff_header_names_its_patch_and_requirements() -> None:
    names = [diff.name for diff in diff_paths()]
    for diff in diff_paths():
        text = diff.read_text()
        head, name = header(text), owner(diff)
        assert len(head.split()) > 30, f"{diff.name}: the header says what and why"
        assert f"Runtime module: {runtime_module(name)}" in head, diff.name
        assert (ROOT / runtime_module(name)).is_file(), diff.name
        for required in required_diffs(text):
            assert required in names[: names.index(diff.name)], f"{diff.name}: {required}"


def test_each_diff_touches_its_patch_targets() -> None:
    used = set()
    for diff in diff_paths():
        name = owner(diff)
        wanted = targets(name)
        touched = set()
        for rel in touched_files(diff.read_text()):
            assert rel.startswith("sglang/") and rel.endswith(".py"), f"{diff.name}: {rel}"
            module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            touched.add(module)
        extra = {m for m in touched - wanted if (name, m) in EXTRA_TOUCHED}
        assert touched - wanted == extra, f"{diff.name} touches modules outside TARGET"
        skipped = {m for m in wanted - touched if (name, m) in UNTOUCHED_TARGETS}
        assert wanted - touched == skipped, f"{diff.name} leaves TARGET modules untouched"
        used |= {(name, m) for m in extra | skipped}
    stale = (set(EXTRA_TOUCHED) | set(UNTOUCHED_TARGETS)) - used
    assert not stale, f"exceptions no diff needs any more: {sorted(stale)}"


@pytest.mark.parametrize("diff", diff_paths(), ids=lambda diff: diff.stem)
def test_each_diff_applies_to_pristine_sglang(
    diff: Path, tmp_path: Path, pinned_sglang: None
) -> None:
    """Alone, after only the diffs it requires."""
    series = [DIFF_DIR / name for name in required_diffs(diff.read_text())] + [diff]
    files = sorted({rel for d in series for rel in touched_files(d.read_text())})
    tree = pristine_tree(tmp_path / "tree", files)
    for each in series:
        apply(tree, each)
    assert_changed_and_compiles(tree, touched_files(diff.read_text()))


def test_the_series_applies_in_order(tmp_path: Path, pinned_sglang: None) -> None:
    diffs = diff_paths()
    files = sorted({rel for diff in diffs for rel in touched_files(diff.read_text())})
    tree = pristine_tree(tmp_path / "tree", files)
    for diff in diffs:
        apply(tree, diff)
    assert_changed_and_compiles(tree, files)


def test_a_diff_whose_context_differs_is_refused(tmp_path: Path, pinned_sglang: None) -> None:
    """The apply check can fail: one context line of a diff changed, git refuses it."""
    diff = diff_paths()[0]
    lines = diff.read_text().splitlines(keepends=True)
    first_hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    context = next(i for i in range(first_hunk, len(lines)) if lines[i].startswith(" "))
    lines[context] = " # a line pristine SGLang does not have\n"
    broken = tmp_path / diff.name
    broken.write_text("".join(lines))
    tree = pristine_tree(tmp_path / "tree", touched_files(broken.read_text()))
    with pytest.raises(AssertionError, match="does not apply cleanly"):
        apply(tree, broken)
