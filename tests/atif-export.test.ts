/**
 * `aic export --format atif` (issue 28): a session file as a trajectory in Harbor's Agent
 * Trajectory Interchange Format, the file integrations/harbor/aic_agent.py writes to
 * /logs/agent/trajectory.json. A real session is made by the compiled dist/aic against the fake
 * OpenAI server (three model turns: two commands, then the claim of completion); its export must
 * pass the ATIF schema (tests/atif.ts, tests/fixtures/atif-schema.json) and say what the
 * conversation said: the steps in order, each tool call with its arguments as an object, each
 * command's output as the observation of the step that called it, and the session's token totals.
 * Bad input (no session, no or an unknown format, a file that is not a session) is one line on
 * stderr and exit 2, and an export never changes or adds a file beside the session.
 */
import { describe, expect, test } from "bun:test";
import { readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { ATIF_VERSIONS, validateAtif } from "./atif.ts";
import { bash, headless, perTestFixtures, runAic, scratch, toolAnswer, type AicRun } from "./helpers.ts";

const fixtures = perTestFixtures();

/** The files in `dir` with their bytes, to see that an export left the directory as it was. */
function snapshot(dir: string): Record<string, string> {
  return Object.fromEntries(
    readdirSync(dir)
      .sort()
      .map((name) => [name, readFileSync(join(dir, name)).toString("base64")]),
  );
}

/** A failed export: nothing on stdout, exit 2, and exactly one line on stderr (returned). */
function oneLineError(run: AicRun): string {
  expect(run.stdout).toBe("");
  expect(run.code).toBe(2);
  const lines = run.stderr.split("\n").filter((l) => l.trim());
  expect(lines).toHaveLength(1);
  return lines[0]!;
}

const TURN_USAGE = [
  { prompt_tokens: 1200, completion_tokens: 30, cached_tokens: 0 },
  { prompt_tokens: 1300, completion_tokens: 25, cached_tokens: 1024 },
  { prompt_tokens: 1400, completion_tokens: 12, cached_tokens: 1024 },
];

const FIRST = "printf 'hello from atif\\n' > greeting.txt";
const SECOND = "cat greeting.txt && echo sum-$((20+22))";

describe("aic export --format atif", () => {
  test("a two-command session exports as a valid ATIF trajectory that matches the conversation", async () => {
    const dir = scratch("aic-atif-");
    const session = join(dir, "task.session");
    const srv = fixtures.serve([
      {
        ...bash(FIRST, "call_write"),
        usage: TURN_USAGE[0],
        reasoning: "First write the file.",
        reasoningField: "reasoning_content",
      },
      { ...bash(SECOND, "call_read"), usage: TURN_USAGE[1] },
      { content: "greeting.txt holds the greeting. TASKCOMPLETE", usage: TURN_USAGE[2] },
    ]);
    const request = "Write a greeting to greeting.txt, then show it.";
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "--", request], {
      cwd: dir,
    });
    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(3);
    const stored = JSON.parse(readFileSync(session, "utf8"));
    const before = snapshot(dir);

    const exported = await runAic(["export", "--format", "atif", "--session", session], { cwd: dir });
    expect(exported.stderr).toBe("");
    expect(exported.code).toBe(0);
    const trajectory = JSON.parse(exported.stdout);
    expect(validateAtif(trajectory)).toEqual([]);
    expect(snapshot(dir)).toEqual(before); // read only: no lock, no repaired copy, no rewrite

    // The newest version the published schema accepts, the agent and the session it came from.
    expect(trajectory.schema_version).toBe("ATIF-v1.7");
    expect(trajectory.schema_version).toBe(ATIF_VERSIONS.at(-1));
    const version = (await runAic(["--version"])).stdout.trim().replace(/^aic /, "");
    expect(trajectory.agent).toMatchObject({ name: "aic", version, model_name: "test-model" });
    expect(trajectory.session_id).toBe(stored.session_id);

    // One step per message (tool answers belong to the step that called): system, user, three agent turns.
    const steps: any[] = trajectory.steps;
    expect(steps.map((s) => s.source)).toEqual(["system", "user", "agent", "agent", "agent"]);
    expect(steps.map((s) => s.step_id)).toEqual([1, 2, 3, 4, 5]);
    expect(steps[0].message).toBe(stored.messages[0].content);
    expect(steps[1].message).toBe(request);

    const [, , write, read, last] = steps;
    for (const [step, id, command] of [
      [write, "call_write", FIRST],
      [read, "call_read", SECOND],
    ] as const) {
      expect(step.tool_calls).toEqual([{ tool_call_id: id, function_name: "execute_bash", arguments: { command } }]);
      expect(step.model_name).toBe("test-model");
      expect(step.observation.results).toHaveLength(1);
      expect(step.observation.results[0].source_call_id).toBe(id);
      // Exactly what the model was given for that call, and what the session file kept.
      const given = toolAnswer(srv.requests.at(-1), id);
      expect(given).not.toBe("");
      expect(step.observation.results[0].content).toBe(given);
      expect(stored.messages.find((m: any) => m.role === "tool" && m.tool_call_id === id)?.content).toBe(given);
    }
    expect(read.observation.results[0].content).toContain("hello from atif");
    expect(read.observation.results[0].content).toContain("sum-42");
    expect(last.message).toContain("TASKCOMPLETE");
    expect(last.tool_calls ?? null).toBeNull();
    expect(last.observation ?? null).toBeNull();

    // Token totals: the session's, which are the sums of what the server reported for each call.
    const sum = (key: keyof (typeof TURN_USAGE)[number]) => TURN_USAGE.reduce((t, u) => t + u[key], 0);
    expect(trajectory.final_metrics).toMatchObject({
      total_prompt_tokens: stored.usage.input_tokens,
      total_completion_tokens: stored.usage.output_tokens,
      total_cached_tokens: stored.usage.cached_tokens,
      total_steps: steps.length,
    });
    expect(trajectory.final_metrics.total_prompt_tokens).toBe(sum("prompt_tokens"));
    expect(trajectory.final_metrics.total_completion_tokens).toBe(sum("completion_tokens"));
    expect(trajectory.final_metrics.total_cached_tokens).toBe(sum("cached_tokens"));
    // Per-step metrics, where a step has them, are whole counts within the totals.
    for (const step of steps.filter((s) => s.metrics)) {
      expect(step.source).toBe("agent");
      expect(step.metrics.prompt_tokens).toBeLessThanOrEqual(trajectory.final_metrics.total_prompt_tokens);
    }
    // Each agent step carries the token figures the server reported for its own call, and the model's reasoning.
    expect([write, read, last].map((s) => s.metrics)).toEqual(TURN_USAGE);
    expect(write.reasoning_content).toBe("First write the file.");
    expect(read.reasoning_content ?? null).toBeNull();
    // Timestamps on the user and agent steps, in the order the steps were made.
    const times = steps.slice(1).map((s) => Date.parse(s.timestamp));
    for (const t of times) expect(t).toBeGreaterThan(0);
    expect([...times].sort((a, b) => a - b)).toEqual(times);
  }, 60_000);

  test("without --session it exports ./.aicsession, as undo and diff read it", async () => {
    const dir = scratch("aic-atif-");
    const srv = fixtures.serve([bash("echo default-session", "call_1"), { content: "TASKCOMPLETE" }]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--session", join(dir, ".aicsession"), "--", "Say it."],
      { cwd: dir },
    );
    expect(run.code).toBe(0);
    const exported = await runAic(["export", "--format", "atif"], { cwd: dir });
    expect(exported.code).toBe(0);
    const trajectory = JSON.parse(exported.stdout);
    expect(validateAtif(trajectory)).toEqual([]);
    expect(trajectory.steps[2].observation.results[0].content).toContain("default-session");
  }, 60_000);

  test("a session a killed run left (a call never answered) exports whole, and the file is not repaired on disk", async () => {
    const dir = scratch("aic-atif-");
    const session = join(dir, "killed.session");
    writeFileSync(
      session,
      JSON.stringify({
        aic_session_version: 1,
        session_id: "20260101_120000",
        model: "some-model",
        step_count: 1,
        usage: { input_tokens: 500, output_tokens: 20, cached_tokens: 0, billable_tokens: 520 },
        messages: [
          { role: "system", content: "You are a shell agent." },
          { role: "user", content: "Sleep." },
          {
            role: "assistant",
            content: null,
            tool_calls: [
              {
                id: "call_sleep",
                type: "function",
                function: { name: "execute_bash", arguments: '{"command":"sleep 100"}' },
              },
            ],
          },
        ],
      }),
    );
    const before = snapshot(dir);
    const exported = await runAic(["export", "--format", "atif", "--session", session], { cwd: dir });
    expect(exported.code).toBe(0);
    const trajectory = JSON.parse(exported.stdout);
    expect(validateAtif(trajectory)).toEqual([]);
    const agent = trajectory.steps[2];
    expect(agent).toMatchObject({ source: "agent", message: "", model_name: "some-model" });
    expect(agent.tool_calls[0].arguments).toEqual({ command: "sleep 100" });
    expect(agent.observation.results[0].source_call_id).toBe("call_sleep");
    expect(agent.observation.results[0].content).toContain("SESSION RECOVERED");
    expect(trajectory.final_metrics).toMatchObject({ total_prompt_tokens: 500, total_completion_tokens: 20 });
    expect(snapshot(dir)).toEqual(before);
  }, 30_000);

  describe("bad input is one line on stderr and exit 2", () => {
    test("no session file (the default ./.aicsession, or --session PATH)", async () => {
      const dir = scratch("aic-atif-");
      const line = oneLineError(await runAic(["export", "--format", "atif"], { cwd: dir }));
      expect(line).toContain(join(dir, ".aicsession"));
      const named = oneLineError(
        await runAic(["export", "--format", "atif", "--session", join(dir, "nope.session")], { cwd: dir }),
      );
      expect(named).toContain(join(dir, "nope.session"));
      expect(readdirSync(dir)).toEqual([]);
    });

    test("an unknown format, and no format at all", async () => {
      const dir = scratch("aic-atif-");
      writeFileSync(join(dir, ".aicsession"), JSON.stringify({ messages: [{ role: "user", content: "hi" }] }));
      const unknown = oneLineError(await runAic(["export", "--format", "yaml"], { cwd: dir }));
      expect(unknown).toContain("yaml");
      expect(unknown).toContain("atif");
      const missing = oneLineError(await runAic(["export", "--session", join(dir, ".aicsession")], { cwd: dir }));
      expect(missing).toContain("--format");
      const stray = oneLineError(await runAic(["export", "--format", "atif", "extra"], { cwd: dir }));
      expect(stray).toContain("extra");
    });

    test("a file that is not a session is reported, and left where and as it is", async () => {
      const dir = scratch("aic-atif-");
      const session = join(dir, "broken.session");
      writeFileSync(session, "{ this is not JSON");
      const line = oneLineError(await runAic(["export", "--format", "atif", "--session", session], { cwd: dir }));
      expect(line).toContain(session);
      expect(readdirSync(dir)).toEqual(["broken.session"]); // not moved aside as a run would
      expect(readFileSync(session, "utf8")).toBe("{ this is not JSON");
    });
  });
});
