/**
 * How aic handles a failing model endpoint, and its exit codes (README: "The model endpoint and
 * its failures", "Exit codes"), end to end: the compiled dist/aic runs headless with
 * --auto-approve against the fake OpenAI server, which answers with error statuses, broken
 * streams and hangs on the wire. We check what aic retries, what it gives up on at once, what it
 * tells the user, that a failed attempt's partial text never becomes the answer, and that signals
 * cut retry waits and hung requests short.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import {
  bash,
  headless,
  httpError,
  jsonLines,
  perTestFixtures,
  runAic,
  startAic,
  waitFor,
  type AicRun,
} from "./helpers.ts";
import { countPromptTokens, type FakeServer, type Turn } from "./fake-openai.ts";

const fixtures = perTestFixtures();

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

/** Headless, auto-approved run of one task against `s`. */
function aic(s: FakeServer, ...more: string[]) {
  return runAic([...headless(s.url, "test-model", "--auto-approve", ...more), "do the task"]);
}

const linesNaming = (text: string, needle: string) => text.split("\n").filter((l) => l.includes(needle));
const allMessagesText = (s: FakeServer) => s.requests.map((r) => JSON.stringify(r.body.messages));
const gapsMs = (s: FakeServer) => s.requests.slice(1).map((r, i) => r.at - s.requests[i]!.at);
/** How text mode shows a retry wait on stderr ("… retry 1 in 1.0 s"): every wait is announced there. */
const RETRY_LINE = /\bretry \d+ in\b/;

/** Runs against a server whose first answer is `reply`, and checks that aic gave up at once: exit 1, one request, no retry wait. */
async function expectFatalAtOnce(reply: Turn): Promise<AicRun> {
  const s = fixtures.serve([reply]);
  const r = await aic(s);
  expect(r.code).toBe(1);
  expect(r.stderr).not.toMatch(RETRY_LINE); // given up at once: no retry wait was announced
  expect(s.requests.length).toBe(1);
  return r;
}

/** Runs against a server whose first answer is `reply` and then completes, and checks the one retry: exit 0, two requests, the wait announced. */
async function expectRetriedOnce(reply: Turn): Promise<AicRun> {
  const s = fixtures.serve([reply]);
  const r = await aic(s);
  expect(r.code).toBe(0);
  expect(s.requests.length).toBe(2);
  expect(r.stderr).toMatch(RETRY_LINE); // the wait is announced in the words the fatal tests look for
  return r;
}

describe("fatal statuses: no retry, one clear line, exit 1", () => {
  // 401/403 are not retried; the one error line names the flag to fix (--api-key).
  for (const status of [401, 403]) {
    test(`HTTP ${status} with an error object`, async () => {
      const r = await expectFatalAtOnce(
        httpError(status, {
          error: { message: "Incorrect API key provided", type: "invalid_request_error", code: "invalid_api_key" },
        }),
      );
      expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
    });
  }

  // 404 (unknown model or path) is not retried; the line names --model.
  test("HTTP 404 names --model", async () => {
    const r = await expectFatalAtOnce(
      httpError(404, {
        error: {
          message: "The model `test-model` does not exist",
          type: "invalid_request_error",
          code: "model_not_found",
        },
      }),
    );
    expect(linesNaming(r.stderr, "--model").length).toBeGreaterThanOrEqual(1);
  });

  // A 400 that is not about the context length is a bad request: no retry, no compression.
  test("HTTP 400 not about context length", async () => {
    const r = await expectFatalAtOnce(
      httpError(400, {
        error: {
          message: "Invalid value for 'reasoning_effort': must be low, medium or high",
          type: "invalid_request_error",
          code: null,
        },
      }),
    );
    expect(r.stderr).toContain("reasoning_effort");
  });
});

