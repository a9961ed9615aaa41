"""Embedded default models: registry, shipped weights, tokenizer, corpus and training determinism."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from sgl_spec.models.build import corpus, specs
from sgl_spec.models.build.data import encode_stream, sample_batch
from sgl_spec.models.build.export import load_model_dir
from sgl_spec.models.build.tokenizer import RESERVED_TOKENS, SPECIAL_TOKENS, load_tokenizer
from sgl_spec.models.build.trainer import TrainConfig, lm_loss, train
from sgl_spec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, is_shipped, resolve_model_path
from sgl_spec.training.acceptance import acceptance_rates, expected_acceptance_length

PROMPT = "import os\n\n\ndef read_file(path):\n    with open(path) as f:\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path(DEFAULT_TARGET))


@pytest.fixture(scope="module")
def shipped_models():
    return load_model_dir(resolve_model_path(DEFAULT_TARGET)), load_model_dir(
        resolve_model_path(DEFAULT_DRAFT)
    )


# --- registry -------------------------------------------------------------------------------


def test_known_names_resolve_to_shipped_dirs():
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        path = Path(resolve_model_path(name))
        assert path.is_absolute() and (path / "config.json").is_file()
        assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
        assert is_shipped(name) and is_shipped(path)
    assert resolve_model_path(DEFAULT_TARGET) != resolve_model_path(DEFAULT_DRAFT)


def test_existing_dir_passes_through(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path.resolve())
    assert not is_shipped(tmp_path)
    assert not is_shipped("no/such/dir")


@pytest.mark.parametrize("bad", ["sgl-spec/tiny-cod", "sgl-spec/", "/nonexistent/model/dir", ""])
def test_bad_names_and_paths_are_refused_clearly(bad):
    with pytest.raises(ValueError) as err:
        resolve_model_path(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    assert DEFAULT_TARGET in msg and DEFAULT_DRAFT in msg


def test_broken_installation_is_reported(tmp_path, monkeypatch):
    from sgl_spec.models import registry

    monkeypatch.setitem(registry.SHIPPED_MODELS, DEFAULT_DRAFT, tmp_path / "gone")
    with pytest.raises(ValueError, match="missing its files"):
        resolve_model_path(DEFAULT_DRAFT)


def test_file_instead_of_dir_is_refused(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(f))


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_model_dir(tmp_path)


# --- shipped models -----------------------------------------------------------------------------


def test_shipped_configs_are_consistent():
    cfg_t = json.loads((Path(resolve_model_path(DEFAULT_TARGET)) / "config.json").read_text())
    cfg_d = json.loads((Path(resolve_model_path(DEFAULT_DRAFT)) / "config.json").read_text())
    assert cfg_t["architectures"] == ["LlamaForCausalLM"] == cfg_d["architectures"]
    assert cfg_t["vocab_size"] == cfg_d["vocab_size"]
    assert cfg_t["num_hidden_layers"] > cfg_d["num_hidden_layers"]
    t_dir, d_dir = Path(resolve_model_path(DEFAULT_TARGET)), Path(resolve_model_path(DEFAULT_DRAFT))
    assert (t_dir / "tokenizer.json").read_bytes() == (d_dir / "tokenizer.json").read_bytes()
    total_mb = sum(p.stat().st_size for d in (t_dir, d_dir) for p in d.glob("*.safetensors")) / 1e6
    assert total_mb <= 64


def test_shipped_models_generate_plausible_code(shipped_models, tok):
    target, draft = shipped_models
    assert next(target.parameters()).dtype == torch.float32
    ids = torch.tensor([tok.encode(PROMPT)])
    for model in (target, draft):
        out = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 6, tok.decode(new)  # not one token repeated
        assert any(ch.isalpha() for ch in tok.decode(new))
    assert specs.count_parameters(target) > 3 * specs.count_parameters(draft)


def test_draft_agrees_with_target_on_code(shipped_models, tok):
    """A weak but failing-capable check of the distillation: agreement far above chance."""
    target, draft = shipped_models
    ids = torch.tensor([tok.encode(inspect.getsource(corpus.split_of))])
    with torch.no_grad():
        agree = (target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.4  # shipped pair: 0.58 on this snippet; an untrained draft: 0.01


def test_narrow_draft_starts_from_the_targets_projected_embeddings(tok):
    """A draft narrower than the target starts from the embeddings' leading singular directions:
    its token-token score matrix is the best rank-w approximation of the target's."""
    from sgl_spec.models.train import init_draft_from_target

    target = specs.build_model(specs.ModelSpec(32, 1, 2, 64), len(tok), tok.eos_token_id, 0)
    draft = specs.build_model(specs.ModelSpec(16, 1, 2, 32), len(tok), tok.eos_token_id, 1)
    init_draft_from_target(draft, target)
    e_t = target.model.embed_tokens.weight.detach()
    e_d = draft.model.embed_tokens.weight.detach()
    u, s, vh = torch.linalg.svd(e_t, full_matrices=False)
    best = (u[:, :16] * s[:16]) @ (u[:, :16] * s[:16]).T
    assert torch.allclose(e_d @ e_d.T, best, atol=1e-4)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()


