/**
 * Speed in real repositories and long runs (README: "Benchmarks"): each figure is a ratio from one
 * run of the bench, A and B alternating (A B, B A, …) for PAIRS pairs, the medians compared.
 * Per step = the median gap between consecutive model requests of a run, against a fake model that
 * answers at once (timed as each request reaches it). `bun run tests/bench/run.ts field` runs them
 * all; each has its own name.
 *
 *   field-checkpoints  2,000-text-file git repository, checkpoints on ÷ off, per step       ≤ 1.3
 *   field-first-step   a second run's first step in a 20,000-file repository ÷ a step
 *                      without checkpoints (checkpoints on in both runs)                     ≤ 3
 *   field-big-dir      a step in 200,000 small files ÷ in an empty directory, both
 *                      --no-checkpoints                                                      ≤ 1.5
 *   field-speed        per step, 100 steps of `true N`, defaults, aic ÷ the original          ≤ 0.25
 *   field-memory       peak memory of the process tree, 300 steps printing 2 KB and 1,000
 *                      cheap steps, aic ÷ the original                                 ≤ 1.5, ≤ 1.3
 *   field-20mb         a command printing 20 MB of short lines, its step, aic ÷ original     ≤ 1.0
 *   field-tui          (field-tui.ts) keystroke → frame p90 in tmux while a command prints
 *                      10 MB, against `cat` in tmux                              ≤ cat p90 + 30 ms
 *
 * The 20,000-file repository is 20,000 small files (a few hundred bytes each, ~9 MB), not a
 * real-sized tree (~230 MB would be too much for CI): the figure is about the number of files.
 * The 200,000-file tree and the 20,000-file repository are built once under /var/tmp and reused;
 * building them is in no figure. The figures with the original need it set up (field-lib.ts says
 * where it is looked for); without it they print SKIP and say why. The original's peak memory is
 * measured once per machine and kept (see ORIGINAL_CACHE): its 1,000-step run alone takes ~6
 * minutes, its cost per step growing with the history (the openai library re-validates the
 * whole request every call), and Python's peak barely moves between runs.
 *
 * Where the time goes: field-checkpoints, field-big-dir and field-speed end with counts from one
 * more run under `strace -f` (git processes per step by subcommand and their time, directory
 * reads and opens per step), over its steps after the first, so start-up and the first snapshot
 * stay out.
 *
 * Every field figure runs a private copy of dist/aic taken when the first of them starts
 * (fieldAic), so a rebuild meanwhile cannot mix two builds in one ratio.
 */
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { scratch } from "../helpers.ts";
import type { Benchmark, Metric } from "./lib.ts";
import {
  type FieldRun,
  type Profile,
  alternate,
  bigTree,
  checkpointsOff,
  describeExecs,
  execMsPerStep,
  expectSteps,
  fieldRun,
  findOriginal,
  git,
  gitPerStep,
  list,
  mb,
  median,
  straceProfile,
} from "./field-lib.ts";

/** Alternating pairs per figure (AIC_BENCH_PAIRS to change it; at least 5 for the figures the README quotes). */
const PAIRS = Math.max(1, Number(process.env.AIC_BENCH_PAIRS) || 5);

const perStep = (r: FieldRun) => median(r.gaps);
const ratio = (a: number, b: number) => a / b;

/** The lines a profile adds: git per step by subcommand, other programs, getdents64/openat per step. */
function profileMetrics(label: string, p: Profile | undefined): Metric[] {
  if (!p)
    return [{ name: `${label}: profile`, value: NaN, unit: "count", status: "SKIP", note: "strace is not installed" }];
  return [
    {
      name: `${label}: git processes per step`,
      value: gitPerStep(p),
      unit: "x",
      note: `${execMsPerStep(p, (k) => k.startsWith("git")).toFixed(1)} ms of git processes a step under strace; strace -f, steps 2–${p.steps + 1} of a run: ${describeExecs(p, (k) => k.startsWith("git"))}`,
    },
    {
      name: `${label}: other programs per step`,
      value: [...p.execs].filter(([k]) => !k.startsWith("git")).reduce((s, [, n]) => s + n, 0),
      unit: "x",
      note: describeExecs(p, (k) => !k.startsWith("git")),
    },
    {
      name: `${label}: getdents64 / openat / fsync per step`,
      value: p.getdents64,
      unit: "count",
      note: `getdents64 ${p.getdents64.toFixed(0)}, openat ${p.openat.toFixed(0)}, fsync ${p.fsync.toFixed(1)} (whole process tree)`,
    },
  ];
}

