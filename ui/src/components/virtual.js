// A list that renders only the rows in view (fixed row height): a 1,000-step run is a few dozen DOM rows.
import { useEffect, useRef, useState } from "preact/hooks";
import { html } from "../lib/html.js";

export function VirtualList({ items, rowHeight, maxHeight, renderRow, overlay, className = "", label }) {
  const box = useRef(null);
  const [top, setTop] = useState(0);
  const [view, setView] = useState(maxHeight);
  const total = items.length * rowHeight;
  const height = Math.min(total, maxHeight);
  useEffect(() => {
    if (box.current) setView(box.current.clientHeight || height);
  }, [height]);
  const overscan = 6;
  const first = Math.max(0, Math.floor(top / rowHeight) - overscan);
  const last = Math.min(items.length, Math.ceil((top + view) / rowHeight) + overscan);
  const rows = [];
  for (let i = first; i < last; i++) rows.push(renderRow(items[i], i, { top: i * rowHeight, height: rowHeight }));
  return html`<div class=${`virtual ${className}`} ref=${box} style=${{ height: `${height}px` }} aria-label=${label}
    data-rows=${items.length} onScroll=${(e) => setTop(e.currentTarget.scrollTop)}>
    <div class="virtual-inner" style=${{ height: `${total}px` }}>${overlay || ""}${rows}</div>
  </div>`;
}
