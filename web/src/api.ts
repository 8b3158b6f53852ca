// The client of dvr serve's REST API (/api/v1, docs/openapi.json).
//
// Authentication (docs/dashboard.md, "Security"): on loopback without
// --token-file nothing is needed to read; a mutating request carries the
// per-process CSRF token dvr serve writes into index.html (<meta
// name="dvr-csrf">) as the X-DVR-CSRF header. With --token-file the server
// answers 401: the dashboard then asks for the token once, keeps it in
// sessionStorage (this tab only) and sends it as "Authorization: Bearer".

import { h } from './dom';

export const API = './api/v1';
const TOKEN_KEY = 'dvr-token';

export interface ApiErrorBody { code: string; message: string; hint?: string }

/** A failed request: the HTTP status and the server's error document. */
export class ApiError extends Error {
  constructor(public status: number, public code: string, message: string, public hint?: string) {
    super(message);
  }
}

export interface Snapshot {
  session: string; name: string; parent: string; label: string; time_ns: number; time: string;
  logical_bytes: number; stored_bytes: number; chunks: number; zero_chunks: number;
  regions: { name: string; size: number; sdk_owned: boolean }[];
  tracking: string; chunks_read: number; damaged: boolean; damage: string; pending: boolean;
}
export interface Process {
  name: string; time_ns: number; time: string; pid: number; command: string; leave_running: boolean;
  image_bytes: number; stored_bytes: number; parent: string;
  heaps: { path: string; bytes: number; store: string; session: string }[];
}
export interface MemorySample {
  time_ns: number; mem_total: number; mem_available: number; mem_used: number; cached: number;
  swap_used: number; pmem_total: number; pmem_used: number; store_bytes: number;
}
export interface Store {
  id: string; path: string; medium: string; format_version: number; sessions: number; snapshots: number;
  logical_bytes: number; pack_bytes: number; free_bytes: number; total_bytes: number; dedup_ratio: number;
}
export interface Host {
  name: string; url: string; reachable: boolean; error?: string;
  memory: MemorySample | null; stores: Store[]; alerts?: number;
}
export interface Health {
  version: string; host: string; time: string; time_ns: number; stores: number; peers: number;
  /** what a mutating request needs: the CSRF header, or the --token-file token */
  auth?: 'csrf' | 'token'; tls?: boolean; sample_every_s?: number;
}
export interface Session { name: string; snapshots: number; latest: Snapshot | null; logical_bytes: number; stored_bytes: number }
export interface RegionDiff {
  name: string; size_a: number; size_b: number; only_in_a: boolean; only_in_b: boolean; bytes_differ: number; pages_differ: number;
}
export interface Job {
  pid: number; store: string; kind: 'run' | 'dump_every' | 'autosave'; session: string | null; command: string; started_ns: number; rss_bytes: number;
  heap: string | null; heap_bytes: number; interval_s: number | null; last_dump: Process | null; last_snapshot: Snapshot | null;
  last_dump_name: string | null;
  next_dump_ns: number | null; last_error: string | null; alive: boolean;
}
export interface Alert {
  id: string; severity: 'error' | 'warning'; kind: string; store: string; subject: string; message: string; since_ns: number;
}
export interface Operation {
  id: string; action: string; store: string; state: 'queued' | 'running' | 'done' | 'failed'; done: number; total: number;
  started_ns: number; finished_ns: number | null; result: Record<string, unknown> | null;
  error: ApiErrorBody | string | null;
}

function csrf(): string {
  return document.querySelector<HTMLMetaElement>('meta[name="dvr-csrf"]')?.content ?? '';
}

let tokenPrompt: Promise<void> | null = null;

/** Asks for the API token (once for all requests waiting on it); keeps it in sessionStorage. */
function askToken(refused: boolean): Promise<void> {
  if (tokenPrompt) return tokenPrompt;
  tokenPrompt = new Promise<void>((resolve) => {
    const input = h('input', { type: 'password', id: 'token-input', autocomplete: 'off', required: true, size: 40 });
    const form = h('form', { class: 'dialog', id: 'token-form' },
      h('h2', undefined, 'This server needs a token'),
      h('p', undefined, refused
        ? 'The token was refused. Enter the token of the server\'s --token-file:'
        : 'dvr serve runs with --token-file. Enter the token (kept for this tab only):'),
      input, ' ', h('button', { type: 'submit' }, 'Sign in'));
    const shade = h('div', { class: 'shade' }, form);
    form.addEventListener('submit', (e) => {
      e.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      shade.remove();
      tokenPrompt = null;
      resolve();
    });
    document.body.append(shade);
    input.focus();
  });
  return tokenPrompt;
}

async function request<T>(method: string, path: string, body?: unknown): Promise<T> {
  for (;;) {
    const headers: Record<string, string> = { Accept: 'application/json' };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (method !== 'GET') {
      headers['Content-Type'] = 'application/json';
      headers['X-DVR-CSRF'] = csrf();
    }
    const r = await fetch(API + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), credentials: 'same-origin' });
    if (r.status === 401) {
      await askToken(token !== null);
      continue;
    }
    let doc: unknown = null;
    const text = await r.text();
    try {
      doc = text ? JSON.parse(text) : null;
    } catch {
      throw new ApiError(r.status, 'bad_response', `${method} ${path}: the server answered ${r.status} with something that is not JSON`);
    }
    if (!r.ok) {
      const e = (doc as { error?: ApiErrorBody } | null)?.error;
      throw new ApiError(r.status, e?.code ?? 'http_' + r.status, e?.message ?? `${method} ${path}: HTTP ${r.status}`, e?.hint);
    }
    return doc as T;
  }
}

export const get = <T>(path: string) => request<T>('GET', path);
export const post = <T>(path: string, body: unknown) => request<T>('POST', path, body);

/** encodeURIComponent for one path segment (store ids, session and snapshot names). */
export const seg = (s: string) => encodeURIComponent(s);