// ---------------------------------------------------------------------------------------------
// 1. Checkpoints on / off in a 2,000-file repository

const REPO_FILES = 2000;
const CKPT_STEPS = 20;

/** A git repository of `files` small text files (src/dNNN/fNNN.txt, 100 per directory, ~250 bytes each), committed. */
function textRepo(files: number, dir: string): void {
  for (let n = 0; n < files; n++) {
    const sub = join(dir, "src", `d${String(Math.floor(n / 100)).padStart(3, "0")}`);
    if (n % 100 === 0) mkdirSync(sub, { recursive: true });
    writeFileSync(join(sub, `f${String(n % 100).padStart(3, "0")}.txt`), `file ${n}\n${"a line of text\n".repeat(16)}`);
  }
  writeFileSync(join(dir, ".gitignore"), "node_modules/\n*.log\n");
  git(dir, "init", "-q", "-b", "main");
  git(dir, "add", "-A");
  git(dir, "commit", "-q", "-m", "initial");
}

/** Even steps `true N`, odd steps a one-line edit of a tracked file. */
const mixedStep = (i: number) =>
  i % 2 === 0
    ? `true ${i}`
    : `echo edit ${i} >> src/d${String(i % 20).padStart(3, "0")}/f${String(i % 100).padStart(3, "0")}.txt`;

export const fieldCheckpoints: Benchmark = {
  name: "field-checkpoints",
  description: `per step with checkpoints ÷ --no-checkpoints, ${REPO_FILES}-file git repository, ${CKPT_STEPS} steps (true N / a small edit), ${PAIRS} pairs`,
  async run(ctx) {
    const root = scratch("aic-bench-field-ckpt-");
    const repo = join(root, "repo");
    mkdirSync(repo);
    ctx.log(`field-checkpoints: a ${REPO_FILES}-file git repository`);
    textRepo(REPO_FILES, repo);
    const commands = (i: number) => (i < CKPT_STEPS ? mixedStep(i) : undefined);
    const off: string[] = [];
    const runOnce = async (flags: string[]) => {
      const r = await fieldRun("aic", undefined, { cwd: repo, commands, flags });
      expectSteps(`field-checkpoints ${flags.join(" ") || "(checkpoints on)"}`, r, CKPT_STEPS);
      const why = checkpointsOff(r);
      if (why && !flags.includes("--no-checkpoints")) off.push(why);
      return r;
    };
    const { a, b } = await alternate(
      PAIRS,
      () => runOnce([]),
      () => runOnce(["--no-checkpoints"]),
      (i) => ctx.log(`field-checkpoints: pair ${i + 1}/${PAIRS}`),
    );
    const on = a.map(perStep);
    const without = b.map(perStep);
    // gaps[i] is the step of command i: even = `true`, odd = an edit.
    const kind = (runs: FieldRun[], parity: number) =>
      median(runs.flatMap((r) => r.gaps.filter((_, i) => i % 2 === parity && i > 0)));
    ctx.log("field-checkpoints: profile (strace): `true` steps, then edit steps");
    const trueSteps = await straceProfile("aic", undefined, 8, { cwd: repo, commands: (i) => mixedStep(2 * i) });
    const editSteps = await straceProfile("aic", undefined, 8, { cwd: repo, commands: (i) => mixedStep(2 * i + 1) });
    rmSync(root, { recursive: true, force: true });
    return [
      {
        name: "checkpoints on ÷ off, per step",
        value: ratio(median(on), median(without)),
        unit: "x",
        target: 1.3,
        status: off.length ? "INVALID" : undefined,
        note: `${median(on).toFixed(1)} ÷ ${median(without).toFixed(1)} ms (runs: ${list(on)} / ${list(without)})${off.length ? `; checkpoints went off: ${off[0]}` : ""}`,
      },
      {
        name: "  with checkpoints: a `true` step / an edit step",
        value: kind(a, 0),
        unit: "ms",
        note: `edit ${kind(a, 1).toFixed(1)} ms; without checkpoints ${kind(b, 0).toFixed(1)} / ${kind(b, 1).toFixed(1)} ms`,
      },
      {
        name: "  first step with checkpoints (first snapshot)",
        value: median(a.map((r) => r.gaps[0]!)),
        unit: "ms",
        note: `a run without a session has its own store: every run snapshots the ${REPO_FILES} files once`,
      },
      ...profileMetrics("  checkpoints on, `true` steps", trueSteps),
      ...profileMetrics("  checkpoints on, edit steps", editSteps),
    ];
  },
};

