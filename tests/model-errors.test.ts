/**
 * How aic handles a failing model endpoint, and its exit codes (README: "The model endpoint and
 * its failures", "Exit codes"), end to end: the compiled dist/aic runs headless with
 * --auto-approve against the fake OpenAI server. The retry policy itself (which failures are
 * retried, the waits, the words) is tested on the ModelClient in model-client.test.ts, without
 * real waiting; here a small set shows that it reaches the user: a fatal status, a transient
 * failure and a Retry-After that are waited out, a context overflow that compresses, and signals
 * that cut waits and hung requests short.
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
  // A 401 is not retried; the one error line names the flag to fix (--api-key).
  test("HTTP 401 with an error object", async () => {
    const r = await expectFatalAtOnce(
      httpError(401, {
        error: { message: "Incorrect API key provided", type: "invalid_request_error", code: "invalid_api_key" },
      }),
    );
    expect(linesNaming(r.stderr, "--api-key")).toHaveLength(1);
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
