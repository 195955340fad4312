/**
 * TUI responsiveness (README: "The terminal UI": the UI never waits on the agent,
 * so a command running or a model streaming never freezes typing, scrolling or /stop).
 *
 * A real `Tui` from aic.ts, with its real Agent, runner and panes, on
 * OpenTUI's in-memory test renderer (120×40; the renderer's own on-demand
 * frame loop, as in a terminal, with the test-only per-frame verification
 * off). The fake model runs in a child process (so its work is not counted
 * here) and answers with 5,000 tokens of Markdown at ~1,000 tokens/s, then one command
 * that prints 10 MB (`head -c 7500000 /dev/urandom | base64`), with
 * `--auto-approve --max-output-bytes 200000` (runaway limit 20 MB, so the
 * command runs to the end) and `--max-prompt-len 1000000` (so the 200 KB
 * result does not start a compression, which is not what this measures).
 * Measured in this process:
 *
 * - event-loop stalls over the whole run: a 5 ms interval timer, stall =
 *   actual interval − 5 ms (aim: median < 5 ms, worst < 50 ms);
 * - typing: a 200-character line typed into the prompt a few characters every
 *   20 ms, once while the tokens stream and once while the command prints; the
 *   prompt must hold exactly that line afterwards (no Enter: it would queue a
 *   suggestion). Also how long a keystroke waits for the frame that shows it
 *   (aim: worst < 50 ms);
 * - idle CPU over 10 s: a fresh TUI before the run, and the same TUI after the
 *   run with full panes (aim ≤ 0.5 % of a core = 5 ms of CPU per second).
 *
 * Not included: writing frames to a real terminal (the test renderer keeps
 * them in memory), and the Landlock sandbox (--disable-sandbox: in-process,
 * aic would re-execute the benchmark runner instead of itself).
 */
import { createTestRenderer } from "@opentui/core/testing";
import * as ot from "@opentui/core";
import { rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Tui, loadXterm, parseArgs, type AgentEvent, type Config } from "../../aic.ts";
import { ROOT, scratch } from "../helpers.ts";
import { type Benchmark, type Metric, median, percentile } from "./lib.ts";

const WIDTH = 120;
const HEIGHT = 40;
const TOKENS = 5000;
const TOKEN_DELAY_MS = 1;
const BIG_COMMAND = "head -c 7500000 /dev/urandom | base64";
const LAG_INTERVAL_MS = 5;
const TYPE_EVERY_MS = 20;
const CHARS_PER_TICK = 3;
const IDLE_SECONDS = 10;
const SETTLE_MS = 3000;

const STALL_MEDIAN_TARGET = 5;
const STALL_WORST_TARGET = 50;
/** 0.5 % of one core, as milliseconds of CPU per second of wall time. */
const IDLE_CPU_TARGET = 5;

/** 200 characters a person might type, with nothing that is a TUI key (no Tab, Enter, leading "/"). */
const TYPED = "fix the flaky test in src/parser, then run npm test and tell me what changed, ok? "
  .repeat(3)
  .slice(0, 200);

/**
 * Exactly TOKENS pieces of Markdown, the way a model writes a report: every 16
 * pieces a line that is by turns a heading, a list item with **bold** and
 * `code`, a plain paragraph line, or a line of a fenced code block (so the
 * agent pane's Markdown renderer parses and lays out all of them while the
 * tokens stream). A piece is a word and its space, or a line's marker.
 */
function streamedText(): string {
  const words = ["the", "cat", "ran", "far", "and", "got", "lost", "near", "old", "mill"];
  const pieces: string[] = [];
  let line = 0;
  while (pieces.length < TOKENS) {
    const kind = line % 8;
    const start = kind === 0 ? "\n## " : kind === 1 ? "- **" : kind === 5 ? "```sh\n" : "";
    const row: string[] = [];
    for (let i = 0; i < 16; i++) row.push(words[(line + i) % words.length]!);
    if (kind === 1) row[1] = `${row[1]}** \`${row[2]}\``;
    const text = start + row.join(" ") + (kind === 5 ? "\n```" : "") + "\n";
    // Split the line into 16 pieces at its spaces, so the stream carries it word by word.
    const parts = text.split(/(?<= )/);
    for (const part of parts) if (pieces.length < TOKENS) pieces.push(part);
    line++;
  }
  return pieces.join("");
}

