// What is wrong with the cluster now, in words, with what to do: the banner above the panels and
// each node's state (live, suspect, offline, gone). It reads what the page already has (State,
// the /events feed and the page's connection to it) and /health, which says why this node cannot
// serve: asked every few seconds, and only while the page is visible.

import {nodeLabel, serverLabel} from "./names.js";
import {h, replaceChildren} from "./util.js";

const HEALTH_EVERY_MS = 5000;
// The master's node.suspect event names the node first, as names.js does: the page shows the rest.
const SUSPECT_REASON = /^node .+? is suspect: /;

export class Troubles {
  constructor() {
    this.connection = {status: "connecting", detail: ""}; // the page's /events stream
    this.health = null; // /health's latest answer (status, problem, nats_connected, redundancy)
    this.gone = new Map(); // node id -> {node, reason, at}: timed out and not heard since
    this.suspect = new Map(); // node id -> why the master marked it suspect (State holds the mark)
    this.known = new Map(); // node id -> its latest NodeInfo: State drops a node that timed out
  }

  // Every event, oldest first; `live`: it happened while the page watched (else `at` is unknown).
  noteEvent({kind, data}, state, live) {
    const at = live ? Date.now() / 1000 : null;
    if (kind === "node.registered" || kind === "node.heartbeat") {
      this.known.set(data.node.node_id, data.node);
      this.gone.delete(data.node.node_id);
    } else if (kind === "node.timed_out") {
      const node = (state && state.nodes[data.node_id]) || this.known.get(data.node_id) || {node_id: data.node_id};
      const reason = (data.reason || "timed out").replace(/^node .+? (?=timed out)/, ""); // it names the node
      this.gone.set(data.node_id, {node, reason, at});
      this.suspect.delete(data.node_id);
    } else if (kind === "node.removed") {
      const node = (state && state.nodes[data.node_id]) || this.known.get(data.node_id) || {node_id: data.node_id};
      const reason = `removed by ${data.removed_by || "an admin"}${data.reason ? ": " + data.reason : ""}`;
      this.gone.set(data.node_id, {node, reason, at});
      this.suspect.delete(data.node_id);
    } else if (kind === "node.suspect" && data.suspect) {
      this.suspect.set(data.node_id, (data.reason || "").replace(SUSPECT_REASON, ""));
    } else if (kind === "node.suspect") {
      this.suspect.delete(data.node_id);
    }
  }

  // This node's bus is away: the page cannot follow the log, or /health says NATS is not connected.
  busAway() {
    return this.connection.status === "reconnecting" || this.connection.status === "error"
      || Boolean(this.health && this.health.nats_connected === false);
  }

  // Nodes State no longer holds that timed out while the page watched (or in its history).
  goneNodes(state) {
    return [...this.gone.values()].filter((gone) => !state.nodes[gone.node.node_id]);
  }
}

// {kind: live | suspect | offline | gone, text}: what a node's card says of it.
export function nodeState(troubles, state, nodeId, thisNode) {
  const gone = troubles && troubles.gone.get(nodeId);
  if (gone && !state.nodes[nodeId]) return {kind: "gone", text: `gone ${when(gone.at)}: ${gone.reason}`};
  if (troubles && nodeId === thisNode && troubles.busAway()) {
    return {kind: "offline", text: "offline: this node is not connected to the cluster's bus"};
  }
  const server = serverOf(state, nodeId);
  if (server && !server.online) return {kind: "offline", text: "offline: its NATS server is not in the cluster"};
  const node = state.nodes[nodeId];
  if (node && node.suspect_since) {
    const why = (troubles && troubles.suspect.get(nodeId)) || `no pulse since ${clock(node.suspect_since)}`;
    return {kind: "suspect", text: `suspect: ${why}`};
  }
  return {kind: "live", text: "live"};
}

function serverOf(state, nodeId) {
  const servers = (state.cluster && state.cluster.servers) || [];
  return servers.find((s) => s.name === `exo-${nodeId}`) || null;
}

function when(at) {
  return at === null ? "before this page opened" : `at ${clock(at)}`;
}

const clock = (at) => new Date(at * 1000).toLocaleTimeString();

