// The page's copy of State, kept current from GET /events.
//
// Most events change State in ways the server's reducer knows best, so they make the page
// fetch /state again, debounced: a burst of events costs one fetch. The two kinds that come
// often (task events, one per request step, and download progress, about once a second per
// model) carry everything needed, so they are applied here directly instead.

import {json, readSse, request} from "./api.js";
import {debounce} from "./util.js";

const HISTORY = 200; // events shown from before the page opened
const KEEP_FINISHED_TASKS = 200; // the page needs recent ones only (chat stats, queue depth)
const RETRY_MS = [500, 1000, 2000, 5000];

export class Live {
  constructor({onState, onEvent, onLive, onConnection}) {
    this.onState = onState;
    this.onEvent = onEvent;
    this.onLive = onLive; // events newer than State: what happens now, not history
    this.onConnection = onConnection;
    this.state = null;
    this.lastSeq = null; // the last event received from /events
    this.refreshSoon = debounce(() => this.refresh(), 250, 1000);
  }

  async start() {
    await this.refresh();
    this.follow();
  }

  async refresh() {
    try {
      this.state = await json("GET", "/state");
      this.onState(this.state);
    } catch (error) {
      this.onConnection("error", error.message);
    }
  }

  async follow() {
    for (let attempt = 0; ; attempt++) {
      const since = this.lastSeq ?? Math.max(0, (this.state ? this.state.last_seq : 0) - HISTORY);
      try {
        const response = await request("GET", `/events?since=${since}`);
        if (response.status === 410) { // the log no longer reaches back that far: start from now
          this.lastSeq = this.state ? this.state.last_seq : 0;
          continue;
        }
        if (!response.ok) throw new Error(`/events answered ${response.status}`);
        this.onConnection("live");
        if (attempt > 0) this.refresh(); // events may have been missed while away
        attempt = 0;
        for await (const message of readSse(response)) this.receive(message);
        throw new Error("the event stream ended");
      } catch (error) {
        this.onConnection("reconnecting", error.message);
        await new Promise((resolve) => setTimeout(resolve, RETRY_MS[Math.min(attempt, RETRY_MS.length - 1)]));
      }
    }
  }

  receive(message) {
    const seq = Number(message.id);
    let data;
    try {
      data = JSON.parse(message.data);
    } catch {
      data = {reason: message.data};
    }
    this.lastSeq = seq;
    const event = {seq, kind: message.event, data};
    this.onEvent(event);
    if (!this.state || seq <= this.state.last_seq) return; // history: already in State
    this.onLive(event);
    if (this.applyHere(event)) {
      this.state.last_seq = seq;
      this.onState(this.state);
    } else {
      this.refreshSoon();
    }
  }

  // Applies the frequent events that carry all they change; false means "fetch /state".
  applyHere({kind, data}) {
    const tasks = this.state.tasks;
    const task = tasks[data.task_id];
    switch (kind) {
      case "download.progress": {
        const p = data.progress;
        this.state.downloads ??= {};
        (this.state.downloads[p.node_id] ??= {})[p.model_id] = p;
        return true;
      }
      case "node.heartbeat": // every few seconds per node: never worth a /state fetch
      case "node.registered":
        (this.state.nodes ??= {})[data.node.node_id] = data.node;
        return true;
      case "task.created":
        tasks[data.task.task_id] = data.task;
        return true;
      case "task.started":
        if (!task || !ofCurrentRun(task, data)) return false; // an earlier run's (a paused node): the server skipped it
        task.status = "running";
        return true;
      case "task.cancel_requested":
        if (task) task.cancel_requested = true;
        return Boolean(task);
      case "task.finished":
        if (!task || (!data.term && !ofCurrentRun(task, data))) return false;
        Object.assign(task, {status: data.status, finish_reason: data.finish_reason, error: data.error,
                             prompt_tokens: data.prompt_tokens, completion_tokens: data.completion_tokens});
        trimFinished(tasks);
        return true;
      default:
        return false;
    }
  }
}

// A task moved to another instance (a migration) starts a new run; workers speak for the current one.
function ofCurrentRun(task, data) {
  return (data.attempt ?? 0) === (task.migrations ?? []).length;
}

function trimFinished(tasks) {
  const finished = Object.values(tasks).filter((t) => t.status !== "pending" && t.status !== "running");
  finished.sort((a, b) => a.created_at - b.created_at);
  for (const task of finished.slice(0, Math.max(0, finished.length - KEEP_FINISHED_TASKS))) delete tasks[task.task_id];
}
