// The cluster panels: nodes (memory, backend, liveness, the shards each one runs) and
// instances (ranks with their layer ranges and runner status), with deleting an instance.

import {json} from "./api.js";
import {bar, bytes, confirmButton, duration, h, percent, replaceChildren, short} from "./util.js";

// Nodes pulse on core NATS and the master removes one it has not heard from (30 s by default):
// a node in State is live. Its NodeInfo is updated only when it changes, so `last_seen` is when
// it last described itself, shown as such.
const STATUS_ORDER = ["failed", "created", "downloading", "loading", "warming_up", "ready", "stopped"];

export function renderNodes(container, state, ctx) {
  const nodes = Object.values(state.nodes).sort((a, b) => (a.hostname || a.node_id).localeCompare(b.hostname || b.node_id));
  if (!nodes.length) return replaceChildren(container, [h("p", {class: "empty"}, "No nodes have registered yet.")]);
  replaceChildren(container, nodes.map((node) => nodeCard(node, state, ctx)));
}

function nodeCard(node, state, ctx) {
  const used = Math.max(0, node.memory_total - node.memory_available);
  const memory = percent(used, node.memory_total);
  const live = liveness(node, ctx);
  return h("article", {class: "card node", "data-node-id": node.node_id},
    h("header", {},
      h("span", {class: `dot ${live.kind}`, title: live.text}),
      h("strong", {}, node.hostname || short(node.node_id)),
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

function liveness(node, ctx) {
  if (typeof node.status === "string" && node.status) { // newer nodes may report it outright
    return {kind: node.status === "alive" || node.status === "live" ? "live" : "down", text: node.status};
  }
  const age = Date.now() / 1000 - (node.last_seen || 0);
  return {kind: "live", text: `live; described ${duration(age)} ago`};
}

function shardsOn(nodeId, state) {
  const rows = [];
  for (const instance of Object.values(state.instances)) {
    for (const shard of instance.shards) {
      if (shard.node_id !== nodeId) continue;
      const runner = state.runners[shard.runner_id];
      rows.push(h("div", {class: "shard"},
        h("div", {class: "shard-head"},
          h("span", {class: "model"}, instance.model_id),
          statusBadge(runner)),
        layerBar(instance, shard),
        h("div", {class: "small muted"}, shardText(instance, shard))));
    }
  }
  return rows.length ? h("div", {class: "shards"}, rows) : h("p", {class: "small muted"}, "Runs no instance.");
}

function totalLayers(instance) {
  return Math.max(1, ...instance.shards.map((s) => s.end_layer));
}

function shardText(instance, shard) {
  const layers = `layers ${shard.start_layer}–${shard.end_layer - 1} of ${totalLayers(instance)}`;
  return `${instance.sharding} · rank ${shard.rank}/${shard.world_size} · ${layers}`;
}

// The model's layers drawn end to end, this rank's range filled in.
function layerBar(instance, shard) {
  const total = totalLayers(instance);
  return h("div", {class: "layers", title: shardText(instance, shard)},
    h("div", {class: `range ${instance.sharding}`, style: {
      left: `${(100 * shard.start_layer) / total}%`, width: `${(100 * (shard.end_layer - shard.start_layer)) / total}%`}}));
}

export function statusBadge(runner) {
  const status = runner ? runner.status : "missing";
  return h("span", {class: `badge status-${status}`, "data-runner-status": status, title: runner && runner.error || null},
    status.replace("_", " "));
}

// The least advanced runner says how far the whole instance is (failed outranks everything).
export function instanceStatus(instance, state) {
  const statuses = instance.shards.map((s) => (state.runners[s.runner_id] || {status: "created"}).status);
  if (!statuses.length) return "created";
  return statuses.reduce((worst, s) => (STATUS_ORDER.indexOf(s) < STATUS_ORDER.indexOf(worst) ? s : worst));
}

export function renderInstances(container, state, ctx) {
  const instances = Object.values(state.instances).sort((a, b) => a.created_seq - b.created_seq);
  if (!instances.length) {
    return replaceChildren(container, [h("p", {class: "empty"}, "No instances. Place one from the Place panel.")]);
  }
  replaceChildren(container, instances.map((instance) => instanceCard(instance, state, ctx)));
}

function instanceCard(instance, state, ctx) {
  const open = Object.values(state.tasks).filter(
    (t) => t.instance_id === instance.instance_id && (t.status === "pending" || t.status === "running")).length;
  const status = instanceStatus(instance, state);
  return h("article", {class: "card instance", "data-instance-id": instance.instance_id, "data-model-id": instance.model_id,
                       "data-status": status},
    h("header", {},
      h("strong", {class: "model"}, instance.model_id),
      h("span", {class: `badge status-${status}`}, status.replace("_", " "))),
    h("div", {class: "facts"},
      h("span", {}, instance.sharding),
      h("span", {}, `${instance.shards.length} rank${instance.shards.length === 1 ? "" : "s"}`),
      h("span", {}, `${open} open task${open === 1 ? "" : "s"}`),
      h("span", {class: "mono", title: instance.instance_id}, short(instance.instance_id))),
    h("table", {class: "ranks"},
      h("thead", {}, h("tr", {}, h("th", {}, "rank"), h("th", {}, "node"), h("th", {}, "layers"), h("th", {}, "runner"))),
      h("tbody", {}, instance.shards.map((shard) => {
        const node = state.nodes[shard.node_id];
        const runner = state.runners[shard.runner_id];
        return h("tr", {"data-rank": shard.rank},
          h("td", {}, `${shard.rank}/${shard.world_size}`),
          h("td", {title: shard.node_id}, node ? node.hostname || short(node.node_id) : short(shard.node_id)),
          h("td", {}, `${shard.start_layer}–${shard.end_layer - 1}`, layerBar(instance, shard)),
          h("td", {}, statusBadge(runner), runner && runner.error ? h("div", {class: "error small"}, runner.error) : null));
      }))),
    h("div", {class: "actions"},
      confirmButton("Delete", async () => {
        try {
          await json("DELETE", `/instance/${encodeURIComponent(instance.instance_id)}`);
        } catch (error) {
          ctx.toast(`Deleting the instance failed: ${error.message}`);
        }
      }, {"data-action": "delete-instance"})));
}
