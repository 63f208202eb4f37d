import pytest
import torch

from kvlib import runtime
from kvlib.vector_add import add, add_ref


@pytest.mark.parametrize("n", [1, 17, 1000, 1024, 1025, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_matches_torch_on_awkward_sizes(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype).to(runtime.DEVICE)
    y = torch.randn(n, generator=g).to(dtype).to(runtime.DEVICE)
    torch.testing.assert_close(add(x, y, tile=256), x + y, rtol=0, atol=0)
    torch.testing.assert_close(add_ref(x, y), x + y, rtol=0, atol=0)


def test_add_keeps_shape_of_2d_input():
    x = torch.arange(35.0, device=runtime.DEVICE).view(5, 7)
    assert add(x, x).shape == (5, 7)
    torch.testing.assert_close(add(x, x), 2 * x)


@pytest.mark.parametrize(
    "x, y, tile, match",
    [
        (torch.ones(4), torch.ones(5), 1024, "shape"),
        (torch.ones(4), torch.ones(4, dtype=torch.float16), 1024, "dtype"),
        (torch.ones(4), torch.ones(4), 100, "power of two"),
        ([1.0], torch.ones(1), 1024, "torch tensors"),
    ],
)
def test_add_rejects_bad_input(x, y, tile, match):
    with pytest.raises((ValueError, TypeError), match=match):
        add(x, y, tile=tile)
