"""Compiled layer stacks for our algorithms' forwards on the CPU engine
(``--enable-torch-compile``).

SGLang's CPU graph runner compiles only a non-speculative decode and refuses a speculative
server (it asserts ``spec_algorithm.is_none()``; patch ``cpu_spec_graphs`` keeps it out of
ours). Here an algorithm names the shapes its forwards take -- (forward mode, batch size,
tokens per request): a verify of each chain width it may pick, a draft model's decode, a plain
decode step -- and each model's layer stack (``model.model.forward``: embeddings, decoder
layers, final norm) is compiled for them at start-up, one graph per shape. A forward of a
captured shape then runs its graph; any other forward runs eager, as before.

Nothing compiles while serving: graphs run under torch's ``fail_on_recompile`` stance, so a call
whose guards do not hold (a shape, a constant of the batch, a mask that differs from the
capture's) raises before the graph runs and is served eager; a shape refused ``MAX_REFUSALS``
times runs eager from then on, with a warning. Only a Llama stack on one CPU rank is compiled
(``cpu_plain_llama.plain_stack``: the stack whose forward has no graph break and whose
arguments are known); any other model runs eager.

Why the layer stack and not the whole ``model.forward``: the logits processor reads the batch's
``spec_info`` and per-step Python values (which rows, which hidden states to keep), which would
fail a compiled graph's guards on every step; it is one GEMM and some indexing, and stays eager.

Each graph compiles its own copy of the forward's code object: dynamo keeps compiled frames per
code object, and with the guards on module attributes skipped (patch ``cpu_graph_guards``: they
cost a sizeable share of a small model's forward to check) a draft model and its target, both
``LlamaModel``, would otherwise share one entry. A module attribute the stack reads per forward
is therefore fixed in its graphs: the one that may change, the layers whose outputs are captured
(``layers_to_capture``), is compared with the capture's on every call; module state an algorithm
sets per step (an adapter's gate) is captured inside the state that shape always runs in
(``around``), and the algorithm serves that shape only in it. ``fullgraph=True``: a
graph break would leave parts of the forward to frames shared between models, so a shape that
does not compile whole stays eager.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo

from sgl_spec.common import capture_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Shape:
    """One captured forward: ``mode`` a ``ForwardMode`` name (``DECODE``, ``TARGET_VERIFY`` or
    ``DRAFT_EXTEND_V2``), ``tokens`` per request (1 for a decode; a verify's or a draft extend's
    width); ``draft_steps``: a decode whose attention backend reads the slots SGLang's
    multi-step draft backend planned for the step (``draft_decode_metadata``) in place of the
    batch's; ``tree``: a verify whose attention reads a tree mask (``custom_mask``, one dynamic
    dimension: its length follows the requests' lengths)."""

    mode: str
    batch_size: int
    tokens: int
    draft_steps: bool = False  # a decode of an EAGLE-style draft loop (the backend's own slots)
    tree: bool = False  # a verify under a tree mask (else a chain, the kernel's causal mask)


def compile_requested(model_runner: Any) -> bool:
    """Whether this runner's server asked for compiled forwards: ``--enable-torch-compile`` on
    a CPU host."""
    from sglang.srt.runtime_context import get_flags

    return model_runner.device == "cpu" and bool(get_flags().capture.enable_torch_compile)


def capture_batch_sizes(model_runner: Any) -> list[int]:
    """The batch sizes SGLang's CPU graph runner would capture (``--cuda-graph-bs-decode``,
    bounded by ``--torch-compile-max-bs`` and the request pool)."""
    from sglang.srt.model_executor.cpu_graph_runner import get_batch_sizes_to_capture

    return get_batch_sizes_to_capture(model_runner)


def forward_shapes(
    batch_sizes: Iterable[int],
    widths: Iterable[int],
    decode: bool,
    draft_steps: bool = False,
    tree: bool = False,
) -> list[Shape]:
    """A decode per batch size (``decode``), a draft loop's decode per batch size
    (``draft_steps``) and a verify per batch size and width (a chain, or under a tree mask)."""
    sizes = list(batch_sizes)
    shapes = [Shape("TARGET_VERIFY", bs, n, tree=tree) for bs in sizes for n in widths if n > 1]
    shapes += [Shape("DECODE", bs, 1) for bs in sizes if decode]
    shapes += [Shape("DECODE", bs, 1, draft_steps=True) for bs in sizes if draft_steps]
    return sorted(set(shapes))


def _own_code(bound: Callable, tag: str) -> Callable:
    """``bound`` (a bound method) with its own copy of the function's code object."""
    func = bound.__func__
    code = func.__code__.replace(co_name=f"{func.__code__.co_name}__{tag}")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__,
                              func.__closure__)  # fmt: skip
    copy.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy, bound.__self__)


