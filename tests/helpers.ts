/**
 * The test kit: one version of each piece of plumbing the tests share. The end-to-end tests drive
 * the compiled dist/aic as a user or a CI job would, against the fake OpenAI server in this folder,
 * in real PTYs and real directories; nothing here mocks the PTY, the SDK or the file system.
 *
 * What the kit holds the tests to:
 * - A test waits on something it can observe (a JSON event on stdout, a line on stderr, a file, a
 *   request reaching the fake server), polled by `waitFor`; a timeout only stops a hung test.
 * - A run's result has no duration in it, so no test can assert on wall-clock time: speed is
 *   measured by the benchmarks in tests/bench.
 * - A test that needs a tool or a privilege the machine may lack skips itself where it is missing
 *   (`test.skipIf(!has.X)`), naming what it needs, so the runner reports a skip, not a failure.
 */
import { afterAll, afterEach } from "bun:test";
import { dlopen, FFIType } from "bun:ffi";
import { existsSync, mkdtempSync, readdirSync, readFileSync, realpathSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import type { Subprocess } from "bun";
import {
  startFakeServer,
  type FakeServer,
  type FakeServerOptions,
  type RecordedRequest,
  type Turn,
} from "./fake-openai.ts";

export const ROOT = resolve(import.meta.dir, "..");
export const AIC = join(ROOT, "dist", "aic");

// ---------------------------------------------------------------------------------------------
// What this machine offers

/**
 * The Landlock ABI version of the running kernel (0 when it has none), asked of the kernel
 * directly from this process (landlock_create_ruleset(NULL, 0, VERSION) is syscall 444 on every
 * architecture), independently of aic.
 */
export function kernelLandlockAbi(): number {
  if (process.platform !== "linux") return 0;
  try {
    const libc = dlopen("libc.so.6", {
      syscall: { args: [FFIType.i64, FFIType.i64, FFIType.i64, FFIType.i64], returns: FFIType.i64 },
    });
    try {
      return Math.max(0, Number(libc.symbols.syscall(444, 0, 0, 1)));
    } finally {
      libc.close();
    }
  } catch {
    return 0; // no glibc to ask: no Landlock as far as the tests can tell
  }
}

const onPath = (tool: string) => Bun.which(tool) !== null;

/**
 * Tools and privileges that some tests need. A test that needs one is written
 * `test.skipIf(!has.X)("…", …)` with the reason next to it, so that where it is missing the runner
 * reports a skip instead of a failure.
 */
export const has = {
  /** uid 0: mount namespaces (unshare --mount, mount), switching to another user (setpriv). */
  root: process.getuid?.() === 0,
  unshare: onPath("unshare"),
  setpriv: onPath("setpriv"),
  strace: onPath("strace"),
  tmux: onPath("tmux"),
  python3: onPath("python3"),
  node: onPath("node"),
  npm: onPath("npm"),
  git: onPath("git"),
  /** GNU time, whose -v report shares aic's output pipe. */
  usrBinTime: existsSync("/usr/bin/time"),
  /** The kernel offers Landlock, so aic's sandbox is on. */
  landlock: kernelLandlockAbi() > 0,
};

/** Whether this kernel lets aic build its jail: Landlock, util-linux unshare, and user namespaces that work. */
export const jailUsable =
  has.landlock &&
  has.unshare &&
  Bun.spawnSync(["unshare", "--user", "--map-current-user", "--mount", "--pid", "--fork", "true"]).exitCode === 0;

/** The unprivileged user the tests run aic as (through setpriv, from root). */
export const NOBODY = 65534;

/** Who runs aic in a test: a label, the uid, the argv prefix that switches to it, and whether this machine can. */
export interface TestUser {
  label: string;
  uid: number;
  wrap: string[];
  skip: boolean;
}

/** This process's user. */
export const THIS_USER: TestUser = {
  label: has.root ? "as root" : "as this user",
  uid: process.getuid?.() ?? 0,
  wrap: [],
  skip: false,
};

/** uid 65534, switched to with setpriv: needs root and setpriv. */
export const NOBODY_USER: TestUser = {
  label: "as uid 65534",
  uid: NOBODY,
  wrap: ["setpriv", `--reuid=${NOBODY}`, `--regid=${NOBODY}`, "--clear-groups", "--"],
  skip: !has.root || !has.setpriv,
};

// ---------------------------------------------------------------------------------------------
// Waiting

/** What a truthy value of type T can be. */
export type Truthy<T> = Exclude<T, false | null | undefined | 0 | "">;

/**
 * Polls `probe` every 20 ms until it returns something truthy, and returns that. The timeout only
 * stops a hung test (it fails naming `what`); it is never the thing a test asserts.
 */
export async function waitFor<T>(what: string, probe: () => T | Promise<T>, timeoutMs = 30_000): Promise<Truthy<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (value) return value as Truthy<T>;
    if (Date.now() > deadline) throw new Error(`gave up after ${timeoutMs / 1000} s waiting for ${what}`);
    await Bun.sleep(20);
  }
}

