// The layer catalog with its lineage (which snapshot was taken on which), sizes and the
// edges' on-demand cache hit rates; and the FnCall pools: occupancy and verdicts.
import { html, useState } from "/ui/vendor/preact.js";
import { Badge, Bar, Card, ErrorNote, api, fmt, qs, usePoll } from "/ui/static/lib.js";

export function LayersPage() {
  const [q, setQ] = useState("");
  const [offset, setOffset] = useState(0);
  const { data, error } = usePoll(() => api(`/v1/console/layers${qs({ q, offset, limit: 100 })}`), 10000, [q, offset]);
  return html`
    <form class="filters" onSubmit=${(e) => { e.preventDefault(); setOffset(0); setQ(e.target.q.value); }}>
      <input type="search" name="q" placeholder="layer or parent ref…" /><button type="submit">Search</button></form>
    <${ErrorNote} error=${error} />
    ${data ? html`<div class="grid2 wide">
      <${Card} title=${`${fmt.num(data.total)} layers`} right=${html`<span class="pager">
        <button disabled=${offset === 0} onClick=${() => setOffset(Math.max(0, offset - 100))}>‹ prev</button>
        <button disabled=${offset + 100 >= data.total} onClick=${() => setOffset(offset + 100)}>next ›</button></span>`}>
        <table class="t" data-testid="layers"><thead><tr><th>layer</th><th>kind</th><th>size</th><th>taken on</th><th>children</th>
          <th>owner</th><th>cache hit rate</th><th>fetched</th><th>created</th></tr></thead>
          <tbody>${data.items.map((l) => html`<tr data-layer=${l.ref}><td class="mono small">${l.ref}</td><td><${Badge} kind=${l.kind}>${l.kind}<//></td>
            <td class="nw">${fmt.bytes(l.size)}</td>
            <td class="mono small">${l.parent ? html`<a href="#" onClick=${(e) => { e.preventDefault(); setQ(l.parent); }}>${l.parent}</a>` : "–"}</td>
            <td>${l.children || ""}</td><td>${l.owner || "–"} <span class="muted small">${l.visibility}</span></td>
            <td>${l.hit_rate === null ? html`<span class="muted">no reads</span>` : html`<${Bar} value=${100 * l.hit_rate} label=${fmt.pct(100 * l.hit_rate)} />`}</td>
            <td>${l.cache.remote_bytes ? fmt.bytes(l.cache.remote_bytes) : "–"}</td><td>${fmt.ago(l.created_at)}</td></tr>`)}</tbody></table>
      <//>
      <${Card} title="Lineage"><${Lineage} items=${data.items} /><//>
    </div>` : html`<p class="muted">Loading&hellip;</p>`}`;
}

function Lineage({ items }) {
  const byParent = new Map();
  const refs = new Set(items.map((l) => l.ref));
  for (const l of items) {
    const p = l.parent && refs.has(l.parent) ? l.parent : null;
    if (!byParent.has(p)) byParent.set(p, []);
    byParent.get(p).push(l);
  }
  const node = (l, depth) => html`<li>
    <span class="mono small">${l.ref}</span> <span class="muted small">${fmt.bytes(l.size)}</span>
    ${l.parent && !refs.has(l.parent) ? html` <span class="muted small">on ${l.parent}</span>` : null}
    ${(byParent.get(l.ref) || []).length && depth < 32 ? html`<ul>${byParent.get(l.ref).map((c) => node(c, depth + 1))}</ul>` : null}</li>`;
  return html`<ul class="tree" data-testid="lineage">${(byParent.get(null) || []).map((l) => node(l, 0))}</ul>`;
}

export function FnCallPage() {
  const { data, error } = usePoll(() => api("/v1/console/fncall"), 3000);
  return html`<${ErrorNote} error=${error} />${(data || []).map((e) => html`
    <${Card} title=${`FnCall on ${e.edge}`} right=${e.shown ? html`<span class="muted">${fmt.num(e.calls)} calls · ${fmt.num(e.errors)} platform errors</span>`
      : html`<span class="muted small">the pools serve every project: their counters are the cluster's admin's to see</span>`}>
      <table class="t" data-testid="fncall-pools"><thead><tr><th>image</th><th>containers</th><th>workers busy</th><th>waiting</th>
        <th>starting</th><th>error</th></tr></thead>
        <tbody>${e.pools.map((p) => html`<tr><td class="mono small">${p.image}${p.layers.length ? ` +${p.layers.join(",")}` : ""}</td>
          <td>${p.containers} / ${e.max_containers}</td><td><${Bar} value=${p.busy} max=${p.workers} label=${`${p.busy} / ${p.workers}`} /></td>
          <td>${p.waiting}</td><td>${p.starting}</td><td class="small">${p.error || ""}</td></tr>`)}</tbody></table>
      ${e.pools.length ? null : html`<p class="muted pad">No pool yet: the first call starts one.</p>`}
      <div class="grid2">
        <div><h4>Results by status</h4><div class="chips">${Object.entries(e.statuses).map(([k, n]) => html`<span class="chip"><${Badge} kind=${k}>${k}<//> ${fmt.num(n)}</span>`)}</div></div>
        <div><h4>Test cases by verdict</h4><div class="chips" data-testid="verdicts">${Object.entries(e.verdicts).map(([k, n]) => html`<span class="chip"><${Badge} kind=${k}>${k}<//> ${fmt.num(n)}</span>`)}</div></div>
      </div>
    <//>`)}`;
}
