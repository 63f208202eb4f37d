# Imported by pytest before any test module: kvlib must decide the mode (and set
# TRITON_INTERPRET=1 on a machine without a GPU) before anything else imports triton —
# transformers, for one, imports triton when it loads.
import kvlib  # noqa: F401
