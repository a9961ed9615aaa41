"""The base of our speculative workers: SGLang's scheduler talks to it as to a target worker.

SGLang builds the worker around its target worker (``(server_args, gpu_id, nccl_port,
target_worker)``). Every scheduler-facing method we do not implement is the target worker's;
there is no SGLang draft worker (drafts come from the target's gated LoRA, a drafter held here,
or a draft-server process).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative import eagle_utils
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sgl_spec.common import compiled_forwards
from sgl_spec.common.draft_input import CarriedDraftInput
from sgl_spec.common.metrics import SpecMetrics
from sgl_spec.control.step_times import StepClock

logger = logging.getLogger(__name__)


def backend_mask_mode(attn_backend: Any, default: Any = None) -> Any:
    """The tree-mask layout ``attn_backend`` reads: its verify mask's, else ``default`` (None:
    SGLang's EAGLE default, ``eagle_utils.default_tree_mask_mode``)."""
    verify_mask = getattr(attn_backend, "verify_mask", None)
    if verify_mask is not None:
        return verify_mask.mode
    return eagle_utils.default_tree_mask_mode() if default is None else default


class TargetWrappingWorker(BaseSpecWorker):
    # The algorithm's name, for errors.
    name: str = "?"
    # The speculation controller (``sgl_spec.control``) choosing each step's setting, if any.
    controller: Any = None

    def __init__(self, server_args: Any, target_worker: Any) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        self.tree_mask_mode = eagle_utils.default_tree_mask_mode()
        self.metrics = SpecMetrics(self.name, server_args)
        self._clock = StepClock()

    def init_cuda_graphs(self) -> None:
        """SGLang's (no draft worker of its own: nothing), then the target's compiled forwards
        where the launch asked for them (``--enable-torch-compile`` on CPU; ``compiled_shapes``):
        here the pools and attention backends exist."""
        super().init_cuda_graphs()
        runner = self.model_runner
        if not compiled_forwards.compile_requested(runner):
            return
        shapes = self.compiled_shapes(compiled_forwards.capture_batch_sizes(runner))
        if shapes:
            compiled_forwards.compile_stacks(runner, "target", shapes, around=self.compiled_state)
        else:
            logger.info("%s: --enable-torch-compile compiles none of its forwards", self.name)

    def compiled_shapes(self, batch_sizes: list[int]) -> list[compiled_forwards.Shape]:
        """The target forwards this algorithm runs that are compiled at start-up, at each of
        ``batch_sizes``; none unless the algorithm says (a forward whose modules change state
        per call must be compiled only where ``compiled_state`` fixes it per shape)."""
        del batch_sizes
        return []

    def compiled_state(self, shape: compiled_forwards.Shape) -> contextlib.AbstractContextManager:
        """The module state every forward of ``shape`` runs in, entered around its capture
        (a graph fixes what the modules read): none here."""
        del shape
        return contextlib.nullcontext()

    def set_verify_shape(self, num_steps: int, num_draft_tokens: int) -> None:
        """What SGLang's speculative infrastructure reads off the worker: the deepest accepted
        path and the verify width per request (``Algorithm.verify_shape``); top-k 1."""
        self.speculative_num_steps = num_steps
        self.speculative_num_draft_tokens = num_draft_tokens
        self.topk = 1

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        """SGLang's entry point: a prefill (EXTEND) or a speculative decode step (DECODE)."""
        del kwargs
        if batch.forward_mode.is_extend():
            tic = time.perf_counter()
            result = self.forward_prefill(batch)
            if self.controller is not None:
                # each request's prefill costs the same whatever setting the decode steps ran:
                # left out of the decode step it follows, timed up to the next one (``StepClock``)
                self._clock.exclude(time.perf_counter() - tic)
            return result
        if batch.forward_mode.is_decode():
            return self.forward_decode(batch)
        raise RuntimeError(
            f"{self.name} expected an EXTEND or DECODE batch, got {batch.forward_mode}"
        )

    def forward_prefill(self, batch: Any) -> Any:
        raise NotImplementedError

    def prefill_target(
        self,
        batch: Any,
        carried: Callable[[torch.Tensor, torch.Tensor], CarriedDraftInput],
        capture_hidden: bool = False,
    ) -> Any:
        """SGLang's plain target extend of ``batch``, with the state a decode step starts from:
        the committed lengths, and ``carried(sampled ids, seq_lens)`` where the batch sampled
        (not the non-final chunk of a chunked prefill). ``capture_hidden`` keeps every row's
        hidden states in ``result.logits_output.hidden_states`` for the caller."""
        if capture_hidden:
            result = self._target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
        else:
            result = self._target_worker.forward_batch_generation(batch)
        result.new_seq_lens = batch.seq_lens
        if isinstance(result.next_token_ids, torch.Tensor):
            result.next_draft_input = carried(result.next_token_ids, batch.seq_lens)
        return result

    def forward_decode(self, batch: Any) -> Any:
        raise NotImplementedError

    def step_started(self, batch: Any, now: float) -> None:
        """At the start of a decode step: the controller learns what the previous step cost
        the server, up to now (``StepClock``: the scheduler's work on its output included)."""
        if self.controller is None:
            return
        self._clock.start(tuple(req.rid for req in batch.reqs), now, self.controller)

    def step_excludes(self, seconds: float) -> None:
        """Work of this step the controller should not count as its setting's cost
        (``StepClock.exclude``)."""
        if self.controller is not None:
            self._clock.exclude(seconds)
            self.controller.prices.switched(seconds)  # a probe's cost all the same

    def step_chosen(self, k: int, batch_size: int) -> None:
        """The controller's setting ``k`` for the step ``step_started`` began."""
        self._clock.chosen(k, batch_size)

    def __getattr__(self, name: str) -> Any:
        if name == "_target_worker":  # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    @property
    def draft_worker(self) -> None:
        return None

    def mask_mode(self) -> Any:
        """The tree-mask layout the attention backend reads (``TreeMaskMode``)."""
        return backend_mask_mode(self.model_runner.attn_backend, self.tree_mask_mode)

    def capture_layer_outputs(self, layer_ids: tuple[int, ...], width: int) -> torch.Tensor:
        """Ask the target for the outputs of ``layer_ids`` (hidden size ``width``) as EAGLE-3
        does; SGLang captures each layer once, in layer order, so repeated ids are re-expanded
        by the returned column index into the captured hidden states."""
        unique = sorted(set(layer_ids))
        self.model_runner.model.set_eagle3_layers_to_capture(unique)
        index = [unique.index(i) * width + j for i in layer_ids for j in range(width)]
        return torch.tensor(index, dtype=torch.long, device=self.device)
