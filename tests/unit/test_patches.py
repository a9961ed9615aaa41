"""Every upstream patch still matches the pinned SGLang, and the CPU sampling replacement
implements the lossless multi-candidate rule (checked on constructed trees)."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.config import SpecConfig
from sgl_spec.patches import all_patches
from sgl_spec.verify import tree_sampling


def test_every_patch_matches_pinned_sglang() -> None:
    for patch in all_patches():
        patch.check()  # raises when the upstream target changed shape


def test_internals_check_sees_a_changed_sglang(monkeypatch) -> None:
    """The checked couplings fail the check when SGLang's code no longer has what they need."""
    from sgl_spec.patches import spec_internals

    monkeypatch.setattr(spec_internals, "_VERIFY_SOURCE", ("topk > 99",))
    with pytest.raises(RuntimeError, match="run_eagle_verify"):
        spec_internals.check()
    monkeypatch.undo()
    monkeypatch.setitem(spec_internals._LLAMA_SOURCE, "LlamaMLP.forward", ("self.fused_mlp(",))
    with pytest.raises(RuntimeError, match="LlamaMLP.forward"):
        spec_internals.check()


def _chain_tree(num_draft_tokens: int):
    """Chain 0 -> 1 -> 2 ...: slot i's first child is i+1, no siblings."""
    nxt = list(range(1, num_draft_tokens)) + [-1]
    return (
        torch.arange(num_draft_tokens).view(1, -1),
        torch.tensor([nxt]),
        torch.full((1, num_draft_tokens), -1),
    )


def _run(candidates, target_probs, coins, final_coin, tree):
    r_index, r_next, r_sib = tree
    n = candidates.shape[1]
    predicts = torch.full((n,), -7, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    tree_sampling.tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_num,
        candidates,
        r_index,
        r_next,
        r_sib,
        torch.tensor([coins], dtype=torch.float32),
        torch.tensor([final_coin]),
        target_probs,
        torch.zeros_like(target_probs),
    )
    return predicts, accept_index, int(accept_num)


