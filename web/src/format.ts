// Formatting of sizes, times and the control characters labels may contain.

/** Bytes as B, KiB, MiB, GiB, TiB (binary units, like the CLI). */
export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let v = n;
  let u = 0;
  while (Math.abs(v) >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return u === 0 ? `${v} B` : `${v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)} ${units[u]}`;
}

/** A nanosecond timestamp as local date and time. */
export function time(ns: number | null | undefined): string {
  if (ns === null || ns === undefined || !ns) return '–';
  const d = new Date(ns / 1e6);
  const p = (x: number) => String(x).padStart(2, '0');
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

/** A nanosecond timestamp as HH:MM (chart axes). */
export function clock(ns: number): string {
  const d = new Date(ns / 1e6);
  return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`;
}

/** How long ago (or in how long) a nanosecond timestamp is, relative to now_ns. */
export function ago(ns: number | null | undefined, nowNs: number): string {
  if (ns === null || ns === undefined || !ns) return '–';
  const d = (nowNs - ns) / 1e9;
  const a = Math.abs(d);
  const t = a < 60 ? `${Math.round(a)} s` : a < 3600 ? `${Math.round(a / 60)} min` : a < 172800 ? `${(a / 3600).toFixed(1)} h` : `${Math.round(a / 86400)} d`;
  return d >= 0 ? `${t} ago` : `in ${t}`;
}

/** Text with control characters shown as escapes (\n, \t, \xNN), as the CLI prints them. */
export function printable(t: string | null | undefined): string {
  if (t === null || t === undefined) return '';
  // eslint-disable-next-line no-control-regex
  return t.replace(/[\u0000-\u001f\u007f-\u009f]/g, (c) => {
    if (c === '\n') return '\\n';
    if (c === '\t') return '\\t';
    if (c === '\r') return '\\r';
    return '\\x' + c.charCodeAt(0).toString(16).padStart(2, '0');
  });
}

/** A ratio as "1.85×". */
export function ratio(r: number | null | undefined): string {
  return r === null || r === undefined || !Number.isFinite(r) ? '–' : `${r.toFixed(2)}×`;
}

/** A fraction 0..1 as a percentage. */
export function percent(f: number): string {
  return Number.isFinite(f) ? `${(f * 100).toFixed(f < 0.1 ? 1 : 0)}%` : '–';
}
