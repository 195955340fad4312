/**
 * Session checkpoint cost (README: "Session files"): aic rewrites the whole session file atomically (temp file,
 * fsync, rename) several times per step — after each assistant turn, before each command, after each
 * tool result (session-writes.ts counts them).
 *
 * 1. `SessionStore.save()` in this process, on histories of ~100 KB, ~1 MB and ~5 MB built from
 *    realistic tool outputs: median and p90 of 20 writes each, and how much of that is
 *    JSON.stringify alone (the rest is the write, fsync and rename).
 * 2. The per-step overhead of a 200-step headless run with `--session` against the same run
 *    without, measured as tests/bench/per-step.ts does: (200-step run − 1-step run) / 199.
 *    `--session` also turns on checkpoints of the files (a snapshot before each command; without
 *    a session `--nogui` takes none), so a third mode, `--session --no-checkpoints`, separates the
 *    session store's own cost from the checkpoints' cost.
 * 3. The peak resident set (VmHWM, polled) of those 200-step runs: keeping a session should cost
 *    little memory beyond the conversation itself.
 */
import { mkdtempSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SessionStore, type Message } from "../../aic.ts";
import { scratch } from "../helpers.ts";
import {
  type Benchmark,
  type Metric,
  expectRun,
  median,
  percentile,
  scriptedCommands,
  timeAic,
  unattended,
} from "./lib.ts";

const WRITES = 20;
const WARMUP = 2;
const SIZES = [
  { label: "100 KB", bytes: 100 * 1024, target: 5 },
  { label: "1 MB", bytes: 1024 * 1024, target: 20 },
  { label: "5 MB", bytes: 5 * 1024 * 1024, target: undefined },
];
const STEPS = 200;
const REPEATS = 4;
/** What keeping a session may add to a step, on top of per-step.ts's 20 ms for the whole step. */
const STEP_TARGET_MS = 5;
const POLL_MS = 10;
/** Peak RSS of the 200-step run with --session may be at most this many times the run without. */
const RSS_RATIO_TARGET = 1.1;

// ---------------------------------------------------------------------------------------------
// Realistic histories

/** A small seeded generator: `r(n)` is an integer in [0, n). */
export function rng(seed: number) {
  let a = seed >>> 0;
  return (n: number) => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), a | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return Math.floor((((t ^ (t >>> 14)) >>> 0) / 4294967296) * n);
  };
}

const WORDS = [
  "src",
  "lib",
  "parser",
  "index",
  "config",
  "utils",
  "server",
  "client",
  "render",
  "test",
  "types",
  "cache",
  "auth",
  "db",
  "api",
];

/** One plausible command and what it printed (a listing, a test run, a grep, a build error, a log). */
export function toolExchange(r: (n: number) => number, i: number): { command: string; output: string } {
  const word = () => WORDS[r(WORDS.length)]!;
  const file = () => `${word()}/${word()}_${r(100)}.${["ts", "js", "json", "md"][r(4)]}`;
  const lines = (n: number, f: (k: number) => string) => Array.from({ length: n }, (_, k) => f(k)).join("\n");
  switch (i % 5) {
    case 0:
      return {
        command: `ls -la ${word()}`,
        output: lines(
          10 + r(40),
          () =>
            `-rw-r--r-- 1 dev dev ${String(r(99999)).padStart(6)} Nov ${1 + r(28)} 1${r(10)}:${10 + r(50)} ${file()}`,
        ),
      };
    case 1:
      return {
        command: "npm test 2>&1 | tail -80",
        output: lines(20 + r(60), (k) =>
          r(10) === 0
            ? `  ✗ ${word()} › handles ${word()} input (${r(900)} ms)\n    expected ${r(100)} to equal ${r(100)}\n      at ${file()}:${r(400)}:${r(80)}`
            : `  ✓ ${word()} › ${word()} ${word()} case ${k} (${r(90)} ms)`,
        ),
      };
    case 2:
      return {
        command: `grep -rn "${word()}" src | head -60`,
        output: lines(
          5 + r(55),
          () =>
            `${file()}:${r(900)}:  const ${word()}${r(9)} = await ${word()}.${word()}(${word()}, { ${word()}: ${r(1000)} });`,
        ),
      };
    case 3:
      return {
        command: "npx tsc --noEmit -p .",
        output: lines(
          5 + r(30),
          () =>
            `${file()}(${r(500)},${r(80)}): error TS${2300 + r(400)}: Property '${word()}' does not exist on type '${word()[0]!.toUpperCase()}${word()}Options'.`,
        ),
      };
    default:
      return {
        command: "git log --oneline -40",
        output: lines(
          40,
          () =>
            `${r(0xfffffff).toString(16).padStart(7, "0")} ${word()}: ${["fix", "add", "refactor", "test"][r(4)]} ${word()} ${word()} handling`,
        ),
      };
  }
}