// ---------------------------------------------------------------------------------------------
// 2. A second run's first step in a 20,000-file repository

const BIG_REPO_FILES = 20_000;

/** The 20,000-file repository under /var/tmp, built once (a marker says it is complete); the runs only run `true`. */
function bigRepo(log: (m: string) => void): string {
  const dir = `/var/tmp/aic-bench-repo-${BIG_REPO_FILES}`;
  const marker = join(dir, ".git", "aic-bench-complete");
  if (existsSync(marker)) return dir;
  log(`field-first-step: building a ${BIG_REPO_FILES}-file git repository in ${dir} (once)`);
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  textRepo(BIG_REPO_FILES, dir);
  writeFileSync(marker, "");
  return dir;
}

export const fieldFirstStep: Benchmark = {
  name: "field-first-step",
  description: `a second run's first step (checkpoints on) ÷ a step with --no-checkpoints, ${BIG_REPO_FILES}-file git repository, ${PAIRS} pairs`,
  async run(ctx) {
    const repo = bigRepo(ctx.log);
    // A state home of its own: the first run below is the directory's very first.
    const root = scratch("aic-bench-field-first-");
    const env = { XDG_STATE_HOME: join(root, "state") };
    let n = 0;
    // A session file per run (outside the tree, which stays as built): a run with a session keeps the directory's store.
    const session = () => ["--session", join(root, `run-${n++}.aicsession`)];
    const steps = (k: number) => (i: number) => (i < k ? `true ${i}` : undefined);
    ctx.log("field-first-step: the first run (the first snapshot of the tree)");
    const first = await fieldRun("aic", undefined, { cwd: repo, commands: steps(1), flags: session(), env });
    expectSteps("field-first-step: the first run", first, 1);
    const off = [checkpointsOff(first)].filter((x) => x !== undefined);
    const { a, b } = await alternate(
      PAIRS,
      async () => {
        const r = await fieldRun("aic", undefined, { cwd: repo, commands: steps(3), flags: session(), env });
        expectSteps("field-first-step: a later run", r, 3);
        const why = checkpointsOff(r);
        if (why) off.push(why);
        return r;
      },
      async () => {
        const r = await fieldRun("aic", undefined, {
          cwd: repo,
          commands: steps(8),
          flags: [...session(), "--no-checkpoints"],
          env,
        });
        expectSteps("field-first-step: --no-checkpoints", r, 8);
        return r;
      },
      (i) => ctx.log(`field-first-step: pair ${i + 1}/${PAIRS}`),
    );
    rmSync(root, { recursive: true, force: true });
    const firstSteps = a.map((r) => r.gaps[0]!);
    const plain = b.map(perStep);
    return [
      {
        name: "second run's first step ÷ a step without checkpoints",
        value: ratio(median(firstSteps), median(plain)),
        unit: "x",
        target: 3,
        status: off.length ? "INVALID" : undefined,
        note: `${median(firstSteps).toFixed(1)} ÷ ${median(plain).toFixed(1)} ms (runs: ${list(firstSteps)} / ${list(plain)}); ${BIG_REPO_FILES} small files (~9 MB, not a real-sized tree)${off.length ? `; checkpoints went off: ${off[0]}` : ""}`,
      },
      {
        name: "  the first run's first step (first snapshot)",
        value: first.gaps[0]!,
        unit: "ms",
        note: "paid once per directory (the store is kept for runs with a session)",
      },
      {
        name: "  a later run: its next steps",
        value: median(a.flatMap((r) => r.gaps.slice(1))),
        unit: "ms",
      },
    ];
  },
};

