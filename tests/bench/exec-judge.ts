/**
 * What holding a deny rule at exec costs (README: "Command rules", "held at
 * exec"): with `deny git push *` every execve of every command goes through
 * the seccomp filter to the supervisor, which reads the program and its argv
 * and judges them. Each step here starts PROGRAMS short programs (`/bin/true`
 * in a loop), so the step's time is dominated by execs. Three rule sets, run
 * in alternation so each sees the same background load: `deny git push *`
 * (judged at exec), `deny rm *` only (held by Landlock, no exec judge), and no
 * rules file. Two figures per step: the command's own time (`duration_ms` of
 * its JSON `command_result`, where the mechanism's cost lives, with less of
 * the machine's noise) and the step's time, the interval between the model
 * requests around it, as a user pays it.
 *
 * per-program overhead = (median command, judged − median command, deny rm only) / PROGRAMS
 */
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { scratch } from "../helpers.ts";
import { type Benchmark, type Metric, expectRun, median, scriptedCommands, timeAic, unattended } from "./lib.ts";

/** Programs each step starts. */
const PROGRAMS = 200;
/** Steps per run: each one the loop (a different line each, since the same line five times is a stall). */
const STEPS = 10;
/** Alternating rounds (AIC_BENCH_PAIRS to change it). */
const ROUNDS = Math.max(1, Number(process.env.AIC_BENCH_PAIRS) || 5);
/** What the exec judge may add to starting one program. */
const TARGET_MS_PER_PROGRAM = 0.5;

const loop = (step: number) => `for i in $(seq ${PROGRAMS}); do /bin/true; done; echo step ${step}`;

interface Variant {
  label: string;
  rules: string | undefined;
  /** Step intervals, every run's together. */
  steps: number[];
  /** The commands' own durations (ms), every run's together. */
  commands: number[];
}

/** One run of STEPS loop steps under `rules`, its figures added to `v`. */
async function runSteps(v: Variant): Promise<void> {
  const cwd = scratch("aic-bench-exec-judge-");
  if (v.rules !== undefined) writeFileSync(join(cwd, ".aicrules"), v.rules);
  const srv = scriptedCommands((i) => (i < STEPS ? loop(i) : undefined));
  try {
    const run = await timeAic(unattended(srv.url, "--no-checkpoints", "--json", "start programs"), { cwd });
    expectRun(`${STEPS}-step run (${v.label})`, run, srv, { code: 0, requests: STEPS + 1 });
    const events = run.stdout
      .split("\n")
      .filter((l) => l.startsWith("{"))
      .map((l) => JSON.parse(l));
    const sandbox = String(events.find((e) => e.type === "start")?.sandbox?.status ?? "?");
    if ((v.rules ?? "").includes("git push") !== sandbox.includes("held at exec"))
      throw new Error(`the run with ${JSON.stringify(v.rules)} says of its sandbox: ${sandbox}`);
    const at = srv.requests.map((r) => r.at);
    // The first step holds the launcher's start: left out of both figures.
    v.steps.push(...at.slice(2).map((t, i) => t - at[i + 1]!));
    const durations = events.filter((e) => e.type === "command_result").map((e) => Number(e.duration_ms));
    if (durations.length !== STEPS) throw new Error(`${durations.length} command results, expected ${STEPS}`);
    v.commands.push(...durations.slice(1));
  } finally {
    srv.close();
  }
}

/** The same loop in bash directly, in this process's environment: what starting the programs costs without aic. */
function floorMs(times: number): number[] {
  const out: number[] = [];
  for (let i = 0; i < times; i++) {
    const started = performance.now();
    Bun.spawnSync(["bash", "-c", loop(i)], { stdout: "ignore", stderr: "ignore" });
    out.push(performance.now() - started);
  }
  return out;
}

export const execJudge: Benchmark = {
  name: "exec-judge",
  description: `steps that each start ${PROGRAMS} programs: deny git push * (judged at exec) vs deny rm * (no judge) vs no rules, ${ROUNDS} alternating rounds`,
  async run(ctx) {
    const variants: Variant[] = [
      { label: "deny git push *", rules: "deny git push *\n", steps: [], commands: [] },
      { label: "deny rm * only", rules: "deny rm *\n", steps: [], commands: [] },
      { label: "no rules file", rules: undefined, steps: [], commands: [] },
    ];
    for (let r = 1; r <= ROUNDS; r++)
      for (const v of variants) {
        ctx.log(`exec-judge: round ${r}/${ROUNDS} (${v.label}): ${STEPS} steps of ${PROGRAMS} programs`);
        await runSteps(v);
      }
    const [judged, byFile, none] = variants.map((v) => median(v.commands)) as [number, number, number];
    const [judgedStep, byFileStep, noneStep] = variants.map((v) => median(v.steps)) as [number, number, number];
    const floor = median(floorMs(ROUNDS * 3));
    const metrics: Metric[] = variants.flatMap((v) => [
      {
        name: `command of ${PROGRAMS} programs [${v.label}]`,
        value: median(v.commands),
        unit: "ms" as const,
        note: `median of ${v.commands.length} commands' duration_ms; ${v.rules?.includes("git push") ? "held at exec" : "no exec judge"}`,
      },
      {
        name: `step [${v.label}]`,
        value: median(v.steps),
        unit: "ms" as const,
        note: "median interval between the model requests around a step",
      },
    ]);
    metrics.push(
      {
        name: "exec judge: overhead per program started",
        value: (judged - byFile) / PROGRAMS,
        unit: "ms",
        target: TARGET_MS_PER_PROGRAM,
        note: "(command judged − command with deny rm only) / programs, difference of medians",
      },
      {
        name: "exec judge: overhead per program vs no rules file",
        value: (judged - none) / PROGRAMS,
        unit: "ms",
      },
      {
        name: "exec judge: overhead per program, from step times",
        value: (judgedStep - byFileStep) / PROGRAMS,
        unit: "ms",
        note: "the same from the intervals between requests",
      },
      { name: "command time, judged / deny rm only", value: judged / byFile, unit: "x", note: "ratio of the medians" },
      { name: "command time, judged / no rules file", value: judged / none, unit: "x" },
      { name: "step time, judged / deny rm only", value: judgedStep / byFileStep, unit: "x" },
      { name: "step time, judged / no rules file", value: judgedStep / noneStep, unit: "x" },
      {
        name: `floor: bash starting ${PROGRAMS} programs, no aic`,
        value: floor,
        unit: "ms",
        note: `median of ${ROUNDS * 3}, spawned from the bench process; ${(floor / PROGRAMS).toFixed(3)} ms a program`,
      },
    );
    return metrics;
  },
};
