/**
 * A scriptable fake of the OpenAI Chat Completions API for end-to-end tests.
 *
 * It is a real HTTP server (Bun.serve on 127.0.0.1) so the compiled agent binary talks to it
 * exactly as it would to a provider: SSE framing, error statuses, broken streams and hangs are
 * all produced on the wire rather than mocked inside the process.
 *
 * Library use:   const srv = startFakeServer({ turns: [...] }); ... srv.requests; srv.close();
 *                With `window`, it also answers the questions a client asks at start about the model's
 *                context window, as vLLM, llama.cpp, Ollama, LM Studio or OpenRouter would (the shapes
 *                are in fixtures/providers/); every such request is kept in `srv.probes`.
 * CLI use:       bun tests/fake-openai.ts --script turns.json [--port N] [--inflation X]
 *                prints the base URL (…/v1) on stdout and rewrites `turns.json.requests.json`
 *                after every chat request, so tmux-driven tests can inspect what was sent.
 */
import { writeFileSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { get_encoding, type Tiktoken } from "tiktoken";

export type ToolCallSpec = { id?: string; name?: string; arguments: string };

export type ReplyTurn = {
  type?: "reply";
  content?: string;
  reasoning?: string;
  reasoningField?: "reasoning_content" | "reasoning" | "thinking";
  toolCalls?: ToolCallSpec[];
  /** Split each call's arguments into this many chunks (default 1). */
  argPieces?: number;
  /** Leave `index` out of tool-call deltas (some providers do). */
  omitIndex?: boolean;
  /** Leave `id` out of every tool-call delta: a call that arrives without any id. */
  omitIds?: boolean;
  /** Default true: id/type/name only on the first delta of each call; false repeats them on every delta. */
  idOnFirstChunkOnly?: boolean;
  /** Split content into this many chunks (default 1). */
  contentPieces?: number;
  /** Split reasoning into this many chunks (default 1). */
  reasoningPieces?: number;
  /** Pause between chunks. */
  delayMs?: number;
  /** Override the finish_reason (default "tool_calls" when toolCalls is non-empty, else "stop"); null sends none at all. */
  finishReason?: string | null;
  /** Leave out the final `data: [DONE]` line. */
  omitDone?: boolean;
  /** Send no usage chunk even when asked for one (some servers never report usage). */
  noUsage?: boolean;
  usage?: { prompt_tokens?: number; completion_tokens?: number; cached_tokens?: number };
  /**
   * Wait this long before the first chunk: a local server reading a long prompt (prefill). The
   * silence is real on the wire: nothing but `promptProgress` frames (and, with `headersFirst`,
   * the HTTP headers) is sent until it has passed.
   */
  firstChunkDelayMs?: number;
  /**
   * With firstChunkDelayMs: true (the default) sends the 200 and its SSE headers at once and the
   * first chunk after the wait (vLLM, llama.cpp); false sends nothing at all, headers included,
   * until the first frame is due (a proxy that buffers until the backend answers).
   */
  headersFirst?: boolean;
  /**
   * llama.cpp's prompt-processing progress, sent during the firstChunkDelayMs wait, evenly spread
   * (frame i of k at (i+1)/(k+1) of the wait), each as llama.cpp sends it: a chunk whose only
   * choice has the delta {role: "assistant", content: null} and a top-level `prompt_progress`.
   * (The real server sends these only when the request asks with `return_progress: true`; this
   * fake sends them whatever the request says.)
   */
  promptProgress?: PromptProgress[];
};

/** llama.cpp's `prompt_progress` object: overall progress is processed/total. */
export type PromptProgress = { total: number; cache: number; processed: number; time_ms: number };

export type Turn =
  | ReplyTurn
  | { type: "http_error"; status: number; body: unknown; headers?: Record<string, string> }
  | { type: "stream_error"; partialContent: string; error: unknown; eventFrame?: boolean }
  | { type: "empty_stream" }
  /** 200 stream: role + partial content, then close without finish_reason or [DONE] (dropped connection). */
  | { type: "truncated_stream"; partialContent: string }
  /** 200 stream: role + partial content, then the connection is reset mid-answer. */
  | { type: "drop_stream"; partialContent: string }
  /** 200 SSE stream of exactly these frames, sent verbatim in order (each ends with its blank line). */
  | { type: "sse"; frames: string[] }
  | { type: "hang" };

export interface RecordedRequest {
  /** GET, POST…: set on every request recorded (chat requests are always POST). */
  method?: string;
  path: string;
  headers: Record<string, string>;
  body: any;
  at: number;
}

export interface FakeServer {
  /** Base URL ending in /v1, e.g. http://127.0.0.1:PORT/v1 */
  url: string;
  /** Every POST /v1/chat/completions body, parsed, in order. */
  requests: RecordedRequest[];
  /**
   * Every other request (GET /v1/models, /props, /api/ps, POST /api/show, unknown paths…), in
   * order, answered or not: what a client asked the server about itself. Body parsed when JSON,
   * else the raw text, else null.
   */
  probes: RecordedRequest[];
  close(): void;
  /** Stops listening at once, resetting open connections without answering them (a server that died). */
  kill(): void;
}

export interface FakeServerOptions {
  /** Array: served in order, then `{content: "TASKCOMPLETE"}` forever. Function: called per request (index is 0-based). */
  turns?: Turn[] | ((req: RecordedRequest, index: number) => Turn);
  /** Default 1.3: reported prompt_tokens = ceil(countPromptTokens(messages) * inflation) unless the turn overrides. */
  inflation?: number;
  port?: number;
  /** Called after each chat request has been recorded (the CLI uses it to dump requests to disk). */
  onRequest?: (req: RecordedRequest, index: number) => void;
  /**
   * The server states a context window of `n` tokens for `model` (default "test-model") the way
   * `kind` does (fixtures/providers/<server>.json has each shape and the version it follows):
   * - vllm:        GET /v1/models, the entry `max_model_len`
   * - llamacpp:    GET /props, `default_generation_settings.n_ctx`; its GET /v1/models names only
   *                `meta.n_ctx_train` (the trained maximum, larger), which is not the window
   * - ollama-ps:   GET /api/ps, the loaded model's `context_length`; POST /api/show has no num_ctx
   *                and a larger trained maximum in model_info
   * - ollama-show: GET /api/ps lists another model; POST /api/show {model} has `num_ctx n` in
   *                `parameters` (and a larger trained maximum in model_info)
   * - ollama-none: GET /api/ps lists no model; POST /api/show has no num_ctx (n is not stated)
   * - lmstudio:    GET /v1/models and GET /api/v0/models, LM Studio's /api/v0 shape, `max_context_length`
   * - openrouter:  GET /v1/models, OpenRouter's shape, `context_length`
   * The model lists hold other models, with other windows, before the one asked about.
   */
  window?: { kind: WindowKind; n: number; model?: string };
  /**
   * A thinking mode that wants the reasoning back: a chat request where an assistant message with
   * tool_calls after the last user message lacks `field` (a string) gets `status` + `body` instead
   * of an answer (DeepSeek's thinking mode: fixtures/providers/deepseek.json). The request is still
   * recorded, and uses up its turn.
   */
  requireReasoning?: { field?: string; status: number; body: unknown };
}

export type WindowKind = "vllm" | "llamacpp" | "ollama-ps" | "ollama-show" | "ollama-none" | "lmstudio" | "openrouter";

export const DEFAULT_TURN: Turn = { content: "TASKCOMPLETE" };

// ---------------------------------------------------------------------------------------------
// Token counting

let encoder: Tiktoken | undefined;

/** Encoding setup parses a multi-megabyte BPE table, so do it once and only when needed. */
function countText(text: unknown): number {
  if (typeof text !== "string" || text.length === 0) return 0;
  encoder ??= get_encoding("o200k_base");
  return encoder.encode(text).length;
}

/** Message content may be a string or an array of parts ({type: "text", text}); count the text. */
function contentText(content: unknown): string {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part) => (typeof part === "string" ? part : typeof part?.text === "string" ? part.text : ""))
      .join("");
  }
  return "";
}

