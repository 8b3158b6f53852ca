// Jobs: running `dvr run` jobs, `dvr proc dump --every` series and session
// autosaves, and each store's process snapshots, with dump / restore / clone
// buttons. A button starts an action and the operations panel follows it
// with a progress bar. An ended job that failed can be dismissed.

import { ApiError, get, post, seg, type Job, type Process, type Store } from '../api';
import { h, num, table } from '../dom';
import { ago, bytes, printable, time } from '../format';
import { startAction } from '../operations';
import type { View } from './view';

export interface JobsData { jobs: Job[]; stores: Store[]; processes: Record<string, Process[]> }

/** A snapshot name for a new dump of command: its program's name and the UTC time. */
export function dumpName(command: string): string {
  const prog = (command.trim().split(/\s+/)[0] ?? '').split('/').pop() ?? '';
  const clean = prog.replace(/[^A-Za-z0-9._-]/g, '').replace(/^[.-]+/, '') || 'job';
  const t = new Date().toISOString().replace(/[-:]/g, '').replace(/\.\d+Z$/, 'Z');
  return `${clean}-${t}`;
}

function dumpButton(store: string, pid: number, command: string, refresh: () => void): HTMLElement {
  return h('button', { class: 'small', 'data-action': 'proc-dump', onclick: () => {
    const name = dumpName(command);
    void startAction(store, 'proc-dump', { pid, name, leave_running: true }, `dump pid ${pid} as ${name}`).then(refresh);
  } }, 'Dump');
}

function dumpForm(store: string, refresh: () => void): HTMLElement {
  const pid = h('input', { type: 'number', min: 1, placeholder: 'PID', class: 'pid-input', required: true });
  const name = h('input', { type: 'text', placeholder: 'snapshot name', class: 'name-input', required: true, pattern: '[A-Za-z0-9._-]+' });
  const leave = h('input', { type: 'checkbox', checked: true });
  const form = h('form', { class: 'dump-form', 'data-store': store }, 'Dump a process: ', pid, ' ', name, ' ',
    h('label', undefined, leave, ' leave running'), ' ', h('button', { type: 'submit', class: 'small' }, 'Dump'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    void startAction(store, 'proc-dump', { pid: Number(pid.value), name: name.value, leave_running: leave.checked },
      `dump pid ${pid.value} as ${name.value}`).then(refresh);
  });
  return form;
}

function kindOf(j: Job): string {
  if (j.kind === 'dump_every') return `dump every ${j.interval_s ?? '?'} s`;
  if (j.kind === 'autosave') return `autosave of ${j.session ?? '?'} every ${j.interval_s ?? '?'} s`;
  return 'dvr run';
}

function lastOf(j: Job, now: number): string {
  if (j.last_dump) return `${printable(j.last_dump.name)} (${ago(j.last_dump.time_ns, now)})`;
  if (j.last_snapshot) return `${printable(j.last_dump_name ?? j.last_snapshot.name)} (${ago(j.last_snapshot.time_ns, now)})`;
  return printable(j.last_dump_name) || '–';
}

/** An ended job kept for its error: a button that removes its record (and its alert). */
function dismissButton(j: Job, refresh: () => void): HTMLElement {
  const b = h('button', { class: 'small', 'data-action': 'dismiss', title: 'remove the record of this ended job and its alert', onclick: () => {
    b.disabled = true;
    post(`/stores/${seg(j.store)}/jobs/${j.pid}/dismiss`, j.session ? { session: j.session } : {}).then(refresh, (e: unknown) => {
      b.disabled = false;
      b.title = e instanceof ApiError ? e.message : String(e);
    });
  } }, 'Dismiss');
  return b;
}

export const jobs: View<JobsData> = {
  name: 'jobs',
  async load() {
    const [j, st] = await Promise.all([get<{ jobs: Job[] }>('/jobs'), get<{ stores: Store[] }>('/stores')]);
    const procs = await Promise.all(st.stores.map((s) => get<{ processes: Process[] }>(`/stores/${seg(s.id)}/processes`)));
    const processes: Record<string, Process[]> = {};
    st.stores.forEach((s, i) => { processes[s.id] = procs[i].processes; });
    return { jobs: j.jobs, stores: st.stores, processes };
  },
  // redrawn at least every 30 s, for the "ago" columns
  state: () => Math.floor(Date.now() / 30000),
  render(d, _args, refresh) {
    const now = Date.now() * 1e6;
    const running = d.jobs.length
      ? table('jobs', ['pid', 'kind', 'store', 'command', 'started', 'RSS', 'heap', 'last dump', 'next dump', ''], d.jobs.map((j) => [
        num(j.pid), kindOf(j), printable(j.store), h('code', undefined, printable(j.command)), time(j.started_ns), num(bytes(j.rss_bytes)),
        j.heap ? h('span', { title: printable(j.heap) }, bytes(j.heap_bytes)) : '–',
        h('td', undefined, lastOf(j, now),
          j.last_error ? h('div', { class: 'error small' }, printable(j.last_error)) : null),
        j.next_dump_ns ? ago(j.next_dump_ns, now) : '–',
        h('td', { class: 'actions' }, j.alive ? dumpButton(j.store, j.pid, j.command, refresh)
          : h('span', undefined, h('span', { class: 'sev error' }, 'gone'), ' ', dismissButton(j, refresh))),
      ]), (i) => ({ 'data-pid': d.jobs[i].pid }))
      : h('p', { class: 'muted' }, 'No running jobs (dvr run, dvr proc dump --every, Session autosave).');
    return h('div', { class: 'jobs-view' },
      h('section', undefined, h('h2', undefined, 'Jobs'), running),
      ...d.stores.map((st) => h('section', { 'data-store': st.id },
        h('h2', undefined, 'Process snapshots in ', printable(st.id)),
        (d.processes[st.id] ?? []).length
          ? table('processes', ['name', 'time', 'pid', 'command', 'image', 'stored', 'parent', 'heaps', ''],
            [...d.processes[st.id]].sort((a, b) => b.time_ns - a.time_ns).map((p) => [
              h('b', undefined, printable(p.name)), time(p.time_ns), num(p.pid), h('code', undefined, printable(p.command)),
              num(bytes(p.image_bytes)), num(bytes(p.stored_bytes)), printable(p.parent) || '–', num(p.heaps.length),
              h('td', { class: 'actions' },
                h('button', { class: 'small', 'data-action': 'proc-clone', onclick: () => {
                  void startAction(st.id, 'proc-clone', { name: p.name }, `clone ${p.name}`).then(refresh);
                } }, 'Clone'),
                h('button', { class: 'small', 'data-action': 'proc-restore', onclick: () => {
                  if (!confirm(`Restore ${printable(p.name)}? Its pid ${p.pid} must not be running.`)) return;
                  void startAction(st.id, 'proc-restore', { name: p.name }, `restore ${p.name}`).then(refresh);
                } }, 'Restore')),
            ]), (i) => ({ 'data-process': [...d.processes[st.id]].sort((a, b) => b.time_ns - a.time_ns)[i].name }))
          : h('p', { class: 'muted' }, 'No process snapshots.'),
        dumpForm(st.id, refresh))));
  },
};
