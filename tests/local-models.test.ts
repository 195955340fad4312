/**
 * Real models on real servers, end to end: the compiled dist/aic, run headless with --json
 * against the fake OpenAI server, which plays what vLLM, llama.cpp, Ollama, LM Studio,
 * OpenRouter and DeepSeek send (the shapes, and the versions they follow, are in
 * fixtures/providers/). What is checked:
 *
 * - reasoning goes back: a tool-calling turn's streamed reasoning is in the next request, in the
 *   field the server used, or DeepSeek's thinking mode refuses the request;
 * - tool calls written as text (Hermes, Qwen3-Coder XML, Mistral, Llama) at the end of a reply are
 *   run and kept as proper tool calls; the same markup quoted, fenced, followed by prose or
 *   calling another function is text;
 * - the context window comes from the server, and the prompt budget and max_tokens fit in it;
 * - a long wait before the first chunk (prefill) is waited out, shown, and never resent;
 * - with --max-time the model is told its time, in the system prompt and after every result.
 *
 * Every wait is on something observable; the only delays are the fake server's, which are what
 * a slow server does on the wire.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { countPromptTokens, providerFixture, type FakeServer, type Turn, type WindowKind } from "./fake-openai.ts";
import {
  bash,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  requestSequenceProblems,
  runAic,
  scratch,
  type AicRun,
} from "./helpers.ts";

const fixtures = perTestFixtures();

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

interface Played {
  srv: FakeServer;
  run: AicRun;
  events: any[];
  cwd: string;
}

/** Runs one task headless in --json mode (unless `json: false`) with --auto-approve. */
async function play(
  srv: FakeServer,
  opts: { model?: string; flags?: string[]; env?: Record<string, string>; json?: boolean; cwd?: string } = {},
): Promise<Played> {
  const cwd = opts.cwd ?? scratch();
  const json = opts.json === false ? [] : ["--json"];
  const run = await runAic(
    [...headless(srv.url, opts.model ?? "test-model", "--auto-approve", ...json, ...(opts.flags ?? [])), "do the task"],
    { cwd, env: opts.env, killAfterMs: 90_000 },
  );
  const events = opts.json === false ? [] : jsonLines(run.stdout);
  if (run.code !== 0) console.error(said(run, srv));
  return { srv, run, events, cwd };
}

/** What aic did, for a failure message. */
function said(run: AicRun, srv?: FakeServer): string {
  const probes = srv ? `\n--- probes ---\n${srv.probes.map((p) => `${p.method} ${p.path}`).join("\n")}` : "";
  return `exit ${run.code}\n--- stdout ---\n${run.stdout.slice(-3000)}\n--- stderr ---\n${run.stderr.slice(-2000)}${probes}`;
}

const ofType = (events: any[], type: string) => events.filter((e) => e.type === type);

/** The assistant message in `messages` whose tool_calls hold call `id`. */
const callMessage = (messages: any[], id: string) =>
  messages.find((m) => m.role === "assistant" && m.tool_calls?.some((c: any) => c.id === id));

// ─── Reasoning goes back ───────────────────────────────────────────────────────────────────────

