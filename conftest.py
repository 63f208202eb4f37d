# Imported by pytest before any test module: kvlib must decide the mode (and set
# TRITON_INTERPRET=1 on a machine without a GPU) before anything else imports triton —
# transformers, for one, imports triton when it loads.
import kvlib  # noqa: F401

import torch  # noqa: E402

from kvlib import runtime  # noqa: E402

if not torch.cuda.is_available():
    # One CPU thread per test process unless KVLIB_THREADS says otherwise (runtime.cpu_threads): on a
    # 2-core machine the two pytest-xdist workers already take both cores.
    torch.set_num_threads(runtime.cpu_threads())
