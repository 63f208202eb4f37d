"""kvlib.course.draw.lowbit: chapter 09b's pictures show what the live objects hold."""

import matplotlib
import pytest
import torch

from kvlib.course import figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import lowbit as draw_lowbit
from kvlib.kivi import KiviCache
from kvlib.model import ModelConfig, Transformer

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                       hidden_dim=128)).eval()


def _filled(model, n, **kw):
    cache = KiviCache.for_model(model, 1, 64, bits=2, group=8, **kw)
    with torch.no_grad():
        model(torch.arange(n)[None] % 32, cache=cache)
    return cache


@pytest.mark.parametrize("n, residual, flush", [(5, 8, "residual"), (20, 8, "residual"), (20, 8, "group"),
                                                 (37, 16, "residual"), (37, 16, "group")])
def test_kivi_frames_every_group_and_exact_position(model, n, residual, flush):
    cache = _filled(model, n, residual=residual, flush=flush)
    D = model.config.head_dim
    n_kq, n_vq = cache.n_quantized(0)
    fig = draw_lowbit.kivi(cache, layer=1, head=1)
    assert cells_with(fig, "key group") == n_kq // cache.group * D
    assert cells_with(fig, "value group") == n_vq * (D // cache.v_group)
    assert cells_with(fig, "exact key") == n - n_kq and cells_with(fig, "exact value") == n - n_vq
    assert figures.figure_problems(fig) == []


def test_kivi_shows_what_the_cache_gives_back(model):
    """The shaded image is the dequantized keys: within one key group each channel shows at most four levels."""
    cache = _filled(model, 24, residual=8, flush="residual")
    fig = draw_lowbit.kivi(cache, layer=0, head=0)
    img = fig.axes[0].images[0].get_array()  # (D, n, 4) RGBA
    for d in range(img.shape[0]):
        assert len({tuple(px) for px in img[d, :8].tolist()}) <= 4


def test_kivi_changes_with_the_cache(model):
    small, large = _filled(model, 10, residual=8), _filled(model, 40, residual=8)
    assert cells_with(draw_lowbit.kivi(small), "key group") < cells_with(draw_lowbit.kivi(large), "key group")


def test_kivi_refuses_what_it_cannot_draw(model):
    with pytest.raises(TypeError):
        draw_lowbit.kivi(object())
    with pytest.raises(ValueError, match="no positions"):
        draw_lowbit.kivi(KiviCache.for_model(model, 1, 16, bits=2, group=8, residual=8))


def test_energy_is_the_svd_share():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g) @ torch.randn(3, 8, generator=g)  # rank 3
    e = draw_lowbit.energy(x)
    assert e.shape == (8,) and torch.all(e[1:] >= e[:-1] - 1e-6)
    assert e[2].item() == pytest.approx(1.0, abs=1e-6) and e[1].item() < 1.0


def test_low_rank_basis_draws_both_curves_from_the_keys():
    g = torch.Generator().manual_seed(1)
    pre = torch.randn(40, 2, generator=g) @ torch.randn(2, 16, generator=g) + 0.01 * torch.randn(40, 16, generator=g)
    post = torch.randn(40, 16, generator=g)
    fig = draw_lowbit.low_rank_basis(pre, post, rank=4)
    lines = {ln.get_gid(): ln for ln in fig.axes[0].lines if ln.get_gid()}
    assert set(lines) == {"energy before RoPE", "energy after RoPE"}
    assert torch.allclose(torch.tensor(lines["energy before RoPE"].get_ydata()).float(), 100 * draw_lowbit.energy(pre))
    assert [im.get_array().shape for im in fig.axes[1].images + fig.axes[2].images] == [(16, 4), (16, 4)]
    assert figures.figure_problems(fig) == []
    with pytest.raises(ValueError):
        draw_lowbit.low_rank_basis(pre, post[:10], rank=4)
    with pytest.raises(ValueError):
        draw_lowbit.low_rank_basis(pre, post, rank=17)


def test_bit_plans_draws_one_bar_per_layer_and_plan_at_its_bits():
    sens = [0.2, 0.01, 0.05, 0.003]
    plans = {"a": [8, 4, 4, 2], "b": [16, 2, 2, 2]}
    fig = draw_lowbit.bit_plans(sens, plans)
    assert cells_with(fig, "sensitivity") == 4
    assert cells_with(fig, "plan bar") == 8
    heights = [p.get_height() for ax in fig.axes for p in ax.patches if p.get_gid() == "plan bar"]
    assert heights == [8, 4, 4, 2, 16, 2, 2, 2]
    assert figures.figure_problems(fig) == []  # the log axis carries enough labels
    with pytest.raises(ValueError):
        draw_lowbit.bit_plans(sens, {"short": [8, 4]})
