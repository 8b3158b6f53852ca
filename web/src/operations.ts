// Actions (POST /stores/{id}/actions/{action}) and the operations they start:
// each is shown in the operations panel with a progress bar, polled every
// second until it is done or failed.

import { ApiError, get, post, seg, type Operation } from './api';
import { h, replace } from './dom';
import { printable } from './format';

interface Tracked { op: Operation; title: string; el: HTMLElement; resolve: (op: Operation) => void }

/** queued or running */
const active = (op: Operation) => op.state === 'running' || op.state === 'queued';

const tracked = new Map<string, Tracked>();
let timer: number | undefined;
let finishedListener: (() => void) | null = null;

/** Called after any operation finishes (the current view refreshes). */
export function onOperationFinished(f: () => void): void {
  finishedListener = f;
}

function panel(): HTMLElement {
  return document.getElementById('operations')!;
}

function errorText(e: Operation['error']): string {
  if (!e) return '';
  if (typeof e === 'string') return e;
  return e.hint ? `${e.message} (${e.hint})` : e.message;
}

/** One line of what an operation's result says (the pid of a clone, bytes freed by gc...). */
export function resultSummary(op: Operation): string {
  const r = op.result as Record<string, unknown> | null;
  if (!r) return '';
  if (typeof r.pid === 'number' && (op.action === 'proc-clone' || op.action === 'proc-restore')) return `pid ${r.pid}`;
  if (op.action === 'verify') return r.ok ? 'no problems' : `${(r.damaged_snapshots as unknown[] | undefined)?.length ?? 0} damaged snapshots`;
  if (op.action === 'gc' && typeof r.bytes_before === 'number' && typeof r.bytes_after === 'number') return `freed ${r.bytes_before - r.bytes_after} bytes`;
  if (op.action === 'rm' && Array.isArray(r.removed)) return `removed ${r.removed.length}`;
  if (op.action === 'prune' && typeof r.removed === 'number') return `${r.dry_run ? 'would remove' : 'removed'} ${r.removed}`;
  if (op.action === 'proc-dump' && typeof r.name === 'string') return `dumped ${r.name}`;
  return '';
}

function draw(t: Tracked): void {
  const op = t.op;
  const frac = op.total > 0 ? Math.min(1, op.done / op.total) : active(op) ? 0 : 1;
  const bar = h('progress', { max: 1, value: frac });
  if (active(op) && op.total <= 0) bar.removeAttribute('value'); // indeterminate
  const pid = op.result && typeof (op.result as { pid?: unknown }).pid === 'number' ? (op.result as { pid: number }).pid : null;
  t.el.setAttribute('data-state', op.state);
  t.el.className = `op op-${op.state}`;
  if (pid !== null) t.el.setAttribute('data-pid', String(pid));
  replace(t.el,
    h('div', { class: 'op-title' }, printable(t.title), h('span', { class: 'op-state' }, op.state)),
    bar,
    op.state === 'done' ? h('div', { class: 'op-result' }, resultSummary(op)) : null,
    op.state === 'failed' ? h('div', { class: 'op-error' }, printable(errorText(op.error))) : null,
    !active(op) ? h('button', { class: 'small', onclick: () => { t.el.remove(); tracked.delete(op.id); } }, 'dismiss') : null);
}

async function poll(): Promise<void> {
  timer = undefined;
  let finished = false;
  for (const t of tracked.values()) {
    if (!active(t.op)) continue;
    try {
      t.op = (await get<{ operation: Operation }>(`/operations/${seg(t.op.id)}`)).operation;
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) {
        t.op = { ...t.op, state: 'failed', error: 'the server no longer knows this operation (restarted?)' };
      } else {
        continue; // a network hiccup: try again at the next poll
      }
    }
    draw(t);
    if (!active(t.op)) {
      finished = true;
      t.resolve(t.op);
    }
  }
  if (finished && finishedListener) finishedListener();
  schedule();
}

function schedule(): void {
  if (timer !== undefined || document.hidden) return;
  if ([...tracked.values()].some((t) => active(t.op))) timer = window.setTimeout(poll, 1000);
}

document.addEventListener('visibilitychange', () => {
  if (!document.hidden) schedule();
});

/**
 * Starts an action on a store and tracks its operation; resolves with the
 * finished operation (done or failed). A refused request (4xx/5xx) shows as a
 * failed operation too.
 */
export async function startAction(store: string, action: string, body: Record<string, unknown>, title: string): Promise<Operation> {
  const el = h('div', { class: 'op', 'data-action': action });
  panel().prepend(el);
  const now = Date.now() * 1e6;
  const t: Tracked = {
    op: { id: '', action, store, state: 'running', done: 0, total: 0, started_ns: now, finished_ns: null, result: null, error: null },
    title, el, resolve: () => {},
  };
  draw(t);
  let op: Operation;
  try {
    const r = await post<{ operation: Operation }>(`/stores/${seg(store)}/actions/${seg(action)}`, body);
    op = r.operation;
  } catch (e) {
    const err = e instanceof ApiError ? { code: e.code, message: e.message, hint: e.hint } : String(e);
    t.op = { ...t.op, state: 'failed', error: err, finished_ns: Date.now() * 1e6 };
    draw(t);
    tracked.set(`local-${now}`, t);
    return t.op;
  }
  t.op = op;
  el.setAttribute('data-op-id', op.id);
  tracked.set(op.id, t);
  draw(t);
  const p = new Promise<Operation>((resolve) => { t.resolve = resolve; });
  if (!active(op)) {
    t.resolve(op);
    if (finishedListener) finishedListener();
  }
  schedule();
  return p;
}