def test_chain_accepts_while_coin_below_target_prob() -> None:
    vocab = 4
    probs = torch.zeros(1, 3, vocab)
    probs[0, 0] = torch.tensor([0.1, 0.6, 0.2, 0.1])  # p(draft 1 | root) = 0.6
    probs[0, 1] = torch.tensor([0.5, 0.0, 0.3, 0.2])  # p(draft 2 | 1) = 0.3
    probs[0, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    cands = torch.tensor([[9, 1, 2]])
    predicts, acc, num = _run(cands, probs, [0.5, 0.9, 0.0], 0.99, _chain_tree(3))
    assert num == 1 and acc[0, :2].tolist() == [0, 1]
    assert predicts[0] == 1
    # rejected draft 2 (coin 0.9 >= 0.3): bonus from p(.|1) without token 2 -> {0:.5, 3:.2}
    assert predicts[1] == 3  # coin 0.99 lands in the last token with mass


def test_siblings_take_consecutive_intervals() -> None:
    """Root has children slot 1 (token 2) and slot 2 (token 3): coin in [p2, p2+p3) picks 3."""
    probs = torch.zeros(1, 3, 5)
    probs[0, 0] = torch.tensor([0.1, 0.1, 0.3, 0.4, 0.1])
    r_index = torch.arange(3).view(1, -1)
    r_next = torch.tensor([[1, -1, -1]])
    r_sib = torch.tensor([[-1, 2, -1]])
    cands = torch.tensor([[0, 2, 3]])
    _, acc, num = _run(cands, probs, [0.5, 0.0, 0.0], 0.0, (r_index, r_next, r_sib))
    assert num == 1 and int(acc[0, 1]) == 2


def test_output_distribution_equals_target_on_a_tree() -> None:
    """Monte-Carlo over coins: token law at depth 1 equals p for a 2-sibling tree."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.15, 0.3, 0.4, 0.1])
    probs = torch.zeros(1, 3, 5)
    probs[0, 0] = p
    probs[0, 1:] = torch.full((5,), 0.2)
    tree = (torch.arange(3).view(1, -1), torch.tensor([[1, -1, -1]]), torch.tensor([[-1, 2, -1]]))
    cands = torch.tensor([[0, 3, 1]])
    counts = torch.zeros(5)
    n = 4000
    for _ in range(n):
        coins = torch.rand(3, generator=gen).tolist()
        predicts, acc, num = _run(cands, probs, coins, float(torch.rand(1, generator=gen)), tree)
        counts[int(predicts[0])] += 1
    from scipy import stats

    _, p_value = stats.chisquare(counts.numpy(), (p * n).numpy())
    assert p_value > 1e-3


def test_filter_probs_matches_sglang_rule() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    out = tree_sampling.filter_probs(probs, torch.tensor([2]), None)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.2, 0.0, 0.0]]) / 0.7)
    probs = torch.tensor([[0.25, 0.5, 0.1, 0.15]])
    # keep tokens while the sorted mass before them is <= top_p: 0.5, 0.25 (0.75 > 0.6 stops)
    out = tree_sampling.filter_probs(probs, None, torch.tensor([0.6]))
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.5, 0.0, 0.0]]) / 0.75)


def test_kv_budget_adds_the_workers_bytes_for_our_algorithms_only(monkeypatch) -> None:
    from types import SimpleNamespace

    from sgl_spec.patches import worker_kv_budget as patch

    class Configurator:
        def __init__(self, kvc) -> None:
            self._cell_size = 1000

    extra = {"SPECBLOCK": 250, "MINEDRAFT": 60}
    monkeypatch.setattr(
        patch, "extra_bytes_per_token", lambda algo, args, dtype: extra.get(algo.name, 0)
    )
    Configurator.__init__ = patch.counting_worker_rows(Configurator.__init__)

    def kvc(name: str, draft: bool = False) -> SimpleNamespace:
        algo = SimpleNamespace(name=name)
        return SimpleNamespace(
            is_draft_worker=draft, spec_algorithm=algo, model_config=None, server_args=None
        )

    assert Configurator(kvc("SPECBLOCK"))._cell_size == 1250
    assert Configurator(kvc("SPECBLOCK", draft=True))._cell_size == 1000
    assert Configurator(kvc("MINEDRAFT"))._cell_size == 1060
    assert Configurator(kvc("STANDALONE"))._cell_size == 1000
    # SGLang's own algorithms are not ours: nothing to add, no settings built
    none = SimpleNamespace(name="NONE")
    assert patch.extra_bytes_per_token(none, None, torch.float32) == 0


def test_each_algorithm_states_its_extra_kv_bytes(monkeypatch, tmp_path) -> None:
    from types import SimpleNamespace

    import sgl_spec.algorithms
    from sgl_spec.minedraft.algorithm import MineDraft
    from sgl_spec.mtp.algorithm import MtpLora
    from sgl_spec.patches import worker_kv_budget as patch
    from sgl_spec.specblock.algorithm import SpecBlock
    from sgl_spec.specblock.draft_kv import drafter_kv_bytes_per_row
    from sgl_spec.specblock.settings import read_drafter_config
    from tests.helpers.server_args import fake_server_args
    from tests.helpers.tiny_models import SPECBLOCK_D, specblock_drafter

    specblock_drafter().save_pretrained(tmp_path)
    per_row = drafter_kv_bytes_per_row(read_drafter_config(str(tmp_path)), torch.float32)
    assert per_row > 0
    config = read_drafter_config(str(tmp_path))
    drafter = SimpleNamespace(drafter_config=config, runs_plain_steps=False)
    assert SpecBlock().extra_kv_bytes_per_token(drafter, torch.float32) == per_row
    # budgets with steps without drafts also keep the unread tokens' rows (target_rows.py):
    # features in the drafter's dtype, an int64 token id and a read flag per location
    rows = 3 * SPECBLOCK_D * 4 + 8 + 1
    lazy = SimpleNamespace(drafter_config=config, runs_plain_steps=True, drafter_dtype="auto")
    assert SpecBlock().extra_kv_bytes_per_token(lazy, torch.float32) == per_row + rows
    hosted = SimpleNamespace(drafter="specblock", drafter_config=drafter.drafter_config)
    assert MineDraft().extra_kv_bytes_per_token(hosted, torch.bfloat16) == 3 * SPECBLOCK_D * 2
    assert MineDraft().extra_kv_bytes_per_token(hosted, torch.float32) == 3 * SPECBLOCK_D * 4
    draft_lm = SimpleNamespace(drafter="model", draft_model_path="unused")
    assert MineDraft().extra_kv_bytes_per_token(draft_lm, torch.float32) == 0
    assert MtpLora().extra_kv_bytes_per_token(None, torch.float32) == 0
    # through the patch: the bound algorithm's settings, built from the process's config
    algorithm = SpecBlock()
    algorithm.bind(SpecConfig(specblock_drafter_path=str(tmp_path)))
    monkeypatch.setattr(sgl_spec.algorithms, "find", lambda name: algorithm)
    server_args = fake_server_args(speculative_algorithm="SPECBLOCK")
    name = SimpleNamespace(name="SPECBLOCK")  # the default budget (auto) runs plain steps
    assert patch.extra_bytes_per_token(name, server_args, torch.float32) == per_row + rows


def test_check_prompt_rejects_empty_and_out_of_vocabulary_ids() -> None:
    import pytest

    from sgl_spec.patches.prompt_validation import check_prompt

    check_prompt([0, 4095], 4096)  # both ends of the vocabulary are fine
    for ids, bad in (([1, 4096], 4096), ([99999, 2, -3], 99999), ([5, -1], -1)):
        with pytest.raises(ValueError, match=rf"input_ids contains {bad}, outside .*\[0, 4096\)"):
            check_prompt(ids, 4096)
    for ids in ([], None):
        with pytest.raises(ValueError, match=r"the prompt is empty \(0 tokens\)"):
            check_prompt(ids, 4096)
    check_prompt([], 4096, allow_empty=True)  # a session continuation extends earlier tokens
    check_prompt([1, 10**9], 4096, check_ids=False)  # multimodal placeholder ids
    check_prompt(None, 4096, num_embeds=3)  # input_embeds: the ids are placeholders
    with pytest.raises(ValueError, match="empty"):
        check_prompt(None, 4096, num_embeds=0)


def test_prompt_validation_wraps_sglang_validation() -> None:
    """The wrapper checks a real GenerateReqInput first and only then calls SGLang's own
    validation; apply() is idempotent and leaves SGLang's method reachable."""
    from types import SimpleNamespace

    import pytest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sgl_spec.patches import prompt_validation as patch

    seen = []
    validate = patch.validating(lambda self, obj, ids: seen.append(list(ids)))
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=512))
    validate(manager, GenerateReqInput(text="hi"), [5, 6])
    with pytest.raises(ValueError, match="empty"):
        validate(manager, GenerateReqInput(text=""), [])
    with pytest.raises(ValueError, match="contains 512"):
        validate(manager, GenerateReqInput(input_ids=[1, 512]), [1, 512])
    assert seen == [[5, 6]]  # SGLang's validation ran only for the good request
    validate(manager, GenerateReqInput(input_ids=[], session_params={"id": "s"}), [])

    assert patch.apply() and patch.apply()
    method = TokenizerManager._validate_one_request
    assert method._sgl_spec_prompt_validation
    assert not hasattr(method.__wrapped__, "_sgl_spec_prompt_validation")  # wrapped once


