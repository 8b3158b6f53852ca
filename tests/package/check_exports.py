#!/usr/bin/env python3
"""Every function the installed public headers declare for libdvr to define is
marked DVR_EXPORT (dvr/export.h), itself or through its class.

libdvr.so and libdvr_mpi.so are built with -fvisibility=hidden: a public
declaration without DVR_EXPORT compiles in a program but fails to link (or
links only inside the build tree). Run by tests/package/run.sh on the
installed headers:

    check_exports.py INCLUDE_DIR HEADER... [-- EXTRA_COMPILER_FLAGS...]

It asks clang for the headers' AST (JSON) and checks, outside namespace
dvr::detail (internal, hidden on purpose):
  - each free function (C or C++) declared without a body and not inline,
    constexpr or a template carries DVR_EXPORT;
  - each class with a member function declared without a body (not inline,
    defaulted, deleted or pure) carries DVR_EXPORT, as the class, an enclosing
    class, or the member itself.
Exit 0 when all do, 1 listing those that do not, 77 when clang is missing.
"""
import json
import os
import shutil
import subprocess
import sys


def main(argv):
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    include, headers = argv[0], argv[1:]
    clang = shutil.which("clang++") or shutil.which("clang++-14")
    if not clang:
        print("check_exports: clang++ not found: the DVR_EXPORT check is skipped")
        return 77
    include = os.path.realpath(include)
    tu = "".join(f"#include <dvr/{h}>\n" for h in headers)
    out = subprocess.run([clang, "-x", "c++", "-std=c++20", "-fsyntax-only", "-I", include, *extra,
                          "-Xclang", "-ast-dump=json", "-Xclang", "-ast-dump-filter", "-Xclang", "dvr", "-"],
                         input=tu, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        print("check_exports: the headers do not compile with clang", file=sys.stderr)
        return 1
    dec = json.JSONDecoder()
    text, i, roots = out.stdout, 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        o, i = dec.raw_decode(text, i)
        roots.append(o)

    sources = {}

    def spelled(path, offset, word):
        if path not in sources:
            with open(path, "rb") as f:
                sources[path] = f.read()
        return sources[path][offset:offset + len(word) + 1].rstrip(b" \t\n(") == word.encode()

    # clang's JSON leaves out a location's file when it is the one printed
    # last: follow the file in document order.
    state = {"file": None}

    def locate(o):
        """Fills in 'file' of every location under o, in document order."""
        if isinstance(o, dict):
            if "offset" in o or "file" in o:
                if "file" in o:
                    state["file"] = o["file"]
                else:
                    o["file"] = state["file"]
            for v in o.values():
                locate(v)
        elif isinstance(o, list):
            for v in o:
                locate(v)

    for r in roots:
        locate(r)

    def exported(node):
        for c in node.get("inner", []):
            if c.get("kind") == "VisibilityAttr":
                b = c.get("range", {}).get("begin", {})
                loc = b.get("expansionLoc", b)
                if loc.get("file") and spelled(loc["file"], loc["offset"], "DVR_EXPORT"):
                    return True
        return False

    def in_public_header(node):
        loc = node.get("loc", {})
        loc = loc.get("expansionLoc", loc)
        f = loc.get("file")
        return f is not None and os.path.realpath(f).startswith(include + os.sep)

    def has_body(node):
        return any(c.get("kind") == "CompoundStmt" for c in node.get("inner", []))

    def defined_by_library(node):
        return not (has_body(node) or node.get("inline") or node.get("constexpr") or node.get("explicitlyDeleted")
                    or node.get("explicitlyDefaulted") or node.get("pure") or node.get("isImplicit"))

    missing, checked, seen = [], [0], set()

    def walk(node, scope, record_exported, in_template):
        kind = node.get("kind")
        if node.get("id") in seen:
            return
        seen.add(node.get("id"))
        name = node.get("name", "")
        if kind == "NamespaceDecl":
            if name == "detail" or name == "":
                return
            for c in node.get("inner", []):
                walk(c, scope + [name], False, in_template)
        elif kind in ("LinkageSpecDecl", "TranslationUnitDecl"):
            for c in node.get("inner", []):
                walk(c, scope, False, in_template)
        elif kind in ("FunctionTemplateDecl", "ClassTemplateDecl"):
            return  # defined in the header, instantiated by the program
        elif kind == "CXXRecordDecl":
            if not node.get("completeDefinition"):
                return
            mine = record_exported or exported(node)
            for c in node.get("inner", []):
                walk(c, scope + [name], mine, in_template)
        elif kind == "FunctionDecl":
            if in_public_header(node) and defined_by_library(node):
                checked[0] += 1
                if not exported(node):
                    missing.append("::".join(scope + [name]) + "()")
        elif kind in ("CXXMethodDecl", "CXXConstructorDecl", "CXXDestructorDecl", "CXXConversionDecl"):
            if in_public_header(node) and defined_by_library(node):
                checked[0] += 1
                if not (record_exported or exported(node)):
                    missing.append("::".join(scope + [name]) + "()")

    for r in roots:
        walk(r, [], False, False)
    if missing:
        print("check_exports: declared in the public headers, defined in the library, but not DVR_EXPORT "
              "(a program cannot link them):", file=sys.stderr)
        for m in sorted(set(missing)):
            print("  " + m, file=sys.stderr)
        return 1
    print(f"check_exports: {checked[0]} functions declared in {len(headers)} public headers, all DVR_EXPORT")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
