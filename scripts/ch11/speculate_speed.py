"""Chapter 11 scratch measurement: prompt lookup speculative decoding vs plain cached decoding, SmolLM2-135M."""
import time, torch
from kvlib import runtime
from kvlib.model import load_pretrained
from kvlib.generate import generate
from kvlib.speculate import speculative_generate, LayerSkipDrafter
torch.set_num_threads(runtime.cpu_threads())
t = time.perf_counter()
model, tok = load_pretrained("smollm2-135m-instruct")
print(f"load {time.perf_counter() - t:.1f} s, threads {torch.get_num_threads()}")
FUNC = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
prompts = {
    "code": tok.chat([{"role": "user", "content": "Add type hints to this Python function and reply with the full "
                       "code:\n```python\n" + FUNC + "```"}]),
    "chat": tok.chat([{"role": "user", "content": "Give me three tips for staying focused while studying."}]),
}
N = 96
for name, ids in prompts.items():
    generate(model, [ids], 4)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    want = generate(model, [ids], N, kernels="torch")[0].tolist()
    base, cbase = (time.perf_counter() - t) / N, (time.process_time() - c) / N
    print(f"{name}: prompt {len(ids)} tokens; plain generate {1000 * base:.1f} ms/token wall, {1000 * cbase:.1f} cpu")
    print("   output:", repr(tok.decode(want))[:300])
    for k in (2, 4, 8):
        c = time.process_time()
        r = speculative_generate(model, ids, N, k=k, kernels="torch")
        cpu = (time.process_time() - c) / N
        print(f"  prompt lookup k={k}: identical={r.tokens == want} acceptance={r.acceptance_rate:.3f} "
              f"tokens/forward={r.tokens_per_forward:.2f} {1000 * r.seconds / N:.1f} ms/token wall "
              f"{1000 * cpu:.1f} cpu; speed-up wall {base * N / r.seconds:.2f}x cpu {cbase / cpu:.2f}x")
    if name == "code":
        for layers in ([i for i in range(30) if i not in (10, 13, 16, 19, 22, 25)],):
            c = time.process_time()
            r = speculative_generate(model, ids, N, k=4, kernels="torch",
                                     drafter=LayerSkipDrafter(model, layers, "torch"))
            cpu = (time.process_time() - c) / N
            print(f"  layer-skip ({len(layers)}/30 layers) k=4: identical={r.tokens == want} "
                  f"acceptance={r.acceptance_rate:.3f} {1000 * r.seconds / N:.1f} ms/token wall {1000 * cpu:.1f} cpu; "
                  f"speed-up cpu {cbase / cpu:.2f}x")
