// The chat panel: streams a reply from any model with an instance through
// /v1/chat/completions, shows time to first token and tokens per second, and can stop it.
// Models whose card says supports_images take images too (picked or pasted), sent as data: URLs.

import {errorMessage, json, readSse, request} from "./api.js";
import {h, replaceChildren} from "./util.js";
import {instanceStatus} from "./status.js";

const ABORT_AFTER_CANCEL_MS = 3000; // if the stream has not ended by then, drop it ourselves

// true: the card says the model embeds; null: its card is not known yet (it is offered as a chat model).
export function isEmbedding(card) {
  return card ? Boolean(card.embedding) : null;
}

// Chat models first (an embedding model is never the default), the ready ones first, then by id.
export function orderChoices(choices) {
  const rank = (c) => (c.embedding ? 2 : 0) + (c.status === "ready" ? 0 : 1);
  return [...choices].sort((a, b) => rank(a) - rank(b) || a.id.localeCompare(b.id));
}

function choiceLabel({id, status, embedding}) {
  if (embedding) return `${id} (embedding: not for chat)`;
  return status === "ready" ? id : `${id} (${status.replace("_", " ")})`;
}

export class Chat {
  constructor(ctx) {
    this.ctx = ctx;
    this.history = []; // the conversation so far, as the API takes it
    this.current = null; // the generation streaming now
    this.last = null; // the latest generation, for stats that arrive after it ended
    this.signature = null; // the model choices the select shows
    this.images = []; // data: URLs attached to the next message
    this.el = Object.fromEntries(["chat-form", "chat-model", "chat-max-tokens", "chat-temperature", "chat-system",
      "chat-log", "chat-input", "chat-send", "chat-stop", "chat-clear", "chat-stats", "chat-attach", "chat-files",
      "chat-images"].map((id) => [id, document.getElementById(id)]));
    this.el["chat-form"].addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    this.el["chat-input"].addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); this.send(); }
    });
    this.el["chat-stop"].addEventListener("click", () => this.stop());
    this.el["chat-clear"].addEventListener("click", () => this.clear());
    this.el["chat-model"].addEventListener("change", () => this.showAttach());
    this.el["chat-attach"].addEventListener("click", () => this.el["chat-files"].click());
    this.el["chat-files"].addEventListener("change", (event) => { this.attach(event.target.files); event.target.value = ""; });
    this.el["chat-input"].addEventListener("paste", (event) => this.attach(event.clipboardData.files));
  }

  // Images only for a model whose card takes them; choosing another model drops those attached.
  showAttach() {
    const card = this.ctx.card(this.el["chat-model"].value);
    const takes = Boolean(card && card.supports_images);
    this.el["chat-attach"].hidden = this.el["chat-attach"].disabled = this.el["chat-files"].disabled = !takes;
    if (!takes && this.images.length) this.setImages([]);
    return takes;
  }

  attach(files) {
    const images = [...files].filter((file) => file.type.startsWith("image/"));
    if (!images.length || !this.showAttach()) return this.attaching;
    const reading = Promise.all(images.map((file) => new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result); // data:<mime>;base64,...
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    }))).catch((error) => { this.ctx.toast(`Could not read the image: ${error.message}`); return []; });
    // Added in the order they were picked or pasted, however long each takes to read.
    this.attaching = (this.attaching || Promise.resolve()).then(() => reading)
      .then((urls) => this.setImages([...this.images, ...urls]));
    return this.attaching;
  }

  setImages(urls) {
    this.images = urls;
    replaceChildren(this.el["chat-images"], urls.map((url, i) => h("div", {class: "thumb"},
      h("img", {src: url, alt: `image ${i + 1}`}),
      h("button", {type: "button", title: "Remove", "aria-label": `remove image ${i + 1}`,
                   onclick: () => this.setImages(urls.filter((_, j) => j !== i))}, "×"))));
  }

  // The models with an instance that serves or will: a failed or stopped one is the instances panel's.
  update(state) {
    const best = new Map();
    for (const instance of Object.values(state.instances)) {
      const status = instanceStatus(instance, state);
      if (status === "failed" || status === "stopped") continue;
      if (best.get(instance.model_id) !== "ready") best.set(instance.model_id, status);
    }
    this.offer([...best].map(([id, status]) => ({id, status, embedding: isEmbedding(this.ctx.card(id))})));
  }

  // `choices`: [{id, status, embedding}]. Embedding models are listed but cannot be chosen: they do not chat.
  offer(choices, empty = "no running model: place one") {
    const select = this.el["chat-model"];
    const ordered = orderChoices(choices);
    const chattable = ordered.filter((c) => !c.embedding).map((c) => c.id);
    // Rebuilt only when the choice changes: rebuilding closes a list the user has open.
    const signature = ordered.map((c) => `${c.id}=${c.status}=${c.embedding}`).join("\n");
    this.el["chat-send"].disabled = Boolean(this.current) || !chattable.length;
    if (signature === this.signature) return;
    this.signature = signature;
    const chosen = select.value;
    const none = chattable.length ? [] : [h("option", {value: ""}, ordered.length ? "no chat model running" : empty)];
    replaceChildren(select, [...none, ...ordered.map((c) => h("option", {
      value: c.id, "data-status": c.status, "data-embedding": c.embedding ? "true" : "false", disabled: c.embedding},
    choiceLabel(c)))]);
    select.value = chattable.includes(chosen) ? chosen : chattable[0] ?? "";
    this.showAttach();
  }

  clear() {
    if (this.current) return;
    this.history = [];
    replaceChildren(this.el["chat-log"], []);
    this.el["chat-stats"].textContent = "";
  }

  body(content) {
    const system = this.el["chat-system"].value.trim();
    const messages = [...(system ? [{role: "system", content: system}] : []), ...this.history, {role: "user", content}];
    const body = {model: this.el["chat-model"].value, messages, stream: true, stream_options: {include_usage: true}};
    const maxTokens = this.el["chat-max-tokens"].value.trim();
    const temperature = this.el["chat-temperature"].value.trim();
    if (maxTokens) body.max_tokens = Number(maxTokens);
    if (temperature) body.temperature = Number(temperature);
    return body;
  }

  async send() {
    const text = this.el["chat-input"].value;
    const images = this.images;
    if (this.current || (!text.trim() && !images.length) || !this.el["chat-model"].value) return;
    // Images go as content parts after the text; earlier turns' images are sent again with the history.
    const content = !images.length ? text : [...(text.trim() ? [{type: "text", text}] : []),
      ...images.map((url) => ({type: "image_url", image_url: {url}}))];
    const body = this.body(content);
    this.el["chat-input"].value = "";
    this.setImages([]);
    this.history.push({role: "user", content});
    const reply = document.createTextNode("");
    const meta = h("div", {class: "meta small muted"}, "waiting for the first token…");
    const message = h("div", {class: "msg assistant", "data-streaming": "true"},
      h("div", {class: "role small"}, body.model), h("div", {class: "text"}, reply), meta);
    const thumbs = images.length ? h("div", {class: "thumbs"}, images.map((url, i) => h("img", {src: url, alt: `image ${i + 1}`}))) : null;
    this.el["chat-log"].append(h("div", {class: "msg user"}, text.trim() ? h("div", {class: "text"}, text) : null, thumbs), message);
    const g = {controller: new AbortController(), started: performance.now(), firstAt: null, lastAt: null, pieces: 0,
               tokens: null, commandId: null, finish: null, error: null, stopped: false, text: reply, message, meta};
    this.current = this.last = g;
    this.setBusy(true);
    try {
      await this.stream(g, body);
    } catch (error) {
      if (!g.stopped) g.error = error.message;
    } finally {
      clearTimeout(g.abortTimer);
      if (g.stopped && !g.finish) g.finish = "cancelled";
      this.history.push({role: "assistant", content: reply.data});
      message.dataset.streaming = "false";
      message.dataset.finish = g.finish || "error";
      if (g.error) message.append(h("div", {class: "error small"}, g.error));
      this.current = null;
      this.setBusy(false);
      this.showStats(g);
      this.scroll();
      this.ctx.replied?.(); // a key's page shows its usage again
    }
  }

  async stream(g, body) {
    const response = await request("POST", "/v1/chat/completions", body, {signal: g.controller.signal});
    if (!response.ok) {
      const data = await response.json().catch(() => null);
      throw new Error(errorMessage(data) || `${response.status} ${response.statusText}`);
    }
    for await (const event of readSse(response)) {
      if (event.data === "[DONE]") break;
      const chunk = JSON.parse(event.data);
      if (chunk.error) { // the stream's way of saying the generation ended badly or was stopped
        g.finish = chunk.error.code || "error";
        if (g.finish !== "cancelled") g.error = chunk.error.message;
        continue;
      }
      if (!g.commandId && chunk.id) {
        g.commandId = chunk.id.replace(/^chatcmpl-/, "");
        g.message.dataset.commandId = g.commandId;
      }
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          const now = performance.now();
          g.firstAt ??= now;
          g.lastAt = now;
          g.pieces += 1;
          g.text.appendData(piece);
        }
        if (choice.finish_reason) g.finish = choice.finish_reason;
      }
      if (chunk.usage) g.tokens = chunk.usage.completion_tokens;
      this.showStats(g);
      this.scroll();
    }
  }

  async stop() {
    const g = this.current;
    if (!g || g.stopped) return;
    g.stopped = true;
    this.el["chat-stop"].disabled = true;
    g.abortTimer = setTimeout(() => g.controller.abort(), ABORT_AFTER_CANCEL_MS);
    if (!g.commandId) return g.controller.abort(); // nothing to name yet: dropping the stream cancels it
    try {
      await json("POST", `/v1/cancel/${g.commandId}`);
    } catch (error) {
      g.controller.abort();
      this.ctx.toast(`Stopping failed: ${error.message}`);
    }
  }

  // A stopped stream has no usage chunk: its task's count arrives with task.finished.
  taskFinished(data) {
    const g = this.last;
    if (g && g.commandId === data.task_id && g.tokens === null) {
      g.tokens = data.completion_tokens;
      this.showStats(g);
    }
  }

  showStats(g) {
    const ttft = g.firstAt === null ? null : g.firstAt - g.started;
    const tokens = g.tokens ?? g.pieces;
    const seconds = g.firstAt === null ? 0 : ((this.current === g ? performance.now() : g.lastAt) - g.firstAt) / 1000;
    // The first token's time is TTFT; the rate is over the tokens after it.
    const rate = seconds > 0 && tokens > 1 ? (tokens - 1) / seconds : null;
    const parts = [ttft === null ? "waiting for the first token…" : `TTFT ${Math.round(ttft)} ms`];
    if (rate !== null) parts.push(`${rate.toFixed(1)} tok/s`);
    if (g.firstAt !== null) parts.push(`${g.tokens === null ? "~" : ""}${tokens} tokens`); // ~: counted from chunks
    if (g.finish) parts.push(g.finish === "cancelled" ? "stopped" : g.finish);
    const line = parts.join(" · ");
    g.meta.textContent = line;
    if (ttft !== null) g.message.dataset.ttftMs = String(Math.round(ttft));
    if (rate !== null) g.message.dataset.tokensPerS = rate.toFixed(2);
    this.el["chat-stats"].textContent = line;
  }

  setBusy(busy) {
    this.el["chat-send"].disabled = busy || !this.el["chat-model"].value;
    this.el["chat-stop"].disabled = !busy;
    this.el["chat-clear"].disabled = busy;
  }

  scroll() {
    const log = this.el["chat-log"];
    log.scrollTop = log.scrollHeight;
  }
}
