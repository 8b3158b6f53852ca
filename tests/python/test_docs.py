"""Docs that run (issue #17, item 5): every fenced code block of README.md and
docs/python.md is executed, so that a doc that stops working fails CI.

A block's info string says what happens to it:

- ``python`` (and ``ipython``): run by /usr/bin/python3 against the built
  package, each block as one cell of IPython's InteractiveShell, one shell per
  document: the blocks of a document share one namespace, in order, as the
  cells of a notebook (a later block uses what an earlier one made, and the
  cell events that ``%dvr auto`` commits on fire), so ``%magic``, ``%%cell``
  and ``!cmd`` lines work in any python block.
- ``cpp``: compiled against the built libdvr and run. A block without
  ``int main`` is a fragment: its ``#include`` lines go to the top and the
  rest into ``main()``, after CPP_PRELUDE below (the placeholders
  ``load_big_dataset()`` and ``mutate()``).
- ``sh``: run by bash (-e -o pipefail), with ``dvr`` on PATH and ``build/``
  the build tree (the working directory has a ``build`` link to it).
- ``text``, or any info string with the word ``no-run`` (```sh no-run``):
  not run (usage texts, commands that install or would run this suite).

A block with no info string, or another language, fails the test: each
block is run or explicitly marked. Every block of a document runs in
document order with a store of its own: ``/dev/shm/my-store`` in the text is
replaced by that store, which is also $DVR_STORE and $MEMDVR_STORE. The whole
document runs twice, in two fresh processes against the same store, since
examples must keep working when they are run again.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import memdvr

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(memdvr.__file__).resolve().parents[2]  # BUILD/python/memdvr/__init__.py
DOCS = ["README.md", "docs/python.md"]
DOC_STORE = "/dev/shm/my-store"

RUN_LANGS = {"python", "ipython", "cpp", "sh"}

# What the C++ fragments of the docs leave to the reader.
CPP_PRELUDE = """\
#include <cstdio>
#include <exception>
#include <vector>

