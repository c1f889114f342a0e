// Jobs, batches and rollouts: how far each has come, what failed and why, what the quota
// still allows. A job's page is what a researcher watching a training run keeps open.
import { html } from "/ui/vendor/preact.js";
import { Badge, Card, ErrorNote, Stat, api, fmt, qs, usePoll } from "/ui/static/lib.js";

const BATCH_STATES = ["running", "starting", "queued", "failed", "cancelled"];

export function Progress({ counts, total, order, testid }) {
  const n = total || Object.values(counts).reduce((a, b) => a + b, 0);
  return html`<div class="progress" data-testid=${testid} title=${order.map((k) => `${k}: ${counts[k] || 0}`).join(", ")}>
    ${order.map((k) => (counts[k] ? html`<div class=${`seg s-${k}`} style=${`width:${(100 * counts[k]) / Math.max(1, n)}%`}></div>` : null))}
  </div>`;
}

export function JobsPage() {
  const { data, error } = usePoll(async () => {
    const [jobs, counts, batches] = await Promise.all([
      api("/v1/jobs"), api("/v1/console/sandboxes?limit=0"), api("/v1/batches?limit=20")]);
    return { jobs, counts, batches };
  }, 3000);
  if (!data) return html`<${ErrorNote} error=${error} /><p class="muted">Loading&hellip;</p>`;
  const { jobs, counts, batches } = data;
  return html`<${ErrorNote} error=${error} />
    <${Card} title="Jobs">
      <table class="t" data-testid="jobs"><thead><tr><th>job</th><th>project</th><th>state</th><th>sandboxes</th>
        <th>by state</th><th>quota</th><th>created</th></tr></thead>
        <tbody>${jobs.slice().reverse().map((j) => {
          const c = counts.jobs[j.name] || {};
          const live = (c.running || 0) + (c.paused || 0) + (c.creating || 0);
          return html`<tr data-job=${j.name}><td><a href=${`#/job/${encodeURIComponent(j.name)}${qs({ project: j.project })}`}>${j.name}</a></td>
            <td>${j.project}</td><td><${Badge} kind=${j.state}>${j.state}<//></td><td>${fmt.num(live)} live</td>
            <td><${Progress} counts=${c} order=${["running", "paused", "creating", "stopped", "failed"]} /></td>
            <td class="small">${quotaText(j.quota)}</td><td>${fmt.ago(j.created_at)}</td></tr>`;
        })}</tbody></table>
      ${jobs.length ? null : html`<p class="muted pad">No jobs yet: client.create_job(...) makes one (docs/rl.md).</p>`}
    <//>
    <${Batches} batches=${batches} />`;
}

function quotaText(q) {
  const parts = [];
  if (q.sandboxes !== null && q.sandboxes !== undefined) parts.push(`${q.sandboxes} sandboxes`);
  if (q.cpu_cores !== null && q.cpu_cores !== undefined) parts.push(`${q.cpu_cores} CPU`);
  if (q.memory_mb !== null && q.memory_mb !== undefined) parts.push(`${q.memory_mb} MiB`);
  return parts.length ? parts.join(" · ") : "no cap";
}

function Batches({ batches, title = "Batches" }) {
  return html`<${Card} title=${title}>
    <table class="t" data-testid="batches"><thead><tr><th>batch</th><th>job</th><th>state</th><th>progress</th><th>made</th>
      <th>failed</th><th>why</th><th>took</th></tr></thead>
      <tbody>${batches.map((b) => html`<tr data-batch=${b.id}><td class="mono small">${b.id}</td><td>${b.job || "–"}</td>
        <td><${Badge} kind=${b.state}>${b.state}<//></td>
        <td><${Progress} counts=${b.counts} total=${b.n} order=${BATCH_STATES} testid=${`batch-${b.id}`} /></td>
        <td>${fmt.num(b.counts.running)} / ${fmt.num(b.n)}</td><td>${fmt.num(b.counts.failed)}</td>
        <td class="small">${Object.entries(b.failure_reasons || {}).map(([r, n]) => html`<div>${n} × ${r}</div>`)}</td>
        <td>${fmt.dur((b.finished_at || Date.now() / 1000) - b.created_at)}</td></tr>`)}</tbody></table>
    ${batches.length ? null : html`<p class="muted pad">No batches.</p>`}<//>`;
}

