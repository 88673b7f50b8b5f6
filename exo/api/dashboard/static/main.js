// Wires the panels to the live State: every State change redraws the panels from it, every
// event goes to the feed. A key without admin cannot read State: its page is the chat and its own
// usage (account.js), and the admin panels stay hidden.

import {Account} from "./account.js";
import {askForKey, forgetKey, json} from "./api.js";
import {Troubles, renderBanner, watchHealth} from "./banner.js";
import {Chat} from "./chat.js";
import {renderNodes} from "./cluster.js";
import {renderDownloads} from "./downloads.js";
import {renderReplicas} from "./replicas.js";
import {EventFeed} from "./events.js";
import {History} from "./history.js";
import {renderInstances} from "./instances.js";
import {KeysPanel} from "./keys.js";
import {Live} from "./live.js";
import {Models} from "./models.js";
import {Rates} from "./rates.js";
import {h} from "./util.js";

const AGES_EVERY_MS = 5000; // "heard 12 s ago" is redrawn locally; nothing is fetched for it

const troubles = new Troubles();
const ctx = {
  nodeId: null,
  troubles,
  connected: false,
  state: () => live.state,
  rates: new Rates(),
  card: (id) => (live.state && live.state.custom_model_cards[id]) || models.cards.get(id), // built-in: once fetched
  toast,
};
const feed = new EventFeed();
const models = new Models(ctx);
const chat = new Chat(ctx);
const keys = new KeysPanel(ctx);
const live = new Live({onState: render, onEvent, onLive, onConnection});

function render(state) {
  drawTroubles();
  renderReplicas(document.getElementById("replicas"), state);
  renderInstances(document.getElementById("instances"), state, ctx);
  renderDownloads(document.getElementById("downloads"), state);
  keys.render(state);
  // A built-in card may arrive after the chat drew: whether the model takes images, or embeds.
  models.update(state).then(() => { chat.update(live.state); chat.showAttach(); });
  chat.update(state);
  document.getElementById("seq").textContent = `seq ${state.last_seq}`;
  document.getElementById("seq").title = "the last event folded into this State (exo replay --until takes it)";
}

// The banner and the node cards: what State shows, and what the page knows is wrong.
function drawTroubles() {
  renderBanner(document.getElementById("banner"), live.state, troubles, ctx.nodeId);
  if (live.state) renderNodes(document.getElementById("nodes"), live.state, ctx);
}

function onEvent(event) {
  troubles.noteEvent(event, live.state, Boolean(live.state) && event.seq > live.state.last_seq);
  feed.add(event);
  if (event.kind === "task.finished") chat.taskFinished(event.data);
}

// Times the tasks that start and finish while the page watches (tokens per second per instance).
function onLive({kind, data}) {
  if (kind === "task.started") ctx.rates.start(data.task_id);
  const task = kind === "task.finished" && live.state.tasks[data.task_id];
  if (task) ctx.rates.finish(task, data.completion_tokens, data.generation_s);
}

function onConnection(status, detail) {
  ctx.connected = status === "live";
  const badge = document.getElementById("conn");
  badge.dataset.state = status;
  badge.textContent = status === "live" ? "live" : status === "reconnecting" ? "reconnecting…" : "error";
  badge.title = detail || "following /events";
  troubles.connection = {status, detail};
  drawTroubles();
}

function toast(message, kind = "error") {
  const note = h("div", {class: `toast ${kind}`, role: "status"}, message);
  document.getElementById("toasts").append(note);
  setTimeout(() => note.remove(), 6000);
}

document.getElementById("key-button").addEventListener("click", async () => {
  forgetKey();
  await askForKey("Enter the API key for this exo cluster:");
  location.reload(); // another key may be another role: the page starts again with it
});

// The sticky header is one line on a laptop and several on a phone: panels reached by the jump
// links, and the chat, stop below it whatever its height.
const header = document.querySelector(".topbar");
new ResizeObserver(() => {
  document.documentElement.style.setProperty("--header-height", `${header.offsetHeight}px`);
}).observe(header);

// GET /usage answers every key (its own usage, every key's for an admin) and says who asks: no
// request is made that the key's role would refuse.
const usage = await json("GET", "/usage").catch(() => null);
const admin = !usage || !usage.caller || usage.caller.admin;
document.body.dataset.role = admin ? "admin" : "user";
if (admin) {
  setInterval(drawTroubles, AGES_EVERY_MS); // ages, and a suspect mark that fades
  watchHealth(troubles, drawTroubles);
  ctx.nodeId = await json("GET", "/node_id").catch(() => null);
  live.start();
  new History(document.getElementById("history")).start();
} else {
  new Account(ctx, chat, models.cards).start(usage);
}
