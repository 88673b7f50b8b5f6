// How far instances and their ranks are, read from State the way the API's report_of does
// (exo/api/cluster/instances.py, GET /instance/{id}): the page and the API never disagree on a status.

import {percent} from "./util.js";

// How far a runner has come, least first: an instance is as far as its least advanced runner.
const PROGRESS = ["created", "downloading", "downloaded", "loading", "warming_up", "ready"];

export function runnerStatus(state, shard) {
  const runner = state.runners[shard.runner_id];
  return runner ? runner.status : "created";
}

// "failed" if a runner failed, "stopped" if one stopped, else the least advanced runner's status.
export function instanceStatus(instance, state) {
  const statuses = instance.shards.map((s) => runnerStatus(state, s));
  if (statuses.includes("failed")) return "failed";
  if (statuses.includes("stopped")) return "stopped";
  if (!statuses.length) return "created";
  const rank = (s) => Math.max(0, PROGRESS.indexOf(s));
  return statuses.reduce((least, s) => (rank(s) < rank(least) ? s : least));
}

// The first failed runner's error, as report_of gives it (the download's code when it failed the runner).
export function instanceError(instance, state) {
  for (const shard of instance.shards) {
    const runner = state.runners[shard.runner_id];
    if (!runner || runner.status !== "failed") continue;
    const download = downloadOf(state, shard.node_id, instance.model_id);
    const byDownload = download && download.status === "failed" && (runner.error || "").startsWith("download failed:");
    return {error: runner.error || "the runner failed", code: byDownload ? download.error_code || "unknown" : "runner_failed"};
  }
  return null;
}

export function downloadOf(state, nodeId, modelId) {
  return ((state.downloads || {})[nodeId] || {})[modelId] || null;
}

// What a rank's layer bar shows: its status, and for a download under way how far it is (0-100).
export function shardProgress(instance, shard, state) {
  const status = runnerStatus(state, shard);
  const download = downloadOf(state, shard.node_id, instance.model_id);
  if (status === "failed") return {kind: "failed", fill: 100, text: "failed"};
  if ((status === "created" || status === "downloading") && download && download.status !== "completed") {
    if (download.status === "failed") return {kind: "failed", fill: 100, text: "download failed"};
    const fill = percent(download.done_bytes, download.total_bytes);
    return {kind: "downloading", fill, text: `downloading ${fill.toFixed(0)}%`};
  }
  if (status === "ready") return {kind: "ready", fill: 100, text: "ready"};
  if (status === "stopped") return {kind: "stopped", fill: 100, text: "stopped"};
  // Created, downloaded, loading, warming up: on its way, the weights not yet in use.
  return {kind: "pending", fill: status === "created" ? 0 : 100, text: status.replace("_", " ")};
}
