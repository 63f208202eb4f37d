"""The tiny model's training text, built on the spot from what every Python install carries.

We commit no third-party prose. Instead ``build_corpus()`` collects, from the Python standard
library of the machine it runs on:
- the docstrings of its modules, classes, functions and methods (``inspect.getdoc``), and
- the help topics of ``pydoc_data.topics`` (the text behind ``help("if")``, ``help("FORMATTING")``),
keeps ASCII ones longer than 40 characters, drops duplicates, and joins them in a fixed order, each
document followed by the end-of-text byte. ``split_corpus`` holds out every 20th document for
validation (documents, not characters, so no text leaks across the split).

The standard library's docstrings change between Python versions (4,758 documents on 3.10.13, 4,838
on 3.11.7, 4,860 on 3.12.1, 4,715 on 3.13.0; 3,967 of them identical on all four), so the text a chapter reads must not be "whatever this Python
has". ``course_texts()`` gives the chapters one text on every Python from 3.10 to 3.13: the documents
that are identical on all four, in the order and split the tiny model was trained with (Python 3.11).
It finds them by the SHA-256 of each document, listed in ``assets/tiny/corpus_index.txt`` (hashes, no
prose; ``python kvlib/corpus.py --index PYTHON...`` rewrites it from the interpreters given, the first
being the one the model was trained on).

``ByteTokenizer`` maps text to UTF-8 bytes: 256 token ids, nothing to learn, nothing to download.
Id 0 (the NUL byte, absent from the corpus) doubles as end-of-text (``eos_id``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

INDEX = Path(__file__).resolve().parent / "assets" / "tiny" / "corpus_index.txt"

# Modules that open windows or browsers, print on import, are huge test suites, or are deprecated shims.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "lib2to3",
        "ensurepip", "test", "pydoc_data", "xxsubtype", "msilib", "winreg", "winsound", "_msi",
        "msvcrt", "nturl2path", "distutils", "asyncio.__main__", "sqlite3.__main__", "venv",
        "unittest.__main__", "json.tool", "ctypes.wintypes", "encodings", "idlelib", "zipapp"}
BOILERPLATE = ("Initialize self.", "Create and return a new object.", "Return repr(self).",
               "Implement ", "Return self", "Helper for pickle.", "Return hash(self).", "Return str(self).",
               "Default object formatter.", "Size of object in memory", "Abstract classes can override")


class ByteTokenizer:
    """Text <-> UTF-8 byte ids. vocab_size 256; id 0 (NUL) is end-of-text."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):  # a tensor
            ids = ids.tolist()
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(vocab_size=256, eos_id=0)"


def _quiet_import(name):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that fails to import is simply skipped
            return None


def _stdlib_module_names() -> list[str]:
    names = set()
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP:
            continue
        mod = _quiet_import(top)
        if mod is None:
            continue
        names.add(top)
        if hasattr(mod, "__path__"):  # a package: walk its submodules too
            for info in pkgutil.walk_packages(mod.__path__, prefix=top + "."):
                last = info.name.rsplit(".", 1)[-1]
                if last.startswith("_") or "test" in info.name or info.name in SKIP:
                    continue
                names.add(info.name)
    return sorted(names)


def _docstrings(mod) -> list[str]:
    objs = [mod]
    for _, obj in sorted(vars(mod).items()):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj):
            objs.append(obj)
            objs.extend(m for _, m in sorted(vars(obj).items()) if inspect.isfunction(m) or inspect.ismethod(m))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            objs.append(obj)
    out = []
    for o in objs:
        try:
            doc = o.__doc__ if isinstance(o.__doc__, str) else None
            doc = inspect.cleandoc(doc) if doc else None
        except Exception:  # noqa: BLE001
            doc = None
        if doc:
            out.append(doc)
    return out


def _builtin_docstrings() -> list[str]:
    import builtins

    out = []
    for _, obj in sorted(vars(builtins).items()):
        if inspect.isclass(obj) or inspect.isbuiltin(obj):
            out.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                out.extend(inspect.getdoc(m) or "" for _, m in sorted(vars(obj).items()) if callable(m))
    return out


