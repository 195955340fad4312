/**
 * Per-step overhead: what one loop step costs aic itself (model request and
 * stream handling, sandbox and PTY spawn, rendering, history bookkeeping) when
 * the model answers instantly and the command does nothing.
 *
 * overhead = (time of a 200-step run − time of a 1-step run) / 199, each step
 * running `true` under `--nogui --auto-approve`. Start-up cancels out. The
 * default configuration (sandbox on where the kernel offers it) carries the
 * target; the same figure with --disable-sandbox shows what confinement costs.
 */
import { existsSync } from "node:fs";
import { type Benchmark, type Metric, expectRun, median, scriptedCommands, timeAic, unattended } from "./lib.ts";

const STEPS = 200;
const REPEATS = 3;
/** What a step may cost aic with the sandbox on (the model answering instantly, the command doing nothing). */
const TARGET_MS = 5;
/** The sandbox may add at most this fraction to a step: one launcher for the run, not a process per command. */
const SANDBOX_RATIO_TARGET = 1.2;
/** How many steps to compare at the start and the end of the long run (growth shows a cost that rises with history). */
const WINDOW = 50;

interface StepRun {
  ms: number;
  /** Spawn to the first model request reaching the fake server. */
  firstRequestMs: number;
  /** Milliseconds between consecutive model requests (one per step). */
  intervals: number[];
  /** The "Sandbox: …" line aic printed. */
  sandbox: string;
}

async function runSteps(steps: number, flags: string[], env?: Record<string, string>): Promise<StepRun> {
  const srv = scriptedCommands((i) => (i < steps ? `true ${i}` : undefined)); // a different line each step: the same one five times is a stall
  try {
    const run = await timeAic(unattended(srv.url, ...flags, `run true ${steps} times`), { env });
    // One request per step plus the one answered with TASKCOMPLETE.
    expectRun(`${steps}-step run ${flags.join(" ")}`, run, srv, { code: 0, requests: steps + 1 });
    const at = srv.requests.map((r) => r.at);
    return {
      ms: run.ms,
      firstRequestMs: at[0]! - run.spawnedAtEpochMs,
      intervals: at.slice(1).map((t, i) => t - at[i]!),
      sandbox: /Sandbox: (.*)/.exec(run.stderr)?.[1]?.trim() ?? "?",
    };
  } finally {
    srv.close();
  }
}

interface Variant {
  label: string;
  flags: string[];
  env?: Record<string, string>;
  overheads: number[];
  short: StepRun[];
  long: StepRun[];
}

/** Commands run in bash (dash where bash is missing), so the floor is measured with it: bash starts ~0.5 ms slower. */
const FLOOR_SHELL = existsSync("/bin/bash") ? "/bin/bash" : "/bin/sh";

/**
 * The floor under each step's command: Bun's PTY spawning `bash -c true`
 * in this process, waited for as aic waits (exit, then end of PTY output).
 */
async function commandFloor(times: number): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < times; i++) {
    const started = performance.now();
    let ended!: () => void;
    const eof = new Promise<void>((resolve) => (ended = resolve));
    const proc = Bun.spawn([FLOOR_SHELL, "-c", "true"], {
      terminal: { cols: 160, rows: 50, name: "xterm-256color", data() {}, exit: () => ended() },
    });
    await proc.exited;
    await Promise.race([eof, Bun.sleep(100)]);
    out.push(performance.now() - started);
    proc.terminal?.close();
  }
  return out;
}

/** How many Landlock rules the default sandbox holds here (the JSON start event says). */
async function sandboxRules(): Promise<number> {
  const srv = scriptedCommands(() => undefined);
  try {
    const run = await timeAic([...unattended(srv.url, "count rules"), "--json"]);
    const start = run.stdout.split("\n").find((l) => l.includes('"type":"start"'));
    return start ? Number(JSON.parse(start).sandbox.rules) : NaN;
  } finally {
    srv.close();
  }
}

