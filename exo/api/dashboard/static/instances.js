// The instances panel: each instance's status (as GET /instance/{id} gives it), what it serves
// (tokens per second, open and queued requests, context, KV cache reserved, prompt-cache hits),
// its ranks with their layers and downloads, and deleting it.

import {json} from "./api.js";
import {layerBar, statusBadge} from "./cluster.js";
import {nodeLabel} from "./names.js";
import {downloadOf, instanceError, instanceStatus} from "./status.js";
import {bytes, confirmButton, duration, h, percent, replaceChildren, short} from "./util.js";

export function renderInstances(container, state, ctx) {
  const instances = Object.values(state.instances).sort((a, b) => a.created_seq - b.created_seq);
  const waiting = Object.values(state.desires ?? {}).filter((d) => d.waiting).map(waitingLine);
  if (!instances.length && !waiting.length) {
    return replaceChildren(container, [h("p", {class: "empty"}, "No instances. Place one from the Place panel.")]);
  }
  replaceChildren(container, [...waiting, ...instances.map((instance) => instanceCard(instance, state, ctx))]);
}

// A placement short of its replicas (its instance died and no node can take a replacement yet): why.
function waitingLine(desire) {
  return h("p", {class: "error desire-waiting"},
           `${desire.model_id}: waiting for ${desire.replicas > 1 ? `${desire.replicas} replicas` : "an instance"}: `
           + desire.waiting);
}

// Numbers about the instance, each from State or measured by the page (tokens per second).
export function instanceStats(instance, state, rates) {
  const tasks = Object.values(state.tasks).filter((t) => t.instance_id === instance.instance_id);
  const running = tasks.filter((t) => t.status === "running").length;
  const queued = tasks.filter((t) => t.status === "pending").length;
  let hits = 0;
  let misses = 0;
  for (const node of Object.values(state.nodes)) { // each rank's runner reports its own cache
    const cache = (node.prompt_caches || {})[instance.instance_id];
    if (cache) { hits += cache.hits; misses += cache.misses; }
  }
  const kvBytes = instance.shards.reduce((sum, s) => sum + (s.kv_bytes || 0), 0);
  return {running, queued, open: running + queued, hits, misses, kvBytes, rate: rates ? rates.of(instance.instance_id) : null};
}

function statsLine(instance, stats) {
  const facts = [
    h("span", {}, `${stats.open} open (${stats.running} running, ${stats.queued} queued${instance.max_queue ? ` of ${instance.max_queue}` : ""})`),
    h("span", {}, instance.max_context ? `context ${instance.max_context.toLocaleString("en")} tokens` : "context: model's"),
    h("span", {}, stats.kvBytes ? `KV ${bytes(stats.kvBytes)} reserved` : "KV reserve unknown"),
    h("span", {}, stats.rate ? `${stats.rate.tokensPerS.toFixed(1)} tok/s (${stats.rate.requests} req)` : "– tok/s"),
  ];
  const asked = stats.hits + stats.misses;
  facts.push(h("span", {title: "requests that reused a cached prompt prefix"},
    asked ? `prompt cache ${percent(stats.hits, asked).toFixed(0)}% hits (${stats.hits}/${asked})` : "prompt cache: no requests"));
  return h("div", {class: "facts stats"}, facts);
}

function instanceCard(instance, state, ctx) {
  const status = instanceStatus(instance, state);
  const stats = instanceStats(instance, state, ctx.rates);
  const failure = instanceError(instance, state);
  return h("article", {class: `card instance ${status === "failed" ? "failed" : ""}`, "data-instance-id": instance.instance_id,
                       "data-model-id": instance.model_id, "data-status": status, "data-open": stats.open,
                       "data-running": stats.running, "data-queued": stats.queued, "data-max-context": instance.max_context,
                       "data-kv-bytes": stats.kvBytes, "data-cache-hits": stats.hits, "data-cache-misses": stats.misses,
                       "data-tokens-per-s": stats.rate ? stats.rate.tokensPerS.toFixed(2) : ""},
    h("header", {},
      h("strong", {class: "model"}, instance.model_id),
      h("span", {class: `badge status-${status}`, "data-instance-status": status}, status.replace("_", " "))),
    failure ? failureLine(instance, failure, ctx) : null,
    h("div", {class: "facts"},
      h("span", {}, instance.sharding),
      h("span", {}, `${instance.shards.length} rank${instance.shards.length === 1 ? "" : "s"}`),
      h("span", {class: "mono", title: instance.instance_id}, short(instance.instance_id))),
    statsLine(instance, stats),
    ranksTable(instance, state, failure),
    failure ? null : h("div", {class: "actions"},
      confirmButton("Delete", () => deleteInstance(instance, ctx), {"data-action": "delete-instance"})));
}

// Why it failed, once (its ranks do not say it again), and removing it: it serves nothing, so one
// click does, without the "Sure?" a serving instance's Delete asks.
function failureLine(instance, failure, ctx) {
  return h("div", {class: "instance-failure"},
    h("div", {class: "error small instance-error grow"}, `${failure.code}: ${failure.error}`),
    h("button", {type: "button", class: "danger", "data-action": "remove-instance",
                 onclick: (event) => { event.currentTarget.disabled = true; deleteInstance(instance, ctx); }}, "Remove"));
}

async function deleteInstance(instance, ctx) {
  try {
    await json("DELETE", `/instance/${encodeURIComponent(instance.instance_id)}`);
  } catch (error) {
    ctx.toast(`Deleting the instance failed: ${error.message}`);
  }
}

// A rank's error is shown where it adds to the instance's (another rank's, a download's own code).
function ranksTable(instance, state, failure) {
  return h("table", {class: "ranks"},
    h("thead", {}, h("tr", {}, h("th", {}, "rank"), h("th", {}, "node"), h("th", {}, "layers"), h("th", {}, "runner"))),
    h("tbody", {}, instance.shards.map((shard) => {
      const runner = state.runners[shard.runner_id];
      return h("tr", {"data-rank": shard.rank},
        h("td", {}, `${shard.rank}/${shard.world_size}`),
        h("td", {title: shard.node_id}, nodeLabel(state, shard.node_id)),
        h("td", {}, `${shard.start_layer}–${shard.end_layer - 1}`, layerBar(instance, shard, state),
          downloadLine(downloadOf(state, shard.node_id, instance.model_id), runner, failure)),
        h("td", {}, statusBadge(runner),
          runner && runner.error && runner.error !== failure?.error ? h("div", {class: "error small"}, runner.error) : null));
    })));
}

// A rank's download while it is under way (its ETA), or why it failed (unless the instance's reason says it).
function downloadLine(download, runner, failure) {
  if (!download || download.status === "completed") return null;
  if (runner && runner.status === "ready") return null; // an older record: the runner got its weights
  if (download.status === "failed") {
    const said = failure && runner && runner.error === failure.error && failure.code === (download.error_code || "unknown");
    return said ? null : h("div", {class: "small error"}, `download failed: ${download.error_code || "error"}`);
  }
  const facts = [`${percent(download.done_bytes, download.total_bytes).toFixed(0)}%`];
  if (download.total_bytes) facts.push(`${bytes(download.done_bytes)} of ${bytes(download.total_bytes)}`);
  if (download.eta_s !== null && download.eta_s !== undefined) facts.push(`${duration(download.eta_s)} left`);
  return h("div", {class: "small muted rank-download"}, `downloading ${facts.join(" · ")}`);
}
