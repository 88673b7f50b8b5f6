// The JetStream cluster under a discovered exo cluster (State's `cluster`, written by the node
// whose server leads the meta group): its servers, meta leader, and each stream's replicas.

import {serverLabel} from "./names.js";
import {h, replaceChildren} from "./util.js";

export function renderReplicas(container, state) {
  const cluster = state.cluster;
  if (!cluster || !cluster.name) {
    return replaceChildren(container, [h("p", {class: "small muted"}, "NATS: one server, no JetStream cluster.")]);
  }
  const serverName = (name) => serverLabel(state, name);
  const servers = cluster.servers.map((s) => h("span", {class: `tag ${s.online ? "" : "down"}`, title: s.name,
    "data-server": s.name, "data-online": String(s.online)},
    `${serverName(s.name)}${s.name === cluster.meta_leader ? " ★" : ""}${s.online ? "" : " offline"}`));
  const rows = cluster.streams.map((s) => h("tr", {"data-stream": s.name, "data-replicas": String(s.replicas)},
    h("td", {class: "mono"}, s.name), h("td", {}, `R${s.replicas}`),
    h("td", {title: s.leader}, s.leader ? serverName(s.leader) : "-"),
    h("td", {}, s.followers.map(serverName).join(", ") || "-")));
  replaceChildren(container, [
    h("div", {class: "small"}, h("strong", {}, `JetStream cluster ${cluster.name}`), " · servers (★ meta leader): ", ...servers),
    h("table", {class: "small replicas"},
      h("thead", {}, h("tr", {}, h("th", {}, "stream"), h("th", {}, "replicas"), h("th", {}, "leader"), h("th", {}, "followers"))),
      h("tbody", {}, ...rows)),
  ]);
}