describe("transient failures are retried with backoff", () => {
  // A 429 honours Retry-After; the wait is shown, and the run then completes with exit 0.
  test("429 with Retry-After: 1 waits about a second, then completes", async () => {
    const s = fixtures.serve([
      httpError(429, { error: { message: "Rate limit reached", type: "rate_limit_error" } }, { "retry-after": "1" }),
    ]);
    const r = await aic(s);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(2);
    expect(gapsMs(s)[0]).toBeGreaterThanOrEqual(900);
    // The wait is shown on stderr: a line about retrying that states the 1 s delay.
    expect(r.stderr).toMatch(/retr.*\b1(\.0+)?\s?s/i);
  });

  // A 5xx is retried and the run completes.
  test("500 then success", async () => {
    await expectRetriedOnce(httpError(500, { error: { message: "Internal server error", type: "server_error" } }));
  });

  // At most 5 attempts, waits doubling from 1 s; then exit 1.
  test("five 503s in a row: gives up after exactly 5 attempts with exponential backoff", async () => {
    const s = fixtures.serve(() =>
      httpError(503, { error: { message: "The server is overloaded", type: "server_error" } }),
    );
    const r = await aic(s);
    expect(r.code).toBe(1);
    expect(s.requests.length).toBe(5);
    const gaps = gapsMs(s);
    [1000, 2000, 4000, 8000].forEach((expected, i) => expect(gaps[i]!).toBeGreaterThanOrEqual(expected * 0.9));
  }, 60_000);
});

