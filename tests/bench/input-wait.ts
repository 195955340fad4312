/**
 * Input-wait detection latency ("the model at the keyboard"): how soon a
 * detector says a command waits for input, or waits on nothing but time
 * (top, watch, tail -f), and that it never says so of a command that is
 * merely sleeping or computing.
 *
 * Each program runs as aic runs a command: `/bin/sh -c "set -m; <command>"`
 * on a PTY of its own (Bun.spawn's `terminal`, 160×50, xterm-256color, aic's
 * COMMAND_ENV). A watcher like the runner's looks first when the output has
 * been quiet for QUIET_MS, then every POLL_MS, at the foreground groups (the
 * shell's and the terminal's tpgid), and asks the detector for a verdict.
 * Measured per program (median of RUNS):
 *
 * - wait→verdict: from the moment the program starts waiting (its last
 *   output before the verdict: the prompt; spawn when it printed nothing) to
 *   the first verdict other than "busy" (aim ≤ 2 s);
 * - spawn→verdict (in the note), and the verdict against the expected one;
 * - runs whose verdict was of the wrong kind, or none within WINDOW_MS (aim 0);
 * - for programs that must stay "busy" (sleep 30, busy loops): how many
 *   non-busy verdicts were given over WINDOW_MS (aim 0).
 * - the cost of one detector call (median over all calls).
 *
 * The detector is aic's own (tests/bench/aic-detector.ts adapts it), or any
 * module named by AIC_INPUT_WAIT_DETECTOR with the same contract:
 *   classifyGroups(pgids: number[], screen: ScreenFacts) → { verdict, reason? }
 *
 *   bun tests/bench/input-wait.ts [name-substring…]     (standalone)
 *   bun run tests/bench/run.ts input-wait                 (with the others)
 */
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { COMMAND_ENV, INPUT_QUIET_MS, INPUT_WAIT_POLL_MS } from "../../aic.ts";
import { scratch } from "../helpers.ts";
import { type Benchmark, type Metric, median } from "./lib.ts";

type Verdict = "waiting_for_input" | "waiting_on_time" | "busy";

interface ScreenFacts {
  quietMs: number;
  altScreen: boolean;
  cursorAddressing: boolean;
  selfRedraws: number;
}

interface DetectorModule {
  classifyGroups(pgids: readonly number[], screen: ScreenFacts): { verdict: Verdict; reason?: string };
}

const DETECTOR = process.env.AIC_INPUT_WAIT_DETECTOR ?? new URL("./aic-detector.ts", import.meta.url).pathname;
const RUNS = Number(process.env.AIC_BENCH_INPUT_WAIT_RUNS) || 3;
// The runner's own schedule and environment, so the bench measures what aic does.
const QUIET_MS = INPUT_QUIET_MS;
const POLL_MS = INPUT_WAIT_POLL_MS;
/** How long a run may take to reach a verdict, and how long a must-stay-busy program is watched. */
const WINDOW_MS = 4000;
const TARGET_MS = 2000;

interface Case {
  name: string;
  command: string;
  expect: Verdict;
  env?: Record<string, string | undefined>;
  cwd?: string;
  /** A program that must exist, else the case is skipped. */
  needs?: string;
}

