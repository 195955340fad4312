/**
 * End to end against the fake OpenAI server: for every real context-overflow reply in
 * context-overflow-fixtures.ts, the compiled dist/aic must recognise it, say so (a warning that
 * the prompt is too long), compress and ask again — one refused request, one answered. For every
 * ordinary request error from the same servers it must give up at once: exit 1, one request.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import { headless, jsonLines, perTestFixtures, runAic } from "./helpers.ts";
import { countPromptTokens, type Turn } from "./fake-openai.ts";
import { CONTEXT_OVERFLOW_FIXTURES, NOT_OVERFLOW_FIXTURES, type ErrorFixture } from "./context-overflow-fixtures.ts";

const fixtures = perTestFixtures();

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

/** The first answer the fake server gives: the fixture's error, on the wire as the server sends it. */
function errorTurn(f: ErrorFixture): Turn {
  if (!f.inStream) return { type: "http_error", status: f.status, body: f.body };
  // The fake server wraps `error` as {"error": …} itself, so hand it what sits under that key.
  const inner =
    typeof f.body === "object" && f.body !== null && "error" in f.body ? (f.body as { error: unknown }).error : f.body;
  return { type: "stream_error", partialContent: "", error: inner, eventFrame: f.eventFrame };
}

const label = (f: ErrorFixture) => `${f.server}: ${f.short}`;

describe("context overflow replies make aic compress and retry", () => {
  test.each(CONTEXT_OVERFLOW_FIXTURES.map((f) => [label(f), f] as const))("%s", async (_name, f) => {
    const srv = fixtures.serve([errorTurn(f), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--json", "--auto-approve", "do it"]);

    const events = jsonLines(run.stdout);
    const warningAt = events.findIndex((e) => e.type === "warning" && /too long/i.test(String(e.text)));
    const endAt = events.findIndex((e) => e.type === "end");
    // Show what aic said when it did not take the reply for an overflow.
    if (warningAt < 0) console.error(`${label(f)} (source: ${f.source})\n${run.stderr.trim()}`);

    expect(warningAt).toBeGreaterThanOrEqual(0);
    expect(endAt).toBeGreaterThan(warningAt);
    expect(srv.requests.length).toBe(2);
    expect(run.code).toBe(0);
  });
});

describe("other request errors end the run at once", () => {
  test.each(NOT_OVERFLOW_FIXTURES.map((f) => [label(f), f] as const))("%s", async (_name, f) => {
    const srv = fixtures.serve([errorTurn(f), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--json", "--auto-approve", "do it"]);

    if (srv.requests.length !== 1) console.error(`${label(f)} (source: ${f.source})\n${run.stderr.trim()}`);
    expect(srv.requests.length).toBe(1);
    expect(run.code).toBe(1);
  });
});
