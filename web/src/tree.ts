// A session's snapshots drawn as a tree: each snapshot a node, joined to its
// parent (the snapshot it is incremental to). Time runs left to right (one
// column per snapshot, oldest first); a snapshot whose parent already has an
// older child starts a branch on a lane of its own. The node's area grows
// with the bytes it stored; labels under the name.

import type { Snapshot } from './api';
import { s } from './dom';
import { bytes, printable } from './format';

export interface Placed { snap: Snapshot; col: number; lane: number; parent: Placed | null }

/** Columns (time order) and lanes (branches) of the snapshots. */
export function layout(snaps: Snapshot[]): Placed[] {
  const sorted = [...snaps].sort((a, b) => a.time_ns - b.time_ns || a.name.localeCompare(b.name));
  const byName = new Map<string, Placed>();
  const out: Placed[] = [];
  const laneEnd: number[] = []; // per lane: the last column used
  const hasChild = new Set<string>();
  sorted.forEach((snap, col) => {
    const parent = snap.parent ? byName.get(snap.parent) ?? null : null;
    let lane: number;
    if (parent && !hasChild.has(parent.snap.name) && laneEnd[parent.lane] === parent.col) {
      lane = parent.lane; // the first child continues its parent's line
    } else {
      // a branch (or a root): the first lane below the parent's that is free
      // from the parent's column on, else a new one
      const from = parent ? parent.lane + 1 : 0;
      const freeAfter = parent ? parent.col : col - 1;
      lane = laneEnd.findIndex((end, i) => i >= from && end <= freeAfter);
      if (lane < 0) lane = Math.max(laneEnd.length, from);
    }
    if (parent) hasChild.add(parent.snap.name);
    laneEnd[lane] = col;
    const p = { snap, col, lane, parent };
    byName.set(snap.name, p);
    out.push(p);
  });
  return out;
}

const COL = 120, LANE = 74, PAD = 64, TOP = 36; // PAD: half a clipped label

/** The SVG of the tree; onSelect is called with the clicked snapshot's name. */
export function snapshotTree(snaps: Snapshot[], selected: string | null, onSelect: (name: string) => void): SVGSVGElement {
  const placed = layout(snaps);
  const lanes = Math.max(1, ...placed.map((p) => p.lane + 1));
  const W = PAD * 2 + Math.max(1, placed.length) * COL - COL + 40;
  const H = TOP + lanes * LANE;
  const maxStored = Math.max(1, ...snaps.map((x) => x.stored_bytes));
  const cx = (p: Placed) => PAD + p.col * COL;
  const cy = (p: Placed) => TOP + p.lane * LANE;
  const svg = s('svg', { class: 'tree', width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'tree' });
  for (const p of placed) {
    if (!p.parent) continue;
    const x1 = cx(p.parent), y1 = cy(p.parent), x2 = cx(p), y2 = cy(p);
    // a branch turns down to its lane right after its parent, then runs along it
    // (the lane is free from the parent's column on: layout() sees to it)
    const k = COL / 2;
    const d = y1 === y2 ? `M${x1},${y1}L${x2},${y2}` : `M${x1},${y1}C${x1 + k},${y1} ${x1 + k / 2},${y2} ${x1 + k},${y2}L${x2},${y2}`;
    svg.append(s('path', { class: 'edge', d }));
  }
  for (const p of placed) {
    const sn = p.snap;
    const r = 6 + 12 * Math.sqrt(sn.stored_bytes / maxStored);
    const cls = ['node', sn.damaged ? 'damaged' : '', sn.pending ? 'pending' : '', sn.name === selected ? 'selected' : ''].join(' ').trim();
    const g = s('g', { class: cls, transform: `translate(${cx(p)},${cy(p)})`, tabindex: 0, role: 'treeitem',
      'data-snapshot': sn.name, 'aria-selected': sn.name === selected ? 'true' : 'false' },
    s('title', undefined, `${printable(sn.name)}${sn.label ? ` (${printable(sn.label)})` : ''}\n${bytes(sn.logical_bytes)} logical, ${bytes(sn.stored_bytes)} stored${sn.damaged ? '\nDAMAGED: ' + printable(sn.damage) : ''}`),
    s('circle', { r: r.toFixed(1) }),
    s('text', { class: 'name', y: r + 14, 'text-anchor': 'middle' }, clip(printable(sn.name), 18)),
    sn.label ? s('text', { class: 'label', y: r + 27, 'text-anchor': 'middle' }, clip(printable(sn.label), 20)) : null,
    s('text', { class: 'size', y: -r - 5, 'text-anchor': 'middle' }, bytes(sn.stored_bytes)));
    g.addEventListener('click', () => onSelect(sn.name));
    g.addEventListener('keydown', (e) => { if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); onSelect(sn.name); } });
    svg.append(g);
  }
  return svg;
}

function clip(t: string, n: number): string {
  return t.length > n ? t.slice(0, n - 1) + '…' : t;
}