describe("reasoning goes back with the tool calls it led to", () => {
  const deepseek = providerFixture("deepseek.json");

  test("DeepSeek thinking mode: every tool-calling turn since the last user message carries its reasoning_content; the run completes", async () => {
    const reasoning = {
      call_one: "The user wants the task done. First I list something: `echo one` is harmless — let me run it.",
      call_two: "That printed one. Now the second step: echo two, then I am done.",
    };
    const srv = fixtures.serve(
      [
        { reasoning: reasoning.call_one, reasoningPieces: 4, ...bash("echo one", "call_one") },
        { reasoning: reasoning.call_two, reasoningPieces: 3, ...bash("echo two", "call_two") },
        { reasoning: "Both ran. The task is complete.", content: "TASKCOMPLETE" },
      ],
      { requireReasoning: { field: deepseek.field, status: deepseek.status, body: deepseek.body } },
    );
    const { run, events } = await play(srv, { model: "deepseek-reasoner" });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(3); // no request was refused, none resent
    expect(ofType(events, "command").map((e) => e.command)).toEqual(["echo one", "echo two"]);

    // Each tool-calling assistant message after the last user message has the full reasoning, in
    // the field DeepSeek streamed it in; older ones may lack it.
    for (const [i, req] of srv.requests.entries()) {
      const messages = messagesOf(req);
      expect(requestSequenceProblems(messages)).toEqual([]);
      const lastUser = messages.findLastIndex((m) => m.role === "user");
      for (const [id, text] of Object.entries(reasoning)) {
        const at = messages.findIndex((m) => m.role === "assistant" && m.tool_calls?.some((c: any) => c.id === id));
        if (at > lastUser)
          expect({ request: i, id, reasoning_content: messages[at].reasoning_content }).toEqual({
            request: i,
            id,
            reasoning_content: text,
          });
      }
    }
    expect(callMessage(messagesOf(srv.requests[1]), "call_one")?.reasoning_content).toBe(reasoning.call_one);
    expect(callMessage(messagesOf(srv.requests[2]), "call_two")?.reasoning_content).toBe(reasoning.call_two);

    // aic's own bookkeeping never goes on the wire.
    for (const req of srv.requests)
      for (const m of messagesOf(req)) expect(Object.keys(m).filter((k) => k.startsWith("aic_"))).toEqual([]);
  });

  test("without the reasoning the fake DeepSeek refuses as DeepSeek does (the fixture bites)", async () => {
    // A control on the server, not on aic: a history with a tool call and no reasoning_content is refused.
    const srv = fixtures.serve([{ content: "never sent" }], {
      requireReasoning: { field: deepseek.field, status: deepseek.status, body: deepseek.body },
    });
    const res = await fetch(`${srv.url}/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({
        model: "deepseek-reasoner",
        stream: true,
        messages: [
          { role: "system", content: "s" },
          { role: "user", content: "u" },
          {
            role: "assistant",
            content: "",
            tool_calls: [{ id: "c1", type: "function", function: { name: "execute_bash", arguments: "{}" } }],
          },
          { role: "tool", tool_call_id: "c1", content: "ok" },
        ],
      }),
    });
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual(deepseek.body);
  });

  test("reasoning streamed in delta.reasoning goes back in `reasoning`", async () => {
    const thought = "I will look first: echo looked.";
    const srv = fixtures.serve([
      { reasoning: thought, reasoningField: "reasoning", reasoningPieces: 3, ...bash("echo looked", "call_look") },
      { content: "TASKCOMPLETE" },
    ]);
    const { run } = await play(srv, { model: "glm-4.6" });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(2);
    expect(callMessage(messagesOf(srv.requests[1]), "call_look")?.reasoning).toBe(thought);
    for (const req of srv.requests)
      for (const m of messagesOf(req)) expect(Object.keys(m).filter((k) => k.startsWith("aic_"))).toEqual([]);
  });
});

// ─── Tool calls written as text ────────────────────────────────────────────────────────────────

/** Markup a tool call is written in, by chat template (what vLLM's and llama.cpp's parsers read). */
const TEXT_FORMATS: { name: string; marker: string; markup: string }[] = [
  {
    name: "Hermes / Qwen2.5 <tool_call> JSON",
    marker: "hermes-ok",
    markup: '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "echo hermes-ok"}}\n</tool_call>',
  },
  {
    name: "Qwen3-Coder <tool_call> XML",
    marker: "qwen-ok",
    markup:
      "<tool_call>\n<function=execute_bash>\n<parameter=command>\necho qwen-ok\n</parameter>\n</function>\n</tool_call>",
  },
  {
    name: "Mistral [TOOL_CALLS] list",
    marker: "mistral-ok",
    markup: '[TOOL_CALLS][{"name": "execute_bash", "arguments": {"command": "echo mistral-ok"}}]',
  },
  {
    name: "Mistral [TOOL_CALLS]name[ARGS]",
    marker: "mistral2-ok",
    markup: '[TOOL_CALLS]execute_bash[ARGS]{"command": "echo mistral2-ok"}',
  },
  {
    name: "Llama 3.x <|python_tag|>",
    marker: "llama-ok",
    markup: '<|python_tag|>{"name": "execute_bash", "parameters": {"command": "echo llama-ok"}}',
  },
];

/** Pieces of markup that must not survive in the history's content. */
const MARKUP = /<tool_call>|<\/tool_call>|<function=|<parameter=|\[TOOL_CALLS\]|\[ARGS\]|<\|python_tag\|>/;

describe("a tool call written as text at the end of the reply is run as the call", () => {
  const cases = TEXT_FORMATS.flatMap((f) => [
    { ...f, label: `${f.name}`, prose: "" },
    { ...f, label: `${f.name}, after prose`, prose: "I'll check that it prints.\n\n" },
  ]);

  test.each(cases.map((c) => [c.label, c] as const))("%s", async (_label, c) => {
    const command = `echo ${c.marker}`;
    const srv = fixtures.serve([
      { content: c.prose + c.markup, contentPieces: 5, finishReason: "stop" },
      { content: "TASKCOMPLETE" },
    ]);
    const { run, events } = await play(srv);

    // The person sees the command, and it ran.
    const commands = ofType(events, "command");
    expect(commands.map((e) => e.command)).toEqual([command]);
    const result = ofType(events, "command_result").find((e) => e.id === commands[0].id);
    expect(result?.output).toContain(c.marker);

    // The history holds a proper tool call, answered by a tool message, without the markup.
    expect(srv.requests.length).toBeGreaterThanOrEqual(2);
    const messages = messagesOf(srv.requests[1]);
    expect(requestSequenceProblems(messages)).toEqual([]);
    const at = messages.findIndex(
      (m) =>
        m.role === "assistant" &&
        m.tool_calls?.some((call: any) => {
          try {
            return call.function?.name === "execute_bash" && JSON.parse(call.function.arguments).command === command;
          } catch {
            return false;
          }
        }),
    );
    expect(at).toBeGreaterThan(0);
    const assistant = messages[at];
    expect(assistant.tool_calls).toHaveLength(1);
    expect(assistant.tool_calls[0].type).toBe("function");
    expect(typeof assistant.tool_calls[0].id).toBe("string");
    expect(String(assistant.content ?? "")).not.toMatch(MARKUP);
    expect(messages[at + 1]).toMatchObject({ role: "tool", tool_call_id: assistant.tool_calls[0].id });
    expect(run.code).toBe(0);
  });
});

describe("the same markup anywhere else is text", () => {
  const hermes = (name: string, command: string) =>
    `<tool_call>\n{"name": "${name}", "arguments": {"command": "${command}"}}\n</tool_call>`;
  const cases: { label: string; content: string; file: string }[] = [
    {
      label: "inside a ``` code fence",
      content: `This is how the model would call it:\n\n\`\`\`\n${hermes("execute_bash", "touch fenced-ran")}\n\`\`\``,
      file: "fenced-ran",
    },
    {
      label: "Qwen3-Coder XML inside a code fence",
      content:
        "The template writes calls like this:\n```xml\n<tool_call>\n<function=execute_bash>\n<parameter=command>\ntouch xml-fenced-ran\n</parameter>\n</function>\n</tool_call>\n```",
      file: "xml-fenced-ran",
    },
    {
      label: "followed by more prose",
      content: `${hermes("execute_bash", "touch prose-ran")}\n\nAfter that, check the output and tell me what it says.`,
      file: "prose-ran",
    },
    {
      label: "calling an unknown function",
      content: hermes("read_file", "touch unknown-ran"),
      file: "unknown-ran",
    },
    {
      label: "execute_bash without a command argument",
      content: '<tool_call>\n{"name": "execute_bash", "arguments": {"cmd": "touch noarg-ran"}}\n</tool_call>',
      file: "noarg-ran",
    },
  ];

  test.each(cases.map((c) => [c.label, c] as const))("%s", async (_label, c) => {
    const srv = fixtures.serve([{ content: c.content, finishReason: "stop" }, { content: "TASKCOMPLETE" }]);
    const { run, events, cwd } = await play(srv);

    expect(ofType(events, "command")).toEqual([]);
    expect(existsSync(join(cwd, c.file))).toBe(false);
    // A tool-less reply under --nogui: the model is nudged, and the next answer ends the run.
    expect(srv.requests).toHaveLength(2);
    expect(messagesOf(srv.requests[1]).filter((m) => m.role === "assistant" && m.tool_calls?.length)).toEqual([]);
    expect(run.code).toBe(0);
  });
});

// ─── The context window comes from the server ──────────────────────────────────────────────────

/** What aic may ask a server about itself at start (and how). */
const ALLOWED_PROBES = new Set(["GET /v1/models", "GET /props", "GET /api/ps", "POST /api/show"]);

/** The output length a chat request asks for. */
const askedOutput = (body: any): number | undefined => body?.max_tokens ?? body?.max_completion_tokens;

const origin = (srv: FakeServer) => srv.url.replace(/\/v1$/, "");

describe("the context window comes from the server", () => {
  const cases: {
    kind: WindowKind;
    model: string;
    n: number;
    endpoints: (srv: FakeServer) => string[];
  }[] = [
    { kind: "vllm", model: "qwen3-coder", n: 32768, endpoints: (s) => [`${s.url}/models`] },
    { kind: "llamacpp", model: "qwen3-coder", n: 16384, endpoints: (s) => [`${origin(s)}/props`] },
    { kind: "ollama-ps", model: "qwen3:8b", n: 16384, endpoints: (s) => [`${origin(s)}/api/ps`] },
    { kind: "ollama-show", model: "qwen3:8b", n: 12288, endpoints: (s) => [`${origin(s)}/api/show`] },
    {
      kind: "lmstudio",
      model: "qwen3-coder-30b-a3b-instruct",
      n: 24576,
      endpoints: (s) => [`${s.url}/models`, `${origin(s)}/api/v0/models`],
    },
    { kind: "openrouter", model: "qwen/qwen3-coder", n: 65536, endpoints: (s) => [`${s.url}/models`] },
  ];

  test.each(cases.map((c) => [c.kind, c] as const))("%s", async (_kind, c) => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }], { window: { kind: c.kind, n: c.n, model: c.model } });
    const { run, events } = await play(srv, { model: c.model });

    const start = ofType(events, "start")[0];
    expect(start?.budget).toMatchObject({ window: c.n, source: "server" });
    expect(c.endpoints(srv)).toContain(start.budget.endpoint);
    // The endpoint named is one aic really asked.
    expect(srv.probes.map((p) => `${origin(srv)}${p.path}`)).toContain(start.budget.endpoint);

    // The prompt budget and the answer asked for fit in the window together.
    const { prompt_tokens, max_tokens } = start.budget;
    expect(prompt_tokens).toBeGreaterThan(0);
    expect(max_tokens).toBeGreaterThan(0);
    expect(prompt_tokens + max_tokens).toBeLessThanOrEqual(c.n);
    for (const req of srv.requests) {
      expect(askedOutput(req.body)).toBe(max_tokens);
      expect(prompt_tokens + askedOutput(req.body)!).toBeLessThanOrEqual(c.n);
    }

    // Only the questions the servers document, and Ollama's /api/ps with GET.
    for (const p of srv.probes) expect(ALLOWED_PROBES).toContain(`${p.method} ${p.path}`);
    if (c.kind === "ollama-show") {
      expect(srv.probes.find((p) => p.method === "POST" && p.path === "/api/show")?.body).toMatchObject({
        model: c.model,
      });
    }
    if (c.kind.startsWith("ollama"))
      expect(srv.probes.some((p) => p.path === "/api/ps" && p.method === "GET")).toBe(true);
    expect(run.code).toBe(0);
  });

  test("Ollama with the model not loaded and no num_ctx: a warning, and a window of 4096", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }], {
      window: { kind: "ollama-none", n: 0, model: "qwen3:8b" },
    });
    const { events } = await play(srv, { model: "qwen3:8b" });

    const start = ofType(events, "start")[0];
    expect(start?.budget?.window).toBe(4096);
    expect(start.budget.prompt_tokens + start.budget.max_tokens).toBeLessThanOrEqual(4096);
    expect(ofType(events, "warning").some((w) => /4096|4,096/.test(w.text))).toBe(true);
    // The trained maximum /api/show names (qwen3.context_length 40960) is not the window.
    expect(JSON.stringify(start.budget)).not.toContain("40960");
    for (const p of srv.probes) expect(ALLOWED_PROBES).toContain(`${p.method} ${p.path}`);
    // No endpoint said this window: it is Ollama's documented default, so the source is the default.
    expect(start.budget).toMatchObject({ source: "default", endpoint: null });
  });

  test("a server that names no window: the budget is the default, and says so", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const { run, events } = await play(srv, { model: "qwen3-coder" });

    const start = ofType(events, "start")[0];
    expect(start?.budget).toMatchObject({ source: "default", endpoint: null });
    expect(start.budget.prompt_tokens).toBeGreaterThan(0);
    // Not an Ollama server: no 4096 fallback and no warning about one.
    expect(ofType(events, "warning").filter((w) => /4096|4,096/.test(w.text))).toEqual([]);
    for (const p of srv.probes) expect(ALLOWED_PROBES).toContain(`${p.method} ${p.path}`);
    expect(run.code).toBe(0);
  });

  test("--max-prompt-len larger than the window is capped to it, with one warning naming both", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }], {
      window: { kind: "vllm", n: 32768, model: "qwen3-coder" },
    });
    const { run, events } = await play(srv, { model: "qwen3-coder", flags: ["--max-prompt-len", "100000"] });

    const start = ofType(events, "start")[0];
    expect(start?.budget).toMatchObject({ window: 32768, source: "server", endpoint: `${srv.url}/models` });
    expect(start.budget.prompt_tokens + start.budget.max_tokens).toBeLessThanOrEqual(32768);
    const both = ofType(events, "warning").filter((w) => /100[,_ ]?000/.test(w.text) && /32[,_ ]?768/.test(w.text));
    expect(both).toHaveLength(1);
    for (const req of srv.requests)
      expect(start.budget.prompt_tokens + askedOutput(req.body)!).toBeLessThanOrEqual(32768);
    expect(run.code).toBe(0);
  });

  test("--max-prompt-len smaller than the window is the budget", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }], {
      window: { kind: "vllm", n: 32768, model: "qwen3-coder" },
    });
    const { run, events } = await play(srv, { model: "qwen3-coder", flags: ["--max-prompt-len", "12000"] });

    const start = ofType(events, "start")[0];
    expect(start?.budget).toMatchObject({ window: 32768, endpoint: `${srv.url}/models` });
    expect(start.budget.prompt_tokens + start.budget.max_tokens).toBeLessThanOrEqual(32768);
    expect(ofType(events, "warning").filter((w) => /32[,_ ]?768/.test(w.text))).toEqual([]);
    expect(run.code).toBe(0);
    // The budget is the smaller of the window less the reply's reserve (here far above 12000) and
    // the flag: the flag, whole, and it is what set the budget.
    expect(start.budget.prompt_tokens).toBe(12000);
    expect(start.budget.source).toBe("flag");
  });

  test("a small window (8192, llama.cpp /props): every request and every usage report fits in it", async () => {
    const srv = fixtures.serve(
      [bash("echo first", "call_first"), bash("echo second", "call_second"), { content: "TASKCOMPLETE" }],
      { window: { kind: "llamacpp", n: 8192, model: "qwen3-coder" } },
    );
    const { run, events } = await play(srv, { model: "qwen3-coder" });

    const start = ofType(events, "start")[0];
    expect(start?.budget).toMatchObject({ window: 8192, source: "server", endpoint: `${origin(srv)}/props` });
    const budget = start.budget.prompt_tokens;
    expect(srv.requests).toHaveLength(3);
    for (const req of srv.requests) {
      const asked = askedOutput(req.body);
      expect(typeof asked).toBe("number");
      expect(asked!).toBeGreaterThan(0);
      expect(budget + asked!).toBeLessThanOrEqual(8192);
    }
    const usage = ofType(events, "usage");
    expect(usage.length).toBeGreaterThan(0);
    for (const u of usage) expect(u.budget).toBeLessThanOrEqual(8192);
    // n_ctx_train (262144) from llama.cpp's /v1/models is the trained maximum, not the window.
    expect(JSON.stringify(start.budget)).not.toContain("262144");
    expect(run.code).toBe(0);
  });
});

