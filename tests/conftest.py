import copy
import sys

import matplotlib
import pytest
import torch

matplotlib.use("Agg")  # every test draws off screen

from kvlib import runtime
from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="session")
def model():
    """A small random GQA model (4 query heads, 2 K/V heads) for the generation and cache tests."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   hidden_dim=128)).eval()


@pytest.fixture(scope="session")
def device_model(model):
    """The same model on this machine's device: Triton kernels run compiled on a GPU only for CUDA
    tensors (on a CPU this is the CPU model again, and the kernels run in the interpreter)."""
    return copy.deepcopy(model).to(runtime.DEVICE)


@pytest.fixture
def model_for(model, device_model):
    """model_for(kernels): the device model for "triton" (kernels compiled on a GPU), else the CPU one."""
    return lambda kernels: device_model if kernels == "triton" else model


@pytest.fixture(autouse=True)
def _close_figures():
    """Close the figures a test drew (matplotlib keeps every open figure alive until then)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
