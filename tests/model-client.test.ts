/**
 * The model client and its retry policy (README: "The model endpoint and its failures"): the real
 * ModelClient, the real openai SDK and real HTTP against the fake OpenAI server, which answers
 * with error statuses, broken streams and provider replies on the wire. Only the waiting is not
 * real: the client is given a RetryWait that records each wait and returns at once, so a policy
 * of 1 s, 2 s, 4 s, 8 s is checked as those numbers without sitting through 15 seconds.
 *
 * What only the binary shows (exit codes, stderr lines, JSON events, signals) keeps a small
 * end-to-end set in model-errors.test.ts and trust.test.ts.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import { ModelClient, type CompletionRequest, type RetryWait, parseArgs } from "../aic.ts";
import { countPromptTokens, type FakeServer, type Turn } from "./fake-openai.ts";
import { bash, httpError, perTestFixtures, requestSequenceProblems, scratch, waitFor } from "./helpers.ts";
import { PROVIDER_FIXTURES, type Outcome, type ProviderFixture } from "./provider-fixtures.ts";
import { RecordingSink, runInProcess } from "./scripted-model.ts";

const fixtures = perTestFixtures();

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

/** What ModelClient throws: a ModelError (not exported), read by its fields. */
type Failure = Error & { kind?: string; retryAfterMs?: number };

const REQUEST: CompletionRequest = {
  messages: [
    { role: "system", content: "You are a shell agent." },
    { role: "user", content: "do the task" },
  ],
  tools: true,
  temperature: 0.2,
};

/** A client of `url` whose retry waits are recorded and return at once (or throw once the run is stopped). */
function clientOf(url: string, opts: { wait?: RetryWait; sink?: RecordingSink } = {}) {
  const parsed = parseArgs(["--nogui", "--api-base", url, "--model", "test-model", "do the task"], {});
  if (parsed.kind !== "run") throw new Error(`not a run: ${JSON.stringify(parsed)}`);
  const sink = opts.sink ?? new RecordingSink();
  const waits: number[] = [];
  const instant: RetryWait = async (ms, signal) => {
    waits.push(ms);
    if (signal.aborted) throw new Error("stopped");
  };
  const client = new ModelClient(parsed.config, sink, opts.wait ?? instant);
  return { client, sink, waits, config: parsed.config };
}

/** One completion with retries; what it returned or threw, what it streamed and what it discarded. */
async function complete(client: ModelClient, signal = new AbortController().signal) {
  let shown = "";
  const discarded: string[] = [];
  try {
    const turn = await client.completeWithRetries(() => REQUEST, signal, {
      onContent: (t) => (shown += t),
      onReasoning: (t) => (shown += t),
      onDiscard: (reason) => discarded.push(reason),
    });
    return { turn, error: undefined, shown, discarded };
  } catch (error) {
    return { turn: undefined, error: error as Failure, shown, discarded };
  }
}

/** A server scripted with `turns` and a client of it; then one completion. */
async function play(turns: Turn[] | ((index: number) => Turn)) {
  const srv = fixtures.serve(typeof turns === "function" ? (_req, i) => turns(i) : turns);
  const c = clientOf(srv.url);
  const result = await complete(c.client);
  return { srv, ...c, ...result };
}

/** A URL where nothing listens: a server's port, just after it stopped. */
function deadUrl(): string {
  const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => new Response("") });
  const port = server.port;
  server.stop(true);
  return `http://127.0.0.1:${port}/v1`;
}

const inStream = (error: unknown, partialContent = "", eventFrame = false): Turn => ({
  type: "stream_error",
  partialContent,
  error,
  eventFrame,
});
const turnOf = (f: ProviderFixture): Turn =>
  f.frames
    ? { type: "sse", frames: f.frames }
    : { type: "http_error", status: f.status, body: f.body, headers: f.headers };
const fixturesOf = (outcome: Outcome) =>
  PROVIDER_FIXTURES.filter((f) => f.expected === outcome).map((f) => [f.name, f] as const);

