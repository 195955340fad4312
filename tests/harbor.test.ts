/**
 * The Harbor adapter (integrations/harbor/aic_agent.py) end to end, without Harbor: its Python tests pass (unit
 * tests with a fake environment, the shell side really run against a stand-in aic, and, where a Harbor checkout is
 * named, the same suite on Harbor's own base class), and its end-to-end test (integrations/harbor/test_end_to_end.py)
 * really runs — install() uploads the compiled dist/aic into a temporary directory standing for the task's container,
 * run() drives it through a two-command task against the fake OpenAI server in this process,
 * populate_context_post_run() reads the logs back — and reports a completed run (exit 0, no failure mode) with the
 * token totals the server reported, leaving a trajectory.json that passes the ATIF schema and holds both commands
 * with their real output.
 *
 * The Python side reports through integrations/harbor/run_tests.py's JSON result file, never unittest's text:
 * under load asyncio's debug-mode warnings and the tests' log lines share that stderr.
 */
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { validateAtif } from "./atif.ts";
import { AIC, ROOT, bash, has, perTestFixtures, runCommand, scratch, type AicRun } from "./helpers.ts";

const fixtures = perTestFixtures();

const HARBOR_DIR = join(ROOT, "integrations", "harbor");

interface PythonReport {
  ran: number;
  passed: string[];
  failures: string[];
  errors: string[];
  skipped: Record<string, string>;
  ok: boolean;
}

/**
 * run_tests.py over the test files matching `pattern`, in the clean environment of helpers.ts plus `env`; the
 * report it wrote, and the process (its output only for a failure's message).
 */
async function pythonTests(
  pattern: string,
  env: Record<string, string> = {},
): Promise<{ run: AicRun; report: PythonReport }> {
  const result = join(scratch("aic-harbor-result-"), "result.json");
  // The Harbor checkout and interpreter for test_harbor_base.py, when the caller has them (helpers.ts drops AIC_*).
  const harbor: Record<string, string> = {};
  for (const name of ["AIC_HARBOR_SRC", "AIC_HARBOR_PYTHON"]) if (process.env[name]) harbor[name] = process.env[name]!;
  const run = await runCommand(
    ["python3", join(HARBOR_DIR, "run_tests.py"), "--result", result, "--pattern", pattern],
    {
      cwd: HARBOR_DIR,
      env: { ...harbor, ...env },
      killAfterMs: 110_000,
    },
  );
  let report: PythonReport;
  try {
    report = JSON.parse(readFileSync(result, "utf8"));
  } catch {
    throw new Error(`run_tests.py wrote no result (exit ${run.code})\n${run.stdout}\n${run.stderr.slice(-4000)}`);
  }
  return { run, report };
}

/** The ids of `report`'s tests that did not pass, with their tracebacks: empty when all is well. */
const problems = (report: PythonReport) => [...report.failures, ...report.errors];

// What the fake model does (the instruction is test_end_to_end.py's): two commands, then the claim of completion.
const FIRST = "printf 'hello from harbor\\n' > greeting.txt";
const SECOND = "cat greeting.txt && echo sum-$((20+22))";
const TURN_USAGE = [
  { prompt_tokens: 1200, completion_tokens: 30, cached_tokens: 0 },
  { prompt_tokens: 1300, completion_tokens: 25, cached_tokens: 1024 },
  { prompt_tokens: 1400, completion_tokens: 12, cached_tokens: 1024 },
];
const total = (key: keyof (typeof TURN_USAGE)[number]) => TURN_USAGE.reduce((sum, u) => sum + u[key], 0);
const E2E_TEST = "test_end_to_end.EndToEndTests.test_a_completed_run_installs_runs_exports_and_counts";

describe.skipIf(!has.python3)("Harbor adapter (needs python3)", () => {
  test("its Python tests pass", async () => {
    const { run, report } = await pythonTests("test_*.py");
    expect(problems(report)).toEqual([]);
    expect(report.ok).toBe(true);
    expect(run.code).toBe(0);
    // The unit tests and the process tests ran; what may be skipped is named, each for its reason.
    expect(report.passed.filter((id) => id.startsWith("test_aic_agent.")).length).toBeGreaterThan(40);
    expect(report.passed.filter((id) => id.startsWith("test_processes.")).length).toBeGreaterThanOrEqual(5);
    const mayBeSkipped = [
      E2E_TEST, // run by the next test, with the binary and the server it needs
      "test_aic_agent.WithHarborTests.test_harbor_classifies_stderr_not_command_output", // Harbor not installed
      "test_harbor_base.HarborBaseClassTests.test_the_adapter_runs_on_harbors_own_base_class", // no Harbor checkout
    ];
    for (const [id, reason] of Object.entries(report.skipped)) {
      expect(mayBeSkipped).toContain(id);
      expect(reason.length).toBeGreaterThan(10);
    }
  }, 100_000);

  test("it installs and runs dist/aic, reports a completed run with the server's token totals, and leaves a valid trajectory", async () => {
    const srv = fixtures.serve([
      { ...bash(FIRST, "call_write"), usage: TURN_USAGE[0] },
      { ...bash(SECOND, "call_read"), usage: TURN_USAGE[1] },
      { content: "greeting.txt holds the greeting. TASKCOMPLETE", usage: TURN_USAGE[2] },
    ]);
    const keep = scratch("aic-harbor-keep-");
    const { run, report } = await pythonTests("test_end_to_end.py", {
      AIC_E2E_BINARY: AIC,
      AIC_E2E_API_BASE: srv.url,
      AIC_E2E_USAGE: `${total("prompt_tokens")},${total("completion_tokens")},${total("cached_tokens")}`,
      AIC_E2E_KEEP: keep,
    });
    // It ran (not skipped) and passed.
    expect(problems(report)).toEqual([]);
    expect(report.skipped).toEqual({});
    expect(report.passed).toEqual([E2E_TEST]);
    expect(run.code).toBe(0);

    // The server saw exactly the scripted conversation, with the model and the key the adapter passed.
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
  }, 100_000);
});
