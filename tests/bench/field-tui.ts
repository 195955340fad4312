/**
 * Keystroke → frame in a real terminal while a command prints 10 MB (README: "Benchmarks"): the
 * compiled dist/aic in tmux (120×40), its TUI running `head -c 7500000 /dev/urandom | base64`
 * (10 MB; `--max-output-bytes 200000` so the runaway stop, 100 × the cap, lets it run to its end),
 * a key typed into the prompt every 25 ms while it runs. A key's latency is from `send-keys` to
 * the first tmux screen (capture-pane, polled over one control-mode connection, so no process is
 * started per look) that shows it. The baseline is the same measurement with tmux running `cat`
 * instead of aic (the tty echoes each key): what tmux, the polling and this machine cost anyway.
 * A and B alternate for PAIRS pairs; the figure is aic's p90 over all its keys against the
 * baseline's p90 + 30 ms.
 *
 * The keys typed: a marker ("QZX", not timed), then a word a letter at a time and back with
 * Backspace, over and over; a key is shown when the screen holds the marker and the word's prefix
 * it makes, and not the next longer prefix. The command prints base64, which never holds the
 * marker. tests/bench/tui.ts measures the same thing inside one process on OpenTUI's test
 * renderer (no terminal, no tmux); this one is the whole path a person sees.
 */
import { rmSync } from "node:fs";
import { startFakeServer } from "../fake-openai.ts";
import { Tmux, bash, cleanEnv, has, scratch } from "../helpers.ts";
import { fieldAic } from "./field-lib.ts";
import { type Benchmark, type Metric, median, percentile, roughPromptTokens } from "./lib.ts";

const PAIRS = Math.max(1, Number(process.env.AIC_BENCH_PAIRS) || 5);
const BIG_COMMAND = "head -c 7500000 /dev/urandom | base64";
const MARKER = "QZX";
const WORD = "abcdefghijklmnop";
const KEY_EVERY_MS = 25;
const KEY_TIMEOUT_MS = 2000;
const MAX_KEYS = 200;
const SLACK_MS = 30;

/** One `tmux -C` client: commands in, their output back, in order (tmux answers each with a %begin … %end block). */
class Control {
  private readonly proc;
  private readonly waiting: { resolve(out: string): void; reject(e: Error): void }[] = [];
  private block: string[] | undefined;
  private closed = false;

  constructor(socket: string) {
    this.proc = Bun.spawn(["tmux", "-L", socket, "-C", "attach-session", "-t", "aic"], {
      env: cleanEnv(),
      stdin: "pipe",
      stdout: "pipe",
      stderr: "ignore",
    });
    void this.read();
  }

  private async read(): Promise<void> {
    const decoder = new TextDecoder();
    let buffer = "";
    for await (const chunk of this.proc.stdout) {
      buffer += decoder.decode(chunk, { stream: true });
      let nl: number;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        // Flags 1: the answer to a command of this client (0: its own attach).
        const begin = /^%begin \d+ \d+ (\d+)$/.exec(line);
        if (begin) {
          if (begin[1] === "1") this.block = [];
          continue;
        }
        const end = /^%(end|error) \d+ \d+ (\d+)$/.exec(line);
        if (end && this.block) {
          const out = this.block.join("\n");
          this.block = undefined;
          const w = this.waiting.shift();
          if (end[1] === "end") w?.resolve(out);
          else w?.reject(new Error(`tmux: ${out}`));
          continue;
        }
        this.block?.push(line);
      }
    }
    this.closed = true;
    for (const w of this.waiting.splice(0)) w.reject(new Error("the tmux control client ended"));
  }

  run(command: string): Promise<string> {
    if (this.closed) return Promise.reject(new Error("the tmux control client ended"));
    return new Promise((resolve, reject) => {
      this.waiting.push({ resolve, reject });
      this.proc.stdin.write(command + "\n");
      this.proc.stdin.flush();
    });
  }

  close(): void {
    this.proc.kill();
  }
}

/** The prefix length the screen shows: the longest k with MARKER + WORD[0, k) on it, or -1 without the marker. */
function shownPrefix(screen: string): number {
  if (!screen.includes(MARKER)) return -1;
  let k = 0;
  while (k < WORD.length && screen.includes(MARKER + WORD.slice(0, k + 1))) k++;
  return k;
}

interface Typed {
  latencies: number[];
  lost: number;
}

/**
 * Types MARKER (untimed), then WORD and back, a key every KEY_EVERY_MS, timing each until the
 * screen shows it, for as long as `keepGoing` says (and at most MAX_KEYS keys).
 */
async function typeAndTime(ctl: Control, target: string, keepGoing: (n: number) => boolean): Promise<Typed> {
  const capture = () => ctl.run(`capture-pane -p -t ${target}`);
  await ctl.run(`send-keys -t ${target} -l ${MARKER}`);
  for (const until = performance.now() + 15_000; shownPrefix(await capture()) !== 0;) {
    if (performance.now() > until) throw new Error(`the marker never appeared:\n${await capture()}`);
    await Bun.sleep(5);
  }
  const latencies: number[] = [];
  let lost = 0;
  let k = 0;
  let up = true;
  while (latencies.length < MAX_KEYS && keepGoing(latencies.length)) {
    if (k === WORD.length) up = false;
    if (k === 0) up = true;
    const want = up ? k + 1 : k - 1;
    const sent = performance.now();
    await ctl.run(up ? `send-keys -t ${target} -l ${WORD[k]}` : `send-keys -t ${target} BSpace`);
    let shown = -2;
    while ((shown = shownPrefix(await capture())) !== want && performance.now() - sent < KEY_TIMEOUT_MS)
      await Bun.sleep(1);
    latencies.push(performance.now() - sent);
    if (shown !== want) {
      lost++;
      k = Math.max(0, shown); // carry on from what the screen shows
    } else k = want;
    await Bun.sleep(KEY_EVERY_MS);
  }
  return { latencies, lost };
}

