// Small DOM helpers. Text from the API only ever goes into the page as text
// (textContent, attribute values through setAttribute): never as HTML, since
// names and labels may contain anything.

export type Child = Node | string | number | null | undefined | false;
type Attrs = Record<string, string | number | boolean | null | undefined | EventListener>;

function apply(el: Element, attrs: Attrs | undefined): void {
  if (!attrs) return;
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2), v);
    } else if (v === true) {
      el.setAttribute(k, '');
    } else {
      el.setAttribute(k, String(v));
    }
  }
}

function append(el: Element, children: Child[]): void {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    el.append(typeof c === 'string' || typeof c === 'number' ? document.createTextNode(String(c)) : c);
  }
}

/** An HTML element: h('td', {class: 'num'}, 'text', child...). */
export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs?: Attrs, ...children: Child[]): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

/** An SVG element: s('circle', {cx: 1, cy: 2, r: 3}). */
export function s<K extends keyof SVGElementTagNameMap>(tag: K, attrs?: Attrs, ...children: Child[]): SVGElementTagNameMap[K] {
  const el = document.createElementNS(SVG_NS, tag) as SVGElementTagNameMap[K];
  apply(el, attrs);
  append(el, children);
  return el;
}

/** Replaces the children of el. */
export function replace(el: Element, ...children: Child[]): void {
  el.replaceChildren();
  append(el, children);
}

/** A table with a header row; rows are arrays of cells (a cell: a Child or a <td>). */
export function table(cls: string, head: string[], rows: (Child | HTMLTableCellElement)[][], rowAttrs?: (i: number) => Attrs): HTMLTableElement {
  return h('table', { class: cls },
    h('thead', undefined, h('tr', undefined, ...head.map((t) => h('th', undefined, t)))),
    h('tbody', undefined, ...rows.map((r, i) => h('tr', rowAttrs ? rowAttrs(i) : undefined,
      ...r.map((c) => (c instanceof HTMLTableCellElement ? c : h('td', undefined, c)))))));
}

/** A numeric table cell (right-aligned). */
export function num(v: Child, title?: string): HTMLTableCellElement {
  return h('td', { class: 'num', title }, v);
}
