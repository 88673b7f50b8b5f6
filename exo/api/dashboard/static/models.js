// The model panels: built-in and custom cards (add one from a Hugging Face id, delete one), and
// placing an instance after looking at where each kind of placement would put it.

import {json} from "./api.js";
import {nodeLabel} from "./names.js";
import {instanceStatus} from "./status.js";
import {bytes, confirmButton, h, replaceChildren, short} from "./util.js";

// Where each model is, as /v1/models says it (exo/api/cluster/models.py): model id -> {ready, downloaded}
// node ids, for the models on some node.
export function availability(state) {
  const where = new Map();
  const of = (id) => where.get(id) || where.set(id, {ready: new Set(), downloaded: new Set()}).get(id);
  for (const instance of Object.values(state.instances)) {
    if (instanceStatus(instance, state) !== "ready") continue;
    for (const shard of instance.shards) of(instance.model_id).ready.add(shard.node_id);
  }
  for (const [nodeId, models] of Object.entries(state.downloads || {})) {
    for (const p of Object.values(models || {})) if (p.status === "completed") of(p.model_id).downloaded.add(nodeId);
  }
  return where;
}

// The model's instances counted by status: ready, failed, and the rest on their way.
function instanceTags(modelId, state) {
  const counts = {ready: 0, failed: 0, starting: 0};
  for (const instance of Object.values(state.instances)) {
    if (instance.model_id !== modelId) continue;
    const status = instanceStatus(instance, state);
    counts[status === "ready" || status === "failed" ? status : "starting"] += 1;
  }
  return Object.entries(counts).filter(([, n]) => n).map(([kind, n]) =>
    h("span", {class: `tag ${kind}`, "data-instances": kind}, `${n} ${kind}`));
}

function whereLine(where, state) {
  if (!where) return h("div", {class: "small muted where", "data-ready-on": "", "data-downloaded-on": ""}, "on no node");
  const names = (ids) => [...ids].map((id) => nodeLabel(state, id)).sort().join(", ");
  const ready = [...where.ready].sort();
  const downloaded = [...where.downloaded].sort();
  return h("div", {class: "small where", "data-ready-on": ready.join(" "), "data-downloaded-on": downloaded.join(" ")},
    ready.length ? h("span", {class: "tag ready"}, `ready on ${names(ready)}`) : null, " ",
    downloaded.length ? h("span", {class: "tag downloaded"}, `downloaded on ${names(downloaded)}`) : null);
}

// local/<folder name>, in the characters a model id allows.
function localId(path) {
  const folder = path.replace(/\/+$/, "").split("/").pop() || "model";
  return `local/${folder.replace(/[^A-Za-z0-9._-]+/g, "-")}`;
}

export class Models {
  constructor(ctx) {
    this.ctx = ctx;
    this.list = document.getElementById("models");
    this.placeSelect = document.getElementById("place-model");
    this.previews = document.getElementById("previews");
    this.cards = new Map(); // model id -> card, from /v1/models/{id}
    this.ids = [];
    this.signature = null; // custom card ids last seen: a change means the catalogue changed
    this.previewSignature = null; // nodes and instances the shown previews were computed for
    document.getElementById("add-model-form").addEventListener("submit", (event) => this.add(event));
    this.placeSelect.addEventListener("change", () => this.loadPreviews());
    document.getElementById("previews-refresh").addEventListener("click", () => this.loadPreviews());
  }

  async update(state) {
    const custom = Object.keys(state.custom_model_cards).sort().join("\n");
    if (custom !== this.signature) {
      this.signature = custom;
      await this.loadCatalogue(state);
    }
    this.render(state);
    const placement = [...Object.keys(state.nodes), ...Object.keys(state.instances)].sort().join("\n");
    if (placement !== this.previewSignature && this.placeSelect.value) this.loadPreviews();
  }

  async loadCatalogue(state) {
    try {
      const models = await json("GET", "/v1/models");
      this.ids = models.data.map((m) => m.id);
      await Promise.all(this.ids.filter((id) => !this.cards.has(id) && !state.custom_model_cards[id]).map(async (id) => {
        const model = await json("GET", `/v1/models/${id}`).catch(() => null);
        if (model) this.cards.set(id, model.card);
      }));
    } catch (error) {
      this.ctx.toast(`Could not list models: ${error.message}`);
    }
    const chosen = this.placeSelect.value;
    replaceChildren(this.placeSelect, [h("option", {value: ""}, "choose a model…"),
                                       this.ids.map((id) => h("option", {value: id}, id))]);
    this.placeSelect.value = this.ids.includes(chosen) ? chosen : "";
  }

