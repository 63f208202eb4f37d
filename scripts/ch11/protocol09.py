"""Chapter 09's evaluation protocol (a copy of notebook 09 cell 11) for scratch measurements.

Usage (from a script in this folder): from protocol09 import *
then evaluate_cache(lambda L: SomeCache.for_model(model, 1, L, ...)) -> dict(perplexity, passkey, by depth).
Full cache: perplexity 15.72, passkey 5/5.
"""
import inspect, math, random, textwrap, time
import torch, torch.nn.functional as F
from kvlib import runtime
from kvlib.cache import KVCache
from kvlib.model import load_pretrained
torch.manual_seed(0)
if runtime.mode() != "gpu":
    torch.set_num_threads(runtime.cpu_threads())
model, tok = load_pretrained("smollm2-135m-instruct")
cfg = model.config
N_TEXT = runtime.by_mode(cpu=1024, gpu=4096)  # tokens of long text
text_ids = torch.tensor([tok.encode(inspect.getsource(textwrap))[:N_TEXT]], device=model.device)  # (1, N_TEXT)

FILLER = ["The river keeps moving past the old mill.", "Clouds drift slowly over the quiet hills.",
          "A farmer walks along the edge of the field.", "Birds rest on the fence near the road.",
          "The afternoon light is warm and even."]  # written for this course


def passkey_prompt(key: int, depth: float, n_fill: int = 40, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = [rng.choice(FILLER) for _ in range(n_fill)]
    at = round(depth * n_fill)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return ("There is an important number hidden inside a lot of irrelevant text. Find it and memorize it.\n"
            + " ".join(sentences[:at] + [needle] + sentences[at:]) + "\nWhat is the pass key? The pass key is")


@torch.no_grad()
def perplexity(cache, step: int = 32) -> float:
    # prefill the first half, then score the second half, `step` tokens per call
    half = N_TEXT // 2
    logits = [model(text_ids[:, :half], cache=cache, logits_to_keep=1)[0]]  # predicts token `half`
    for t in range(half, N_TEXT - 1, step):
        e = min(t + step, N_TEXT - 1)
        positions = torch.arange(t, e, device=model.device)[None]
        logits.append(model(text_ids[:, t:e], positions=positions, cache=cache)[0])  # predicts t+1 .. e
    logits = torch.cat(logits)  # (N - half, V)
    return math.exp(F.cross_entropy(logits.float(), text_ids[0, half:]).item())


@torch.no_grad()
def passkey(cache, key: int, depth: float, n_fill: int = 40) -> dict:
    prompt, answer = tok.encode(passkey_prompt(key, depth, n_fill)), tok.encode(f" {key}")
    last = model(torch.tensor([prompt], device=model.device), cache=cache, logits_to_keep=1)[0, -1]  # the prompt, then:
    P = len(prompt)
    rest = model(torch.tensor([answer[:-1]], device=model.device),
                 positions=torch.arange(P, P + len(answer) - 1, device=model.device)[None], cache=cache)[0]
    hit = torch.cat([last[None], rest]).argmax(-1).cpu() == torch.tensor(answer)  # (len(answer),)
    return {"retrieved": bool(hit.all()), "tokens right": hit.float().mean().item(), "prompt tokens": P}


DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]
rng = random.Random(0)
KEYS = [rng.randint(10000, 99999) for _ in DEPTHS]
P_LEN = len(tok.encode(passkey_prompt(KEYS[0], 0.5)))


def evaluate_cache(make_cache) -> dict:
    # make_cache(length) -> a fresh cache for a sequence of `length` tokens
    ppl = perplexity(make_cache(N_TEXT))
    trials = [passkey(make_cache(P_LEN + 8), key, d) for key, d in zip(KEYS, DEPTHS)]
    return {"perplexity": ppl, "passkey": sum(t["retrieved"] for t in trials) / len(trials),
            "digits": sum(t["tokens right"] for t in trials) / len(trials),
            "by depth": [t["retrieved"] for t in trials]}


