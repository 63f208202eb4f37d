"""kvlib.course.ch07: chapter 07's harnesses measure what the notebook says they measure."""

import math

import pytest
import torch

from kvlib.course import ch07, figures
from kvlib.memory import spec
from kvlib.model import ModelConfig, Transformer
from kvlib.train import lr_at


def gqa_model(H=6, H_KV=2, seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=32, dim=8 * H, n_layers=2, n_heads=H, n_kv_heads=H_KV,
                                   hidden_dim=64)).eval()


@pytest.mark.parametrize("H, H_KV", [(32, 8), (9, 3), (8, 1), (8, 8)])
def test_schedule_bytes_count_every_load_and_write(H, H_KV):
    D, S, b = 128, 1024, 2
    head = 2 * S * D * b  # K and V of one head
    moved = ch07.schedule_bytes(H, H_KV, D, S, b)
    assert moved == {"repeat K/V": (H_KV + 2 * H) * head, "per query head": H * head, "grouped": H_KV * head}
    assert moved["per query head"] // moved["grouped"] == H // H_KV
    assert moved["repeat K/V"] // moved["grouped"] == 1 + 2 * H // H_KV


def test_kind_table_names_each_config():
    t = ch07.kind_table()
    for _, row in t.iterrows():
        h, g = row["H (query heads)"], row["H_KV (K/V heads)"]
        assert row["kind"] == ("MHA" if g == h else "MQA" if g == 1 else "GQA")
        assert row["saving (H-H_KV)/H"] == round((h - g) / h, 3)


def test_kernel_errors_are_small_on_a_ragged_cache():
    errors = ch07.kernel_errors(B=2, H=4, H_KV=2, S=20, D=16, lens=(20, 7))
    assert len(errors) == 3 and max(errors.values()) < 1e-5


def test_mapped_attention_with_h_div_n_rep_is_the_model_itself():
    model = gqa_model()
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    right, wrong = [h // 3 for h in range(6)], [h % 2 for h in range(6)]
    plain = ch07.next_token_scores(model, ids)
    assert ch07.next_token_scores(model, ids, right) == pytest.approx(plain, abs=1e-5)
    assert ch07.next_token_scores(model, ids, wrong)[0] != pytest.approx(plain[0], abs=1e-4)
    capture = ch07.CaptureQKV(1)
    with torch.no_grad():
        model(ids, cache=capture)
    q, k, v = capture.qkv
    assert q.shape == (1, 6, 12, 8) and k.shape == v.shape == (1, 2, 12, 8)


def test_lr_schedule_warms_up_then_decays_to_the_end_rate():
    rates = [ch07.lr_schedule(s, 100, 5e-4, 5e-5, 10) for s in range(100)]
    assert rates[0] == pytest.approx(5e-5) and rates[9] == pytest.approx(5e-4)  # linear warm-up over 10 steps
    assert rates[10] == pytest.approx(5e-4) and rates[-1] == pytest.approx(5e-5)  # cosine from the peak to the end
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))


def test_finetune_scheduled_at_a_constant_rate_is_kvlib_finetune():
    from kvlib.gqa import finetune

    ids = torch.randint(0, 32, (600,), generator=torch.Generator().manual_seed(0))
    a, b = gqa_model(), gqa_model()
    la = finetune(a, ids, steps=3, batch=2, seq_len=16, lr=1e-3)
    lb = ch07.finetune_scheduled(b, ids, steps=3, batch=2, seq_len=16, peak_lr=1e-3, end_lr=1e-3, warmup=0)
    assert la == pytest.approx(lb, abs=1e-6)  # the same batches, the same steps