// The banner's lines, most basic first: a page that cannot follow the log shows stale State.
export function troubleLines(state, troubles, thisNode) {
  const lines = [];
  const {status, detail} = troubles.connection;
  if (status === "reconnecting" || status === "error") {
    lines.push(["bus", `This page cannot follow the cluster from ${location.host} (${detail || status}), so what it shows `
      + "may be out of date; it keeps trying. Check that this node runs and that this browser can reach it."]);
  }
  if (troubles.health && troubles.health.status === "degraded") {
    const problem = troubles.health.problem || "no reason given";
    lines.push(["health", `This node cannot serve requests: ${problem}. ${adviceFor(problem)}`]);
  }
  const label = (node) => node.name || node.hostname || nodeLabel(state, node.node_id);
  for (const gone of troubles.goneNodes(state)) {
    lines.push(["gone", `Node ${label(gone.node)} is gone (${gone.reason}, ${when(gone.at)}): check that it runs and `
      + "can reach the others; it rejoins by itself when it does."]);
  }
  for (const nodeId of Object.keys(state.nodes)) {
    const shown = nodeState(troubles, state, nodeId, thisNode);
    if (shown.kind === "suspect") {
      lines.push(["suspect", `Node ${nodeLabel(state, nodeId)} is ${shown.text}; its requests moved to other nodes. `
        + "Check that it runs and can reach the others."]);
    }
  }
  return [...lines, ...clusterLines(state), ...redundancyLines(state, troubles.health)];
}

// An event log of one replica that other nodes depend on (issue #46): /health's `redundancy` says
// "none: " and then why and the fix, in the words the start banner prints. A lone node has no line:
// losing its server stops nothing else.
function redundancyLines(state, health) {
  const none = /^none: /;
  if (!health || !none.test(health.redundancy || "") || Object.keys(state.nodes).length < 2) return [];
  return [["redundancy", `This cluster has no redundancy: ${health.redundancy.replace(none, "")}.`]];
}

// A discovered cluster's servers that are offline and streams with fewer replicas online than they want.
function clusterLines(state) {
  const cluster = state.cluster;
  if (!cluster || !cluster.name) return [];
  const online = new Set(cluster.servers.filter((s) => s.online).map((s) => s.name));
  const lines = cluster.servers.filter((s) => !s.online).map((s) => ["server",
    `The NATS server of ${serverLabel(state, s.name)} is offline: check that the node runs and can reach the others.`]);
  for (const stream of cluster.streams) {
    const up = [stream.leader, ...stream.followers].filter((name) => name && online.has(name)).length;
    if (up >= stream.replicas) continue;
    const stops = up < Math.floor(stream.replicas / 2) + 1 ? ": without a majority it takes no writes" : "";
    lines.push(["stream", `Stream ${stream.name} has ${up} of its ${stream.replicas} replicas online${stops}. `
      + "Start the stopped nodes."]);
  }
  return lines;
}

function adviceFor(problem) {
  if (/not connected to NATS/.test(problem)) return "Check this node's NATS server (its log, or the --nats URL) and the network to it.";
  if (/JetStream cannot serve/.test(problem)) return "NATS does not answer in time: check this node's NATS server (its log, CPU and disk).";
  if (/no quorum/.test(problem)) return "Start the stopped nodes: a stream takes writes only while most of its replicas run.";
  if (/behind the event log/.test(problem)) return "State is catching up: wait, or read this node's log if it lasts.";
  if (/full/.test(problem)) return "Free disk space in this node's data dir.";
  return "Read this node's log for more.";
}

export function renderBanner(container, state, troubles, thisNode) {
  const lines = state ? troubleLines(state, troubles, thisNode) : [];
  container.hidden = !lines.length;
  container.dataset.health = troubles.health ? troubles.health.status : ""; // "": not asked yet
  replaceChildren(container, lines.map(([kind, text]) => h("p", {"data-trouble": kind}, text)));
}

// /health every HEALTH_EVERY_MS while the page is visible, and at once when it becomes visible.
export function watchHealth(troubles, onChange) {
  const ask = async () => {
    if (document.visibilityState !== "visible") return;
    try {
      const response = await fetch("/health", {cache: "no-store"});
      troubles.health = await response.json();
    } catch {
      troubles.health = null; // unreachable: the /events stream says so already
    }
    onChange();
  };
  document.addEventListener("visibilitychange", ask);
  setInterval(ask, HEALTH_EVERY_MS);
  ask();
}
