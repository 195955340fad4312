/**
 * SPEC §3 (Failures) and §9 (exit codes), end to end: the compiled dist/aic runs headless with
 * --auto-approve against the fake OpenAI server, which answers with error statuses, broken
 * streams and hangs on the wire. We check what aic retries, what it gives up on at once, what it
 * tells the user, that a failed attempt's partial text never becomes the answer, and that signals
 * cut retry waits and hung requests short.
 */
import { afterEach, beforeAll, describe, expect, test } from "bun:test";
import { AIC, bash, cleanEnv, headless, jsonLines, runAic, scratch } from "./helpers.ts";
import { countPromptTokens, startFakeServer, type FakeServer, type Turn } from "./fake-openai.ts";

let srv: FakeServer | undefined;
afterEach(() => {
  srv?.close();
  srv = undefined;
});

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

function server(turns: Turn[] | ((req: any, index: number) => Turn)): FakeServer {
  srv = startFakeServer({ turns });
  return srv;
}

/** Headless, auto-approved run of one task against `s`. */
function aic(s: FakeServer, ...more: string[]) {
  return runAic([...headless(s.url, "test-model", "--auto-approve", ...more), "do the task"]);
}

const linesNaming = (text: string, needle: string) => text.split("\n").filter((l) => l.includes(needle));
const allMessagesText = (s: FakeServer) => s.requests.map((r) => JSON.stringify(r.body.messages));
const gapsMs = (s: FakeServer) => s.requests.slice(1).map((r, i) => r.at - s.requests[i]!.at);
const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** "Well under the retry time": any retry path would take 30 s or more. */
const PROMPT_MS = 10_000;

/** A scripted HTTP error response. */
const http = (status: number, body: unknown, headers?: Record<string, string>): Turn => ({ type: "http_error", status, body, headers });

/** Starts dist/aic in the background so a test can signal it mid-run. */
function spawnAic(args: string[]) {
  const proc = Bun.spawn([AIC, ...args], { cwd: scratch(), env: cleanEnv(), stdin: "ignore", stdout: "pipe", stderr: "pipe" });
  const guard = setTimeout(() => proc.kill("SIGKILL"), 100_000);
  const stdout = new Response(proc.stdout).text();
  const stderr = new Response(proc.stderr).text();
  return {
    proc,
    async done() {
      const code = await proc.exited;
      clearTimeout(guard);
      return { code, stdout: await stdout, stderr: await stderr };
    },
  };
}

async function waitFor(cond: () => boolean, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await sleep(50);
  }
}

describe("fatal statuses: no retry, one clear line, exit 1", () => {
  // §3: 401/403 are not retried; the one error line names the flag to fix (--api-key).
  for (const status of [401, 403]) {
    test(`HTTP ${status} with an error object`, async () => {
      const s = server([http(status, { error: { message: "Incorrect API key provided", type: "invalid_request_error", code: "invalid_api_key" } })]);
      const r = await aic(s);
      expect(r.code).toBe(1);
      expect(r.ms).toBeLessThan(PROMPT_MS);
      expect(s.requests.length).toBe(1);
      expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
    });
  }

  // §3: 404 (unknown model or path) is not retried; the line names --model.
  test("HTTP 404 names --model", async () => {
    const s = server([http(404, { error: { message: "The model `test-model` does not exist", type: "invalid_request_error", code: "model_not_found" } })]);
    const r = await aic(s);
    expect(r.code).toBe(1);
    expect(r.ms).toBeLessThan(PROMPT_MS);
    expect(s.requests.length).toBe(1);
    expect(linesNaming(r.stderr, "--model").length).toBeGreaterThanOrEqual(1);
  });

  // §3: a 400 that is not about the context length is a bad request: no retry, no compression.
  test("HTTP 400 not about context length", async () => {
    const s = server([http(400, { error: { message: "Invalid value for 'reasoning_effort': must be low, medium or high", type: "invalid_request_error", code: null } })]);
    const r = await aic(s);
    expect(r.code).toBe(1);
    expect(r.ms).toBeLessThan(PROMPT_MS);
    expect(s.requests.length).toBe(1);
    expect(r.stderr).toContain("reasoning_effort");
  });
});

