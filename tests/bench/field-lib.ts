/**
 * Plumbing for the field benchmarks (field.ts, field-tui.ts): runs of dist/aic and of the original
 * Python program against one fake model that answers at once, timed from the model's side (per
 * step = the gap between consecutive model requests, stamped with performance.now() as each
 * request reaches the server), the peak memory of a whole process tree, the original's location,
 * alternating A/B pairs, and the trees the figures run in.
 *
 * The original (the unchanged aic.py, run from local wheels) is found at $AIC_ORIGINAL, else where
 * the anchors' setup-original.sh puts its wrapper ($XDG_CACHE_HOME/aic-original/aic-orig, default
 * ~/.cache). When it is missing, the figures that need it say so (SKIP) and the others still run.
 */
import { dlopen, FFIType } from "bun:ffi";
import {
  accessSync,
  chmodSync,
  constants,
  copyFileSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { homedir, tmpdir } from "node:os";
import { join } from "node:path";
import { startFakeServer } from "../fake-openai.ts";
import { AIC, bash, cleanEnv, readPeakRssKb, scratch } from "../helpers.ts";
import { median, roughPromptTokens } from "./lib.ts";

// ---------------------------------------------------------------------------------------------
// The binary

let pinned: string | undefined;

/**
 * dist/aic as it was when the first field figure started: a private copy, so a rebuild in the
 * middle of the bench (another session running `bun run build`) cannot mix two builds in one
 * ratio. Removed when the bench exits.
 */
export function fieldAic(): string {
  if (pinned) return pinned;
  const dir = mkdtempSync(join(tmpdir(), "aic-bench-bin-"));
  pinned = join(dir, "aic");
  copyFileSync(AIC, pinned);
  chmodSync(pinned, 0o755);
  process.once("exit", () => rmSync(dir, { recursive: true, force: true }));
  return pinned;
}

// ---------------------------------------------------------------------------------------------
// The original

export interface Original {
  /** The wrapper that runs aic.py (`WRAPPER --nogui --auto-approve --api-base URL --model M --api-key x TASK`). */
  path?: string;
  /** Where it was looked for, and how to set it up, when it was not found. */
  missing?: string;
}

export function findOriginal(): Original {
  const runnable = (p: string) => {
    try {
      accessSync(p, constants.X_OK);
      return statSync(p).isFile();
    } catch {
      return false;
    }
  };
  const fromEnv = process.env.AIC_ORIGINAL;
  if (fromEnv)
    return runnable(fromEnv) ? { path: fromEnv } : { missing: `AIC_ORIGINAL=${fromEnv} is not an executable file` };
  const cache = process.env.XDG_CACHE_HOME || join(homedir(), ".cache");
  const wrapper = join(cache, "aic-original", "aic-orig");
  if (runnable(wrapper)) return { path: wrapper };
  return {
    missing: `the original is not set up (no ${wrapper}): run the anchors' setup-original.sh, or set AIC_ORIGINAL to its wrapper`,
  };
}

// ---------------------------------------------------------------------------------------------
// One run against an instant fake model

export type Who = "aic" | "original";

export interface FieldRunOptions {
  /** The command asked for at command step i (0-based), or undefined: TASKCOMPLETE. */
  commands: (i: number) => string | undefined;
  cwd: string;
  /** Flags after the common ones (`--nogui --auto-approve --api-base … --model … --api-key x`). */
  flags?: string[];
  env?: Record<string, string>;
  /** Sample the process tree's memory every this many ms (off when undefined). */
  sampleMemoryMs?: number;
  killAfterMs?: number;
  /** Words put before the program (`strace -f -o FILE …`). */
  wrap?: string[];
}

export interface FieldRun {
  code: number;
  ms: number;
  /** performance.now() of each model request carrying tools (a step's request), in order. */
  at: number[];
  /** The same instants, as wall-clock epoch milliseconds (to line up with strace -ttt). */
  atEpochMs: number[];
  /** Spawn → the first model request. */
  firstRequestMs: number;
  /** Gaps between consecutive step requests: one per step. */
  gaps: number[];
  /** Requests without tools (a summary for compression), answered with a short summary. */
  summaries: number;
  stderr: string;
  stdoutBytes: number;
  /** Highest sampled Σ Pss over the process tree, kB: the figure. */
  peakTreeKb: number;
  /** Highest sampled Σ Rss over the process tree, kB (counts shared pages once per process). */
  peakRssKb: number;
  /** The program's own process: its VmHWM. */
  mainHwmKb: number;
  /** Most processes seen in the tree at once. */
  maxProcesses: number;
}

const SUMMARY = "Summary of the earlier steps: the commands ran and printed their output; nothing failed.";

/** Runs `who` once on a fresh fake server; commands are counted per step request, so summary requests do not shift them. */
export async function fieldRun(who: Who, original: string | undefined, opts: FieldRunOptions): Promise<FieldRun> {
  const at: number[] = [];
  const atEpochMs: number[] = [];
  let served = 0;
  let summaries = 0;
  const srv = startFakeServer({
    turns: (req) => {
      const now = performance.now();
      const usage = { prompt_tokens: roughPromptTokens(req), completion_tokens: 12 };
      const tools = Array.isArray(req.body?.tools) && req.body.tools.length > 0;
      req.body = null; // the server keeps every request: 1,000 steps of growing history would be the bench's own memory
      if (!tools) return (summaries++, { content: SUMMARY, usage });
      at.push(now);
      atEpochMs.push(performance.timeOrigin + now);
      const command = opts.commands(served);
      if (command === undefined) return { content: "TASKCOMPLETE", usage };
      served++;
      return { ...bash(command), usage };
    },
  });
  try {
    const common = ["--nogui", "--auto-approve", "--api-base", srv.url, "--model", "bench-model", "--api-key", "x"];
    const argv =
      who === "aic"
        ? [fieldAic(), ...common, ...(opts.flags ?? []), "run the benchmark's commands"]
        : [original!, ...common, ...(opts.flags ?? []), "run the benchmark's commands"];
    const started = performance.now();
    const proc = Bun.spawn([...(opts.wrap ?? []), ...argv], {
      cwd: opts.cwd,
      env: cleanEnv(opts.env),
      stdin: "ignore",
      stdout: "pipe",
      stderr: "pipe",
    });
    const sampler = opts.sampleMemoryMs ? treeSampler(proc.pid, opts.sampleMemoryMs) : undefined;
    const guard = setTimeout(() => proc.kill("SIGKILL"), opts.killAfterMs ?? 600_000);
    const drain = async (stream: ReadableStream<Uint8Array>, keep: number) => {
      let bytes = 0;
      let tail = "";
      const decoder = new TextDecoder();
      for await (const chunk of stream) {
        bytes += chunk.length;
        tail = (tail + decoder.decode(chunk, { stream: true })).slice(-keep);
      }
      return { bytes, tail };
    };
    const [out, err, code] = await Promise.all([drain(proc.stdout, 0), drain(proc.stderr, 4000), proc.exited]);
    const ms = performance.now() - started;
    clearTimeout(guard);
    const mem = sampler?.stop();
    return {
      code,
      ms,
      at,
      atEpochMs,
      gaps: at.slice(1).map((t, i) => t - at[i]!),
      firstRequestMs: (at[0] ?? NaN) - started,
      summaries,
      stderr: err.tail,
      stdoutBytes: out.bytes,
      peakTreeKb: mem?.peakTreeKb ?? 0,
      peakRssKb: mem?.peakRssKb ?? 0,
      mainHwmKb: mem?.mainHwmKb ?? 0,
      maxProcesses: mem?.maxProcesses ?? 0,
    };
  } finally {
    srv.close();
  }
}

/** Throws with the stderr tail unless the run exited 0 after `steps` step requests plus the last one. */
export function expectSteps(what: string, run: FieldRun, steps: number): void {
  if (run.code === 0 && run.at.length === steps + 1) return;
  throw new Error(
    `${what}: exit ${run.code}, ${run.at.length} step requests (expected ${steps + 1})\n--- stderr (tail) ---\n${run.stderr.slice(-1500)}`,
  );
}

/** aic's warning that checkpoints went off (with its reason), if it printed one. */
export function checkpointsOff(run: FieldRun): string | undefined {
  return /checkpoints are off: ([^\n]*)/.exec(run.stderr)?.[1];
}

// ---------------------------------------------------------------------------------------------
// Memory of a process tree

/** Pss and Rss of a process, kB (smaps_rollup: one pass over its mappings); undefined once it is gone or a zombie. */
function readMemory(pid: number): { pss: number; rss: number } | undefined {
  try {
    const s = readFileSync(`/proc/${pid}/smaps_rollup`, "utf8");
    const pss = /^Pss:\s+(\d+)/m.exec(s);
    const rss = /^Rss:\s+(\d+)/m.exec(s);
    return pss && rss ? { pss: Number(pss[1]), rss: Number(rss[1]) } : undefined;
  } catch {
    return undefined;
  }
}

/** The pid and all its descendants with their parents, through /proc/PID/task/TID/children (every thread's own children). */
export function processTree(root: number): { pid: number; parent: number }[] {
  const out = [{ pid: root, parent: 0 }];
  for (let i = 0; i < out.length; i++) {
    const pid = out[i]!.pid;
    let tasks: string[];
    try {
      tasks = readdirSync(`/proc/${pid}/task`);
    } catch {
      continue;
    }
    for (const t of tasks) {
      try {
        const children = readFileSync(`/proc/${pid}/task/${t}/children`, "utf8").trim();
        if (children) for (const c of children.split(" ")) out.push({ pid: Number(c), parent: pid });
      } catch {}
    }
  }
  return out;
}

const KCMP = process.arch === "x64" ? 312 : process.arch === "arm64" ? 272 : -1;
const KCMP_VM = 1;
const kcmpLibc = (() => {
  if (KCMP < 0) return undefined;
  try {
    const i64 = FFIType.i64;
    return dlopen("libc.so.6", { syscall: { args: [i64, i64, i64, i64, i64, i64], returns: i64 } });
  } catch {
    return undefined;
  }
})();

/**
 * Whether two processes share one address space (kcmp KCMP_VM): a child started with vfork or
 * posix_spawn (CLONE_VM) has not exec'd yet and reports its parent's whole memory as its own.
 * False where kcmp cannot be asked.
 */
function sameMemory(a: number, b: number): boolean {
  return kcmpLibc !== undefined && Number(kcmpLibc.symbols.syscall(KCMP, a, b, KCMP_VM, 0, 0)) === 0;
}

/**
 * Samples the tree's memory every `everyMs` (a timer in this process): Σ Pss, which counts a page
 * shared by several processes once in all (a forked child that has not exec'd yet shares all of
 * its parent's pages: Σ Rss would count them twice), and Σ Rss for comparison. A child still in
 * its parent's address space (vfork, posix_spawn) is not counted: it is the same memory.
 */
function treeSampler(root: number, everyMs: number) {
  let peakTreeKb = 0;
  let peakRssKb = 0;
  let maxProcesses = 0;
  let mainHwmKb = 0;
  const sample = () => {
    mainHwmKb = readPeakRssKb(root) ?? mainHwmKb;
    let pss = 0;
    let rss = 0;
    const pids = processTree(root);
    for (const { pid, parent } of pids) {
      if (parent && sameMemory(pid, parent)) continue;
      const m = readMemory(pid);
      if (!m) continue;
      pss += m.pss;
      rss += m.rss;
    }
    peakTreeKb = Math.max(peakTreeKb, pss);
    peakRssKb = Math.max(peakRssKb, rss);
    maxProcesses = Math.max(maxProcesses, pids.length);
  };
  const timer = setInterval(sample, everyMs);
  sample();
  return {
    stop() {
      clearInterval(timer);
      return { peakTreeKb, peakRssKb, maxProcesses, mainHwmKb };
    },
  };
}

// ---------------------------------------------------------------------------------------------
// Pairs

/** Runs a() then b() `pairs` times, alternating which goes first, so both see the same load. */
export async function alternate<A, B>(
  pairs: number,
  a: (i: number) => Promise<A>,
  b: (i: number) => Promise<B>,
  log?: (i: number) => void,
): Promise<{ a: A[]; b: B[] }> {
  const as: A[] = [];
  const bs: B[] = [];
  for (let i = 0; i < pairs; i++) {
    log?.(i);
    if (i % 2 === 0) {
      as.push(await a(i));
      bs.push(await b(i));
    } else {
      bs.push(await b(i));
      as.push(await a(i));
    }
  }
  return { a: as, b: bs };
}

export const ms1 = (v: number) => `${v.toFixed(1)} ms`;
export const mb = (kb: number) => `${(kb / 1024).toFixed(0)} MB`;
export const list = (values: number[], f = (v: number) => v.toFixed(1)) => values.map(f).join(", ");
export { median };

// ---------------------------------------------------------------------------------------------
// Trees

/** Runs git with a fixed identity and no user or system config, in `cwd`. */
export function git(cwd: string, ...args: string[]): string {
  const r = Bun.spawnSync(["git", ...args], {
    cwd,
    env: {
      PATH: process.env.PATH ?? "/usr/bin:/bin",
      HOME: cwd,
      GIT_CONFIG_NOSYSTEM: "1",
      GIT_CONFIG_GLOBAL: "/dev/null",
      GIT_AUTHOR_NAME: "bench",
      GIT_AUTHOR_EMAIL: "bench@example.invalid",
      GIT_COMMITTER_NAME: "bench",
      GIT_COMMITTER_EMAIL: "bench@example.invalid",
    },
    stdout: "pipe",
    stderr: "pipe",
  });
  if (r.exitCode !== 0) throw new Error(`git ${args.join(" ")} failed: ${r.stderr.toString()}`);
  return r.stdout.toString();
}

/**
 * A directory of `files` small files under /var/tmp, built once and reused by later runs (a marker
 * file records that it is complete; a half-built one is rebuilt). Not a git repository. The time to
 * build it is not in any figure.
 */
export function bigTree(files: number, log: (m: string) => void): { dir: string; builtMs?: number } {
  const dir = `/var/tmp/aic-bench-tree-${files}`;
  const marker = join(dir, ".aic-bench-complete");
  if (existsSync(marker) && readFileSync(marker, "utf8").trim() === String(files)) return { dir };
  log(`building ${files.toLocaleString("en")} small files in ${dir} (once; reused by later runs)`);
  const started = performance.now();
  rmSync(dir, { recursive: true, force: true });
  const perDir = 500;
  for (let n = 0; n < files; n++) {
    const sub = join(dir, `d${String(Math.floor(n / perDir)).padStart(4, "0")}`);
    if (n % perDir === 0) mkdirSync(sub, { recursive: true });
    writeFileSync(join(sub, `f${n % perDir}.txt`), `file ${n}\n`);
  }
  writeFileSync(marker, `${files}\n`);
  return { dir, builtMs: performance.now() - started };
}

// ---------------------------------------------------------------------------------------------
// Where the time goes: one extra run under strace

export interface Profile {
  steps: number;
  /** Successful execve per step, by program (git by subcommand: `git add`). Counts below are per step too. */
  execs: Map<string, number>;
  /** Wall time of those processes per step, ms, by the same key (under strace: slower than without, compare them with each other). */
  execMs: Map<string, number>;
  getdents64: number;
  openat: number;
  fsync: number;
}

/** git's subcommand in an execve line's argv: the first word after the options (`-c x=y`, `--git-dir=…`). */
function gitSubcommand(argv: string[]): string {
  for (let i = 1; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "-c" || a === "-C" || a === "--git-dir" || a === "--work-tree") i++;
    else if (!a.startsWith("-")) return a;
  }
  return "?";
}

