// Timeline: a store's sessions, and one session's snapshots drawn as a tree.
// Clicking a snapshot shows its details (the `info` document) and its diff
// against its parent (the `diff` document).

import { ApiError, get, seg, type RegionDiff, type Session, type Snapshot, type Store } from '../api';
import { h, num, table } from '../dom';
import { bytes, printable, time } from '../format';
import { startAction } from '../operations';
import { snapshotTree } from '../tree';
import type { View } from './view';

let selected: { store: string; session: string; name: string } | null = null;

export interface TimelineData {
  stores: Store[]; store: string | null; sessions: Session[]; session: string | null; snapshots: Snapshot[];
  info: Snapshot | null; diff: { a: string; b: string; regions: RegionDiff[] } | null; detailError: string | null;
}

function route(store: string, session?: string): string {
  return `#/timeline/${encodeURIComponent(store)}` + (session !== undefined ? `/${encodeURIComponent(session)}` : '');
}

export const timeline: View<TimelineData> = {
  name: 'timeline',
  async load(args) {
    const stores = (await get<{ stores: Store[] }>('/stores')).stores;
    const store = args[0] ?? stores[0]?.id ?? null;
    const d: TimelineData = { stores, store, sessions: [], session: null, snapshots: [], info: null, diff: null, detailError: null };
    if (store === null) return d;
    d.sessions = (await get<{ sessions: Session[] }>(`/stores/${seg(store)}/sessions`)).sessions;
    const newest = [...d.sessions].sort((a, b) => (b.latest?.time_ns ?? 0) - (a.latest?.time_ns ?? 0))[0];
    d.session = args[1] ?? newest?.name ?? null;
    if (d.session === null) return d;
    d.snapshots = (await get<{ snapshots: Snapshot[] }>(`/stores/${seg(store)}/sessions/${seg(d.session)}/snapshots`)).snapshots;
    if (selected && selected.store === store && selected.session === d.session && d.snapshots.some((x) => x.name === selected!.name)) {
      const base = `/stores/${seg(store)}/sessions/${seg(d.session)}`;
      try {
        d.info = await get<Snapshot>(`${base}/snapshots/${seg(selected.name)}`);
        if (d.info.parent && d.snapshots.some((x) => x.name === d.info!.parent)) {
          d.diff = await get<TimelineData['diff']>(`${base}/diff?a=${seg(d.info.parent)}&b=${seg(d.info.name)}`);
        }
      } catch (e) {
        d.detailError = e instanceof ApiError ? `${e.message}${e.hint ? ` (${e.hint})` : ''}` : String(e);
      }
    }
    return d;
  },
  state: () => selected,
  render(d, _args, refresh) {
    if (d.store === null) return h('p', { class: 'muted' }, 'No stores: start dvr serve with --store DIR.');
    const store = d.store;
    const storePick = h('select', { id: 'store-select', onchange: (e: Event) => { location.hash = route((e.target as HTMLSelectElement).value); } },
      ...d.stores.map((st) => h('option', { value: st.id, selected: st.id === store }, printable(st.id))));
    const sessions = h('ul', { class: 'sessions' }, ...d.sessions.map((se) => h('li', { class: se.name === d.session ? 'on' : '' },
      h('a', { href: route(store, se.name), 'data-session': se.name }, printable(se.name)),
      h('span', { class: 'muted small' }, ` ${se.snapshots} · ${bytes(se.stored_bytes)}`))));
    const select = (name: string) => { selected = { store, session: d.session!, name }; refresh(); };
    const sel = selected && selected.store === store && selected.session === d.session ? selected.name : null;
    return h('div', { class: 'timeline' },
      h('div', { class: 'side' }, h('label', undefined, 'Store ', storePick), h('h3', undefined, 'Sessions'),
        d.sessions.length ? sessions : h('p', { class: 'muted' }, 'No sessions in this store yet.')),
      h('div', { class: 'main' },
        d.session === null ? h('p', { class: 'muted' }, 'Pick a session.') : h('div', undefined,
          h('h2', undefined, 'Session ', h('span', { class: 'session-name' }, printable(d.session)), h('span', { class: 'muted' }, ` — ${d.snapshots.length} snapshots`)),
          d.snapshots.length ? h('div', { class: 'tree-box' }, snapshotTree(d.snapshots, sel, select)) : h('p', { class: 'muted' }, 'No snapshots in this session.'),
          d.detailError ? h('p', { class: 'error' }, printable(d.detailError)) : null,
          d.info ? details(store, d.info, d.diff, refresh) : (d.snapshots.length ? h('p', { class: 'muted' }, 'Click a snapshot for its details and its diff against its parent.') : null))));
  },
};

function details(store: string, info: Snapshot, diff: TimelineData['diff'], refresh: () => void): HTMLElement {
  const kv = (k: string, v: string | Node) => h('tr', undefined, h('th', undefined, k), h('td', undefined, v));
  return h('div', { class: 'details', 'data-snapshot': info.name },
    h('h3', undefined, `${printable(info.session)}/${printable(info.name)}`, info.damaged ? h('span', { class: 'sev error' }, ' damaged') : null),
    h('table', { class: 'kv-table' }, h('tbody', undefined,
      kv('time', time(info.time_ns)), kv('label', printable(info.label) || '–'), kv('parent', printable(info.parent) || '– (a full snapshot)'),
      kv('logical', bytes(info.logical_bytes)), kv('stored', bytes(info.stored_bytes)),
      kv('chunks', `${info.chunks} (${info.zero_chunks} zero)`), kv('tracking', printable(info.tracking) || '–'),
      info.damaged ? kv('damage', printable(info.damage)) : null, info.pending ? kv('state', 'pending (being written)') : null)),
    h('h4', undefined, 'Regions'),
    table('regions', ['region', 'size', 'owner'], info.regions.map((r) => [printable(r.name), num(bytes(r.size)), r.sdk_owned ? 'SDK' : 'tracked'])),
    diff ? h('div', { class: 'diff' }, h('h4', undefined, `Diff against its parent ${printable(info.parent)}`),
      table('regions', ['region', 'size before', 'size after', 'bytes differ', 'pages differ'], diff.regions.map((r) => [
        printable(r.name) + (r.only_in_a ? ' (removed)' : r.only_in_b ? ' (new)' : ''), num(bytes(r.size_a)), num(bytes(r.size_b)),
        num(bytes(r.bytes_differ)), num(r.pages_differ)]))) : null,
    h('p', undefined, h('button', { class: 'small danger', onclick: () => {
      if (!confirm(`Remove the snapshot ${printable(info.session)}/${printable(info.name)}?`)) return;
      void startAction(store, 'rm', { session: info.session, names: [info.name] }, `rm ${info.session}/${info.name}`).then(refresh);
    } }, 'Remove snapshot')));
}
