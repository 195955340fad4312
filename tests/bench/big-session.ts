/**
 * Resuming a big session (README: "Session files"): a long-lived conversation
 * restored from a ~50 MB `.aicsession` of ~20,000 messages, written by aic's own
 * `SessionStore` with the very system prompt this aic builds in that directory,
 * so nothing in it needs repairing. The history is a realistic mix: a series of
 * tasks, each a user request, assistant turns calling execute_bash (some with
 * text, some with two calls), tool results of every size (listings, test runs,
 * greps, compiler errors, logs; some capped with head, tail and the saved-output
 * note), a few very large outputs (a run with a high --max-output-bytes), the odd
 * suggestion from the user, and the model's TASKCOMPLETE closing each task.
 *
 * `dist/aic --nogui --auto-approve --session FILE` then gets one more request,
 * which the fake model finishes at once. A history this size is far over the
 * prompt budget, so the first step compresses it: the fake model answers the
 * summariser's request(s) (no tools) with a summary and the agent's with
 * TASKCOMPLETE. Each run starts from a fresh copy of the same file.
 *
 * Figures, median of RUNS: spawn to the first model request reaching the fake
 * server (restore, repair, compression and the first checkpoints all come
 * before it), and the peak resident set (VmHWM, polled) against the file size.
 */
import { copyFileSync, readFileSync, readdirSync, rmSync, statSync } from "node:fs";
import { join } from "node:path";
import { SessionStore, type Message } from "../../aic.ts";
import { startFakeServer, type FakeServer, type Turn } from "../fake-openai.ts";
import { scratch } from "../helpers.ts";
import {
  type Benchmark,
  type Metric,
  type TimedRun,
  expectRun,
  median,
  roughPromptTokens,
  timeAic,
  unattended,
} from "./lib.ts";
import { rng, toolExchange } from "./session.ts";

const TARGET_BYTES = 50 * 1024 * 1024;
const TARGET_MESSAGES = 20_000;
const RUNS = 3;
const POLL_MS = 10;
const FIRST_REQUEST_TARGET_MS = 3000;
/** Peak RSS may be at most this many times the file's size. */
const RSS_FACTOR = 4;
/** aic's default --max-output-bytes: what an ordinary tool result holds at most. */
const CAP = 10_240;
/** The size of the few very large tool results (made by a run with a high --max-output-bytes). */
const LARGE_OUTPUT_BYTES = 256 * 1024;
const REQUEST = "One more thing: check that the test suite still passes and stop.";
const SESSION_NAME = ".aicsession";

const TASKS = [
  "The test suite fails after the last merge. Find out why and fix it without changing the public API.",
  "Add a --json flag to the CLI that prints the report as JSON; keep the text output as it is.",
  "The build is slow. Profile it and make the incremental build faster.",
  "Upgrade the database driver to the next major version and fix whatever breaks.",
  "Write unit tests for the config parser, covering the edge cases in the issue tracker.",
  "The server leaks memory under load. Reproduce it, find the leak and fix it.",
  "Rename the `utils` package to `common` everywhere, including the docs and the imports.",
  "Set up CI: lint, type-check and the tests on every pull request.",
];

const SUGGESTIONS = [
  "use the existing helper in src/lib instead of writing a new one",
  "don't touch the generated files",
  "run only the failing test first, the full suite takes long",
  "the staging config is in config/staging.json",
];

// ---------------------------------------------------------------------------------------------
// The history

/** Bytes a message takes in the file: aic writes each one as 2-space JSON indented by 4. */
function fileBytes(m: Message): number {
  const text = JSON.stringify(m, null, 2);
  let lines = 1;
  for (let i = text.indexOf("\n"); i >= 0; i = text.indexOf("\n", i + 1)) lines++;
  return Buffer.byteLength(text) + 4 * lines + 2;
}

/** A command's output as aic hands it to the model with the default cap: head, the saved-output note, tail. */
function capped(output: string, id: string): string {
  if (Buffer.byteLength(output) <= CAP) return output;
  const head = output.slice(0, CAP / 2);
  const tail = output.slice(-CAP / 2);
  const omitted = output.length - head.length - tail.length;
  const note = `[… ${omitted} bytes left out of ${output.length} (${output.split("\n").length} lines). The whole output is saved in /tmp/aic-outputs-20260101_120000/${id}.txt; read it in slices (sed -n, head -c, tail -c, grep) instead of re-running the command …]`;
  return `${head}\n${note}\n${tail}\noutput too long: truncated`;
}

/** Output of about `bytes`: several of `toolExchange`'s outputs one after another (a long test or build log). */
function longOutput(r: (n: number) => number, bytes: number): string {
  const parts: string[] = [];
  let size = 0;
  for (let k = 0; size < bytes; k++) {
    const part = toolExchange(r, k).output;
    parts.push(part);
    size += part.length + 1;
  }
  return parts.join("\n").slice(0, bytes);
}

/**
 * About TARGET_MESSAGES messages whose file is about TARGET_BYTES: ordinary
 * turns first, then the bytes still missing spread over a few very large tool
 * results, evenly through the conversation.
 */
