// Projects (docs/iam.md): each project the caller sees with what its subtree holds against
// its quota, and what its sub-projects' quotas carve out of it.
import { html } from "/ui/vendor/preact.js";
import { Bar, Card, ErrorNote, api, fmt, usePoll } from "/ui/static/lib.js";

const RESOURCES = [["sandboxes", "sandboxes", (v) => fmt.num(v)], ["cpu_cores", "CPU", (v) => v.toFixed(1)],
  ["memory_mb", "memory", (v) => fmt.bytes(v * 2 ** 20)], ["disk_mb", "disk", (v) => fmt.bytes(v * 2 ** 20)],
  ["starting", "starting", (v) => fmt.num(v)]];

function Use({ used, cap, show }) {
  if (cap === null || cap === undefined) return html`<span>${show(used)} <span class="muted small">no cap</span></span>`;
  return html`<${Bar} value=${used} max=${cap} label=${`${show(used)} / ${show(cap)}`} />`;
}

export function ProjectsPage() {
  const { data, error } = usePoll(() => api("/v1/projects"), 5000);
  return html`<${ErrorNote} error=${error} /><${Card} title="Projects and their quotas">
    <table class="t" data-testid="projects"><thead><tr><th>project</th>${RESOURCES.map(([, l]) => html`<th>${l}</th>`)}
      <th>FnCall / s</th><th>delegated</th></tr></thead>
      <tbody>${(data || []).map((p) => html`<tr data-project=${p.name}>
        <td style=${`padding-left:${8 + 16 * (p.name.split("/").length - 1)}px`}><a href=${`#/sandboxes?project=${encodeURIComponent(p.name)}`}>${p.name}</a>
          ${p.description ? html`<div class="muted small">${p.description}</div>` : null}</td>
        ${RESOURCES.map(([k, , show]) => html`<td><${Use} used=${p.usage[k]} cap=${p.quota[k]} show=${show} /></td>`)}
        <td>${p.quota.fncall_per_s === null || p.quota.fncall_per_s === undefined ? html`<span class="muted small">no cap</span>` : p.quota.fncall_per_s}</td>
        <td class="small">${p.delegated.sandboxes ? `${fmt.num(p.delegated.sandboxes)} sandboxes` : ""}${p.delegated.memory_mb ? ` · ${fmt.bytes(p.delegated.memory_mb * 2 ** 20)}` : ""}</td>
      </tr>`)}</tbody></table>
    ${data && !data.length ? html`<p class="muted pad">No projects: sandboxes run in "default" (docs/iam.md).</p>` : null}<//>`;
}
