"""Values that nbval may compare because they are exact by construction (tests/test_nbval_policy.py).

Per file (relative to the repository): (pattern, reason). A pattern matches the words around the
value, so a new float printed elsewhere in the same cell is still caught; patterns anchored with ^/$
carry (?m). Remove an entry when its cell changes: a test fails on an entry that matches nothing.
"""

EXACT = {
    "notebooks/00_setup.ipynb": [
        (r"max \|triton - torch\| = 0\.0\b",
         "an elementwise add is bitwise exact (IEEE rounding of one sum), the cell asserts max_err == 0.0"),
    ],
    "notebooks/01_attention.ipynb": [
        (r"a=0\.9: influence of a token +\d+ steps back = a\^\d+ = \S+",
         "a config constant 0.9 and Python float powers of it (0.9**10), printed to 3 digits"),
        (r"989 TFLOP/s ÷ 3\.35 TB/s",
         "H100 datasheet numbers"),
        (r"at S = [\d,]+ does \d+\.\d+ FLOPs per byte",
         "plain Python arithmetic on integer head counts and sizes (4·H·S·D / bytes of Llama-3-8B shapes)"),
    ],
    "notebooks/02_naive_decoding.ipynb": [
        (r"rope_theta +10000\.0",
         "a config constant"),
        (r"naive \d\.\d+e\+\d+ FLOPs, cached \d\.\d+e\+\d+ FLOPs",
         "FLOP model on datasheet integers (LLaMA-7B parameter count, layers, width), summed in float64 over "
         "integer-valued terms; far from any rounding boundary at 3 digits"),
        (r"one recomputed token row: \d+\.\d GFLOPs",
         "Python arithmetic on the LLaMA-7B parameter count"),
        (r"at the H100's 989 TFLOP/s the waste, \d\.\de\+\d+ FLOPs",
         "H100 datasheet number and the same integer FLOP model"),
    ],
    "notebooks/03_kv_cache.ipynb": [
        (r"'temperature': 0\.8",
         "a sampling-config constant"),
        (r"files in\\nan intermediate",
         "no number: the repr's \\n followed by the word 'an' reads as nan (sampled text, token ids checked equal)"),
        (r"context [\d,]+, \d+\.\d M parameters",
         "an integer parameter count divided by 1e6"),
    ],
    "notebooks/11a_speculative_decoding.ipynb": [
        (r"qx = 1\.0 if q is None|index_fill_\(0, torch\.tensor\(\[x\]\), 1\.0\)",
         "printed source code (speculative_accept)"),
    ],
    "solutions/00_setup_lab.ipynb": [
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)",
         "check()'s tolerances, constants given by the cell (the difference itself is replaced by nbval_sanitize.cfg)"),
    ],
    "solutions/01_attention_lab.ipynb": [
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)",
         "check()'s tolerances, constants given by the cell (the difference itself is replaced by nbval_sanitize.cfg)"),
    ],
    "solutions/02_naive_decoding_lab.ipynb": [
        (r"\(\d+\.\dx as many\)|\d+\.\dx the minimum",
         "a ratio of two integer row counts"),
        (r"temperature=\d+\.\d+, 20 draws",
         "a sampling-config constant in the check's name"),
    ],
    "solutions/03_kv_cache_lab.ipynb": [
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)",
         "check()'s tolerances, constants given by the cell (the difference itself is replaced by nbval_sanitize.cfg)"),
    ],
    "solutions/04_kv_memory_lab.ipynb": [
        (r"(?m)^\S+\s+\d+ KiB\s+[\d,]+\s+\d+\.\d\d GiB$",
         "per-model table: integer KV bytes at max context (formula on integer configs) / 2**30, plain Python"),
        (r"(?m)^\S+\s+\d+ GiB\s*\d+\.\d GiB\s+[\d,]+\s+\d+$",
         "per-model table: int weight bytes of a model-card constant / 2**30; the sequence count is an integer"),
        (r"\(atol=[\de.+-]+, rtol=[\de.+-]+\)",
         "the checker's tolerances: constants passed to check(); the difference itself is sanitized, and check() "
         "raises if it is beyond them"),
        (r"bandwidth \d\.\d+e\+\d+ B/s", "the bandwidth constant 3.35e12 set in the cell"),
        (r"weights\s+\d+\.\d GiB \+ KV\s+\d+\.\d GiB -> at least\s+\d+\.\d ms per step",
         "integer byte counts / 2**30, and (weights + KV bytes) / a bandwidth constant, all plain Python floats"),
        (r"floor / Llama-3-8B's: \d+\.\d", "ratio of two plain-Python time floors computed from constants"),
        (r"Llama-3\.1-8B", "a model name, not a number"),
    ],
    "notebooks/05_paged_kv.ipynb": [
        (r"(?m)^(contiguous(, max_len \d+)?|paged, block \d+)(\s+\d+(\.\d{3})?)+\s*\\?$",
         "kvlib.pool_sim results via ch05.server_view (text/plain): pure-Python integer simulation of a seeded "
         "random.Random workload; the shares are sums of integer ratios in a fixed order, mean running = integer sum "
         "/ iterations, peak = integer max / integer pool size"),
        (r"(?m)^\s*<td>\d+\.\d{3}</td>$",
         "pool_sim tables (text/html), one cell per line: the same exact shares as the text/plain rows (round(3))"),
        (r"(?m)^(\d\.\d\d?|all at step 0)(\s+\d+(\.\d{3})?)+\s*\\?$",
         "watermark and arrival-rate table rows (text/plain): the index is a watermark or arrival-rate constant, the "
         "values pool_sim integers and shares (pure-Python simulation; the arrivals from a seeded random.Random)"),
        (r"(?m)^\s*<th>\d\.\d\d?</th>$",
         "watermark and arrival-rate table index (text/html): the constants 0.0 .. 0.3 and 0.25 .. 2.0"),
        (r"'temperature': 0\.8", "a sampling argument, a constant"),
    ],
    "solutions/05_paged_kv_lab.ipynb": [
        (r"\(atol=[\de.+-]+, rtol=[\de.+-]+\)",
         "the checker's tolerances: constants passed to check(); the difference itself is sanitized, and check() "
         "raises if it is beyond them"),
    ],
    "notebooks/06_int8_kv.ipynb": [
        # cell 3 (54ec505e): six float32 constants, quantized elementwise (abs-max, one IEEE division, round
        # half away from zero, one multiply): correctly rounded operations with no reduction order, the same on every CPU
        (r"(?m)^x\s+\[[-\d., ]+\]$", "the six float32 constants of the example, printed by tolist(): exact"),
        (r"(?m)^scale\s+\d\.\d+ = max\|x\| / 127$", "max|x| / 127 of the constants: one IEEE division, exact"),
        (r"(?m)^x_hat\s+\[[-\d., ]+\]$", "q * scale of the constants, rounded to 4 places: elementwise IEEE ops, exact"),
        (r"(?m)^max error \d\.\d{5}, half a step \d\.\d{5}$", "max of elementwise |x_hat - x| and scale / 2 of the constants: exact"),
        # cell 19 (c06-19): live cache bytes, integers, and their ratio (D + 2) / (2D) = 0.515625, a binary fraction
        (r"(?m)<td>0\.515625</td>|^\s*\d+\s+\d+\s+\d+\s+0\.515625$",
         "int8 / fp16 bytes of live caches: a ratio of integers equal to (D + 2) / (2D) for D = 64, exact in binary"),
        (r"int8 / fp16 from the tensors: \d\.\d{4}; \(D \+ 2\) / \(2D\) for D = 64: \d\.\d{4}",
         "the same ratio of integer byte counts, and (D + 2) / (2D) in Python floats: exact"),
        # cell 29 (c06-29): the kernel's source, shown
        (r"line-height: 125%|other=0\.0\)\.to\(tl\.float32\)|<span class=\"mf\">0\.0</span>|\\PY\{l\+m\+mf\}\{0\.0\}",
         "printed source code (text, HTML and LaTeX renderings of the literal 0.0) and its CSS"),
    ],
    "notebooks/07_gqa.ipynb": [
        # the REAL_MODELS table, config integers only
        (r"<th>Llama-3\.1-8B</th>", "a model's name"),
        (r"<td>0\.(000|875|750|857|667)</td>", "(h - g) / h of config integers, rounded to 3 places"),
        (r"<td>((512|800|320|128|56)\.0|22\.5)</td>", "kv_bytes_per_token (an integer) / 1024"),
        (r"(?m)^\s*[A-Za-z][\w.-]*\s+\d+\s+\d+\s+(MHA|GQA|MQA)\s+\d\.\d{3}\b",
         "model, h, g, kind, (h - g) / h of config integers"),
        (r"(?m)^\s*(LLaMA|Llama|Mistral|Qwen|SmolLM)[\w.-]*\s+\d+\.\d\s*$", "model, kv_bytes_per_token (an integer) / 1024"),
        (r"weights (fp16|int8) \(\s*\d+\.\d GiB\)", "int(n_params x bytes) from the model card constant / 2**30"),
    ],
    "notebooks/09a_keeping_fewer_positions.ipynb": [
        # cell 7 (c09a-07) shows kvlib's index kernel source: these are its literals, not results
        (r"other=0\.0\)", "a literal in the printed kernel source"),
        (r"m_i = -1\.0e30", "a literal in the printed kernel source"),
        (r"l_i = 0\.0", "a literal in the printed kernel source"),
    ],
    "solutions/09a_keeping_fewer_positions_lab.ipynb": [
        # cells 12 (c23908dd) and 19 (a9c30005)
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)", "the tolerances passed to check(): constants"),
    ],
    "solutions/09b_keeping_fewer_bits_lab.ipynb": [
        # cells 11 (l9b-11) and 26 (l9b-26): check()'s reports
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)", "the tolerances passed to check(): constants"),
    ],
    "notebooks/10_http_serving.ipynb": [
        # cell 4 (c03) prints kvlib.serve's engine loop: literals of the source, not results
        (r"min\(0\.05 \* self\.failures, 0\.5\)", "a literal in the printed source"),
        (r"time\.sleep\(0\.05\)", "a literal in the printed source"),
        # cell 21 (c14): the server's error messages quote its limits and the value sent
        (r"temperature must be a number in \[0\.0, 2\.0\]", "the server's configured range, in its error text"),
        (r"top_p=0\.5 is not supported", "the value the cell sends, echoed by the error"),
        # cells 28 (c18) and 44 (c32): the GuideLLM command line, built from the cell's constants
        (r"127\.0\.0\.1", "the loopback address in the target URL"),
    ],
    "solutions/06_int8_kv_lab.ipynb": [
        # cell 7 (72022b45)
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)", "the tolerances passed to check(): constants"),
        (r"(?m)^ties: \[[-\d., ]+\] ->", "the tie constants of the rounding test (exact in float32)"),
    ],
    "solutions/07_gqa_lab.ipynb": [
        # cells 11 (29ae72ca) and 16 (cacf0001)
        (r"\(atol=[\d.e+-]+, rtol=[\d.e+-]+\)", "the tolerances passed to check(): constants"),
        # cell 18 (41efcfb0)
        (r"saving \(h-g\)/h = \d+\.\d%", "(h - g) / h of integers"),
    ],
}
