// Alerts: damaged snapshots, low space, failed or late autosaves and dumps,
// unreachable peers, permissions; errors first, then the newest.

import { get, type Alert, type Health } from '../api';
import { h, table } from '../dom';
import { ago, printable, time } from '../format';
import type { View } from './view';

export interface AlertsData { alerts: Alert[]; now: number }

export const alerts: View<AlertsData> = {
  name: 'alerts',
  async load() {
    const [a, health] = await Promise.all([get<{ alerts: Alert[] }>('/alerts'), get<Health>('/health')]);
    return { alerts: a.alerts, now: health.time_ns };
  },
  render(d) {
    if (!d.alerts.length) return h('div', undefined, h('h2', undefined, 'Alerts'), h('p', { class: 'ok', id: 'no-alerts' }, 'No alerts.'));
    const sorted = [...d.alerts].sort((x, y) => (x.severity === y.severity ? y.since_ns - x.since_ns : x.severity === 'error' ? -1 : 1));
    return h('div', undefined, h('h2', undefined, `Alerts (${d.alerts.length})`),
      table('alerts', ['severity', 'kind', 'store', 'subject', 'message', 'since'], sorted.map((a) => [
        h('span', { class: `sev ${a.severity}` }, a.severity), a.kind.replace(/_/g, ' '), printable(a.store), printable(a.subject),
        printable(a.message), h('span', { title: time(a.since_ns) }, ago(a.since_ns, d.now)),
      ]), (i) => ({ class: `alert alert-${sorted[i].severity}`, 'data-kind': sorted[i].kind, 'data-subject': sorted[i].subject })));
  },
};
