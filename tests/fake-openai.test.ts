/**
 * Tests for the fake OpenAI server, driven through the official `openai` SDK so that what the
 * agent's client sees (including how the SDK turns error frames into exceptions) is pinned down.
 */
import { afterEach, beforeAll, describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import OpenAI, { APIError, APIUserAbortError, RateLimitError } from "openai";
import type { ChatCompletionChunk } from "openai/resources/chat/completions";
import { countPromptTokens, startFakeServer, type FakeServer, type Turn } from "./fake-openai.ts";
import { lineReader, reapAfterAll, scratch, waitFor } from "./helpers.ts";

reapAfterAll();

// Loading the o200k_base table takes ~0.3 s idle but several seconds on a loaded machine; do it
// once up front with a generous limit so it cannot push an individual test past the default 5 s.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

/** The CLI test starts a second bun process (which loads tiktoken again), so it gets extra time. */
const SLOW_TEST_MS = 60_000;

let server: FakeServer | undefined;
afterEach(() => {
  server?.close();
  server = undefined;
});

function setup(turns: Turn[] | ((req: any, index: number) => Turn), inflation?: number) {
  server = startFakeServer({ turns, inflation });
  const client = new OpenAI({ baseURL: server.url, apiKey: "x", maxRetries: 0 });
  return { server, client };
}

const userMessages = [{ role: "user" as const, content: "list the files in /tmp" }];

/** Drain a stream, keeping whatever arrived before an error so tests can assert on both. */
async function collect(
  client: OpenAI,
  extra: Partial<OpenAI.Chat.ChatCompletionCreateParamsStreaming> = {},
): Promise<{ chunks: ChatCompletionChunk[]; error?: unknown }> {
  const chunks: ChatCompletionChunk[] = [];
  try {
    const stream = await client.chat.completions.create({
      model: "fake-model",
      messages: userMessages,
      stream: true,
      stream_options: { include_usage: true },
      ...extra,
    });
    for await (const chunk of stream) chunks.push(chunk);
    return { chunks };
  } catch (error) {
    return { chunks, error };
  }
}

const deltas = (chunks: ChatCompletionChunk[]) => chunks.flatMap((c) => c.choices.map((choice) => choice.delta as any));

describe("reply turns", () => {
  test("content reply streams in pieces with role first, finish, and usage last", async () => {
    const { client } = setup([
      { content: "hello there, world", contentPieces: 3, reasoning: "thinking hard", reasoningField: "reasoning" },
    ]);
    const { chunks, error } = await collect(client);
    expect(error).toBeUndefined();

    const ds = deltas(chunks);
    expect(ds[0]).toEqual({ role: "assistant" });
    expect(ds.map((d) => d.reasoning ?? "").join("")).toBe("thinking hard");
    expect(ds.some((d) => "reasoning_content" in d)).toBe(false);
    const contentChunks = ds.filter((d) => typeof d.content === "string");
    expect(contentChunks).toHaveLength(3);
    expect(contentChunks.map((d) => d.content).join("")).toBe("hello there, world");

    const finishes = chunks.flatMap((c) => c.choices.map((ch) => ch.finish_reason)).filter(Boolean);
    expect(finishes).toEqual(["stop"]);

    const last = chunks.at(-1)!;
    expect(last.choices).toEqual([]);
    expect(last.usage?.prompt_tokens).toBe(Math.ceil(countPromptTokens(userMessages) * 1.3));
    expect(last.usage?.completion_tokens).toBeGreaterThan(0);
    expect(last.usage?.total_tokens).toBe(last.usage!.prompt_tokens + last.usage!.completion_tokens);
    expect(last.usage?.prompt_tokens_details?.cached_tokens).toBe(0);
  });

  test("usage overrides win, and no usage chunk without include_usage", async () => {
    const { client } = setup([
      { content: "a", usage: { prompt_tokens: 123, completion_tokens: 7, cached_tokens: 100 } },
      { content: "b" },
    ]);
    const first = await collect(client);
    const usage = first.chunks.at(-1)!.usage!;
    expect(usage).toMatchObject({ prompt_tokens: 123, completion_tokens: 7, total_tokens: 130 });
    expect(usage.prompt_tokens_details?.cached_tokens).toBe(100);

    const second = await collect(client, { stream_options: undefined });
    expect(second.chunks.some((c) => c.usage)).toBe(false);
    expect(second.chunks.at(-1)!.choices[0]!.finish_reason).toBe("stop");
  });

  test("tool calls split into pieces with omitted index", async () => {
    const args0 = JSON.stringify({ command: "ls -la /tmp", timeout: 30 });
    const args1 = JSON.stringify({ command: "echo 'ünïcode ✓'" });
    const { client } = setup([
      {
        content: "running",
        toolCalls: [{ arguments: args0 }, { id: "custom", name: "other_tool", arguments: args1 }],
        argPieces: 4,
        omitIndex: true,
      },
    ]);
    const { chunks, error } = await collect(client);
    expect(error).toBeUndefined();

    const callDeltas = deltas(chunks).flatMap((d) => d.tool_calls ?? []);
    expect(callDeltas).toHaveLength(8);
    expect(callDeltas.every((d: any) => !("index" in d))).toBe(true);

    // id/name only on the first delta of each call, so a client must rely on id changes to split calls.
    const withId = callDeltas.filter((d: any) => d.id !== undefined);
    expect(withId.map((d: any) => [d.id, d.type, d.function.name])).toEqual([
      ["call_0_0", "function", "execute_bash"],
      ["custom", "function", "other_tool"],
    ]);
    expect(
      callDeltas
        .slice(0, 4)
        .map((d: any) => d.function.arguments)
        .join(""),
    ).toBe(args0);
    expect(
      callDeltas
        .slice(4)
        .map((d: any) => d.function.arguments)
        .join(""),
    ).toBe(args1);
    expect(chunks.flatMap((c) => c.choices.map((ch) => ch.finish_reason)).filter(Boolean)).toEqual(["tool_calls"]);
  });

  test("omitIds: no tool-call delta carries an id", async () => {
    const { client } = setup([
      { toolCalls: [{ id: "call_never_sent", arguments: '{"command":"pwd"}' }], argPieces: 3, omitIds: true },
    ]);
    const { chunks } = await collect(client);
    const callDeltas = deltas(chunks).flatMap((d) => d.tool_calls ?? []);
    expect(callDeltas).toHaveLength(3);
    expect(callDeltas.some((d: any) => "id" in d)).toBe(false);
    expect(callDeltas[0].function.name).toBe("execute_bash");
    expect(callDeltas.map((d: any) => d.function.arguments).join("")).toBe('{"command":"pwd"}');
  });

  test("idOnFirstChunkOnly: false repeats id and name, index present by default", async () => {
    const { client } = setup([
      { toolCalls: [{ arguments: '{"command":"pwd"}' }], argPieces: 3, idOnFirstChunkOnly: false },
    ]);
    const { chunks } = await collect(client);
    const callDeltas = deltas(chunks).flatMap((d) => d.tool_calls ?? []);
    expect(callDeltas).toHaveLength(3);
    expect(
      callDeltas.every((d: any) => d.index === 0 && d.id === "call_0_0" && d.function.name === "execute_bash"),
    ).toBe(true);
  });

  test("delayMs spaces chunks out", async () => {
    const { client } = setup([{ content: "slow reply", contentPieces: 3, delayMs: 60 }]);
    const started = Date.now();
    const { error } = await collect(client);
    expect(error).toBeUndefined();
    // role, 3 content, finish, usage, [DONE] = 7 frames => 6 gaps of 60 ms.
    expect(Date.now() - started).toBeGreaterThanOrEqual(300);
  });

  test("after the scripted turns run out, TASKCOMPLETE is answered", async () => {
    const { client } = setup([{ content: "first" }]);
    await collect(client);
    const { chunks } = await collect(client);
    expect(
      deltas(chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("TASKCOMPLETE");
  });
});

describe("failure turns", () => {
  test("http_error 429 with Retry-After is a RateLimitError with status and header", async () => {
    const { client, server } = setup([
      {
        type: "http_error",
        status: 429,
        headers: { "retry-after": "7" },
        body: { error: { message: "Rate limit reached", type: "rate_limit_error", code: "rate_limit_exceeded" } },
      },
    ]);
    const { chunks, error } = await collect(client);
    expect(chunks).toHaveLength(0);
    expect(error).toBeInstanceOf(APIError);
    expect(error).toBeInstanceOf(RateLimitError);
    const apiError = error as APIError;
    expect(apiError.status).toBe(429);
    expect(apiError.headers?.get("retry-after")).toBe("7");
    expect(apiError.message).toBe("429 Rate limit reached");
    expect(apiError.code).toBe("rate_limit_exceeded");
    expect(server.requests).toHaveLength(1); // maxRetries: 0 means the SDK did not retry
  });

  test("http_error with a string body is sent raw", async () => {
    const { client } = setup([{ type: "http_error", status: 503, body: "upstream overloaded" }]);
    const { error } = await collect(client);
    expect((error as APIError).status).toBe(503);
    expect((error as APIError).message).toBe("503 upstream overloaded");
  });

  // Observed SDK behaviour: content before the error is yielded, then iteration throws a *plain*
  // APIError with status undefined (not RateLimitError etc., whatever the payload says), and the
  // SDK never retries it because the request already succeeded with 200.
  test("stream_error as a data frame: partial content, then APIError without status", async () => {
    const { server } = setup([
      {
        type: "stream_error",
        partialContent: "partial ans",
        error: { message: "Overloaded", type: "server_error", code: "overloaded" },
      },
    ]);
    const retrying = new OpenAI({ baseURL: server.url, apiKey: "x", maxRetries: 3 });
    const { chunks, error } = await collect(retrying);
    expect(
      deltas(chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("partial ans");
    expect(error).toBeInstanceOf(APIError);
    expect(error).not.toBeInstanceOf(RateLimitError);
    const apiError = error as APIError;
    expect(apiError.status).toBeUndefined();
    expect(apiError.message).toBe("Overloaded");
    expect(apiError.code).toBe("overloaded");
    expect(apiError.type).toBe("server_error");
    expect(apiError.headers?.get("content-type")).toContain("text/event-stream");
    expect(server.requests).toHaveLength(1); // not retried even with maxRetries: 3
  });

  test("stream_error as an `event: error` frame throws the same way", async () => {
    const { client } = setup([
      { type: "stream_error", partialContent: "x", error: { message: "boom", code: 529 }, eventFrame: true },
    ]);
    const { chunks, error } = await collect(client);
    expect(
      deltas(chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("x");
    expect(error).toBeInstanceOf(APIError);
    expect((error as APIError).status).toBeUndefined();
    expect((error as APIError).message).toBe("boom");
    expect((error as APIError).code).toBe(529 as any); // numeric codes pass through untouched
  });

  test("stream_error edge cases: string error, and a falsy error slips through as a chunk", async () => {
    const { client } = setup([
      { type: "stream_error", partialContent: "", error: "plain string" },
      { type: "stream_error", partialContent: "half", error: null },
    ]);
    const stringCase = await collect(client);
    // Non-object errors are JSON.stringified into the message, quotes included.
    expect((stringCase.error as APIError).message).toBe('"plain string"');

    // `data: {"error": null}` is *not* treated as an error: the SDK yields it as a chunk with no
    // `choices`, and the stream just ends (no [DONE]). A client indexing choices[0] would crash.
    const nullCase = await collect(client);
    expect(nullCase.error).toBeUndefined();
    expect(nullCase.chunks.at(-1) as unknown).toEqual({ error: null });
  });

  test("empty_stream: the SDK yields nothing and does not throw", async () => {
    const { client, server } = setup([{ type: "empty_stream" }]);
    const { chunks, error } = await collect(client);
    expect(error).toBeUndefined();
    expect(chunks).toHaveLength(0);
    expect(server.requests).toHaveLength(1);
  });

  test("truncated_stream: partial content, no finish_reason, and no error from the SDK", async () => {
    const { client } = setup([{ type: "truncated_stream", partialContent: "cut off" }]);
    const { chunks, error } = await collect(client);
    expect(error).toBeUndefined();
    expect(
      deltas(chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("cut off");
    expect(chunks.some((c) => c.choices.some((ch) => ch.finish_reason))).toBe(false);
  });

  test("hang never answers until the client aborts", async () => {
    const { client, server } = setup([{ type: "hang" }, { content: "answered meanwhile" }]);
    const controller = new AbortController();
    let settled = false;
    const promise = client.chat.completions
      .create({ model: "fake-model", messages: userMessages, stream: true }, { signal: controller.signal })
      .then(
        () => undefined,
        (e: unknown) => e,
      )
      .finally(() => (settled = true));
    await waitFor("the hanging request to reach the server", () => server.requests.length === 1);
    // A whole second exchange completes while the first still has no answer.
    const other = await collect(client);
    expect(
      deltas(other.chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("answered meanwhile");
    expect(settled).toBe(false);
    controller.abort();
    const error = await promise;
    expect(error).toBeInstanceOf(APIUserAbortError);
    expect(server.requests).toHaveLength(2);
  });
});

describe("recording and routing", () => {
  test("records path, headers, parsed body and time of every chat request", async () => {
    const seen: number[] = [];
    const { client, server } = setup((req, index) => {
      seen.push(index);
      return { content: `turn ${index} saw ${req.body.messages.length} messages` };
    }, 2);
    const before = Date.now();
    const tools = [
      { type: "function" as const, function: { name: "execute_bash", parameters: { type: "object", properties: {} } } },
    ];
    const first = await collect(client, { tools });
    const history = [
      ...userMessages,
      {
        role: "assistant" as const,
        content: null,
        tool_calls: [
          {
            id: "call_0_0",
            type: "function" as const,
            function: { name: "execute_bash", arguments: '{"command":"ls"}' },
          },
        ],
      },
      { role: "tool" as const, tool_call_id: "call_0_0", content: "a.txt\nb.txt" },
    ];
    const second = await collect(client, { messages: history });

    expect(seen).toEqual([0, 1]);
    expect(
      deltas(first.chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("turn 0 saw 1 messages");
    expect(
      deltas(second.chunks)
        .map((d) => d.content ?? "")
        .join(""),
    ).toBe("turn 1 saw 3 messages");

    expect(server.requests).toHaveLength(2);
    const [r0, r1] = server.requests;
    expect(r0!.path).toBe("/v1/chat/completions");
    expect(r0!.headers["authorization"]).toBe("Bearer x");
    expect(r0!.headers["content-type"]).toContain("application/json");
    expect(r0!.body).toMatchObject({ model: "fake-model", stream: true, messages: userMessages, tools });
    expect(r0!.at).toBeGreaterThanOrEqual(before);
    expect(r1!.at).toBeGreaterThanOrEqual(r0!.at);
    expect(r1!.body.messages[1].tool_calls[0].function.arguments).toBe('{"command":"ls"}');

    // Inflation 2 applies to the tool-call-bearing history too.
    expect(second.chunks.at(-1)!.usage!.prompt_tokens).toBe(Math.ceil(countPromptTokens(history) * 2));
  });

  test("countPromptTokens counts content, tool call names/args, and 4 per message", () => {
    expect(countPromptTokens([])).toBe(0);
    expect(countPromptTokens([{ role: "user", content: "" }])).toBe(4);
    const text = countPromptTokens([{ role: "user", content: "hello world" }]);
    expect(text).toBe(4 + 2);
    const parts = countPromptTokens([{ role: "user", content: [{ type: "text", text: "hello world" }] }]);
    expect(parts).toBe(text);
    const withCall = countPromptTokens([
      {
        role: "assistant",
        content: null,
        tool_calls: [{ function: { name: "execute_bash", arguments: '{"command":"ls"}' } }],
      },
    ]);
    expect(withCall).toBeGreaterThan(4 + 3);
  });

  test("GET /v1/models lists models; unknown paths get a 404 JSON error", async () => {
    const { client, server } = setup([]);
    const models = [];
    for await (const m of client.models.list()) models.push(m.id);
    expect(models).toContain("fake-model");

    const res = await fetch(server.url.replace(/\/v1$/, "/nope"));
    expect(res.status).toBe(404);
    expect(((await res.json()) as any).error.message).toContain("/nope");
    expect(server.requests).toHaveLength(0); // only chat completions are recorded
  });

  test(
    "CLI mode serves a script file and dumps requests next to it",
    async () => {
      const dir = scratch("fake-openai-");
      const script = join(dir, "turns.json");
      writeFileSync(script, JSON.stringify([{ content: "from the script" }]));
      const proc = Bun.spawn(["bun", join(import.meta.dir, "fake-openai.ts"), "--script", script], {
        stdout: "pipe",
        stderr: "inherit",
      });
      try {
        const lines = lineReader(proc.stdout);
        const url = ((await lines.next()) ?? "").trim();
        lines.release();
        expect(url).toMatch(/^http:\/\/127\.0\.0\.1:\d+\/v1$/);

        const client = new OpenAI({ baseURL: url, apiKey: "x", maxRetries: 0 });
        const { chunks } = await collect(client);
        expect(
          deltas(chunks)
            .map((d) => d.content ?? "")
            .join(""),
        ).toBe("from the script");

        const recorded = JSON.parse(readFileSync(`${script}.requests.json`, "utf8"));
        expect(recorded).toHaveLength(1);
        expect(recorded[0].body.messages).toEqual(userMessages);
      } finally {
        proc.kill();
        await proc.exited;
      }
    },
    SLOW_TEST_MS,
  );
});