// ---------------------------------------------------------------------------------------------
// 3. 200,000 files ÷ an empty directory, --no-checkpoints

const TREE_FILES = 200_000;
const TREE_STEPS = 10;

export const fieldBigDir: Benchmark = {
  name: "field-big-dir",
  description: `per step in a directory of ${TREE_FILES.toLocaleString("en")} small files ÷ in an empty one, --no-checkpoints, ${TREE_STEPS} steps, ${PAIRS} pairs`,
  async run(ctx) {
    const tree = bigTree(TREE_FILES, (m) => ctx.log(`field-big-dir: ${m}`));
    const empty = scratch("aic-bench-field-empty-");
    const commands = (i: number) => (i < TREE_STEPS ? `true ${i}` : undefined);
    const once = async (cwd: string) => {
      const r = await fieldRun("aic", undefined, { cwd, commands, flags: ["--no-checkpoints"] });
      expectSteps(`field-big-dir in ${cwd}`, r, TREE_STEPS);
      return r;
    };
    const { a, b } = await alternate(
      PAIRS,
      () => once(tree.dir),
      () => once(empty),
      (i) => ctx.log(`field-big-dir: pair ${i + 1}/${PAIRS}`),
    );
    ctx.log("field-big-dir: profile (strace)");
    const flags = ["--no-checkpoints"];
    const big = await straceProfile("aic", undefined, 6, { cwd: tree.dir, commands: (i) => `true ${i}`, flags });
    const small = await straceProfile("aic", undefined, 6, { cwd: empty, commands: (i) => `true ${i}`, flags });
    rmSync(empty, { recursive: true, force: true });
    const [inTree, inEmpty] = [a.map(perStep), b.map(perStep)];
    return [
      {
        name: `${TREE_FILES.toLocaleString("en")} files ÷ empty directory, per step`,
        value: ratio(median(inTree), median(inEmpty)),
        unit: "x",
        target: 1.5,
        note: `${median(inTree).toFixed(1)} ÷ ${median(inEmpty).toFixed(1)} ms (runs: ${list(inTree)} / ${list(inEmpty)}); tree in ${tree.dir}${tree.builtMs ? `, built in ${(tree.builtMs / 1000).toFixed(0)} s` : ", reused"}`,
      },
      ...profileMetrics(`  ${TREE_FILES.toLocaleString("en")} files`, big),
      ...profileMetrics("  empty directory", small),
    ];
  },
};

// ---------------------------------------------------------------------------------------------
// 4. Per step against the original

const SPEED_STEPS = 100;

export const fieldSpeed: Benchmark = {
  name: "field-speed",
  description: `per step, ${SPEED_STEPS} steps of \`true N\`, defaults, aic ÷ the original, ${PAIRS} pairs`,
  async run(ctx) {
    const original = findOriginal();
    const commands = (i: number) => (i < SPEED_STEPS ? `true ${i}` : undefined);
    const once = async (who: "aic" | "original") => {
      const cwd = scratch("aic-bench-field-speed-");
      const r = await fieldRun(who, original.path, { cwd, commands });
      expectSteps(`field-speed (${who})`, r, SPEED_STEPS);
      rmSync(cwd, { recursive: true, force: true });
      return r;
    };
    const profileDir = scratch("aic-bench-field-speed-");
    const profile = async () => {
      ctx.log("field-speed: profile (strace)");
      return straceProfile("aic", undefined, 20, { cwd: profileDir, commands: (i) => `true ${i}` });
    };
    if (!original.path) {
      const runs = [];
      for (let i = 0; i < PAIRS; i++) runs.push(perStep(await once("aic")));
      return [
        {
          name: "per step, aic ÷ the original",
          value: NaN,
          unit: "x",
          target: 0.25,
          status: "SKIP",
          note: original.missing,
        },
        { name: "  aic per step", value: median(runs), unit: "ms", note: `runs: ${list(runs)}` },
        ...profileMetrics("  aic", await profile()),
      ];
    }
    const { a, b } = await alternate(
      PAIRS,
      () => once("aic"),
      () => once("original"),
      (i) => ctx.log(`field-speed: pair ${i + 1}/${PAIRS}`),
    );
    const [mine, theirs] = [a.map(perStep), b.map(perStep)];
    return [
      {
        name: "per step, aic ÷ the original",
        value: ratio(median(mine), median(theirs)),
        unit: "x",
        target: 0.25,
        note: `${median(mine).toFixed(1)} ÷ ${median(theirs).toFixed(1)} ms (runs: ${list(mine)} / ${list(theirs)}); original: ${original.path}`,
      },
      {
        name: "  spawn → first model request, aic",
        value: median(a.map((r) => r.firstRequestMs)),
        unit: "ms",
        note: `original ${median(b.map((r) => r.firstRequestMs)).toFixed(0)} ms; not in the figure`,
      },
      ...profileMetrics("  aic", await profile()),
    ];
  },
};