export function JobPage({ name, params }) {
  const project = params.get("project") || undefined;
  const { data, error } = usePoll(async () => {
    const [status, batches, rollouts, failed] = await Promise.all([
      api(`/v1/jobs/${encodeURIComponent(name)}/status${qs({ project, usage: true })}`),
      api(`/v1/batches${qs({ job: name, limit: 20 })}`),
      api(`/v1/rollouts/counts${qs({ job: name, project })}`),
      api(`/v1/rollouts${qs({ job: name, project, state: "failed", limit: 1000 })}`)]);
    return { status, batches, rollouts, failed };
  }, 2000, [name, project]);
  if (!data) return html`<${ErrorNote} error=${error} /><p class="muted">Loading ${name}&hellip;</p>`;
  const { status, batches, rollouts, failed } = data;
  const j = status.job;
  const u = status.usage;
  const q = j.quota;
  const rTotal = Object.entries(rollouts).filter(([k]) => k !== "unconsumed").reduce((a, [, v]) => a + v, 0);
  return html`<${ErrorNote} error=${error} />
    <div class="head"><h2>${j.name}</h2><${Badge} kind=${j.state}>${j.state}<//><span class="muted">project ${j.project}</span>
      <span class="grow"></span><a href=${`#/sandboxes${qs({ job: j.name })}`}>its sandboxes →</a></div>
    <div class="stats">
      <${Stat} testid="job-live" label="live sandboxes" value=${fmt.num(u.sandboxes)} sub=${q.sandboxes !== null && q.sandboxes !== undefined ? `of ${q.sandboxes} allowed` : "no cap"} />
      <${Stat} label="CPU reserved" value=${u.cpu_cores.toFixed(1)} sub=${q.cpu_cores !== null && q.cpu_cores !== undefined ? `of ${q.cpu_cores}` : "no cap"} />
      <${Stat} label="memory reserved" value=${fmt.bytes(u.memory_mb * 2 ** 20)} sub=${q.memory_mb !== null && q.memory_mb !== undefined ? `of ${fmt.bytes(q.memory_mb * 2 ** 20)}` : "no cap"} />
      <${Stat} label="created last minute" value=${fmt.num(status.created_last_minute)} />
      <${Stat} label="memory in use" value=${u.memory_bytes !== null ? fmt.bytes(u.memory_bytes) : "–"} sub=${u.cpu_s !== null ? `${fmt.dur(u.cpu_s)} CPU` : ""} />
    </div>
    <div class="grid2">
      <${Card} title="Sandboxes by state">
        <${Progress} counts=${status.by_state} order=${["running", "paused", "creating", "restoring", "stopped", "failed"]} testid="job-progress" />
        <div class="chips">${Object.entries(status.by_state).sort().map(([s, n]) => html`
          <a class="chip" href=${`#/sandboxes${qs({ job: j.name, state: s })}`}><${Badge} kind=${s}>${s}<//> <span data-testid=${`job-state-${s}`}>${fmt.num(n)}</span></a>`)}</div>
        <h4>By edge</h4><div class="chips">${Object.entries(status.by_edge).map(([e, n]) => html`<span class="chip">${e} ${n}</span>`)}</div>
        ${status.unreachable_edges.length ? html`<p class="error small">not answering: ${status.unreachable_edges.join(", ")}</p>` : null}
      <//>
      <${Card} title="Rollouts">
        <${Progress} counts=${rollouts} total=${rTotal} order=${["done", "running", "queued", "failed", "cancelled"]} testid="rollout-progress" />
        <div class="chips">${["queued", "running", "done", "failed", "cancelled", "unconsumed"].map((k) => html`
          <span class="chip"><${Badge} kind=${k}>${k}<//> ${fmt.num(rollouts[k])}</span>`)}</div>
        ${failed.length ? html`<h4>Failed rollouts</h4><table class="t"><thead><tr><th>rollout</th><th>key</th><th>kind</th><th>error</th><th>sandbox</th></tr></thead>
          <tbody>${failed.slice(-20).reverse().map((r) => html`<tr><td class="mono small">${r.id}</td><td class="small">${r.key || "–"}</td>
            <td>${r.failure || "–"}</td><td class="small">${r.error}</td>
            <td>${r.sandbox_id ? html`<a href=${`#/sandbox/${r.sandbox_id}`} class="mono small">${r.sandbox_id}</a>` : "–"}</td></tr>`)}</tbody></table>` : null}
      <//>
    </div>
    <${Batches} batches=${batches} title="Its batches" />`;
}