def test_standalone_full_context_window_slots_and_seq_len_shift() -> None:
    from types import SimpleNamespace

    from sgl_spec.standalone.draft import shift_seq_lens, window_slots

    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)  # row r, column c -> 10r + c
    slots = window_slots(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 7]), 3)
    assert slots.tolist() == [23, 24, 25, 7, 8, 9]
    assert slots.dtype == torch.int64
    batch = SimpleNamespace(
        seq_lens=torch.tensor([3, 7]), seq_lens_cpu=torch.tensor([3, 7]), seq_lens_sum=10
    )
    shift_seq_lens(batch, 1)
    assert batch.seq_lens.tolist() == [4, 8] and batch.seq_lens_cpu.tolist() == [4, 8]
    assert batch.seq_lens_sum == 12
    shift_seq_lens(batch, -1)
    assert batch.seq_lens.tolist() == [3, 7] and batch.seq_lens_sum == 10
    gpu_only = SimpleNamespace(seq_lens=torch.tensor([5]), seq_lens_cpu=None, seq_lens_sum=None)
    shift_seq_lens(gpu_only, 1)
    assert gpu_only.seq_lens.tolist() == [6] and gpu_only.seq_lens_cpu is None


def test_cpu_graph_fakes_skip_ops_that_do_not_exist(monkeypatch) -> None:
    import importlib

    from sgl_spec.patches import cpu_graph_fakes

    module = importlib.import_module(cpu_graph_fakes.TARGET)
    seen: list[str] = []

    def upstream(op_name: str):
        seen.append(op_name)
        return lambda fn: "registered"

    monkeypatch.setattr(module, "register_cpu_compile_fake", upstream)
    assert cpu_graph_fakes.apply()
    assert not cpu_graph_fakes.apply()  # idempotent
    patched = module.register_cpu_compile_fake
    assert patched("no_such_op_anywhere")(len) is len  # nothing registered, no error
    assert patched("rmsnorm_cpu")(len) == "registered"  # defined (ours or native): upstream
    assert seen == ["rmsnorm_cpu"]


