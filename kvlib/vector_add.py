"""A first Triton kernel: out = x + y.

What you will learn (notebook 00):
- a Triton *program* handles one tile of TILE elements; the *grid* says how many programs run;
- ``tl.program_id`` tells a program which tile is its own, ``tl.arange`` gives its offsets;
- the last tile is usually partly outside the tensor, so loads and stores take a *mask*;
- the host wrapper checks its inputs and builds the grid; the kernel trusts it.
"""

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference, written with the same loop structure as the kernel.

    >>> add_ref(torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]))
    tensor([11., 22.])
    """
    out = torch.empty_like(x)
    TILE = 1024
    for start in range(0, x.numel(), TILE):  # one iteration = one Triton program
        end = min(start + TILE, x.numel())  # the mask: stop at the end of the tensor
        out.view(-1)[start:end] = x.view(-1)[start:end] + y.view(-1)[start:end]
    return out


@triton.jit
def add_kernel(
    x_ptr,  # pointer to the first element of x
    y_ptr,  # pointer to the first element of y
    out_ptr,  # pointer to the first element of the output
    n_elements,  # how many elements x, y and out hold
    TILE: tl.constexpr,  # elements per program (a power of two, known at compile time)
):
    # A program id is a 32-bit int, and so is pid * TILE unless one side is 64-bit: from n = 2**31 elements
    # on (8 GiB of fp32) the last programs' pid * TILE would wrap around to negative offsets, and those
    # programs would read and write the wrong memory. So the id is made 64-bit first.
    pid = tl.program_id(axis=0).to(tl.int64)  # which tile this program owns
    offsets = pid * TILE + tl.arange(0, TILE)  # (TILE,) element indices of that tile, 64-bit
    mask = offsets < n_elements  # False past the end of the tensor (last tile only)
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, tile: int = 1024) -> torch.Tensor:
    """x + y with the Triton kernel (interpreter on CPU, compiled on a GPU).

    x, y: one shape, float32/float16/bfloat16 (bfloat16 not in CPU mode), on one device.

    >>> from kvlib.runtime import DEVICE
    >>> add(torch.tensor([1.0, 2.0], device=DEVICE), torch.tensor([10.0, 20.0], device=DEVICE)).tolist()
    [11.0, 22.0]
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"x and y must be torch tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.shape != y.shape:
        raise ValueError(f"y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise ValueError(f"y must have x's dtype {x.dtype}, got {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"y must be on x's device {x.device}, got {y.device}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile!r}")
    # bf16 is refused where it cannot work: Triton's interpreter (CPU mode) does not support it (its sums come back
    # wrong), and GPUs below compute capability 8.0 lack it. (dot=True: this kernel computes in x's dtype.)
    check_kernel_dtype("vector_add.add", "x", x, dot=True)
    if not runtime.require_triton("vector_add.add", x=x, y=y):
        return add_ref(x, y)
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:  # nothing to add (a grid of 0 programs is not a valid launch)
        return out
    grid = (triton.cdiv(n, tile),)  # enough programs to cover every element
    add_kernel[grid](x, y, out, n, TILE=tile)
    return out


def _compile_launch():
    """The launch ``kvlib.course.compile_check`` builds: add() on two 1 MiB fp32 CPU vectors (a multiple of 16
    elements, as the JIT sees real buffers). compile_check records the launch instead of running it."""
    x = torch.empty(1 << 18)
    return add(x, x)


# What kvlib.course.compile_check (and tests/test_compile.py) builds for sm_75, sm_80 and sm_90.
COMPILE_SPECS = [dict(name="add fp32", launch=_compile_launch)]
