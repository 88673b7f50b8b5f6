// The History panel: what GET /metrics/history sampled (this API node's view: an hour of samples at
// 10 s, kept in its memory), drawn with uPlot (vendor/uPlot.iife.min.js, a classic script that defines
// the global `uPlot`). The page asks for the samples newer than its last one at the sampler's pace and
// appends them: the charts move without a reload.

import {json} from "./api.js";
import {h, short} from "./util.js";

const MIN_POLL_MS = 1000;
const HEIGHT = 180;
const PALETTE = ["#5aa9ff", "#3ecf8e", "#f5b544", "#ff6b6b", "#b48cff", "#4dd0e1", "#ff9f5a", "#9ccc65"];
const GB = 1e9;

// Each chart's series from one sample: name -> value (null: nothing to plot at that time).
const CHARTS = [
  {key: "tokens", title: "Tokens/s per model", digits: 1,
   series: (s) => mapValues(s.models, (m) => m.tokens_per_s)},
  {key: "requests", title: "Requests/s per model", digits: 2,
   series: (s) => mapValues(s.models, (m) => m.requests_per_s)},
  {key: "queue", title: "Queue depth per instance", digits: 0,
   series: (s) => Object.fromEntries(Object.entries(s.queues).map(([id, q]) => [`${q.model_id} ${short(id)}`, q.depth]))},
  {key: "ttft", title: "Time to first token, s (this API node)", digits: 3, dots: true, // empty between requests
   series: (s) => ({p50: s.ttft.p50_s, p99: s.ttft.p99_s})},
  {key: "memory", title: "Memory per node, GB (dashed: total)", digits: 1,
   series: (s) => Object.fromEntries(Object.entries(s.memory).flatMap(([node, m]) => [
     [`${node} used`, m.used_bytes / GB], [`${node} total`, m.total_bytes / GB]])),
   dashed: (name) => name.endsWith(" total"), colorOf: (name) => name.replace(/ (used|total)$/, "")},
];

function mapValues(object, fn) {
  return Object.fromEntries(Object.entries(object).map(([name, value]) => [name, fn(value)]));
}

export class History {
  constructor(root) {
    this.root = root;
    this.samples = [];
    this.kept = 360;
    this.pollMs = 10_000;
    this.charts = new Map(); // chart key -> {figure, plot, names}
    new ResizeObserver(() => this.resize()).observe(root);
  }

  async start() {
    await this.poll();
    const again = () => setTimeout(async () => { await this.poll(); again(); }, this.pollMs);
    again();
  }

  async poll() {
    const last = this.samples.length ? this.samples[this.samples.length - 1].t : null;
    const data = await json("GET", last === null ? "/metrics/history" : `/metrics/history?after=${last}`)
      .catch(() => null); // the node restarted or the network blinked: the next poll tries again
    if (!data) return;
    this.kept = data.kept;
    this.pollMs = Math.max(MIN_POLL_MS, data.interval_s * 1000);
    this.samples = this.samples.concat(data.samples).slice(-this.kept);
    this.root.dataset.samples = String(this.samples.length);
    if (this.samples.length) this.root.dataset.last = String(this.samples[this.samples.length - 1].t);
    for (const spec of CHARTS) this.draw(spec);
  }

  draw(spec) {
    const values = this.samples.map(spec.series);
    const names = [...new Set(values.flatMap(Object.keys))].sort();
    const data = [this.samples.map((s) => s.t), ...names.map((name) => values.map((v) => v[name] ?? null))];
    let chart = this.charts.get(spec.key);
    if (chart && chart.names.join("\n") === names.join("\n")) {
      chart.plot.setData(data);
    } else { // a new model, instance or node: its series is added by drawing the chart again
      chart?.plot.destroy();
      chart = chart || this.figure(spec);
      chart.names = names;
      chart.plot = new globalThis.uPlot(this.options(spec, names, chart.figure), data, chart.place);
      this.charts.set(spec.key, chart);
    }
    chart.figure.dataset.points = String(data[0].length);
    chart.figure.dataset.series = names.join("\n");
  }

  figure(spec) {
    const place = h("div", {class: "plot"});
    const figure = h("figure", {class: "chart", "data-chart": spec.key}, h("figcaption", {}, spec.title), place);
    this.root.append(figure);
    return {figure, place};
  }

  options(spec, names, figure) {
    const style = getComputedStyle(document.documentElement);
    const text = style.getPropertyValue("--muted").trim() || "#888";
    const grid = style.getPropertyValue("--line").trim() || "#ccc";
    const axis = {stroke: text, grid: {stroke: grid, width: 1}, ticks: {stroke: grid, width: 1}};
    const shown = (u, v) => (v === null || v === undefined ? "–" : v.toFixed(spec.digits));
    const owners = [...new Set(names.map(spec.colorOf || ((name) => name)))]; // a node's used and total: one colour
    const color = (name) => PALETTE[owners.indexOf((spec.colorOf || ((n) => n))(name)) % PALETTE.length];
    const counts = spec.digits ? {} : {incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]}; // no "0.5 requests"
    return {
      width: figure.clientWidth || 400, height: HEIGHT,
      scales: {x: {time: true}, y: {range: (u, min, max) => [0, Math.max(max || 0, spec.digits ? 0.001 : 1) * 1.1]}},
      axes: [axis, {...axis, ...counts, size: 56, values: (u, ticks) => ticks.map((t) => +t.toFixed(spec.digits))}],
      series: [{}, ...names.map((name) => ({
        label: name, value: shown, width: 1.5, stroke: color(name),
        dash: spec.dashed && spec.dashed(name) ? [5, 4] : undefined,
        points: spec.dots ? {show: true, size: 5, fill: color(name)} : {size: 4},
      }))],
    };
  }

  resize() {
    for (const chart of this.charts.values()) {
      const width = chart.figure.clientWidth;
      if (width && chart.plot && width !== chart.plot.width) chart.plot.setSize({width, height: HEIGHT});
    }
  }
}
