"""The text the chapters read is the same on every Python the course supports (3.10-3.13).

The tiny model's corpus is collected from the standard library's docstrings, which change between
Python versions; ``kvlib.corpus.course_texts()`` keeps only the documents that are identical on all
four versions (listed by hash in ``kvlib/assets/tiny/corpus_index.txt``). Each installed interpreter
is asked for its own corpus here; an interpreter that is not installed is skipped, saying so.
"""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kvlib.corpus import INDEX, build_corpus, course_docs, course_texts, doc_hash, read_index, split_corpus

VERSIONS = ["3.10", "3.11", "3.12", "3.13"]


@pytest.fixture(scope="module")
def here():
    return build_corpus()


def _interpreter(version):
    """A working pythonX.Y: on PATH, or one that pyenv installed (its shims only run the selected ones)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}"), *sorted(pyenv.glob(f"{version}.*/bin/python{version}"))]
    want = str(tuple(map(int, version.split("."))))
    for exe in filter(None, candidates):
        ok = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if ok.returncode == 0 and ok.stdout.strip() == want:
            return str(exe)
    return None


@pytest.mark.parametrize("version", VERSIONS)
def test_course_texts_are_the_same_on_every_supported_python(version, here):
    exe = _interpreter(version)
    if exe is None:
        pytest.skip(f"python{version} is not installed here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing document warns: make it fail
        theirs = course_texts(build_corpus(exe))
        ours = course_texts(here)
    assert theirs == ours


def test_every_indexed_document_is_found_here(here):
    rows = read_index()
    have = {doc_hash(d) for d in here}
    assert [h for _, h in rows if h not in have] == [], f"Python {sys.version.split()[0]} lacks indexed documents"
    train, val = course_docs(here)
    assert len(train) + len(val) == len(rows) and len(set(train) & set(val)) == 0
    # enough text for the chapters: ~48 KB held out, ~870 KB to fine-tune on
    assert sum(map(len, val)) > 40_000 and sum(map(len, train)) > 800_000


def test_held_out_documents_are_ones_the_tiny_model_did_not_train_on(here):
    """On the Python the model was trained with (its log says which), the held-out documents are in its
    validation split and the training documents in its training split."""
    import json

    trained_on = json.loads((INDEX.parent / "train_log.json").read_text())["python"]
    if sys.version.split()[0] != trained_on:
        pytest.skip(f"the split is defined on Python {trained_on}; this is {sys.version.split()[0]}")
    train_text, val_text = split_corpus(here)
    train, val = course_docs(here)
    val_docs = set(val_text.split(chr(0)))
    train_docs = set(train_text.split(chr(0)))
    assert all(d in val_docs for d in val) and all(d in train_docs for d in train)
