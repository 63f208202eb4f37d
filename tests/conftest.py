import pytest
import torch

from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="session")
def model():
    """A small random GQA model (4 query heads, 2 K/V heads) for the generation and cache tests."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   hidden_dim=128)).eval()
