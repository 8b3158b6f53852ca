// Overview: hosts (this one and each --peer), memory over time, store space, alerts.

import { get, type Alert, type Health, type Host, type MemorySample, type Store } from '../api';
import { memoryChart } from '../chart';
import { h, num, table } from '../dom';
import { ago, bytes, percent, printable, ratio } from '../format';
import { startAction } from '../operations';
import type { View } from './view';

const WINDOWS: [string, number][] = [['1 h', 3600], ['6 h', 6 * 3600], ['24 h', 24 * 3600]];
let windowS = 3600;
let samples: MemorySample[] = [];

export interface OverviewData { health: Health; hosts: Host[]; stores: Store[]; alerts: Alert[]; samples: MemorySample[]; now: number }

async function loadMemory(nowNs: number): Promise<MemorySample[]> {
  const keep = nowNs - 24 * 3600e9;
  const last = samples.length ? samples[samples.length - 1].time_ns : keep;
  const r = await get<{ samples: MemorySample[] }>(`/memory?since=${Math.floor(last + 1000)}`);
  const fresh = r.samples.filter((p) => p.time_ns > last);
  samples = samples.concat(fresh).filter((p) => p.time_ns >= keep);
  return samples;
}

function bar(used: number, total: number, cls = ''): HTMLElement {
  const f = total > 0 ? used / total : 0;
  return h('div', { class: `bar ${cls} ${f > 0.9 ? 'high' : ''}`, title: `${bytes(used)} of ${bytes(total)} (${percent(f)})` },
    h('div', { class: 'fill', style: `width:${Math.min(100, f * 100).toFixed(1)}%` }));
}

function hostCard(host: Host): HTMLElement {
  const m = host.memory;
  return h('div', { class: `card host-card ${host.reachable ? '' : 'unreachable'}`, 'data-host': host.name },
    h('h3', undefined, printable(host.name || '(unnamed)'), host.url ? h('span', { class: 'muted' }, ' ', printable(host.url)) : h('span', { class: 'muted' }, ' (this server)')),
    host.reachable ? null : h('div', { class: 'error' }, 'unreachable: ', printable(host.error ?? 'no answer')),
    m ? h('div', undefined,
      h('div', { class: 'kv' }, h('span', undefined, 'DRAM'), h('span', undefined, `${bytes(m.mem_used)} of ${bytes(m.mem_total)}`)), bar(m.mem_used, m.mem_total),
      m.pmem_total > 0 ? h('div', { class: 'kv' }, h('span', undefined, 'PMem'), h('span', undefined, `${bytes(m.pmem_used)} of ${bytes(m.pmem_total)}`)) : null,
      m.pmem_total > 0 ? bar(m.pmem_used, m.pmem_total, 'pmem') : null,
      h('div', { class: 'kv' }, h('span', undefined, 'swap used'), h('span', undefined, bytes(m.swap_used))),
      h('div', { class: 'kv' }, h('span', undefined, 'in stores'), h('span', undefined, bytes(m.store_bytes)))) : null,
    h('div', { class: 'kv' }, h('span', undefined, 'stores'), h('span', undefined, String(host.stores?.length ?? 0))),
    host.alerts ? h('div', { class: 'kv' }, h('span', undefined, 'alerts'), h('span', { class: 'error' }, String(host.alerts))) : null,
    host.stores?.length ? h('div', { class: 'muted small' }, host.stores.map((st) => `${st.id}: ${st.snapshots} snapshots, ${bytes(st.pack_bytes)}`).join(' · ')) : null);
}

export function storesTable(stores: Store[], refresh: () => void): HTMLElement {
  if (!stores.length) return h('p', { class: 'muted' }, 'No stores: start dvr serve with --store DIR.');
  return table('stores', ['store', 'path', 'medium', 'sessions', 'snapshots', 'logical', 'packs', 'dedup', 'space', ''],
    stores.map((st) => [
      h('a', { href: `#/timeline/${encodeURIComponent(st.id)}` }, printable(st.id)),
      h('code', undefined, printable(st.path)), st.medium, num(st.sessions), num(st.snapshots),
      num(bytes(st.logical_bytes)), num(bytes(st.pack_bytes)), num(ratio(st.dedup_ratio)),
      h('td', undefined, bar(st.total_bytes - st.free_bytes, st.total_bytes), h('span', { class: 'small muted' }, `${bytes(st.free_bytes)} free of ${bytes(st.total_bytes)}`)),
      h('td', { class: 'actions' },
        h('button', { class: 'small', 'data-action': 'verify', onclick: () => { void startAction(st.id, 'verify', {}, `verify ${st.id}`).then(refresh); } }, 'Verify'),
        h('button', { class: 'small', 'data-action': 'gc', onclick: () => { void startAction(st.id, 'gc', {}, `gc ${st.id}`).then(refresh); } }, 'GC')),
    ]), (i) => ({ 'data-store': stores[i].id }));
}

const plural = (n: number, w: string) => `${n} ${w}${n === 1 ? '' : 's'}`;

export function alertsSummary(alerts: Alert[], nowNs: number, limit: number): HTMLElement {
  const errors = alerts.filter((a) => a.severity === 'error').length;
  const warnings = alerts.length - errors;
  if (!alerts.length) return h('p', { class: 'ok' }, 'No alerts.');
  return h('div', undefined,
    h('p', undefined, h('span', { class: 'sev error' }, plural(errors, 'error')), ' ', h('span', { class: 'sev warning' }, plural(warnings, 'warning')),
      alerts.length > limit ? h('a', { href: '#/alerts' }, ` — all ${alerts.length}`) : null),
    h('ul', { class: 'alert-list' }, ...alerts.slice(0, limit).map((a) => h('li', { class: `alert alert-${a.severity}`, 'data-kind': a.kind },
      h('span', { class: `sev ${a.severity}` }, a.severity), ' ', h('b', undefined, a.kind.replace(/_/g, ' ')), ' ',
      printable(a.store), a.subject ? ` · ${printable(a.subject)}` : '', ': ', printable(a.message), h('span', { class: 'muted' }, ` (${ago(a.since_ns, nowNs)})`)))));
}

export const overview: View<OverviewData> = {
  name: 'overview',
  async load() {
    const health = await get<Health>('/health');
    const [hosts, stores, alerts, mem] = await Promise.all([
      get<Host[] | { hosts: Host[] }>('/hosts'), get<{ stores: Store[] }>('/stores'), get<{ alerts: Alert[] }>('/alerts'), loadMemory(health.time_ns)]);
    return { health, hosts: Array.isArray(hosts) ? hosts : hosts.hosts, stores: stores.stores, alerts: alerts.alerts, samples: mem, now: health.time_ns };
  },
  state: () => windowS,
  render(d, _args, refresh) {
    const picker = h('span', { class: 'picker' }, ...WINDOWS.map(([label, sec]) =>
      h('button', { class: `small ${sec === windowS ? 'on' : ''}`, onclick: () => { windowS = sec; refresh(); } }, label)));
    return h('div', { class: 'overview' },
      h('section', undefined, h('h2', undefined, 'Hosts'), h('div', { class: 'cards' }, ...d.hosts.map(hostCard))),
      h('section', undefined, h('h2', undefined, `Memory on ${printable(d.health.host)} `, picker),
        memoryChart(d.samples, d.now - windowS * 1e9, d.now)),
      h('section', undefined, h('h2', undefined, 'Stores'), storesTable(d.stores, refresh)),
      h('section', undefined, h('h2', undefined, 'Alerts'), alertsSummary(d.alerts, d.now, 5)));
  },
};