def _shape_of(input_ids: torch.Tensor, forward_batch: Any) -> Shape | None:
    from sglang.srt.model_executor.forward_context import get_forward_context

    bs = forward_batch.batch_size
    if bs <= 0 or input_ids is None or input_ids.shape[0] % bs:
        return None
    backend = get_forward_context().attn_backend
    steps = getattr(backend, "draft_decode_metadata", None) is not None
    mode = forward_batch.forward_mode
    extend = getattr(backend, "extend_metadata", None) if mode.is_target_verify() else None
    tree = extend is not None and extend[3] is not None  # (lens..., tree_mask)
    return Shape(mode.name, bs, input_ids.shape[0] // bs, steps, tree)


_RECOMPILE = "Detected recompile"  # the start of the error torch's fail_on_recompile raises
MAX_REFUSALS = 4  # calls of a shape its graph's guards may refuse before it runs eager for good


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with the strides of a fresh tensor of its shape (the capture's): a graph guards on
    strides, and a draft step's slots are a column of a [batch, steps] table."""
    if t is None:
        return t
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.new_empty(t.shape).copy_(t)


class CompiledStack:
    """One model's layer stack with its captured graphs; installed as the stack's ``forward``
    (``install``), where the model's own forward calls it.

    ``around(shape)``: the state a shape's forwards always run in (a gated adapter's gate for a
    verify of its width), entered around its capture. A module attribute the graph reads is
    fixed in it and not guarded (module guards are skipped), so the caller must serve that shape
    only in that state."""

    def __init__(
        self,
        model_runner: Any,
        name: str,
        width_per_backend: bool = False,
        around: Callable[[Shape], AbstractContextManager] | None = None,
    ) -> None:
        self.runner = model_runner
        self.name = name
        self.around = around or (lambda shape: contextlib.nullcontext())
        # each verify width served by an attention backend planned for it (SGLang's runtime
        # states per step count): a verify's width is a constant of its graph, as that backend
        # has it; else the one backend's width, the server's, for every verify
        self.width_per_backend = width_per_backend
        self.stack = model_runner.model.model
        self.eager = self.stack.forward  # the class's forward, bound
        self.graphs: dict[Shape, Callable] = {}
        self.captured_layers = _captured_layers(self.stack)
        self.served: set[Shape] = set()
        self.refusals: dict[Shape, int] = {}

    def capture(self, shapes: Iterable[Shape]) -> None:
        """Compile and run one graph per shape (a shape that does not compile whole is logged
        and left eager)."""
        from sglang.srt.model_executor import cpu_graph_runner
        from sglang.srt.runtime_context import get_parallel

        cpu_graph_runner.register_fake_ops(get_parallel().tp_size)
        cpu_graph_runner.set_torch_compile_config()
        tic = time.perf_counter()
        for shape in shapes:
            try:
                self.graphs[shape] = self._capture_one(shape)
            except Exception as exc:  # a shape that cannot compile runs eager
                logger.warning("%s: %s stays eager, its compile failed: %s", self.name, shape,
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
        logger.info("%s: compiled %d forward shape(s) in %.1f s: %s", self.name, len(self.graphs),
                    time.perf_counter() - tic, ", ".join(map(_label, sorted(self.graphs))))  # fmt: skip

    def _capture_one(self, shape: Shape) -> Callable:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        runner, backend = self.runner, self.runner.attn_backend
        fb = capture_batches.capture_batch(runner, shape)
        width = getattr(backend, "num_draft_tokens", None)
        if shape.mode == "TARGET_VERIFY" and self.width_per_backend:
            backend.num_draft_tokens = shape.tokens
        tag = "_".join(map(str, (self.name, shape.mode, shape.batch_size, shape.tokens,
                                 int(shape.draft_steps), int(shape.tree))))  # fmt: skip
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        graph = torch.compile(_own_code(self.eager, tag), dynamic=False, fullgraph=True,
                              options=options)  # fmt: skip
        try:
            with (
                torch.no_grad(),
                self.around(shape),
                forward_context(ForwardContext(attn_backend=backend), forward_batch=fb),
            ):
                backend.init_forward_metadata(fb)
                if shape.draft_steps:
                    backend.draft_decode_metadata = capture_batches.draft_step_metadata(backend, fb)
                self.eager(fb.input_ids, fb.positions, fb)  # modules resolve their ops eagerly
                for _ in range(2):
                    graph(fb.input_ids, fb.positions, fb)
        finally:
            backend.num_draft_tokens = width
            if shape.draft_steps:
                backend.draft_decode_metadata = None
        return graph

    def _refused(self, shape: Shape, exc: BaseException) -> None:
        self.refusals[shape] = self.refusals.get(shape, 0) + 1
        logger.debug("%s: %s refused: %s", self.name, _label(shape), _reason(exc))
        if self.refusals[shape] >= MAX_REFUSALS:
            del self.graphs[shape]
            logger.warning("%s: %s served eager from now on, its guards failed %d times: %s",
                           self.name, _label(shape), MAX_REFUSALS, _reason(exc))  # fmt: skip

    def install(self) -> None:
        if self.graphs:
            self.stack.forward = self  # an instance attribute: nn.Module.__call__ reaches it

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any, *args, **kwargs
    ) -> Any:
        graph = None
        plain = all(a is None for a in args) and all(v is None for v in kwargs.values())
        if plain and _captured_layers(self.stack) == self.captured_layers:
            shape = _shape_of(input_ids, forward_batch)
            graph = self.graphs.get(shape)
        if graph is None:
            return self.eager(input_ids, positions, forward_batch, *args, **kwargs)
        input_ids, positions = _dense(input_ids), _dense(positions)
        forward_batch.out_cache_loc = _dense(forward_batch.out_cache_loc)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = graph(input_ids, positions, forward_batch)
        except RuntimeError as exc:
            if not str(exc).startswith(_RECOMPILE):
                raise
            # the guards refused this call before the graph ran: serve it eager. A state set up
            # by a module's first eager call (an attention backend of another verify width
            # caches what it learnt of its pool) passes them the next time; a shape refused
            # MAX_REFUSALS times runs eager from then on.
            self._refused(shape, exc)
            return self.eager(input_ids, positions, forward_batch, *args, **kwargs)
        if shape not in self.served:
            self.served.add(shape)
            logger.info("%s: first forward on the compiled graph of %s", self.name, _label(shape))
        return out


def _captured_layers(stack: Any) -> tuple:
    return tuple(getattr(stack, "layers_to_capture", ()) or ())


def _reason(exc: BaseException) -> str:
    """The guard failures torch names in a fail_on_recompile error (its first lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("-") or "guard" in line.lower()]
    return " | ".join((failed or lines)[:4])


def _label(shape: Shape) -> str:
    kind = "draft-step decode" if shape.draft_steps else shape.mode.lower()
    kind += " (tree)" if shape.tree else ""
    return f"{kind} bs={shape.batch_size} n={shape.tokens}"


def _compilable(model_runner: Any, name: str) -> bool:
    """A Llama stack on one CPU rank (``plain_stack``), and the torch whose refusal this module
    reads (``_RECOMPILE``); else a log line and eager forwards."""
    import inspect

    from sgl_spec.patches.cpu_plain_llama import plain_stack

    stack = getattr(model_runner.model, "model", None)
    if stack is None or not hasattr(stack, "layers") or not plain_stack(stack):
        logger.info("%s: forwards stay eager (compiled: a Llama on one CPU rank only)", name)
        return False
    if _RECOMPILE not in inspect.getsource(torch._dynamo.eval_frame):
        logger.warning(
            "%s: forwards stay eager: this torch's fail_on_recompile error differs", name
        )
        return False
    return True


@contextlib.contextmanager
def unscoped() -> Iterator[None]:
    """Without the scoped parallel overrides active here (a draft worker's ``draft_tp_context``,
    around SGLang's call of its graph capture): a graph guards on them (how many there are), and
    on one rank, the only case compiled, the forwards it serves see none."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    saved = parallel._overrides
    parallel._overrides = {}
    try:
        yield
    finally:
        parallel._overrides = saved


def compile_stacks(
    model_runner: Any,
    name: str,
    shapes: Iterable[Shape],
    width_per_backend: bool = False,
    around: Callable[[Shape], AbstractContextManager] | None = None,
) -> CompiledStack | None:
    """Compile ``model_runner``'s layer stack for ``shapes`` where the server asked for
    compiled forwards (``compile_requested``); ``None`` elsewhere, or where the model has no
    layer stack at ``model.model``. Captured outside the caller's scoped parallel overrides
    (``unscoped``), as on one rank both the target and a draft model are served.
    ``width_per_backend``, ``around``: see ``CompiledStack``."""
    if not compile_requested(model_runner) or not _compilable(model_runner, name):
        return None
    shapes = list(shapes)
    logger.info("%s: compiling %d forward shape(s) for batch sizes %s (--cuda-graph-bs-decode)",
                name, len(shapes), sorted({s.batch_size for s in shapes}))  # fmt: skip
    compiled = CompiledStack(model_runner, name, width_per_backend, around)
    with unscoped():
        compiled.capture(shapes)
    compiled.install()
    return compiled