describe("the fake server states each window where its server does (a control on the fixtures)", () => {
  const get = async (url: string, init?: RequestInit): Promise<{ status: number; body: any }> => {
    const res = await fetch(url, init);
    return {
      status: res.status,
      body: res.headers.get("content-type")?.includes("json") ? await res.json() : await res.text(),
    };
  };
  const entry = (list: any, model: string) => list.data.find((m: any) => m.id === model);

  test("each kind, the window in its own field, and every question recorded", async () => {
    const n = 20480;
    const at = (kind: WindowKind, model = "m:1") => fixtures.serve([], { window: { kind, n, model } });

    let s = at("vllm");
    expect(entry((await get(`${s.url}/models`)).body, "m:1").max_model_len).toBe(n);

    s = at("llamacpp");
    expect((await get(`${origin(s)}/props`)).body.default_generation_settings.n_ctx).toBe(n);
    expect(entry((await get(`${s.url}/models`)).body, "m:1").meta.n_ctx_train).not.toBe(n);

    s = at("ollama-ps");
    const ps = (await get(`${origin(s)}/api/ps`)).body;
    expect(ps.models.find((m: any) => m.name === "m:1").context_length).toBe(n);
    expect((await get(`${origin(s)}/api/ps`, { method: "POST" })).status).toBe(405);

    s = at("ollama-show");
    expect((await get(`${origin(s)}/api/ps`)).body.models.some((m: any) => m.name === "m:1")).toBe(false);
    const show = (await get(`${origin(s)}/api/show`, { method: "POST", body: JSON.stringify({ model: "m:1" }) })).body;
    expect(show.parameters).toMatch(new RegExp(`^num_ctx +${n}$`, "m"));
    expect(show.model_info["qwen3.context_length"]).not.toBe(n);
    expect(
      (await get(`${origin(s)}/api/show`, { method: "POST", body: JSON.stringify({ model: "other" }) })).status,
    ).toBe(404);
    expect(s.probes.map((p) => [p.method, p.path, p.body])).toEqual([
      ["GET", "/api/ps", null],
      ["POST", "/api/show", { model: "m:1" }],
      ["POST", "/api/show", { model: "other" }],
    ]);

    s = at("ollama-none");
    expect((await get(`${origin(s)}/api/ps`)).body.models).toEqual([]);
    expect(
      (await get(`${origin(s)}/api/show`, { method: "POST", body: JSON.stringify({ model: "m:1" }) })).body.parameters,
    ).not.toContain("num_ctx");

    s = at("lmstudio");
    expect(entry((await get(`${s.url}/models`)).body, "m:1").max_context_length).toBe(n);

    s = at("openrouter");
    const or = (await get(`${s.url}/models`)).body;
    expect(entry(or, "m:1").context_length).toBe(n);
    expect(or.data[0].id).not.toBe("m:1"); // another model, another window, comes first
    expect(s.requests).toEqual([]); // probes are kept apart from chat requests
  });
});