describe("transient failures: waited out and retried", () => {
  test("a 500 is retried after 1 s, the wait is told to the sink, and the next answer is returned", async () => {
    const r = await play([httpError(500, { error: { message: "Internal server error", type: "server_error" } })]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(2);
    expect(r.waits).toEqual([1000]);
    expect(r.sink.of("retry")).toEqual([
      { type: "retry", attempt: 1, wait_ms: 1000, reason: expect.stringContaining("Internal server error") },
    ]);
    // Nothing was shown before the failure, so there is nothing to disregard.
    expect(r.discarded).toEqual([]);
  });

  test("five 503s: five attempts with waits of 1, 2, 4 and 8 s, then the failure is the caller's", async () => {
    const r = await play(() =>
      httpError(503, { error: { message: "The server is overloaded", type: "server_error" } }),
    );
    expect(r.srv.requests).toHaveLength(5);
    expect(r.waits).toEqual([1000, 2000, 4000, 8000]);
    expect(r.sink.of("retry").map((e) => e.attempt)).toEqual([1, 2, 3, 4]);
    expect(r.error?.kind).toBe("retry");
    expect(r.error?.message).toContain("overloaded");
  });

  // Bodies of every shape are judged by status and text: an array, plain text, no body at all.
  const shapes: [string, Turn][] = [
    ["a JSON array with 429", httpError(429, [{ error: { message: "quota" } }])],
    ["plain text with 503", httpError(503, "Service Unavailable")],
    ["408", httpError(408, { error: { message: "request timeout" } })],
    ["409", httpError(409, { error: { message: "conflict" } })],
    ["a stream without any data", { type: "empty_stream" }],
    ["a numeric 503 inside the stream", inStream({ code: 503, message: "overloaded" })],
  ];
  for (const [label, turn] of shapes)
    test(`${label}: retried once after 1 s`, async () => {
      const r = await play([turn]);
      expect(r.turn?.content).toBe("TASKCOMPLETE");
      expect(r.srv.requests).toHaveLength(2);
      expect(r.waits).toEqual([1000]);
    });
});

describe("the server's own wait is honoured", () => {
  const rateLimit = { error: { message: "Rate limit reached", type: "rate_limit_error" } };
  const cases: [string, Turn, number][] = [
    ["Retry-After in seconds", httpError(429, rateLimit, { "retry-after": "3" }), 3000],
    ["retry-after-ms", httpError(429, rateLimit, { "retry-after-ms": "1500" }), 1500],
    ["Retry-After: 0 (a rate limit that has already passed)", httpError(429, rateLimit, { "retry-after": "0" }), 0],
    ["'try again in 2.5s' in the message", httpError(429, { error: { message: "Please try again in 2.5s." } }), 2500],
    ["'retry in 700ms' in the message", httpError(503, { error: { message: "busy, retry in 700ms" } }), 700],
    ["a wait over a minute is cut to a minute", httpError(429, rateLimit, { "retry-after": "120" }), 60_000],
  ];
  for (const [label, turn, expected] of cases)
    test(label, async () => {
      const r = await play([turn]);
      expect(r.turn?.content).toBe("TASKCOMPLETE");
      expect(r.waits).toEqual([expected]);
      expect(r.sink.of("retry")[0]?.wait_ms).toBe(expected);
    });

  test("Retry-After as an HTTP date", async () => {
    const date = new Date(Date.now() + 30_000).toUTCString();
    const r = await play([httpError(503, { error: { message: "maintenance" } }, { "retry-after": date })]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    // The date has whole seconds: the wait is what is left of the 30 s when the answer came.
    expect(r.waits[0]).toBeGreaterThan(20_000);
    expect(r.waits[0]).toBeLessThanOrEqual(30_000);
  });

  // The ordinary rate limit stays transient even though exhausted quotas are fatal (see below).
  test("an ordinary 429 rate_limit_exceeded is retried", async () => {
    const r = await play([
      httpError(429, { error: { message: "Rate limit reached", code: "rate_limit_exceeded" } }, { "retry-after": "0" }),
    ]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(2);
  });
});

describe("provider replies that must be waited out (tests/provider-fixtures.ts)", () => {
  test.each(fixturesOf("retry"))("%s", async (_name, f) => {
    const r = await play([turnOf(f)]);
    expect(r.error).toBeUndefined();
    expect(r.srv.requests).toHaveLength(2);
    expect(r.sink.of("retry")).toHaveLength(1);
    // The server's own hint, not the 1 s first backoff, not a multi-second guess.
    if (f.hintMs !== undefined) {
      expect(r.waits[0]!).toBeGreaterThanOrEqual(f.hintMs);
      expect(r.waits[0]!).toBeLessThanOrEqual(f.hintMs + 1500);
    }
  });

  // "Like a 5xx" includes its bound: an in-stream error on every attempt ends after five attempts.
  test.each(fixturesOf("retry").filter(([, f]) => f.frames))("%s, on every attempt: five attempts", async (_n, f) => {
    const r = await play(() => turnOf(f));
    expect(r.srv.requests).toHaveLength(5);
    expect(r.waits).toEqual([1000, 2000, 4000, 8000]);
    expect(r.error?.kind).toBe("retry");
  });
});

describe("failures waiting cannot fix: given up at once, naming what to fix", () => {
  const badKey = {
    error: { message: "Incorrect API key provided", type: "invalid_request_error", code: "invalid_api_key" },
  };
  const cases: [string, Turn, RegExp][] = [
    ["HTTP 401 with an error object", httpError(401, badKey), /refused the API key.*--api-key/],
    ["HTTP 403 with an error object", httpError(403, badKey), /refused the API key.*--api-key/],
    ["HTTP 401 with a flat object", httpError(401, { message: "Invalid API key" }), /--api-key/],
    ["HTTP 401 with plain text", httpError(401, "Unauthorized"), /--api-key/],
    [
      "HTTP 404: an unknown model",
      httpError(404, {
        error: {
          message: "The model `test-model` does not exist",
          type: "invalid_request_error",
          code: "model_not_found",
        },
      }),
      /does not know this model.*--model.*--api-base/,
    ],
    [
      "HTTP 400 not about the context",
      httpError(400, {
        error: { message: "Invalid value for 'reasoning_effort': must be low, medium or high", code: null },
      }),
      /reasoning_effort/,
    ],
    [
      "HTTP 429 insufficient_quota",
      httpError(429, {
        error: {
          message: "You exceeded your current quota, please check your plan and billing details.",
          type: "insufficient_quota",
          code: "insufficient_quota",
        },
      }),
      /account.*billing/,
    ],
    ["HTTP 402", httpError(402, { error: { message: "payment required" } }), /account.*billing/],
    [
      "invalid_api_key inside the stream",
      inStream({ code: "invalid_api_key", message: "Incorrect API key provided" }),
      /--api-key/,
    ],
    ["model_not_found inside the stream", inStream({ code: "model_not_found", message: "no such model" }), /--model/],
    [
      "insufficient_quota inside the stream",
      inStream({ code: "insufficient_quota", message: "You exceeded your current quota" }),
      /billing/,
    ],
    ["a numeric 401 inside the stream", inStream({ code: 401, message: "unauthorised" }), /--api-key/],
    [
      "type authentication_error inside the stream",
      inStream({ type: "authentication_error", message: "invalid x-api-key" }),
      /--api-key/,
    ],
  ];
  for (const [label, turn, names] of cases)
    test(label, async () => {
      const r = await play([turn]);
      expect(r.error?.kind).toBe("fatal");
      expect(r.error?.message).toMatch(names);
      expect(r.srv.requests).toHaveLength(1);
      expect(r.waits).toEqual([]);
      expect(r.sink.of("retry")).toEqual([]);
    });

  test.each(fixturesOf("fatal"))("%s", async (_name, f) => {
    const r = await play([turnOf(f)]);
    expect(r.error?.kind).toBe("fatal");
    expect(r.error?.message).toMatch(/quota|credit|billing/i);
    expect(r.srv.requests).toHaveLength(1);
    expect(r.waits).toEqual([]);
  });

  test("a context overflow goes back to the caller at once, to compress harder", async () => {
    const r = await play([
      httpError(400, {
        error: {
          message:
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 13000 tokens. Please reduce the length of the messages.",
          type: "invalid_request_error",
          code: "context_length_exceeded",
        },
      }),
    ]);
    expect(r.error?.kind).toBe("context");
    expect(r.error?.message).toContain("the prompt is too long for the model");
    expect(r.srv.requests).toHaveLength(1);
    expect(r.waits).toEqual([]);
  });
});

describe("an endpoint nobody answers at", () => {
  test("connection refused before any answer: three quick attempts, then fatal, naming the URL and --api-base", async () => {
    const url = deadUrl();
    const { client, waits, sink } = clientOf(url);
    const { error } = await complete(client);
    expect(error?.kind).toBe("fatal");
    expect(error?.message).toContain(`cannot reach ${url}`);
    expect(error?.message).toContain("refused");
    expect(error?.message).toContain("--api-base");
    expect(waits).toEqual([500, 1000]);
    expect(sink.of("retry").map((e) => e.wait_ms)).toEqual([500, 1000]);
  });

  test("an unknown host names the URL and --api-base", async () => {
    const { client, waits } = clientOf("http://no-such-host.invalid/v1");
    const { error } = await complete(client);
    expect(error?.kind).toBe("fatal");
    expect(error?.message).toMatch(/^cannot reach http:\/\/no-such-host\.invalid\/v1 \(.*--api-base/);
    expect(waits.length).toBeLessThanOrEqual(2);
  });

  // Once the endpoint has answered, it is a server that went away, not a wrong --api-base: backed off as a
  // 5xx; a new run gives up quickly again.
  test("later in a run, a vanished endpoint is backed off as for a 5xx; a new run gives up quickly again", async () => {
    const srv = fixtures.serve([{ content: "first answer" }]);
    const { client, waits } = clientOf(srv.url);
    expect((await complete(client)).turn?.content).toBe("first answer");
    srv.kill();
    const later = await complete(client);
    expect(later.error?.kind).toBe("fatal");
    expect(later.error?.message).toContain("--api-base");
    expect(waits).toEqual([1000, 2000, 4000, 8000]);

    waits.length = 0;
    client.newRun();
    expect((await complete(client)).error?.kind).toBe("fatal");
    expect(waits).toEqual([500, 1000]);
  });
});

describe("broken streams: retried, their partial text reported as discarded", () => {
  test("an error object after partial content (data: frame)", async () => {
    const r = await play([inStream({ message: "upstream overloaded", type: "server_error" }, "PARTIAL-JUNK")]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(2);
    expect(r.shown).toContain("PARTIAL-JUNK"); // streamed live…
    expect(r.discarded).toHaveLength(1); // …and then declared void
    expect(r.discarded[0]).toContain("upstream overloaded");
    expect(r.sink.of("retry")[0]?.reason).toContain("upstream overloaded");
  });

  test("an error object after partial content (event: error frame)", async () => {
    const r = await play([inStream({ message: "upstream overloaded", type: "server_error" }, "PARTIAL-JUNK", true)]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(2);
    expect(r.discarded).toHaveLength(1);
  });

  test("a stream cut off with neither finish_reason nor [DONE]", async () => {
    const r = await play([{ type: "truncated_stream", partialContent: "PARTIAL-JUNK" }]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.waits).toEqual([1000]);
    expect(r.discarded).toHaveLength(1);
    expect(r.sink.of("retry")[0]?.reason).toContain("neither a finish_reason nor data: [DONE]");
  });

  test("a reply with neither finish_reason nor [DONE] is cut off too, even with whole sentences", async () => {
    const r = await play([{ content: "half an answ", finishReason: null, omitDone: true }]);
    expect(r.srv.requests).toHaveLength(2);
    expect(r.sink.of("retry")[0]?.reason).toContain("neither a finish_reason nor data: [DONE]");
  });

  test("a connection dropped mid-answer, described in aic's words", async () => {
    const r = await play([{ type: "drop_stream", partialContent: "JUNK " }]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.waits).toEqual([1000]);
    expect(r.discarded).toHaveLength(1);
    const reason = r.sink.of("retry")[0]!.reason;
    expect(reason).toContain("dropped in the middle of the answer");
    expect(reason).not.toContain("verbose: true");
  });

  test("each failed attempt is discarded on its own, and the waits go on doubling", async () => {
    const r = await play([
      inStream({ message: "upstream overloaded", type: "server_error" }, "JUNK-ONE "),
      { type: "truncated_stream", partialContent: "JUNK-TWO " },
      { content: "The good answer. TASKCOMPLETE" },
    ]);
    expect(r.turn?.content).toBe("The good answer. TASKCOMPLETE");
    expect(r.discarded).toHaveLength(2);
    expect(r.waits).toEqual([1000, 2000]);
  });

  test("[DONE] without a finish_reason is a complete answer", async () => {
    const r = await play([{ content: "All done. TASKCOMPLETE", finishReason: null }]);
    expect(r.turn?.content).toBe("All done. TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(1);
    expect(r.waits).toEqual([]);
  });

  test("a finish_reason without [DONE] is a complete answer", async () => {
    const r = await play([{ content: "TASKCOMPLETE", omitDone: true }]);
    expect(r.turn?.content).toBe("TASKCOMPLETE");
    expect(r.srv.requests).toHaveLength(1);
    expect(r.waits).toEqual([]);
  });
});

describe("a stopped run cuts the client short", () => {
  // The real wait (no RetryWait given): a stop during a minute's wait ends it, without a second request. The
  // test's 30 s timeout is shorter than the wait: a wait the stop could not cut would make the test time out.
  test("a stop during a retry wait ends it at once", async () => {
    const srv = fixtures.serve([httpError(429, { error: { message: "Rate limit reached" } }, { "retry-after": "60" })]);
    const { config, sink } = clientOf(srv.url);
    const client = new ModelClient(config, sink);
    const stop = new AbortController();
    const pending = complete(client, stop.signal);
    await waitFor("the retry wait", () => sink.of("retry").length > 0);
    expect(sink.of("retry")[0]!.wait_ms).toBe(60_000);
    stop.abort();
    const { turn, error } = await pending;
    expect(turn).toBeUndefined();
    expect(error?.message).toBe("stopped");
    expect(srv.requests).toHaveLength(1);
  }, 30_000);

  test("a stop during a request that never answers ends it, with no retry", async () => {
    const srv = fixtures.serve([{ type: "hang" }]);
    const { client, waits } = clientOf(srv.url);
    const stop = new AbortController();
    const pending = complete(client, stop.signal);
    await waitFor("the request to reach the server", () => srv.requests.length >= 1);
    stop.abort();
    const { error } = await pending;
    expect(error?.message).toBe("stopped");
    expect(waits).toEqual([]);
    expect(srv.requests).toHaveLength(1);
  });
});

/**
 * The loop in-process over a real ModelClient: what the model and the events see of a failed
 * attempt. Nothing of its partial text may reach the history or an `assistant` event.
 */
describe("the loop over the real client: a failed attempt never becomes the answer", () => {
  const failing: [string, Turn][] = [
    ["an in-stream error", inStream({ message: "upstream overloaded", type: "server_error" }, "PARTIAL-JUNK")],
    [
      "an in-stream error (event: error frame)",
      inStream({ message: "upstream overloaded", type: "server_error" }, "PARTIAL-JUNK", true),
    ],
    ["a truncated stream", { type: "truncated_stream", partialContent: "PARTIAL-JUNK" }],
    ["a dropped stream", { type: "drop_stream", partialContent: "PARTIAL-JUNK" }],
  ];
  for (const [label, turn] of failing)
    test(label, async () => {
      const srv: FakeServer = fixtures.serve([turn, bash("echo step-two")]);
      // The client reports to the run's own sink, as createRun wires it.
      const { client, waits, sink } = clientOf(srv.url);
      const { outcome } = await runInProcess(client, ["--auto-approve"], "do the task", { cwd: scratch(), sink });

      expect(outcome).toEqual({ status: "completed", exitCode: 0 });
      expect(srv.requests).toHaveLength(3);
      expect(waits).toEqual([1000]);
      for (const r of srv.requests) {
        expect(JSON.stringify(r.body.messages)).not.toContain("PARTIAL-JUNK");
        expect(requestSequenceProblems(r.body.messages)).toEqual([]);
      }
      const assistant = sink.of("assistant");
      expect(assistant).toHaveLength(2);
      for (const e of assistant) expect(JSON.stringify(e)).not.toContain("PARTIAL-JUNK");
      expect(sink.of("discarded")).toHaveLength(1);
      expect(sink.of("retry")).toHaveLength(1);
    });
});
