// The fleet at a glance: edges with health and load, sandboxes by state and backend, the
// last hour's creation rate and latency, and (for the cluster's admin) the fleet's events.
import { html, useRef } from "/ui/vendor/preact.js";
import { Chart, columns } from "/ui/static/charts.js";
import { Badge, Bar, Card, ErrorNote, Stat, api, fmt, navigate, qs, usePoll } from "/ui/static/lib.js";

const POLL_MS = 3000;

export function FleetPage() {
  // the history is kept here and extended with each answer's new samples
  const hist = useRef([]);
  const { data, error } = usePoll(async () => {
    const since = hist.current.length ? hist.current[hist.current.length - 1].at : 0;
    const r = await api(`/v1/console/fleet${qs({ since })}`);
    hist.current = [...hist.current, ...r.history.samples].slice(-720);
    return { ...r, samples: hist.current };
  }, POLL_MS);
  if (!data) return html`<${ErrorNote} error=${error} /><p class="muted">Loading the fleet&hellip;</p>`;
  const { nodes, sandboxes, samples, events, history } = data;
  const note = history.shown ? null : html`<p class="muted small">The fleet's history is the cluster's admin's to see.</p>`;
  const last = samples.length ? samples[samples.length - 1] : null;
  const up = nodes.filter((n) => n.state === "up").length;
  const live = (sandboxes.states.running || 0) + (sandboxes.states.paused || 0) + (sandboxes.states.creating || 0);
  return html`
    <${ErrorNote} error=${error} />
    <div class="stats">
      <${Stat} testid="stat-edges" label="edges up" value=${`${up} / ${nodes.length}`}
        sub=${nodes.filter((n) => n.cordoned).length ? `${nodes.filter((n) => n.cordoned).length} cordoned` : "none cordoned"} />
      <${Stat} testid="stat-sandboxes" label="sandboxes live" value=${fmt.num(live)} sub=${`${fmt.num(sandboxes.total)} known`} />
      <${Stat} label="creates / s" value=${last ? last.creates_per_s.toFixed(2) : "–"}
        sub=${last && last.create_failures_per_s ? `${last.create_failures_per_s.toFixed(2)} failing / s` : "no failures"} />
      <${Stat} label="create latency" value=${last && last.create_ms !== null ? `${last.create_ms.toFixed(0)} ms` : "–"}
        sub="mean over the last interval" />
      <${Stat} label="fleet CPU" value=${last ? fmt.pct(last.cpu_pct) : "–"} sub=${last ? `memory ${fmt.pct(last.memory_pct)}` : ""} />
    </div>
    <div class="grid2">
      <${Card} title="Sandboxes by state">
        <div class="chips">${Object.entries(sandboxes.states).sort().map(([s, n]) => html`
          <a class="chip" href=${`#/sandboxes${qs({ state: s })}`} data-state=${s}><${Badge} kind=${s}>${s}<//> ${fmt.num(n)}</a>`)}
          ${Object.keys(sandboxes.states).length ? null : html`<span class="muted">none</span>`}</div>
        <h4>By backend</h4>
        <div class="chips">${Object.entries(sandboxes.backends).sort().map(([b, n]) => html`
          <a class="chip" href=${`#/sandboxes${qs({ backend: b })}`}>${b} ${fmt.num(n)}</a>`)}</div>
      <//>
      <${Card} title="Sandboxes over time">${note}
        <${Chart} title="live sandboxes" testid="chart-sandboxes" series=${[{ label: "sandboxes" }]}
          data=${columns(samples, "at", ["sandboxes"])} height=${140} />
      <//>
    </div>
    <div class="grid2">
      <${Card} title="Creation rate">${note}
        <${Chart} title="per second" testid="chart-creates"
          series=${[{ label: "creates/s" }, { label: "failures/s", color: "#c92a2a" }, { label: "refusals/s", color: "#e67700" }]}
          data=${columns(samples, "at", ["creates_per_s", "create_failures_per_s", "refusals_per_s"])} />
      <//>
      <${Card} title="Creation latency">
        <${Chart} title="mean create time (ms)" testid="chart-latency" series=${[{ label: "create ms", points: true }]}
          data=${columns(samples, "at", ["create_ms"])} />
      <//>
    </div>
    <${Card} title="Edges" right=${html`<span class="muted">${fmt.ago(last ? last.at : 0)}</span>`}>
      <table class="t" data-testid="edges">
        <thead><tr><th>edge</th><th>state</th><th>health</th><th>CPU</th><th>memory</th><th>swap</th><th>disk</th>
          <th>sandboxes</th><th>reserved</th><th>PSI cpu/mem/io</th></tr></thead>
        <tbody>${nodes.map((n) => html`<${EdgeRow} n=${n} />`)}</tbody>
      </table>
    <//>
    ${events.length ? html`<${Card} title="Fleet events">
      <table class="t"><thead><tr><th>when</th><th>edge</th><th>kind</th><th>by</th><th>reason</th></tr></thead>
        <tbody>${events.map((e) => html`<tr><td>${fmt.ago(e.at)}</td><td>${e.edge}</td><td><${Badge} kind=${e.kind}>${e.kind}<//></td>
          <td>${e.actor}</td><td>${e.sandbox_id ? html`<a href=${`#/sandbox/${e.sandbox_id}`}>${e.sandbox_id}</a> ` : null}${e.reason}</td></tr>`)}
        </tbody></table><//>` : null}`;
}

function EdgeRow({ n }) {
  const h = n.host || {};
  const sig = n.signals || {};
  const memUsed = h.memory_total_mb ? h.memory_total_mb - h.memory_available_mb : 0;
  const swapUsed = h.swap_total_mb ? h.swap_total_mb - h.swap_free_mb : 0;
  const health = n.cordoned ? "cordoned" : n.health;
  return html`<tr data-edge=${n.edge}>
    <td><a href=${`#/sandboxes${qs({ edge: n.edge })}`}>${n.edge}</a></td>
    <td><${Badge} kind=${n.state}>${n.state}<//></td>
    <td><${Badge} kind=${health}>${health}<//>${n.health_reason ? html` <span class="muted small">${n.health_reason}</span>` : null}</td>
    <td><${Bar} value=${h.cpu_pct || 0} label=${`${fmt.pct(h.cpu_pct || 0)} · ${n.cpus} CPUs`} /></td>
    <td><${Bar} value=${memUsed} max=${h.memory_total_mb || 0} label=${`${fmt.bytes(memUsed * 2 ** 20)} / ${fmt.bytes((h.memory_total_mb || 0) * 2 ** 20)}`} /></td>
    <td><${Bar} value=${swapUsed} max=${h.swap_total_mb || 0} label=${h.swap_total_mb ? `${fmt.bytes(swapUsed * 2 ** 20)} / ${fmt.bytes(h.swap_total_mb * 2 ** 20)}` : "none"} /></td>
    <td><${Bar} value=${sig.disk_used_bytes || 0} max=${sig.disk_total_bytes || 0} label=${`${fmt.bytes(sig.disk_used_bytes || 0)} / ${fmt.bytes(sig.disk_total_bytes || 0)}`} /></td>
    <td>${fmt.num(n.sandboxes)} / ${fmt.num(n.max_sandboxes)}</td>
    <td class="small">${n.cpu_reserved.toFixed(1)} CPU · ${fmt.bytes(n.memory_reserved_mb * 2 ** 20)}</td>
    <td class="small">${(sig.psi_cpu || 0).toFixed(1)} / ${(sig.psi_memory || 0).toFixed(1)} / ${(sig.psi_io || 0).toFixed(1)}</td>
  </tr>`;
}

export function goSandboxes(filters) { navigate(`#/sandboxes${qs(filters)}`); }
