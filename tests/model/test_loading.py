"""Loading checkpoints: HF models give HF's logits, nanolab checkpoints round-trip, bad input fails clearly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_models import KINDS, VOCAB, save_tiny_hf_model, tiny_hf_model
from safetensors.torch import load_file, save_file

import nanolab.model.loading
from nanolab.model.config import ModelConfig
from nanolab.model.generate import generate
from nanolab.model.hf import save_hf, to_hf
from nanolab.model.loading import load_model, load_tokenizer, resolve_checkpoint, save_model
from nanolab.model.transformer import Transformer


@pytest.fixture(scope="module", params=KINDS)
def hf_checkpoint(request, tmp_path_factory):
    """(kind, HF model, directory it was saved to)."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, save_tiny_hf_model(request.param, path), path


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


def test_hf_checkpoint_gives_the_same_logits_as_transformers(hf_checkpoint):
    kind, hf_model, path = hf_checkpoint
    model = load_model(path)
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(ids)
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), atol=1e-4, rtol=0)
    assert ours.std() > 0.1, "logits this flat would make the comparison meaningless"


def test_hf_config_is_translated_field_by_field(hf_checkpoint):
    kind, hf_model, path = hf_checkpoint
    config = load_model(path).config
    c = hf_model.config
    assert (config.vocab_size, config.n_layers, config.d_model) == (VOCAB, c.num_hidden_layers, c.hidden_size)
    assert config.arch == ("gpt2" if kind == "gpt2" else "llama")
    assert config.tie_embeddings == (kind in ("gpt2", "llama_tied"))
    assert config.qkv_bias == (kind == "qwen2")
    if kind != "gpt2":
        assert (config.n_kv_heads, config.rope_theta) == (2, 1000.0)


def test_nanolab_checkpoint_round_trips_exactly(hf_checkpoint, tmp_path):
    kind, _, path = hf_checkpoint
    model = load_model(path)
    save_model(model, tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["nanolab_format"] == 1 and raw["arch"] == model.config.arch
    again = load_model(tmp_path / "ckpt")
    assert again.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not model.config.tie_embeddings)  # a tied matrix is stored once


def test_to_hf_gives_identical_logits_and_save_hf_reloads_identically(hf_checkpoint, tmp_path):
    kind, _, path = hf_checkpoint
    model = load_model(path)
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        ours = model.logits(ids)
    torch.testing.assert_close(
        hf_logits(to_hf(model, attn_implementation="eager"), ids), ours, atol=1e-5, rtol=0
    )
    save_hf(model, tmp_path / "hf")
    again = load_model(tmp_path / "hf")
    assert again.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_a_fresh_nanolab_model_survives_to_hf_both_families(tmp_path):
    torch.manual_seed(0)
    for config in (ModelConfig(arch="gpt2", vocab_size=50, d_model=32, n_heads=2, n_kv_heads=2, max_seq_len=32),
                   ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=32)):  # fmt: skip
        model = Transformer(config).eval()
        ids = torch.randint(0, 50, (2, 12))
        with torch.no_grad():
            torch.testing.assert_close(hf_logits(to_hf(model), ids), model.logits(ids), atol=1e-4, rtol=0)


def test_original_gpt2_names_without_the_transformer_prefix_load(tmp_path):
    save_tiny_hf_model("gpt2", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    stripped = {k.removeprefix("transformer."): v for k, v in state.items()}
    stripped |= {f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64) for i in range(2)}  # buffers old files carry
    save_file(stripped, tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert torch.equal(model.tok_emb.weight, state["transformer.wte.weight"])


def test_sharded_and_pytorch_bin_checkpoints_load(tmp_path):
    hf_model = tiny_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
    ids = torch.randint(0, VOCAB, (1, 16))
    for path in (tmp_path / "sharded", bin_dir):
        with torch.no_grad():
            torch.testing.assert_close(
                load_model(path).logits(ids), hf_logits(hf_model, ids), atol=1e-4, rtol=0
            )


def test_load_model_converts_to_the_requested_dtype_and_still_runs(hf_checkpoint):
    _, hf_model, path = hf_checkpoint
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        logits = model.logits(ids)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), hf_logits(hf_model, ids), atol=0.15, rtol=0.05)
    assert len(generate(model, None, ids[0].tolist(), max_new_tokens=3).token_ids) == 3