/** tiktoken o200k_base count of each message's content + tool call names/args + 4 per message. */
export function countPromptTokens(messages: any[]): number {
  if (!Array.isArray(messages)) return 0;
  let total = 0;
  for (const message of messages) {
    total += 4;
    total += countText(contentText(message?.content));
    for (const call of Array.isArray(message?.tool_calls) ? message.tool_calls : []) {
      total += countText(call?.function?.name) + countText(call?.function?.arguments);
    }
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Helpers

/** Split into at most `n` near-equal pieces by code point, so surrogate pairs are never cut. */
export function splitPieces(text: string, n: number | undefined): string[] {
  const chars = Array.from(text);
  const count = Math.max(1, Math.min(Math.floor(n ?? 1), chars.length));
  const size = Math.ceil(chars.length / count);
  const pieces: string[] = [];
  for (let i = 0; i < chars.length; i += size) pieces.push(chars.slice(i, i + size).join(""));
  return pieces.length > 0 ? pieces : [""];
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function sseData(payload: unknown): string {
  return `data: ${JSON.stringify(payload)}\n\n`;
}

const SSE_HEADERS = {
  "content-type": "text/event-stream; charset=utf-8",
  "cache-control": "no-cache",
  connection: "keep-alive",
};

function jsonResponse(status: number, payload: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(payload), {
    status,
    headers: { "content-type": "application/json", ...headers },
  });
}

function headersToRecord(headers: Headers): Record<string, string> {
  const out: Record<string, string> = {};
  headers.forEach((value, key) => {
    out[key] = value;
  });
  return out;
}

/**
 * Stream pre-rendered SSE frames, optionally pausing between them. Stops quietly if the client
 * goes away (the agent aborting mid-stream must not crash the server). `prelude` frames come
 * first, each at its offset from `started` (an empty frame only waits).
 */
function streamFrames(
  frames: string[],
  delayMs: number,
  signal: AbortSignal,
  prelude: { atMs: number; frame: string }[] = [],
  started = Date.now(),
): Response {
  const bytes = new TextEncoder();
  let cancelled = false;
  const body = new ReadableStream<Uint8Array>({
    async start(controller) {
      try {
        for (const step of prelude) {
          await sleepUnlessAborted(started + step.atMs - Date.now(), signal);
          if (cancelled || signal.aborted) return;
          if (step.frame) controller.enqueue(bytes.encode(step.frame));
        }
        for (let i = 0; i < frames.length; i++) {
          if (i > 0 && delayMs > 0) await sleep(delayMs);
          if (cancelled || signal.aborted) return;
          controller.enqueue(bytes.encode(frames[i]));
        }
        controller.close();
      } catch {
        // Client disconnected while we were writing; nothing to do.
      }
    },
    cancel() {
      cancelled = true;
    },
  });
  return new Response(body, { status: 200, headers: SSE_HEADERS });
}

/** Resolves after `ms`, or at once when `signal` aborts (the client went away). */
function sleepUnlessAborted(ms: number, signal: AbortSignal): Promise<void> {
  if (ms <= 0 || signal.aborted) return Promise.resolve();
  return new Promise<void>((resolve) => {
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
    signal.addEventListener("abort", done, { once: true });
  });
}

/**
 * A reply that keeps the client waiting `waitMs` before its first frame (prefill), sending only
 * `progress` frames in the meantime at the given offsets; then `frames`, `delayMs` apart. With
 * `headersFirst` false the Response itself (status and headers) only comes with the first frame.
 */
async function streamAfterWait(
  frames: string[],
  delayMs: number,
  signal: AbortSignal,
  wait: { waitMs: number; progress: { atMs: number; frame: string }[]; headersFirst: boolean },
): Promise<Response> {
  const started = Date.now();
  const schedule = [...wait.progress.map((p) => ({ atMs: p.atMs, frame: p.frame })), { atMs: wait.waitMs, frame: "" }];
  if (!wait.headersFirst) await sleepUnlessAborted(started + schedule[0]!.atMs - Date.now(), signal);
  return streamFrames(frames, delayMs, signal, schedule, started);
}

// ---------------------------------------------------------------------------------------------
// Reply rendering

interface ReplyContext {
  requestIndex: number;
  body: any;
  inflation: number;
}

function chunkFactory(ctx: ReplyContext) {
  const id = `chatcmpl-fake-${ctx.requestIndex}`;
  const created = Math.floor(Date.now() / 1000);
  const model = typeof ctx.body?.model === "string" ? ctx.body.model : "fake-model";
  return (delta: Record<string, unknown>, finishReason: string | null = null) => ({
    id,
    object: "chat.completion.chunk",
    created,
    model,
    choices: [{ index: 0, delta, logprobs: null, finish_reason: finishReason }],
  });
}

function resolvedToolCalls(turn: ReplyTurn, requestIndex: number) {
  return (turn.toolCalls ?? []).map((spec, i) => ({
    id: spec.id ?? `call_${requestIndex}_${i}`,
    name: spec.name ?? "execute_bash",
    arguments: spec.arguments,
  }));
}

function usageFor(turn: ReplyTurn, ctx: ReplyContext) {
  const calls = resolvedToolCalls(turn, ctx.requestIndex);
  const prompt = turn.usage?.prompt_tokens ?? Math.ceil(countPromptTokens(ctx.body?.messages) * ctx.inflation);
  const completion =
    turn.usage?.completion_tokens ??
    countText(turn.content) +
      countText(turn.reasoning) +
      calls.reduce((n, c) => n + countText(c.name) + countText(c.arguments), 0);
  return {
    prompt_tokens: prompt,
    completion_tokens: completion,
    total_tokens: prompt + completion,
    prompt_tokens_details: { cached_tokens: turn.usage?.cached_tokens ?? 0 },
  };
}

/** Render a reply turn as the exact sequence of SSE frames a streaming provider would send. */
export function renderReplyFrames(turn: ReplyTurn, ctx: ReplyContext): string[] {
  const chunk = chunkFactory(ctx);
  const frames: string[] = [sseData(chunk({ role: "assistant" }))];

  if (turn.reasoning) {
    const field = turn.reasoningField ?? "reasoning_content";
    for (const piece of splitPieces(turn.reasoning, turn.reasoningPieces))
      frames.push(sseData(chunk({ [field]: piece })));
  }
  if (turn.content) {
    for (const piece of splitPieces(turn.content, turn.contentPieces)) frames.push(sseData(chunk({ content: piece })));
  }

  const calls = resolvedToolCalls(turn, ctx.requestIndex);
  const idOnce = turn.idOnFirstChunkOnly ?? true;
  calls.forEach((call, i) => {
    splitPieces(call.arguments, turn.argPieces).forEach((piece, j) => {
      const withIdentity = j === 0 || !idOnce;
      const delta: Record<string, unknown> = {};
      if (!turn.omitIndex) delta.index = i;
      if (withIdentity) {
        if (!turn.omitIds) delta.id = call.id;
        delta.type = "function";
      }
      delta.function = withIdentity ? { name: call.name, arguments: piece } : { arguments: piece };
      frames.push(sseData(chunk({ tool_calls: [delta] })));
    });
  });

  const finish = turn.finishReason === undefined ? (calls.length > 0 ? "tool_calls" : "stop") : turn.finishReason;
  frames.push(sseData(chunk({}, finish)));

  // Real OpenAI only sends the usage chunk when asked to; the agent must request it.
  if (ctx.body?.stream_options?.include_usage && !turn.noUsage) {
    const last = chunk({});
    frames.push(sseData({ ...last, choices: [], usage: usageFor(turn, ctx) }));
  }
  if (!turn.omitDone) frames.push("data: [DONE]\n\n");
  return frames;
}

/** One of llama.cpp's prompt-progress chunks (its to_json_oaicompat_chat_stream with is_progress). */
function progressFrame(ctx: ReplyContext, progress: PromptProgress): string {
  const base = chunkFactory(ctx)({ role: "assistant", content: null });
  const { logprobs: _, ...choice } = base.choices[0]!;
  return sseData({
    choices: [choice],
    created: base.created,
    id: base.id,
    model: base.model,
    system_fingerprint: "b6500-fake",
    object: "chat.completion.chunk",
    prompt_progress: progress,
  });
}

/** Non-streaming answer, for completeness (the agent is expected to stream). */
function renderReplyJson(turn: ReplyTurn, ctx: ReplyContext) {
  const calls = resolvedToolCalls(turn, ctx.requestIndex);
  const base = chunkFactory(ctx)({});
  const message: Record<string, unknown> = { role: "assistant", content: turn.content ?? null, refusal: null };
  if (turn.reasoning) message[turn.reasoningField ?? "reasoning_content"] = turn.reasoning;
  if (calls.length > 0) {
    message.tool_calls = calls.map((c) => ({
      id: c.id,
      type: "function",
      function: { name: c.name, arguments: c.arguments },
    }));
  }
  return {
    id: base.id,
    object: "chat.completion",
    created: base.created,
    model: base.model,
    choices: [
      {
        index: 0,
        message,
        logprobs: null,
        finish_reason: turn.finishReason ?? (calls.length > 0 ? "tool_calls" : "stop"),
      },
    ],
    usage: usageFor(turn, ctx),
  };
}

// ---------------------------------------------------------------------------------------------
// What a server says about itself: the context window

/** Where the documented response shapes live, one file per server. */
export const PROVIDER_FIXTURES_DIR = join(import.meta.dir, "fixtures", "providers");

/** A fixture file: `{comment, source, shapes: {"GET /props": …}}`, plus whatever else it documents. */
export function providerFixture(
  file: string,
): { comment: string; source?: string; shapes?: Record<string, unknown> } & Record<string, any> {
  return JSON.parse(readFileSync(join(PROVIDER_FIXTURES_DIR, file), "utf8"));
}

/** Replaces "{{model}}" and "{{n}}" in a fixture shape: a whole-string "{{n}}" becomes the number. */
function fillShape(shape: unknown, model: string, n: number): unknown {
  if (shape === "{{n}}") return n;
  if (typeof shape === "string") return shape.replaceAll("{{model}}", model).replaceAll("{{n}}", String(n));
  if (Array.isArray(shape)) return shape.map((v) => fillShape(v, model, n));
  if (shape && typeof shape === "object")
    return Object.fromEntries(
      Object.entries(shape).map(([k, v]) => [k.replaceAll("{{model}}", model), fillShape(v, model, n)]),
    );
  return shape;
}

/** For each kind: its fixture file, and which of its shapes answers each route. */
const WINDOW_KINDS: Record<WindowKind, { file: string; routes: Record<string, string> }> = {
  vllm: { file: "vllm.json", routes: { "GET /v1/models": "GET /v1/models" } },
  llamacpp: { file: "llamacpp.json", routes: { "GET /props": "GET /props", "GET /v1/models": "GET /v1/models" } },
  "ollama-ps": {
    file: "ollama.json",
    routes: {
      "GET /v1/models": "GET /v1/models",
      "GET /api/ps": "GET /api/ps",
      "POST /api/show": "POST /api/show (no num_ctx)",
    },
  },
  "ollama-show": {
    file: "ollama.json",
    routes: {
      "GET /v1/models": "GET /v1/models",
      "GET /api/ps": "GET /api/ps (another model loaded)",
      "POST /api/show": "POST /api/show",
    },
  },
  "ollama-none": {
    file: "ollama.json",
    routes: {
      "GET /v1/models": "GET /v1/models",
      "GET /api/ps": "GET /api/ps (none loaded)",
      "POST /api/show": "POST /api/show (no num_ctx)",
    },
  },
  lmstudio: {
    file: "lmstudio.json",
    routes: { "GET /v1/models": "GET /api/v0/models", "GET /api/v0/models": "GET /api/v0/models" },
  },
  openrouter: { file: "openrouter.json", routes: { "GET /v1/models": "GET /api/v1/models" } },
};

/** The answer to one probe under `window`, or undefined when this server has no such route. */
function windowRoutesFor(window: NonNullable<FakeServerOptions["window"]>) {
  const kind = WINDOW_KINDS[window.kind];
  if (!kind) throw new Error(`unknown window kind ${window.kind}`);
  const fixture = providerFixture(kind.file);
  const model = window.model ?? "test-model";
  const ollama = window.kind.startsWith("ollama");
  return (method: string, path: string, body: any): Response | undefined => {
    const shapeName = kind.routes[`${method} ${path}`];
    if (shapeName === undefined) {
      // Ollama's router (gin, HandleMethodNotAllowed) answers a known path asked with another method so.
      if (ollama && Object.keys(kind.routes).some((r) => r.endsWith(` ${path}`)))
        return new Response("405 method not allowed", { status: 405, headers: { "content-type": "text/plain" } });
      return undefined;
    }
    if (path === "/api/show") {
      const asked = body?.model ?? body?.name;
      if (asked !== model) return jsonResponse(404, { error: `model '${asked}' not found` });
    }
    const shape = fixture.shapes?.[shapeName];
    if (shape === undefined) throw new Error(`${kind.file} has no shape "${shapeName}"`);
    return jsonResponse(200, fillShape(shape, model, window.n));
  };
}

/** Whether an assistant message with tool calls after the last user message lacks `field`. */
function lacksReasoning(messages: unknown, field: string): boolean {
  if (!Array.isArray(messages)) return false;
  let lastUser = -1;
  messages.forEach((m, i) => {
    if (m?.role === "user") lastUser = i;
  });
  return messages
    .slice(lastUser + 1)
    .some(
      (m) =>
        m?.role === "assistant" &&
        Array.isArray(m.tool_calls) &&
        m.tool_calls.length > 0 &&
        typeof m[field] !== "string",
    );
}

// ---------------------------------------------------------------------------------------------
// Server

export function startFakeServer(opts: FakeServerOptions = {}): FakeServer {
  const requests: RecordedRequest[] = [];
  const inflation = opts.inflation ?? 1.3;
  // Hanging requests are parked here so close() can release them instead of leaking promises.
  const hanging = new Set<() => void>();

  const pickTurn = (req: RecordedRequest, index: number): Turn => {
    if (typeof opts.turns === "function") return opts.turns(req, index);
    return opts.turns?.[index] ?? DEFAULT_TURN;
  };

  const handleChat = async (req: Request, path: string): Promise<Response> => {
    const raw = await req.text();
    let body: any;
    let parsed = true;
    try {
      body = JSON.parse(raw);
    } catch {
      body = raw;
      parsed = false;
    }
    const recorded: RecordedRequest = {
      method: req.method,
      path,
      headers: headersToRecord(req.headers),
      body,
      at: Date.now(),
    };
    const index = requests.push(recorded) - 1;
    opts.onRequest?.(recorded, index);

    if (!parsed) {
      return jsonResponse(400, { error: { message: "invalid JSON body", type: "invalid_request_error", code: null } });
    }
    if (opts.requireReasoning && lacksReasoning(body?.messages, opts.requireReasoning.field ?? "reasoning_content")) {
      return jsonResponse(opts.requireReasoning.status, opts.requireReasoning.body);
    }

    const turn = pickTurn(recorded, index);
    const ctx: ReplyContext = { requestIndex: index, body, inflation };

    switch (turn.type) {
      case "http_error": {
        const headers = turn.headers ?? {};
        if (typeof turn.body === "string") {
          return new Response(turn.body, {
            status: turn.status,
            headers: { "content-type": "text/plain", ...headers },
          });
        }
        return jsonResponse(turn.status, turn.body, headers);
      }
      case "stream_error": {
        const chunk = chunkFactory(ctx);
        const frames = [sseData(chunk({ role: "assistant" }))];
        if (turn.partialContent) frames.push(sseData(chunk({ content: turn.partialContent })));
        const payload = JSON.stringify({ error: turn.error });
        frames.push(turn.eventFrame ? `event: error\ndata: ${payload}\n\n` : `data: ${payload}\n\n`);
        return streamFrames(frames, 0, req.signal);
      }
      case "empty_stream":
        return new Response("", { status: 200, headers: SSE_HEADERS });
      case "truncated_stream": {
        const chunk = chunkFactory(ctx);
        const frames = [sseData(chunk({ role: "assistant" }))];
        if (turn.partialContent) frames.push(sseData(chunk({ content: turn.partialContent })));
        return streamFrames(frames, 0, req.signal);
      }
      case "drop_stream": {
        const chunk = chunkFactory(ctx);
        const encoder = new TextEncoder();
        const body = new ReadableStream<Uint8Array>({
          async start(controller) {
            controller.enqueue(encoder.encode(sseData(chunk({ role: "assistant" }))));
            controller.enqueue(encoder.encode(sseData(chunk({ content: turn.partialContent }))));
            await sleep(50);
            controller.error(new Error("connection reset by the fake server"));
          },
        });
        return new Response(body, { status: 200, headers: SSE_HEADERS });
      }
      case "sse":
        return streamFrames(turn.frames, 0, req.signal);
      case "hang":
        return new Promise<Response>((resolve) => {
          const release = () => {
            hanging.delete(release);
            resolve(new Response(null, { status: 499 }));
          };
          hanging.add(release);
          req.signal.addEventListener("abort", release, { once: true });
        });
      default: {
        if (body?.stream !== true) {
          if (turn.firstChunkDelayMs) await sleepUnlessAborted(turn.firstChunkDelayMs, req.signal);
          return jsonResponse(200, renderReplyJson(turn, ctx));
        }
        const frames = renderReplyFrames(turn, ctx);
        if (!turn.firstChunkDelayMs && !turn.promptProgress?.length)
          return streamFrames(frames, turn.delayMs ?? 0, req.signal);
        const waitMs = turn.firstChunkDelayMs ?? 0;
        const progress = (turn.promptProgress ?? []).map((p, i, all) => ({
          atMs: Math.round((waitMs * (i + 1)) / (all.length + 1)),
          frame: progressFrame(ctx, p),
        }));
        return streamAfterWait(frames, turn.delayMs ?? 0, req.signal, {
          waitMs,
          progress,
          headersFirst: turn.headersFirst ?? true,
        });
      }
    }
  };

  const probes: RecordedRequest[] = [];
  const windowRoutes = opts.window ? windowRoutesFor(opts.window) : undefined;

  const handleProbe = async (req: Request, path: string): Promise<Response | undefined> => {
    const raw = req.method === "GET" || req.method === "HEAD" ? "" : await req.text();
    let body: any = raw === "" ? null : raw;
    try {
      if (raw !== "") body = JSON.parse(raw);
    } catch {
      /* kept as text */
    }
    probes.push({ method: req.method, path, headers: headersToRecord(req.headers), body, at: Date.now() });
    return windowRoutes?.(req.method, path, body);
  };

  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: opts.port ?? 0,
    // Bun's default 10 s idle timeout would cut slow (delayMs) streams and "hang" turns.
    idleTimeout: 0,
    async fetch(req) {
      const path = new URL(req.url).pathname;
      if (req.method === "POST" && path === "/v1/chat/completions") return handleChat(req, path);
      const answered = await handleProbe(req, path);
      if (answered) return answered;
      if (req.method === "GET" && path === "/v1/models") {
        return jsonResponse(200, {
          object: "list",
          data: ["fake-model", "fake-model-mini"].map((id) => ({
            id,
            object: "model",
            created: 0,
            owned_by: "fake-openai",
          })),
        });
      }
      return jsonResponse(404, {
        error: { message: `Unknown route: ${req.method} ${path}`, type: "invalid_request_error", code: "not_found" },
      });
    },
  });

  return {
    url: `http://127.0.0.1:${server.port}/v1`,
    requests,
    probes,
    close() {
      for (const release of [...hanging]) release();
      server.stop(true);
    },
    kill() {
      hanging.clear();
      server.stop(true);
    },
  };
}

