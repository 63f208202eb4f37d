"""kvlib.model against a real peer (transformers' LlamaForCausalLM) and on bad checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlib.model import CheckpointError, ModelConfig, Transformer, load_hf, save_hf

transformers = pytest.importorskip("transformers")

PARITY_CONFIGS = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa-tied-theta5e5": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                              rope_theta=500000.0),
    "mqa-headdim32": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=1234.5),
    "gqa-8-2-llama3-rope": dict(
        num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def make_hf(tmp_path, seed=0, max_shard_size=None, **overrides):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              max_position_embeddings=512)
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # random norms too, so a swapped norm weight would be caught
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    args = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(tmp_path, **args)
    return hf


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf = make_hf(tmp_path, **PARITY_CONFIGS[name])
    ours = load_hf(tmp_path)
    ids = torch.randint(0, 97, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    assert err <= 1e-4, f"{name}: max |logits - HF logits| = {err:.3g}"
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings
    if ours.config.tie_embeddings:
        assert ours.lm_head.weight is ours.tok_emb.weight


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = torch.arange(50)[None] % 97
    with torch.no_grad():
        assert (load_hf(tmp_path)(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_save_hf_roundtrip_and_transformers_reads_it(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                      tie_embeddings=True)
    model = Transformer(cfg).eval()
    save_hf(model, tmp_path)
    ids = torch.randint(0, 61, (3, 33))
    with torch.no_grad():
        ref = model(ids)
        assert torch.equal(load_hf(tmp_path)(ids), ref)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
        assert (hf(ids).logits - ref).abs().max().item() <= 1e-4


def test_left_padding_with_attention_mask_matches_unpadded(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    hidden_dim=96)).eval()
    short = torch.randint(0, 50, (1, 7))
    pad = 5
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, 7)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    with torch.no_grad():
        padded = model(ids, positions=positions, attention_mask=mask)
        alone = model(short)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:, pad:], alone, rtol=1e-5, atol=1e-5)


def test_fp16_model_keeps_rope_frequencies_in_fp32():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=64, n_layers=1, n_heads=4, hidden_dim=96)).half()
    cos, _ = model.rope(torch.tensor([[1000]]), torch.float16)
    assert model.inv_freq.dtype == torch.float32
    exact = torch.cos(1000 * model.inv_freq.double())
    assert (cos[0, 0, : exact.numel()].double() - exact).abs().max() < 2e-3


def test_config_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        ModelConfig(n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(dim=100, n_heads=8)


def test_forward_rejects_wrong_rank():
    model = Transformer(ModelConfig(vocab_size=10, dim=32, n_layers=1, n_heads=2, hidden_dim=64))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(5, dtype=torch.long))


def test_logits_to_keep_gives_the_last_positions_of_the_full_forward():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = model(ids)
        assert model(ids, logits_to_keep=0).shape == (2, 9, 50)
        for n in (1, 3, 9):
            kept = model(ids, logits_to_keep=n)
            assert kept.shape == (2, n, 50)
            torch.testing.assert_close(kept, full[:, -n:], rtol=1e-5, atol=1e-5)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(ids, logits_to_keep=bad)


def test_num_params_matches_the_module():
    for tie in (False, True):
        cfg = ModelConfig(vocab_size=77, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96,
                          tie_embeddings=tie)
        assert cfg.num_params() == sum(p.numel() for p in Transformer(cfg).parameters())


# ---- bad checkpoints: clear errors naming the file, the tensor and the expected shape ----


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_hf(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        load_hf(tmp_path / "nope")


def test_non_llama_architecture(tmp_path):
    make_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not a Llama-family"):
        load_hf(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    make_hf(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(f)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, f)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(112, 64\)"):
        load_hf(tmp_path)


def test_misshaped_tensor_is_named_with_file_and_expected_shape(tmp_path):
    make_hf(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(f)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(state, f)
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors.*k_proj\.weight.*\(32, 64\), expected \(64, 64\)"):
        load_hf(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(tmp_path)


def test_a_cache_that_stores_keys_before_rope_gets_them_unrotated():
    """The seam's second form: with ``keys_before_rope`` the cache receives k before RoPE (q after) and
    rotates the keys itself; rotating them at their positions gives the usual cache's logits."""
    from kvlib.cache import KVCache
    from kvlib.model import rope_cos_sin, rotate

    class RotateOnRead(KVCache):
        keys_before_rope = True
        seen = []

        def attend(self, layer_idx, q, k, v):
            self.seen.append(k.clone())
            pos = self.seq_lens[:, None] + torch.arange(k.shape[2])  # (B, T): where the new tokens sit
            cos, sin = rope_cos_sin(pos, model.inv_freq, k.dtype)
            return super().attend(layer_idx, q, rotate(k, cos[:, None], sin[:, None]), v)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        ref = model(ids, cache=KVCache.for_model(model, 2, 12))
        mine = RotateOnRead.for_model(model, 2, 12)
        got = model(ids[:, :6], cache=mine)
        got = torch.cat([got, model(ids[:, 6:], positions=mine.next_positions().expand(2, 1) + torch.arange(3),
                                    cache=mine)], dim=1)
        layer0 = model.layers[0].attn
        x = model.layers[0].attn_norm(model.tok_emb(ids[:, :6]))
        raw_k = layer0.wk(x).view(2, 6, 2, -1).transpose(1, 2)  # (B, H_KV, T, D) before RoPE
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(RotateOnRead.seen[0], raw_k)
