// Talking to the exo API: the API key, JSON requests, and server-sent events read with fetch.
//
// EventSource cannot send an Authorization header, so both the event log and chat streams are
// read with fetch and parsed here; that also lets a chat stream be stopped by aborting it.

const KEY_STORE = "exo.apiKey";
let pendingKey = null; // one dialog for every request that got 401 at the same time

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const hasKey = () => Boolean(localStorage.getItem(KEY_STORE));

function headers(body) {
  const out = {};
  const key = localStorage.getItem(KEY_STORE);
  if (key) out.Authorization = `Bearer ${key}`;
  if (body !== undefined) out["Content-Type"] = "application/json";
  return out;
}

// fetch with the key; on 401 ask for a key (once, however many requests failed) and try again.
export async function request(method, path, body, {signal} = {}) {
  for (;;) {
    const response = await fetch(path, {method, headers: headers(body), signal, cache: "no-store",
                                        body: body === undefined ? undefined : JSON.stringify(body)});
    if (response.status !== 401) return response;
    await askForKey(hasKey() ? "That key was refused. Enter another:" : "This exo API needs a key.");
  }
}

export async function json(method, path, body) {
  const response = await request(method, path, body);
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, errorMessage(data) || `${response.status} ${response.statusText}`);
  return data;
}

export function errorMessage(data) {
  const error = data && data.error;
  return typeof error === "string" ? error : error && error.message;
}

export function askForKey(message = "Enter the API key for this exo cluster:") {
  if (pendingKey) return pendingKey;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message;
  input.value = "";
  pendingKey = new Promise((resolve) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_STORE, input.value.trim());
      dialog.close();
      pendingKey = null;
      resolve();
    }, {once: true});
  });
  // Escape would close the dialog with the requests still waiting on it: the key is needed.
  dialog.addEventListener("cancel", (event) => event.preventDefault(), {once: true});
  dialog.showModal();
  input.focus();
  return pendingKey;
}

export function forgetKey() {
  localStorage.removeItem(KEY_STORE);
}

// The events of a text/event-stream response, as {id, event, data} objects, until it ends.
export async function* readSse(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = blank();
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (event.data.length) yield {id: event.id, event: event.event, data: event.data.join("\n")};
          event = blank();
        } else if (!line.startsWith(":")) {
          field(event, line);
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function blank() {
  return {id: null, event: "message", data: []};
}

function field(event, line) {
  const colon = line.indexOf(":");
  const name = colon < 0 ? line : line.slice(0, colon);
  const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
  if (name === "data") event.data.push(value);
  else if (name === "id") event.id = value;
  else if (name === "event") event.event = value;
}
