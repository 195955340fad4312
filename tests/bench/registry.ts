/**
 * Every benchmark the runner knows, in the order they run by default.
 *
 * To add one (session checkpoint cost, token accounting cost, TUI
 * responsiveness, …): write `tests/bench/<name>.ts` exporting a `Benchmark`
 * (see lib.ts: a name, a description and `run(ctx)` returning metrics, each
 * with an optional target), and append it here. Do not name files *.test.ts:
 * benchmarks must not run under `bun test`.
 */
import { bigSession } from "./big-session.ts";
import { checkpoints } from "./checkpoints.ts";
import { coldStart } from "./cold-start.ts";
import { execJudge } from "./exec-judge.ts";
import { field20mb, fieldBigDir, fieldCheckpoints, fieldFirstStep, fieldMemory, fieldSpeed } from "./field.ts";
import { fieldTui } from "./field-tui.ts";
import { inputWait } from "./input-wait.ts";
import type { Benchmark } from "./lib.ts";
import { memory } from "./memory.ts";
import { perStep } from "./per-step.ts";
import { rules } from "./rules.ts";
import { sessionCheckpoint } from "./session.ts";
import { sessionWrites } from "./session-writes.ts";
import { tokens } from "./tokens.ts";
import { tui } from "./tui.ts";

export const BENCHMARKS: readonly Benchmark[] = [
  coldStart,
  perStep,
  memory,
  tokens,
  sessionCheckpoint,
  sessionWrites,
  bigSession,
  checkpoints,
  tui,
  inputWait,
  rules,
  execJudge,
  // Speed in real repositories and long runs (field.ts, field-tui.ts): ratios from alternating runs.
  fieldCheckpoints,
  fieldFirstStep,
  fieldBigDir,
  fieldSpeed,
  fieldMemory,
  field20mb,
  fieldTui,
];

/** Names that stand for several benchmarks on the command line: `bun run tests/bench/run.ts field`. */
export const GROUPS: Readonly<Record<string, readonly string[]>> = {
  field: BENCHMARKS.filter((b) => b.name.startsWith("field-")).map((b) => b.name),
};
