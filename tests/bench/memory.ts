/**
 * Peak memory: the high-water resident set (VmHWM) of dist/aic during a long
 * run and during a command that prints far more than the output cap. The README
 * ("Running a command") promises that memory stays bounded whatever a command prints.
 *
 * The peak depends on when the garbage collector happens to run, so every
 * case runs REPEATS times and the worst peak is the figure (the others are in
 * the note). A 1-step run gives the baseline every run pays.
 */
import { toolResults } from "../helpers.ts";
import { type Benchmark, type Metric, expectRun, scriptedCommands, timeAic, unattended } from "./lib.ts";

/** The step run: at most what the Python original peaked at for 100 steps (82 MB), rounded down. */
const STEP_TARGET_MB = 80;
/** A command that prints without end, stopped as a runaway. */
const RUNAWAY_TARGET_MB = 100;
/** Everything a 16 MB output renders to, when the cap lets it all through. */
const FULL_RENDER_TARGET_MB = 150;
const POLL_MS = 10;
const REPEATS = 3;
const STEPS = 200;
const SEQ = "seq 1 2000000"; // 14.9 MB of text, 16.9 MB through the PTY (\n becomes \r\n)
const YES = "yes"; // never ends: only the runaway stop ends it
/** Large enough that the runaway limit (100 × cap = 20 MB) lets the whole `seq` stream through. */
const FULL_RENDER_CAP = 200_000;

interface Case {
  label: string;
  /** The command for request i, or undefined for TASKCOMPLETE. */
  commands: (i: number) => string | undefined;
  requests: number;
  flags: string[];
  target?: number;
}

const CASES: Case[] = [
  { label: "1-step run (baseline)", commands: (i) => (i < 1 ? "true" : undefined), requests: 2, flags: [] },
  {
    label: `${STEPS}-step run`,
    commands: (i) => (i < STEPS ? `true ${i}` : undefined), // the same line five times in a row is a stall
    requests: STEPS + 1,
    flags: [],
    target: STEP_TARGET_MB,
  },
  // Default cap 10240: the runaway limit (1 MB) stops `seq` early.
  {
    label: `\`${SEQ}\`, default cap`,
    commands: (i) => (i === 0 ? SEQ : undefined),
    requests: 2,
    flags: [],
    target: RUNAWAY_TARGET_MB,
  },
  {
    label: `\`${YES}\`, default cap`,
    commands: (i) => (i === 0 ? YES : undefined),
    requests: 2,
    flags: [],
    target: RUNAWAY_TARGET_MB,
  },
  // The whole stream rendered and truncated; a prompt budget far above the 200 kB result keeps compression out of it.
  {
    label: `\`${SEQ}\`, cap ${FULL_RENDER_CAP}`,
    commands: (i) => (i === 0 ? SEQ : undefined),
    requests: 2,
    flags: ["--max-output-bytes", String(FULL_RENDER_CAP), "--max-prompt-len", "10000000"],
    target: FULL_RENDER_TARGET_MB,
  },
];

/** What became of the command, read from the tool message aic sent back. */
function outcome(toolMessage: string | undefined): string {
  if (toolMessage === undefined) return "no tool message";
  const parts: string[] = [];
  if (/runaway/i.test(toolMessage)) parts.push("stopped as runaway");
  if (toolMessage.trimEnd().endsWith("output too long: truncated")) parts.push("truncated");
  parts.push(`${toolMessage.length} chars to the model`);
  return parts.join(", ");
}

async function peakOnce(c: Case) {
  const srv = scriptedCommands(c.commands);
  try {
    const run = await timeAic(unattended(srv.url, ...c.flags, c.label), { pollRssMs: POLL_MS, keepStdoutChars: 0 });
    expectRun(c.label, run, srv, { code: 0, requests: c.requests });
    if (run.peakRssKb === 0)
      throw new Error(`${c.label}: never read VmHWM from /proc (exited within ${run.ms.toFixed(0)} ms?)`);
    return { mb: run.peakRssKb / 1024, ms: run.ms, stdoutBytes: run.stdoutBytes, tool: toolResults(srv).at(-1) };
  } finally {
    srv.close();
  }
}

export const memory: Benchmark = {
  name: "memory",
  description: `peak RSS of dist/aic (last VmHWM seen, polled every ${POLL_MS} ms), worst of ${REPEATS} runs`,
  async run(ctx) {
    const metrics: Metric[] = [];
    for (const c of CASES) {
      const runs = [];
      for (let r = 1; r <= REPEATS; r++) {
        ctx.log(`memory: ${c.label} (${r}/${REPEATS})`);
        runs.push(await peakOnce(c));
      }
      const worst = runs.reduce((a, b) => (b.mb > a.mb ? b : a));
      const details = [`runs ${runs.map((x) => x.mb.toFixed(0)).join(", ")} MB`, `${(worst.ms / 1000).toFixed(1)} s`];
      if (c.commands(0) !== "true" && c.commands(0) !== undefined)
        details.push(outcome(worst.tool), `${(worst.stdoutBytes / 1048576).toFixed(1)} MB on stdout`);
      metrics.push({
        name: `peak RSS, ${c.label}`,
        value: worst.mb,
        unit: "MB",
        target: c.target,
        note: details.join("; "),
      });
    }
    metrics.push(await launcherPeak(ctx));
    return metrics;
  },
};

/**
 * The sandbox launcher is a second process (see the README's "Sandbox (Linux)"): its own peak, read by a
 * command from /proc/$PPID/status, since the launcher is every command's parent.
 */
async function launcherPeak(ctx: { log(message: string): void }): Promise<Metric> {
  ctx.log("memory: the sandbox launcher's own peak RSS");
  const srv = scriptedCommands((i) => (i === 0 ? "grep VmHWM /proc/$PPID/status" : undefined));
  try {
    const run = await timeAic(unattended(srv.url, "launcher RSS"), { keepStdoutChars: 0 });
    expectRun("launcher RSS", run, srv, { code: 0, requests: 2 });
    const kb = Number(/VmHWM:\s+(\d+)/.exec(toolResults(srv).at(-1) ?? "")?.[1]);
    if (!kb) throw new Error(`the command did not print the launcher's VmHWM: ${toolResults(srv).at(-1)}`);
    return {
      name: "peak RSS of the sandbox launcher (a second process)",
      value: kb / 1024,
      unit: "MB",
      note: "not in the figures above, which are aic's own process",
    };
  } finally {
    srv.close();
  }
}
