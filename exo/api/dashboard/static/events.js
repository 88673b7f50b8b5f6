// The live event feed: every event from GET /events with its stream sequence (the number
// `exo replay --until` takes), newest first, filtered by kind, by text, or to one "#sequence".

import {h, replaceChildren} from "./util.js";

const KEEP = 1000; // events held in the page
const SHOW = 300; // rows drawn at once

export class EventFeed {
  constructor() {
    this.events = [];
    this.kinds = new Set();
    this.list = document.getElementById("events");
    this.kind = document.getElementById("events-kind");
    this.filter = document.getElementById("events-filter");
    this.pause = document.getElementById("events-pause");
    this.count = document.getElementById("events-count");
    this.kind.addEventListener("change", () => this.redraw());
    this.filter.addEventListener("input", () => this.redraw());
    this.pause.addEventListener("change", () => this.redraw());
  }

  add(event) {
    event.text = JSON.stringify(event.data);
    this.events.push(event);
    if (this.events.length > KEEP) this.events.splice(0, this.events.length - KEEP);
    if (!this.kinds.has(event.kind)) {
      this.kinds.add(event.kind);
      const options = [...this.kinds].sort().map((k) => h("option", {value: k}, k));
      const chosen = this.kind.value;
      replaceChildren(this.kind, [h("option", {value: ""}, "every kind"), options]);
      this.kind.value = chosen;
    }
    if (this.pause.checked) return;
    if (this.matches(event)) {
      this.list.prepend(row(event));
      while (this.list.childElementCount > SHOW) this.list.lastElementChild.remove();
    }
    this.showCount();
  }

  matches(event) {
    if (this.kind.value && event.kind !== this.kind.value) return false;
    const needle = this.filter.value.trim().toLowerCase();
    if (!needle) return true;
    if (/^#\d+$/.test(needle)) return event.seq === Number(needle.slice(1)); // one event, by its sequence
    return event.kind.includes(needle) || event.text.toLowerCase().includes(needle);
  }

  redraw() {
    const shown = this.events.filter((e) => this.matches(e)).slice(-SHOW).reverse();
    replaceChildren(this.list, shown.map(row));
    this.showCount();
  }

  showCount() {
    const matching = this.events.filter((e) => this.matches(e)).length;
    this.count.textContent = `${matching} of ${this.events.length}${this.pause.checked ? " · paused" : ""}`;
  }
}

function row(event) {
  const family = event.kind.split(".")[0];
  return h("li", {class: "event", "data-seq": event.seq, "data-kind": event.kind},
    h("details", {},
      h("summary", {},
        h("span", {class: "seq mono"}, `#${event.seq}`),
        h("span", {class: `kind k-${family}`}, event.kind),
        h("span", {class: "summary"}, safeSummary(event))),
      h("pre", {}, JSON.stringify(event.data, null, 2))));
}

function safeSummary(event) {
  try {
    return summarize(event);
  } catch { // a newer node's event of a known kind with another shape: show it raw
    return generic(event.data);
  }
}

function generic(data) {
  const {kind: _, term: __, ...rest} = data;
  const text = JSON.stringify(rest);
  return text.length > 160 ? `${text.slice(0, 157)}…` : text;
}

// One line a person can read; the full event is one click away.
function summarize({kind, data}) {
  switch (kind) {
    case "runner.status":
      return `runner ${data.runner_id.slice(0, 8)} → ${data.status}${data.error ? `: ${data.error}` : ""}`;
    case "instance.created":
      return `${data.instance.model_id} · ${data.instance.sharding} · ${data.instance.shards.length} rank(s)`;
    case "instance.deleted":
      return `${data.instance_id.slice(0, 8)}${data.reason ? `: ${data.reason}` : ""}`;
    case "task.created":
      return `${data.task.task_id.slice(0, 8)} on ${data.task.model_id}`;
    case "task.finished":
      return `${data.task_id.slice(0, 8)} ${data.status} (${data.finish_reason || "-"}), ${data.completion_tokens} tokens`;
    case "download.progress": {
      const p = data.progress;
      return `${p.model_id} on ${p.node_id.slice(0, 8)}: ${p.status} ${p.done_bytes}/${p.total_bytes} B`;
    }
    case "node.registered":
      return `${data.node.name || data.node.hostname || data.node.node_id} (${data.node.backend})`;
    case "command.rejected":
      return `${data.command_kind}: ${data.reason}`;
    default:
      return generic(data);
  }
}
