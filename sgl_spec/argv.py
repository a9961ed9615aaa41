"""Reading and editing SGLang-style command lines (``--name value`` or ``--name=value``).

One implementation for the launcher, the model defaults and the benchmark harness. Like
argparse, the last occurrence of a flag is the one that counts. ``LaunchArgs`` is the one place
that reads the speculative settings our algorithms check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def has_flag(argv: list[str], *names: str) -> bool:
    return any(arg == n or arg.startswith(n + "=") for arg in argv for n in names)


def _last_index(argv: list[str], *names: str) -> int | None:
    found = None
    for i, arg in enumerate(argv):
        for name in names:
            if (arg == name and i + 1 < len(argv)) or arg.startswith(name + "="):
                found = i
    return found


def flag_value(argv: list[str], *names: str) -> str | None:
    """Last value of any of ``names`` (one flag's aliases) in ``argv``, or None."""
    i = _last_index(argv, *names)
    if i is None:
        return None
    return argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1]


def set_flag_value(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with the effective value of ``name`` replaced, or ``name value`` appended."""
    out = list(argv)
    i = _last_index(out, name)
    if i is None:
        return out + [name, value]
    if out[i] == name:
        out[i + 1] = value
    else:
        out[i] = f"{name}={value}"
    return out


def drop_flags(argv: list[str], prefix: str) -> list[str]:
    """``argv`` without every flag starting with ``prefix`` (``--flag v``, ``--flag=v``) and the
    values that follow it."""
    out: list[str] = []
    dropping = False
    for arg in argv:
        if arg.startswith("--"):
            dropping = arg.startswith(prefix)
        if not dropping:
            out.append(arg)
    return out


@dataclass(frozen=True)
class LaunchArgs:
    """The SGLang settings our launch checks read, in one place: parsed from the launcher's argv
    before SGLang sees it (``from_argv``), or read from SGLang's ``ServerArgs`` inside its
    processes (``from_server_args``), so each check is written once for both. A value SGLang
    will refuse (not an integer) reads as unset here and is left to SGLang's own parser."""

    algorithm: str | None = None  # --speculative-algorithm, upper case
    model_path: str | None = None
    tokenizer_path: str | None = None
    draft_model_path: str | None = None  # --speculative-draft-model-path
    token_map: str | None = None  # --speculative-token-map (a draft's hot vocabulary)
    device: str = "cpu"
    base_gpu_id: int = 0
    load_format: str | None = None  # "dummy": random weights, no checkpoint files read
    num_steps: int | None = None  # --speculative-num-steps
    eagle_topk: int | None = None  # --speculative-eagle-topk
    num_draft_tokens: int | None = None  # --speculative-num-draft-tokens
    max_running_requests: int | None = None
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1  # --nnodes: the ranks are spread over that many node processes
    # SGLang's overlap scheduler as the launch asks for it: True (--enable-overlap-schedule),
    # False (--disable-overlap-schedule), None (neither: SGLang's default, on)
    overlap_schedule: bool | None = None

    @property
    def num_ranks(self) -> int:
        """Model-running processes SGLang starts on all nodes: one per tensor, pipeline and
        data rank."""
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def local_ranks(self) -> int:
        """The ranks this node process runs (SGLang splits them evenly over ``nnodes``)."""
        return -(-self.num_ranks // self.nnodes)

    @classmethod
    def from_argv(cls, argv: list[str]) -> LaunchArgs:
        algorithm = flag_value(argv, "--speculative-algorithm")
        device = flag_value(argv, "--device")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(
            algorithm=algorithm.upper() if algorithm else None,
            model_path=flag_value(argv, "--model-path"),
            tokenizer_path=flag_value(argv, "--tokenizer-path"),
            draft_model_path=flag_value(argv, "--speculative-draft-model-path"),
            token_map=flag_value(argv, "--speculative-token-map"),
            device=device,
            base_gpu_id=_int_or_none(flag_value(argv, "--base-gpu-id")) or 0,
            load_format=flag_value(argv, "--load-format"),
            num_steps=_int_or_none(flag_value(argv, "--speculative-num-steps")),
            eagle_topk=_int_or_none(flag_value(argv, "--speculative-eagle-topk")),
            num_draft_tokens=_int_or_none(flag_value(argv, "--speculative-num-draft-tokens")),
            max_running_requests=_int_or_none(flag_value(argv, "--max-running-requests")),
            tp_size=_int_or_none(flag_value(argv, "--tp-size", "--tensor-parallel-size")) or 1,
            pp_size=_int_or_none(flag_value(argv, "--pp-size", "--pipeline-parallel-size")) or 1,
            dp_size=_int_or_none(flag_value(argv, "--dp-size", "--data-parallel-size")) or 1,
            enable_dp_attention=has_flag(argv, "--enable-dp-attention"),
            nnodes=_int_or_none(flag_value(argv, "--nnodes")) or 1,
            overlap_schedule=_overlap_schedule(argv),
        )

    @classmethod
    def from_server_args(cls, server_args: Any) -> LaunchArgs:
        algorithm = server_args.speculative_algorithm
        return cls(
            algorithm=str(algorithm).upper() if algorithm else None,
            model_path=server_args.model_path,
            tokenizer_path=server_args.tokenizer_path,
            draft_model_path=server_args.speculative_draft_model_path,
            token_map=getattr(server_args, "speculative_token_map", None),
            device=str(server_args.device),
            base_gpu_id=int(server_args.base_gpu_id or 0),
            load_format=str(server_args.load_format),
            num_steps=server_args.speculative_num_steps,
            eagle_topk=server_args.speculative_eagle_topk,
            num_draft_tokens=server_args.speculative_num_draft_tokens,
            max_running_requests=server_args.max_running_requests,
            tp_size=int(server_args.tp_size or 1),
            pp_size=int(server_args.pp_size or 1),
            dp_size=int(server_args.dp_size or 1),
            enable_dp_attention=bool(server_args.enable_dp_attention),
            nnodes=int(getattr(server_args, "nnodes", 1) or 1),
            overlap_schedule=not getattr(server_args, "disable_overlap_schedule", False),
        )


def _overlap_schedule(argv: list[str]) -> bool | None:
    if has_flag(argv, "--disable-overlap-schedule"):
        return False
    return True if has_flag(argv, "--enable-overlap-schedule") else None


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
