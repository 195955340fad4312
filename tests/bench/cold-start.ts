/**
 * Cold start: how long dist/aic takes from spawn to exit on the paths that do
 * no work — `--version`, `--help`, and a usage error (missing --model). This is
 * the floor every invocation pays, and what a shell completion or a CI script
 * calling `aic --version` sees.
 */
import { statSync } from "node:fs";
import { AIC, type Benchmark, type Metric, median, percentile, timeAic } from "./lib.ts";

const RUNS = 20;
/** Runs thrown away first, so the 120 MB binary is in the page cache for every timed run. */
const WARMUP = 2;
const TARGET_MS = 60;

interface Case {
  label: string;
  args: string[];
  code: number;
  /** Something the output must contain, so a broken path is not timed as a fast one. */
  expect: RegExp;
}

const CASES: Case[] = [
  { label: "--version", args: ["--version"], code: 0, expect: /^aic \d/ },
  { label: "--help", args: ["--help"], code: 0, expect: /Usage:/ },
  // A run request without --model: parsed, rejected with exit 2 before any model or PTY work.
  {
    label: "usage error (no --model)",
    args: ["--nogui", "--api-base", "http://127.0.0.1:9/v1", "hello"],
    code: 2,
    expect: /model/,
  },
];

async function timeCase(c: Case): Promise<number[]> {
  const times: number[] = [];
  for (let i = 0; i < WARMUP + RUNS; i++) {
    const run = await timeAic(c.args);
    const text = run.stdout + run.stderr;
    if (run.code !== c.code || !c.expect.test(text)) {
      throw new Error(`aic ${c.args.join(" ")}: exit ${run.code} (expected ${c.code}), output: ${text.slice(0, 300)}`);
    }
    if (i >= WARMUP) times.push(run.ms);
  }
  return times;
}

export const coldStart: Benchmark = {
  name: "cold-start",
  description: `spawn-to-exit of dist/aic on no-work paths, ${RUNS} runs each after ${WARMUP} warm-up runs`,
  async run(ctx) {
    // The size every cold start reads from disk (the Bun runtime, OpenTUI's native library, tiktoken's tables).
    const metrics: Metric[] = [
      { name: "dist/aic size", value: statSync(AIC).size / 1048576, unit: "MB", note: `${statSync(AIC).size} bytes` },
    ];
    for (const c of CASES) {
      ctx.log(`cold-start: ${c.label} ×${RUNS}`);
      const times = await timeCase(c);
      metrics.push({ name: `${c.label}: median`, value: median(times), unit: "ms", target: TARGET_MS });
      metrics.push({
        name: `${c.label}: p90`,
        value: percentile(times, 90),
        unit: "ms",
        note: `min ${Math.min(...times).toFixed(1)} ms`,
      });
    }
    return metrics;
  },
};