def build_corpus(python: str | None = None) -> list[str]:
    """The documents, in a fixed order (builtins, then modules by name, then help topics).

    Collected in a fresh interpreter with no site-packages (``python -I -S``): what third-party
    packages imported into *this* process do to standard modules must not change the corpus.
    ``python`` collects them with another interpreter instead (its standard library, its docstrings).
    """
    out = subprocess.run([python or sys.executable, "-I", "-S", __file__], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def doc_hash(doc: str) -> str:
    """The 16-hex-digit SHA-256 prefix that names a document in the index."""
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()[:16]


def read_index(path: Path = INDEX) -> list[tuple[str, str]]:
    """[(split, hash)]: split "t" (the tiny model trained on it) or "v" (held out), in corpus order."""
    rows = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            split, h = line.split()
            rows.append((split, h))
    return rows


def course_docs(docs: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents) of the index, found in this Python's corpus.

    The same lists on Python 3.10-3.13 (tested). On another version a document that changed is
    missing: a warning says how many, and the chapters' figures may then differ a little.
    """
    docs = build_corpus() if docs is None else docs
    by_hash = {doc_hash(d): d for d in docs}
    rows = read_index()
    missing = sum(h not in by_hash for _, h in rows)
    if missing:
        warnings.warn(f"kvlib.corpus: {missing} of {len(rows)} indexed documents are not in Python "
                      f"{sys.version.split()[0]}'s standard library (the index was built from 3.10-3.13); "
                      "the chapters' texts differ a little from the committed outputs", stacklevel=2)
    train = [by_hash[h] for s, h in rows if s == "t" and h in by_hash]
    val = [by_hash[h] for s, h in rows if s == "v" and h in by_hash]
    return train, val


def course_texts(docs: list[str] | None = None) -> tuple[str, str]:
    """(train text, held-out text) as ``split_corpus`` joins them, the same on Python 3.10-3.13.

    The held-out documents are ones the tiny model never trained on (its validation split).
    """
    train, val = course_docs(docs)
    return _join(train), _join(val)


def write_index(pythons: list[str], path: Path = INDEX, every: int = 20) -> int:
    """Rewrite the index from the interpreters given; ``pythons[0]`` is the one the tiny model was
    trained on (its order and its train/validation split are kept). Returns the number of documents."""
    corpora = [build_corpus(p) for p in pythons]
    common = set(corpora[0]).intersection(*map(set, corpora[1:]))
    versions = [subprocess.run([p, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                               text=True, check=True).stdout.strip() for p in pythons]
    lines = [f"# The documents of kvlib.corpus that are identical on Python {', '.join(versions)}:",
             f"# split (t: trained on, v: held out, every {every}th document of {versions[0]}) and SHA-256 prefix.",
             "# Written by `python kvlib/corpus.py --index PYTHON...`; read by kvlib.corpus.course_texts()."]
    n = 0
    for i, d in enumerate(corpora[0]):
        if d in common:
            lines.append(f"{'v' if i % every == 0 else 't'} {doc_hash(d)}")
            n += 1
    path.write_text("\n".join(lines) + "\n")
    return n


def _collect() -> list[str]:
    docs = _builtin_docstrings()
    for name in _stdlib_module_names():
        mod = sys.modules.get(name) or _quiet_import(name)
        if mod is not None:
            docs.extend(_docstrings(mod))
    from pydoc_data.topics import topics

    docs.extend(topics[k] for k in sorted(topics))
    seen, keep = set(), []
    for d in docs:
        d = d.strip()
        if len(d) < 40 or not d.isascii() or "\x00" in d or d.startswith(BOILERPLATE) or d in seen:
            continue
        seen.add(d)
        keep.append(d)
    return keep


def split_corpus(docs: list[str], every: int = 20) -> tuple[str, str]:
    """(train text, validation text): every ``every``-th document is held out. Each document ends
    with the end-of-text byte so the model learns where documents stop."""
    train = [d for i, d in enumerate(docs) if i % every]
    val = [d for i, d in enumerate(docs) if i % every == 0]
    return _join(train), _join(val)


def _join(docs: list[str]) -> str:
    """The documents as one text, each followed by the end-of-text byte."""
    eos = chr(ByteTokenizer.eos_id)
    return eos.join(docs) + eos


def fingerprint(text: str) -> str:
    """Short hash of a text, recorded in the model card so a rebuilt corpus can be compared."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--index"]:  # a maintainer rewriting the index
        print(f"{write_index(sys.argv[2:])} documents indexed in {INDEX}")
    else:  # run by build_corpus() in a clean interpreter
        print(json.dumps(_collect()))
