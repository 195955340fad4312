/**
 * Session writes per step (README: "Session files"), with `--session PATH` on a real disk: how many
 * times a step rewrites the session file, how many fsyncs it makes and how many of those the step
 * itself waits for, and what keeping the session adds to a step's wall time.
 *
 * 1. One run of STEPS steps (`true N`, auto-approved, checkpoints on and off) under
 *    `strace -f -e trace=openat,rename,fsync,fdatasync`, counted over steps 2 … STEPS (start-up,
 *    the first request and the exit stay out): temporary session files written (`openat` of
 *    `.NAME.*.tmp`), renames onto the session file, fsyncs by aic's main thread (the event loop
 *    waits in them) and by its other threads (the thread pool: only a command waits for those).
 * 2. Per step (the median gap between consecutive model requests, as field.ts measures it) with
 *    `--session` against the same run without a session, A and B alternating for PAIRS pairs
 *    (AIC_BENCH_PAIRS, default 3), both in the same directory kind.
 *
 * The session file lives in a directory under AIC_BENCH_DISK_DIR (default /var/tmp), which must not
 * be a tmpfs: there fsync costs nothing and the figure would say nothing. The metric is marked
 * INVALID when it is one.
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { alternate, expectSteps, fieldRun, list, median } from "./field-lib.ts";
import type { Benchmark, Metric } from "./lib.ts";

const STEPS = 20;
const PAIRS = Math.max(1, Number(process.env.AIC_BENCH_PAIRS) || 3);
const DISK = process.env.AIC_BENCH_DISK_DIR || "/var/tmp";
/** The turn, the checkpoint of the files before its command, the result (without checkpoints: the turn, the result). */
const WRITES_TARGET = { default: 3, "--no-checkpoints": 2 } as const;
/** A step's checkpoints are flushed on the thread pool: the event loop makes no fsync of its own during a step. */
const LOOP_FSYNCS_TARGET = 0;

/** The file system type of `dir` (`ext2/ext3`, `tmpfs`, `xfs`, …), as `stat -f` names it. */
function fsType(dir: string): string {
  const r = Bun.spawnSync(["stat", "-f", "-c", "%T", dir], { stdout: "pipe", stderr: "pipe" });
  return r.exitCode === 0 ? r.stdout.toString().trim() : "unknown";
}

interface Counts {
  temporaries: number;
  renames: number;
  mainFsyncs: number;
  otherFsyncs: number;
}

const steps = (n: number) => (i: number) => (i < n ? `true ${i}` : undefined);

/** One run under strace; the session syscalls per step over steps 2 … STEPS. */
async function traced(flags: string[]): Promise<Counts | undefined> {
  if (!Bun.which("strace")) return undefined;
  const dir = mkdtempSync(join(DISK, "aic-bench-session-writes-"));
  const out = join(dir, "trace");
  try {
    const run = await fieldRun("aic", undefined, {
      cwd: dir,
      commands: steps(STEPS),
      flags: ["--session", join(dir, "run.aicsession"), ...flags],
      wrap: ["strace", "-f", "-qq", "-ttt", "-o", out, "-e", "trace=openat,rename,renameat,renameat2,fsync,fdatasync"],
    });
    expectSteps(`session-writes under strace ${flags.join(" ")}`, run, STEPS);
    const [from, to] = [run.atEpochMs[1]! / 1000, run.atEpochMs[STEPS]! / 1000];
    const lines = readFileSync(out, "utf8").split("\n");
    // aic's main thread is the first pid of the trace (strace -f names every thread by its tid).
    const main = /^(\d+)\s/.exec(lines[0] ?? "")?.[1];
    const c: Counts = { temporaries: 0, renames: 0, mainFsyncs: 0, otherFsyncs: 0 };
    for (const line of lines) {
      const m = /^(\d+)\s+([\d.]+)\s+(openat|rename|renameat2?|fsync|fdatasync)\((.*)$/.exec(line);
      if (!m || Number(m[2]) < from || Number(m[2]) > to) continue;
      if (m[3] === "openat")
        c.temporaries += /\.run\.aicsession\.[^"/]*\.tmp"/.test(m[4]!) && /O_CREAT/.test(m[4]!) ? 1 : 0;
      else if (m[3]!.startsWith("rename"))
        c.renames += /run\.aicsession"\)?/.test(m[4]!.split(",").at(-1) ?? "") ? 1 : 0;
      else if (m[1] === main) c.mainFsyncs++;
      else c.otherFsyncs++;
    }
    const n = STEPS - 1;
    return {
      temporaries: c.temporaries / n,
      renames: c.renames / n,
      mainFsyncs: c.mainFsyncs / n,
      otherFsyncs: c.otherFsyncs / n,
    };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

export const sessionWrites: Benchmark = {
  name: "session-writes",
  description: `session file writes and fsyncs per step with --session on a real disk (${DISK}), ${STEPS} steps, and per step with ÷ without a session, ${PAIRS} pairs`,
  async run(ctx) {
    const kind = fsType(DISK);
    const invalid = kind === "tmpfs" || kind === "ramfs" ? ("INVALID" as const) : undefined;
    const where = `${DISK} is ${kind}${invalid ? " (no disk under it: set AIC_BENCH_DISK_DIR)" : ""}`;
    const metrics: Metric[] = [];
    for (const [label, flags] of [
      ["default", []],
      ["--no-checkpoints", ["--no-checkpoints"]],
    ] as const) {
      ctx.log(`session-writes: ${label}: one run under strace`);
      const c = await traced([...flags]);
      if (!c) {
        metrics.push({ name: `[${label}] writes per step`, value: NaN, unit: "x", status: "SKIP", note: "no strace" });
      } else {
        metrics.push(
          {
            name: `[${label}] session writes per step`,
            value: c.temporaries,
            unit: "x",
            target: WRITES_TARGET[label],
            status: invalid,
            note: `temporary files written; ${c.renames.toFixed(2)} renames onto the session file; ${where}`,
          },
          {
            name: `[${label}] fsyncs on aic's event loop per step`,
            value: c.mainFsyncs,
            unit: "x",
            target: LOOP_FSYNCS_TARGET,
            status: invalid,
            note: `${c.otherFsyncs.toFixed(2)} on other threads (the thread pool); ${(c.mainFsyncs + c.otherFsyncs).toFixed(2)} in all; a command still waits for its turn's to end`,
          },
        );
      }
      const once = async (session: boolean) => {
        const dir = mkdtempSync(join(DISK, "aic-bench-session-writes-"));
        try {
          const r = await fieldRun("aic", undefined, {
            cwd: dir,
            commands: steps(STEPS),
            flags: [...(session ? ["--session", join(dir, "run.aicsession")] : []), ...flags],
          });
          expectSteps(`session-writes ${label} ${session ? "--session" : "no session"}`, r, STEPS);
          return median(r.gaps);
        } finally {
          rmSync(dir, { recursive: true, force: true });
        }
      };
      const { a, b } = await alternate(
        PAIRS,
        () => once(true),
        () => once(false),
        (i) => ctx.log(`session-writes: ${label}: pair ${i + 1}/${PAIRS}`),
      );
      metrics.push(
        { name: `[${label}] per step with --session`, value: median(a), unit: "ms", note: `runs: ${list(a)}` },
        { name: `[${label}] per step without a session`, value: median(b), unit: "ms", note: `runs: ${list(b)}` },
        {
          name: `[${label}] what the session adds to a step`,
          value: median(a) - median(b),
          unit: "ms",
          status: invalid,
          note: `difference of the medians; ${where}`,
        },
      );
    }
    return metrics;
  },
};