// ---------------------------------------------------------------------------------------------
// 5. Peak memory against the original

const SAMPLE_MS = 10;
interface MemoryCase {
  key: string;
  label: string;
  steps: number;
  command: (i: number) => string;
  target: number;
}
const MEMORY_CASES: MemoryCase[] = [
  {
    key: "300x2KB",
    label: "300 steps each printing 2 KB",
    steps: 300,
    // 2,048 bytes in 41-byte lines, different at every step.
    command: (i) => `yes 'step ${String(i).padStart(4, "0")}: 0123456789abcdefghijklmnopqrstu' | head -c 2048`,
    target: 1.5,
  },
  { key: "1000xtrue", label: "1,000 cheap steps", steps: 1000, command: (i) => `true ${i}`, target: 1.3 },
];

/**
 * The original's peaks, kept between runs of the bench: keyed by what could change them (aic.py,
 * the wrapper, the case). AIC_BENCH_FRESH_ORIGINAL=1 measures again.
 */
const ORIGINAL_CACHE = "/var/tmp/aic-bench-original-memory.json";

interface CachedPeak {
  peakTreeKb: number;
  peakRssKb: number;
  mainHwmKb: number;
  ms: number;
  measuredAt: string;
}

function originalKey(wrapper: string, c: MemoryCase): string {
  const text = readFileSync(wrapper, "utf8");
  const script = /"([^"]*aic\.py)"/.exec(text)?.[1];
  const h = createHash("sha256").update(text);
  if (script && existsSync(script)) h.update(readFileSync(script));
  h.update(`${c.key}|${c.steps}|${c.command(7)}|${SAMPLE_MS}|pss`);
  return h.digest("hex").slice(0, 16);
}

function readCache(): Record<string, CachedPeak> {
  try {
    return JSON.parse(readFileSync(ORIGINAL_CACHE, "utf8"));
  } catch {
    return {};
  }
}

