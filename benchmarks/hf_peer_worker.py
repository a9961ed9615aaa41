"""The worker of ``hf_peer.py``: one measurement of a Hugging Face transformers peer, run as
``python benchmarks/hf_peer_worker.py SPEC.json OUT.json`` in a fresh process.

What it measures and why it is set up so (threads, EOS, prompts, warm-up): ``hf_peer.py``'s
docstring. It writes raw per-request timings; ``hf_peer.parse_peer_result`` turns them into
bench_serving's metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
ASSISTANT_SETTINGS = (
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
)


def peer_cores(environ: dict[str, str], affinity: set[int]) -> list[int]:
    """The cores SGLang's CPU server binds: the first group of ``SGLANG_CPU_OMP_THREADS_BIND``
    ("0-3,6|..."), or, unset, the process's affinity (node 0 of a one-node host)."""
    bind = environ.get(BIND_ENV, "").strip()
    if not bind or bind == "all":
        return sorted(affinity)
    cores: list[int] = []
    for part in filter(None, bind.split("|")[0].replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


class FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated tokens arrive
    (``put`` gets the prompt first, then each step's new tokens)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: object) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def generate(
    target: PreTrainedModel, draft: PreTrainedModel | None, ids: list[int], new_tokens: int
) -> tuple[list[int], float, float]:
    """One greedy request: its new ids, time to first token and end-to-end time (s)."""
    import torch

    input_ids = torch.tensor([ids], device=target.device)
    clock = FirstTokenClock()
    extra = {"assistant_model": draft} if draft is not None else {}
    start = time.perf_counter()
    out = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # ignore_eos: neither stop at EOS nor mask it
        streamer=clock,
        **extra,
    )
    if out.is_cuda:
        torch.cuda.synchronize()
    e2e = time.perf_counter() - start
    new = out[0, len(ids) :].tolist()
    if len(new) != new_tokens or clock.first is None:
        raise RuntimeError(f"generate gave {len(new)} tokens, asked for {new_tokens}")
    return new, clock.first - start, e2e


def bench_serving_prompts(tokenizer: PreTrainedTokenizerBase, spec: dict) -> list[list[int]]:
    """bench_serving's ``random-ids`` prompts, or its ``custom`` ones from ``dataset_path``
    (its loader, seeded as it seeds), as the server tokenizes the text it is sent."""
    import random

    import numpy as np
    from sglang.benchmark.datasets.custom import sample_custom_requests
    from sglang.benchmark.datasets.random import sample_random_requests

    random.seed(spec["seed"])
    np.random.seed(spec["seed"])
    if spec.get("dataset_path"):
        rows = sample_custom_requests(
            dataset_path=spec["dataset_path"],
            num_requests=spec["num_prompts"],
            tokenizer=tokenizer,
            fixed_output_len=spec["output_len"],
        )
        return [tokenizer.encode(row.prompt) for row in rows]
    rows = sample_random_requests(
        input_len=spec["input_len"],
        output_len=spec["output_len"],
        num_prompts=spec["num_prompts"],
        range_ratio=spec["range_ratio"],
        tokenizer=tokenizer,
        dataset_path="",
        random_sample=False,
        return_text=True,
    )
    return [tokenizer.encode(row.prompt) for row in rows]


def load_models(
    spec: dict,
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, PreTrainedModel | None]:
    """Tokenizer, target and draft (None for plain ``hf``), fp32, eval mode."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def load(path: str) -> PreTrainedModel:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(device).eval()

    draft = load(spec["draft"]) if spec["draft"] else None
    return AutoTokenizer.from_pretrained(spec["target"]), load(spec["target"]), draft


def assistant_settings(draft: PreTrainedModel | None) -> dict | None:
    """What assisted generation uses: the draft's generation config, else transformers'
    defaults (as ``AssistedCandidateGenerator`` fills them in)."""
    if draft is None:
        return None
    import importlib.util

    config = draft.generation_config
    defaults = config._get_default_generation_params()
    settings = {
        name: getattr(config, name, None)
        if getattr(config, name, None) is not None
        else defaults.get(name)
        for name in ASSISTANT_SETTINGS
    }
    # the confidence threshold is re-fitted between calls only with scikit-learn installed
    settings["confidence_threshold_adapts"] = importlib.util.find_spec("sklearn") is not None
    return settings


def count_forwards(models: dict[str, PreTrainedModel | None]) -> dict[str, int]:
    """A live count of each model's forward calls (a pre-hook per model; zero for None)."""
    counts = dict.fromkeys(models, 0)

    def hook(key: str) -> Callable[..., None]:
        return lambda *_: counts.__setitem__(key, counts[key] + 1)

    for key, model in models.items():
        if model is not None:
            model.register_forward_pre_hook(hook(key))
    return counts


def timed_requests(
    target: PreTrainedModel, draft: PreTrainedModel | None, prompts: list[list[int]], new: int
) -> tuple[list[dict], float]:
    """The benchmark proper: the requests one after another; per-request timings and the wall
    time of the whole loop (s)."""
    requests, start = [], time.perf_counter()
    for ids in prompts:
        tokens, ttft, e2e = generate(target, draft, ids, new)
        requests.append(
            {"input_tokens": len(ids), "output_tokens": len(tokens), "ttft_s": ttft, "e2e_s": e2e}
        )
    return requests, time.perf_counter() - start


def describe(
    spec: dict, target: PreTrainedModel, draft: PreTrainedModel | None, cores: list[int]
) -> dict:
    """How the peer ran, for the result JSON."""
    import torch
    import transformers

    return {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": str(target.device),
        "dtype": "float32",
        "attn_implementation": target.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": cores,
        "batch_size": 1,
        "target": spec["target"],
        "draft": spec["draft"],
        "assistant": assistant_settings(draft),
    }


def run_peer(spec: dict) -> dict:
    """The whole measurement: warm-up, timed requests, greedy prompts; raw timings out."""
    import torch

    cores = peer_cores(dict(os.environ), os.sched_getaffinity(0))
    if os.environ.get(BIND_ENV, "all").strip() not in ("", "all"):
        os.sched_setaffinity(0, cores)  # as SGLang binds its threads to those cores
    torch.set_num_threads(len(cores))
    tokenizer, target, draft = load_models(spec)
    prompts = bench_serving_prompts(tokenizer, spec)
    forwards = count_forwards({"target": target, "draft": draft})
    with torch.no_grad():
        generate(target, draft, prompts[0], spec["output_len"])  # bench_serving's warm-up
        forwards.update(target=0, draft=0)
        requests, duration = timed_requests(target, draft, prompts, spec["output_len"])
        counted = dict(forwards)
        new = spec["greedy_new_tokens"]
        greedy = [generate(target, draft, p, new)[0] for p in spec["greedy_prompts"]]
    return {
        "requests": requests,
        "duration_s": duration,
        "target_forwards": counted["target"],
        "draft_forwards": counted["draft"],
        "greedy_output_ids": greedy,
        "peer": describe(spec, target, draft, cores),
    }


def main(argv: list[str]) -> int:
    """``hf_peer_worker.py SPEC.json OUT.json``: run one measurement, write its raw result."""
    if len(argv) != 2:
        print(
            "usage: hf_peer_worker.py SPEC.json OUT.json (run by bench_speculative.py)",
            file=sys.stderr,
        )
        return 2
    result = run_peer(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