/** A history whose JSON is about `bytes` long: system prompt, the task, then command turns. */
export function buildHistory(bytes: number, seed = 7): Message[] {
  const r = rng(seed);
  const messages: Message[] = [
    {
      role: "system",
      content: `You are an autonomous engineer working in a Linux shell.\n${"Rules and recipes for the agent. ".repeat(120)}`,
    },
    {
      role: "user",
      content: "The test suite fails after the last merge. Find out why and fix it without changing the public API.",
    },
  ];
  let size = JSON.stringify(messages, null, 2).length;
  for (let i = 0; size < bytes; i++) {
    const { command, output } = toolExchange(r, i);
    const id = `call_${i}_${r(1e9).toString(36)}`;
    const turn: Message[] = [
      {
        role: "assistant",
        content: i % 4 === 0 ? `Step ${i}: checking ${command.split(" ")[0]} output next.` : null,
        tool_calls: [
          { id, type: "function", function: { name: "execute_bash", arguments: JSON.stringify({ command }) } },
        ],
      },
      {
        role: "tool",
        tool_call_id: id,
        content: `Command executed with exit code ${r(8) === 0 ? 1 : 0}.\nOutput:\n${output.slice(0, 10_240)}`,
      },
    ];
    messages.push(...turn);
    size += JSON.stringify(turn, null, 2).length;
  }
  return messages;
}

// ---------------------------------------------------------------------------------------------
// save() in process

const quiet = { emit() {} };

interface SaveFigures {
  fileBytes: number;
  saveMs: number[];
  stringifyMs: number[];
}

function timeSaves(messages: Message[]): SaveFigures {
  const dir = mkdtempSync(join(tmpdir(), "aic-bench-session-"));
  const store = SessionStore.claim(
    join(dir, ".aicsession"),
    { model: "bench-model", apiBase: "http://127.0.0.1:9/v1" },
    quiet,
  );
  const state = {
    messages,
    stepCount: 100,
    usage: { input_tokens: 1, output_tokens: 1, cached_tokens: 0, billable_tokens: 2 },
  };
  const saveMs: number[] = [];
  const stringifyMs: number[] = [];
  try {
    for (let i = 0; i < WARMUP + WRITES; i++) {
      // A new message each time, as a real checkpoint has: an unchanged history would skip the fsync.
      messages.push({ role: "user", content: `[Suggestion from user] step ${i}` });
      const started = performance.now();
      if (!store.save("tool_result", state)) throw new Error(`SessionStore.save failed in ${dir}`);
      const ms = performance.now() - started;
      const s0 = performance.now();
      JSON.stringify({ ...state, extra: i }, null, 2);
      const sms = performance.now() - s0;
      if (i >= WARMUP) {
        saveMs.push(ms);
        stringifyMs.push(sms);
      }
    }
    return { fileBytes: statSync(store.path).size, saveMs, stringifyMs };
  } finally {
    store.release();
    rmSync(dir, { recursive: true, force: true });
  }
}

// ---------------------------------------------------------------------------------------------
// Per-step cost of --session in dist/aic

/** How the runs keep a session: none, a session file with checkpoints (the default), or without them. */
const MODES = [
  { key: "none", label: "without a session", flags: [] as string[] },
  { key: "session", label: "with --session", flags: ["--session"] },
  { key: "store", label: "with --session --no-checkpoints", flags: ["--session", "--no-checkpoints"] },
] as const;
type Mode = (typeof MODES)[number];

interface StepRun {
  ms: number;
  /** Milliseconds between consecutive model requests (one per step), from the fake server's clock. */
  intervals: number[];
  sessionBytes: number;
  /** Peak resident set (VmHWM) in MB, when polled. */
  peakMb: number;
}

async function stepRun(steps: number, mode: Mode, pollRss: boolean): Promise<StepRun> {
  const srv = scriptedCommands((i) => (i < steps ? `true ${i}` : undefined)); // a different line each step: the same one five times is a stall
  const cwd = scratch("aic-bench-");
  const session = join(cwd, "bench.aicsession");
  try {
    const flags = mode.flags.flatMap((f) => (f === "--session" ? [f, session] : [f]));
    const run = await timeAic(unattended(srv.url, ...flags, `run true ${steps} times`), {
      cwd,
      pollRssMs: pollRss ? POLL_MS : undefined,
    });
    expectRun(`${steps}-step run ${mode.label}`, run, srv, { code: 0, requests: steps + 1 });
    if (pollRss && run.peakRssKb === 0) throw new Error(`${steps}-step run ${mode.label}: never read VmHWM`);
    const at = srv.requests.map((r) => r.at);
    return {
      ms: run.ms,
      intervals: at.slice(2).map((t, i) => t - at[i + 1]!),
      sessionBytes: mode.key === "none" ? 0 : statSync(session).size,
      peakMb: run.peakRssKb / 1024,
    };
  } finally {
    srv.close();
    rmSync(cwd, { recursive: true, force: true });
  }
}

