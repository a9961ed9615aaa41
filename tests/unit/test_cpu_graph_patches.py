"""The CPU graph runner's patches: our rotary op gets a fake of its own layout
(``cpu_graph_fakes``), and ``patch_model`` compiles without dynamo's module-attribute guards
(``cpu_graph_guards``): a changed module flag no longer recompiles, a new input shape still
does."""

from __future__ import annotations

import importlib

import torch

from sgl_spec.patches import cpu_graph_fakes, cpu_graph_guards


def test_rotary_embedding_gets_the_fake_of_our_op(monkeypatch) -> None:
    module = importlib.import_module(cpu_graph_fakes.TARGET)
    registered: dict[str, object] = {}

    def upstream(op_name: str):
        return lambda fn: registered.setdefault(op_name, fn)

    monkeypatch.setattr(module, "register_cpu_compile_fake", upstream)
    assert cpu_graph_fakes.apply()

    def upstreams_fake(*args):
        return args[1], args[2]

    assert (
        module.register_cpu_compile_fake("rotary_embedding_cpu")(upstreams_fake) is upstreams_fake
    )
    assert module.register_cpu_compile_fake("rmsnorm_cpu")(len) is len
    assert registered["rmsnorm_cpu"] is len
    fake = registered["rotary_embedding_cpu"]
    assert fake is cpu_graph_fakes._rotary_embedding_fake
    qkv = torch.empty(3, 48)
    q, k = fake(None, qkv[:, :32], qkv[:, 32:], 16, None, True)
    assert q.shape == (3, 32) and q.is_contiguous() and k.shape == (3, 16) and k.is_contiguous()


def test_patch_model_skips_module_guards(monkeypatch) -> None:
    module = importlib.import_module(cpu_graph_guards.TARGET)
    monkeypatch.setattr(module, "patch_model", module.patch_model)  # restored after the test
    assert cpu_graph_guards.apply()
    assert not cpu_graph_guards.apply()  # idempotent

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = Scaled()
    with module.patch_model(model, False, 1, None) as forward:
        assert forward == model.forward
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]
    with module.patch_model(model, True, 1, None) as forward:
        x = torch.ones(2)
        assert torch.equal(forward(x), x * 2)
        compiled = frames["unique_graphs"]
        model.scale = 3.0  # a module attribute: not guarded, the graph keeps 2.0
        assert torch.equal(forward(x), x * 2)
        assert frames["unique_graphs"] == compiled
        # input shapes are guarded: a new one compiles anew, with the attribute as it is now
        assert torch.equal(forward(torch.ones(3)), torch.ones(3) * 3)
        assert frames["unique_graphs"] == compiled + 1
    torch._dynamo.reset()
