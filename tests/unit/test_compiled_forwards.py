"""Compiled layer stacks for our algorithms' forwards (``sgl_spec/common/compiled_forwards.py``,
``--enable-torch-compile`` on CPU): the shapes each algorithm asks for, and a stack compiled for
a decode, a chain verify and a tree verify that serves those shapes bit-identically to the eager
stack at other lengths, KV slots and tree-mask lengths (a strided slot column included), leaves
other shapes and calls its guards refuse to the eager stack, and compiles nothing after
capture."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_spec.common.compiled_forwards import Shape, _dense, _reason, forward_shapes
from sgl_spec.control.chain_steps import chain_widths
from sgl_spec.models.registry import DEFAULT_DRAFT, resolve_model_path
from tests.helpers.model_check import run_check
from tests.helpers.native_kernels import require_native


def test_forward_shapes_name_each_width_decode_and_draft_step_once() -> None:
    shapes = forward_shapes([1, 2], [1, 3, 2, 3], decode=True, draft_steps=True)
    assert shapes == sorted(set(shapes))
    assert Shape("TARGET_VERIFY", 2, 3) in shapes and Shape("TARGET_VERIFY", 1, 2) in shapes
    assert not any(s.mode == "TARGET_VERIFY" and s.tokens == 1 for s in shapes)
    assert Shape("DECODE", 1, 1) in shapes and Shape("DECODE", 2, 1, draft_steps=True) in shapes
    assert len(shapes) == 2 * 2 + 2 + 2
    assert forward_shapes([4], [], decode=False) == []


@pytest.mark.parametrize(
    ("mode", "widths", "decode"),
    [("fixed", [4], False), ("off", [], True), ("auto", [2, 3, 4], True),
     ("cycle", [2, 3, 4], True)],
)  # fmt: skip
def test_chain_widths_follow_the_step_policy(mode, widths, decode) -> None:
    assert chain_widths(mode, 3) == (widths, decode)


def test_dense_copies_only_strided_tensors() -> None:
    table = torch.arange(12).view(4, 3)
    column = table[:, 1]
    dense = _dense(column)
    assert column.stride() == (3,) and dense.stride() == (1,)
    assert torch.equal(dense, column)
    assert _dense(table) is table and _dense(None) is None
    assert _dense(table[:1, 0]).stride() == (1,)  # one element, stride 3: guards still differ


def test_reason_names_the_failed_guards() -> None:
    exc = RuntimeError("Detected recompile when ...\ntriggered by the following guard failure(s):"
                       "\n  - 0/0: tensor 'x' size mismatch\nmore")  # fmt: skip
    assert "size mismatch" in _reason(exc)


def test_only_a_llama_stack_on_one_rank_compiles() -> None:
    from sgl_spec.common.compiled_forwards import _compilable

    no_stack = SimpleNamespace(model=SimpleNamespace())
    other = SimpleNamespace(model=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    assert not _compilable(no_stack, "target") and not _compilable(other, "target")


def test_only_our_algorithms_skip_sglangs_cpu_graph_runner() -> None:
    from sgl_spec.patches.cpu_spec_graphs import ours

    def runner(name: str) -> SimpleNamespace:
        algorithm = SimpleNamespace(name=name, is_none=lambda: name == "NONE")
        return SimpleNamespace(spec_algorithm=algorithm)

    assert ours(runner("SPECBLOCK")) and ours(runner("MTP_LORA"))
    assert not ours(runner("NONE")) and not ours(runner("NGRAM")) and not ours(runner("EAGLE"))
    assert not ours(runner("STANDALONE"))  # SGLang's own, unless the launch asked for _FULL


def test_compiled_stack_serves_its_shapes_and_nothing_else(tmp_path: Path) -> None:
    require_native()
    result = run_check("compiled_forwards_check.py", resolve_model_path(DEFAULT_DRAFT), tmp_path)
    assert result["captured"] == ["DECODE:1:0", "TARGET_VERIFY:3:0", "TARGET_VERIFY:3:1"]
    first = [result["verify_20"], result["tree_20"], result["decode_20"]]
    later = [result["verify_33"], result["tree_33"], result["decode_33"]]  # another mask length
    assert all(r["equal"] for r in first + later)
    assert [r["newly_served"] for r in first + later] == [1, 1, 1, 0, 0, 0]
    assert result["other_width"] == {"equal": True, "newly_served": 0}
    assert result["refused"]["equal"] and result["refusals"] == 1
    assert result["new_graphs_while_serving"] == 0
