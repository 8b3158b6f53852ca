// The memory-over-time chart: an SVG line chart drawn here (no chart library).

import type { MemorySample } from './api';
import { h, s } from './dom';
import { bytes, clock, time } from './format';

interface Series { key: keyof MemorySample; label: string; cls: string }

const SERIES: Series[] = [
  { key: 'mem_used', label: 'DRAM used', cls: 's-used' },
  { key: 'cached', label: 'page cache', cls: 's-cached' },
  { key: 'swap_used', label: 'swap used', cls: 's-swap' },
  { key: 'pmem_used', label: 'PMem used', cls: 's-pmem' },
  { key: 'store_bytes', label: 'stores', cls: 's-store' },
];

/** A "nice" step (1, 2 or 5 times a power of 1024 or 10) for about n ticks up to max. */
function niceStep(max: number, n: number): number {
  const raw = max / n;
  const base = raw >= 1024 ? 1024 ** Math.floor(Math.log(raw) / Math.log(1024)) : 1;
  const r = raw / base;
  const mag = 10 ** Math.floor(Math.log10(r));
  const m = r / mag;
  return base * mag * (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10);
}

/** At most n samples (every k-th, the last always kept). */
function thin(samples: MemorySample[], n: number): MemorySample[] {
  if (samples.length <= n) return samples;
  const k = Math.ceil(samples.length / n);
  const out = samples.filter((_, i) => i % k === 0);
  if (out[out.length - 1] !== samples[samples.length - 1]) out.push(samples[samples.length - 1]);
  return out;
}

/** The chart of samples between fromNs and toNs. */
export function memoryChart(samples: MemorySample[], fromNs: number, toNs: number): HTMLElement {
  const W = 900, H = 260, L = 70, R = 10, T = 10, B = 28;
  const pts = thin(samples.filter((p) => p.time_ns >= fromNs), 450);
  const shown = SERIES.filter((se) => pts.some((p) => (p[se.key] as number) > 0));
  const total = Math.max(1, ...pts.map((p) => Math.max(p.mem_total, p.pmem_total, ...shown.map((se) => p[se.key] as number))));
  const x = (t: number) => L + ((t - fromNs) / Math.max(1, toNs - fromNs)) * (W - L - R);
  const y = (v: number) => T + (1 - v / total) * (H - T - B);
  const svg = s('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'memory over time' });
  const step = niceStep(total, 4);
  for (let v = 0; v <= total + 1e-9; v += step) {
    svg.append(s('line', { class: 'grid', x1: L, x2: W - R, y1: y(v), y2: y(v) }),
      s('text', { class: 'axis', x: L - 6, y: y(v) + 4, 'text-anchor': 'end' }, bytes(v)));
  }
  const span = toNs - fromNs;
  const tstep = [60, 300, 600, 1800, 3600, 7200, 14400, 21600].map((m) => m * 1e9).find((st) => span / st <= 8) ?? 43200e9;
  for (let t = Math.ceil(fromNs / tstep) * tstep; t <= toNs; t += tstep) {
    svg.append(s('line', { class: 'grid', x1: x(t), x2: x(t), y1: T, y2: H - B }),
      s('text', { class: 'axis', x: x(t), y: H - B + 16, 'text-anchor': 'middle' }, clock(t)));
  }
  if (pts.length > 0 && pts[0].mem_total > 0) {
    svg.append(s('line', { class: 'total', x1: L, x2: W - R, y1: y(pts[pts.length - 1].mem_total), y2: y(pts[pts.length - 1].mem_total) },
      s('title', undefined, `DRAM total ${bytes(pts[pts.length - 1].mem_total)}`)));
  }
  for (const se of shown) {
    const d = pts.map((p, i) => `${i ? 'L' : 'M'}${x(p.time_ns).toFixed(1)},${y(p[se.key] as number).toFixed(1)}`).join('');
    svg.append(s('path', { class: `line ${se.cls}`, d }));
    // the newest sample as a dot: visible even while there is only one
    const last = pts[pts.length - 1];
    svg.append(s('circle', { class: `dot ${se.cls}`, cx: x(last.time_ns).toFixed(1), cy: y(last[se.key] as number).toFixed(1), r: 3 }));
  }
  // a cursor with the values under the mouse
  const cursor = s('line', { class: 'cursor', y1: T, y2: H - B, x1: -10, x2: -10 });
  svg.append(cursor, s('rect', { class: 'hit', x: L, y: T, width: W - L - R, height: H - T - B }));
  const readout = h('div', { class: 'readout' }, pts.length ? '' : 'no samples yet (dvr serve samples every few seconds)');
  svg.addEventListener('mousemove', (ev) => {
    if (!pts.length) return;
    const box = svg.getBoundingClientRect();
    const px = ((ev.clientX - box.left) / box.width) * W;
    const t = fromNs + ((px - L) / (W - L - R)) * (toNs - fromNs);
    let best = pts[0];
    for (const p of pts) if (Math.abs(p.time_ns - t) < Math.abs(best.time_ns - t)) best = p;
    cursor.setAttribute('x1', String(x(best.time_ns)));
    cursor.setAttribute('x2', String(x(best.time_ns)));
    readout.textContent = `${time(best.time_ns)}: ` + shown.map((se) => `${se.label} ${bytes(best[se.key] as number)}`).join(', ');
  });
  const legend = h('div', { class: 'legend' }, ...shown.map((se) => h('span', { class: `key ${se.cls}` }, se.label)),
    pts.length && pts[0].mem_total > 0 ? h('span', { class: 'key total' }, 'DRAM total') : null);
  return h('div', { class: 'chart-box' }, svg, legend, readout);
}