export const sessionCheckpoint: Benchmark = {
  name: "session",
  description: `SessionStore.save() (atomic write + fsync) on ~100 KB / 1 MB / 5 MB histories, ${WRITES} writes each; per-step cost and peak RSS of --session (with and without checkpoints) over ${STEPS}-step runs`,
  async run(ctx) {
    const metrics: Metric[] = [];
    for (const size of SIZES) {
      ctx.log(`session: save() ×${WRITES} on a ${size.label} history`);
      const f = timeSaves(buildHistory(size.bytes));
      const mb = (f.fileBytes / 1024 / 1024).toFixed(2);
      metrics.push({
        name: `save(), ${size.label} history: median`,
        value: median(f.saveMs),
        unit: "ms",
        target: size.target,
        note: `file ${mb} MB; p90 ${percentile(f.saveMs, 90).toFixed(1)} ms`,
      });
      metrics.push({
        name: `  of which JSON.stringify (median)`,
        value: median(f.stringifyMs),
        unit: "ms",
        note: "the rest is write + fsync + rename",
      });
    }

    const empty = () => ({ none: [] as number[], session: [] as number[], store: [] as number[] });
    const overhead = empty();
    const intervals = empty();
    const peaks = empty();
    let sessionBytes = 0;
    for (let r = 1; r <= REPEATS; r++) {
      // Interleaved so every mode sees the same background load.
      for (const mode of MODES) {
        ctx.log(`session: repeat ${r}/${REPEATS}: 1-step and ${STEPS}-step runs ${mode.label}`);
        const one = await stepRun(1, mode, false);
        const many = await stepRun(STEPS, mode, true);
        overhead[mode.key].push((many.ms - one.ms) / (STEPS - 1));
        intervals[mode.key].push(...many.intervals);
        peaks[mode.key].push(many.peakMb);
        if (mode.key === "session") sessionBytes = many.sessionBytes;
      }
    }
    const list = (xs: number[]) => xs.map((v) => v.toFixed(1)).join(", ");
    const step = { none: median(intervals.none), session: median(intervals.session), store: median(intervals.store) };
    const peak = { none: median(peaks.none), session: median(peaks.session), store: median(peaks.store) };
    metrics.push(
      {
        name: "per-step overhead without a session (median)",
        value: median(overhead.none),
        unit: "ms",
        note: `(${STEPS}-step − 1-step) / ${STEPS - 1}; repeats: ${list(overhead.none)} ms`,
      },
      {
        name: "per-step overhead with --session (median)",
        value: median(overhead.session),
        unit: "ms",
        note: `checkpoints on (the default); repeats: ${list(overhead.session)} ms; final file ${(sessionBytes / 1024).toFixed(0)} KB`,
      },
      {
        name: "per-step overhead, --session --no-checkpoints",
        value: median(overhead.store),
        unit: "ms",
        note: `median; repeats: ${list(overhead.store)} ms`,
      },
      {
        name: "step interval without a session (median)",
        value: step.none,
        unit: "ms",
        note: `${intervals.none.length} steps, between model requests`,
      },
      {
        name: "step interval with --session (median)",
        value: step.session,
        unit: "ms",
        note: `${intervals.session.length} steps; checkpoints on`,
      },
      {
        name: "step interval, --session --no-checkpoints",
        value: step.store,
        unit: "ms",
        note: `median of ${intervals.store.length} steps`,
      },
      {
        name: "cost of --session per step",
        value: step.session - step.none,
        unit: "ms",
        // The target is the session store's (below); the file snapshot has its own in the checkpoints benchmark.
        note: "difference of the step-interval medians: the session store's checkpoints plus a file snapshot a step",
      },
      {
        name: "  of which the session store",
        value: step.store - step.none,
        unit: "ms",
        target: STEP_TARGET_MS,
        note: "--session --no-checkpoints against no session: three session writes a step",
      },
      {
        name: "  of which the file checkpoints",
        value: step.session - step.store,
        unit: "ms",
        note: "--session against --session --no-checkpoints: the snapshot before each command (target: see checkpoints)",
      },
      {
        name: `peak RSS, ${STEPS}-step run without a session`,
        value: peak.none,
        unit: "MB",
        note: `median; repeats ${list(peaks.none)} MB`,
      },
      {
        name: `peak RSS, ${STEPS}-step run with --session`,
        value: peak.session,
        unit: "MB",
        note: `median; repeats ${list(peaks.session)} MB`,
      },
      {
        name: `peak RSS, ${STEPS}-step run, --no-checkpoints`,
        value: peak.store,
        unit: "MB",
        note: `--session --no-checkpoints; median; repeats ${list(peaks.store)} MB`,
      },
      {
        name: "peak RSS with --session / without",
        value: peak.session / peak.none,
        unit: "x",
        target: RSS_RATIO_TARGET,
        note: `--no-checkpoints / without: ${(peak.store / peak.none).toFixed(2)}×`,
      },
    );
    return metrics;
  },
};
