// What the page calls a node: its NodeInfo.name (hostname plus the API port when not the default,
// or the --name it was given), else its hostname; two nodes that would look alike (older nodes on
// one host) get their short ids added, so no two nodes ever share a label.

import {short} from "./util.js";

function baseName(node) {
  return (node && (node.name || node.hostname)) || "";
}

export function nodeLabel(state, nodeId) {
  const node = state.nodes[nodeId];
  const base = baseName(node);
  if (!base) return short(nodeId);
  const twins = Object.values(state.nodes).filter((other) => baseName(other) === base).length;
  return twins > 1 ? `${base} (${short(nodeId)})` : base;
}

// A JetStream server of the cluster (exo-<node id>, or exo-<node id>-witness for the small server
// the seed node runs until three nodes hold the streams), named after its node.
export function serverLabel(state, serverName) {
  const witness = serverName.endsWith("-witness");
  const nodeId = serverName.replace(/^exo-/, "").replace(/-witness$/, "");
  const label = state.nodes[nodeId] ? nodeLabel(state, nodeId) : short(nodeId);
  return witness ? `${label} witness` : label;
}
