// Time-series charts on uPlot: x is seconds since the epoch, one or more y series.
import { html, useEffect, useRef } from "/ui/vendor/preact.js";
import uPlot from "/ui/vendor/uplot.js";

const COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#9c36b5", "#e67700", "#0b7285"];

export function Chart({ title, series, data, height = 180, unit = "", testid }) {
  const box = useRef(null);
  const plot = useRef(null);
  const key = series.map((s) => s.label).join("|");

  useEffect(() => {
    if (!box.current) return undefined;
    const width = Math.max(240, box.current.clientWidth || 400);
    const opts = {
      width,
      height,
      legend: { show: true },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true } },
      axes: [
        { stroke: "#667", grid: { stroke: "#eef" } },
        { stroke: "#667", grid: { stroke: "#eef" }, size: 56,
          values: (_, ticks) => ticks.map((v) => `${+v.toFixed(2)}${unit}`) },
      ],
      series: [{}, ...series.map((s, i) => ({
        label: s.label, stroke: s.color || COLORS[i % COLORS.length], width: 2,
        fill: i === 0 && series.length === 1 ? "rgba(47,111,222,0.08)" : undefined,
        spanGaps: true, points: { show: !!s.points, size: 5 },
      }))],
    };
    plot.current = new uPlot(opts, data, box.current);
    const onResize = () => {
      if (plot.current && box.current) plot.current.setSize({ width: box.current.clientWidth, height });
    };
    window.addEventListener("resize", onResize);
    return () => {
      window.removeEventListener("resize", onResize);
      if (plot.current) plot.current.destroy();
      plot.current = null;
    };
  }, [key, height]);

  useEffect(() => { if (plot.current) plot.current.setData(data); }, [data]);

  return html`<figure class="chart" data-testid=${testid}>
    <figcaption>${title}</figcaption><div ref=${box}></div></figure>`;
}

// Column arrays for uPlot from a list of samples: columns(samples, "at", ["a", "b"]).
export function columns(samples, x, ys) {
  const out = [samples.map((s) => s[x])];
  for (const y of ys) out.push(samples.map((s) => (s[y] === undefined ? null : s[y])));
  return out;
}