def test_cpu_draft_selection_runs_eagerly(monkeypatch) -> None:
    """CPU tensors take the function torch.compile wrapped (no compile mid-serving), with the
    same result; other devices keep the compiled one."""
    import importlib

    import torch

    from sgl_spec.patches import cpu_eager_draft_select as patch

    module = importlib.import_module(patch.TARGET)
    compiled_calls: list[str] = []

    def eager(i, topk_p, topk_index, hidden_states, scores, topk):
        return ("eager", i, topk)

    def compiled(*args):
        compiled_calls.append(args[1].device.type)
        return "compiled"

    compiled._torchdynamo_orig_callable = eager
    monkeypatch.setattr(module, patch.NAME, compiled)
    patch.check()
    assert patch.apply()
    assert not patch.apply()  # idempotent
    patch.check()  # a patched module still passes
    cpu = torch.zeros(2, 2)
    assert module.select_top_k_tokens(1, cpu, cpu.long(), None, cpu, 2) == ("eager", 1, 2)
    meta = torch.zeros(2, 2, device="meta")
    assert module.select_top_k_tokens(2, meta, meta.long(), None, meta, 2) == "compiled"
    assert compiled_calls == ["meta"]
    monkeypatch.setattr(module, patch.NAME, eager)  # not compiled (e.g. disabled): left alone
    patch.check()
    assert not patch.apply() and getattr(module, patch.NAME) is eager
    monkeypatch.delattr(module, patch.NAME)
    with pytest.raises(RuntimeError, match="is gone"):
        patch.check()


def test_the_real_draft_selection_is_patched_to_eager_on_cpu() -> None:
    import importlib

    import torch

    from sgl_spec.patches import cpu_eager_draft_select as patch

    module = importlib.import_module(patch.TARGET)
    patch.check()
    patch.apply()
    scores = torch.tensor([[0.5, 0.2]])
    topk_p = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    topk_index = torch.tensor([[5, 6], [7, 8]])
    hidden = torch.arange(4.0).view(2, 2)
    ids, states, *_ = module.select_top_k_tokens(1, topk_p, topk_index, hidden, scores, 2)
    # scores x p: [[0.45, 0.05], [0.06, 0.14]] -> the best two are 5 (row 0) then 8 (row 1)
    assert ids.tolist() == [5, 8]
    assert torch.equal(states, hidden[[0, 1]])


def test_a_patch_whose_target_changed_refuses_to_start(monkeypatch) -> None:
    from types import SimpleNamespace

    import sgl_spec.patches as patches

    def check() -> None:
        raise RuntimeError("upstream_fn is gone")

    fake = SimpleNamespace(
        __name__="sgl_spec.patches.fake",
        TARGET="sglang.srt.somewhere",
        enabled=lambda config: True,
        check=check,
        apply=lambda: pytest.fail("applied despite a failed check"),
    )
    monkeypatch.setattr(patches, "all_patches", lambda: [fake])
    with pytest.raises(patches.PatchMismatch, match=r"patch fake .* sglang\.srt\.somewhere"):
        patches.apply_patches(SpecConfig())
    monkeypatch.setattr(fake, "enabled", lambda config: False)
    assert patches.apply_patches(SpecConfig()) == []  # a disabled patch is not checked