interface TuiRun extends Typed {
  commandMs: number;
}

async function aicRun(): Promise<TuiRun> {
  const [home, cwd] = [scratch("aic-bench-tmux-home-"), scratch("aic-bench-tmux-cwd-")];
  const at: number[] = [];
  const srv = startFakeServer({
    turns: (req, index) => {
      at.push(performance.now());
      const usage = { prompt_tokens: roughPromptTokens(req), completion_tokens: 12 };
      return index === 0 ? { ...bash(BIG_COMMAND), usage } : { content: "Done.\nTASKCOMPLETE", usage };
    },
  });
  const env = cleanEnv({ HOME: home, TERM: "xterm-256color", SHELL: "/bin/bash" });
  const args = ["--api-base", srv.url, "--model", "bench-model", "--api-key", "x", "--auto-approve"];
  args.push("--max-output-bytes", "200000", "--max-prompt-len", "1000000", "print a lot");
  const tmux = new Tmux(env, cwd, [fieldAic(), ...args]);
  const ctl = new Control(tmux.socket);
  try {
    for (const until = performance.now() + 30_000; at.length === 0; await Bun.sleep(5))
      if (performance.now() > until) throw new Error(`aic never asked the model:\n${tmux.screen()}`);
    // While the command runs: until the request carrying its result reaches the model.
    const typed = await typeAndTime(ctl, tmux.target, () => at.length < 2);
    for (const until = performance.now() + 60_000; at.length < 2; await Bun.sleep(20))
      if (performance.now() > until) throw new Error("the command did not end within 60 s");
    return { ...typed, commandMs: at[1]! - at[0]! };
  } finally {
    ctl.close();
    tmux.kill();
    srv.close();
    for (const d of [home, cwd]) rmSync(d, { recursive: true, force: true });
  }
}

async function catRun(keys: number): Promise<Typed> {
  const cwd = scratch("aic-bench-tmux-cat-");
  const tmux = new Tmux(cleanEnv({ HOME: cwd, TERM: "xterm-256color" }), cwd, ["cat"]);
  const ctl = new Control(tmux.socket);
  try {
    return await typeAndTime(ctl, tmux.target, (n) => n < keys);
  } finally {
    ctl.close();
    tmux.kill();
    rmSync(cwd, { recursive: true, force: true });
  }
}

export const fieldTui: Benchmark = {
  name: "field-tui",
  description: `keystroke → frame p90 in tmux while dist/aic's TUI runs a command printing 10 MB, ÷ (\`cat\` in tmux p90 + ${SLACK_MS} ms), ${PAIRS} pairs`,
  async run(ctx): Promise<Metric[]> {
    if (!has.tmux)
      return [{ name: "keystroke → frame p90", value: NaN, unit: "ms", status: "SKIP", note: "tmux is not installed" }];
    const mine: TuiRun[] = [];
    const base: Typed[] = [];
    for (let i = 0; i < PAIRS; i++) {
      ctx.log(`field-tui: pair ${i + 1}/${PAIRS}`);
      // The baseline types as many keys as the aic run before it did (30 for the first).
      if (i % 2 === 0) {
        mine.push(await aicRun());
        base.push(await catRun(Math.max(30, mine.at(-1)!.latencies.length)));
      } else {
        base.push(await catRun(Math.max(30, mine.at(-1)?.latencies.length ?? 30)));
        mine.push(await aicRun());
      }
    }
    const a = mine.flatMap((r) => r.latencies);
    const b = base.flatMap((r) => r.latencies);
    const [pa, pb] = [percentile(a, 90), percentile(b, 90)];
    const lost = mine.reduce((s, r) => s + r.lost, 0);
    return [
      {
        name: "keystroke → frame p90, aic while 10 MB prints",
        value: pa,
        unit: "ms",
        target: pb + SLACK_MS,
        note: `target = cat-in-tmux p90 ${pb.toFixed(1)} ms + ${SLACK_MS} ms; ${a.length} keys over ${PAIRS} runs (per run p90 ${mine.map((r) => percentile(r.latencies, 90).toFixed(0)).join(", ")} ms)`,
      },
      {
        name: "  aic median / worst",
        value: median(a),
        unit: "ms",
        note: `worst ${Math.max(...a).toFixed(0)} ms; ${lost} keys not shown within ${KEY_TIMEOUT_MS / 1000} s; the command ran ${list(mine.map((r) => r.commandMs / 1000))} s`,
      },
      {
        name: "  cat in tmux median / worst",
        value: median(b),
        unit: "ms",
        note: `worst ${Math.max(...b).toFixed(0)} ms; ${b.length} keys`,
      },
    ];
  },
};

const list = (v: number[]) => v.map((x) => x.toFixed(1)).join(", ");