/**
 * What a step costs in processes and system calls: one run of `steps` steps under `strace -f -ttt`
 * (the whole tree of processes), counting only what happened between the second model request and
 * the last (steps 2 … `steps`: start-up, the first snapshot and the end stay out), per step.
 * Undefined when strace is not installed. A run is slower under strace: compare its times with
 * each other, not with the figures.
 */
export async function straceProfile(
  who: Who,
  original: string | undefined,
  steps: number,
  opts: FieldRunOptions,
): Promise<Profile | undefined> {
  if (!Bun.which("strace")) return undefined;
  const out = join(scratch("aic-bench-strace-"), "trace");
  const syscalls = "trace=execve,exit_group,getdents64,openat,fsync,fdatasync";
  const run = await fieldRun(who, original, {
    ...opts,
    commands: (i) => (i < steps ? opts.commands(i) : undefined),
    // --seccomp-bpf stops only at the traced calls: plain strace slows every call, and a first snapshot slowed past
    // 2 s goes on in the background, leaving the traced steps without checkpoints to count.
    wrap: ["strace", "--seccomp-bpf", "-f", "-q", "-ttt", "-s", "48", "-o", out, "-e", syscalls],
  });
  expectSteps(`a ${steps}-step run under strace`, run, steps);
  // Wall-clock bounds of steps 2 … steps, in strace's -ttt seconds.
  const [from, to] = [run.atEpochMs[1]! / 1000, run.atEpochMs[steps]! / 1000];
  const counted = steps - 1;
  const execs = new Map<string, number>();
  const execMs = new Map<string, number>();
  const running = new Map<string, { key: string; at: number }>();
  const c = { getdents64: 0, openat: 0, fsync: 0 };
  for (const line of readFileSync(out, "utf8").split("\n")) {
    const exited = /^(\d+)\s+([\d.]+)\s+\+\+\+ (exited|killed)/.exec(line);
    if (exited) {
      const r = running.get(exited[1]!);
      if (r) execMs.set(r.key, (execMs.get(r.key) ?? 0) + (Number(exited[2]) * 1000 - r.at));
      running.delete(exited[1]!);
      continue;
    }
    const m = /^(\d+)\s+([\d.]+)\s+(execve|getdents64|openat|fsync|fdatasync)\((.*)$/.exec(line);
    if (!m) continue;
    const at = Number(m[2]);
    if (at < from || at > to) continue;
    if (m[3] === "getdents64") c.getdents64++;
    else if (m[3] === "openat") c.openat++;
    else if (m[3] === "fsync" || m[3] === "fdatasync") c.fsync++;
    else if (!/= -1 E/.test(line)) {
      const argv = [...(/\[(.*?)\]/.exec(m[4]!)?.[1] ?? "").matchAll(/"((?:[^"\\]|\\.)*)"/g)].map((x) => x[1]!);
      const prog = (/^"([^"]*)"/.exec(m[4]!)?.[1] ?? "?").split("/").pop()!;
      const key = prog === "git" ? `git ${gitSubcommand(argv)}` : prog;
      execs.set(key, (execs.get(key) ?? 0) + 1);
      // The same process executing again (a wrapper exec'ing the real program): its time goes to the last.
      running.set(m[1]!, { key, at: at * 1000 });
    }
  }
  rmSync(out, { force: true });
  for (const [k, v] of execs) execs.set(k, v / counted);
  for (const [k, v] of execMs) execMs.set(k, v / counted);
  return {
    steps: counted,
    execs,
    execMs,
    getdents64: c.getdents64 / counted,
    openat: c.openat / counted,
    fsync: c.fsync / counted,
  };
}

/** "git add 2.0, git write-tree 1.0 …": the programs a step starts, most first. */
export function describeExecs(p: Profile, only?: (name: string) => boolean, top = 6): string {
  const rows = [...p.execs].filter(([k]) => !only || only(k)).sort((a, b) => b[1] - a[1]);
  const shown = rows.slice(0, top).map(([k, n]) => `${k} ${n.toFixed(1)} (${(p.execMs.get(k) ?? 0).toFixed(1)} ms)`);
  return shown.length ? shown.join(", ") + (rows.length > top ? ", …" : "") : "none";
}

/** Wall time per step of the processes `only` selects, ms (under strace). */
export function execMsPerStep(p: Profile, only: (name: string) => boolean): number {
  let ms = 0;
  for (const [k, v] of p.execMs) if (only(k)) ms += v;
  return ms;
}

export function gitPerStep(p: Profile): number {
  let n = 0;
  for (const [k, v] of p.execs) if (k.startsWith("git")) n += v;
  return n;
}
