// Downloads: one progress bar per model per node, from State.downloads (node -> model -> progress),
// moved along by download.progress events. Nodes without that field (older versions) show none.
// A failed download of a model that no instance wants any more is not shown: its instance, whose
// failure it explained, is gone, and nothing will retry it.

import {nodeLabel} from "./names.js";
import {bar, bytes, duration, h, percent, replaceChildren} from "./util.js";

export function renderDownloads(container, state) {
  const wanted = new Set(Object.values(state.instances).map((i) => i.model_id));
  const rows = [];
  for (const [nodeId, models] of Object.entries(state.downloads || {})) {
    for (const progress of Object.values(models || {})) {
      if (progress.status === "failed" && !wanted.has(progress.model_id)) continue;
      rows.push(row(nodeId, progress, state));
    }
  }
  if (!rows.length) return replaceChildren(container, [h("p", {class: "empty"}, "No downloads.")]);
  replaceChildren(container, rows);
}

function row(nodeId, p, state) {
  const done = p.status === "completed" ? Math.max(p.done_bytes, p.total_bytes) : p.done_bytes;
  const fraction = p.status === "completed" ? 100 : percent(done, p.total_bytes);
  const facts = [`${bytes(done)} of ${p.total_bytes ? bytes(p.total_bytes) : "?"}`];
  if (p.status === "downloading") {
    if (p.speed_bps) facts.push(`${bytes(p.speed_bps)}/s`);
    if (p.eta_s !== null && p.eta_s !== undefined) facts.push(`${duration(p.eta_s)} left`);
  }
  if (p.source) facts.push(p.source);
  return h("div", {class: "download", "data-model-id": p.model_id, "data-node-id": nodeId, "data-status": p.status},
    h("div", {class: "download-head"},
      h("strong", {class: "model"}, p.model_id),
      h("span", {class: "muted small"}, `on ${nodeLabel(state, nodeId)}`),
      h("span", {class: `badge dl-${p.status}`}, p.status)),
    bar(fraction, `${p.model_id} downloaded`, p.status === "failed" ? "hot" : p.status === "completed" ? "done" : ""),
    h("div", {class: "small muted"}, `${fraction.toFixed(0)}% · ${facts.join(" · ")}`),
    p.error ? h("div", {class: "small error"}, p.error_code ? `${p.error_code}: ${p.error}` : p.error) : null);
}
