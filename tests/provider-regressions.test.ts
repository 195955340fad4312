/**
 * End to end against the fake OpenAI server: a provider reply from provider-fixtures.ts goes on the
 * wire exactly as the provider sends it (status, headers, body or SSE frames) to the compiled
 * dist/aic, run headless with --json, and aic must do what the fixture expects. The "retry" and
 * "fatal" fixtures are played to the ModelClient in model-client.test.ts (the retry policy, without
 * real waiting); here the "cut_off" ones, which only the whole loop answers:
 *
 * - cut_off: the next request answers the cut call with a tool message saying the answer was cut
 *            off by the output limit, naming the limit, and nothing was run.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import { headless, jsonLines, messagesOf, perTestFixtures, runAic, toolAnswer } from "./helpers.ts";
import { countPromptTokens, type FakeServer, type Turn } from "./fake-openai.ts";
import { CUT_OFF_CALL_ID, PROVIDER_FIXTURES, type Outcome, type ProviderFixture } from "./provider-fixtures.ts";

const fixtures = perTestFixtures();

// The fake server counts tokens with tiktoken; load the table once, outside any single test's time.
beforeAll(() => {
  countPromptTokens([{ role: "user", content: "warm up" }]);
}, 60_000);

/** The fixture's reply as a turn of the fake server. */
function turnOf(f: ProviderFixture): Turn {
  if (f.frames) return { type: "sse", frames: f.frames };
  return { type: "http_error", status: f.status, body: f.body, headers: f.headers };
}

const of = (outcome: Outcome) => PROVIDER_FIXTURES.filter((f) => f.expected === outcome);
const named = (list: ProviderFixture[]) => list.map((f) => [f.name, f] as const);

/** Runs one task headless in --json mode; the first answer is `first`, every later one TASKCOMPLETE. */
async function play(first: Turn | ((index: number) => Turn)) {
  const srv: FakeServer = fixtures.serve(typeof first === "function" ? (_req, i) => first(i) : [first]);
  const run = await runAic([...headless(srv.url, "test-model", "--auto-approve", "--json"), "do the task"]);
  return { srv, run, events: jsonLines(run.stdout) };
}

/** What aic did, for the failure message: its events and stderr. */
const said = (f: ProviderFixture, run: { stdout: string; stderr: string }) =>
  `${f.name}\nsource: ${f.source}\n--- stdout ---\n${run.stdout.slice(-2500)}\n--- stderr ---\n${run.stderr.slice(-1500)}`;

describe("an answer cut off by the output limit is named as such", () => {
  test.each(named(of("cut_off")))("%s", async (_name, f) => {
    const { srv, run, events } = await play(turnOf(f));
    if (srv.requests.length < 2) console.error(said(f, run));

    expect(srv.requests.length).toBeGreaterThanOrEqual(2);
    const limit = srv.requests[0]!.body.max_tokens;
    expect(typeof limit).toBe("number"); // aic caps the output of non-GPT models: that is the limit to name
    const answer = toolAnswer(srv.requests[1], CUT_OFF_CALL_ID);
    if (!/cut off by the output limit/i.test(answer))
      console.error(`${f.name}: the tool answer was:\n${answer || "(none)"}\n${said(f, run)}`);

    // The cut call is answered in the very next request, in the words the model needs…
    expect(messagesOf(srv.requests[1]).some((m) => m.role === "tool" && m.tool_call_id === CUT_OFF_CALL_ID)).toBe(true);
    expect(answer).toMatch(/cut off by the output limit/i);
    expect(answer).toContain(String(limit));
    // …not as a quoting mistake, and nothing of the half-written command ran.
    expect(answer).not.toMatch(/double quotes|trailing commas/i);
    expect(events.filter((e) => e.type === "command")).toHaveLength(0);
    expect(run.code).toBe(0);
  });
});
