"""The draft server's device argument: ``cpu``, ``cpu:N`` (a core set of N cores) or
``cuda:N``. A module of its own so that argument checking (``sgl_spec.config``) needs nothing
of the draft server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed ``Hello.device``: ``kind`` "cpu" or "cuda"; ``index`` the GPU id, or the number
    of dedicated cores for "cpu:N" (None: no core set of its own)."""

    kind: str
    index: int | None

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index or 0}"


def parse_device(device: str) -> DeviceSpec:
    """``"cpu"``, ``"cpu:N"`` (N >= 1 cores) or ``"cuda:N"``; ValueError names the value."""
    kind, sep, index = device.strip().partition(":")
    if kind not in ("cpu", "cuda") or (sep and not index.isdigit()):
        raise ValueError(f"draft device must be cpu, cpu:N or cuda:N, got {device!r}")
    number = int(index) if sep else None
    if kind == "cpu" and number == 0:
        raise ValueError(f"draft device {device!r}: a core set needs at least one core")
    return DeviceSpec(kind, number if sep else (0 if kind == "cuda" else None))


def cpu_core_set(num_cores: int, available: set[int] | list[int]) -> list[int]:
    """The cores a ``cpu:N`` draft server takes: the last ``num_cores`` of ``available``."""
    cores = sorted(available)
    if num_cores > len(cores):
        raise ValueError(f"cpu:{num_cores} asks for more cores than the {len(cores)} available")
    return cores[len(cores) - num_cores :]