/** The fake model as a child process: prints its base URL, serves the scripted turns. */
async function startModelProcess(dir: string): Promise<{ url: string; stop(): void }> {
  const script = join(dir, "turns.json");
  writeFileSync(
    script,
    JSON.stringify([
      {
        content: streamedText(),
        contentPieces: TOKENS,
        delayMs: TOKEN_DELAY_MS,
        toolCalls: [{ arguments: JSON.stringify({ command: BIG_COMMAND }) }],
        usage: { prompt_tokens: 3000, completion_tokens: TOKENS },
      },
      { content: "Done.\nTASKCOMPLETE", usage: { prompt_tokens: 80000, completion_tokens: 5 } },
    ]),
  );
  const proc = Bun.spawn([process.execPath, join(ROOT, "tests", "fake-openai.ts"), "--script", script], {
    stdout: "pipe",
    stderr: "inherit",
  });
  const reader = proc.stdout.getReader();
  let out = "";
  while (!out.includes("\n")) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the fake model process exited before printing its URL");
    out += new TextDecoder().decode(value);
  }
  reader.releaseLock();
  return { url: out.trim().split("\n")[0]!, stop: () => proc.kill() };
}

/** Stalls of the event loop: how much later than due each 5 ms tick ran. */
function lagMonitor() {
  const stalls: { at: number; ms: number }[] = [];
  let last = performance.now();
  const timer = setInterval(() => {
    const now = performance.now();
    stalls.push({ at: now, ms: Math.max(0, now - last - LAG_INTERVAL_MS) });
    last = now;
  }, LAG_INTERVAL_MS);
  return { stalls, stop: () => clearInterval(timer) };
}

/** CPU time of this process (all threads) per second of wall time, over `seconds`. */
async function cpuPerSecond(seconds: number): Promise<number> {
  const cpu = process.cpuUsage();
  const started = performance.now();
  await Bun.sleep(seconds * 1000);
  const used = process.cpuUsage(cpu);
  return (used.user + used.system) / 1000 / ((performance.now() - started) / 1000);
}

function configFor(url: string, dir: string): Config {
  const parsed = parseArgs(
    [
      "--api-base",
      url,
      "--model",
      "bench-model",
      "--auto-approve",
      "--max-output-bytes",
      "200000",
      "--max-prompt-len",
      "1000000",
      "--disable-sandbox",
      "--session",
      join(dir, ".aicsession"),
    ],
    {},
  );
  if (parsed.kind !== "run") throw new Error(`unexpected parse result ${parsed.kind}`);
  return parsed.config;
}

/** How many of `typed` did not arrive, or arrived out of place (0 when the prompt holds exactly `typed`). */
function keystrokeErrors(typed: string, got: string): number {
  let same = 0;
  while (same < typed.length && typed[same] === got[same]) same++;
  return typed.length - same + Math.max(0, got.length - typed.length);
}

