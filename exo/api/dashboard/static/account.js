// The page of a key without admin: the chat, over the models the key may use that run or are
// downloaded somewhere (GET /v1/models), and the key's own limits and usage (GET /usage). Such a
// key gets 403 on /state and /events, so this page never asks them: it asks these two again every
// REFRESH_MS while visible, when it becomes visible, and after each reply.

import {json} from "./api.js";
import {isEmbedding} from "./chat.js";
import {limitsOf, usageSum, utcDay} from "./keys.js";
import {h, replaceChildren} from "./util.js";

const REFRESH_MS = 10_000;

const number = (n) => n.toLocaleString("en");

// The models the chat offers, from /v1/models' entries: ready on a node, else downloaded on one
// (the first request loads it).
export function modelChoices(entries, cards) {
  return entries.filter((m) => m.ready_on.length || m.downloaded_on.length).map((m) => ({
    id: m.id, status: m.ready_on.length ? "ready" : "downloaded", embedding: isEmbedding(cards.get(m.id)),
  }));
}

export class Account {
  constructor(ctx, chat, cards) {
    this.ctx = ctx;
    this.chat = chat;
    this.cards = cards; // model id -> card, shared with the chat's ctx.card
    this.panel = document.getElementById("account");
    ctx.replied = () => this.refresh();
  }

  start(usage) {
    this.render(usage);
    this.refresh();
    setInterval(() => this.refresh(), REFRESH_MS);
    document.addEventListener("visibilitychange", () => this.refresh());
  }

  async refresh() {
    if (document.visibilityState !== "visible") return;
    try {
      const [usage, models] = await Promise.all([json("GET", "/usage"), json("GET", "/v1/models")]);
      const offered = models.data.filter((m) => m.ready_on.length || m.downloaded_on.length);
      await Promise.all(offered.filter((m) => !this.cards.has(m.id)).map(async (m) => {
        const model = await json("GET", `/v1/models/${m.id}`).catch(() => null);
        if (model) this.cards.set(m.id, model.card);
      }));
      this.chat.offer(modelChoices(models.data, this.cards), "no running model: ask an admin to place one");
      this.chat.showAttach();
      this.render(usage);
    } catch (error) {
      this.ctx.toast(`Could not read your usage or the models: ${error.message}`);
    }
  }

  // Who the key is, what it may use, its limits, and its usage today and this month against them.
  render({data, caller}) {
    const key = caller.key || {key_id: "", name: "", models: [], limits: {}, priority: "interactive"};
    const today = utcDay();
    const day = usageSum(data, today);
    const month = usageSum(data, today.slice(0, 7));
    const limits = limitsOf(key);
    const limitOf = (name) => (key.limits || {})[name] || 0;
    replaceChildren(this.panel, [
      h("p", {}, h("strong", {}, key.name || "(no name)"), " ", h("span", {class: "small muted mono"}, key.key_id),
        " · ", key.models.length ? `may use ${key.models.join(", ")}` : "may use every model", ` · ${key.priority}`),
      h("p", {"data-usage": "today", "data-requests": day.requests, "data-tokens": day.tokens},
        `Today (UTC ${today}): ${number(day.requests)} requests, ${number(day.tokens)} tokens`,
        limitOf("tokens_per_day") ? ` of ${number(limitOf("tokens_per_day"))} a day` : ""),
      h("p", {"data-usage": "month", "data-tokens": month.tokens},
        `This month: ${number(month.tokens)} tokens`,
        limitOf("tokens_per_month") ? ` of ${number(limitOf("tokens_per_month"))} a month` : ""),
      h("ul", {class: "small limits"}, limits.length
        ? limits.map(([name, words, value]) => h("li", {"data-limit": name}, `${words}: ${number(value)}`))
        : h("li", {"data-limit": ""}, "no limits"))]);
  }
}
