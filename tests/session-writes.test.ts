/**
 * How often a step writes the session file, and what a crash still finds in it (README: "Session files",
 * "What survives what"; issue 34). The compiled dist/aic in `--nogui --auto-approve --session PATH`,
 * against the fake OpenAI server, with real commands, real SIGKILLs and real files.
 *
 * A step's own checkpoints (its turn, the checkpoint of the files before its command, its result) do not
 * wait for the disk: each is flushed on the thread pool and renamed into place once flushed, a command
 * waits until they are on disk before it runs, and the model is asked once the result is in place. So:
 * - under strace, a step writes the file at most three times with checkpoints on (twice without), and
 *   aic's event loop makes no fsync during a step (it made four);
 * - a SIGKILL at the instant a model request arrives, or while a command runs, loses nothing the README
 *   promises: the request, the last finished turn and result, and the checkpoint taken before the command
 *   (`aic undo` works), and the killed command is never run again.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { SessionStore, type AgentEvent } from "../aic.ts";
import type { RecordedRequest, Turn } from "./fake-openai.ts";
import {
  bash,
  groupAlive,
  has,
  headless,
  hostPid,
  killGroup,
  messagesOf,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  startAic,
  waitFor,
  type Live,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const groups: number[] = [];
afterEach(() => {
  for (const g of groups.splice(0)) killGroup(g);
});

const SESSION = "run.aicsession";
const args = (url: string, ...more: string[]) => [
  ...headless(url, "test-model", "--auto-approve", "--session", SESSION),
  ...more,
];
const readSession = (cwd: string) => JSON.parse(readFileSync(join(cwd, SESSION), "utf8"));
const lastUser = (req: RecordedRequest): string => messagesOf(req).findLast((m) => m.role === "user")?.content ?? "";

/** The killed command's shell writes its pid here first; its process group (the PTY child leads one) is returned. */
async function commandGroup(cwd: string): Promise<number> {
  const file = join(cwd, "cmd.pid");
  const text = await waitFor(
    "the command to start",
    () => existsSync(file) && /^\d+\n/.test(readFileSync(file, "utf8")) && readFileSync(file, "utf8"),
  );
  const pgid = hostPid(Number(text.trim()), cwd) ?? -1;
  groups.push(pgid);
  return pgid;
}

/**
 * Waits for `aic`'s command (WAITING: it writes its pid, counts itself, sleeps) to run, reads the session file
 * (what a kill -9 now leaves), kills aic with SIGKILL and the command's group, and returns what was read, checked
 * to be what the file still holds.
 */
const WAITING = `echo $$ > cmd.pid; echo run >> counter.txt; sleep 300`;
async function killDuringCommand(cwd: string, aic: Live): Promise<any> {
  const pgid = await commandGroup(cwd);
  await waitFor("the command to count itself", () => existsSync(join(cwd, "counter.txt")));
  const atKill = readSession(cwd);
  aic.proc.kill("SIGKILL");
  await aic.done;
  killGroup(pgid);
  await waitFor("the orphaned command to go", () => !groupAlive(pgid));
  expect(readSession(cwd)).toEqual(atKill);
  return atKill;
}

// ---------------------------------------------------------------------------------------------

interface StepCounts {
  /** Temporary session files created: one per write. */
  writes: number;
  /** Renames onto the session file. */
  renames: number;
  /** fsync/fdatasync made by aic's main thread (the event loop waits in them). */
  loopFsyncs: number;
  /** fsync/fdatasync made by aic's other threads (the thread pool). */
  poolFsyncs: number;
}

