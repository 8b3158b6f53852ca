// The dashboard: a hash router over four views, refreshed every few seconds
// (paused while the tab is hidden), the alert count in the navigation bar.

import './style.css';
import { ApiError, get, type Alert, type Health } from './api';
import { h, replace } from './dom';
import { printable } from './format';
import { onOperationFinished } from './operations';
import { alerts } from './views/alerts';
import { jobs } from './views/jobs';
import { overview } from './views/overview';
import { timeline } from './views/timeline';
import type { View } from './views/view';

const REFRESH_MS = 5000;
// eslint-disable-next-line @typescript-eslint/no-explicit-any
const VIEWS: Record<string, View<any>> = { overview, timeline, jobs, alerts };

let timer: number | undefined;
let generation = 0;
let lastKey = '';
let loading = false;
let again = false;

function parseRoute(): { view: View<unknown>; args: string[] } {
  const parts = location.hash.replace(/^#\/?/, '').split('/').filter((x) => x !== '').map((x) => {
    try { return decodeURIComponent(x); } catch { return x; }
  });
  const view = VIEWS[parts[0] ?? ''] ?? overview;
  return { view, args: parts.slice(1) };
}

function banner(text: string | null): void {
  const b = document.getElementById('banner')!;
  b.hidden = text === null;
  b.textContent = text ?? '';
}

async function header(): Promise<void> {
  const [health, a] = await Promise.all([get<Health>('/health'), get<{ alerts: Alert[] }>('/alerts')]);
  document.getElementById('host')!.textContent = `${printable(health.host)} · dvr ${printable(health.version)}`;
  const badge = document.getElementById('alert-badge')!;
  const errors = a.alerts.filter((x) => x.severity === 'error').length;
  badge.hidden = a.alerts.length === 0;
  badge.textContent = String(a.alerts.length);
  badge.className = `badge ${errors ? 'error' : 'warning'}`;
}

/** Loads the current view and redraws it when its data changed. */
async function refresh(): Promise<void> {
  if (loading) { again = true; return; }
  loading = true;
  window.clearTimeout(timer);
  timer = undefined;
  const gen = generation;
  const { view, args } = parseRoute();
  for (const a of document.querySelectorAll<HTMLAnchorElement>('#nav a')) a.classList.toggle('on', a.dataset.view === view.name);
  try {
    const [data] = await Promise.all([view.load(args), header()]);
    if (gen === generation) {
      const key = JSON.stringify([view.name, args, data, view.state ? view.state() : null]);
      if (key !== lastKey) {
        lastKey = key;
        const main = document.getElementById('view')!;
        const scroll = [window.scrollX, window.scrollY];
        replace(main, view.render(data, args, () => { lastKey = ''; void refresh(); }));
        window.scrollTo(scroll[0], scroll[1]);
      }
      banner(null);
      document.getElementById('refresh')!.textContent = `updated ${new Date().toLocaleTimeString()}`;
    }
  } catch (e) {
    if (gen === generation) {
      const msg = e instanceof ApiError ? `${e.message}${e.hint ? ` — ${e.hint}` : ''}` : `cannot reach dvr serve (${String(e)})`;
      banner(msg);
    }
  } finally {
    loading = false;
  }
  if (again) { again = false; void refresh(); return; }
  if (!document.hidden) timer = window.setTimeout(() => void refresh(), REFRESH_MS);
}

window.addEventListener('hashchange', () => {
  generation++;
  lastKey = '';
  replace(document.getElementById('view')!, h('p', { class: 'muted' }, 'loading…'));
  void refresh();
});
document.addEventListener('visibilitychange', () => {
  if (document.hidden) {
    window.clearTimeout(timer);
    timer = undefined;
    document.getElementById('refresh')!.textContent = 'paused';
  } else {
    void refresh();
  }
});
onOperationFinished(() => { lastKey = ''; void refresh(); });
void refresh();