// The docs' placeholders: a data set to load, and a change to it.
static std::vector<float> load_big_dataset() {
  std::vector<float> v(4u << 20);  // 16 MiB
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000);
  return v;
}
static void mutate(std::vector<float>& data) {
  for (std::size_t i = 0; i < data.size(); i += 1024) data[i] *= 2;
}
"""


def fenced_blocks(path):
    """(line, info string, text) of each fenced code block of a Markdown file."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^( {0,3})(`{3,}|~{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start = i + 1
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:{start}: code block never closed"
        blocks.append((start, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def kind(info, text):
    """What to do with a block: a run kind, "skip", or None (unmarked: an error)."""
    words = info.split()
    if not words:
        return None
    lang = words[0].lower()
    if "no-run" in words[1:] or lang == "text":
        return "skip"
    if lang not in RUN_LANGS:
        return None
    if lang == "python" and re.search(r"^\s*(%|!)", text, re.M):
        return "ipython"
    return lang


def runnable(doc):
    path = ROOT / doc
    out = []
    for line, info, text in fenced_blocks(path):
        k = kind(info, text)
        if k not in (None, "skip"):
            out.append({"where": f"{doc}:{line}", "kind": k, "text": text})
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_block_is_run_or_marked(doc):
    blocks = fenced_blocks(ROOT / doc)
    assert blocks, f"{doc} has no code block?"
    unmarked = [f"{doc}:{line}: ```{info}" for line, info, text in blocks if kind(info, text) is None]
    assert not unmarked, (
        "code blocks that are neither run nor marked (use ```python, ```cpp, ```sh to run, "
        "```text or ```sh no-run not to):\n" + "\n".join(unmarked))


def test_block_extraction_and_kinds(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(textwrap.dedent("""\
        text
        ```python
        a = 1
        ```
        - item:
          ```sh no-run
          rm -rf /
          ```
        ````text
        ```
        nested
        ````
        ```
        plain
        ```
        ```python
        %load_ext memdvr
        ```
        """))
    blocks = fenced_blocks(md)
    assert [(line, info) for line, info, _ in blocks] == [
        (2, "python"), (6, "sh no-run"), (9, "text"), (13, ""), (16, "python")]
    assert blocks[1][2] == "rm -rf /\n" and blocks[2][2] == "```\nnested\n"
    assert [kind(info, text) for _, info, text in blocks] == ["python", "skip", "skip", None, "ipython"]
    assert kind("json", "{}") is None and kind("cpp", "int x;") == "cpp"


# The program that runs one document's blocks in order (a fresh
# /usr/bin/python3 each time): reads the blocks as JSON on stdin.
DRIVER = r'''
import json, os, subprocess, sys, traceback
cfg = json.load(sys.stdin)
shell = None

def fail(block, what):
    print(f"\n{block['where']}: {block['kind']} block failed: {what}\n--- block ---\n{block['text']}", flush=True)
    sys.exit(1)

def cpp_source(text):
    if "int main" in text:
        return text
    includes = [l for l in text.splitlines() if l.startswith("#include")]
    body = "\n".join(l for l in text.splitlines() if not l.startswith("#include"))
    return ("\n".join(includes) + "\n" + cfg["cpp_prelude"] +
            "int main() {\n  try {\n" + body + "\n  } catch (const std::exception& e) {\n"
            "    std::fprintf(stderr, \"error: %s\\n\", e.what());\n    return 1;\n  }\n  return 0;\n}\n")

for n, block in enumerate(cfg["blocks"]):
    text = block["text"].replace(cfg["doc_store"], cfg["store"])
    print(f"== {block['where']} ({block['kind']})", flush=True)
    if block["kind"] in ("python", "ipython"):
        # One IPython shell per document, as one notebook: cells share a
        # namespace and fire the cell events (%dvr auto commits on them).
        if shell is None:
            from IPython.core.interactiveshell import InteractiveShell
            shell = InteractiveShell.instance()
            shell.user_ns["__name__"] = "__main__"
        result = shell.run_cell(text, store_history=True)
        if not result.success:
            err = result.error_before_exec or result.error_in_exec
            fail(block, "".join(traceback.format_exception(err)) if err is not None else "failed")
    elif block["kind"] == "sh":
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text])
        if proc.returncode != 0:
            fail(block, f"exit status {proc.returncode}")
    elif block["kind"] == "cpp":
        src = os.path.join(cfg["work"], f"block{n}.cpp")
        exe = os.path.join(cfg["work"], f"block{n}")
        with open(src, "w") as f:
            f.write(cpp_source(text))
        if not os.path.exists(exe):  # compiled in the first run, run in both
            cc = subprocess.run(["c++", "-std=c++20", "-O1", "-I", cfg["include"], src, "-o", exe,
                                 "-L", cfg["libdir"], "-ldvr", "-Wl,-rpath," + cfg["libdir"]],
                                capture_output=True, text=True)
            if cc.returncode != 0:
                fail(block, "does not compile:\n" + cc.stderr[-6000:])
        proc = subprocess.run([exe])
        if proc.returncode != 0:
            fail(block, f"exit status {proc.returncode}")
    else:
        fail(block, "unknown kind")
print("== all blocks ran", flush=True)
'''


@pytest.mark.parametrize("doc", DOCS)
def test_doc_runs_twice(doc, tmp_path):
    blocks = runnable(doc)
    assert blocks, f"{doc}: nothing to run"
    kinds = {b["kind"] for b in blocks}
    dvr = BUILD / "dvr"
    libdir = BUILD / "libdvr"
    if "sh" in kinds and not dvr.exists():
        pytest.skip(f"{dvr} is not built (DVR_BUILD_CLI=OFF): {doc} has shell blocks that use it")
    if "cpp" in kinds and not (libdir / "libdvr.so").exists():
        pytest.skip(f"{libdir}/libdvr.so is not built: {doc} has C++ blocks")
    if "cpp" in kinds and shutil.which("c++") is None:
        pytest.skip(f"no C++ compiler (c++) for the C++ blocks of {doc}")
    store = tmp_path / "store"
    work = tmp_path / "work"
    work.mkdir()
    (work / "build").symlink_to(BUILD)
    env = dict(os.environ, DVR_STORE=str(store), MEMDVR_STORE=str(store),
               PATH=f"{BUILD}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
               PYTHONPATH=str(BUILD / "python"))
    cfg = {"blocks": blocks, "doc_store": DOC_STORE, "store": str(store), "work": str(work),
           "include": str(ROOT / "libdvr" / "include"), "libdir": str(libdir),
           "cpp_prelude": CPP_PRELUDE}
    for run in (1, 2):
        proc = subprocess.run(["/usr/bin/python3", "-c", DRIVER], input=json.dumps(cfg), cwd=work,
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (
            f"{doc}, run {run} of 2 against the same store:\n{proc.stdout[-12000:]}\n{proc.stderr[-6000:]}")
        assert proc.stdout.rstrip().endswith("== all blocks ran")