// ─── Local prefill is not a failure ───────────────────────────────────────────────────────────

describe("a long wait before the first chunk (prefill) is waited out", () => {
  // The between-chunk silence limit is 300 ms here; the first chunk comes after 2 s.
  const env = { AIC_STREAM_IDLE_MS: "300", AIC_MODEL_REQUEST_TIMEOUT_MS: "60000" };

  test.each([
    ["headers at once, first chunk after the wait", true],
    ["nothing at all, headers included, until the first chunk", false],
  ] as const)("%s: one request, shown as model_wait", async (_label, headersFirst) => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE", firstChunkDelayMs: 2000, headersFirst }]);
    const { run, events } = await play(srv, { model: "qwen3-coder", env });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(1); // no retry, no resend of a prompt the server is reading
    expect(ofType(events, "retry")).toEqual([]);
    const waits = ofType(events, "model_wait");
    expect(waits.length).toBeGreaterThanOrEqual(1);
    for (const w of waits) {
      expect(typeof w.elapsed_ms).toBe("number");
      expect(w.elapsed_ms).toBeGreaterThan(0);
    }
  });

  test("without --json the person reads that aic is waiting for the model", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE", firstChunkDelayMs: 2000 }]);
    const { run } = await play(srv, { model: "qwen3-coder", env, json: false });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(1);
    expect(run.stderr).toContain("waiting for the model");
  });

  test("llama.cpp's prompt_progress is passed on in model_wait", async () => {
    // Progress frames 400 ms apart, under a 1 s silence limit: whether or not aic counts them as
    // chunks, nothing here is a stalled stream.
    const progress = [250, 500, 750, 1000].map((processed, i) => ({
      total: 1000,
      cache: 0,
      processed,
      time_ms: 400 * (i + 1),
    }));
    const srv = fixtures.serve([{ content: "TASKCOMPLETE", firstChunkDelayMs: 2000, promptProgress: progress }]);
    const { run, events } = await play(srv, {
      model: "qwen3-coder",
      env: { AIC_STREAM_IDLE_MS: "1000", AIC_MODEL_REQUEST_TIMEOUT_MS: "60000" },
    });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(1);
    const withProgress = ofType(events, "model_wait").filter((e) => e.prompt_progress);
    expect(withProgress.length).toBeGreaterThanOrEqual(1);
    for (const e of withProgress) {
      expect(e.prompt_progress.total).toBe(1000);
      expect([250, 500, 750, 1000]).toContain(e.prompt_progress.processed);
    }
    // The progress frames are not content.
    expect(ofType(events, "assistant").map((e) => e.content)).toEqual(["TASKCOMPLETE"]);
  });

  test("the request timeout still bounds a server that never answers", async () => {
    const srv = fixtures.serve([{ type: "hang" }, { content: "TASKCOMPLETE" }] as Turn[]);
    const { run, events } = await play(srv, {
      model: "qwen3-coder",
      env: { AIC_STREAM_IDLE_MS: "300", AIC_MODEL_REQUEST_TIMEOUT_MS: "2500" },
    });

    // aic ended on its own (retried or gave up), long before the test's guard would have killed it.
    expect(run.code).not.toBe(128 + 9);
    expect(ofType(events, "end")).toHaveLength(1);
    expect(ofType(events, "model_wait").length).toBeGreaterThanOrEqual(1);
  });
});