function makeCases(root: string): Case[] {
  const long = join(root, "long.txt");
  writeFileSync(long, Array.from({ length: 400 }, (_, i) => `line ${i + 1}`).join("\n") + "\n");
  const tailed = join(root, "tailed.log");
  writeFileSync(tailed, "first\nsecond\n");
  const repo = join(root, "repo");
  mkdirSync(repo);
  const sh = (c: string) => Bun.spawnSync(["/bin/sh", "-c", c], { cwd: repo, stdout: "ignore", stderr: "ignore" });
  sh("git init -q . && git config user.email b@e.x && git config user.name bench");
  sh('for i in $(seq 1 60); do echo $i > f; git add f; git commit -qm "commit $i"; done');
  mkdirSync(join(root, "npm"));
  writeFileSync(
    join(root, "pollloop.py"),
    "import select,sys\nprint('polling', flush=True)\nwhile True:\n    select.select([sys.stdin],[],[],0.5)\n",
  );
  return [
    { name: "read -p (bash)", command: `bash -c "read -p 'Name? ' x"`, expect: "waiting_for_input" },
    { name: "read -p (dash)", command: `read -p 'Name? ' x`, expect: "waiting_for_input" },
    { name: "python3 REPL", command: "python3", expect: "waiting_for_input", needs: "python3" },
    { name: "node REPL", command: "node", expect: "waiting_for_input", needs: "node" },
    { name: "vim -u NONE file", command: `vim -u NONE ${long}`, expect: "waiting_for_input", needs: "vim" },
    { name: "less file", command: `less ${long}`, expect: "waiting_for_input", needs: "less" },
    {
      name: "git -c core.pager=less log",
      command: "git -c core.pager=less log",
      cwd: repo,
      env: { GIT_PAGER: undefined },
      expect: "waiting_for_input",
      needs: "less",
    },
    {
      name: "git commit (vim)",
      // Staged afresh each run, so there is always something to commit.
      command: "date > f && git add f && git commit",
      cwd: repo,
      env: { GIT_EDITOR: "vim -u NONE" },
      expect: "waiting_for_input",
      needs: "vim",
    },
    { name: "npm init", command: "npm init", cwd: join(root, "npm"), expect: "waiting_for_input", needs: "npm" },
    {
      name: "ssh-keygen passphrase",
      command: `rm -f ${root}/key ${root}/key.pub; ssh-keygen -t ed25519 -f ${root}/key`,
      expect: "waiting_for_input",
      needs: "ssh-keygen",
    },
    { name: "sqlite3 REPL", command: `sqlite3 ${root}/db.sqlite`, expect: "waiting_for_input", needs: "sqlite3" },
    { name: "cat", command: "cat", expect: "waiting_for_input" },
    {
      name: "select 0.5 s poll loop",
      command: `python3 ${root}/pollloop.py`,
      expect: "waiting_for_input",
      needs: "python3",
    },
    { name: "top", command: "top", expect: "waiting_on_time", needs: "top" },
    { name: "watch date", command: "watch date", expect: "waiting_on_time", needs: "watch" },
    { name: "tail -f file", command: `tail -f ${tailed}`, expect: "waiting_on_time" },
    { name: "tail -f | grep", command: `tail -f ${tailed} | grep --line-buffered s`, expect: "waiting_on_time" },
    { name: "sleep 30", command: "sleep 30", expect: "busy" },
    { name: "busy loop (sh)", command: "while :; do :; done", expect: "busy" },
    { name: "busy loop (python3)", command: `python3 -c "while True: pass"`, expect: "busy", needs: "python3" },
    {
      name: "progress + sleep 1.5 s",
      command: `python3 -c "import time; [print(i, flush=True) or time.sleep(1.5) for i in range(9)]"`,
      expect: "busy",
      needs: "python3",
    },
    {
      name: "socket + terminal select",
      command: `python3 -c "import socket,select,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); select.select([s,sys.stdin],[],[])"`,
      expect: "busy",
      needs: "python3",
    },
  ];
}

/** The screen facts the detector needs, from the PTY output (no input is typed here). */
class ScreenTracker {
  private lastOutput: number;
  private sawOutput = false;
  private alt = false;
  private addressing = false;
  private redraws = 0;
  private tail = "";
  everAlt = false;

  constructor(start: number) {
    this.lastOutput = start;
  }

