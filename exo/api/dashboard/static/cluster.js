// The nodes panel (memory, backend, liveness, the shards each node runs) and the pieces the
// instances panel shares with it: a rank's layer bar and its runner's badge.

import {nodeState} from "./banner.js";
import {nodeLabel} from "./names.js";
import {shardProgress} from "./status.js";
import {bar, bytes, duration, h, percent, replaceChildren, short} from "./util.js";

// Nodes pulse on core NATS; the master marks one it has not heard from suspect in State
// (suspect_since) and removes it later (30 s by default): a node in State is live unless State or
// the page knows worse (banner.js's nodeState). Its NodeInfo is
// updated only when it changes, so `last_seen` is when it last described itself, shown as such.
// A node that timed out stays on the page, greyed, until the page reloads.
export function renderNodes(container, state, ctx) {
  const label = (node) => (state.nodes[node.node_id] ? nodeLabel(state, node.node_id) : goneLabel(node));
  const gone = ctx.troubles ? ctx.troubles.goneNodes(state).map((g) => g.node) : [];
  const nodes = [...Object.values(state.nodes), ...gone].sort((a, b) => label(a).localeCompare(label(b)));
  if (!nodes.length) return replaceChildren(container, [h("p", {class: "empty"}, "No nodes have registered yet.")]);
  replaceChildren(container, nodes.map((node) => nodeCard(node, label(node), state, ctx)));
}

const goneLabel = (node) => node.name || node.hostname || short(node.node_id);

function nodeCard(node, label, state, ctx) {
  const used = Math.max(0, (node.memory_total || 0) - (node.memory_available || 0));
  const memory = percent(used, node.memory_total);
  const live = liveness(node, state, ctx);
  const master = state.leader_node === node.node_id;
  return h("article", {class: `card node ${live.kind}`, "data-node-id": node.node_id, "data-node-state": live.kind},
    h("header", {},
      h("span", {class: `dot ${live.kind}`, title: live.text}),
      h("strong", {class: "node-name", title: node.hostname ? `host ${node.hostname}` : null}, label),
      master ? h("span", {class: "tag master", "data-master": "",
                          title: "the master: it places instances and routes requests"}, "master") : null,
      node.node_id === ctx.nodeId ? h("span", {class: "tag"}, "this node") : null,
      h("span", {class: "muted small liveness"}, live.text)),
    h("div", {class: "facts"},
      h("span", {}, `backend ${node.backend || "?"}`),
      h("span", {}, `${node.cpu_count || "?"} CPUs`),
      h("span", {class: "mono", title: node.node_id}, short(node.node_id))),
    bar(memory, "memory used", memory > 90 ? "hot" : ""),
    h("div", {class: "small muted"},
      `${bytes(used)} used of ${bytes(node.memory_total)} · ${bytes(node.memory_available)} free`),
    shardsOn(node.node_id, state));
}

function liveness(node, state, ctx) {
  const shown = nodeState(ctx.troubles, state, node.node_id, ctx.nodeId);
  if (shown.kind !== "live") return shown;
  const age = Date.now() / 1000 - (node.last_seen || 0);
  return {kind: "live", text: `live; described ${duration(age)} ago`};
}

function shardsOn(nodeId, state) {
  const rows = [];
  for (const instance of Object.values(state.instances)) {
    for (const shard of instance.shards) {
      if (shard.node_id !== nodeId) continue;
      rows.push(h("div", {class: "shard", "data-instance-id": instance.instance_id},
        h("div", {class: "shard-head"},
          h("span", {class: "model"}, instance.model_id),
          statusBadge(state.runners[shard.runner_id])),
        layerBar(instance, shard, state),
        h("div", {class: "small muted"}, shardText(instance, shard))));
    }
  }
  return rows.length ? h("div", {class: "shards"}, rows) : h("p", {class: "small muted"}, "Runs no instance.");
}

function totalLayers(instance) {
  return Math.max(1, ...instance.shards.map((s) => s.end_layer));
}

export function shardText(instance, shard) {
  const layers = `layers ${shard.start_layer}–${shard.end_layer - 1} of ${totalLayers(instance)}`;
  return `${instance.sharding} · rank ${shard.rank}/${shard.world_size} · ${layers}`;
}

// The model's layers drawn end to end, this rank's range in it: filled as far as its download has
// come while downloading, red when it failed, in the sharding's colour once ready.
export function layerBar(instance, shard, state) {
  const total = totalLayers(instance);
  const progress = shardProgress(instance, shard, state);
  return h("div", {class: "layers", title: `${shardText(instance, shard)} · ${progress.text}`,
                   "data-layers-status": progress.kind, "data-progress": progress.fill.toFixed(0)},
    h("div", {class: `range ${instance.sharding} ${progress.kind}`, style: {
      left: `${(100 * shard.start_layer) / total}%`, width: `${(100 * (shard.end_layer - shard.start_layer)) / total}%`}},
      h("div", {class: "fill", style: {width: `${progress.fill}%`}})));
}

export function statusBadge(runner) {
  const status = runner ? runner.status : "created"; // not in State yet: as report_of says
  return h("span", {class: `badge status-${status}`, "data-runner-status": status, title: runner && runner.error || null},
    status.replace("_", " "));
}
