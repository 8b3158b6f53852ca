"""Checks JSON documents against docs/cli-schema.json, the written schema of
`dvr --json` and `python -m memdvr --json` (a small subset of JSON Schema:
type, properties (all required unless listed in "optional", no others
allowed), items, $ref into $defs, extends (a $defs object whose properties
are added), const, enum, pattern, oneOf)."""

import json
import re
from pathlib import Path

SCHEMA_FILE = Path(__file__).resolve().parent.parent.parent / "docs" / "cli-schema.json"
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def load_schema():
    return json.loads(SCHEMA_FILE.read_text())


def _is(value, name):
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def problems(value, rule, schema, where="$"):
    """What is wrong with `value` under `rule` (a list of messages, empty when it fits)."""
    defs = schema["$defs"]
    if "$ref" in rule:
        return problems(value, defs[rule["$ref"]], schema, where)
    if "oneOf" in rule:
        fits = [r for r in rule["oneOf"] if not problems(value, r, schema, where)]
        return [] if len(fits) == 1 else [f"{where}: fits {len(fits)} of the oneOf choices: {value!r}"]
    out = []
    if "const" in rule and value != rule["const"]:
        out.append(f"{where}: {value!r} is not {rule['const']!r}")
    if "enum" in rule and value not in rule["enum"]:
        out.append(f"{where}: {value!r} is not one of {rule['enum']}")
    if "type" in rule:
        types = rule["type"] if isinstance(rule["type"], list) else [rule["type"]]
        if not any(_is(value, t) for t in types):
            return out + [f"{where}: {value!r} is not {' or '.join(types)}"]
    if "pattern" in rule and isinstance(value, str) and not re.search(rule["pattern"], value):
        out.append(f"{where}: {value!r} does not match {rule['pattern']}")
    if isinstance(value, dict) and ("properties" in rule or "extends" in rule):
        props = dict(defs[rule["extends"]]["properties"]) if "extends" in rule else {}
        props.update(rule.get("properties", {}))
        optional = set(rule.get("optional", []))
        for key in sorted(set(props) - set(value) - optional):
            out.append(f"{where}: lacks {key!r}")
        for key in sorted(set(value) - set(props)):
            out.append(f"{where}: has {key!r}, which the schema does not name")
        for key in sorted(set(value) & set(props)):
            out += problems(value[key], props[key], schema, f"{where}.{key}")
    if isinstance(value, list) and "items" in rule:
        for k, item in enumerate(value):
            out += problems(item, rule["items"], schema, f"{where}[{k}]")
    return out


def check(doc, name, schema=None):
    """Asserts that `doc` is a valid `name` document (a key of "documents")."""
    schema = schema or load_schema()
    found = problems(doc, schema["documents"][name], schema)
    assert not found, f"{name} document does not fit docs/cli-schema.json:\n  " + "\n  ".join(found) + f"\n{doc}"