  output(bytes: Uint8Array, t: number): void {
    if (this.sawOutput && t - this.lastOutput >= QUIET_MS) this.redraws++;
    this.sawOutput = true;
    this.lastOutput = t;
    const s = this.tail + new TextDecoder().decode(bytes);
    for (const m of s.matchAll(/\x1b\[\?(?:1049|1047|47)([hl])/g)) this.alt = m[1] === "h";
    this.everAlt ||= this.alt;
    if (/\x1b\[(?:\d+(?:;\d+)?)?H|\x1b\[2J/.test(s)) this.addressing = true;
    this.tail = s.slice(-12);
  }

  get last(): number {
    return this.lastOutput;
  }

  facts(now: number): ScreenFacts {
    return {
      quietMs: now - this.lastOutput,
      altScreen: this.alt,
      cursorAddressing: this.addressing,
      selfRedraws: this.redraws,
    };
  }
}

function statFields(pid: number): string[] | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  } catch {
    return undefined;
  }
}

/** aic's foregroundGroups: the shell's group and the terminal's foreground group. */
function foregroundGroups(shell: number): number[] {
  const tpgid = Number(statFields(shell)?.[5] ?? 0);
  return tpgid > 0 && tpgid !== shell ? [shell, tpgid] : [shell];
}

/** Every process group in the session `sid` (to clean up after a run). */
function sessionGroups(sid: number): number[] {
  const groups = new Set<number>([sid]);
  for (const e of readdirSync("/proc")) {
    if (!/^\d+$/.test(e)) continue;
    const f = statFields(Number(e));
    if (f && Number(f[3]) === sid) groups.add(Number(f[2]));
  }
  return [...groups];
}

interface RunResult {
  verdict: Verdict;
  reason: string;
  spawnToVerdict?: number;
  waitToVerdict?: number;
  falseVerdicts: number;
  altScreen: boolean;
}

async function runOnce(c: Case, root: string, detector: DetectorModule, costs: number[]): Promise<RunResult> {
  const env: Record<string, string | undefined> = { ...process.env, ...COMMAND_ENV, ...(c.env ?? {}) };
  for (const [k, v] of Object.entries(c.env ?? {})) if (v === undefined) delete env[k];
  const t0 = performance.now();
  const screen = new ScreenTracker(t0);
  const proc = Bun.spawn(["/bin/sh", "-c", `set -m 2>/dev/null\n${c.command}`], {
    cwd: c.cwd ?? root,
    env,
    terminal: {
      cols: 160,
      rows: 50,
      name: "xterm-256color",
      data: (_t, bytes) => screen.output(bytes, performance.now()),
    },
  });
  const shell = proc.pid;
  let exited = false;
  void proc.exited.then(() => (exited = true));
  const result: RunResult = { verdict: "busy", reason: "", falseVerdicts: 0, altScreen: false };
  try {
    while (!exited && performance.now() - t0 < WINDOW_MS) {
      // The watcher's schedule: first look when the output has been quiet for QUIET_MS, then every POLL_MS.
      const now = performance.now();
      const wake = Math.max(screen.last + QUIET_MS, now + (result.spawnToVerdict === undefined ? 0 : POLL_MS));
      await Bun.sleep(Math.max(POLL_MS / 5, Math.min(wake - now, POLL_MS)));
      const at = performance.now();
      if (at - screen.last < QUIET_MS || exited) continue;
      const d = detector.classifyGroups(foregroundGroups(shell), screen.facts(at));
      costs.push(performance.now() - at);
      if (d.verdict === "busy") continue;
      if (c.expect === "busy") {
        result.falseVerdicts++;
        result.verdict = d.verdict;
        result.reason = d.reason ?? "";
        continue;
      }
      result.verdict = d.verdict;
      result.reason = d.reason ?? "";
      result.spawnToVerdict = at - t0;
      result.waitToVerdict = at - (screen.last > t0 ? screen.last : t0);
      break;
    }
  } finally {
    result.altScreen = screen.everAlt;
    for (const g of sessionGroups(shell)) {
      try {
        process.kill(-g, "SIGKILL");
      } catch {
        /* gone */
      }
    }
    await proc.exited; // the shell leads one of the groups just killed
    proc.terminal?.close();
  }
  return result;
}

const onPath = (program: string) =>
  (process.env.PATH ?? "").split(":").some((dir) => dir && existsSync(join(dir, program)));

export const inputWait: Benchmark = {
  name: "input-wait",
  description: `input-wait detector: wait→verdict latency per interactive program (median of ${RUNS}), no false verdicts`,
  async run(ctx) {
    const detector = (await import(DETECTOR)) as DetectorModule;
    const root = scratch("aic-bench-input-wait-");
    const filters = (process.env.AIC_BENCH_INPUT_WAIT_ONLY ?? "").split(",").filter(Boolean);
    const metrics: Metric[] = [];
    const costs: number[] = [];
    try {
      for (const c of makeCases(root)) {
        if (filters.length && !filters.some((f) => c.name.includes(f))) continue;
        if (c.needs && !onPath(c.needs)) {
          metrics.push({ name: `${c.name}: skipped`, value: 0, unit: "count", note: `${c.needs} not installed` });
          continue;
        }
        ctx.log(`input-wait: ${c.name} ×${RUNS}`);
        const runs: RunResult[] = [];
        for (let i = 0; i < RUNS; i++) runs.push(await runOnce(c, root, detector, costs));
        const verdicts = [...new Set(runs.map((r) => r.verdict))].join("/");
        const alt = runs.some((r) => r.altScreen) ? "alt-screen" : "no alt-screen";
        if (c.expect === "busy") {
          const falses = runs.reduce((n, r) => n + r.falseVerdicts, 0);
          const reason = runs.find((r) => r.falseVerdicts)?.reason;
          metrics.push({
            name: `${c.name}: non-busy verdicts in ${WINDOW_MS / 1000} s`,
            value: falses,
            unit: "count",
            target: 0,
            note: falses ? `said ${verdicts}: ${reason}` : `stayed busy, ${alt}`,
          });
          continue;
        }
        const found = runs.filter((r) => r.waitToVerdict !== undefined);
        const wrong = runs.filter((r) => r.verdict !== c.expect).length;
        metrics.push({
          name: `${c.name}: wait→verdict`,
          value: found.length ? median(found.map((r) => r.waitToVerdict!)) : WINDOW_MS,
          unit: "ms",
          target: TARGET_MS,
          note:
            `${verdicts}${wrong ? ` (expected ${c.expect}, ${wrong}/${RUNS} wrong)` : ""}, ` +
            (found.length
              ? `spawn→verdict ${median(found.map((r) => r.spawnToVerdict!)).toFixed(0)} ms`
              : `none within ${WINDOW_MS} ms`) +
            `${found.length < RUNS ? `, missed ${RUNS - found.length}/${RUNS}` : ""}, ${alt}; ${runs[0]?.reason ?? ""}`,
        });
        // A verdict of the wrong kind (or none) is its own failure, whatever the latency.
        if (wrong)
          metrics.push({
            name: `${c.name}: wrong verdicts`,
            value: wrong,
            unit: "count",
            target: 0,
            note: `said ${verdicts}, expected ${c.expect}`,
          });
      }
      if (costs.length)
        metrics.push({
          name: "detector call cost: median",
          value: median(costs),
          unit: "ms",
          note: `max ${Math.max(...costs).toFixed(1)} ms over ${costs.length} calls`,
        });
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
    return metrics;
  },
};

if (import.meta.main) {
  const only = process.argv.slice(2);
  if (only.length) process.env.AIC_BENCH_INPUT_WAIT_ONLY = only.join(",");
  const metrics = await inputWait.run({ log: (m) => console.error(`  … ${m}`) });
  for (const m of metrics) {
    const value = m.unit === "ms" ? `${m.value.toFixed(m.value < 10 ? 2 : 0)} ms` : String(m.value);
    const status = m.target === undefined ? "info" : m.value <= m.target ? "PASS" : "MISS";
    console.log(`${m.name.padEnd(48)} ${value.padStart(9)}  ${status.padEnd(4)}  ${m.note ?? ""}`);
  }
  process.exit(0);
}