// ---------------------------------------------------------------------------------------------
// Running dist/aic (or anything else) as a user would

export interface AicRun {
  /** The exit code, or 128 + the signal's number when a signal ended the process. */
  code: number;
  stdout: string;
  stderr: string;
}

export interface AicOptions {
  /** Default: a fresh scratch directory. */
  cwd?: string;
  /** Text on standard input; without it standard input is /dev/null. */
  stdin?: string;
  /** Added to (or, with undefined, removed from) the clean environment of `cleanEnv`. */
  env?: Record<string, string | undefined>;
  /** SIGKILL after this long: a guard against a hung test, never an assertion (default 100 s). */
  killAfterMs?: number;
}

/** Directories made by `scratch`, removed after the test file (`reapAfterAll`), or at exit outside `bun test`. */
const scratchDirs: string[] = [];

/** Removes every directory `scratch` made so far. */
function removeScratchDirs(): void {
  for (const dir of scratchDirs.splice(0)) {
    try {
      rmSync(dir, { recursive: true, force: true });
    } catch {
      /* a test made it unremovable on purpose: leave it */
    }
  }
}
process.once("exit", removeScratchDirs); // bun test emits no "exit": reapAfterAll does it there

/** A fresh empty directory for one test, removed after its test file. */
export function scratch(prefix = "aic-test-"): string {
  const dir = realpathSync(mkdtempSync(join(tmpdir(), prefix)));
  scratchDirs.push(dir);
  return dir;
}

/** A name no other test or run uses, for files in shared places (/var/tmp, $HOME). */
export function unique(prefix = ""): string {
  return `${prefix}${process.pid}-${Math.random().toString(36).slice(2, 10)}`;
}

/**
 * Where the aic processes of a test file keep their checkpoints (the shadow repositories under
 * $XDG_STATE_HOME/aic), so the tests never fill the developer's own ~/.local/state. Made when
 * first needed, removed after the file (`reapAfterAll`): `bun test` emits no "exit" to clean up at.
 */
let stateHome: string | undefined;
export function testStateHome(): string {
  stateHome ??= mkdtempSync(join(tmpdir(), "aic-test-state-"));
  return stateHome;
}

/** Removes the state home, if one was made; the next test file gets a fresh one. */
function removeStateHome(): void {
  if (stateHome) rmSync(stateHome, { recursive: true, force: true });
  stateHome = undefined;
}
process.once("exit", removeStateHome); // outside `bun test` (the benchmarks)

/**
 * What npm adds to the environment of the scripts it runs (`npm test`): npm_config_cache and its
 * kind point every npm a test starts at the developer's own ~/.npm and settings, whatever $HOME the
 * test gives it. Never passed on: a test under `npm test` must see what it sees under `bun test`.
 */
const FROM_NPM = /^(npm_.*|INIT_CWD)$/i;
for (const name of Object.keys(process.env)) if (FROM_NPM.test(name)) delete process.env[name];

/**
 * The marker of this test run: every process the tests start carries `AIC_TEST_RUN=<it>` in its
 * environment (cleanEnv adds it; it is also in this process's own environment, for the aic that
 * tui.test.ts runs in-process and for plain Bun.spawn), and so does everything those processes
 * start. `reapAfterAll` finds leftovers by it, never by name.
 */
export const TEST_RUN_VAR = "AIC_TEST_RUN";
export const TEST_RUN = `${process.pid}-${Math.random().toString(36).slice(2, 12)}`;
process.env[TEST_RUN_VAR] = TEST_RUN;

