# Imported by pytest before any test module: kvlib must decide the mode (and set
# TRITON_INTERPRET=1 on a machine without a GPU) before anything else imports triton —
# transformers, for one, imports triton when it loads.
import kvlib  # noqa: F401

import torch  # noqa: E402

if not torch.cuda.is_available():
    # One CPU thread: on a 2-core machine that is doing anything else, a second OpenMP thread mostly
    # waits for a core (measured: a SmolLM2 forward of 6 tokens, 0.15 s on one thread, 3.2 s on two).
    torch.set_num_threads(1)