export function buildBigHistory(systemPrompt: string, seed = 11): Message[] {
  const r = rng(seed);
  const messages: Message[] = [{ role: "system", content: systemPrompt }];
  let task = 0;
  let turnInTask = 0;
  let turnsThisTask = 0;
  const newTask = () => {
    messages.push({ role: "user", content: TASKS[task++ % TASKS.length]! });
    turnInTask = 0;
    turnsThisTask = 30 + r(60);
  };
  newTask();
  for (let i = 0; messages.length < TARGET_MESSAGES - 3; i++) {
    if (turnInTask++ >= turnsThisTask) {
      messages.push({ role: "assistant", content: "TASKCOMPLETE" });
      newTask();
      continue;
    }
    if (r(120) === 0)
      messages.push({ role: "user", content: `[Suggestion from user] ${SUGGESTIONS[r(SUGGESTIONS.length)]}` });
    const calls = r(15) === 0 ? 2 : 1;
    const exchanges = Array.from({ length: calls }, (_, k) => toolExchange(r, i + k));
    const ids = exchanges.map((_, k) => `call_${i}_${k}_${r(1e9).toString(36)}`);
    messages.push({
      role: "assistant",
      content: r(4) === 0 ? `Next I look at what ${exchanges[0]!.command.split(" ")[0]} says.` : null,
      tool_calls: exchanges.map((x, k) => ({
        id: ids[k]!,
        type: "function" as const,
        function: { name: "execute_bash", arguments: JSON.stringify({ command: x.command }) },
      })),
    });
    exchanges.forEach((x, k) => {
      const output = r(12) === 0 ? capped(longOutput(r, 20_000 + r(60_000)), ids[k]!) : x.output;
      messages.push({
        role: "tool",
        tool_call_id: ids[k]!,
        content: `Command executed with exit code ${r(8) === 0 ? 1 : 0}.\nOutput:\n${output}`,
      });
    });
  }
  messages.push({ role: "assistant", content: "TASKCOMPLETE" });

  let bytes = messages.reduce((n, m) => n + fileBytes(m), 0);
  const tools = messages.filter((m) => m.role === "tool");
  const large = Math.max(0, Math.ceil((TARGET_BYTES - bytes) / LARGE_OUTPUT_BYTES));
  for (let k = 0; k < large && bytes < TARGET_BYTES; k++) {
    const m = tools[Math.floor(((k + 0.5) * tools.length) / large)]!;
    const before = fileBytes(m);
    const extra = Math.min(LARGE_OUTPUT_BYTES, TARGET_BYTES - bytes);
    m.content = `${String(m.content)}\n${longOutput(r, extra)}`;
    bytes += fileBytes(m) - before;
  }
  return messages;
}

// ---------------------------------------------------------------------------------------------
// Runs

/** A summary as a model would write it, for every summariser request. */
const SUMMARY = [
  "Goal: keep the project's tests green while working through the requested changes.",
  "Done: fixed the failing parser tests, added the --json flag, sped up the incremental build,",
  "upgraded the database driver, renamed utils to common, set up CI.",
  "Current state: all tests passed at the last run; no background jobs.",
  "Next step: answer the newest request.",
].join("\n");

/** The fake model: the summariser's requests (sent without tools) get a summary, the agent's TASKCOMPLETE. */
function model(): FakeServer {
  return startFakeServer({
    turns: (req): Turn => {
      const usage = { prompt_tokens: roughPromptTokens(req), completion_tokens: 40 };
      return req.body?.tools ? { content: "TASKCOMPLETE", usage } : { content: SUMMARY, usage };
    },
  });
}

/** Removes what a run left beside the session file (its lock, a kept original, temporary files). */
function clearSessionFiles(cwd: string): void {
  for (const name of readdirSync(cwd))
    if (name.includes(SESSION_NAME)) rmSync(join(cwd, name), { recursive: true, force: true });
}

/** The system prompt aic writes into a session in `cwd`, from a one-step run there. */
async function systemPromptIn(cwd: string): Promise<string> {
  const srv = model();
  try {
    const file = join(cwd, SESSION_NAME);
    const run = await timeAic(unattended(srv.url, "--session", file, "say done"), { cwd });
    expectRun("priming run", run, srv, { code: 0, requests: 1 });
    const doc = JSON.parse(readFileSync(file, "utf8")) as { messages: Message[] };
    return String(doc.messages[0]!.content);
  } finally {
    srv.close();
    clearSessionFiles(cwd);
  }
}

/** Writes the big session with aic's own SessionStore, to `file`; returns how many messages it holds. */
function writeBigSession(file: string, systemPrompt: string, apiBase: string): number {
  const messages = buildBigHistory(systemPrompt);
  const store = SessionStore.claim(file, { model: "bench-model", apiBase }, { emit() {} });
  try {
    const state = {
      messages,
      stepCount: messages.filter((m) => m.role === "assistant").length,
      usage: { input_tokens: 912_345_678, output_tokens: 2_345_678, cached_tokens: 800_000_000, billable_tokens: 0 },
    };
    if (!store.save("process_exit", state)) throw new Error(`SessionStore.save failed for ${file}`);
    return messages.length;
  } finally {
    store.release();
  }
}