// ─── The model knows its time ──────────────────────────────────────────────────────────────────

describe("the model knows its time", () => {
  const turns = (): Turn[] => [bash("echo a", "call_a"), bash("echo b", "call_b"), { content: "TASKCOMPLETE" }];
  const TIME_LEFT = /\[time left: .+ of .+\]$/;
  const toolMessages = (srv: FakeServer) =>
    srv.requests.flatMap((req, i) =>
      messagesOf(req)
        .filter((m) => m.role === "tool")
        .map((m) => ({ request: i, id: m.tool_call_id, content: String(m.content) })),
    );

  test("--max-time 600: the system prompt states the budget, and every tool result ends with the time left", async () => {
    const srv = fixtures.serve(turns());
    const { run } = await play(srv, { flags: ["--max-time", "600"] });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(3);
    expect(messagesOf(srv.requests[0])[0].content).toMatch(/\b600\b|10 min/);
    const tools = toolMessages(srv);
    expect(tools.length).toBe(3); // call_a in requests 1 and 2, call_b in request 2
    for (const t of tools)
      expect({ ...t, last: t.content.trimEnd().split("\n").at(-1) }).toMatchObject({
        last: expect.stringMatching(TIME_LEFT),
      });
  });

  test("without --max-time, neither", async () => {
    const srv = fixtures.serve(turns());
    const { run } = await play(srv);

    expect(run.code).toBe(0);
    expect(messagesOf(srv.requests[0])[0].content).not.toMatch(/\b600\b|10 min|time left/);
    for (const t of toolMessages(srv)) expect(t.content).not.toContain("[time left:");
  });
});