@pytest.mark.parametrize("which", ["native", "mkl"])
def test_cpu_packed_linear_is_row_invariant_and_follows_weight_updates(which: str) -> None:
    from sgl_spec.patches import cpu_packed_linear as patch

    if not patch.available(which):
        pytest.skip(f"no {which} kernel on this host: the patch stands aside")
    method = patch._module().UnquantizedLinearMethod()
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(512, 512) * 0.05, requires_grad=False)
    original_apply = patch._module().UnquantizedLinearMethod.apply
    patch.pack(layer, which)
    assert layer._sgl_spec_packed.kind == which
    x = torch.randn(3, 7, 512)
    bias = torch.randn(512)
    out = patch.packed_linear(layer, x, bias)
    assert out.shape == (3, 7, 512)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, bias))
    # a row's result is the same among 4 rows as among 21 (F.linear switches kernels with rows)
    rows = x.reshape(-1, 512)
    fours = torch.cat([patch.packed_linear(layer, rows[i : i + 4], bias) for i in range(0, 20, 4)])
    assert torch.equal(fours, out.reshape(-1, 512)[:20])
    if which == "native":  # every row count up to the limit, one row alone included
        ones = torch.cat([patch.packed_linear(layer, rows[i : i + 1], bias) for i in range(21)])
        assert torch.equal(ones, out.reshape(-1, 512))
        many = torch.randn(patch.native_max_rows() + 1, 512)
        assert patch.packed_linear(layer, many, None) is None  # prefill-sized: F.linear's path
    else:
        assert patch.packed_linear(layer, rows[:3], bias) is None  # few rows: F.linear's path
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place update: packed again before the next use
    torch.testing.assert_close(
        patch.packed_linear(layer, x, None), torch.nn.functional.linear(x, layer.weight)
    )
    assert patch.packed_linear(layer, x.double(), None) is None  # other dtypes: upstream path
    bf16 = torch.nn.Module()
    bf16.weight = torch.nn.Parameter(torch.randn(8, 8).bfloat16(), requires_grad=False)
    patch.pack(bf16, which)
    assert not hasattr(bf16, "_sgl_spec_packed")
    # the wrapped apply answers through the packed weight; unpacked layers keep upstream's
    wrapped = patch.applying(original_apply)
    torch.testing.assert_close(
        wrapped(method, layer, x, bias), out * 0 + patch.packed_linear(layer, x, bias)
    )
    plain = torch.nn.Module()
    plain.weight = torch.nn.Parameter(torch.randn(96, 512), requires_grad=False)
    torch.testing.assert_close(
        wrapped(method, plain, x), torch.nn.functional.linear(x, plain.weight)
    )


def test_native_packed_linear_odd_shapes_and_bias() -> None:
    """Output widths that are not a multiple of the kernel's block, every row count of a tile
    and past it: the same as F.linear to float32 rounding, each row as computed alone."""
    from sgl_spec.patches import cpu_packed_linear as patch

    if not patch.available("native"):
        pytest.skip("native CPU kernels not built here")
    ops = torch.ops.sgl_spec_native
    weight, bias = torch.randn(1000, 300) * 0.05, torch.randn(1000)
    packed = ops.pack_linear_weight(weight)
    x = torch.randn(40, 300)
    single = torch.cat([ops.packed_linear(x[i : i + 1], packed, 1000, bias) for i in range(40)])
    for rows in (1, 2, 5, 7, 16, 17, 33, 40):
        got = ops.packed_linear(x[:rows].contiguous(), packed, 1000, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x[:rows], weight, bias))
        assert torch.equal(got, single[:rows])
    with pytest.raises(RuntimeError, match="packed_linear shapes"):
        ops.packed_linear(x[:, :299].contiguous(), packed, 1000, None)