def test_conversion_quality_table_and_figure():
    torch.manual_seed(0)
    mha = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, hidden_dim=64)).eval()
    ids = torch.randint(0, 32, (1200,), generator=torch.Generator().manual_seed(0))
    t = ch07.conversion_quality(mha, ids, ids, heads=(2, 1), steps=3, batch=2, seq=16, warmup=1)
    assert list(t["K/V heads"]) == [4, 4, 2, 1]
    assert t.index[0].startswith("original") and t.index[1].startswith("control")
    assert t["agreement after"].iloc[0] == 1.0 and t.attrs["windows"] == (len(ids) - 1) // 128  # every window
    orig, ctl = t["val loss after"].iloc[0], t["val loss after"].iloc[1]
    assert (t["val loss before"].iloc[:2] == orig).all()  # the control starts from the original
    assert t["after vs original (%)"].tolist() == pytest.approx((100 * (t["val loss after"] - orig) / orig).tolist())
    assert t["after vs control (%)"].tolist() == pytest.approx((100 * (t["val loss after"] - ctl) / ctl).tolist())
    log = {"steps": 30, "batch": 4, "seq_len": 32}
    line = ch07.budget_line(t, log)
    assert "3 steps of 2 x 16 bytes = 2.50% of the pre-training bytes" in line  # 96 / 3,840 bytes
    assert "would be 6 steps of this batch" in line  # 5% of 3,840 bytes in batches of 32
    assert all(len(part.split()) <= 30 for part in line.splitlines())  # the form: short printed lines
    assert "held out: all 9 windows of 128 bytes" in line
    few = ch07.conversion_quality(mha, ids, ids, heads=(1,), steps=1, batch=2, seq=16, warmup=1, windows=4)
    assert (few.attrs["windows"], few.attrs["all_windows"]) == (4, 9)
    assert "held out: 4 evenly spaced of its 9 windows of 128 bytes" in ch07.budget_line(few, log)
    fig = ch07.plot_quality(t, unigram=3.0)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert sum("after the fine-tune" in s for s in labels) == 1 and sum("control" in s for s in labels) == 1
    assert figures.figure_problems(fig) == []


def test_grouped_vs_per_head_reads_both_kernels_at_each_size():
    rows = [dict(sweep="grouped", kernel=k, H=32, H_KV=8, B=B, S=S, time_ms=t)
            for k, B, S, t in (("grouped decode", 1, 4096, 2.0), ("per-query-head decode", 1, 4096, 1.0),
                               ("grouped decode", 8, 65536, 1.0), ("per-query-head decode", 8, 65536, 4.0),
                               ("repeat K/V + decode", 8, 65536, 9.0))]
    (line,) = ch07.grouped_vs_per_head(rows, label="GPU")
    assert "over 2 sizes: 0.50-4.00x" in line and "at most 1.1x at: B=1 S=4,096 (0.50x)" in line


def test_kernel_excerpt_shows_the_query_load_the_loop_and_the_store():
    text = ch07.kernel_excerpt()
    assert "q = tl.load(" in text and "for pos0" in text and "tl.store(o_ptr" in text and "g_ok" in text


def test_hf_gqa_branches_show_their_conditions():
    pytest.importorskip("transformers")
    text = ch07.hf_gqa_branches()
    if text is None:
        pytest.skip("this transformers version chooses elsewhere")
    assert "if use_gqa_in_sdpa(" in text and "elif q_length == 1" in text and "else:" in text
    assert "enable_gqa" in text and "pack_gqa(query" in text and "repeat_kv(key" in text


def test_tp_table_follows_get_num_kv_heads():
    t = ch07.tp_table(spec("Llama-3-8B"), tps=(1, 8, 16))
    assert t["K/V heads per GPU"].tolist() == [8, 1, 1]  # max(1, 8 // TP)
    assert t["copies of each K/V head"].tolist() == [1, 1, 2]
    per_gpu = t["KV bytes/token per GPU"]
    assert per_gpu.loc[1] == spec("Llama-3-8B").kv_bytes_per_token("fp16") and per_gpu.loc[8] == per_gpu.loc[16]
    assert t.loc[16, "KV bytes/token, all GPUs"] == 2 * t.loc[8, "KV bytes/token, all GPUs"]


def test_tiny_train_log_final_lr():
    log = ch07.tiny_train_log()
    assert log["final_lr"] == lr_at(log["steps"], log["steps"], log["peak_lr"], 0)


def test_hf_twin_caches_kv_heads_and_matches_logits():
    pytest.importorskip("transformers")
    model = gqa_model()
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(2))
    cfg, err, k0, branches = ch07.hf_twin(model, ids)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (6, 2)
    assert tuple(k0.shape) == (1, 2, 9, 8) and err < 1e-4
    assert sum(branches.values()) == 2  # one GQA choice per layer's attention call


def test_hf_twin_read_from_the_models_saved_checkpoint_is_the_same_twin(tmp_path):
    pytest.importorskip("transformers")
    from kvlib.model import save_hf

    model = gqa_model()
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(2))
    written = ch07.hf_twin(model, ids)
    save_hf(model, tmp_path)
    read = ch07.hf_twin(model, ids, folder=tmp_path)
    config = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731  (the folder)
    assert config(read[0]) == config(written[0]) and read[1] == written[1]  # config, |logits - ours|
    assert torch.equal(read[2], written[2]) and read[3] == written[3]  # the cached keys, the GQA branches taken
    other = gqa_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    save_hf(other, tmp_path / "other")
    assert ch07.hf_twin(model, ids, folder=tmp_path / "other")[1] > 1e-3  # other weights: the logits show it
