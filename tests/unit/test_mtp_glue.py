"""MTP_LORA glue without a server: carried state, flags, shipped defaults, start-up errors."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from sgl_spec.algorithms import with_shipped_defaults
from sgl_spec.argv import LaunchArgs
from sgl_spec.config import ConfigError, SpecConfig, split_argv
from sgl_spec.mtp.algorithm import MTP_DEFAULT_K
from sgl_spec.mtp.info import MtpDraftInput, pad_drafts


def _state(bonus: list[int], drafts: list[list[int]]) -> MtpDraftInput:
    d = torch.tensor(drafts, dtype=torch.long).reshape(len(bonus), -1)
    return MtpDraftInput(
        bonus_tokens=torch.tensor(bonus),
        drafts=d,
        new_seq_lens=torch.arange(len(bonus)) + 10,
        num_real=torch.full((len(bonus),), d.shape[1]),
    )


def test_pad_drafts_truncates_or_pads_with_token_zero() -> None:
    d = torch.tensor([[4, 5, 6]])
    assert pad_drafts(d, 2).tolist() == [[4, 5]]
    assert pad_drafts(d, 5).tolist() == [[4, 5, 6, 0, 0]]


def test_merge_keeps_every_request_and_the_widest_drafts() -> None:
    running = _state([1, 2], [[7, 8], [9, 9]])
    fresh = MtpDraftInput.after_prefill(torch.tensor([3]), torch.tensor([5]))
    running.merge_batch(fresh)
    assert running.bonus_tokens.tolist() == [1, 2, 3]
    assert running.drafts.tolist() == [[7, 8], [9, 9], [0, 0]]
    assert running.num_real.tolist() == [2, 2, 0]
    assert running.new_seq_lens.tolist() == [10, 11, 5]
    running.filter_batch(torch.tensor([2, 0]))
    assert running.bonus_tokens.tolist() == [3, 1]
    assert running.drafts.tolist() == [[0, 0], [7, 8]]
    assert running.num_real.tolist() == [0, 2]


def test_mtp_flags_are_ours_and_validated() -> None:
    config, rest = split_argv(["--mtp-k", "2", "--mtp-lora-path", "/a", "--model-path", "m"])
    assert (config.mtp_k, config.mtp_lora_path) == ("2", "/a")
    assert rest == ["--model-path", "m"]
    with pytest.raises(ConfigError, match="--mtp-k"):
        SpecConfig(mtp_k="many")
    with pytest.raises(ConfigError, match="--mtp-k"):
        SpecConfig(mtp_k="99")
    assert SpecConfig(mtp_k="auto").mtp_gamma_table is None  # online calibration needs no table
    assert SpecConfig.from_env({"SGLSPEC_CONFIG": SpecConfig(mtp_k="3").to_env()}).mtp_k == "3"


def fill_mtp_defaults(config: SpecConfig, argv: list[str]) -> SpecConfig:
    return with_shipped_defaults(config, LaunchArgs.from_argv(argv))


def test_shipped_target_gets_the_shipped_adapter_and_k() -> None:
    from sgl_spec.models.registry import DEFAULT_MTP_ADAPTER, DEFAULT_TARGET

    argv = ["--model-path", DEFAULT_TARGET, "--speculative-algorithm", "MTP_LORA"]
    filled = fill_mtp_defaults(SpecConfig(), argv)
    assert (filled.mtp_lora_path, filled.mtp_k) == (DEFAULT_MTP_ADAPTER, MTP_DEFAULT_K)
    mine = fill_mtp_defaults(SpecConfig(mtp_k="1", mtp_lora_path="/x"), argv)
    assert (mine.mtp_lora_path, mine.mtp_k) == ("/x", "1")
    other = ["--model-path", "/some/model", "--speculative-algorithm", "MTP_LORA"]
    assert fill_mtp_defaults(SpecConfig(), other) == SpecConfig()


def test_bad_adapter_is_refused_naming_the_flag(tmp_path: Path) -> None:
    from sgl_spec.mtp.settings import load_settings

    with pytest.raises(ValueError, match="--mtp-lora-path"):
        load_settings(SpecConfig())
    with pytest.raises(ValueError, match="--mtp-lora-path"):
        load_settings(SpecConfig(mtp_lora_path=str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_settings(SpecConfig(mtp_lora_path=str(tmp_path)))


def test_bench_mtp_lora_drops_pass_through_speculative_flags() -> None:
    from _bench_lib import server_flags

    extra = ["--model-path", "m", "--speculative-draft-model-path", "d", "--mtp-k", "2"]
    flags = server_flags("mtp_lora", extra)
    assert "--speculative-draft-model-path" not in flags
    assert flags[-2:] == ["--speculative-algorithm", "MTP_LORA"]
    assert "--mtp-k" in flags


def test_auto_controller_calibrates_online_with_an_optional_table(tmp_path: Path) -> None:
    from sgl_spec.mtp.settings import build_controller

    online = build_controller(None, 3, 0.6)
    assert online.table is None and online.calibrating
    assert online.decide(4, 128).source == "calibrate"  # T(0) is measured first
    with pytest.raises(ValueError, match="--mtp-gamma-table"):
        build_controller(str(tmp_path / "missing.json"), 3, 0.6)
    (tmp_path / "bad.json").write_text('{"points": []}')
    with pytest.raises(ValueError, match="--mtp-gamma-table"):
        build_controller(str(tmp_path / "bad.json"), 3, 0.6)


def test_fused_mlp_kernel_runs_only_without_gated_rows() -> None:
    from types import SimpleNamespace

    from sgl_spec.mtp.sglang_lora import GatedLoRA, _gate_dual_gemm

    adapter = GatedLoRA(torch.zeros(2, 4), k_max=2)
    dual = SimpleNamespace(can_run=lambda x, proj: x == "small")
    _gate_dual_gemm(dual, adapter)
    assert dual.can_run("small", None) and not dual.can_run("large", None)
    with adapter.gates(width=3, first_gated=1, mask_index=torch.tensor([0, 1])):
        assert not dual.can_run("small", None)  # mask rows need gate_up_proj's LoRA delta
    with adapter.gates(width=1, first_gated=1, mask_index=torch.zeros(0, dtype=torch.int64)):
        assert dual.can_run("small", None)  # k = 0: anchors only


def test_auto_relearns_deep_masks_after_a_poor_request() -> None:
    """MTP_LORA's controller is a chain's (``CHAIN_TUNING``): a request whose masks fail from
    position 2 on settles it at k = 1, where masks 2-3 are never verified; probing the other k
    while speculating lets a later request of full acceptance bring back k = 3."""
    from sgl_spec.mtp.settings import build_controller

    controller = build_controller(None, 3, 0.7)
    seconds = {0: 0.010, 1: 0.0112, 2: 0.0124, 3: 0.0136}
    history = []
    for step in range(1500):
        k = controller.decide(1, 64).k
        history.append(k)
        poor = 100 <= step < 400
        if k:
            controller.observe(k, [min(k, 1) if poor else k])
        controller.observe_step(k, 1, seconds[k])
    assert history[380:400].count(1) >= 15, history[380:400]
    assert history[-50:].count(3) >= 40, history[-50:]


@pytest.mark.parametrize("kernel", ["native", "0"])
def test_lora_delta_through_the_packed_kernel_equals_matmul(monkeypatch, kernel) -> None:
    """With our native linear kernel the LoRA factors are packed like the base layers; the
    delta is the same (float32 rounding) for the rows of a step and of a prefill, and with the
    kernel off the factors stay plain matmuls."""
    from sgl_spec.mtp.sglang_lora import _Delta
    from sgl_spec.patches import cpu_packed_linear as cpu_linear

    if kernel == "native" and not cpu_linear.available("native"):
        pytest.skip("native CPU kernels not built on this host")
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, kernel)
    gen = torch.Generator().manual_seed(0)
    factors = [(torch.randn(4, 40, generator=gen), torch.randn(out, 4, generator=gen))
               for out in (24, 9, 9)]  # fmt: skip
    delta = _Delta(factors, 0.5, torch.float32)
    packed = [getattr(f, "_sgl_spec_packed", None) is not None for f in delta._factors]
    assert packed == [kernel == "native"] * 2
    for rows in (1, 6, 9, 100):  # 100: more rows than the kernel takes, plain matmul
        x = torch.randn(rows, 40, generator=gen)
        expected = torch.cat([(x @ a.t()) @ b.t() * 0.5 for a, b in factors], dim=1)
        torch.testing.assert_close(delta(x), expected, rtol=1e-5, atol=1e-5)


def test_fused_gated_delta_touches_only_gated_rows(monkeypatch) -> None:
    """The one-call native path adds, to the gated rows of every step block, the delta the
    PyTorch path computes (float32 rounding) and leaves every anchor row bit for bit; a call
    it cannot take (a bfloat16 output, a strided row) falls back to the PyTorch path."""
    from sgl_spec.mtp.sglang_lora import GatedLoRA, _Delta
    from sgl_spec.patches import cpu_packed_linear as cpu_linear

    if not cpu_linear.available("native"):
        pytest.skip("native CPU kernels not built on this host")
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "native")
    gen = torch.Generator().manual_seed(1)
    factors = [(torch.randn(3, 40, generator=gen), torch.randn(out, 3, generator=gen))
               for out in (24, 9)]  # fmt: skip
    adapter = GatedLoRA(torch.zeros(2, 40), k_max=2)
    adapter.deltas["m"] = delta = _Delta(factors, 0.5, torch.float32)
    assert delta._fused is not None
    width, first = 9, 3  # k = 2: 3 anchors, 6 masks per request
    for requests in (1, 5):
        x = torch.randn(requests * width, 40, generator=gen)
        base = torch.randn(requests * width, 33, generator=gen)
        with adapter.gates(width, first, torch.arange(width - first) % 2):
            fused = adapter._add_delta("m", x, base.clone())
            delta._fused = None  # the PyTorch path, for reference
            expected = adapter._add_delta("m", x, base.clone())
            delta._fused = torch.ops.sgl_spec_native.gated_lora_add
        anchors = torch.zeros(requests, width, dtype=torch.bool)
        anchors[:, :first] = True
        anchors = anchors.reshape(-1)
        assert torch.equal(fused[anchors], base[anchors])
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fused[~anchors], base[~anchors])
    strided = torch.randn(width, 80, generator=gen)[:, ::2]
    assert not delta.add_gated(strided, torch.zeros(width, 33), width, first)
    assert not delta.add_gated(
        x[:width], torch.zeros(width, 33, dtype=torch.bfloat16), width, first
    )
    with pytest.raises(RuntimeError, match="blocks of width"):
        delta.add_gated(x[:5], torch.zeros(5, 33), width, first)


def test_compiled_shapes_are_the_steps_of_every_k_it_may_run() -> None:
    """``--enable-torch-compile``: fixed k compiles its verify of (k+1)² tokens only; auto the
    verify of every k up to k_max and the plain decode of k = 0; each verify's capture runs
    with the gate ``forward_decode`` sets for it."""
    from types import SimpleNamespace

    from sgl_spec.common.compiled_forwards import Shape
    from sgl_spec.mtp.worker import MtpLoraWorker

    fixed = SimpleNamespace(k_max=4, fixed_k=2, controller=None)
    assert MtpLoraWorker.compiled_shapes(fixed, [1, 8]) == [
        Shape("TARGET_VERIFY", 1, 9, tree=True), Shape("TARGET_VERIFY", 8, 9, tree=True),
    ]  # fmt: skip
    auto = SimpleNamespace(k_max=3, fixed_k=3, controller=object())
    shapes = MtpLoraWorker.compiled_shapes(auto, [2])
    assert {(s.mode, s.tokens) for s in shapes} == {
        ("DECODE", 1), ("TARGET_VERIFY", 4), ("TARGET_VERIFY", 9), ("TARGET_VERIFY", 16),
    }  # fmt: skip

    entered = []

    @contextlib.contextmanager
    def gates(*args):
        entered.append(args)
        yield

    worker = SimpleNamespace(
        _layout=lambda k: (SimpleNamespace(width=(k + 1) ** 2), None, f"index{k}", None),
        lora=SimpleNamespace(gates=gates),
    )
    worker._gates = lambda k: MtpLoraWorker._gates(worker, k)
    with MtpLoraWorker.compiled_state(worker, Shape("TARGET_VERIFY", 2, 9, tree=True)):
        assert entered == [(9, 3, "index2")]
    with MtpLoraWorker.compiled_state(worker, Shape("DECODE", 2, 1)):
        pass
    assert entered == [(9, 3, "index2")]


def test_target_compile_is_given_the_workers_state_per_shape(monkeypatch) -> None:
    """``init_cuda_graphs`` hands ``compiled_state`` to ``compile_stacks`` as the state each
    shape is captured in."""
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    from sgl_spec.common import compiled_forwards
    from sgl_spec.common.worker import TargetWrappingWorker

    calls = []
    monkeypatch.setattr(BaseSpecWorker, "init_cuda_graphs", lambda self: None, raising=False)
    monkeypatch.setattr(compiled_forwards, "compile_requested", lambda runner: True)
    monkeypatch.setattr(compiled_forwards, "capture_batch_sizes", lambda runner: [4])
    monkeypatch.setattr(compiled_forwards, "compile_stacks", lambda *a, **kw: calls.append((a, kw)))
    shape = compiled_forwards.Shape("DECODE", 4, 1)

    class Worker(TargetWrappingWorker):
        def compiled_shapes(self, batch_sizes: list[int]) -> list:
            return [shape] if batch_sizes == [4] else []

    worker = Worker.__new__(Worker)  # no SGLang worker behind it: only the compile is wired
    worker.model_runner = "runner"
    worker.init_cuda_graphs()
    assert calls == [(("runner", "target", [shape]), {"around": worker.compiled_state})]
