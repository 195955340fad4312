/**
 * Shared plumbing for the benchmarks in this folder: the benchmark and metric
 * types, statistics, timing a dist/aic process, polling its peak memory, and a
 * fake model that answers instantly. What they share with the tests (running
 * dist/aic with a clean environment, reading /proc, reading what the model was
 * sent) comes from tests/helpers.ts.
 *
 * Benchmarks inform; they are not tests. They never fail the run: a metric
 * that misses its target is printed as MISS and the runner still exits 0.
 */
import { rmSync } from "node:fs";
import { startFakeServer, type FakeServer, type RecordedRequest, type Turn } from "../fake-openai.ts";
import { AIC, bash, cleanEnv, headless, readPeakRssKb, scratch } from "../helpers.ts";

export { AIC };

/** One measured figure. A metric without a target is informational. */
export interface Metric {
  name: string;
  value: number;
  unit: "ms" | "MB" | "x" | "count";
  /** Upper bound the value should stay at or below. */
  target?: number;
  note?: string;
  /**
   * Set when the figure could not be measured as defined: SKIP (something it needs is missing, the
   * note says what), INVALID (it ran, but not in the conditions the figure is defined by, such as
   * checkpoints turned off where they must be on). Either replaces PASS/MISS.
   */
  status?: "SKIP" | "INVALID";
}

export interface BenchContext {
  /** Progress lines for the person watching (stderr). */
  log(message: string): void;
}

export interface Benchmark {
  /** Short kebab-case name, used on the command line: `bun run tests/bench/run.ts cold-start`. */
  name: string;
  description: string;
  run(ctx: BenchContext): Promise<Metric[]>;
}

// ---------------------------------------------------------------------------------------------
// Statistics

export function median(values: number[]): number {
  return percentile(values, 50);
}

/** Nearest-rank percentile (p in 0..100) of a non-empty list. */
export function percentile(values: number[], p: number): number {
  if (values.length === 0) throw new Error("percentile of an empty list");
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.max(1, Math.ceil((p / 100) * sorted.length));
  return sorted[rank - 1]!;
}

// ---------------------------------------------------------------------------------------------
// Running dist/aic

export interface TimedRun {
  code: number;
  /** Spawn to exit, wall clock. */
  ms: number;
  /** performance.timeOrigin-relative spawn instant, for lining up with server timestamps. */
  spawnedAtEpochMs: number;
  stdout: string;
  stdoutBytes: number;
  stderr: string;
  /** Last VmHWM (peak resident set) read from /proc before the process went away, in kB; 0 if never read. */
  peakRssKb: number;
}

export interface TimedRunOptions {
  cwd?: string;
  /** Poll /proc/<pid>/status for VmHWM every this many ms (off when undefined). */
  pollRssMs?: number;
  /** Keep at most this many characters of stdout (the byte count is always exact). */
  keepStdoutChars?: number;
  killAfterMs?: number;
  /** Added to the clean environment. */
  env?: Record<string, string>;
}

/**
 * Runs dist/aic with a clean environment (as tests/helpers.ts does), draining
 * stdout and stderr, and times it from spawn to exit.
 */
export async function timeAic(args: string[], opts: TimedRunOptions = {}): Promise<TimedRun> {
  const keep = opts.keepStdoutChars ?? 64 * 1024;
  // A fresh working directory per run, removed afterwards (benchmarks run hundreds of times).
  const cwd = opts.cwd ?? scratch("aic-bench-");
  const spawnedAtEpochMs = performance.timeOrigin + performance.now();
  const started = performance.now();
  const proc = Bun.spawn([AIC, ...args], {
    cwd,
    env: cleanEnv(opts.env),
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
  });
  let peakRssKb = 0;
  const poll = opts.pollRssMs
    ? setInterval(() => {
        const kb = readPeakRssKb(proc.pid);
        if (kb !== undefined) peakRssKb = kb;
      }, opts.pollRssMs)
    : undefined;
  const guard = setTimeout(() => proc.kill("SIGKILL"), opts.killAfterMs ?? 300_000);

  const drain = async (stream: ReadableStream<Uint8Array>, limit: number) => {
    const decoder = new TextDecoder();
    let text = "";
    let bytes = 0;
    for await (const chunk of stream) {
      bytes += chunk.length;
      if (text.length < limit) text += decoder.decode(chunk, { stream: true });
    }
    return { text: text.slice(0, limit), bytes };
  };
  const [out, err, code] = await Promise.all([drain(proc.stdout, keep), drain(proc.stderr, 64 * 1024), proc.exited]);
  const ms = performance.now() - started;
  clearTimeout(guard);
  if (poll) clearInterval(poll);
  if (opts.cwd === undefined) rmSync(cwd, { recursive: true, force: true });
  return { code, ms, spawnedAtEpochMs, stdout: out.text, stdoutBytes: out.bytes, stderr: err.text, peakRssKb };
}

/** `--nogui --auto-approve` against `url`: the unattended CI shape of a run. */
export function unattended(url: string, ...more: string[]): string[] {
  return headless(url, "bench-model", "--auto-approve", ...more);
}

// ---------------------------------------------------------------------------------------------
// An instant fake model

/**
 * Rough prompt size (characters / 4). Supplying usage ourselves keeps the fake
 * server from running tiktoken over the whole prompt on every request, which
 * would put the bench process's own work inside aic's per-step time.
 */
export function roughPromptTokens(req: RecordedRequest): number {
  let chars = 0;
  for (const m of Array.isArray(req.body?.messages) ? req.body.messages : []) {
    chars += typeof m?.content === "string" ? m.content.length : 0;
    for (const c of Array.isArray(m?.tool_calls) ? m.tool_calls : [])
      chars += String(c?.function?.arguments ?? "").length;
  }
  return Math.max(1, Math.ceil(chars / 4));
}

/** A fake model that asks for `commands[i]` on request i, then answers TASKCOMPLETE; no delays. */
export function scriptedCommands(commands: (index: number) => string | undefined): FakeServer {
  return startFakeServer({
    turns: (req, index): Turn => {
      const command = commands(index);
      const usage = { prompt_tokens: roughPromptTokens(req), completion_tokens: 12 };
      return command === undefined ? { content: "TASKCOMPLETE", usage } : { ...bash(command), usage };
    },
  });
}

/** Throws with the run's stderr when aic did not finish the way the benchmark needs. */
export function expectRun(
  what: string,
  run: TimedRun,
  srv: FakeServer | undefined,
  expected: { code: number; requests?: number },
): void {
  const problems: string[] = [];
  if (run.code !== expected.code) problems.push(`exit code ${run.code}, expected ${expected.code}`);
  if (srv && expected.requests !== undefined && srv.requests.length !== expected.requests)
    problems.push(`${srv.requests.length} model requests, expected ${expected.requests}`);
  if (problems.length)
    throw new Error(`${what}: ${problems.join("; ")}\n--- stderr (tail) ---\n${run.stderr.slice(-1500)}`);
}