def test_cpu_packed_linear_switch(monkeypatch) -> None:
    from sgl_spec.patches import cpu_packed_linear as patch

    for value, expected in (("0", None), ("off", None), ("1", "mkl"), ("mkl", "mkl")):
        monkeypatch.setenv(patch.ENV_SWITCH, value)
        assert patch.kind() == expected
        assert patch.enabled(SpecConfig()) is (expected is not None)
    monkeypatch.setenv(patch.ENV_SWITCH, "native")
    assert patch.kind() == "native"
    monkeypatch.setenv(patch.ENV_SWITCH, "fast")
    with pytest.raises(ValueError, match="expected auto, native, mkl or 0"):
        patch.kind()
    monkeypatch.delenv(patch.ENV_SWITCH)
    # by default: the native kernel where it is built and the CPU has AVX-512 or AVX2 + FMA
    expected = "native" if patch.available("native") and patch.has_vector_fma() else None
    assert patch.kind() == expected
    monkeypatch.setenv(patch.ENV_SWITCH, "1")
    assert patch.enabled(SpecConfig())


def test_standalone_full_is_served_as_sglang_standalone_with_our_draft_worker() -> None:
    """The launcher passes SGLang STANDALONE for STANDALONE_FULL and records the choice;
    SGLang's own STANDALONE is left as SGLang's. The hook (in a fresh process: it replaces
    SGLang's class for the whole process) makes SGLang's worker build our subclass."""
    import subprocess
    import sys

    from sgl_spec.algorithms import prepare_launch
    from sgl_spec.argv import flag_value

    cpu = ["--device", "cpu"]
    for name, ours in (("STANDALONE_FULL", True), ("STANDALONE", False)):
        config, argv = prepare_launch(["--speculative-algorithm", name, *cpu])
        assert flag_value(argv, "--speculative-algorithm") == "STANDALONE"
        assert config.standalone_full_context is ours
    config, _ = prepare_launch(cpu)  # the launcher's default
    assert config.standalone_full_context
    code = (
        "from sglang.srt.speculative import standalone_worker_v2 as m\n"
        "upstream = [m.StandaloneDraftWorker]  # a list: the hook rebinds module globals\n"
        "from sgl_spec.standalone import hook\n"
        "from sgl_spec.standalone.draft import FullContextDraftWorker as F\n"
        "hook.check(); assert hook.apply() and hook.apply()\n"
        "assert m.StandaloneDraftWorker is F and F.__mro__[1] is upstream[0]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_cpu_packed_lm_head_takes_the_plain_float32_head_only(monkeypatch) -> None:
    """The wrapped ``_compute_lm_head``: a plain float32 head is packed on first use and its
    logits are row-invariant (a row's logits alone equal its logits among 5); a head upstream
    treats otherwise (LoRA-wrapped, fp32 upcast, another dtype) keeps upstream's path."""
    from types import SimpleNamespace

    from sgl_spec.patches import cpu_packed_linear as patch
    from sgl_spec.patches import cpu_packed_lm_head as lm_head

    if not patch.available("native"):
        pytest.skip("native CPU kernels not built here")
    lm_head.check()
    calls = []

    def upstream(self, hidden, head, embedding_bias=None, *, out=None):
        calls.append(head)
        return hidden.to(head.weight.dtype) @ head.weight.T

    compute = lm_head.computing(upstream, patch.pack, patch.packed_linear)
    processor = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(300, 64), requires_grad=False)
    hidden = torch.randn(5, 64)
    monkeypatch.setenv(patch.ENV_SWITCH, "native")
    logits = compute(processor, hidden, head)
    assert calls == [] and head._sgl_spec_packed is not None
    torch.testing.assert_close(logits, hidden @ head.weight.T)
    alone = torch.cat([compute(processor, hidden[i : i + 1], head) for i in range(5)])
    assert torch.equal(alone, logits)
    compute(SimpleNamespace(use_fp32_lm_head=True, rl_on_policy_target=None), hidden, head)
    assert calls == [head]
    lora = torch.nn.Module()
    lora.weight, lora.set_lora, lora.apply_lora = head.weight, None, None
    compute(processor, hidden, lora)
    compute(processor, hidden.double(), head)
    assert calls == [head, lora, head]