# --- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        inspect.getsource(corpus),
        "def f(x):\n\tif x:  \n\t\treturn 'é ✓ 中文'  # trailing spaces  \n\n\n",
        "    \n  x = 1\r\n",
        "<|endoftext|> is plain text here",
    ],
)
def test_tokenizer_round_trip_is_identity(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens_and_chat_template(tok):
    for t in SPECIAL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    assert len(RESERVED_TOKENS) == 16
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- corpus -----------------------------------------------------------------------------------


def _fake_stdlib(root: Path) -> Path:
    for rel, body in {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "test/test_os.py": "assert 0\n",
        "lib2/tests/t.py": "assert 0\n",
        "site-packages/pkg/m.py": "y = 2\n",
        "encodings/cp1252.py": "table = ()\n",
        "notes.txt": "not python\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    return root


def test_corpus_excludes_tests_and_is_deterministic(tmp_path):
    root = _fake_stdlib(tmp_path / "stdlib")
    m1 = corpus.build_corpus(tmp_path / "a", root)
    m2 = corpus.build_corpus(tmp_path / "b", root)
    assert [f["path"] for f in m1["files"]] == ["json/__init__.py", "os.py"]
    assert m1["total_sha256"] == m2["total_sha256"]
    (root / "os.py").write_text("import sys  # changed\n")
    assert corpus.build_corpus(tmp_path / "c", root)["total_sha256"] != m1["total_sha256"]
    texts = corpus.load_split(tmp_path / "a", "train") + corpus.load_split(tmp_path / "a", "eval")
    assert sorted(texts) == ["import sys\n", "x = 1\n"]


def test_split_is_fixed_and_holds_out_some_files():
    splits = [corpus.split_of(f"mod{i}.py") for i in range(400)]
    assert splits == [corpus.split_of(f"mod{i}.py") for i in range(400)]
    assert 5 <= splits.count("eval") <= 40


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        corpus.load_split(tmp_path, "train")


# --- training determinism ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_stream(tok):
    return torch.from_numpy(encode_stream(tok, [inspect.getsource(corpus)]).astype("int64"))


def _tiny_run(tok, stream, seed, steps=6, **kw):
    torch.set_num_threads(1)
    model = specs.build_model(specs.TINY_SPEC, len(tok), tok.eos_token_id, seed)
    cfg = TrainConfig(steps=steps, batch_size=2, seq_len=32, warmup_steps=2, seed=seed)
    return train(model, stream, cfg, lm_loss, progress=False, **kw)


def test_same_seed_same_losses_other_seed_differs(tok, tiny_stream):
    a = _tiny_run(tok, tiny_stream, seed=1)
    b = _tiny_run(tok, tiny_stream, seed=1)
    c = _tiny_run(tok, tiny_stream, seed=2)
    assert len(a) == 6 and a == b
    assert a != c


def test_resume_continues_exactly(tok, tiny_stream, tmp_path):
    ckpt = tmp_path / "tiny.ckpt"
    full = _tiny_run(tok, tiny_stream, seed=3)
    first = _tiny_run(tok, tiny_stream, seed=3, checkpoint=ckpt, stop_after=3)
    assert first == full[:3]
    resumed = _tiny_run(tok, tiny_stream, seed=3, checkpoint=ckpt, resume=True)
    assert resumed == full


def test_resume_may_change_steps_before_decay_only(tok, tiny_stream, tmp_path):
    # 8 steps: warm-up 2, stable until 6, decay 6..8; 12 steps: stable until 9.
    ckpt = tmp_path / "c.ckpt"
    _tiny_run(tok, tiny_stream, seed=4, steps=8, checkpoint=ckpt, stop_after=4)
    longer = _tiny_run(tok, tiny_stream, seed=4, steps=12, checkpoint=ckpt, resume=True)
    assert longer == _tiny_run(tok, tiny_stream, seed=4, steps=12)
    _tiny_run(tok, tiny_stream, seed=4, steps=8, checkpoint=ckpt, stop_after=7, resume=False)
    with pytest.raises(ValueError, match="decay has begun"):
        _tiny_run(tok, tiny_stream, seed=4, steps=12, checkpoint=ckpt, resume=True)


def test_resume_refuses_missing_or_mismatched_checkpoint(tok, tiny_stream, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        _tiny_run(tok, tiny_stream, seed=0, checkpoint=tmp_path / "none.ckpt", resume=True)
    ckpt = tmp_path / "c.ckpt"
    _tiny_run(tok, tiny_stream, seed=0, steps=2, checkpoint=ckpt)
    with pytest.raises(ValueError, match="different hyper-parameters"):
        _tiny_run(tok, tiny_stream, seed=1, steps=2, checkpoint=ckpt, resume=True)


def test_batches_depend_only_on_seed_and_step(tiny_stream):
    from sgl_spec.models.build.data import batch_generator

    x1, y1 = sample_batch(tiny_stream, 4, 16, batch_generator(0, 5))
    x2, _ = sample_batch(tiny_stream, 4, 16, batch_generator(0, 5))
    x3, _ = sample_batch(tiny_stream, 4, 16, batch_generator(0, 6))
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


# --- metrics ----------------------------------------------------------------------------------


def test_acceptance_rates_on_constructed_matches():
    matches = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    rates = acceptance_rates(matches, max_k=3)  # starts s = 0..3 in each row
    # k=1: m[s] holds for 6 of 8 starts; k=2: m[s+1] for 3 of those 6 (row0 s0, s3; row1 s2);
    # k=3: m[s+2] for 1 of those 3 (row0 s3).
    assert rates == pytest.approx([6 / 8, 3 / 6, 1 / 3])
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx([1.5, 1.75])
