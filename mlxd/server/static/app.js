// mlxd playground: plain JS against the server's own public API (no build step, no CDN).
// The API key is asked when the API answers 401 and kept in this tab's sessionStorage only.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "mlxd.apiKey";
  const ADMIN_KEY = "mlxd.adminKey";
  const POLL_MS = 3000;
  const CHAT_KINDS = ["text", "vision"];
  const state = { models: [], history: [], controller: null, polling: false, again: false,
                  keyDeclined: false, image: null, audio: null, recorder: null };

  // ---------------------------------------------------------------- API and key
  let keyAsk = null; // one dialog at a time: concurrent 401s wait for the same answer

  function askKey(reason, storageKey) {
    if (keyAsk) return keyAsk;
    keyAsk = new Promise((resolve) => {
      const dialog = $("key-dialog");
      $("key-reason").textContent = reason;
      $("key-input").value = "";
      dialog.onclose = () => {
        const value = $("key-input").value.trim();
        const ok = dialog.returnValue === "save" && value !== "";
        if (ok) sessionStorage.setItem(storageKey, value);
        state.keyDeclined = !ok;
        keyAsk = null;
        resolve(ok ? value : null);
      };
      dialog.returnValue = "";
      dialog.showModal();
      $("key-input").focus();
    });
    return keyAsk;
  }

  function currentKey(admin) {
    return (admin && sessionStorage.getItem(ADMIN_KEY)) || sessionStorage.getItem(KEY);
  }

  // fetch with the stored key; on 401 (or an admin route's 403) ask for a key and retry.
  // `quiet` calls (the live refresh) do not open the dialog again once it was cancelled.
  async function api(path, opts = {}, { admin = false, quiet = false } = {}) {
    for (let attempt = 0; ; attempt++) {
      const key = currentKey(admin);
      const headers = { ...(opts.headers || {}) };
      if (key) headers.Authorization = "Bearer " + key;
      const r = await fetch(path, { ...opts, headers });
      const refused = r.status === 401 || (admin && r.status === 403);
      if (!refused || attempt >= 3) return r;
      if (currentKey(admin) !== key) continue; // another request got a key meanwhile
      if (quiet && state.keyDeclined) return r;
      const reason = admin
        ? "Loading and unloading models needs the admin API key."
        : "This server needs an API key.";
      if ((await askKey(reason, admin ? ADMIN_KEY : KEY)) === null) return r;
    }
  }

  async function errorText(r) {
    const text = await r.text();
    try {
      const body = JSON.parse(text);
      return `${r.status}: ${(body.error && body.error.message) || text}`;
    } catch (_) {
      return `${r.status}: ${text}`;
    }
  }

  function postJSON(path, body, opts = {}) {
    return api(path, { method: "POST", headers: { "Content-Type": "application/json" },
                       body: JSON.stringify(body), signal: opts.signal },
               { admin: Boolean(opts.admin) });
  }

  function setStatus(id, text, error = false) {
    const el = $(id);
    el.textContent = text;
    el.classList.toggle("error", error);
  }

  // ------------------------------------------------------------------- models
  // Binary units, as `mlxd ps` prints them (mlxd.models.memory.format_bytes).
  function fmtBytes(n) {
    if (n === null || n === undefined) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function cell(row, index) {
    while (row.cells.length <= index) row.insertCell();
    return row.cells[index];
  }

  function actionButton(label, name, action) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.className = action;
    b.addEventListener("click", () => modelAction(name, action, b));
    return b;
  }

  // Rows are updated in place (keyed by name) so buttons survive the live refresh.
  function renderModels(models) {
    const body = $("models").tBodies[0];
    const seen = new Set();
    for (const m of models) {
      seen.add(m.id);
      let row = body.querySelector(`tr[data-model="${CSS.escape(m.id)}"]`);
      if (!row) {
        row = body.insertRow();
        row.dataset.model = m.id;
        const actions = cell(row, 7);
        actions.append(actionButton("Load", m.id, "load"), actionButton("Unload", m.id, "unload"));
      }
      row.dataset.kind = m.kind;
      row.dataset.state = m.state;
      const aliases = (m.aliases || []).length ? ` (${m.aliases.join(", ")})` : "";
      cell(row, 0).textContent = m.id + aliases;
      cell(row, 1).textContent = m.kind;
      const st = cell(row, 2);
      st.textContent = m.state + (m.in_use ? ` · ${m.in_use} in use` : "");
      st.className = "state " + m.state + (m.health === "failing" ? " failing" : "");
      st.title = m.error || "";
      // measured: what the loaded model holds; reserved: what it holds against the budget
      // (weights + the KV reserve for its limits), an estimate (~) until it loads
      const loaded = m.state === "loaded";
      const measured = cell(row, 3);
      measured.className = "measured";
      measured.textContent = loaded && m.measured_bytes != null ? fmtBytes(m.measured_bytes) : "-";
      const reserved = cell(row, 4);
      reserved.className = "reserved";
      reserved.textContent = loaded ? fmtBytes(m.memory_bytes) : "~" + fmtBytes(m.estimated_bytes);
      cell(row, 5).textContent = m.pinned ? "pinned" : "";
      const sv = cell(row, 6);
      sv.textContent = m.servable ? "yes" : "no";
      sv.title = m.unservable_reason || "";
      const busy = m.state === "loading" || m.state === "unloading";
      row.querySelector("button.load").disabled = !m.servable || busy || m.state === "loaded";
      row.querySelector("button.unload").disabled = busy || m.state === "unloaded";
    }
    for (const row of [...body.rows]) if (!seen.has(row.dataset.model)) row.remove();
  }

  function fillSelect(select, models) {
    const names = models.map((m) => m.id + (m.servable ? "" : "!")).join("\n");
    if (select.dataset.names === names) return;
    select.dataset.names = names;
    const keep = select.value;
    select.replaceChildren(...models.map((m) => {
      const o = new Option(m.id + (m.servable ? "" : " (not servable)"), m.id);
      o.disabled = !m.servable;
      return o;
    }));
    if (models.some((m) => m.id === keep)) select.value = keep;
  }

  function ofKind(kinds) {
    return state.models.filter((m) => kinds.includes(m.kind));
  }

  // Panels for kinds no registered model has stay hidden (vision, speech to text, speech).
  function updatePanels() {
    fillSelect($("chat-model"), ofKind(CHAT_KINDS));
    fillSelect($("emb-model"), ofKind(["embedding"]));
    fillSelect($("rerank-model"), ofKind(["rerank"]));
    fillSelect($("stt-model"), ofKind(["stt"]));
    fillSelect($("tts-model"), ofKind(["tts"]));
    if ($("tts-voice").dataset.model !== $("tts-model").value) refreshVoices();
    $("panel-vision").hidden = ofKind(["vision"]).length === 0;
    $("panel-stt").hidden = ofKind(["stt"]).length === 0;
    $("panel-tts").hidden = ofKind(["tts"]).length === 0;
    $("emb-run").disabled = ofKind(["embedding"]).length === 0;
    $("rerank-run").disabled = ofKind(["rerank"]).length === 0;
  }

  async function refreshModels() {
    if (state.polling) { state.again = true; return; } // one more once this one is done
    state.polling = true;
    state.again = false;
    try {
      const r = await api("/v1/models", {}, { quiet: true });
      if (!r.ok) {
        const hint = r.status === 401 ? " (press API key to enter one)" : "";
        setStatus("models-status", "model list: " + await errorText(r) + hint, true);
        return;
      }
      if ($("models-status").textContent.startsWith("model list:")) setStatus("models-status", "");
      state.models = (await r.json()).data;
      renderModels(state.models);
      updatePanels();
      $("models-updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      setStatus("models-status", "server unreachable: " + e.message, true);
    } finally {
      state.polling = false;
      if (state.again) refreshModels();
    }
  }

  async function refreshHealth() {
    const pill = $("health");
    try {
      const r = await fetch("/health");
      const body = await r.json();
      pill.textContent = body.status;
      pill.className = "pill " + body.status;
    } catch (_) {
      pill.textContent = "unreachable";
      pill.className = "pill failing";
    }
  }

  async function modelAction(name, action, button) {
    button.disabled = true;
    setStatus("models-status", `${action === "load" ? "loading" : "unloading"} ${name}…`);
    try {
      const r = await postJSON(`/v1/models/${action}`, { model: name }, { admin: true });
      if (r.ok) setStatus("models-status", `${name}: ${(await r.json()).state}`);
      else setStatus("models-status", `${action} ${name}: ${await errorText(r)}`, true);
    } catch (e) {
      setStatus("models-status", `${action} ${name}: ${e.message}`, true);
    }
    await refreshModels();
  }

  // --------------------------------------------------------------------- chat
  // One server-sent event's JSON at a time; stops at OpenAI's closing [DONE].
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (!data) continue;
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    if (text) div.textContent = text;
    $("transcript").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  // The assistant's turn: reasoning, tool calls and the answer in their own boxes.
  function assistantMessage() {
    const div = addMessage("assistant", "");
    div.innerHTML = '<details class="reasoning" open hidden><summary>reasoning</summary>' +
      '<div class="text"></div></details><div class="answer"></div>' +
      '<div class="tool-calls" hidden></div>';
    const calls = [];
    const parts = {
      div, text: "", reasoning: "", calls,
      addReasoning(t) {
        parts.reasoning += t;
        const box = div.querySelector(".reasoning");
        box.hidden = false;
        box.querySelector(".text").textContent = parts.reasoning;
      },
      addAnswer(t) {
        parts.text += t;
        div.querySelector(".answer").textContent = parts.text;
      },
      addToolCalls(deltas) {
        for (const d of deltas) {
          const i = d.index ?? calls.length;
          const call = calls[i] || (calls[i] = { id: "", name: "", arguments: "" });
          if (d.id) call.id = d.id;
          if (d.function && d.function.name) call.name += d.function.name;
          if (d.function && d.function.arguments) call.arguments += d.function.arguments;
        }
        const box = div.querySelector(".tool-calls");
        box.hidden = false;
        box.replaceChildren(...calls.filter(Boolean).map((c) => {
          const el = document.createElement("div");
          el.className = "tool-call";
          const name = document.createElement("span");
          name.className = "tool-name";
          name.textContent = "tool call: " + c.name;
          const args = document.createElement("code");
          args.textContent = c.arguments;
          el.append(name, " ", args);
          return el;
        }));
      },
    };
    return parts;
  }

  function number(id) {
    const v = $(id).value.trim();
    return v === "" ? undefined : Number(v);
  }

  function chatBody(model) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    const body = { model, messages: messages.concat(state.history), stream: true,
                   stream_options: { include_usage: true }, temperature: number("temperature"),
                   top_p: number("top_p"), max_tokens: number("max_tokens") };
    const tools = $("tools").value.trim();
    if (tools) body.tools = JSON.parse(tools); // a SyntaxError is shown to the user
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function sendChat(event) {
    event.preventDefault();
    if (state.controller) return;
    const text = $("prompt").value.trim();
    const model = $("chat-model").value;
    if (!text) return;
    if (!model) { setStatus("chat-status", "No chat model is registered.", true); return; }
    const content = state.image
      ? [{ type: "text", text }, { type: "image_url", image_url: { url: state.image } }]
      : text;
    let body;
    state.history.push({ role: "user", content });
    try {
      body = chatBody(model);
    } catch (e) {
      state.history.pop();
      setStatus("chat-status", "tools: " + e.message, true);
      return;
    }
    $("prompt").value = "";
    addMessage("user", text + (state.image ? " [image]" : ""));
    clearImage();
    const reply = assistantMessage();
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    setStatus("chat-status", "waiting for the first token…");
    const started = performance.now();
    let first = null;
    let finish = null;
    let usage = null;
    let failed = false;
    try {
      const r = await postJSON("/v1/chat/completions", body, { signal: controller.signal });
      if (!r.ok) throw new Error(await errorText(r));
      for await (const data of sseEvents(r.body)) {
        if (data.error) throw new Error(data.error.message);
        if (data.usage) usage = data.usage;
        for (const choice of data.choices || []) {
          const d = choice.delta || {};
          if (d.reasoning_content) reply.addReasoning(d.reasoning_content);
          if (d.content) reply.addAnswer(d.content);
          if (d.tool_calls) reply.addToolCalls(d.tool_calls);
          if (choice.finish_reason) finish = choice.finish_reason;
          if (first === null && (d.content || d.reasoning_content || d.tool_calls)) {
            first = performance.now();
            setStatus("chat-status", "streaming…");
          }
        }
        reply.div.scrollIntoView({ block: "end" });
      }
      const secs = (performance.now() - started) / 1000;
      const tokens = usage ? `, ${usage.completion_tokens} tokens` : "";
      const rate = usage && first !== null && secs > (first - started) / 1000
        ? `, ${(usage.completion_tokens / (secs - (first - started) / 1000)).toFixed(1)} tok/s`
        : "";
      setStatus("chat-status", `done (${finish || "?"})${tokens} in ${secs.toFixed(1)} s${rate}`);
    } catch (e) {
      if (e.name === "AbortError") {
        reply.div.classList.add("stopped");
        setStatus("chat-status", "stopped");
      } else {
        failed = true;
        reply.div.classList.add("failed");
        setStatus("chat-status", e.message, true);
      }
    } finally {
      if (reply.text || reply.calls.length) {
        state.history.push({ role: "assistant", content: reply.text });
      } else if (failed) {
        state.history.pop(); // nothing came back: the next send retries this turn
      }
      state.controller = null;
      setBusy(false);
      refreshModels(); // the model may have been loaded by this request
    }
  }

  function stopChat() {
    if (state.controller) state.controller.abort();
  }

  function clearChat() {
    stopChat();
    state.history = [];
    $("transcript").replaceChildren();
    setStatus("chat-status", "");
  }

  function clearImage() {
    state.image = null;
    $("image").value = "";
  }

  // Send waits while the image is read, so a quick Enter never drops it.
  function readImage() {
    const file = $("image").files[0];
    if (!file) { state.image = null; return; }
    const reader = new FileReader();
    $("send").disabled = true;
    reader.onloadend = () => {
      state.image = reader.error ? null : reader.result;
      if (reader.error) setStatus("chat-status", "image: " + reader.error.message, true);
      $("send").disabled = Boolean(state.controller);
    };
    reader.readAsDataURL(file);
  }

  // --------------------------------------------------- embeddings and rerank
  function cosine(a, b) {
    let dot = 0, na = 0, nb = 0;
    for (let i = 0; i < a.length; i++) { dot += a[i] * b[i]; na += a[i] * a[i]; nb += b[i] * b[i]; }
    return dot / (Math.sqrt(na) * Math.sqrt(nb));
  }

  async function runEmbeddings() {
    const out = $("emb-result");
    out.textContent = "…";
    try {
      const r = await postJSON("/v1/embeddings", { model: $("emb-model").value,
                                                   input: [$("emb-a").value, $("emb-b").value] });
      if (!r.ok) throw new Error(await errorText(r));
      const data = (await r.json()).data.sort((x, y) => x.index - y.index);
      const [a, b] = data.map((d) => d.embedding);
      out.textContent = `cosine similarity ${cosine(a, b).toFixed(4)} ` +
                        `(${a.length} dimensions)`;
      out.classList.remove("error");
    } catch (e) {
      out.textContent = e.message;
      out.classList.add("error");
    }
    refreshModels();
  }

  async function runRerank() {
    const out = $("rerank-result");
    const documents = $("rerank-docs").value.split("\n").map((d) => d.trim()).filter(Boolean);
    out.replaceChildren();
    try {
      const r = await postJSON("/v1/rerank", { model: $("rerank-model").value,
                                               query: $("rerank-query").value, documents });
      if (!r.ok) throw new Error(await errorText(r));
      for (const res of (await r.json()).results) {
        const li = document.createElement("li");
        const score = document.createElement("span");
        score.className = "score";
        score.textContent = res.relevance_score.toFixed(4);
        li.append(score, " " + documents[res.index]);
        out.append(li);
      }
    } catch (e) {
      const li = document.createElement("li");
      li.className = "error";
      li.textContent = e.message;
      out.append(li);
    }
    refreshModels();
  }

  // ------------------------------------------------------------------- audio
  // Shown only when an stt / tts model is registered; OpenAI's audio routes.
  async function toggleRecording() {
    if (state.recorder) { state.recorder.stop(); return; }
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      const chunks = [];
      const rec = new MediaRecorder(stream);
      rec.ondataavailable = (e) => chunks.push(e.data);
      rec.onstop = () => {
        state.audio = new Blob(chunks, { type: rec.mimeType });
        stream.getTracks().forEach((t) => t.stop());
        state.recorder = null;
        $("stt-record").textContent = "Record";
        $("stt-result").textContent = "recorded; press Transcribe";
      };
      state.recorder = rec;
      rec.start();
      $("stt-record").textContent = "Stop recording";
    } catch (e) {
      $("stt-result").textContent = "cannot record: " + e.message;
    }
  }

  async function runTranscription() {
    const out = $("stt-result");
    const file = $("stt-file").files[0] || state.audio;
    if (!file) { out.textContent = "Choose or record audio first."; return; }
    const form = new FormData();
    form.append("model", $("stt-model").value);
    form.append("file", file, file.name || "recording.webm");
    out.textContent = "…";
    try {
      const r = await api("/v1/audio/transcriptions", { method: "POST", body: form });
      if (!r.ok) throw new Error(await errorText(r));
      out.textContent = (await r.json()).text;
    } catch (e) {
      out.textContent = e.message;
    }
  }

  // The voice picker lists the chosen model's voices (read from its files: no load).
  async function refreshVoices() {
    const select = $("tts-voice");
    const model = $("tts-model").value;
    select.dataset.model = model;
    if (!model) { select.replaceChildren(); return; }
    try {
      const r = await api("/v1/audio/voices?model=" + encodeURIComponent(model), {},
                          { quiet: true });
      if (!r.ok) throw new Error(await errorText(r));
      if (select.dataset.model !== model) return; // another model was chosen meanwhile
      const keep = select.value;
      const voices = (await r.json()).data;
      select.replaceChildren(...voices.map((v) => new Option(
        v.id + (v.language ? ` (${v.language})` : ""), v.id)));
      if (voices.some((v) => v.id === keep)) select.value = keep;
    } catch (e) {
      select.dataset.model = ""; // try again at the next refresh
      $("tts-result").textContent = "voices: " + e.message;
    }
  }

  async function runSpeech() {
    const out = $("tts-result");
    const voice = $("tts-voice").value;
    if (!voice) { out.textContent = "This model lists no voice yet; try again."; return; }
    out.textContent = "…";
    try {
      const r = await postJSON("/v1/audio/speech", { model: $("tts-model").value, voice,
                                                     input: $("tts-text").value });
      if (!r.ok) throw new Error(await errorText(r));
      const audio = $("tts-audio");
      const decoded = new Promise((resolve, reject) => {
        audio.onloadedmetadata = resolve;
        audio.onerror = () => reject(new Error("the browser cannot play the audio it got"));
      });
      audio.src = URL.createObjectURL(await r.blob());
      await decoded;
      out.textContent = `${audio.duration.toFixed(1)} s of speech (voice ${voice})`;
      audio.play().catch(() => {}); // a browser may refuse to autoplay: the controls remain
    } catch (e) {
      out.textContent = e.message;
    }
  }

  // ------------------------------------------------------------------- wiring
  function init() {
    $("chat-form").addEventListener("submit", sendChat);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
    });
    $("stop").addEventListener("click", stopChat);
    $("chat-clear").addEventListener("click", clearChat);
    $("image").addEventListener("change", readImage);
    $("emb-run").addEventListener("click", runEmbeddings);
    $("rerank-run").addEventListener("click", runRerank);
    $("stt-record").addEventListener("click", toggleRecording);
    $("stt-run").addEventListener("click", runTranscription);
    $("tts-run").addEventListener("click", runSpeech);
    $("tts-model").addEventListener("change", refreshVoices);
    $("key-button").addEventListener("click", async () => {
      state.keyDeclined = false;
      if (await askKey("API key for this server (admin key for load / unload).", KEY) !== null) {
        sessionStorage.removeItem(ADMIN_KEY);
        refreshModels();
      }
    });
    refreshModels();
    refreshHealth();
    setInterval(() => { refreshModels(); refreshHealth(); }, POLL_MS);
  }

  init();
})();
