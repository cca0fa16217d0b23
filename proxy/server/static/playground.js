// foretell playground: plain JavaScript, no build step, no dependencies. It talks to this
// server's /v1 API (same origin) and asks for per-token origins with the report_origins
// stream extension: speculation: {"report_origins": true}.
"use strict";

(function () {
  const KEY_STORAGE = "foretell-api-key"; // sessionStorage: this tab only

  // ---- the edit prompt: the same shape as foretell.sdk.edit.build_edit_prompt -------------

  const LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx", ".go": "go", ".rs": "rust", ".java": "java",
    ".kt": "kotlin", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp",
    ".cs": "csharp", ".rb": "ruby", ".php": "php", ".swift": "swift", ".sh": "bash",
    ".sql": "sql", ".html": "html", ".css": "css", ".json": "json", ".yaml": "yaml", ".yml": "yaml",
    ".toml": "toml", ".md": "markdown", ".rst": "rst", ".txt": "text",
  };

  // Python's os.path.splitext(name)[1]: leading dots of the base name do not start an extension.
  function extension(filename) {
    const base = (filename || "").slice((filename || "").lastIndexOf("/") + 1);
    const leading = base.match(/^\.*/)[0].length;
    const dot = base.lastIndexOf(".");
    return dot >= leading && dot > 0 ? base.slice(dot) : "";
  }

  function codePoints(text) {
    let count = 0;
    for (const _ of text) count += 1;
    return count;
  }

  function buildEditPrompt(text, instruction, filename) {
    const name = filename || "the file";
    const language = LANGUAGES[extension(filename).toLowerCase()] || "text";
    const longest = Math.max(0, ...(text.match(/`+/g) || []).map((run) => run.length));
    const fence = "`".repeat(Math.max(3, longest + 1));
    const body = text.endsWith("\n") || !text ? text : text + "\n";
    const opening = fence + language + "\n";
    const content = `Edit ${name}. ${instruction.trim()}\n\n` +
      `${name} before the edit:\n${opening}${body}${fence}\n\n` +
      `Reply with ${name} after the edit, the whole file in one ${fence}${language} block.`;
    const maxTokens = Math.floor((Math.floor(codePoints(opening + body) / 3) + 1) * 1.5) + 64;
    return {
      messages: [{ role: "user", content }], prediction: opening + body, fence,
      max_tokens: maxTokens, stop: ["\n" + fence + "\n"],
    };
  }

  function escapeRegExp(text) {
    return text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  }

  // foretell.sdk.edit.extract_edited_text: the first fenced block's content (or the answer).
  function extractEditedText(output, fence, keepFinalNewline) {
    const opening = new RegExp("^[ \\t]*" + escapeRegExp(fence) + "[^`\\n]*\\n", "m").exec(output);
    let body;
    if (opening === null) {
      body = output.replace(/^\n+|\n+$/g, "");
      body = body ? body + "\n" : body;
    } else {
      const rest = output.slice(opening.index + opening[0].length);
      const closing = new RegExp("^[ \\t]*" + escapeRegExp(fence) + "[ \\t]*$", "m").exec(rest);
      body = closing ? rest.slice(0, closing.index) : rest;
      if (!closing && body && !body.endsWith("\n")) body += "\n";
    }
    if (!keepFinalNewline && body.endsWith("\n")) body = body.slice(0, -1);
    return body;
  }

  // ---- a line diff: common prefix and suffix, then a longest common subsequence ----------

  const MAX_DIFF_CELLS = 4000000;

  function lineDiff(before, after) {
    const a = before === "" ? [] : before.split("\n");
    const b = after === "" ? [] : after.split("\n");
    let start = 0;
    while (start < a.length && start < b.length && a[start] === b[start]) start += 1;
    let endA = a.length, endB = b.length;
    while (endA > start && endB > start && a[endA - 1] === b[endB - 1]) { endA -= 1; endB -= 1; }
    const ops = [];
    for (let i = 0; i < start; i += 1) ops.push(["same", a[i]]);
    const n = endA - start, m = endB - start;
    if (n * m > MAX_DIFF_CELLS) {
      for (let i = start; i < endA; i += 1) ops.push(["del", a[i]]);
      for (let j = start; j < endB; j += 1) ops.push(["add", b[j]]);
    } else {
      // lengths[i][j]: LCS of a[start+i..endA) and b[start+j..endB), in one flat array.
      const width = m + 1;
      const lengths = new Int32Array((n + 1) * width);
      for (let i = n - 1; i >= 0; i -= 1) {
        for (let j = m - 1; j >= 0; j -= 1) {
          lengths[i * width + j] = a[start + i] === b[start + j]
            ? lengths[(i + 1) * width + j + 1] + 1
            : Math.max(lengths[(i + 1) * width + j], lengths[i * width + j + 1]);
        }
      }
      let i = 0, j = 0;
      while (i < n || j < m) {
        if (i < n && j < m && a[start + i] === b[start + j]) {
          ops.push(["same", a[start + i]]); i += 1; j += 1;
        } else if (j < m && (i === n || lengths[i * width + j + 1] >= lengths[(i + 1) * width + j])) {
          ops.push(["add", b[start + j]]); j += 1;
        } else {
          ops.push(["del", a[start + i]]); i += 1;
        }
      }
    }
    for (let i = endA; i < a.length; i += 1) ops.push(["same", a[i]]);
    return ops;
  }

  // ---- the page ----------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const state = {
    mode: "edit",
    view: "answer",
    controller: null,
    last: null, // {path, body, prediction, mode, fence, keepFinalNewline, run}
    models: [],
  };

  function apiKey() {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  }

  function headers(json) {
    const result = {};
    if (json) result["content-type"] = "application/json";
    const key = apiKey();
    if (key) result.authorization = "Bearer " + key;
    return result;
  }

  class ApiError extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  async function errorOf(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
    } catch (_) { /* not JSON: keep the status line */ }
    return new ApiError(message, response.status);
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = !message;
  }

  function needKey(message) {
    $("key-panel").hidden = false;
    $("key-button").hidden = false;
    showError(message);
    $("key-input").focus();
  }

  async function checkHealth() {
    const pill = $("health");
    try {
      const response = await fetch("/health", { cache: "no-store" });
      const body = await response.json();
      if (response.ok) {
        pill.textContent = "ready";
        pill.className = "pill ok";
        return true;
      }
      pill.textContent = body.status === "loading" ? "loading the model\u2026" : "model failed to load";
      pill.className = body.status === "loading" ? "pill" : "pill bad";
      if (body.error) pill.title = body.error;
      return body.status !== "loading";
    } catch (_) {
      pill.textContent = "server unreachable";
      pill.className = "pill bad";
      return false;
    }
  }

  async function waitForHealth() {
    while (!(await checkHealth())) await new Promise((done) => setTimeout(done, 1000));
  }

  async function loadModels() {
    const response = await fetch("/v1/models", { headers: headers(false), cache: "no-store" });
    if (response.status === 401) {
      const error = await errorOf(response);
      needKey(apiKey() ? error.message : "This server needs an API key.");
      return false;
    }
    if (!response.ok) {
      showError("Listing the models failed: " + (await errorOf(response)).message);
      return false;
    }
    const body = await response.json();
    const select = $("model");
    const previous = select.value;
    select.textContent = "";
    state.models = (body.data || []).map((model) => model.id);
    for (const id of state.models) {
      const option = document.createElement("option");
      option.value = option.textContent = id;
      select.append(option);
    }
    if (state.models.includes(previous)) select.value = previous;
    $("key-panel").hidden = true;
    showError("");
    updateButtons();
    return true;
  }

  function updateButtons() {
    const busy = state.controller !== null;
    $("send").disabled = busy || state.models.length === 0;
    $("stop").disabled = !busy;
    $("compare").disabled = busy || state.last === null || state.last.run === null;
  }

  function setMode(mode) {
    state.mode = mode;
    $("mode-edit").classList.toggle("active", mode === "edit");
    $("mode-prompt").classList.toggle("active", mode === "prompt");
    $("mode-edit").setAttribute("aria-selected", String(mode === "edit"));
    $("mode-prompt").setAttribute("aria-selected", String(mode === "prompt"));
    $("edit-fields").hidden = mode !== "edit";
    $("prompt-fields").hidden = mode !== "prompt";
  }

  function setView(view) {
    state.view = view;
    $("view-answer").classList.toggle("active", view === "answer");
    $("view-diff").classList.toggle("active", view === "diff");
    $("view-answer").setAttribute("aria-selected", String(view === "answer"));
    $("view-diff").setAttribute("aria-selected", String(view === "diff"));
    $("answer").hidden = view !== "answer";
    $("diff").hidden = view !== "diff";
    if (view === "diff") renderDiff();
  }

  // The request for what the form holds.
  function buildRequest() {
    const model = $("model").value;
    const temperature = Number($("temperature").value || 0);
    const maxTokens = $("max-tokens").value ? Number($("max-tokens").value) : null;
    const speculation = { prompt_lookup: $("prompt-lookup").checked, report_origins: true };
    const common = { model, temperature, stream: true, stream_options: { include_usage: true }, speculation };
    if (state.mode === "edit") {
      const text = $("file-text").value;
      const instruction = $("instruction").value;
      if (!instruction.trim()) throw new Error("Write an instruction: what should change in the file?");
      const prompt = buildEditPrompt(text, instruction, $("filename").value.trim() || null);
      return {
        path: "/v1/chat/completions", mode: "edit", fence: prompt.fence, original: text,
        keepFinalNewline: text.endsWith("\n") || !text, prediction: prompt.prediction,
        body: { ...common, messages: prompt.messages, prediction: { type: "content", content: prompt.prediction },
                max_tokens: maxTokens || prompt.max_tokens, stop: prompt.stop },
      };
    }
    const prompt = $("prompt-text").value;
    if (!prompt) throw new Error("Write a prompt.");
    const prediction = $("prediction-text").value;
    const body = { ...common, prompt, max_tokens: maxTokens || 256 };
    if (prediction) body.prediction = { type: "content", content: prediction };
    const stop = $("stop-text").value.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
    if (stop) body.stop = [stop];
    return { path: "/v1/completions", mode: "prompt", prediction: prediction || null, original: prediction, body };
  }

  // POST a streaming request; onChunk(payload) for each event; resolves at [DONE].
  async function stream(path, body, signal, onChunk) {
    const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data.trim() === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new ApiError(payload.error.message || "the stream failed", null);
        onChunk(payload);
      }
    }
    throw new ApiError("the stream ended before it was complete", null);
  }

  function chunkText(payload) {
    const choice = (payload.choices || [])[0];
    if (!choice) return "";
    if (choice.delta) return choice.delta.content || "";
    return choice.text || "";
  }

  // One run of a request: its text, origins, counts and times.
  function newRun() {
    return {
      text: "", started: performance.now(), first: null, ended: null, tokens: 0, passes: 0,
      usage: null, speculation: null, reported: false, finish: null, chunks: 0,
    };
  }

  async function execute(request, onText) {
    const run = newRun();
    const controller = new AbortController();
    state.controller = controller;
    updateButtons();
    try {
      await stream(request.path, request.body, controller.signal, (payload) => {
        const text = chunkText(payload);
        const extension = payload.foretell;
        if (extension && Array.isArray(extension.origins)) {
          run.reported = true;
          run.tokens += extension.tokens || 0;
          run.passes += extension.passes || 0;
        }
        if (text && run.first === null) run.first = performance.now();
        if (text) {
          run.chunks += 1;
          run.text += text;
          if (onText) onText(text, extension && Array.isArray(extension.origins) ? extension.origins : null, run);
        }
        const choice = (payload.choices || [])[0];
        if (choice && choice.finish_reason) run.finish = choice.finish_reason;
        if (payload.usage) run.usage = payload.usage;
        if (payload.speculation) run.speculation = payload.speculation;
      });
    } finally {
      run.ended = performance.now();
      state.controller = null;
      updateButtons();
    }
    return run;
  }

  // ---- rendering ---------------------------------------------------------------------------

  function appendSpans(container, text, origins) {
    const spans = origins || [{ text, origin: undefined }];
    for (const span of spans) {
      const element = document.createElement("span");
      element.className = span.origin === undefined ? "o-unknown"
        : span.origin === null ? "o-target" : "o-" + span.origin;
      element.textContent = span.text;
      container.append(element);
    }
  }

  function fmt(value, digits) {
    return value === null || value === undefined || Number.isNaN(value) ? "\u2013" : value.toFixed(digits);
  }

  function completionTokens(run) {
    return run.usage ? run.usage.completion_tokens : (run.reported ? run.tokens : null);
  }

  function runSeconds(run) {
    return ((run.ended || performance.now()) - run.started) / 1000;
  }

  // Tokens per second, end to end: from sending the request to its last token (or now).
  function tokensPerSecond(run) {
    const tokens = completionTokens(run) !== null ? completionTokens(run) : Math.round(run.text.length / 4);
    const seconds = runSeconds(run);
    return run.first !== null && seconds > 0 ? tokens / seconds : null;
  }

  function renderStats(run) {
    $("stat-speed").textContent = fmt(tokensPerSecond(run), 1);
    const tokens = completionTokens(run);
    $("stat-tokens").textContent = tokens === null ? "\u2013" : String(tokens);
    const passes = run.speculation ? run.speculation.target_passes : (run.reported ? run.passes : null);
    $("stat-passes").textContent = passes === null || passes === undefined ? "\u2013" : String(passes);
    $("stat-time").textContent = fmt(runSeconds(run), 2);
    const details = run.usage && run.usage.completion_tokens_details;
    $("stat-prediction").textContent = details && details.accepted_prediction_tokens !== undefined
      ? `${details.accepted_prediction_tokens} / ${details.rejected_prediction_tokens}` : "\u2013";
    const sources = $("sources");
    sources.textContent = "";
    const perSource = run.speculation && run.speculation.per_source;
    if (perSource) {
      for (const [name, source] of Object.entries(perSource)) {
        const chip = document.createElement("span");
        chip.className = "source o-" + name;
        const rate = source.drafted ? ` (${(100 * source.accepted / source.drafted).toFixed(0)}%)` : "";
        chip.textContent = `${name.replace("_", " ")}: ${source.accepted} of ${source.drafted} drafted accepted${rate}, ${source.rounds} round${source.rounds === 1 ? "" : "s"}`;
        sources.append(chip);
      }
    }
  }

  function answerFile() {
    const last = state.last;
    if (!last || !last.run) return null;
    return last.mode === "edit" ? extractEditedText(last.run.text, last.fence, last.keepFinalNewline) : last.run.text;
  }

  function renderDiff() {
    const box = $("diff");
    box.textContent = "";
    const last = state.last;
    if (!last || !last.run) {
      box.append(line("skip", "Send a request first."));
      return;
    }
    if (last.original === null || last.original === undefined || (last.mode === "prompt" && !last.original)) {
      box.append(line("skip", "This request had no prediction to compare with."));
      return;
    }
    const ops = lineDiff(last.original, answerFile());
    const added = ops.filter((op) => op[0] === "add").length;
    const removed = ops.filter((op) => op[0] === "del").length;
    box.append(line("summary-line", added || removed ? `+${added} \u2212${removed} lines` : "no changes"));
    const context = 3;
    const keep = ops.map(() => false);
    ops.forEach((op, index) => {
      if (op[0] !== "same") {
        for (let k = Math.max(0, index - context); k <= Math.min(ops.length - 1, index + context); k += 1) keep[k] = true;
      }
    });
    let skipped = 0;
    const flush = () => {
      if (skipped) box.append(line("skip", `\u2026 ${skipped} unchanged line${skipped === 1 ? "" : "s"}`));
      skipped = 0;
    };
    ops.forEach((op, index) => {
      if (!keep[index] && (added || removed)) { skipped += 1; return; }
      flush();
      box.append(line(op[0], op[1]));
    });
    flush();
  }

  function line(kind, text) {
    const element = document.createElement("div");
    element.className = kind === "summary-line" || kind === "skip" ? kind : "line " + kind;
    element.textContent = text === "" && kind !== "skip" ? "\u200b" : text;
    return element;
  }

  function setNote(text) {
    $("note").textContent = text || "";
    $("note").hidden = !text;
  }

  function renderComparison() {
    const last = state.last;
    const plain = last && last.plain;
    $("comparison").hidden = !plain;
    if (!plain) return;
    const fill = (rowId, run) => {
      const cells = $(rowId).querySelectorAll("td");
      cells[0].textContent = fmt(runSeconds(run), 2);
      const tokens = completionTokens(run);
      cells[1].textContent = tokens === null ? "\u2013" : String(tokens);
      const passes = run.speculation ? run.speculation.target_passes : null;
      cells[2].textContent = passes === null || passes === undefined ? "\u2013" : String(passes);
      cells[3].textContent = fmt(tokensPerSecond(run), 1);
    };
    fill("row-spec", last.run);
    fill("row-plain", plain);
    const ratio = runSeconds(plain) / runSeconds(last.run);
    let summary = `${ratio.toFixed(2)}\u00d7 ${ratio >= 1 ? "faster" : "slower"} with speculation`;
    if (Number(last.body.temperature) === 0) {
      summary += last.run.text === plain.text ? "; the same text, as greedy decoding guarantees" : "; the texts differ";
    }
    $("comparison-summary").textContent = summary;
  }

  // ---- actions -----------------------------------------------------------------------------

  async function send() {
    let request;
    try {
      request = buildRequest();
    } catch (error) {
      showError(error.message);
      return;
    }
    showError("");
    setNote("");
    state.last = { ...request, run: null, plain: null };
    $("comparison").hidden = true;
    const answer = $("answer");
    answer.textContent = "";
    delete answer.dataset.chunks;
    let pending = false;
    let live = null;
    const refresh = () => {
      pending = false;
      if (live) renderStats(live);
    };
    try {
      const run = await execute(request, (text, origins, current) => {
        live = current;
        appendSpans(answer, text, origins);
        if (!pending) { pending = true; requestAnimationFrame(refresh); }
      });
      state.last.run = run;
      answer.dataset.chunks = String(run.chunks);
      renderStats(run);
      if (!run.reported) setNote("This model did not report token origins (an upstream route): the text is not coloured.");
      else if (run.finish === "length") setNote("The answer stopped at max tokens.");
      if (state.view === "diff") renderDiff();
    } catch (error) {
      handleFailure(error);
    }
    updateButtons();
  }

  async function compare() {
    const last = state.last;
    if (!last || !last.run) return;
    const body = { ...last.body, speculation: { prompt_lookup: false, draft_cache: false, report_origins: true } };
    delete body.prediction;
    showError("");
    try {
      last.plain = await execute({ path: last.path, body }, null);
      $("comparison").dataset.chunks = String(last.plain.chunks);
      renderComparison();
    } catch (error) {
      handleFailure(error);
    }
  }

  function handleFailure(error) {
    if (error.name === "AbortError") {
      setNote("Stopped.");
      return;
    }
    if (error.status === 401) {
      needKey(error.message);
      return;
    }
    showError(error.message || String(error));
  }

  function readFile(file) {
    if (!file) return;
    file.text().then((text) => {
      $("file-text").value = text;
      $("filename").value = file.name;
    }, (error) => showError("Could not read the file: " + error.message));
  }

  function wire() {
    $("mode-edit").addEventListener("click", () => setMode("edit"));
    $("mode-prompt").addEventListener("click", () => setMode("prompt"));
    $("view-answer").addEventListener("click", () => setView("answer"));
    $("view-diff").addEventListener("click", () => setView("diff"));
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("compare").addEventListener("click", compare);
    $("open-file").addEventListener("click", () => $("file-input").click());
    $("file-input").addEventListener("change", (event) => readFile(event.target.files[0]));
    for (const id of ["file-text", "prediction-text"]) {
      const area = $(id);
      area.addEventListener("dragover", (event) => { event.preventDefault(); area.classList.add("dragging"); });
      area.addEventListener("dragleave", () => area.classList.remove("dragging"));
      area.addEventListener("drop", (event) => {
        event.preventDefault();
        area.classList.remove("dragging");
        const file = event.dataTransfer.files[0];
        if (!file) return;
        if (id === "file-text") readFile(file);
        else file.text().then((text) => { area.value = text; });
      });
    }
    document.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && !$("send").disabled) send();
    });
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
      $("key-input").value = "";
      loadModels().catch((error) => showError(error.message));
    });
    $("key-button").addEventListener("click", () => {
      $("key-panel").hidden = !$("key-panel").hidden;
      if (!$("key-panel").hidden) $("key-input").focus();
    });
  }

  async function start() {
    wire();
    setMode("edit");
    updateButtons();
    if (apiKey()) $("key-button").hidden = false;
    await waitForHealth();
    try {
      await loadModels();
    } catch (error) {
      showError("Listing the models failed: " + error.message);
    }
    document.body.dataset.ready = "true";
  }

  // For tests and the curious: the pure functions the page is built on.
  window.foretellPlayground = { buildEditPrompt, extractEditedText, lineDiff, extension };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
