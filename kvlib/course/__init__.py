"""Course machinery: what runs the course, as opposed to what the chapters teach.

The chapter modules (``kvlib.attention``, ``kvlib.cache``, ``kvlib.paged``, ...) are what a learner
reads. This subpackage holds what keeps the course honest and readable around them:

- ``expect``: the one-line check a teaching cell uses instead of an ``assert``;
- ``draw``: conceptual diagrams drawn from live objects (one module per chapter);
- ``check`` and ``mistakes``: the labs' checkers and the known wrong answers they diagnose;
- ``labs``: generates ``labs/`` from ``solutions/``;
- ``figures``: the readability check every plot passes under the test command;
- ``compile_check``: builds every Triton kernel for sm_75/80/90 without a GPU;
- ``readme``: rewrites the README's results table from the notebooks' outputs.

The benchmark harness is its own subpackage, ``kvlib.bench``.
"""
