"""The one shape of an sgl-spec speculative algorithm, and its adapter to SGLang's registry.

An algorithm (``mtp/algorithm.py``, ``specblock/algorithm.py``, ``minedraft/algorithm.py``)
says: its name; the settings it builds from our config and SGLang's launch settings (refusing
bad ones with a message naming the flag); the defaults it fills in on the shipped models; the
verify shape SGLang must size its buffers for; and its worker class. The launcher and SGLang's
``handle_server_args`` run the same ``check``. Its command-line flags are the ``FLAGS`` group of its
package's ``flags.py``; ``sgl_spec/algorithm_list.py`` lists the packages.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sgl_spec.argv import LaunchArgs
from sgl_spec.config import SpecConfig

logger = logging.getLogger(__name__)


class Algorithm(ABC):
    """An algorithm registered with SGLang as ``--speculative-algorithm NAME``."""

    name: ClassVar[str]
    # True when the algorithm drafts with --speculative-draft-model-path (a draft LM).
    uses_draft_model: ClassVar[bool] = False
    # True when its draft model's head can be cut to SGLang's --speculative-token-map.
    takes_token_map: ClassVar[bool] = False
    # With a draft LM: SGLang flags it gets on the shipped target (with the shipped draft)
    # where the user gave none.
    shipped_argv: ClassVar[dict[str, str]] = {}
    # The flags of its own that size its drafts, when it has them: SGLang's EAGLE-shape flags
    # (--speculative-num-steps / -eagle-topk / -num-draft-tokens) are then refused, since its
    # verify shape would silently replace them.
    own_draft_shape: ClassVar[str | None] = None
    # Why the algorithm cannot replay CUDA graphs (logged when it turns them off).
    cuda_graph_off_reason: ClassVar[str] = ""
    # Runtime patches the algorithm needs (modules of its package shaped like those of
    # ``sgl_spec/patches/``: TARGET, enabled, check, apply), applied after the shared ones.
    patches: ClassVar[tuple[str, ...]] = ()
    # SGLang's own algorithm this one is served as (SGLang's worker, with our subclasses
    # hooked in by ``patches``): the launcher passes SGLang that name and records the choice
    # with ``mark``. The launch checks and shipped defaults of ours also serve SGLang's.
    runs_as: ClassVar[str | None] = None
    # The parallel sizes it serves above 1 (``tp_size``, ``dp_size``); none: one rank only.
    parallel: ClassVar[frozenset[str]] = frozenset()
    # Why a size it does not serve cannot be served, where the reason is not just "not yet".
    parallel_why: ClassVar[dict[str, str]] = {}
    # This process's config, bound by ``register`` (the plugin entry point) or ``bind``.
    _config: SpecConfig | None = None

    def with_shipped_defaults(self, config: SpecConfig, launch: LaunchArgs) -> SpecConfig:
        """``config`` with this algorithm's defaults for the shipped models, where unset."""
        del launch
        return config

    @abstractmethod
    def settings(self, config: SpecConfig, launch: LaunchArgs) -> Any:
        """The validated settings; ``ValueError`` naming the flag or file otherwise."""

    def check(self, config: SpecConfig, launch: LaunchArgs) -> Any:
        """The launch-time check, run by the launcher before SGLang starts and again by SGLang's
        ``handle_server_args``; returns the settings."""
        if not self.uses_draft_model and launch.draft_model_path is not None:
            raise ValueError(
                f"{self.name} does not draft with a draft model; drop"
                " --speculative-draft-model-path"
            )
        if not self.takes_token_map and launch.token_map is not None:
            raise ValueError(
                f"{self.name} does not draft on a hot vocabulary; drop --speculative-token-map"
            )
        return self.settings(config, launch)

    @abstractmethod
    def verify_shape(self, settings: Any) -> tuple[int, int]:
        """(``speculative_num_steps``, ``speculative_num_draft_tokens``): the deepest accepted
        path and the widest verify block per request, which SGLang sizes its per-step KV
        reservation and verify buffers from."""

    def extra_kv_bytes_per_token(self, settings: Any, dtype: Any) -> int:
        """Bytes the worker keeps per target KV location outside SGLang's pools (a drafter's
        KV, cached target features), which SGLang's KV budget must count; 0 by default."""
        del settings, dtype
        return 0

    def cpu_cores_apart(self, config: Any, launch: Any, environ: dict[str, str]) -> list[int]:
        """With two target ranks or more on a CPU host: the cores processes of its own take
        beside the ranks (which the launcher's per-rank core lists then leave out), recorded in
        ``environ`` for its workers; ``ValueError`` naming the flag if they cannot fit. None
        by default."""
        del config, launch, environ
        return []

    @abstractmethod
    def worker_class(self) -> type:
        """The worker SGLang's scheduler builds around the target worker."""

    def mark(self, config: SpecConfig) -> SpecConfig:
        """With ``runs_as``: ``config`` recording that the launch asked for this algorithm."""
        return config

    def marked(self, config: SpecConfig) -> bool:
        """With ``runs_as``: whether ``config`` records that the launch asked for this
        algorithm (``mark``) rather than for SGLang's own."""
        del config
        return False

    def sglang_argv(self, config: SpecConfig, argv: list[str]) -> list[str]:
        """With ``runs_as``: the SGLang argv the launch passes on, with the SGLang settings this
        algorithm's own choices need (``ValueError`` naming a flag that contradicts them)."""
        del config
        return argv

    def register(self, config: SpecConfig) -> None:
        """Register with SGLang, bound to this process's ``config`` (called once in every
        process by the plugin entry point). One that ``runs_as`` SGLang's own algorithm has
        nothing to register: its ``patches`` hook it in."""
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.bind(config)
        if self.runs_as is not None:
            return
        spec_class = type(f"{type(self).__name__}SpecAlgo", (SglSpecAlgo,), {"algorithm": self})
        SpeculativeAlgorithm.register(self.name, supports_overlap=False, spec_class=spec_class)(
            self.bound_worker
        )

    def bind(self, config: SpecConfig) -> None:
        """Use ``config`` for every setting this process builds (no settings built yet)."""
        self._config = config
        self._built: dict[LaunchArgs, Any] = {}

    def process_settings(self, server_args: Any) -> Any:
        """The settings of the registered config and ``server_args``, built (checked, files
        read) once per process and launch; SGLang's ``handle_server_args`` and the worker
        share them."""
        if self._config is None:
            raise RuntimeError(f"{self.name} has no config: sgl_spec.plugin.register() binds it")
        launch = LaunchArgs.from_server_args(server_args)
        if launch not in self._built:
            self._built[launch] = self.check(self._config, launch)
        return self._built[launch]

    def bound_worker(self, server_args: Any) -> Callable[..., Any]:
        """What SGLang's scheduler instantiates: the worker class with its settings bound."""
        return functools.partial(self.worker_class(), settings=self.process_settings(server_args))


