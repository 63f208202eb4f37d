"""Scratch measurement for issue 26 (Quest): evaluate_cache of chapter 09's protocol."""
import sys, time, json
sys.path.insert(0, __import__("os").path.dirname(__file__))
from protocol09 import *  # model, tok, evaluate_cache, P_LEN, N_TEXT
from kvlib.sparse import QuestCache

configs = [tuple(a.split(":")) for a in sys.argv[1:]]  # token_budget:dense_layers, or fFRACTION:dense_layers
# fFRACTION: chapter 09's convention, budget = round(FRACTION * L) for a cache of L positions
print("P_LEN", P_LEN, "N_TEXT", N_TEXT, flush=True)
for budget, dense in configs:
    made, dense = [], int(dense)
    def make(L, budget=budget, dense=dense):
        tb = max(16, round(float(budget[1:]) * L)) if budget.startswith("f") else int(budget)
        made.append(QuestCache.for_model(model, 1, L, block_size=16, token_budget=tb, dense_layers=dense))
        return made[-1]
    t0 = time.time()
    r = evaluate_cache(make)
    ppl_cache, pk = made[0], made[1:]
    row = dict(token_budget=budget, n_select=ppl_cache.n_select, passkey_n_select=pk[0].n_select, dense_layers=dense,
               perplexity=round(r["perplexity"], 2), passkey=r["passkey"], by_depth=r["by depth"],
               digits=round(r["digits"], 3),
               ppl_read_fraction=round(ppl_cache.read_fraction(0), 4),
               ppl_read_per_step_kb=round(ppl_cache.bytes_read_per_step(0) / 1024, 1),
               ppl_full_per_step_kb=round(float(ppl_cache.full_bytes[0]) / int(ppl_cache.read_steps[0]) / 1024, 1),
               ppl_kept_kb_at_end=round(ppl_cache.bytes_kept(0) / 1024, 1), ppl_steps=int(ppl_cache.read_steps[0]),
               passkey_read_fraction=round(sum(c.read_fraction(0) for c in pk) / len(pk), 4),
               seconds=round(time.time() - t0, 1))
    print(json.dumps(row), flush=True)