export const fieldMemory: Benchmark = {
  name: "field-memory",
  description: `peak memory of the whole process tree (Σ Pss sampled every ${SAMPLE_MS} ms), aic (median of ${PAIRS}) ÷ the original`,
  async run(ctx) {
    const original = findOriginal();
    const metrics: Metric[] = [];
    for (const c of MEMORY_CASES) {
      const flags = ["--max-steps", String(c.steps + 100)];
      const commands = (i: number) => (i < c.steps ? c.command(i) : undefined);
      const once = async (who: "aic" | "original") => {
        const cwd = scratch("aic-bench-field-mem-");
        const r = await fieldRun(who, original.path, { cwd, commands, flags, sampleMemoryMs: SAMPLE_MS });
        expectSteps(`field-memory ${c.label} (${who})`, r, c.steps);
        rmSync(cwd, { recursive: true, force: true });
        return r;
      };
      const mine: FieldRun[] = [];
      for (let i = 0; i < PAIRS; i++) {
        ctx.log(`field-memory: ${c.label}, aic ${i + 1}/${PAIRS}`);
        mine.push(await once("aic"));
      }
      const peak = median(mine.map((r) => r.peakTreeKb));
      const details = `aic runs ${list(
        mine.map((r) => r.peakTreeKb),
        mb,
      )}, ${median(mine.map((r) => r.summaries))} summary requests, Σ Rss ${mb(median(mine.map((r) => r.peakRssKb)))}, its own process's VmHWM ${mb(median(mine.map((r) => r.mainHwmKb)))}, ≤ ${Math.max(...mine.map((r) => r.maxProcesses))} processes, ${(median(mine.map((r) => r.ms)) / 1000).toFixed(1)} s`;
      if (!original.path) {
        metrics.push({
          name: `peak memory, ${c.label}, aic ÷ the original`,
          value: NaN,
          unit: "x",
          target: c.target,
          status: "SKIP",
          note: original.missing,
        });
        metrics.push({ name: `  aic`, value: peak / 1024, unit: "MB", note: details });
        continue;
      }
      const key = originalKey(original.path, c);
      let theirs = process.env.AIC_BENCH_FRESH_ORIGINAL ? undefined : readCache()[key];
      let source = `measured ${theirs?.measuredAt.slice(0, 10)}, kept in ${ORIGINAL_CACHE}`;
      if (!theirs) {
        ctx.log(`field-memory: ${c.label}, the original (once per machine; kept in ${ORIGINAL_CACHE})`);
        const r = await once("original");
        theirs = {
          peakTreeKb: r.peakTreeKb,
          peakRssKb: r.peakRssKb,
          mainHwmKb: r.mainHwmKb,
          ms: r.ms,
          measuredAt: new Date().toISOString(),
        };
        writeFileSync(ORIGINAL_CACHE, JSON.stringify({ ...readCache(), [key]: theirs }, null, 2) + "\n");
        source = "measured in this run";
      }
      metrics.push(
        {
          name: `peak memory, ${c.label}, aic ÷ the original`,
          value: ratio(peak, theirs.peakTreeKb),
          unit: "x",
          target: c.target,
          note: `${mb(peak)} ÷ ${mb(theirs.peakTreeKb)} (Σ Rss ${mb(theirs.peakRssKb)}, python's VmHWM ${mb(theirs.mainHwmKb)}); original ${source} (${(theirs.ms / 1000).toFixed(0)} s a run)`,
        },
        { name: "  aic", value: peak / 1024, unit: "MB", note: details },
      );
    }
    return metrics;
  },
};

// ---------------------------------------------------------------------------------------------
// 6. A command printing 20 MB of short lines

const FLOOD = "yes | head -c 20000000";

export const field20mb: Benchmark = {
  name: "field-20mb",
  description: `the step of \`${FLOOD}\` under --auto-approve, aic ÷ the original, ${PAIRS} pairs`,
  async run(ctx) {
    const original = findOriginal();
    const commands = (i: number) => (i === 0 ? FLOOD : undefined);
    const once = async (who: "aic" | "original") => {
      const cwd = scratch("aic-bench-field-20mb-");
      const r = await fieldRun(who, original.path, { cwd, commands });
      expectSteps(`field-20mb (${who})`, r, 1);
      rmSync(cwd, { recursive: true, force: true });
      return r;
    };
    if (!original.path) {
      const runs = [];
      for (let i = 0; i < PAIRS; i++) runs.push((await once("aic")).gaps[0]!);
      return [
        {
          name: "20 MB step, aic ÷ the original",
          value: NaN,
          unit: "x",
          target: 1,
          status: "SKIP",
          note: original.missing,
        },
        { name: "  aic", value: median(runs), unit: "ms", note: `runs: ${list(runs)}` },
      ];
    }
    const { a, b } = await alternate(
      PAIRS,
      () => once("aic"),
      () => once("original"),
      (i) => ctx.log(`field-20mb: pair ${i + 1}/${PAIRS}`),
    );
    const [mine, theirs] = [a.map((r) => r.gaps[0]!), b.map((r) => r.gaps[0]!)];
    return [
      {
        name: "20 MB step, aic ÷ the original",
        value: ratio(median(mine), median(theirs)),
        unit: "x",
        target: 1,
        note: `${median(mine).toFixed(0)} ÷ ${median(theirs).toFixed(0)} ms (runs: ${list(mine, (v) => v.toFixed(0))} / ${list(theirs, (v) => v.toFixed(0))}); both stop it early: aic's runaway stop, the original's 5 × --max-output-bytes`,
      },
      {
        name: "  stdout of the run, aic / original",
        value: median(a.map((r) => r.stdoutBytes)) / 1024,
        unit: "count",
        note: `kB; original ${(median(b.map((r) => r.stdoutBytes)) / 1024).toFixed(0)} kB`,
      },
    ];
  },
};
