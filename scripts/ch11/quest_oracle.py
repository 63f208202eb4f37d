"""Diagnostic: Quest's selection with the bound replaced by each block's true max q.k (an oracle)."""
import sys, time, json
sys.path.insert(0, __import__("os").path.dirname(__file__))
from protocol09 import *
import torch
import kvlib.sparse as sp
from kvlib.sparse import QuestCache

KEYS_OF = {}  # data_ptr of a layer's kmin buffer -> that layer's K buffer

def oracle(q, kmin, kmax):
    k = KEYS_OF[kmin.data_ptr()]  # (B, H_KV, S_max, D)
    N, bs = kmin.shape[2], 16
    rows = torch.nn.functional.pad(k, (0, 0, 0, max(0, N * bs - k.shape[2])))[:, :, :N * bs].float()
    q4 = q.float()[:, :, None] if q.dim() == 3 else q.float()  # (B, H, T, D)
    rows = rows.repeat_interleave(q.shape[1] // k.shape[1], 1)  # (B, H, N*bs, D)
    s = (q4 @ rows.transpose(-1, -2)).view(*q4.shape[:3], N, bs).amax(-1)  # (B, H, T, N)
    return s[:, :, 0] if q.dim() == 3 else s

sp.block_upper_bound = oracle
for budget, dense in [tuple(map(eval, a.split(":"))) for a in sys.argv[1:]]:
    made = []
    def make(L, budget=budget, dense=dense):
        c = QuestCache.for_model(model, 1, L, block_size=16, token_budget=budget, dense_layers=dense)
        KEYS_OF.update({m.data_ptr(): k for m, k in zip(c.kmin, c.k)})
        made.append(c)
        return c
    t0 = time.time()
    r = evaluate_cache(make)
    print(json.dumps(dict(selection="oracle max q.k", token_budget=budget, dense_layers=dense,
                          perplexity=round(r["perplexity"], 2), passkey=r["passkey"], by_depth=r["by depth"],
                          ppl_read_fraction=round(made[0].read_fraction(0), 4), seconds=round(time.time() - t0, 1))),
          flush=True)
