import matplotlib

matplotlib.use("Agg")

import time

import torch

from kvlib import bench, runtime


def test_time_ms_measures_a_known_sleep():
    ms = bench.time_ms(lambda: time.sleep(0.004), warmup=1, rep=5)
    assert 3.5 <= ms <= 50


def test_tensor_bytes_counts_shared_storage_once():
    a = torch.zeros(10, 4)  # 160 bytes
    view = a[2:5]
    b = torch.zeros(3, dtype=torch.float16)  # 6 bytes
    assert bench.tensor_bytes(a) == 160
    assert bench.tensor_bytes([a, view, {"b": b}]) == 166


def test_tensor_bytes_of_a_module_with_tied_weights():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    assert bench.tensor_bytes(torch.nn.ModuleList([emb, head])) == 10 * 8 * 4


def test_copy_bandwidth_is_positive_and_plausible():
    bw = bench.copy_bandwidth_gbps(8 * 2**20)
    assert 0.1 < bw < 100_000


def test_gbps_units():
    assert bench.gbps(2e9, 1000.0) == 2.0


def test_peak_memory_is_gpu_only():
    result = bench.peak_memory_bytes(lambda: torch.empty(1024, device=runtime.DEVICE))
    if runtime.DEVICE == "cpu":
        assert result is None
    else:
        assert result >= 4096


def test_plot_curves_labels_units_and_device():
    ax = bench.plot_curves([1, 2, 4], {"a": [1.0, 2.0, None], "b": [3.0, 2.0, 1.0]}, xlabel="tokens",
                           ylabel="time (ms)", title="demo", reference={"gpu": ([1, 2], [0.1, 0.2])},
                           reference_device="H200")
    assert ax.get_xlabel() == "tokens" and ax.get_ylabel() == "time (ms)"
    assert runtime.device_name() in ax.get_title()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a", "b", "gpu [H200]"]
    assert len(ax.lines[0].get_xdata()) == 2  # the None point is skipped


def test_plot_curves_labels_the_plotted_sizes_as_plain_numbers():
    """A log2 axis of sizes reads 1,024 and 4,096 at the measured points, not 2^10 .. 2^17 between them."""
    ax = bench.plot_curves([1024, 4096, 131072], {"a": [1, 2, 3]}, xlabel="S", ylabel="ms", title="t")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1,024", "4,096", "131,072"]
    ax = bench.plot_curves(None, {"a": ([256, 512], [1, 2]), "b": ([1024], [3])}, xlabel="S", ylabel="ms", title="t")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "512", "1,024"]
    matplotlib.pyplot.close("all")