// ---------------------------------------------------------------------------------------------
// CLI: bun tests/fake-openai.ts --script turns.json [--port N] [--inflation X]

/** The script file is either a JSON array of turns or `{turns: [...], inflation?: number}`. */
export function runCli(argv: string[]): FakeServer {
  const arg = (name: string) => {
    const i = argv.indexOf(name);
    return i >= 0 ? argv[i + 1] : undefined;
  };
  const script = arg("--script");
  if (!script) throw new Error("usage: bun tests/fake-openai.ts --script turns.json [--port N] [--inflation X]");

  const parsed = JSON.parse(readFileSync(script, "utf8"));
  const turns: Turn[] = Array.isArray(parsed) ? parsed : (parsed.turns ?? []);
  const inflationArg = arg("--inflation") ?? (Array.isArray(parsed) ? undefined : parsed.inflation);
  const portArg = arg("--port");
  const requestsFile = `${script}.requests.json`;

  const server = startFakeServer({
    turns,
    inflation: inflationArg === undefined ? undefined : Number(inflationArg),
    port: portArg === undefined ? undefined : Number(portArg),
    // Synchronous write: the file is complete before the response starts, so a test that sees
    // the agent react can immediately read every request up to that point.
    onRequest: () => writeFileSync(requestsFile, JSON.stringify(server.requests, null, 2)),
  });
  writeFileSync(requestsFile, "[]");
  return server;
}

if (import.meta.main) {
  const server = runCli(process.argv.slice(2));
  console.log(server.url);
  const shutdown = () => {
    server.close();
    process.exit(0);
  };
  process.on("SIGINT", shutdown);
  process.on("SIGTERM", shutdown);
}