/** STEPS steps of `true N` under `strace -f`; the session's syscalls of aic's own threads over steps 2 … STEPS, per step. */
async function countWrites(steps: number, flags: string[]): Promise<StepCounts> {
  const cwd = scratch();
  const trace = join(scratch(), "trace");
  const srv = fixtures.serve((_req, i) => (i < steps ? bash(`true ${i}`, `call_${i}`) : { content: "TASKCOMPLETE" }));
  const strace = [
    "strace",
    "-f",
    "-qq",
    "-ttt",
    "-o",
    trace,
    "-e",
    "trace=execve,openat,rename,renameat,renameat2,fsync,fdatasync",
  ];
  const run = await runCommand(
    [...strace, join(import.meta.dir, "..", "dist", "aic"), ...args(srv.url, ...flags), "run true"],
    { cwd },
  );
  expect(run.code).toBe(0);
  expect(srv.requests).toHaveLength(steps + 1);
  // Steps 2 … STEPS: from the second model request to the last command's (the TASKCOMPLETE one is request STEPS).
  const [from, to] = [srv.requests[1]!.at / 1000, srv.requests[steps]!.at / 1000];
  const lines = readFileSync(trace, "utf8").split("\n");
  const main = /^(\d+)\s/.exec(lines[0] ?? "")?.[1];
  // aic's threads are every pid but the processes it starts (git, the shell, the launcher): those execve.
  const processes = new Set<string>();
  for (const line of lines) {
    const m = /^(\d+)\s+[\d.]+\s+execve\(/.exec(line);
    if (m && m[1] !== main) processes.add(m[1]!);
  }
  const c: StepCounts = { writes: 0, renames: 0, loopFsyncs: 0, poolFsyncs: 0 };
  for (const line of lines) {
    const m = /^(\d+)\s+([\d.]+)\s+(\w+)\((.*)$/.exec(line);
    if (!m) continue;
    const [, pid, at, call, rest] = m as unknown as [string, string, string, string, string];
    if (processes.has(pid) || Number(at) < from || Number(at) > to) continue;
    if (call === "openat" && rest.includes(`/.${SESSION}.`) && rest.includes("O_CREAT")) c.writes++;
    else if (call.startsWith("rename") && rest.includes(`/${SESSION}"`)) c.renames++;
    else if (call === "fsync" || call === "fdatasync") pid === main ? c.loopFsyncs++ : c.poolFsyncs++;
  }
  const n = steps - 1;
  return { writes: c.writes / n, renames: c.renames / n, loopFsyncs: c.loopFsyncs / n, poolFsyncs: c.poolFsyncs / n };
}

// Needs strace to see the writes (apt-get install strace); skipped where it is missing.
describe.skipIf(!has.strace)("writes per step (strace)", () => {
  const STEPS = 6;

  test("checkpoints on: at most 3 writes a step (turn, checkpoint, result), no fsync on the event loop", async () => {
    const c = await countWrites(STEPS, []);
    // Before issue 34's change: 4 writes (before_llm_call, assistant_message, before_command, tool_result), 4 fsyncs
    // on the event loop.
    expect(c.writes).toBeLessThanOrEqual(3);
    expect(c.renames).toBeLessThanOrEqual(c.writes);
    expect(c.loopFsyncs).toBe(0);
    // The turn and the result: file and directory each (the checkpoint after an unchanged turn is a rename only).
    expect(c.poolFsyncs).toBeLessThanOrEqual(4 + 1 / (STEPS - 1));
    expect(c.poolFsyncs).toBeGreaterThan(0);
  }, 60_000);

  test("--no-checkpoints: 2 writes a step (turn, result), no fsync on the event loop", async () => {
    const c = await countWrites(STEPS, ["--no-checkpoints"]);
    // Before: 3 writes, 4 fsyncs on the event loop.
    expect(c.writes).toBeLessThanOrEqual(2);
    expect(c.loopFsyncs).toBe(0);
    expect(c.poolFsyncs).toBeLessThanOrEqual(4 + 1 / (STEPS - 1));
    expect(c.poolFsyncs).toBeGreaterThan(0);
  }, 60_000);
});

// ---------------------------------------------------------------------------------------------

describe("SIGKILL loses nothing promised", () => {
  /** A server whose request number `at` kills `aic` the instant it arrives, before answering it (it hangs). */
  function killingAt(at: number, turns: (i: number) => Turn, aic: { live?: Live }) {
    return fixtures.serve((_req, i) => {
      if (i !== at) return turns(i);
      aic.live!.proc.kill("SIGKILL");
      return { type: "hang" };
    });
  }

  test("killed as the first model request arrives: the request is in the file", async () => {
    const cwd = scratch();
    const aic: { live?: Live } = {};
    const srv = killingAt(0, () => ({ content: "TASKCOMPLETE" }), aic);
    aic.live = startAic(args(srv.url, "the task typed before the kill"), { cwd });
    const run = await aic.live.done;
    expect(run.code).toBe(128 + 9);
    const doc = readSession(cwd);
    expect(doc.reason).toBe("user_request");
    expect(doc.messages.map((m: any) => m.role)).toEqual(["system", "user"]);
    expect(doc.messages[1].content).toBe("the task typed before the kill");
  });

  for (const flags of [[], ["--no-checkpoints"]])
    test(`killed as the model is asked after a result${flags.length ? ` (${flags[0]})` : ""}: every result is in the file`, async () => {
      const cwd = scratch();
      const aic: { live?: Live } = {};
      // Requests 0 and 1 ask for commands; request 2 arrives once the second result is in place.
      const srv = killingAt(2, (i) => bash(`echo result ${i}`, `call_${i}`), aic);
      aic.live = startAic(args(srv.url, ...flags, "print two results"), { cwd });
      expect((await aic.live.done).code).toBe(128 + 9);
      const doc = readSession(cwd);
      expect(doc.reason).toBe("tool_result");
      const tools = doc.messages.filter((m: any) => m.role === "tool");
      expect(tools.map((m: any) => m.tool_call_id)).toEqual(["call_0", "call_1"]);
      expect(tools[1].content).toContain("result 1");
    });

  test("killed while a command runs: its turn and its checkpoint are in the file, and aic undo puts the files back", async () => {
    const cwd = scratch();
    const srv = fixtures.serve((req, i) => {
      if (lastUser(req) !== "make a file, then wait") return { content: "TASKCOMPLETE" };
      return i === 0 ? bash("echo one > a.txt", "call_file") : bash(WAITING, "call_wait");
    });
    const atKill = await killDuringCommand(cwd, startAic(args(srv.url, "make a file, then wait"), { cwd }));

    expect(atKill.reason).toBe("before_command");
    expect(atKill.messages.map((m: any) => m.role)).toEqual(["system", "user", "assistant", "tool", "assistant"]);
    expect(atKill.messages[3]).toMatchObject({ role: "tool", tool_call_id: "call_file" });
    expect(atKill.messages[4].tool_calls.map((c: any) => c.id)).toEqual(["call_wait"]);
    expect(atKill.checkpoints.done.map((s: any) => s.call)).toEqual(["call_file", "call_wait"]);

    // The checkpoint taken before the killed command puts back the files as they were before it: its pid file goes.
    const undo = await runAic(["undo", "1", "--session", SESSION], { cwd });
    expect(undo.code).toBe(0);
    expect(existsSync(join(cwd, "cmd.pid"))).toBe(false);
    expect(readFileSync(join(cwd, "a.txt"), "utf8")).toBe("one\n");
  });

  test("--no-checkpoints, killed while a command runs: the turn is in the file, recovered and never re-run", async () => {
    const cwd = scratch();
    const srv = fixtures.serve((req) =>
      lastUser(req) === "first task" ? bash(WAITING, "call_wait") : { content: "TASKCOMPLETE" },
    );
    const atKill = await killDuringCommand(cwd, startAic(args(srv.url, "--no-checkpoints", "first task"), { cwd }));

    expect(atKill.reason).toBe("assistant_message");
    expect(atKill.messages.at(-1).tool_calls.map((c: any) => c.id)).toEqual(["call_wait"]);

    const second = await runAic(args(srv.url, "--no-checkpoints", "second task"), { cwd });
    expect(second.code).toBe(0);
    expect(readFileSync(join(cwd, "counter.txt"), "utf8")).toBe("run\n");
    const sent = messagesOf(srv.requests.at(-1));
    expect(sent.find((m) => m.role === "tool")?.content).toStartWith("[SESSION RECOVERED]");
  });
});

// ---------------------------------------------------------------------------------------------

describe("the store's writes that do not wait (in-process)", () => {
  const warnings: string[] = [];
  const sink = { emit: (e: AgentEvent) => void (e.type === "warning" && warnings.push(e.text)) };
  const META = { model: "unit-model", apiBase: "http://127.0.0.1:9/v1" };
  const usage = { input_tokens: 0, output_tokens: 0, cached_tokens: 0, billable_tokens: 0 };
  const state = (n: number) => ({
    messages: [
      { role: "system" as const, content: "s" },
      ...Array.from({ length: n }, (_, i) => ({ role: "user" as const, content: `m${i}` })),
    ],
    stepCount: n,
    usage,
  });
  const onDisk = (file: string) => JSON.parse(readFileSync(file, "utf8"));
  const temporaries = (dir: string) => readdirSync(dir).filter((n) => n.endsWith(".tmp"));

  test("in order, the newest last; one waiting its turn is dropped; a write that waits drops them all", async () => {
    const dir = scratch();
    const file = join(dir, "s.aicsession");
    const store = SessionStore.claim(file, META, sink);
    try {
      // The first goes to the disk at once, the second waits its turn and gives way to the third.
      for (const n of [1, 2, 3]) expect(store.saveSoon(`soon_${n}`, state(n))).toBe(true);
      await store.inPlace();
      expect(onDisk(file)).toMatchObject({ reason: "soon_3", step_count: 3 });
      await store.settled();
      expect(temporaries(dir)).toEqual([]);

      // A write that waits for the disk comes after both: neither of them is ever put in place after it.
      store.saveSoon("soon_4", state(4));
      store.saveSoon("soon_5", state(5));
      const waited = state(6);
      expect(store.save("waited", waited)).toBe(true);
      expect(onDisk(file)).toMatchObject({ reason: "waited", step_count: 6 });
      await store.settled();
      expect(onDisk(file)).toMatchObject({ reason: "waited", step_count: 6 });
      expect(temporaries(dir)).toEqual([]);

      // Nothing new but the label and the step count (before_llm_call right after a result): not written.
      expect(store.save("before_llm_call", { ...waited, stepCount: 7 }, true)).toBe(true);
      expect(onDisk(file)).toMatchObject({ reason: "waited", step_count: 6 });
      // Something new (a steering message): written.
      waited.messages.push({ role: "user", content: "a steering message" });
      expect(store.save("before_llm_call", { ...waited, stepCount: 7 }, true)).toBe(true);
      expect(onDisk(file)).toMatchObject({ reason: "before_llm_call", step_count: 7 });
      expect(warnings).toEqual([]);
    } finally {
      store.release();
    }
  });
});
