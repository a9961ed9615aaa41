"""Every change sgl-spec makes to upstream SGLang's behaviour, listed and applied in one place.

One module per upstream target (here, or in the package of the algorithm that needs it, listed by
its ``Algorithm.patches``); each names the SGLang module it changes in ``TARGET``, says
why in its docstring, says whether our config wants it (``enabled(config)``), checks that the
installed SGLang still has the shape it was written against (``check()``; ``SGLANG_VERSION``)
and applies itself (``apply()``). ``apply_patches`` runs each enabled patch's check first and
refuses to start, naming the patch, on an SGLang whose patched code differs.
``docs/patches.md`` is generated from these modules (``python -m sgl_spec.patches``).

The one change that cannot wait for the plugin: ``sgl_spec/cpu_kernels/boot.py``, installed as a
``.pth`` start-up hook, because SGLang imports ``sgl_kernel`` before any plugin runs.
"""

from __future__ import annotations

import logging

from sgl_spec.config import SpecConfig

logger = logging.getLogger(__name__)

# The SGLang release every patch's check() was written against (pyproject pins it).
SGLANG_VERSION = "0.5.23"


# Every patch module, in the order they are applied.
PATCHES = (
    "cpu_graph_fakes",
    "cpu_packed_linear",
    "cpu_spec_sampling",
    "cuda_optional_kernels",
    "prompt_validation",
    "spec_penalties",
    "spec_row_headroom",
    "worker_kv_budget",
    "spec_internals",
    "cpu_tensor_parallel",
    "cpu_attention_store",
    "cpu_eager_draft_select",
    "cpu_plain_llama",
    "cpu_kv_split",
    "cpu_graph_guards",
    "cpu_spec_graphs",
)


def all_patches() -> list:
    """The shared patches (``PATCHES``), then those each algorithm declares for itself
    (``Algorithm.patches``: modules of the same shape inside its package)."""
    import importlib

    from sgl_spec.algorithms import all_algorithms

    names = [f"sgl_spec.patches.{name}" for name in PATCHES]
    names += [module for algorithm in all_algorithms() for module in algorithm.patches]
    return [importlib.import_module(name) for name in names]


def patch_name(patch) -> str:
    """How a patch module is named in logs, errors and docs: below ``sgl_spec.patches`` for a
    shared one, below ``sgl_spec`` for an algorithm's own (``standalone.hook``)."""
    return patch.__name__.removeprefix("sgl_spec.patches.").removeprefix("sgl_spec.")


class PatchMismatch(RuntimeError):
    """The installed SGLang differs where a patch changes it."""


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def apply_patches(config: SpecConfig) -> list[str]:
    applied: list[str] = []
    for patch in all_patches():
        if not patch.enabled(config):
            continue
        name = patch_name(patch)
        try:
            patch.check()
        except Exception as exc:
            raise PatchMismatch(
                f"sgl-spec: patch {name} was written for SGLang {SGLANG_VERSION}, and the"
                f" installed SGLang {installed_sglang_version()} differs where it changes"
                f" {patch.TARGET}: {exc}. Install sglang=={SGLANG_VERSION}."
            ) from exc
        if patch.apply():
            applied.append(name)
    if applied:
        logger.info("sgl_spec: applied patches %s", ", ".join(applied))
    return applied


def patches_markdown() -> str:
    """``docs/patches.md``: every upstream change, from the patch modules themselves."""
    lines = [
        "# Changes to upstream SGLang",
        "",
        f"Written and checked against SGLang {SGLANG_VERSION}. Generated from"
        " `sgl_spec/patches/` (`python -m sgl_spec.patches > docs/patches.md`). Each patch's"
        " `check()` runs before it is applied, and the server refuses to start if the installed"
        " SGLang differs where the patch changes it; `tests/unit/test_patches.py` runs every check.",
        "",
        # the upstream-ready source diffs of the same changes (tests/unit/test_patch_diffs.py)
        "The same changes as source diffs against that release, written to be proposed upstream,"
        " are in the repository's `patches/` folder (`patches/README.md`).",
        "",
        "| patch | upstream target | what and why |",
        "| --- | --- | --- |",
    ]
    for patch in all_patches():
        targets = patch.TARGET if isinstance(patch.TARGET, tuple) else (patch.TARGET,)
        summary = " ".join(patch.__doc__.split("\n\n")[0].split()).removeprefix("Patch: ")
        summary = summary[:1].upper() + summary[1:]
        name = patch_name(patch)
        lines.append(f"| `{name}` | {', '.join(f'`{t}`' for t in targets)} | {summary} |")
    lines.append(
        "| `cpu_kernels/boot.py` (start-up hook) | `sgl_kernel.load_utils`,"
        " `sglang.srt.utils.common.cpu_has_amx_support` | Lets the published `sgl_kernel`"
        " import where its compiled library cannot load, registering our PyTorch ops in its"
        " place, and lets SGLang's CPU kernel paths run on CPUs without AMX. Installed as a"
        " `.pth` hook because SGLang imports `sgl_kernel` before any plugin runs. |"
    )
    return "\n".join(lines) + "\n"
