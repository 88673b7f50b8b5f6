// The Keys panel, for admins: the cluster's API keys (State's api_keys: hashed, never the secret)
// with what each may use, its limits and its usage today and this month (State's usage); creating
// one (POST /keys: its secret is shown here once, and never again) and deleting one.

import {json} from "./api.js";
import {confirmButton, h, replaceChildren} from "./util.js";

const LIMIT_NAMES = {
  requests_per_minute: "requests per minute", tokens_per_minute: "tokens per minute",
  concurrent_requests: "concurrent requests", tokens_per_day: "tokens per day", tokens_per_month: "tokens per month",
};

// Usage is counted by UTC day ("2026-12-05"), as exo/core/usage.py does.
export const utcDay = (at = new Date()) => at.toISOString().slice(0, 10);

// {requests, tokens} over usage rows ({day, requests, prompt_tokens, completion_tokens}) whose day starts with `prefix`.
export function usageSum(rows, prefix) {
  const sum = {requests: 0, tokens: 0};
  for (const row of rows) {
    if (!row.day.startsWith(prefix)) continue;
    sum.requests += row.requests;
    sum.tokens += row.prompt_tokens + row.completion_tokens;
  }
  return sum;
}

// The limits a key has (0: none), as [name, words, value].
export function limitsOf(key) {
  return Object.entries(LIMIT_NAMES).filter(([name]) => (key.limits || {})[name]).map(([name, words]) =>
    [name, words, key.limits[name]]);
}

const number = (n) => n.toLocaleString("en");

// State's usage of one key ({day: {model: counts}}) as /usage's rows.
function rowsOf(usage) {
  return Object.entries(usage || {}).flatMap(([day, models]) => Object.values(models).map((c) => ({day, ...c})));
}

export class KeysPanel {
  constructor(ctx) {
    this.ctx = ctx;
    this.table = document.getElementById("keys");
    this.secret = document.getElementById("key-secret");
    this.signature = null;
    document.getElementById("add-key-form").addEventListener("submit", (event) => this.add(event));
  }

  // Redrawn only when the keys or their usage changed: a redraw would disarm a Delete's "Sure?".
  render(state) {
    const keys = Object.values(state.api_keys || {}).sort((a, b) => a.key_id.localeCompare(b.key_id));
    const today = utcDay();
    const signature = JSON.stringify([today, keys, keys.map((k) => (state.usage || {})[k.key_id])]);
    if (signature === this.signature) return;
    this.signature = signature;
    if (!keys.length) {
      return replaceChildren(this.table, [h("p", {class: "empty"}, "No keys added: only the nodes' EXO_API_KEYS (or none).")]);
    }
    replaceChildren(this.table, [h("table", {class: "keys"},
      h("thead", {}, h("tr", {}, ["key", "may use", "limits", "today (UTC)", "this month", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, keys.map((key) => this.row(key, rowsOf((state.usage || {})[key.key_id]), today))))]);
  }

  row(key, rows, today) {
    const day = usageSum(rows, today);
    const month = usageSum(rows, today.slice(0, 7));
    const limits = limitsOf(key);
    return h("tr", {"data-key-id": key.key_id, "data-admin": key.admin ? "true" : "false"},
      h("td", {}, h("strong", {}, key.name || "(no name)"), h("div", {class: "small muted mono"}, key.key_id)),
      h("td", {}, key.admin ? h("span", {class: "tag master"}, "admin") : key.models.length ? key.models.join(", ") : "every model"),
      h("td", {class: "small"}, limits.length ? limits.map(([, words, value]) => `${number(value)} ${words}`).join(", ") : "none"),
      h("td", {"data-usage": "today", "data-requests": day.requests, "data-tokens": day.tokens},
        `${number(day.requests)} req · ${number(day.tokens)} tokens`),
      h("td", {"data-usage": "month"}, `${number(month.tokens)} tokens`),
      h("td", {}, confirmButton("Delete", () => this.remove(key.key_id), {"data-action": "delete-key"})));
  }

  async add(event) {
    event.preventDefault();
    const form = event.target;
    const patterns = form.elements["key-models"].value.split(/[\s,]+/).filter(Boolean);
    const limits = {};
    for (const name of ["requests_per_minute", "tokens_per_day"]) {
      const value = Number(form.elements[`key-${name}`].value || 0);
      if (value) limits[name] = value;
    }
    const body = {name: form.elements["key-name"].value.trim(), admin: form.elements["key-admin"].checked, models: patterns, limits};
    event.submitter.disabled = true;
    try {
      const added = await json("POST", "/keys", body);
      form.reset();
      this.showSecret(added.key, added.secret);
    } catch (error) {
      this.ctx.toast(`Creating the key failed: ${error.message}`);
    } finally {
      event.submitter.disabled = false;
    }
  }

  // The one time the secret exists outside its holder's hands: until dismissed, never redrawn from State.
  showSecret(key, secret) {
    this.secret.hidden = false;
    replaceChildren(this.secret, [
      h("p", {}, `The secret of ${key.name || key.key_id} (${key.key_id}), shown this once: copy it now.`),
      h("code", {class: "secret", "data-key-id": key.key_id}, secret), " ",
      h("button", {type: "button", class: "ghost small", onclick: () => { replaceChildren(this.secret, []); this.secret.hidden = true; }},
        "Done")]);
  }

  async remove(keyId) {
    try {
      await json("DELETE", `/keys/${encodeURIComponent(keyId)}`);
    } catch (error) {
      this.ctx.toast(`Deleting ${keyId} failed: ${error.message}`);
    }
  }
}
