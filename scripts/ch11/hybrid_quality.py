import sys, time
sys.path.insert(0, __import__("os").path.dirname(__file__))
from protocol09 import *
from kvlib.hybrid import HybridCache, hybrid_bytes, layer_plan
from kvlib.cache import KVCache
print("threads", torch.get_num_threads())
res = {}
t = time.time(); r = evaluate_cache(lambda L: KVCache.for_model(model, 1, L)); print("full", r, f"{time.time()-t:.1f}s", flush=True)
print("P_LEN", P_LEN)
for W in (128, 256, 512):
    t = time.time()
    caches = []
    def make(L, W=W):
        c = HybridCache.for_model(model, 1, L, pattern="5:1", window=W); caches.append(c); return c
    r = evaluate_cache(make)
    c = caches[0]  # the perplexity run's cache: 1023 positions seen
    plan = layer_plan(cfg.n_layers, "5:1")
    print(f"5:1 W={W}", r, f"{time.time()-t:.1f}s", "seen", c.held(0), "stored fp32", c.stored_bytes(),
          "fp16 formula", hybrid_bytes(c.held(0), plan, W, cfg.n_kv_heads, cfg.head_dim, 2),
          "full fp16", hybrid_bytes(c.held(0), layer_plan(cfg.n_layers, "0:1"), None, cfg.n_kv_heads, cfg.head_dim, 2), flush=True)