export const tui: Benchmark = {
  name: "tui",
  description:
    "TUI responsiveness: event-loop stalls and typing while 5,000 tokens stream and a command prints 10 MB; idle CPU",
  async run(ctx): Promise<Metric[]> {
    const dir = scratch("aic-bench-tui-");
    const model = await startModelProcess(dir);
    const setup = await createTestRenderer({
      width: WIDTH,
      height: HEIGHT,
      nativeSceneVerify: false,
      exitOnCtrlC: false,
      exitSignals: [],
      autoFocus: false,
      openConsoleOnError: false,
      useMouse: true,
      maxFps: 60,
    });
    const { renderer, mockInput } = setup;
    let exited: (code: number) => void = () => {};
    const exit = new Promise<number>((resolve) => (exited = resolve));
    const tui = new Tui({
      config: configFor(model.url, dir),
      renderer,
      ot,
      Terminal: await loadXterm(),
      onExit: (code) => exited(code),
      historyFile: join(dir, "history"),
    });

    // Watch the agent's events on their way into the TUI (the Agent calls tui.emit for each).
    const seen: {
      firstToken?: number;
      command?: number;
      resultAt?: number;
      result?: AgentEvent & { type: "command_result" };
      end?: AgentEvent & { type: "end" };
    } = {};
    const phaseListeners: ((e: AgentEvent) => void)[] = [];
    const emit = tui.emit.bind(tui);
    tui.emit = (e: AgentEvent) => {
      const now = performance.now();
      if (e.type === "assistant_delta") seen.firstToken ??= now;
      if (e.type === "command") seen.command = now;
      if (e.type === "command_result") [seen.result, seen.resultAt] = [e, now];
      if (e.type === "end") seen.end = e;
      emit(e);
      for (const l of phaseListeners) l(e);
    };

    // Keystroke → frame: each frame that follows a keystroke shows it.
    let keyPending: number | undefined;
    const keyToFrame: number[] = [];
    let frames = 0;
    const paints: number[] = [];
    renderer.on("frame", () => {
      frames++;
      paints.push(renderer.lastSceneTimeMs);
      if (keyPending !== undefined) keyToFrame.push(performance.now() - keyPending);
      keyPending = undefined;
    });

    /** Types TYPED a few characters per tick; resolves with the errors found in the prompt afterwards. */
    const typeLine = () =>
      new Promise<number>((resolve) => {
        let next = 0;
        const timer = setInterval(() => {
          if (next >= TYPED.length) {
            clearInterval(timer);
            const errors = keystrokeErrors(TYPED, tui.prompt.value);
            if (errors) ctx.log(`prompt after typing: ${JSON.stringify(tui.prompt.value.slice(0, 80))}…`);
            tui.prompt.value = "";
            return resolve(errors);
          }
          for (const ch of TYPED.slice(next, next + CHARS_PER_TICK)) mockInput.pressKey(ch);
          keyPending ??= performance.now();
          next += CHARS_PER_TICK;
        }, TYPE_EVERY_MS);
      });

    try {
      await setup.renderOnce();
      ctx.log(`idle CPU of a fresh TUI over ${IDLE_SECONDS} s`);
      await Bun.sleep(SETTLE_MS);
      const idleFresh = await cpuPerSecond(IDLE_SECONDS);

      ctx.log(`streaming ${TOKENS} tokens, then ${BIG_COMMAND}`);
      const lag = lagMonitor();
      const started = performance.now();
      const typing: Promise<number>[] = [];
      phaseListeners.push((e) => {
        if (e.type === "assistant_delta" && typing.length === 0) typing.push(typeLine());
        if (e.type === "command" && typing.length === 1) typing.push(typeLine());
      });
      void tui.submit("print a lot");
      const deadline = Date.now() + 240_000;
      while (!seen.end && Date.now() < deadline) await Bun.sleep(50);
      const runMs = performance.now() - started;
      const typingErrors = await Promise.all(typing);
      lag.stop();
      model.stop();
      if (!seen.end) throw new Error("the run did not end within 240 s");
      if (seen.end.status !== "completed") throw new Error(`the run ended ${seen.end.status}`);
      if (seen.result?.exit_code !== 0 || seen.result.status !== "exited")
        throw new Error(`the command ended ${seen.result?.status} with ${seen.result?.exit_code}`);
      if (typing.length !== 2) throw new Error(`typed during ${typing.length} phase(s), expected 2`);

      const stalls = lag.stalls.map((s) => s.ms);
      const during = (from = Infinity, to = -Infinity) =>
        lag.stalls.filter((s) => s.at >= from && s.at <= to).map((s) => s.ms);
      const streamStalls = during(seen.firstToken, seen.command);
      const commandStalls = during(seen.command, seen.resultAt);
      const afterStalls = during(seen.resultAt, Infinity);
      // Where the long stalls happened, for whoever has to fix them.
      const phase = (at: number) =>
        at >= (seen.resultAt ?? Infinity)
          ? "after the command: its result going to the model"
          : at >= (seen.command ?? Infinity)
            ? "command printing"
            : at >= (seen.firstToken ?? Infinity)
              ? "tokens streaming"
              : "before the first token";
      const when = (at: number) => `${((at - started) / 1000).toFixed(2)} s into the run (${phase(at)})`;
      for (const s of lag.stalls.filter((s) => s.ms > STALL_WORST_TARGET))
        ctx.log(`stall of ${s.ms.toFixed(0)} ms ending ${when(s.at)}`);

      ctx.log(`idle CPU after the run over ${IDLE_SECONDS} s`);
      await Bun.sleep(SETTLE_MS);
      const idleAfter = await cpuPerSecond(IDLE_SECONDS);

      return [
        {
          name: "stall median (whole run)",
          value: median(stalls),
          unit: "ms",
          target: STALL_MEDIAN_TARGET,
          note: `${stalls.length} ticks of ${LAG_INTERVAL_MS} ms over ${(runMs / 1000).toFixed(1)} s`,
        },
        { name: "stall p99 (whole run)", value: percentile(stalls, 99), unit: "ms" },
        { name: "stall worst (whole run)", value: Math.max(...stalls), unit: "ms", target: STALL_WORST_TARGET },
        {
          name: "stall worst while tokens stream",
          value: streamStalls.length ? Math.max(...streamStalls) : 0,
          unit: "ms",
          note: `median ${streamStalls.length ? median(streamStalls).toFixed(2) : "—"} ms`,
        },
        {
          name: "stall worst while 10 MB prints",
          value: commandStalls.length ? Math.max(...commandStalls) : 0,
          unit: "ms",
          note: `median ${commandStalls.length ? median(commandStalls).toFixed(2) : "—"} ms; the command took ${((seen.resultAt! - seen.command!) / 1000).toFixed(1)} s`,
        },
        {
          name: "stall worst after the command",
          value: afterStalls.length ? Math.max(...afterStalls) : 0,
          unit: "ms",
          note: "its 200 KB result counted, saved and sent",
        },
        {
          name: "keystrokes lost or out of order",
          value: typingErrors[0]! + typingErrors[1]!,
          unit: "count",
          target: 0,
          note: `${TYPED.length} chars typed twice (while streaming, while printing): ${typingErrors.join(" + ")}`,
        },
        {
          name: "keystroke → frame median",
          value: keyToFrame.length ? median(keyToFrame) : NaN,
          unit: "ms",
          note: `${keyToFrame.length} samples`,
        },
        {
          name: "keystroke → frame p90",
          value: keyToFrame.length ? percentile(keyToFrame, 90) : NaN,
          unit: "ms",
          note: "in this process, no terminal; field-tui measures it in tmux against `cat`",
        },
        {
          name: "keystroke → frame worst",
          value: keyToFrame.length ? Math.max(...keyToFrame) : NaN,
          unit: "ms",
          target: STALL_WORST_TARGET,
        },
        {
          name: "frame paint median",
          value: paints.length ? median(paints) : NaN,
          unit: "ms",
          note: `${frames} frames; layout + paint, synchronous part of a frame`,
        },
        { name: "frame paint worst", value: paints.length ? Math.max(...paints) : NaN, unit: "ms" },
        {
          name: "idle CPU, fresh TUI",
          value: idleFresh,
          unit: "ms",
          target: IDLE_CPU_TARGET,
          note: "ms of CPU per second (5 = 0.5% of a core)",
        },
        {
          name: "idle CPU after the run",
          value: idleAfter,
          unit: "ms",
          target: IDLE_CPU_TARGET,
          note: "ms of CPU per second, panes full",
        },
      ];
    } finally {
      model.stop();
      await tui.quit(0, "process_exit");
      await Promise.race([exit, Bun.sleep(5000)]);
      await setup.dispose().catch(() => {});
      rmSync(dir, { recursive: true, force: true });
    }
  },
};