  render(state) {
    if (!this.ids.length) return replaceChildren(this.list, [h("li", {class: "empty"}, "No model cards.")]);
    const where = availability(state);
    replaceChildren(this.list, this.ids.map((id) => {
      const custom = state.custom_model_cards[id];
      const card = custom || this.cards.get(id) || {};
      return h("li", {class: "model-row", "data-model-id": id},
        h("div", {class: "grow"},
          h("div", {}, h("strong", {}, card.name || id), " ",
            h("span", {class: `tag ${custom ? "custom" : ""}`}, custom ? "custom" : "built-in"),
            instanceTags(id, state)),
          h("div", {class: "small muted"},
            [id, card.n_layers ? `${card.n_layers} layers` : null, card.storage_bytes ? bytes(card.storage_bytes) : null,
             card.path ? `local: ${card.path}` : null].filter(Boolean).join(" · ")),
          whereLine(where.get(id), state)),
        h("div", {class: "actions"},
          h("button", {type: "button", "data-action": "choose-model", onclick: () => this.choose(id)}, "Place…"),
          custom ? confirmButton("Delete", () => this.remove(id), {"data-action": "delete-model"}) : null));
    }));
  }

  // A Hub id, or a local model directory (with an id of the user's, or local/<folder name>).
  async add(event) {
    event.preventDefault();
    const idInput = document.getElementById("add-model-id");
    const pathInput = document.getElementById("add-model-path");
    const status = document.getElementById("add-model-status");
    const button = event.submitter;
    const path = pathInput.value.trim();
    const modelId = idInput.value.trim() || (path ? localId(path) : "");
    if (!modelId) return;
    button.disabled = true;
    status.className = "small muted";
    status.textContent = path ? `Reading ${path}/config.json…` : `Reading ${modelId}'s config from the Hub…`;
    try {
      await json("POST", "/models/add", path ? {model_id: modelId, path} : {model_id: modelId});
      status.textContent = `Added ${modelId}.`;
      idInput.value = pathInput.value = "";
    } catch (error) {
      status.className = "small error";
      status.textContent = error.message; // the server's own words: they name the cause
    } finally {
      button.disabled = false;
    }
  }

  async remove(id) {
    try {
      await json("DELETE", `/models/custom/${id}`);
    } catch (error) {
      this.ctx.toast(`Deleting ${id} failed: ${error.message}`);
    }
  }

  choose(id) {
    this.placeSelect.value = id;
    this.loadPreviews();
    document.getElementById("place-panel").scrollIntoView({behavior: "smooth", block: "nearest"});
  }

  async loadPreviews() {
    const modelId = this.placeSelect.value;
    const state = this.ctx.state();
    this.previewSignature = [...Object.keys(state.nodes), ...Object.keys(state.instances)].sort().join("\n");
    if (!modelId) return replaceChildren(this.previews, []);
    try {
      const {previews} = await json("GET", `/instance/previews?model_id=${encodeURIComponent(modelId)}`);
      if (this.placeSelect.value !== modelId) return; // another model was chosen meanwhile
      replaceChildren(this.previews, previews.map((p) => this.preview(p, state)));
    } catch (error) {
      replaceChildren(this.previews, [h("p", {class: "error"}, error.message)]);
    }
  }

  preview(p, state) {
    const title = `${p.sharding} · ${p.min_nodes} node${p.min_nodes === 1 ? "" : "s"} minimum`;
    if (!p.instance) {
      return h("div", {class: "preview invalid", "data-sharding": p.sharding, "data-min-nodes": p.min_nodes},
        h("div", {}, h("strong", {}, title)), h("div", {class: "small muted"}, p.error));
    }
    const hostname = (id) => nodeLabel(state, id);
    return h("div", {class: "preview", "data-sharding": p.sharding, "data-min-nodes": p.min_nodes},
      h("div", {class: "grow"},
        h("strong", {}, title),
        h("ul", {class: "small"}, p.instance.shards.map((s) =>
          h("li", {}, `rank ${s.rank} on ${hostname(s.node_id)}: layers ${s.start_layer}–${s.end_layer - 1}`)))),
      h("button", {type: "button", class: "primary", "data-action": "place",
                   onclick: (event) => this.place(event.currentTarget, p)}, "Place"));
  }

  async place(button, p) {
    button.disabled = true;
    try {
      const placed = await json("POST", "/place_instance", {model_id: p.model_id, sharding: p.sharding, min_nodes: p.min_nodes});
      this.ctx.toast(`Placed ${p.model_id} (${short(placed.instance_id)}).`, "ok");
    } catch (error) {
      this.ctx.toast(`Placing ${p.model_id} failed: ${error.message}`);
    } finally {
      button.disabled = false;
    }
  }
}
