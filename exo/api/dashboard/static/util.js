// Small helpers shared by every panel: building DOM nodes and formatting numbers.

// h("div", {class: "x", "data-id": id, onclick: f}, child, ...): children are nodes or text.
// Text always goes in as text nodes, never as HTML, so ids and model output cannot inject markup.
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else if (name === "style" && typeof value === "object") Object.assign(node.style, value);
    else if (name in node && typeof value !== "string") node[name] = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else node.append(child instanceof Node ? child : String(child));
  }
}

export function replaceChildren(node, children) {
  node.replaceChildren();
  append(node, children);
}

const UNITS = ["B", "KB", "MB", "GB", "TB"];

export function bytes(n) {
  if (!Number.isFinite(n) || n <= 0) return "0 B";
  const power = Math.min(UNITS.length - 1, Math.floor(Math.log(n) / Math.log(1000)));
  const value = n / 1000 ** power;
  return `${value >= 100 || power === 0 ? value.toFixed(0) : value.toFixed(1)} ${UNITS[power]}`;
}

export function duration(seconds) {
  if (!Number.isFinite(seconds) || seconds < 0) return "?";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

export const short = (id) => (id || "").slice(0, 8);

export const percent = (part, whole) => (whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0);

// A bar of `fraction` percent, labelled for screen readers.
export function bar(fraction, label, kind = "") {
  return h("div", {class: `bar ${kind}`, role: "progressbar", "aria-valuenow": fraction.toFixed(0),
                   "aria-valuemin": "0", "aria-valuemax": "100", "aria-label": label},
           h("div", {class: "fill", style: {width: `${fraction}%`}}));
}

// Calls fn once things go quiet for `wait` ms, but at least every `maxWait` ms while they do not:
// a burst of events costs one /state fetch, and a steady stream still refreshes the page.
export function debounce(fn, wait, maxWait) {
  let timer = null;
  let first = 0;
  return () => {
    const now = performance.now();
    if (timer === null) first = now;
    clearTimeout(timer);
    const delay = Math.max(0, Math.min(wait, first + maxWait - now));
    timer = setTimeout(() => { timer = null; fn(); }, delay);
  };
}

// A button that asks "sure?" on its first click and acts on the second within a few seconds,
// so nothing is deleted by a stray tap (and no blocking confirm() dialog).
export function confirmButton(label, action, attrs = {}) {
  let armed = null;
  const button = h("button", {type: "button", class: "danger", ...attrs}, label);
  button.addEventListener("click", async () => {
    if (armed === null) {
      button.textContent = "Sure?";
      button.classList.add("armed");
      armed = setTimeout(() => { armed = null; button.textContent = label; button.classList.remove("armed"); }, 4000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    button.disabled = true;
    button.textContent = "…";
    try {
      await action();
    } finally {
      button.disabled = false;
      button.textContent = label;
      button.classList.remove("armed");
    }
  });
  return button;
}
