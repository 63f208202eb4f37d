"""Block pools for the paged-attention tests: blocks handed out in a scrambled order, as after many
allocations and frees."""

import torch


def scattered_pool(lens, block_size, H_KV, D, dtype=torch.float32, seed=0, spare=3, extra_columns=0):
    """K and V pools (num_blocks, block_size, H_KV, D) of random values with ``spare`` blocks nobody uses, and
    block tables (len(lens), max blocks + extra_columns) int32, -1 past each sequence's blocks. Returns
    (k, v, tables, generator): the generator goes on for whatever else the test draws."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-L // block_size) for L in lens]
    total = sum(n_blocks) + spare
    perm = torch.randperm(total, generator=g).tolist()
    tables = torch.full((len(lens), max(n_blocks) + extra_columns), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = torch.tensor(perm[i:i + n])
        i += n
    k = torch.randn(total, block_size, H_KV, D, generator=g).to(dtype)
    v = torch.randn(total, block_size, H_KV, D, generator=g).to(dtype)
    return k, v, tables, g