/** The floor under each step's model call: one streamed completion from the fake server, fetched from this process. */
async function httpFloor(times: number): Promise<number[]> {
  const srv = scriptedCommands(() => "true");
  const out: number[] = [];
  try {
    const body = JSON.stringify({
      model: "bench-model",
      stream: true,
      stream_options: { include_usage: true },
      messages: [{ role: "user", content: "x" }],
    });
    for (let i = 0; i < times; i++) {
      const started = performance.now();
      const res = await fetch(`${srv.url}/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body,
      });
      await res.text();
      out.push(performance.now() - started);
    }
  } finally {
    srv.close();
  }
  return out;
}

export const perStep: Benchmark = {
  name: "per-step",
  description: `(${STEPS}-step run − 1-step run) / ${STEPS - 1}, every step the command \`true\`, ${REPEATS} repeats, with and without snapshots, sandbox, jail`,
  async run(ctx) {
    // Every variant but the first leaves out the two snapshots a step takes for the changed-files list, so the
    // figures compare with the runs before checkpoints covered session-less runs (2.6 ms a step).
    const variant = (label: string, flags: string[], env?: Record<string, string>): Variant => ({
      label,
      flags,
      env,
      overheads: [],
      short: [],
      long: [],
    });
    const NC = "--no-checkpoints";
    const variants: Variant[] = [
      variant("default", []),
      variant(NC, [NC]),
      variant(`${NC} --allow-read-secrets`, [NC, "--allow-read-secrets"]),
      variant(`${NC} --disable-sandbox`, [NC, "--disable-sandbox"]),
      // Landlock alone, as where the kernel refuses namespaces: what the jail itself costs.
      variant(`${NC}, no jail`, [NC], { AIC_NO_NAMESPACES: "1" }),
    ];
    for (let r = 1; r <= REPEATS; r++) {
      // Interleaved so every size and variant sees the same background load.
      for (const v of variants) {
        ctx.log(`per-step: repeat ${r}/${REPEATS} (${v.label}): 1-step and ${STEPS}-step runs`);
        const one = await runSteps(1, v.flags, v.env);
        const many = await runSteps(STEPS, v.flags, v.env);
        v.short.push(one);
        v.long.push(many);
        v.overheads.push((many.ms - one.ms) / (STEPS - 1));
      }
    }
    ctx.log(`per-step: floors (${STEPS} PTY spawns of ${FLOOR_SHELL} -c true, ${STEPS} fake-server requests)`);
    const floor = median(await commandFloor(STEPS));
    const http = median(await httpFloor(STEPS));

    const metrics: Metric[] = [];
    for (const v of variants) {
      const overhead = median(v.overheads);
      const early = median(v.long.flatMap((run) => run.intervals.slice(1, 1 + WINDOW)));
      const late = median(v.long.flatMap((run) => run.intervals.slice(-WINDOW)));
      const tag = `[${v.label}]`;
      metrics.push(
        {
          name: `${tag} per-step overhead`,
          value: overhead,
          unit: "ms",
          target: v.label === NC ? TARGET_MS : undefined,
          note: `median of ${v.overheads.map((x) => x.toFixed(1)).join(", ")} ms; sandbox ${v.long[0]!.sandbox.split(";")[0]}`,
        },
        { name: `${tag} ${STEPS}-step run total`, value: median(v.long.map((x) => x.ms)), unit: "ms" },
        { name: `${tag} 1-step run total`, value: median(v.short.map((x) => x.ms)), unit: "ms" },
        {
          name: `${tag} spawn → first model request`,
          value: median([...v.short, ...v.long].map((x) => x.firstRequestMs)),
          unit: "ms",
          note: "start-up of a real run",
        },
        {
          name: `${tag} step interval, steps 2–${WINDOW + 1}`,
          value: early,
          unit: "ms",
          note: "median time between model requests",
        },
        {
          name: `${tag} step interval, last ${WINDOW} steps`,
          value: late,
          unit: "ms",
          note: `${(late / early).toFixed(2)}× the early steps (growth = cost rising with history)`,
        },
      );
    }
    const withCheckpoints = median(variants[0]!.overheads);
    const withSandbox = median(variants[1]!.overheads);
    const writesOnly = median(variants[2]!.overheads);
    const without = median(variants[3]!.overheads);
    const noJail = median(variants[4]!.overheads);
    const firstRequest = (v: Variant) => median([...v.short, ...v.long].map((x) => x.firstRequestMs));
    metrics.push(
      {
        name: "snapshots per step (default − --no-checkpoints)",
        value: withCheckpoints - withSandbox,
        unit: "ms",
        note: "two git snapshots a step, for undo and the changed-files list",
      },
      { name: "sandbox cost per step (on − disabled)", value: withSandbox - without, unit: "ms" },
      {
        name: "jail cost per step (jail − no jail)",
        value: withSandbox - noJail,
        unit: "ms",
        note: "the jail is built once per launcher; a step pays nothing for it but noise",
      },
      {
        name: "jail start-up: 1-step run, jail − no jail",
        value: median(variants[1]!.short.map((x) => x.ms)) - median(variants[4]!.short.map((x) => x.ms)),
        unit: "ms",
        note: "unshare, the jail's mounts, the socket list (paid before the first command)",
      },
      {
        name: "per-step overhead, sandbox on / off",
        value: withSandbox / without,
        unit: "x",
        target: SANDBOX_RATIO_TARGET,
        note: "ratio of the two medians above, measured in the same run",
      },
      {
        name: "read rules: cost per step (on − --allow-read-secrets)",
        value: withSandbox - writesOnly,
        unit: "ms",
        note: `${await sandboxRules()} Landlock rules in the default ruleset; denying the secret stores means granting reads entry by entry`,
      },
      {
        name: "read rules: set-up at start (on − --allow-read-secrets)",
        value: firstRequest(variants[1]!) - firstRequest(variants[2]!),
        unit: "ms",
        note: "spawn → first model request, difference of medians",
      },
      {
        name: `floor: PTY spawn of ${FLOOR_SHELL} -c true`,
        value: floor,
        unit: "ms",
        note: "median, Bun.spawn with terminal in the bench process",
      },
      {
        name: "floor: one fake-server completion",
        value: http,
        unit: "ms",
        note: "median, fetch from the bench process",
      },
      {
        name: "[--no-checkpoints --disable-sandbox] overhead above both floors",
        value: without - floor - http,
        unit: "ms",
        note: "aic's own work per step",
      },
    );
    return metrics;
  },
};
