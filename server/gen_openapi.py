#!/usr/bin/env python3
"""Writes docs/openapi.json, the OpenAPI 3.0.3 description of `dvr serve`'s REST
API (docs/dashboard.md). The documents the CLI prints (docs/cli-schema.json)
are translated into components verbatim, so the API and `dvr --json` share one
schema; tests/python/test_serve.py checks that this script reproduces the
committed file, that every route the server registers is documented, and that
live responses fit. Run: /usr/bin/python3 server/gen_openapi.py > docs/openapi.json"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = json.loads((ROOT / "docs" / "cli-schema.json").read_text())


def ref(name):
    return {"$ref": "#/components/schemas/" + name}


def translate(rule, defs):
    """A cli-schema.json rule as an OpenAPI 3.0 schema object."""
    if "$ref" in rule:
        return ref(cli_name(rule["$ref"]))
    if "oneOf" in rule:
        choices = [c for c in rule["oneOf"] if c != {"type": "null"}]
        assert len(choices) == 1 and len(rule["oneOf"]) == 2, rule
        return {"nullable": True, "allOf": [translate(choices[0], defs)]}
    if "const" in rule:
        v = rule["const"]
        return {"type": "integer" if isinstance(v, int) else "string", "enum": [v]}
    out = {}
    if "enum" in rule:
        out = {"type": "string", "enum": rule["enum"]}
    t = rule.get("type")
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        assert len(rest) == 1, rule
        out["type"], out["nullable"] = rest[0], True
    elif t:
        out["type"] = t
    if "pattern" in rule:
        out["pattern"] = rule["pattern"]
    if "items" in rule:
        out["items"] = translate(rule["items"], defs)
    if "properties" in rule or "extends" in rule:
        props = dict(defs[rule["extends"]]["properties"]) if "extends" in rule else {}
        props.update(rule.get("properties", {}))
        optional = set(rule.get("optional", []))
        out["properties"] = {k: translate(v, defs) for k, v in props.items()}
        out["required"] = [k for k in props if k not in optional]
        out["additionalProperties"] = False
    return out


def cli_name(name):
    return "cli_" + name


def obj(props, optional=(), description=None):
    o = {"type": "object", "properties": props, "required": [k for k in props if k not in optional], "additionalProperties": False}
    if description:
        o["description"] = description
    return o


def doc(props, optional=(), description=None):
    return obj({"schema_version": {"type": "integer", "enum": [1]}, **props}, optional, description)


I = {"type": "integer"}
S = {"type": "string"}
B = {"type": "boolean"}
N = {"type": "number"}


def arr(x):
    return {"type": "array", "items": x}


def nullable(x):
    if "$ref" in x:
        return {"nullable": True, "allOf": [x]}
    return {**x, "nullable": True}


schemas = {}
for name, rule in CLI["$defs"].items():
    schemas[cli_name(name)] = translate(rule, CLI["$defs"])
for name, rule in CLI["documents"].items():
    schemas[cli_name(name)] = translate(rule, CLI["$defs"])

ERROR_CODES = ["not_found", "already_exists", "corrupt", "no_space", "invalid_argument", "io", "unsupported", "permission", "cancelled",
               "unauthorized", "forbidden", "rate_limited", "busy", "payload_too_large", "method_not_allowed", "internal"]
schemas.update({
    "error": doc({"error": obj({"code": {"type": "string", "enum": ERROR_CODES}, "message": S, "hint": S})},
                 description="Every error: the HTTP status and this body. `hint` says what to do (may be empty)."),
    "memory_sample": obj({"time_ns": I, "mem_total": I, "mem_available": I, "mem_used": I, "cached": I, "swap_used": I,
                          "pmem_total": I, "pmem_used": I, "store_bytes": I},
                         description="Host memory in bytes (/proc/meminfo: MemTotal, MemAvailable, MemTotal-MemAvailable, Cached, "
                                     "SwapTotal-SwapFree), persistent memory (statvfs of the file systems of the stores whose medium "
                                     "is pmem, each counted once) and the pack bytes of all stores."),
    "health": doc({"version": S, "host": S, "time": ref("cli_time"), "time_ns": I, "stores": I, "peers": I,
                   "auth": {"type": "string", "enum": ["csrf", "token"]}, "tls": B, "sample_every_s": N},
                  description="`auth`: what a mutating request needs: `csrf` (the X-DVR-CSRF header with the token of the "
                              "`dvr-csrf` meta tag of /index.html) or `token` (Authorization: Bearer, from --token-file)."),
    "store_summary": obj({"id": S, "path": S, "medium": {"type": "string", "enum": ["pmem", "dram", "disk"]}, "format_version": I,
                          "sessions": I, "snapshots": I, "logical_bytes": I, "pack_bytes": I, "free_bytes": I, "total_bytes": I,
                          "dedup_ratio": N},
                         description="`id` is the store's name in URLs (its directory's basename, -2, -3 for repeats). "
                                     "`dedup_ratio`: logical_bytes / pack_bytes (1 when nothing is stored)."),
    "stores": doc({"stores": arr(ref("store_summary"))}),
    "store": {"allOf": [ref("cli_stat")], "description": "The `stat` document plus these fields.",
              "x-dvr-extra": {"id": S, "free_bytes": I, "total_bytes": I, "dedup_ratio": N, "warnings": arr(S)}},
    "session_summary": obj({"name": S, "snapshots": I, "latest": nullable(ref("cli_snapshot")), "logical_bytes": I, "stored_bytes": I},
                           description="`latest`: the newest snapshot; `logical_bytes`: of all its snapshots; `stored_bytes`: what they added."),
    "sessions": doc({"store": S, "sessions": arr(ref("session_summary"))}),
    "job": obj({"pid": I, "store": S, "kind": {"type": "string", "enum": ["run", "dump_every", "autosave"]}, "session": nullable(S),
                "command": S, "started_ns": I,
                "rss_bytes": I, "heap": nullable(S), "heap_bytes": I, "interval_s": nullable(N), "last_dump": nullable(ref("cli_process")),
                "last_snapshot": nullable(ref("cli_snapshot")),
                "last_dump_name": nullable(S), "next_dump_ns": nullable(I), "last_error": nullable(S), "alive": B},
               description="A `dvr run` job, a `dvr proc dump --every` series, or a session's autosave (kind autosave: `session`, and the "
                           "last autosave in `last_snapshot`, its SESSION/NAME in `last_dump_name`), from STORE/run/ (dvr/jobs.hpp)."),
    "jobs": doc({"jobs": arr(ref("job"))}),
    "dismiss": obj({"session": S}, optional=("session",), description="kind autosave: the job's session (an autosave record is per session)"),
    "dismissed": doc({"dismissed": B}),
    "memory": doc({"interval_s": N, "capacity": I, "samples": arr(ref("memory_sample"))}),
    "alert": obj({"id": S, "severity": {"type": "string", "enum": ["error", "warning"]},
                  "kind": {"type": "string", "enum": ["damaged_snapshot", "low_space", "autosave_failed", "autosave_late", "dump_failed",
                                                      "dump_late", "peer_unreachable", "permissions"]},
                  "store": S, "subject": S, "message": S, "since_ns": I}),
    "alerts": doc({"alerts": arr(ref("alert"))}),
    "host": obj({"name": S, "url": S, "reachable": B, "error": S, "memory": nullable(ref("memory_sample")), "stores": arr(ref("store_summary")),
                 "alerts": I},
                optional=["error"], description="`url` is \"\" for this server itself."),
    "hosts": doc({"hosts": arr(ref("host"))}),
    "operation": obj({"id": S, "action": {"type": "string", "enum": ["verify", "gc", "prune", "rm", "proc-dump", "proc-restore", "proc-clone", "push"]},
                      "store": S, "state": {"type": "string", "enum": ["queued", "running", "done", "failed"]}, "done": I, "total": I,
                      "started_ns": I, "finished_ns": nullable(I), "result": {"type": "object", "nullable": True,
                                                                            "description": "the CLI document of the action (verify, gc, prune, rm, "
                                                                                           "proc_info, proc_restore, transfer_sent)"},
                      "error": nullable(ref("error_body"))}),
    "error_body": obj({"code": S, "message": S, "hint": S}),
    "operation_doc": doc({"operation": ref("operation")}),
    "operations": doc({"operations": arr(ref("operation"))}),
    "route": obj({"method": {"type": "string", "enum": ["GET", "POST"]}, "path": S}),
    "routes": doc({"routes": arr(ref("route"))}),
    "action_verify": obj({}, description="verify: re-hash every chunk of the store (no arguments)."),
    "action_gc": obj({}, description="gc: reclaim the space of removed snapshots (no arguments)."),
    "action_prune": obj({"session": S, "keep_last": I, "keep_within_s": I, "keep_hourly": I, "keep_daily": I, "keep_weekly": I,
                         "keep_monthly": I, "dry_run": B},
                        optional=["keep_last", "keep_within_s", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly", "dry_run"],
                        description="prune: `dvr prune` (at least one keep rule)."),
    "action_rm": obj({"session": S, "names": arr(S)}, description="rm: `dvr rm SESSION/NAME...` (every name checked first)."),
    "action_proc_dump": obj({"pid": I, "name": S, "leave_running": B, "tcp_established": B}, optional=["leave_running", "tcp_established"],
                            description="proc-dump: `dvr proc dump PID --name NAME` (leave_running defaults to true here)."),
    "action_proc_restore": obj({"name": S, "tcp_established": B}, optional=["tcp_established"],
                               description="proc-restore: `dvr proc restore NAME --detach`."),
    "action_proc_clone": obj({"name": S, "net": S, "ip": S, "host_ip": S}, optional=["net", "ip", "host_ip"],
                             description="proc-clone: `dvr proc clone NAME [--net new|NETNS] [--ip A/P] [--host-ip A]`."),
    "action_push": obj({"ref": S, "to": S},
                       description="push: send snapshot `ref` (SESSION/NAME or proc/NAME) to `to`: the id of another store of this server, "
                                   "or ssh://[USER@]HOST[:PORT]/STORE (`dvr push`)."),
})
# The store document: stat's properties plus the extras, flat.
extra = schemas["store"].pop("x-dvr-extra")
stat = schemas["cli_stat"]
schemas["store"] = {"type": "object", "description": "The `stat` document plus id, free_bytes, total_bytes, dedup_ratio; warnings: the stat document's own (loosened permissions), then the server's (tmpfs, low space).",
                    "properties": {**stat["properties"], **extra}, "required": stat["required"] + list(extra), "additionalProperties": False}

ERR = {"description": "error", "content": {"application/json": {"schema": ref("error")}}}


def ok(schema_name, description="OK", status="200"):
    return {status: {"description": description, "content": {"application/json": {"schema": ref(schema_name)}}},
            "default": ERR}


def param(name, where="path", description="", schema=None):
    return {"name": name, "in": where, "required": where == "path", "description": description, "schema": schema or S}


STORE_ID = param("id", description="the store's id (GET /api/v1/stores)")
SESSION = param("session", description="a session name (1-128 of [A-Za-z0-9._-], not starting with '.')")
NAME = param("name", description="a snapshot name (the same rules)")

SECURITY_NOTE_BASE = ("Needs Authorization: Bearer TOKEN when the server has --token-file, else the X-DVR-CSRF header; an Origin or "
                      "Sec-Fetch-Site header that is not this server's own origin is refused (403).")

paths = {
    "/api/v1/health": {"get": {"summary": "the server: version, host, time, how many stores and peers, what mutating requests need",
                               "responses": ok("health")}},
    "/api/v1/hosts": {"get": {"summary": "this host and each --peer (queried with a short timeout, cached a few seconds)",
                              "parameters": [param("local", "query", "1: this host only (what a peer asks)", {"type": "integer", "enum": [0, 1]})],
                              "responses": ok("hosts")}},
    "/api/v1/stores": {"get": {"summary": "every store served", "responses": ok("stores")}},
    "/api/v1/stores/{id}": {"get": {"summary": "one store: the stat document plus space and warnings", "parameters": [STORE_ID],
                                    "responses": ok("store")}},
    "/api/v1/stores/{id}/sessions": {"get": {"summary": "the store's sessions", "parameters": [STORE_ID], "responses": ok("sessions")}},
    "/api/v1/stores/{id}/sessions/{session}/snapshots": {"get": {"summary": "the log document: a session's snapshots (parent links make the tree)",
                                                                 "parameters": [STORE_ID, SESSION], "responses": ok("cli_log")}},
    "/api/v1/stores/{id}/sessions/{session}/snapshots/{name}": {"get": {"summary": "the info document of one snapshot",
                                                                        "parameters": [STORE_ID, SESSION, NAME], "responses": ok("cli_info")}},
    "/api/v1/stores/{id}/sessions/{session}/diff": {"get": {"summary": "the diff document of two snapshots of the session",
                                                            "parameters": [STORE_ID, SESSION, param("a", "query", "snapshot name"),
                                                                           param("b", "query", "snapshot name")],
                                                            "responses": ok("cli_diff")}},
    "/api/v1/stores/{id}/processes": {"get": {"summary": "the proc_ls document: the store's process snapshots", "parameters": [STORE_ID],
                                              "responses": ok("cli_proc_ls")}},
    "/api/v1/jobs": {"get": {"summary": "running `dvr run` jobs, `dvr proc dump --every` series and session autosaves of every store, and ended "
                                        "ones whose last dump or autosave failed", "responses": ok("jobs")}},
    "/api/v1/stores/{id}/jobs/{pid}/dismiss": {"post": {
        "summary": "remove the record of an ended job that stays for its error (and its dump_failed or autosave_failed alert); "
                   "409 while the job runs, 404 when there is no such record",
        "description": SECURITY_NOTE_BASE,
        "parameters": [STORE_ID, param("pid", description="the job's PID", schema=I)],
        "security": [{"bearer": []}, {"csrf": []}],
        "requestBody": {"required": False, "content": {"application/json": {"schema": ref("dismiss")}}},
        "responses": ok("dismissed")}},
    "/api/v1/memory": {"get": {"summary": "host memory samples, oldest first (a ring of at least 24 h)",
                               "parameters": [param("since", "query", "only samples taken after this time (ns since the epoch)", I)],
                               "responses": ok("memory")}},
    "/api/v1/alerts": {"get": {"summary": "current alerts", "responses": ok("alerts")}},
    "/api/v1/operations": {"get": {"summary": "recent operations (actions), newest last", "responses": ok("operations")}},
    "/api/v1/operations/{id}": {"get": {"summary": "one operation", "parameters": [param("id", description="the operation's id")],
                                        "responses": ok("operation_doc")}},
    "/api/v1/openapi.json": {"get": {"summary": "this document", "responses": {"200": {"description": "OpenAPI 3.0.3",
                                                                                      "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    "/api/v1/routes": {"get": {"summary": "every route the server registers (method and path template)", "responses": ok("routes")}},
}
ACTIONS = {"verify": "action_verify", "gc": "action_gc", "prune": "action_prune", "rm": "action_rm", "proc-dump": "action_proc_dump",
           "proc-restore": "action_proc_restore", "proc-clone": "action_proc_clone", "push": "action_push"}
SECURITY_NOTE = (SECURITY_NOTE_BASE + " Rate limited per action (429 with Retry-After); "
                 "verify, gc, push and proc-* run one at a time per store (429 busy while one runs).")
for action, schema in ACTIONS.items():
    paths[f"/api/v1/stores/{{id}}/actions/{action}"] = {"post": {
        "summary": f"start `{action}` on the store; 202 with the operation (state done or failed when it finished before the reply)",
        "description": SECURITY_NOTE,
        "parameters": [STORE_ID],
        "security": [{"bearer": []}, {"csrf": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(schema)}}},
        "responses": {"202": {"description": "accepted", "content": {"application/json": {"schema": ref("operation_doc")}}}, "default": ERR}}}

openapi = {
    "openapi": "3.0.3",
    "info": {"title": "Memory DVR server (dvr serve)", "version": "1",
             "description": "The REST API of `dvr serve` (docs/dashboard.md). Every document carries schema_version 1 and uses the field "
                            "names of `dvr --json` (docs/cli-schema.json; components cli_*). Generated by server/gen_openapi.py."},
    "servers": [{"url": "http://127.0.0.1:8642"}],
    "paths": paths,
    "components": {"schemas": schemas,
                   "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "the token of --token-file"},
                                       "csrf": {"type": "apiKey", "in": "header", "name": "X-DVR-CSRF",
                                                "description": "the per-process token of the dvr-csrf meta tag of /index.html"}}},
}
json.dump(openapi, sys.stdout, indent=1)
sys.stdout.write("\n")