def test_mistral_sliding_window_caps_max_seq_len_with_a_warning(tmp_path):
    save_tiny_hf_model("mistral", tmp_path)  # window 32, max_position_embeddings 64
    with pytest.warns(UserWarning, match="sliding window 32"):
        model = load_model(tmp_path)
    assert model.config.max_seq_len == 32


# ---- errors ---------------------------------------------------------------------------------------


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_dir(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(architectures=["BertForMaskedLM"], model_type="bert"),
            "architecture 'BertForMaskedLM'.*not supported",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
            "RoPE scaling 'llama3'",
        ),
        (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "RoPE scaling 'linear'"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(num_key_value_heads=3), "multiple of n_kv_heads"),
        (dict(intermediate_size=None), "missing 'intermediate_size'"),
    ],
)
def test_unsupported_hf_configs_are_refused_naming_the_file_and_option(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(ValueError, match=message) as info:
        load_model(llama_dir)
    assert "config.json" in str(info.value)


def test_old_style_rope_theta_is_read(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 1000.0, "rope_scaling": None}
    (llama_dir / "config.json").write_text(json.dumps(config))
    assert load_model(llama_dir).config.rope_theta == 1000.0


def test_missing_and_unexpected_tensors_are_named(llama_dir):
    state = load_file(llama_dir / "model.safetensors")
    weights = llama_dir / "model.safetensors"
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(llama_dir)
    save_file({**state, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, weights)
    with pytest.raises(ValueError, match="q_norm"):
        load_model(llama_dir)


def test_missing_files_are_reported_with_what_to_do(tmp_path, llama_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is not a model checkpoint: it has no config.json"):
        load_model(tmp_path / "empty")
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights: expected model.safetensors"):
        load_model(llama_dir)
    with pytest.raises(FileNotFoundError, match="nanolab never downloads"):
        load_model("meta-llama/Llama-3.2-1B")
    (tmp_path / "plain.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="pass the checkpoint directory"):
        load_model(tmp_path / "plain.json")


def test_a_config_that_is_neither_format_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ValueError, match="neither a nanolab checkpoint"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)


def test_nanolab_checkpoint_errors_name_the_file(tmp_path):
    model = Transformer(ModelConfig(vocab_size=40, d_model=32, max_seq_len=16))
    save_model(model, tmp_path)
    edit_config(tmp_path, d_model=64)
    with pytest.raises(ValueError, match="model.safetensors.*has shape"):
        load_model(tmp_path)
    edit_config(tmp_path, nanolab_format=2)
    with pytest.raises(ValueError, match="format 2"):
        load_model(tmp_path)
    edit_config(tmp_path, nanolab_format=1, n_experts=8)
    with pytest.raises(ValueError, match="unknown ModelConfig keys \\['n_experts'\\]"):
        load_model(tmp_path)


def test_bare_names_and_none_resolve_to_bundled_models(tmp_path, monkeypatch):
    monkeypatch.setattr(nanolab.model.loading, "ASSETS_DIR", tmp_path / "assets")
    with pytest.raises(FileNotFoundError, match="bundled model .*tinypy is not there"):
        load_model()
    model = Transformer(ModelConfig(vocab_size=40, d_model=32, max_seq_len=16))
    save_model(model, tmp_path / "assets" / "tinypy")
    assert resolve_checkpoint() == resolve_checkpoint("tinypy") == tmp_path / "assets" / "tinypy"
    assert load_model().config == load_model("tinypy").config == model.config
    with pytest.raises(FileNotFoundError, match=r"bundled: \['tinypy'\]"):
        load_model("tinypi")


def test_load_tokenizer_returns_none_without_a_tokenizer_file_and_the_tokenizer_with_one(tmp_path):
    model = Transformer(ModelConfig(vocab_size=300, d_model=32, max_seq_len=16))
    save_model(model, tmp_path / "bare")
    assert load_tokenizer(tmp_path / "bare") is None
    tokenizer_module = pytest.importorskip("nanolab.text.tokenizer")
    tok = tokenizer_module.Tokenizer.train(
        "def f(x):\n    return x\n" * 20, 265, special_tokens=["<|endoftext|>"]
    )
    save_model(model, tmp_path / "with", tokenizer=tok)
    assert (tmp_path / "with" / "nanolab_tokenizer.json").exists()
    loaded = load_tokenizer(tmp_path / "with")
    assert loaded.encode("def g(y): return y") == tok.encode("def g(y): return y")
    assert loaded.eos_token_id == tok.eos_token_id is not None