describe("a failed stream is never kept as the answer", () => {
  /** Runs [failing turn, one command, TASKCOMPLETE] in --json mode and checks nothing of the junk survives. */
  async function expectJunkDiscarded(failing: Turn) {
    const s = fixtures.serve([failing, bash("echo step-two")]);
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

  // `data: {"error": …}` inside a 200 stream is a failed attempt, retried like a 5xx.
  test("error object after partial content (data frame)", async () => {
    await expectJunkDiscarded({
      type: "stream_error",
      partialContent: "PARTIAL-JUNK",
      error: { message: "upstream overloaded", type: "server_error" },
    });
  });

  // The same for an `event: error` frame.
  test("error object after partial content (event: error frame)", async () => {
    await expectJunkDiscarded({
      type: "stream_error",
      partialContent: "PARTIAL-JUNK",
      error: { message: "upstream overloaded", type: "server_error" },
      eventFrame: true,
    });
  });

  // A stream that ends without any chunk is retried.
  test("empty stream is retried", async () => {
    await expectRetriedOnce({ type: "empty_stream" });
  });

  // A connection dropped mid-answer (no finish_reason) is a failed attempt; its text is dropped.
  test("truncated stream is retried and its partial text not kept", async () => {
    await expectJunkDiscarded({ type: "truncated_stream", partialContent: "PARTIAL-JUNK" });
  });
});

describe("error bodies of any shape are classified by status and text", () => {
  // A flat object body with 401 is still fatal and names --api-key.
  test("flat object with 401 is fatal", async () => {
    const r = await expectFatalAtOnce(httpError(401, { message: "Invalid API key" }));
    expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
  });

  // A JSON array body with 429 is retried.
  test("JSON array with 429 is retried", async () => {
    await expectRetriedOnce(httpError(429, [{ error: { message: "quota" } }]));
  });

  // A plain-text body with 503 is retried.
  test("plain text with 503 is retried", async () => {
    await expectRetriedOnce(httpError(503, "Service Unavailable"));
  });

  // A plain-text body with 401 is fatal.
  test("plain text with 401 is fatal", async () => {
    const r = await expectFatalAtOnce(httpError(401, "Unauthorized"));
    expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
  });
});

describe("context too long: compress harder and retry", () => {
  const contextError = httpError(400, {
    error: {
      message:
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 13000 tokens. Please reduce the length of the messages.",
      type: "invalid_request_error",
      code: "context_length_exceeded",
    },
  });
  // Two steps with ~5k-token outputs give history to compress; with --max-prompt-len 30000 the
  // budget (22000) is not exceeded, so only the server's complaint triggers compression.
  const twoBigSteps = [bash("seq 1 2000"), bash("seq 1 2001")];
  const flags = ["--compress-alg", "truncate", "--max-prompt-len", "30000"];

  // A 400 saying the context is too long makes aic compress and retry; the run completes.
  test("compresses and retries with a smaller request", async () => {
    const s = fixtures.serve([...twoBigSteps, contextError]);
    const r = await aic(s, ...flags);
    expect(r.code).toBe(0);
    expect(s.requests.length).toBe(4);
    const failing = s.requests[2]!.body.messages;
    const retried = s.requests[3]!.body.messages;
    // The retry carries the same conversation, squeezed: fewer messages or much less text.
    expect(retried.length < failing.length || countPromptTokens(retried) < countPromptTokens(failing) / 2).toBe(true);
    expect(JSON.stringify(retried)).toContain("do the task");
  });

  // At most 3 compress-and-retry rounds; a context error that never goes away ends in exit 1.
  test("context errors that persist end in exit 1", async () => {
    const s = fixtures.serve((_req, i) => (i < 2 ? twoBigSteps[i]! : contextError));
    const r = await aic(s, ...flags);
    expect(r.code).toBe(1);
    const contextAttempts = s.requests.length - 2;
    expect(contextAttempts).toBeGreaterThanOrEqual(2);
    expect(contextAttempts).toBeLessThanOrEqual(4);
    expect(r.stderr).not.toMatch(RETRY_LINE); // given up at once: no retry wait was announced
  });
});

describe("signals cut waits short (exit 143 after SIGTERM, 130 after SIGINT)", () => {
  // A retry wait is cut short by SIGTERM, which ends the run with exit 143. The 30 s wait outlasts
  // the 25 s guard: a wait sat out to its end would meet the guard's SIGKILL (137), so aic's own
  // 143 proves the signal cut the wait.
  test("SIGTERM during a 30 s Retry-After wait exits 143 promptly", async () => {
    const s = fixtures.serve([httpError(429, { error: { message: "Rate limit reached" } }, { "retry-after": "30" })]);
    const run = startAic([...headless(s.url, "test-model", "--auto-approve", "--json"), "do the task"], {
      killAfterMs: 25_000,
    });
    const retry = await run.waitForEvent("the retry event of the 429", (e) => e.type === "retry");
    expect(retry.wait_ms).toBe(30_000);
    run.proc.kill("SIGTERM");
    const r = await run.done;
    expect(r.code).toBe(143);
    expect(jsonLines(r.stdout).at(-1)).toMatchObject({ type: "end", status: "stopped", exit_code: 143 });
    expect(s.requests.length).toBe(1);
  });

  // A request that never answers is interrupted by Ctrl+C, which ends the run with exit 130. The
  // request would hang for 5 minutes (aic's stream idle limit), far past the 45 s guard: aic's own
  // 130 proves the signal cut it.
  test("SIGINT during a hung request exits 130 promptly", async () => {
    const s = fixtures.serve([{ type: "hang" }]);
    const run = startAic([...headless(s.url, "test-model", "--auto-approve"), "do the task"], { killAfterMs: 45_000 });
    await waitFor("the request to reach the server", () => s.requests.length >= 1);
    run.proc.kill("SIGINT");
    const r = await run.done;
    expect(r.code).toBe(130);
    expect(s.requests.length).toBe(1);
  });
});

describe("the API key reaches the server", () => {
  // --api-key is sent as a bearer token.
  test("--api-key", async () => {
    const s = fixtures.serve([]);
    const r = await runAic([
      ...headless(s.url, "test-model", "--auto-approve", "--api-key", "sk-from-flag"),
      "do the task",
    ]);
    expect(r.code).toBe(0);
    expect(s.requests[0]!.headers.authorization).toBe("Bearer sk-from-flag");
  });

  // AIC_API_KEY and then OPENAI_API_KEY supply the key when the flag is absent.
  test("AIC_API_KEY and OPENAI_API_KEY", async () => {
    const s = fixtures.serve([]);
    const args = [...headless(s.url, "test-model", "--auto-approve"), "do the task"];
    expect((await runAic(args, { env: { AIC_API_KEY: "sk-from-aic-env", OPENAI_API_KEY: "sk-other" } })).code).toBe(0);
    expect((await runAic(args, { env: { OPENAI_API_KEY: "sk-from-openai-env" } })).code).toBe(0);
    expect(s.requests.map((q) => q.headers.authorization)).toEqual([
      "Bearer sk-from-aic-env",
      "Bearer sk-from-openai-env",
    ]);
  });
});