interface ResumeFigures {
  /** Spawn to the first model request (the summariser's, when compression runs first). */
  firstRequestMs: number;
  /** Spawn to the agent's own model request. */
  agentRequestMs: number;
  totalMs: number;
  peakMb: number;
  summariserCalls: number;
  restored: number;
  sessionAfterBytes: number;
}

async function resumeOnce(master: string, cwd: string): Promise<ResumeFigures> {
  clearSessionFiles(cwd);
  const file = join(cwd, SESSION_NAME);
  copyFileSync(master, file);
  const srv = model();
  let run: TimedRun;
  try {
    run = await timeAic(unattended(srv.url, "--session", file, REQUEST), {
      cwd,
      pollRssMs: POLL_MS,
      keepStdoutChars: 0,
    });
    expectRun("resumed run", run, srv, { code: 0 });
    const agent = srv.requests.filter((r) => r.body?.tools);
    if (agent.length !== 1) throw new Error(`${agent.length} agent requests, expected 1\n${run.stderr.slice(-1500)}`);
    const restored = Number(/Restored (\d+) message\(s\)/.exec(run.stderr)?.[1] ?? NaN);
    if (!Number.isFinite(restored)) throw new Error(`the session was not restored\n${run.stderr.slice(-1500)}`);
    if (/differs from this run's|kept the file as it was/.test(run.stderr))
      throw new Error(`the session needed repairs, so the run is not the plain resume measured\n${run.stderr}`);
    if (run.peakRssKb === 0) throw new Error("never read VmHWM from /proc");
    return {
      firstRequestMs: srv.requests[0]!.at - run.spawnedAtEpochMs,
      agentRequestMs: agent[0]!.at - run.spawnedAtEpochMs,
      totalMs: run.ms,
      peakMb: run.peakRssKb / 1024,
      summariserCalls: srv.requests.length - 1,
      restored,
      sessionAfterBytes: statSync(file).size,
    };
  } finally {
    srv.close();
  }
}

export const bigSession: Benchmark = {
  name: "big-session",
  description: `resuming a ~${TARGET_BYTES / 1048576} MB, ~${TARGET_MESSAGES} message session: spawn to first model request, peak RSS; median of ${RUNS}`,
  async run(ctx) {
    const cwd = scratch("aic-bench-big-");
    const store = scratch("aic-bench-big-master-");
    try {
      ctx.log("big-session: the system prompt aic uses in the run directory");
      const prompt = await systemPromptIn(cwd);
      ctx.log(`big-session: writing a ~${TARGET_BYTES / 1048576} MB session with SessionStore`);
      const master = join(store, SESSION_NAME);
      const count = writeBigSession(master, prompt, "http://127.0.0.1:9/v1");
      const bytes = statSync(master).size;
      const mb = bytes / 1048576;
      const runs: ResumeFigures[] = [];
      for (let r = 1; r <= RUNS; r++) {
        ctx.log(`big-session: resumed run ${r}/${RUNS}`);
        runs.push(await resumeOnce(master, cwd));
      }
      const list = (f: (x: ResumeFigures) => number, digits = 0) => runs.map((x) => f(x).toFixed(digits)).join(", ");
      const last = runs.at(-1)!;
      return [
        {
          name: "session file",
          value: mb,
          unit: "MB",
          note: `${bytes} bytes, ${count} messages (${last.restored} restored after the system prompt)`,
        },
        {
          name: "spawn to first model request (median)",
          value: median(runs.map((x) => x.firstRequestMs)),
          unit: "ms",
          target: FIRST_REQUEST_TARGET_MS,
          note: `runs ${list((x) => x.firstRequestMs)} ms; ${last.summariserCalls} summariser call(s) first`,
        },
        {
          name: "spawn to the agent's request (median)",
          value: median(runs.map((x) => x.agentRequestMs)),
          unit: "ms",
          note: `runs ${list((x) => x.agentRequestMs)} ms`,
        },
        {
          name: "spawn to exit (median)",
          value: median(runs.map((x) => x.totalMs)),
          unit: "ms",
          note: `runs ${list((x) => x.totalMs)} ms; file after the run ${(last.sessionAfterBytes / 1024).toFixed(0)} KB`,
        },
        {
          name: "peak RSS (median)",
          value: median(runs.map((x) => x.peakMb)),
          unit: "MB",
          target: RSS_FACTOR * mb,
          note: `runs ${list((x) => x.peakMb)} MB; target ${RSS_FACTOR}× the file`,
        },
        {
          name: "peak RSS / file size",
          value: median(runs.map((x) => x.peakMb)) / mb,
          unit: "x",
          note: "the figure to compare across file sizes",
        },
      ] satisfies Metric[];
    } finally {
      rmSync(cwd, { recursive: true, force: true });
      rmSync(store, { recursive: true, force: true });
    }
  },
};