def disable_cuda_graphs(server_args: Any) -> None:
    """Turn CUDA graphs off for decode and prefill. SGLang 0.5.23 resolves its graph settings
    (``cuda_graph_config``) before an algorithm sees the server arguments, so the legacy
    ``disable_cuda_graph`` alone no longer stops the capture: the resolved config is replaced
    by a copy with both phases disabled."""
    import copy

    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig

    config = server_args.cuda_graph_config
    config = copy.deepcopy(config) if isinstance(config, CudaGraphConfig) else CudaGraphConfig()
    config.decode.backend = Backend.DISABLED
    config.prefill.backend = Backend.DISABLED
    server_args.cuda_graph_config = config
    server_args.disable_cuda_graph = True


class SglSpecAlgo(CustomSpecAlgo):
    """SGLang's view of our algorithm: no draft KV pool in SGLang (MTP_LORA drafts with the
    target, SPECBLOCK keeps its drafter's KV in its worker, MINEDRAFT in its draft server)."""

    algorithm: ClassVar[Algorithm]

    def handle_server_args(self, server_args: Any) -> None:
        algorithm = self.algorithm
        require_parallel(algorithm, server_args)
        settings = algorithm.process_settings(server_args)
        num_steps, num_draft_tokens = algorithm.verify_shape(settings)
        server_args.speculative_num_steps = num_steps
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = num_draft_tokens
        if str(server_args.device).startswith("cuda"):
            logger.warning(
                "%s: disabling CUDA graphs (%s)", algorithm.name, algorithm.cuda_graph_off_reason
            )
            disable_cuda_graphs(server_args)
        if not server_args.disable_overlap_schedule:
            # registered with supports_overlap=False: SGLang refuses to start otherwise (its
            # CUDA default is the overlap scheduler; the CPU launcher already turns it off)
            logger.warning(
                "%s: disabling the overlap scheduler (steps run in order)", algorithm.name
            )
            server_args.disable_overlap_schedule = True

    def has_draft_kv(self) -> bool:
        return False

    # Methods SGLang's enum has and its CustomSpecAlgo base lacks (0.5.23).
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> type | None:
        return None

    def create_future_map(self, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return SpeculativeAlgorithm.create_future_map(self, *args, **kwargs)


def unserved_size(algorithm: Algorithm, sizes: dict[str, int]) -> str | None:
    """The first of ``sizes`` (``tp_size``, ``pp_size``, ``dp_size``: value) above 1 that
    ``algorithm`` does not serve, or None."""
    return next((f for f, v in sizes.items() if v != 1 and f not in algorithm.parallel), None)


def require_parallel(algorithm: Algorithm, server_args: Any) -> None:
    """Refuse the tensor / pipeline / data parallelism ``algorithm`` does not serve."""
    sizes = {f: int(getattr(server_args, f, 1) or 1) for f in ("tp_size", "pp_size", "dp_size")}
    flag = unserved_size(algorithm, sizes)
    if flag is not None:
        why = algorithm.parallel_why.get(flag)
        raise ValueError(
            f"{algorithm.name} supports --{flag.replace('_', '-')} 1 only"
            + (f": {why}" if why else "")
        )