/**
 * Environment without the developer's own model settings, npm's variables or a CI runner's CI=true, so tests see only
 * what they pass.
 */
export function cleanEnv(extra: Record<string, string | undefined> = {}): Record<string, string> {
  // The developer's own ~/.config/aic/config.toml never reaches a test: the config home is the (empty) state home.
  const env: Record<string, string> = { XDG_STATE_HOME: testStateHome(), XDG_CONFIG_HOME: testStateHome() };
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || /^(AIC_|OPENAI_|XDG_(STATE|CONFIG)_HOME$|CI$)/.test(k) || FROM_NPM.test(k)) continue;
    env[k] = v;
  }
  env[TEST_RUN_VAR] = TEST_RUN;
  for (const [k, v] of Object.entries(extra))
    if (v !== undefined) env[k] = v;
    else delete env[k];
  return env;
}

/** A process started in the background, its output collected as it comes. */
export interface Live {
  proc: Subprocess;
  /** What it has printed so far. */
  stdout(): string;
  stderr(): string;
  /** The JSON Lines events (`--json`) among the complete lines it has printed so far. */
  events(): any[];
  /** Whether it has exited. */
  exited(): boolean;
  /** Resolves once it has exited and both streams are drained. */
  done: Promise<AicRun>;
  /** Waits for the first JSON event that `match` accepts; fails at once, with the output, if the process exits first. */
  waitForEvent(what: string, match: (event: any) => boolean): Promise<any>;
}

/** Processes started by `startCommand` and not yet known to have exited; `perTestFixtures` kills leftovers. */
const running = new Set<Live>();

/** Starts `argv` with a clean environment in the background. */
export function startCommand(argv: string[], opts: AicOptions = {}): Live {
  const proc = Bun.spawn(argv, {
    cwd: opts.cwd ?? scratch(),
    env: cleanEnv(opts.env),
    stdin: opts.stdin === undefined ? "ignore" : new Blob([opts.stdin]),
    stdout: "pipe",
    stderr: "pipe",
  });
  const guard = setTimeout(() => proc.kill("SIGKILL"), opts.killAfterMs ?? 100_000);
  let out = "";
  let err = "";
  let finished = false;
  const pump = async (stream: ReadableStream<Uint8Array>, add: (s: string) => void) => {
    const decoder = new TextDecoder();
    for await (const chunk of stream) add(decoder.decode(chunk, { stream: true }));
  };
  const done = Promise.all([
    pump(proc.stdout, (s) => (out += s)),
    pump(proc.stderr, (s) => (err += s)),
    proc.exited,
  ]).then(([, , code]) => {
    clearTimeout(guard);
    finished = true;
    running.delete(live);
    return { code, stdout: out, stderr: err };
  });
  /** Waits for `probe` on the output; a process that ends first fails the wait with what it printed. */
  const waitForOutput = <T>(what: string, probe: () => T): Promise<Truthy<T>> =>
    waitFor(what, () => {
      const value = probe();
      if (!value && finished)
        throw new Error(
          `${argv[0]} exited (${proc.exitCode ?? proc.signalCode}) before ${what}\n--- stdout ---\n${out.slice(-3000)}\n--- stderr ---\n${err.slice(-3000)}`,
        );
      return value;
    });
  const events = () => jsonLines(out.slice(0, out.lastIndexOf("\n") + 1));
  const live: Live = {
    proc,
    stdout: () => out,
    stderr: () => err,
    events,
    exited: () => finished,
    done,
    waitForEvent: (what, match) => waitForOutput(what, () => events().find(match)),
  };
  running.add(live);
  return live;
}

/** Starts dist/aic in the background (behind `prefix`, a wrapper such as strace or unshare, when given). */
export function startAic(args: string[], opts: AicOptions & { prefix?: string[] } = {}): Live {
  return startCommand([...(opts.prefix ?? []), AIC, ...args], opts);
}

/** Runs `argv` with a clean environment to its end. */
export function runCommand(argv: string[], opts: AicOptions = {}): Promise<AicRun> {
  return startCommand(argv, opts).done;
}

