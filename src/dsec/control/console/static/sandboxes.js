// The sandboxes of the caller's projects: filtered and paged by the server (each edge answers
// for its own), sorted by age, activity, CPU or memory, refreshed live.
import { html, useState } from "/ui/vendor/preact.js";
import { Badge, Card, ErrorNote, api, fmt, navigate, qs, usePoll } from "/ui/static/lib.js";

const STATES = ["creating", "running", "paused", "restoring", "stopping", "stopped", "failed"];
const BACKENDS = ["container", "microvm", "vm"];
const SORTS = [["-created", "newest"], ["created", "oldest"], ["-last_active", "recently active"],
  ["-cpu", "most CPU time"], ["-memory", "most memory"]];
const PAGE = 50;

export function SandboxesPage({ params }) {
  const filters = {
    q: params.get("q") || "", state: params.get("state") || "", backend: params.get("backend") || "",
    job: params.get("job") || "", label: params.get("label") || "", project: params.get("project") || "",
    edge: params.get("edge") || "", sort: params.get("sort") || "-created",
  };
  const offset = Number(params.get("offset") || 0);
  const [draft, setDraft] = useState(filters.q);
  const set = (patch) => {
    const next = { ...filters, offset: 0, ...patch };
    if (next.sort === "-created") delete next.sort;
    if (!next.offset) delete next.offset;
    navigate(`#/sandboxes${qs(next)}`);
  };
  const key = JSON.stringify([filters, offset]);
  const { data, error } = usePoll(() => api(`/v1/console/sandboxes${qs({
    ...filters, limit: PAGE, offset, usage: true, label: filters.label || undefined,
  })}`), 3000, [key]);
  return html`
    <form class="filters" onSubmit=${(e) => { e.preventDefault(); set({ q: draft }); }}>
      <input type="search" name="q" placeholder="search id, image, job, label…" value=${draft}
        onInput=${(e) => setDraft(e.target.value)} />
      <select name="state" value=${filters.state} onChange=${(e) => set({ state: e.target.value })}>
        <option value="">any state</option>${STATES.map((s) => html`<option value=${s}>${s}</option>`)}</select>
      <select name="backend" value=${filters.backend} onChange=${(e) => set({ backend: e.target.value })}>
        <option value="">any backend</option>${BACKENDS.map((s) => html`<option value=${s}>${s}</option>`)}</select>
      <input name="job" placeholder="job" value=${filters.job} onChange=${(e) => set({ job: e.target.value })} />
      <input name="label" placeholder="label k=v" value=${filters.label} onChange=${(e) => set({ label: e.target.value })} />
      <input name="project" placeholder="project" value=${filters.project} onChange=${(e) => set({ project: e.target.value })} />
      <select name="sort" value=${filters.sort} onChange=${(e) => set({ sort: e.target.value })}>
        ${SORTS.map(([v, l]) => html`<option value=${v}>${l}</option>`)}</select>
      <button type="submit">Search</button>
    </form>
    <${ErrorNote} error=${error} />
    ${data ? html`<${Results} data=${data} filters=${filters} offset=${offset} set=${set} />` : html`<p class="muted">Loading&hellip;</p>`}`;
}

function Results({ data, filters, offset, set }) {
  const last = Math.min(data.total, offset + data.items.length);
  return html`
    <div class="chips">${Object.entries(data.states).sort().map(([s, n]) => html`
      <button class="chip" onClick=${() => set({ state: filters.state === s ? "" : s })}>
        <${Badge} kind=${s}>${s}<//> ${fmt.num(n)}</button>`)}
      ${data.unreachable.length ? html`<span class="error small">not answering: ${data.unreachable.join(", ")}</span>` : null}
    </div>
    <${Card} title=${html`<span data-testid="sandbox-count">${fmt.num(data.total)}</span> sandboxes`}
      right=${html`<${Pager} total=${data.total} offset=${offset} shown=${last} set=${set} />`}>
      <table class="t" data-testid="sandboxes">
        <thead><tr><th>sandbox</th><th>state</th><th>backend</th><th>image</th><th>job</th><th>edge</th>
          <th>created</th><th>CPU time</th><th>memory</th><th>limits</th></tr></thead>
        <tbody>${data.items.map((i) => html`<tr data-sandbox=${i.sandbox_id}>
          <td><a href=${`#/sandbox/${i.sandbox_id}`} class="mono">${i.sandbox_id}</a></td>
          <td><${Badge} kind=${i.state}>${i.state}<//></td><td>${i.backend}</td>
          <td class="small">${i.image}${i.layers.length ? ` +${i.layers.length}` : ""}</td>
          <td>${i.job ? html`<a href=${`#/job/${encodeURIComponent(i.job)}`}>${i.job}</a>` : "–"}</td>
          <td>${i.edge}</td><td title=${fmt.time(i.created_at)}>${fmt.ago(i.created_at)}</td>
          <td>${i.usage ? fmt.dur(i.usage.cpu_s) : "–"}</td><td>${i.usage ? fmt.bytes(i.usage.memory_bytes) : "–"}</td>
          <td class="small">${i.cpu_cores_limit} CPU · ${i.memory_limit_mb} MiB</td></tr>`)}
        </tbody>
      </table>
      ${data.items.length ? null : html`<p class="muted pad">No sandbox matches.</p>`}
    <//>`;
}

function Pager({ total, offset, shown, set }) {
  return html`<span class="pager">
    <span>${total ? `${fmt.num(offset + 1)}–${fmt.num(shown)} of ${fmt.num(total)}` : "0"}</span>
    <button disabled=${offset === 0} onClick=${() => set({ offset: Math.max(0, offset - PAGE) })}>‹ prev</button>
    <button disabled=${shown >= total} data-testid="next-page" onClick=${() => set({ offset: offset + PAGE })}>next ›</button>
  </span>`;
}
