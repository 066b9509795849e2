// The chat page: a conversation kept in localStorage, replies streamed from this server's
// /v1/chat/completions (SSE), and a HUD that polls /v1/stats. No other origin is contacted.
"use strict";

(function () {
  const md = window.mferenceMarkdown;
  const $ = (id) => document.getElementById(id);
  const STORE = "mference.chat.v1";
  const DEFAULTS = { system: "", temperature: 0.2, top_p: 0.95, top_k: 64, max_tokens: 1024, seed: "", thinking: false };
  const SETTINGS = ["temperature", "top_p", "top_k", "max_tokens", "seed"];

  // { messages: [{ role, content, reasoning?, stopped?, error?, summary? }], settings: {...} }
  let state = load();
  let modelId = null;
  let streaming = null; // { controller, id, message }
  let stats = null;
  // The id of this page's latest finished request: the HUD's "this reply" column shows the
  // server's figures only for this page's own requests (not another client's).
  let lastId = null;
  let storageFull = false;

  function load() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE) || "null");
      if (s && Array.isArray(s.messages)) {
        s.settings = Object.assign({}, DEFAULTS, s.settings || {});
        // A reply that was streaming when the page went away ended there.
        for (const m of s.messages) {
          if (m.pending) { delete m.pending; m.stopped = true; }
        }
        return s;
      }
    } catch (_) { /* a damaged entry starts a new conversation */ }
    return { messages: [], settings: Object.assign({}, DEFAULTS) };
  }

  // Keeps the conversation; when the browser's storage is full it says so once and goes on in
  // memory (nothing typed or streamed is dropped).
  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
      storageFull = false;
    } catch (e) {
      if (!storageFull) {
        storageFull = true;
        notice("The browser's storage is full (" + (e.name || e) + "): this conversation is no " +
          "longer saved across reloads. Clear frees it.");
      }
    }
  }

  function notice(text) {
    let n = $("notice");
    if (!n) {
      n = document.createElement("p");
      n.id = "notice";
      n.className = "notice";
      $("chat").insertBefore(n, $("composer"));
    }
    n.textContent = text;
  }

  // Another tab of this page changed the stored conversation: take it over unless this tab is
  // streaming (its own save then wins, and the other tab follows).
  window.addEventListener("storage", (e) => {
    if (e.key !== STORE || streaming) return;
    state = load();
    showSettings();
    renderMessages();
  });

  // ---- reasoning ---------------------------------------------------------------------------
  // The server sends a reply's reasoning apart (`reasoning_content`). Replies stored before it
  // did carry it in their content: Gemma 4's `<|channel>thought … <channel|>` block, Qwen 3.6's
  // `<think> … </think>`; those are split here.
  const REASONING = [["<|channel>thought", "<channel|>"], ["<think>", "</think>"]];

  function splitReasoning(text) {
    const t = text.replace(/^\s+/, "");
    for (const [open, close] of REASONING) {
      if (t.startsWith(open)) {
        const rest = t.slice(open.length);
        const at = rest.indexOf(close);
        if (at < 0) return { reasoning: rest.trim(), open: true, answer: "" };
        return { reasoning: rest.slice(0, at).trim(), open: false,
          answer: rest.slice(at + close.length).replace(/^\n+/, "") };
      }
    }
    // A template that opens the block itself leaves only the close marker in the reply.
    const close = text.indexOf("</think>");
    if (close >= 0 && text.indexOf("<think>") < 0) {
      return { reasoning: text.slice(0, close).trim(), open: false,
        answer: text.slice(close + 8).replace(/^\n+/, "") };
    }
    return { reasoning: null, open: false, answer: text };
  }

  // ---- rendering ---------------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function copyText(text, button) {
    const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1200); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text, done));
    } else {
      fallbackCopy(text, done);
    }
  }

  function fallbackCopy(text, done) {
    const ta = el("textarea");
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    try { document.execCommand("copy"); done(); } finally { ta.remove(); }
  }

  function fillBody(body, m) {
    body.textContent = "";
    if (m.role !== "assistant") {
      body.innerHTML = md.render(m.content);
      return;
    }
    const r = typeof m.reasoning === "string"
      ? { reasoning: m.reasoning, open: m.pending && !m.content, answer: m.content }
      : splitReasoning(m.content);
    if (r.reasoning !== null && r.reasoning !== "") {
      const d = el("details", "reasoning");
      d.appendChild(el("summary", null, r.open ? "Reasoning…" : "Reasoning"));
      d.appendChild(el("div", "thought", r.reasoning));
      body.appendChild(d);
    }
    const answer = el("div", "answer");
    answer.innerHTML = md.render(r.answer);
    for (const pre of answer.querySelectorAll("pre")) {
      const b = el("button", "small copy-code", "copy");
      b.type = "button";
      b.addEventListener("click", () => copyText(pre.querySelector("code").textContent, b));
      pre.prepend(b);
    }
    body.appendChild(answer);
  }

  function footText(m) {
    const parts = [];
    if (m.summary) {
      const s = m.summary;
      parts.push(s.prompt_tokens + " prompt (" + s.cached_tokens + " cached)");
      if (s.completion_tokens !== null) parts.push(s.completion_tokens + " tokens");
      if (s.ttft_s !== null) parts.push("TTFT " + fmt.secs(s.ttft_s));
      if (s.decode_tps !== null) parts.push(fmt.rate(s.decode_tps));
      if (s.finish_reason) parts.push(s.finish_reason);
    }
    if (m.stopped) parts.push("stopped");
    return parts.join(" · ");
  }

  function messageNode(m, i) {
    const node = el("div", "msg " + m.role);
    node.dataset.index = String(i);
    node.dataset.role = m.role;
    const meta = el("div", "meta");
    meta.appendChild(el("span", "role", m.role));
    const copy = el("button", "small copy", "copy");
    copy.type = "button";
    copy.addEventListener("click", () => copyText(m.content, copy));
    meta.appendChild(copy);
    node.appendChild(meta);
    const body = el("div", "body");
    fillBody(body, m);
    node.appendChild(body);
    if (m.error) node.appendChild(el("div", "error", m.error));
    const foot = footText(m);
    if (foot) node.appendChild(el("div", "foot" + (m.stopped ? " stopped" : ""), foot));
    return node;
  }

  function renderMessages() {
    const box = $("messages");
    box.textContent = "";
    state.messages.forEach((m, i) => box.appendChild(messageNode(m, i)));
    $("empty").hidden = state.messages.length > 0;
    box.scrollTop = box.scrollHeight;
  }

  // Re-renders only the streaming reply (at most once per frame).
  let frame = 0;
  function renderStreaming() {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      if (!streaming) return;
      const box = $("messages");
      const node = box.lastElementChild;
      if (!node) return;
      const body = node.querySelector(".body");
      fillBody(body, streaming.message);
      body.classList.add("streaming");
      box.scrollTop = box.scrollHeight;
    });
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("regenerate").disabled = busy;
    $("clear").disabled = busy;
    $("stop").hidden = !busy;
  }

  // ---- settings ----------------------------------------------------------------------------
  function readSettings() {
    const s = state.settings;
    s.system = $("system").value;
    s.thinking = $("thinking").checked;
    for (const k of SETTINGS) s[k] = $(k).value;
    save();
  }

  function showSettings() {
    $("system").value = state.settings.system;
    $("thinking").checked = !!state.settings.thinking;
    for (const k of SETTINGS) $(k).value = state.settings[k];
  }

  function requestBody() {
    const s = state.settings;
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of state.messages) {
      if (m.pending || (m.error && !m.content)) continue;
      messages.push({ role: m.role, content: m.content });
    }
    const body = { model: modelId, messages, stream: true, stream_options: { include_usage: true } };
    // Thinking off is the server's default; the template variable is sent only to turn it on.
    if (s.thinking) body.chat_template_kwargs = { enable_thinking: true };
    // The value as typed, or a refusal that names the field: never a silently different number.
    const num = (k, whole) => {
      if ($(k).validity && $(k).validity.badInput) throw new Error(k + ": not a number");
      const v = String(s[k]).trim();
      if (v === "") return;
      const x = Number(v);
      if (!Number.isFinite(x)) throw new Error(k + ": not a number: " + v);
      if (whole && !(Number.isInteger(x) && Number.isSafeInteger(x))) {
        throw new Error(k + ": must be a whole number below 2^53, got " + v);
      }
      body[k] = x;
    };
    num("temperature", false);
    num("top_p", false);
    num("top_k", true);
    num("max_tokens", true);
    num("seed", true);
    return body;
  }

  // ---- streaming ---------------------------------------------------------------------------
  // A request that cannot reach the server fails with the browser's bare "Failed to fetch" or
  // "network error"; say what it means instead.
  const UNREACHABLE = "The server is unreachable (it may have stopped or restarted). " +
    "The conversation is kept: send again when it is back.";

  async function reach(promise) {
    try {
      return await promise;
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new Error(UNREACHABLE);
    }
  }

  async function generate() {
    readSettings();
    const message = { role: "assistant", content: "", pending: true };
    state.messages.push(message);
    save();
    renderMessages();
    const controller = new AbortController();
    streaming = { controller, id: null, message };
    setBusy(true);
    poll();
    try {
      const body = JSON.stringify(requestBody());
      const resp = await reach(fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body,
        signal: controller.signal,
      }));
      if (!resp.ok) {
        const e = await resp.json().catch(() => null);
        throw new Error((e && e.error && e.error.message) || ("HTTP " + resp.status));
      }
      await readEvents(resp.body.getReader(), message);
    } catch (e) {
      if (e.name === "AbortError") message.stopped = true;
      else message.error = String(e.message || e);
    }
    delete message.pending;
    const id = streaming.id;
    lastId = id;
    streaming = null;
    setBusy(false);
    save();
    renderMessages();
    await summarize(message, id);
  }

  async function readEvents(reader, message) {
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reach(reader.read());
      if (done) return;
      buf += dec.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, at);
        buf = buf.slice(at + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue; // `: ping` comments
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.id && !streaming.id) {
            streaming.id = chunk.id;
            poll(); // the HUD switches to this reply now rather than at the next tick
          }
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.reasoning_content) {
            message.reasoning = (message.reasoning || "") + delta.reasoning_content;
            save();
            renderStreaming();
          }
          if (delta && delta.content) {
            message.content += delta.content;
            save();
            renderStreaming();
          }
          if (chunk.usage) message.usage = chunk.usage;
        }
      }
    }
  }

  // Keeps the server's figures for a finished reply in its footer.
  async function summarize(message, id) {
    if (!id) return;
    const s = await fetchStats();
    const r = s && s.last;
    if (!r || r.id !== id) return;
    message.summary = {
      prompt_tokens: r.prompt_tokens, cached_tokens: r.cached_tokens,
      completion_tokens: r.completion_tokens, ttft_s: r.ttft_s,
      decode_tps: r.decode.tokens_per_s, finish_reason: r.finish_reason,
    };
    save();
    renderMessages();
  }

  function send(ev) {
    ev.preventDefault();
    if (streaming || !modelId) return;
    const text = $("input").value;
    if (!text.trim()) return;
    $("input").value = "";
    state.messages.push({ role: "user", content: text });
    generate();
  }

  function regenerate() {
    if (streaming || !modelId) return;
    while (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
      state.messages.pop();
    }
    if (!state.messages.length) return;
    generate();
  }

  function clear() {
    if (streaming) return;
    state.messages = [];
    save();
    renderMessages();
  }

  // ---- HUD -----------------------------------------------------------------------------------
  const fmt = {
    int: (v) => String(v),
    secs: (v) => (v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 0) + " ms" : v.toFixed(2) + " s"),
    rate: (v) => v.toFixed(1) + " tok/s",
    pct: (v) => (v * 100).toFixed(1) + " %",
    bytes: (v) => {
      const u = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
      return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + " " + u[i];
    },
  };

  const both = (p) => p.prefill.experts.hits + p.decode.experts.hits;
  const total = (p) => both(p) + p.prefill.experts.misses + p.decode.experts.misses;
  const replyRate = (r) => (total(r) > 0 ? both(r) / total(r) : null);

  // [key, label, format, value of the latest reply, value of the session]
  const ROWS = [
    ["prompt", "prompt tokens", fmt.int, (r) => r.prompt_tokens, (s) => s.prompt_tokens],
    ["cached", "cached tokens", fmt.int, (r) => r.cached_tokens, (s) => s.cached_tokens],
    ["completion", "generated tokens", fmt.int,
      (r) => (r.completion_tokens !== null ? r.completion_tokens : r.decode.tokens + (r.phase === "decode" ? 1 : 0)),
      (s) => s.completion_tokens],
    ["ttft", "TTFT", fmt.secs, (r) => r.ttft_s, (s) => s.ttft_mean_s],
    ["prefill-tps", "prefill", fmt.rate, (r) => r.prefill.tokens_per_s, (s) => s.prefill.tokens_per_s],
    ["decode-tps", "decode", fmt.rate, (r) => r.decode.tokens_per_s, (s) => s.decode.tokens_per_s],
    ["hit-rate", "expert-cache hits", fmt.pct, replyRate, (s) => {
      const n = s.experts.hits + s.experts.misses;
      return n > 0 ? s.experts.hits / n : null;
    }],
    ["bytes-per-token", "read / decode token", fmt.bytes,
      (r) => r.decode.bytes_read_per_token, (s) => s.decode.bytes_read_per_token],
    ["bytes-read", "expert bytes read", fmt.bytes,
      (r) => r.prefill.experts.bytes_read + r.decode.experts.bytes_read, (s) => s.experts.bytes_read],
  ];

  // The cell `id` (made on first use under `parent` as a `tag`) shows `text`; `data-value` holds
  // the number behind it, empty when there is none.
  function show(parent, tag, id, text, value) {
    let e = document.getElementById(id);
    if (!e) {
      e = el(tag);
      e.id = id;
      parent.appendChild(e);
    }
    e.textContent = text;
    e.dataset.value = value !== null && value !== undefined ? String(value) : "";
  }

  function number(parent, id, value, format) {
    const ok = value !== null && value !== undefined && Number.isFinite(value);
    show(parent, "td", id, ok ? format(value) : "–", ok ? value : null);
  }

  function renderHud(s) {
    const rows = $("hud-rows");
    const mine = streaming ? streaming.id : lastId;
    const r = s.last && mine && s.last.id === mine ? s.last : null;
    for (const [key, label, format, ofReply, ofSession] of ROWS) {
      let tr = document.getElementById("hud-row-" + key);
      if (!tr) {
        tr = el("tr");
        tr.id = "hud-row-" + key;
        tr.appendChild(el("td", null, label));
        rows.appendChild(tr);
      }
      number(tr, "hud-reply-" + key, r ? ofReply(r) : null, format);
      number(tr, "hud-session-" + key, ofSession(s.session), format);
    }
    const i = s.server;
    const m = s.memory;
    const slots = i.expert_slots === "resident"
      ? "resident (" + i.experts_per_layer + "/layer)"
      : i.slots_per_layer + " of " + i.experts_per_layer + " per layer";
    const server = [
      ["device", "device", i.device],
      ["cache", "expert cache", slots + " × " + i.moe_layers + " layers, " + i.io],
      ["context", "context", i.max_context + " tokens, prompt cache " + i.prompt_cache],
      ["kv", "KV cache", s.kv_cache_tokens + " tokens, " + fmt.bytes(m.kv_cache_bytes), m.kv_cache_bytes],
      ["rss", "process RSS", m.rss_bytes !== null ? fmt.bytes(m.rss_bytes) + " (peak " + fmt.bytes(m.peak_rss_bytes) + ")" : "–", m.rss_bytes],
      ["weights", "resident weights", fmt.bytes(m.resident_weights_bytes), m.resident_weights_bytes],
      ["slots", "expert slots", i.io === "mmap" ? "none (layer files mapped)"
        : fmt.bytes(m.expert_slot_bytes) + " of " + fmt.bytes(m.expert_slot_capacity_bytes), m.expert_slot_bytes],
      ["queue", "queue", s.queue.running + " running, " + s.queue.waiting + " waiting"],
    ];
    const dl = $("hud-server");
    for (const [key, label, text, value] of server) {
      if (!document.getElementById("hud-" + key)) dl.appendChild(el("dt", null, label));
      show(dl, "dd", "hud-" + key, text, value);
    }
    $("device").textContent = i.device;
  }

  async function fetchStats() {
    try {
      const resp = await fetch("/v1/stats", { cache: "no-store" });
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      stats = await resp.json();
      $("hud").classList.remove("stale");
      renderHud(stats);
      return stats;
    } catch (_) {
      staleHud();
      return null;
    }
  }

  // The server did not answer: its last figures stay for reference, dimmed, and the queue no
  // longer claims a request is running.
  function staleHud() {
    $("hud").classList.add("stale");
    $("health").className = "dot bad";
    $("health").title = "server unreachable";
    const q = document.getElementById("hud-queue");
    if (q) {
      q.textContent = "– (server unreachable)";
      q.dataset.value = "";
    }
  }

  let timer = 0;
  async function poll() {
    clearTimeout(timer);
    await fetchStats();
    timer = setTimeout(poll, streaming ? 100 : 2000);
  }

  async function health() {
    let ok = false;
    try { ok = (await fetch("/health", { cache: "no-store" })).ok; } catch (_) { ok = false; }
    $("health").className = "dot " + (ok ? "ok" : "bad");
    $("health").title = ok ? "server healthy" : "server unreachable or unhealthy";
    setTimeout(health, 5000);
  }

  async function init() {
    showSettings();
    renderMessages();
    $("composer").addEventListener("submit", send);
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
    });
    $("stop").addEventListener("click", () => streaming && streaming.controller.abort());
    $("regenerate").addEventListener("click", regenerate);
    $("clear").addEventListener("click", clear);
    for (const k of ["system", "thinking"].concat(SETTINGS)) $(k).addEventListener("change", readSettings);
    try {
      const models = await (await fetch("/v1/models")).json();
      modelId = models.data[0].id;
      $("model").textContent = modelId;
    } catch (e) {
      $("model").textContent = "no model: " + e;
    }
    document.body.dataset.ready = "1";
    health();
    poll();
  }

  window.mferenceChat = { splitReasoning };
  init();
})();