/** Runs dist/aic to its end. */
export function runAic(args: string[], opts: AicOptions = {}): Promise<AicRun> {
  return runCommand([AIC, ...args], opts);
}

/** The usual flags for a headless run against `url`. */
export function headless(url: string, model = "test-model", ...more: string[]): string[] {
  return ["--nogui", "--api-base", url, "--model", model, ...more];
}

/** Parses JSON Lines output. */
export function jsonLines(text: string): any[] {
  return text
    .split("\n")
    .filter((l) => l.trim())
    .map((l) => JSON.parse(l));
}

/**
 * Every option named in the first column of the README's options table (`| option | default |
 * meaning |`), short forms included: what `--help` must list.
 */
export function documentedOptions(): string[] {
  const lines = readFileSync(join(ROOT, "README.md"), "utf8").split("\n");
  const header = lines.findIndex((l) => /^\|\s*option\s*\|\s*default\s*\|/.test(l));
  if (header < 0) throw new Error("README.md has no options table (| option | default | meaning |)");
  const options: string[] = [];
  for (const line of lines.slice(header + 2)) {
    if (!line.startsWith("|")) break;
    for (const m of (line.split("|")[1] ?? "").matchAll(/`(-{1,2}[A-Za-z][\w-]*)/g)) options.push(m[1]!);
  }
  return options;
}

/** The stderr line that reports the sandbox state (`Sandbox: on (…)` or `Sandbox: off (…)`). */
export function sandboxLine(stderr: string): string {
  return stderr.split("\n").find((l) => l.startsWith("Sandbox:")) ?? "";
}

/** Reads a stream line by line; `next()` gives undefined at its end. */
export function lineReader(stream: ReadableStream<Uint8Array>): {
  next(): Promise<string | undefined>;
  release(): void;
} {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let text = "";
  return {
    async next() {
      while (!text.includes("\n")) {
        const { value, done } = await reader.read();
        if (done) break;
        text += decoder.decode(value, { stream: true });
      }
      if (text === "") return undefined;
      const nl = text.includes("\n") ? text.indexOf("\n") : text.length;
      const line = text.slice(0, nl);
      text = text.slice(nl + 1);
      return line;
    },
    release: () => reader.releaseLock(),
  };
}

// ---------------------------------------------------------------------------------------------
// Processes seen through /proc

/** The fields of /proc/<pid>/stat after the command name (state first), or undefined once it is gone. */
function statFields(pid: number | string): string[] | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  } catch {
    return undefined;
  }
}

/** True while `pid` is a live (non-zombie) process. */
export function alive(pid: number): boolean {
  const fields = statFields(pid);
  return fields !== undefined && fields[0] !== "Z";
}

/** Whether any live (non-zombie) process is in process group `pgid`. */
export function groupAlive(pgid: number): boolean {
  return readdirSync("/proc").some((entry) => {
    if (!/^\d+$/.test(entry)) return false;
    const fields = statFields(entry);
    return fields !== undefined && Number(fields[2]) === pgid && fields[0] !== "Z";
  });
}

/**
 * The pid, as the tests see it, of a process a command knows as `inner` (`$$`, `$!`): in aic's jail commands have
 * a PID namespace of their own. Found among the live processes working in `cwd` whose innermost pid is `inner`
 * (outside a jail that is `inner` itself); undefined when there is none (gone already).
 */
export function hostPid(inner: number, cwd: string): number | undefined {
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const nspid = /^NSpid:\s*(.*)$/m
        .exec(readFileSync(`/proc/${entry}/status`, "utf8"))?.[1]
        ?.trim()
        .split(/\s+/);
      if (Number(nspid?.at(-1)) === inner && realpathSync(`/proc/${entry}/cwd`) === cwd && alive(Number(entry)))
        return Number(entry);
    } catch {
      /* gone, or not ours to read */
    }
  }
  return undefined;
}

/** SIGKILL to a whole process group, if it is still there. */
export function killGroup(pgid: number): void {
  try {
    process.kill(-pgid, "SIGKILL");
  } catch {
    /* already gone */
  }
}

/** Live processes other than this one whose environment carries this run's marker (TEST_RUN). */
export function markedProcesses(): number[] {
  const needle = `${TEST_RUN_VAR}=${TEST_RUN}`;
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    let environ: string;
    try {
      environ = readFileSync(`/proc/${entry}/environ`, "latin1");
    } catch {
      continue; // gone, or not ours to read
    }
    if (environ.split("\0").includes(needle) && alive(Number(entry))) found.push(Number(entry));
  }
  return found;
}

/**
 * SIGKILL to every live process that carries this run's marker (a job, a server or a daemon a
 * test's command left running), repeated until none is left, in case one forked in between.
 * Returns the pids it killed.
 */
export async function reapMarkedProcesses(): Promise<number[]> {
  const killed = new Set<number>();
  for (let round = 0; round < 100; round++) {
    const pids = killMarkedProcesses();
    if (pids.length === 0) break;
    for (const pid of pids) killed.add(pid);
    await Bun.sleep(20);
  }
  return [...killed];
}

/** One pass of `reapMarkedProcesses`: SIGKILL to each marked process alive now; returns their pids. */
function killMarkedProcesses(): number[] {
  return markedProcesses().filter((pid) => {
    try {
      process.kill(pid, "SIGKILL");
      return true;
    } catch {
      return false; // already gone
    }
  });
}
// Outside `bun test` (the benchmarks), at exit; bun test emits no "exit": reapAfterAll does it there.
process.once("exit", killMarkedProcesses);

/**
 * After the test file that calls it: kills what its tests' commands left running
 * (`reapMarkedProcesses`) and removes the directories `scratch` made and the state home. `perTestFixtures` calls it;
 * a file that does not use the fixtures calls it once at its top.
 */
export function reapAfterAll(): void {
  afterAll(async () => {
    await reapMarkedProcesses();
    removeScratchDirs();
    removeStateHome();
  });
}

/** Peak resident set (VmHWM) of `pid` in kB, or undefined once the process (or its memory map) is gone. */
export function readPeakRssKb(pid: number): number | undefined {
  try {
    const match = /^VmHWM:\s+(\d+)\s+kB/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"));
    return match ? Number(match[1]) : undefined;
  } catch {
    return undefined;
  }
}

/**
 * git as the test harness runs it (outside aic, as root or this user, on directories another user may own), with
 * a committer of its own; its trimmed output. A failure throws with git's words.
 */
export function harnessGit(cwd: string, ...args: string[]): string {
  const r = Bun.spawnSync(["git", "-c", "safe.directory=*", ...args], {
    cwd,
    env: {
      ...process.env,
      GIT_AUTHOR_NAME: "t",
      GIT_AUTHOR_EMAIL: "t@t",
      GIT_COMMITTER_NAME: "t",
      GIT_COMMITTER_EMAIL: "t@t",
    },
  });
  if (r.exitCode !== 0) throw new Error(`git ${args.join(" ")}: ${r.stderr.toString()}`);
  return r.stdout.toString().trim();
}

// ---------------------------------------------------------------------------------------------
// Scripting the fake model and reading what it was sent

/** A tool-call turn that runs one command. */
export function bash(command: string, id?: string) {
  return { toolCalls: [{ id, arguments: JSON.stringify({ command }) }] };
}

/** A scripted HTTP error response. */
export function httpError(status: number, body: unknown, headers?: Record<string, string>): Turn {
  return { type: "http_error", status, body, headers };
}

/** One entry of an assistant message's `tool_calls`, as aic keeps it in its history and session file. */
export function toolCall(id: string, command = "true") {
  return { id, type: "function" as const, function: { name: "execute_bash", arguments: JSON.stringify({ command }) } };
}

/** The messages of a recorded request ([] when there is none). */
export function messagesOf(req: RecordedRequest | undefined): any[] {
  return req?.body?.messages ?? [];
}

/** The content of the tool message answering call `id` in request `req` ("" when there is none). */
export function toolAnswer(req: RecordedRequest | undefined, id: string): string {
  return String(messagesOf(req).find((m) => m.role === "tool" && m.tool_call_id === id)?.content ?? "");
}

/** The contents of every tool message in the server's last request, which holds the whole conversation. */
export function toolResults(srv: { requests: RecordedRequest[] }): string[] {
  return messagesOf(srv.requests.at(-1))
    .filter((m) => m.role === "tool")
    .map((m) => String(m.content));
}

/**
 * Why `messages` would be refused as an OpenAI chat request, as readable strings (empty when it
 * is valid): one system message and it comes first; known roles only; no two assistant messages
 * in a row; every tool message answers a call of the assistant message right before its run of
 * tool messages, once; every assistant call is answered before the next non-tool message (or the
 * end). This is what aic promises about every request it sends.
 */
export function requestSequenceProblems(messages: any[]): string[] {
  const problems: string[] = [];
  if (messages[0]?.role !== "system") problems.push(`[0] is ${messages[0]?.role}, not system`);
  let open: Set<string> | undefined; // ids of the current assistant turn's calls not yet answered
  let answered = new Set<string>();
  messages.forEach((m, i) => {
    if (!["system", "user", "assistant", "tool"].includes(m?.role)) problems.push(`[${i}] unknown role ${m?.role}`);
    if (m.role === "system" && i > 0) problems.push(`[${i}] a second system message`);
    if (m.role === "tool") {
      if (!open) problems.push(`[${i}] tool message ${m.tool_call_id} without an assistant call right before it`);
      else if (answered.has(m.tool_call_id))
        problems.push(`[${i}] tool message ${m.tool_call_id} answers a call twice`);
      else if (!open.has(m.tool_call_id))
        problems.push(`[${i}] tool message ${m.tool_call_id} answers no call of the preceding assistant`);
      else {
        open.delete(m.tool_call_id);
        answered.add(m.tool_call_id);
      }
      return;
    }
    if (open?.size) problems.push(`[${i}] ${m.role} message before call(s) ${[...open].join(", ")} were answered`);
    if (m.role === "assistant" && messages[i - 1]?.role === "assistant")
      problems.push(`[${i}] two assistant messages in a row`);
    open = m.role === "assistant" && m.tool_calls?.length ? new Set(m.tool_calls.map((c: any) => c.id)) : undefined;
    answered = new Set();
  });
  if (open?.size) problems.push(`end: call(s) ${[...open].join(", ")} never answered`);
  return problems;
}

/**
 * Why a history loaded from a session file (whatever was in the file) would be refused by the API
 * or lose track of a command, or [] if it is fine: it is a list of messages (objects with a string
 * role); the system prompt comes first; `tool_calls`, where present, is a list of calls with string
 * ids (anything else can be neither answered nor sent); each tool message answers a call of the
 * assistant message before it; every such call is answered. Looser than
 * `requestSequenceProblems`: two assistant messages in a row and roles the API does not know may
 * stay in the history (aic merges or drops them when it sends it), and a trailing assistant
 * message without tool calls is the model's last answer, kept on purpose.
 */
export function loadedHistoryProblems(messages: unknown): string[] {
  if (!Array.isArray(messages)) return ["messages is not a list"];
  const problems: string[] = [];
  messages.forEach((m, i) => {
    if (typeof m !== "object" || m === null || Array.isArray(m) || typeof (m as any).role !== "string")
      problems.push(`[${i}] is not a message`);
  });
  if (problems.length) return problems;
  if (messages[0]?.role !== "system") problems.push("the first message is not the system prompt");
  messages.forEach((m: any, i) => {
    if (m.tool_calls === undefined || m.tool_calls === null) return;
    if (
      !Array.isArray(m.tool_calls) ||
      !m.tool_calls.every((c: any) => typeof c === "object" && c !== null && typeof c.id === "string")
    )
      problems.push(`[${i}] tool_calls is not a list of calls with ids: ${JSON.stringify(m.tool_calls)}`);
  });
  let open = new Set<unknown>();
  messages.forEach((m: any, i) => {
    if (m.role === "tool") {
      if (!open.has(m.tool_call_id))
        problems.push(`[${i}] tool message answers no call of the preceding assistant message`);
      open.delete(m.tool_call_id);
      return;
    }
    if (open.size) problems.push(`call(s) ${[...open].join(", ")} before [${i}] have no answer`);
    open = new Set(
      m.role === "assistant" && Array.isArray(m.tool_calls)
        ? m.tool_calls.map((c: any) => c?.id).filter((id: unknown) => typeof id === "string")
        : [],
    );
  });
  if (open.size) problems.push(`call(s) ${[...open].join(", ")} at the end have no answer`);
  return problems;
}

// ---------------------------------------------------------------------------------------------
// Per-test fixtures

/**
 * Fake servers, scratch paths and background processes opened by the tests of one file: closed,
 * removed and killed after each test whatever happens, so a failing test leaves nothing behind;
 * after the file, whatever its commands left running is killed and its scratch directories are
 * removed (`reapAfterAll`). Call it once at the top of a test file.
 */
export function perTestFixtures() {
  reapAfterAll();
  const servers: FakeServer[] = [];
  const paths: string[] = [];
  afterEach(() => {
    for (const live of [...running]) if (!live.exited()) live.proc.kill("SIGKILL");
    for (const s of servers.splice(0)) s.close();
    for (const p of paths.splice(0)) rmSync(p, { recursive: true, force: true });
  });
  const fixtures = {
    serve(turns: NonNullable<FakeServerOptions["turns"]>, options: Omit<FakeServerOptions, "turns"> = {}): FakeServer {
      const srv = startFakeServer({ ...options, turns });
      servers.push(srv);
      return srv;
    },
    /** `path`, removed after the test. */
    disposable(path: string): string {
      paths.push(path);
      return path;
    },
    /** A fresh directory under /var/tmp (outside the sandbox's writable /tmp), removed after the test. */
    varTmp(prefix: string): string {
      return fixtures.disposable(realpathSync(mkdtempSync(`/var/tmp/${prefix}`)));
    },
  };
  return fixtures;
}

// ---------------------------------------------------------------------------------------------
// Terminals

/** The bottom line of a screen or frame: the TUI's status footer. */
export function footer(screen: string): string {
  return screen.trimEnd().split("\n").at(-1) ?? "";
}

/**
 * One detached tmux session on a private server socket, so tests can run in parallel; `kill()`
 * ends it. Needs tmux (`has.tmux`).
 */
export class Tmux {
  readonly socket = unique("aic-test-");
  readonly target = "aic:0.0";
  private readonly socketPath: string;

  constructor(env: Record<string, string>, cwd: string, command: string[], size = { width: 120, height: 40 }) {
    // -f /dev/null: the developer's ~/.tmux.conf must not change key handling or the size.
    this.run(
      [
        "-f",
        "/dev/null",
        "new-session",
        "-d",
        "-s",
        "aic",
        "-x",
        String(size.width),
        "-y",
        String(size.height),
        "-c",
        cwd,
        ...command,
      ],
      env,
    );
    this.socketPath = this.display("#{socket_path}");
  }

  run(args: string[], env = cleanEnv()): string {
    const r = Bun.spawnSync(["tmux", "-L", this.socket, ...args], { env, stdout: "pipe", stderr: "pipe" });
    if (r.exitCode !== 0) throw new Error(`tmux ${args.join(" ")} failed (${r.exitCode}): ${r.stderr.toString()}`);
    return r.stdout.toString();
  }

  /** Named keys (Enter, Tab, C-c) or single characters. */
  keys(...keys: string[]): void {
    this.run(["send-keys", "-t", this.target, ...keys]);
  }

  /** Text typed as-is, character by character. */
  type(text: string): void {
    this.run(["send-keys", "-t", this.target, "-l", text]);
  }

  screen(): string {
    return this.run(["capture-pane", "-p", "-t", this.target]);
  }

  display(format: string): string {
    return this.run(["display-message", "-p", "-t", this.target, format]).trim();
  }

  /** Polls the screen until `check` holds and returns it; on timeout fails with what was on screen. */
  async waitFor(what: string, check: (screen: string) => boolean, timeoutMs = 30_000): Promise<string> {
    let screen = "";
    try {
      return await waitFor(what, () => ((screen = this.screen()), check(screen) && screen), timeoutMs);
    } catch (error) {
      throw new Error(`${(error as Error).message}; the screen was:\n${screen}`);
    }
  }

  /** Ends the server (its panes get SIGHUP) and removes the socket file it leaves behind. */
  kill(): void {
    Bun.spawnSync(["tmux", "-L", this.socket, "kill-server"], { stdout: "ignore", stderr: "ignore" });
    rmSync(this.socketPath, { force: true });
  }
}