describe("transient failures are retried with backoff", () => {
  // §3: 429 honours Retry-After; the wait is shown, and the run then completes (§9: exit 0).
  test("429 with Retry-After: 1 waits about a second, then completes", async () => {
    const s = server([http(429, { error: { message: "Rate limit reached", type: "rate_limit_error" } }, { "retry-after": "1" })]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
    expect(gapsMs(s)[0]).toBeGreaterThanOrEqual(900);
    // The wait is shown on stderr: a line about retrying that states the 1 s delay.
    expect(r.stderr).toMatch(/retr.*\b1(\.0+)?\s?s/i);
  });

  // §3: a 5xx is retried and the run completes.
  test("500 then success", async () => {
    const s = server([http(500, { error: { message: "Internal server error", type: "server_error" } })]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
  });

  // §3: at most 5 attempts, waits doubling from 1 s; then exit 1.
  test(
    "five 503s in a row: gives up after exactly 5 attempts with exponential backoff",
    async () => {
      const s = server(() => http(503, { error: { message: "The server is overloaded", type: "server_error" } }));
      const r = await aic(s);
      expect(r.code).toBe(1);
      expect(s.requests.length).toBe(5);
      const gaps = gapsMs(s);
      [1000, 2000, 4000, 8000].forEach((expected, i) => expect(gaps[i]!).toBeGreaterThanOrEqual(expected * 0.9));
    },
    60_000,
  );
});

describe("a failed stream is never kept as the answer", () => {
  /** Runs [failing turn, one command, TASKCOMPLETE] in --json mode and checks nothing of the junk survives. */
  async function expectJunkDiscarded(failing: Turn) {
    const s = server([failing, bash("echo step-two")]);
    const r = await aic(s, "--json");
    expect(r.code).toBe(0);
    // The failing attempt, its retry (answered with the command), then the final turn.
    expect(s.requests.length).toBe(3);
    for (const sent of allMessagesText(s)) expect(sent).not.toContain("PARTIAL-JUNK");
    const events = jsonLines(r.stdout);
    const assistant = events.filter((e) => e.type === "assistant");
    expect(assistant.length).toBeGreaterThanOrEqual(2);
    for (const e of assistant) expect(JSON.stringify(e)).not.toContain("PARTIAL-JUNK");
    expect(assistant.at(-1).content).toContain("TASKCOMPLETE");
    expect(events.at(-1)).toMatchObject({ type: "end", status: "completed", exit_code: 0 });
    return s;
  }

  // §3: `data: {"error": …}` inside a 200 stream is a failed attempt, retried like a 5xx.
  test("error object after partial content (data frame)", async () => {
    await expectJunkDiscarded({ type: "stream_error", partialContent: "PARTIAL-JUNK", error: { message: "upstream overloaded", type: "server_error" } });
  });

  // §3: same for an `event: error` frame.
  test("error object after partial content (event: error frame)", async () => {
    await expectJunkDiscarded({ type: "stream_error", partialContent: "PARTIAL-JUNK", error: { message: "upstream overloaded", type: "server_error" }, eventFrame: true });
  });

  // §3: a stream that ends without any chunk is retried.
  test("empty stream is retried", async () => {
    const s = server([{ type: "empty_stream" }]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
  });

  // §3: a connection dropped mid-answer (no finish_reason) is a failed attempt; its text is dropped.
  test("truncated stream is retried and its partial text not kept", async () => {
    await expectJunkDiscarded({ type: "truncated_stream", partialContent: "PARTIAL-JUNK" });
  });
});

describe("error bodies of any shape are classified by status and text", () => {
  // §3: a flat object body with 401 is still fatal and names --api-key.
  test("flat object with 401 is fatal", async () => {
    const s = server([http(401, { message: "Invalid API key" })]);
    const r = await aic(s);
    expect(r.code).toBe(1);
    expect(r.ms).toBeLessThan(PROMPT_MS);
    expect(s.requests.length).toBe(1);
    expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
  });

  // §3: a JSON array body with 429 is retried.
  test("JSON array with 429 is retried", async () => {
    const s = server([http(429, [{ error: { message: "quota" } }])]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
  });

  // §3: a plain-text body with 503 is retried.
  test("plain text with 503 is retried", async () => {
    const s = server([http(503, "Service Unavailable")]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
  });

  // §3: a plain-text body with 401 is fatal.
  test("plain text with 401 is fatal", async () => {
    const s = server([http(401, "Unauthorized")]);
    const r = await aic(s);
    expect(r.code).toBe(1);
    expect(r.ms).toBeLessThan(PROMPT_MS);
    expect(s.requests.length).toBe(1);
    expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
  });
});

describe("context too long: compress harder and retry", () => {
  const contextError = http(400, {
    error: {
      message: "This model's maximum context length is 8192 tokens. However, your messages resulted in 13000 tokens. Please reduce the length of the messages.",
      type: "invalid_request_error",
      code: "context_length_exceeded",
    },
  });
  // Two steps with ~5k-token outputs give history to compress; with --max-prompt-len 30000 the
  // budget (22000) is not exceeded, so only the server's complaint triggers compression.
  const twoBigSteps = [bash("seq 1 2000"), bash("seq 1 2001")];
  const flags = ["--compress-alg", "truncate", "--max-prompt-len", "30000"];

  // §3: a 400 saying the context is too long makes aic compress and retry; the run completes.
  test("compresses and retries with a smaller request", async () => {
    const s = server([...twoBigSteps, contextError]);
    const r = await aic(s, ...flags);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(4);
    const failing = s.requests[2]!.body.messages;
    const retried = s.requests[3]!.body.messages;
    // The retry carries the same conversation, squeezed: fewer messages or much less text.
    expect(retried.length < failing.length || countPromptTokens(retried) < countPromptTokens(failing) / 2).toBe(true);
    expect(JSON.stringify(retried)).toContain("do the task");
  });

  // §3: at most 3 compress-and-retry rounds; a context error that never goes away ends in exit 1.
  test("context errors that persist end in exit 1", async () => {
    const s = server((_req, i) => (i < 2 ? twoBigSteps[i]! : contextError));
    const r = await aic(s, ...flags);
    expect(r.code).toBe(1);
    const contextAttempts = s.requests.length - 2;
    expect(contextAttempts).toBeGreaterThanOrEqual(2);
    expect(contextAttempts).toBeLessThanOrEqual(4);
    expect(r.ms).toBeLessThan(PROMPT_MS);
  });
});

describe("signals cut waits short (§9: 143 after SIGTERM, 130 after SIGINT)", () => {
  // §3: a retry wait is cut short by SIGTERM; §9: exit 143.
  test("SIGTERM during a 30 s Retry-After wait exits 143 promptly", async () => {
    const s = server([http(429, { error: { message: "Rate limit reached" } }, { "retry-after": "30" })]);
    const run = spawnAic([...headless(s.url, "test-model", "--auto-approve"), "do the task"]);
    await waitFor(() => s.requests.length >= 1);
    await sleep(1500); // aic has the 429 by now and is waiting out Retry-After
    const signalledAt = performance.now();
    run.proc.kill("SIGTERM");
    const r = await run.done();
    expect(r.code).toBe(143);
    expect(performance.now() - signalledAt).toBeLessThan(PROMPT_MS);
    expect(s.requests.length).toBe(1);
  });

  // A request that never answers is interrupted by Ctrl+C; §9: exit 130.
  test("SIGINT during a hung request exits 130 promptly", async () => {
    const s = server([{ type: "hang" }]);
    const run = spawnAic([...headless(s.url, "test-model", "--auto-approve"), "do the task"]);
    await waitFor(() => s.requests.length >= 1);
    await sleep(300);
    const signalledAt = performance.now();
    run.proc.kill("SIGINT");
    const r = await run.done();
    expect(r.code).toBe(130);
    expect(performance.now() - signalledAt).toBeLessThan(PROMPT_MS);
  });
});

describe("the API key reaches the server", () => {
  // §1/§3: --api-key is sent as a bearer token.
  test("--api-key", async () => {
    const s = server([]);
    const r = await runAic([...headless(s.url, "test-model", "--auto-approve", "--api-key", "sk-from-flag"), "do the task"]);
    expect(r.code).toBe(0);
    expect(s.requests[0]!.headers.authorization).toBe("Bearer sk-from-flag");
  });

  // §1: AIC_API_KEY and then OPENAI_API_KEY supply the key when the flag is absent.
  test("AIC_API_KEY and OPENAI_API_KEY", async () => {
    const s = server([]);
    const args = [...headless(s.url, "test-model", "--auto-approve"), "do the task"];
    expect((await runAic(args, { env: { AIC_API_KEY: "sk-from-aic-env", OPENAI_API_KEY: "sk-other" } })).code).toBe(0);
    expect((await runAic(args, { env: { OPENAI_API_KEY: "sk-from-openai-env" } })).code).toBe(0);
    expect(s.requests.map((q) => q.headers.authorization)).toEqual(["Bearer sk-from-aic-env", "Bearer sk-from-openai-env"]);
  });
});
