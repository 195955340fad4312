/**
 * The Harbor adapter (integrations/harbor/aic_agent.py) end to end, without Harbor: its Python unit tests pass,
 * and its end-to-end test (integrations/harbor/test_end_to_end.py) really runs — install() uploads the compiled
 * dist/aic into a temporary directory standing for the task's container, run() drives it through a two-command task
 * against the fake OpenAI server in this process, populate_context_post_run() reads the logs back — and reports a
 * completed run (exit 0, no failure mode) with the token totals the server reported, leaving a trajectory.json that
 * passes the ATIF schema and holds both commands with their real output.
 */
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { validateAtif } from "./atif.ts";
import { AIC, ROOT, bash, has, perTestFixtures, runCommand, scratch, type AicRun } from "./helpers.ts";

const fixtures = perTestFixtures();

const HARBOR_DIR = join(ROOT, "integrations", "harbor");

/** `python3 -m unittest <args>` from the repository root, in the clean environment of helpers.ts plus `env`. */
function unittest(args: string[], env: Record<string, string> = {}): Promise<AicRun> {
  return runCommand(["python3", "-m", "unittest", ...args], { cwd: ROOT, env });
}

// What the fake model does (the instruction is test_end_to_end.py's): two commands, then the claim of completion.
const FIRST = "printf 'hello from harbor\\n' > greeting.txt";
const SECOND = "cat greeting.txt && echo sum-$((20+22))";
const TURN_USAGE = [
  { prompt_tokens: 1200, completion_tokens: 30, cached_tokens: 0 },
  { prompt_tokens: 1300, completion_tokens: 25, cached_tokens: 1024 },
  { prompt_tokens: 1400, completion_tokens: 12, cached_tokens: 1024 },
];
const total = (key: keyof (typeof TURN_USAGE)[number]) => TURN_USAGE.reduce((sum, u) => sum + u[key], 0);

describe.skipIf(!has.python3)("Harbor adapter (needs python3)", () => {
  test("its unit tests pass", async () => {
    const run = await unittest(["discover", "-s", HARBOR_DIR, "-v"]);
    expect(run.stderr).toMatch(/^OK\b/m);
    expect(run.code).toBe(0);
  });

  test("it installs and runs dist/aic, reports a completed run with the server's token totals, and leaves a valid trajectory", async () => {
    const srv = fixtures.serve([
      { ...bash(FIRST, "call_write"), usage: TURN_USAGE[0] },
      { ...bash(SECOND, "call_read"), usage: TURN_USAGE[1] },
      { content: "greeting.txt holds the greeting. TASKCOMPLETE", usage: TURN_USAGE[2] },
    ]);
    const keep = scratch("aic-harbor-keep-");
    const run = await unittest(["discover", "-s", HARBOR_DIR, "-p", "test_end_to_end.py", "-v"], {
      AIC_E2E_BINARY: AIC,
      AIC_E2E_API_BASE: srv.url,
      AIC_E2E_USAGE: `${total("prompt_tokens")},${total("completion_tokens")},${total("cached_tokens")}`,
      AIC_E2E_KEEP: keep,
    });
    // It ran (a skip would say "skipped '…'") and passed; unittest reports on stderr, a failure with its traceback.
    expect(run.stderr).toMatch(/^test_a_completed_run_installs_runs_exports_and_counts .*\.\.\. ok$/m);
    expect(run.stderr).toMatch(/^OK$/m);
    expect(run.code).toBe(0);

    // The server saw exactly the scripted conversation, with the model and the key the adapter passed in aic's environment.
    expect(srv.requests).toHaveLength(TURN_USAGE.length);
    expect(srv.requests[0]!.body.model).toBe("test-model");
    expect(srv.requests[0]!.headers.authorization).toBe("Bearer sk-aic-e2e-test");

    // The context the adapter filled: a completed run, the server's totals.
    const context = JSON.parse(readFileSync(join(keep, "context.json"), "utf8"));
    expect(context).toMatchObject({
      n_input_tokens: total("prompt_tokens"),
      n_output_tokens: total("completion_tokens"),
      n_cache_tokens: total("cached_tokens"),
      cost_usd: null,
      metadata: { aic_exit_code: 0, aic_status: "completed", aic_failure_mode: null },
    });

    // The trajectory it left: valid ATIF, both commands called in order, each with the output bash really gave.
    const trajectory = JSON.parse(readFileSync(join(keep, "trajectory.json"), "utf8"));
    expect(validateAtif(trajectory)).toEqual([]);
    const calls = trajectory.steps.flatMap((step: any) =>
      (step.tool_calls ?? []).map((call: any) => ({
        command: call.arguments.command,
        output: step.observation?.results?.find((r: any) => r.source_call_id === call.tool_call_id)?.content,
      })),
    );
    expect(calls.map((c: any) => c.command)).toEqual([FIRST, SECOND]);
    expect(calls[1].output).toContain("hello from harbor");
    expect(calls[1].output).toContain("sum-42");
  });
});
