/**
 * Shared plumbing for the end-to-end tests: they drive the compiled dist/aic
 * as a user or a CI job would, against the fake OpenAI server in this folder.
 */
import { afterEach } from "bun:test";
import { mkdtempSync, realpathSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { startFakeServer, type FakeServer, type FakeServerOptions } from "./fake-openai.ts";

export const ROOT = resolve(import.meta.dir, "..");
export const AIC = join(ROOT, "dist", "aic");

export interface AicRun {
  code: number;
  stdout: string;
  stderr: string;
  ms: number;
}

export interface AicOptions {
  cwd?: string;
  stdin?: string | "inherit-null";
  env?: Record<string, string | undefined>;
  /** Kill the process after this long (a guard against hangs, not an assertion). */
  killAfterMs?: number;
}

/** A fresh empty directory for one test. */
export function scratch(prefix = "aic-test-"): string {
  return realpathSync(mkdtempSync(join(tmpdir(), prefix)));
}

/** Environment without the developer's own model settings, so tests see only what they pass. */
export function cleanEnv(extra: Record<string, string | undefined> = {}): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || /^(AIC_|OPENAI_)/.test(k)) continue;
    env[k] = v;
  }
  for (const [k, v] of Object.entries(extra)) if (v !== undefined) env[k] = v;
  return env;
}

export async function runAic(args: string[], opts: AicOptions = {}): Promise<AicRun> {
  const started = performance.now();
  const proc = Bun.spawn([AIC, ...args], {
    cwd: opts.cwd ?? scratch(),
    env: cleanEnv(opts.env),
    stdin: opts.stdin === undefined ? "ignore" : new Blob([opts.stdin]),
    stdout: "pipe",
    stderr: "pipe",
  });
  const guard = setTimeout(() => proc.kill("SIGKILL"), opts.killAfterMs ?? 100_000);
  const [stdout, stderr, code] = await Promise.all([new Response(proc.stdout).text(), new Response(proc.stderr).text(), proc.exited]);
  clearTimeout(guard);
  return { code, stdout, stderr, ms: performance.now() - started };
}

/** The usual flags for a headless run against `url`. */
export function headless(url: string, model = "test-model", ...more: string[]): string[] {
  return ["--nogui", "--api-base", url, "--model", model, ...more];
}

/** A tool-call turn that runs one command. */
export function bash(command: string, id?: string) {
  return { toolCalls: [{ id, arguments: JSON.stringify({ command }) }] };
}

/** Parses JSON Lines output. */
export function jsonLines(text: string): any[] {
  return text
    .split("\n")
    .filter((l) => l.trim())
    .map((l) => JSON.parse(l));
}

/**
 * What makes `messages` an invalid OpenAI chat sequence, as readable strings (empty when valid):
 * one system message and it comes first; no two assistant messages in a row; every tool message
 * answers a call of the assistant message right before its run of tool messages, once; every
 * assistant call is answered before the next non-tool message (or the end).
 */
export function sequenceProblems(messages: any[]): string[] {
  const problems: string[] = [];
  if (messages[0]?.role !== "system") problems.push(`[0] is ${messages[0]?.role}, not system`);
  let open: Set<string> | undefined; // ids of the current assistant turn's calls not yet answered
  let answered = new Set<string>();
  messages.forEach((m, i) => {
    if (!["system", "user", "assistant", "tool"].includes(m?.role)) problems.push(`[${i}] unknown role ${m?.role}`);
    if (m.role === "system" && i > 0) problems.push(`[${i}] a second system message`);
    if (m.role === "tool") {
      if (!open) problems.push(`[${i}] tool message ${m.tool_call_id} without an assistant call right before it`);
      else if (answered.has(m.tool_call_id)) problems.push(`[${i}] tool message ${m.tool_call_id} answers a call twice`);
      else if (!open.has(m.tool_call_id)) problems.push(`[${i}] tool message ${m.tool_call_id} answers no call of the preceding assistant`);
      else {
        open.delete(m.tool_call_id);
        answered.add(m.tool_call_id);
      }
      return;
    }
    if (open?.size) problems.push(`[${i}] ${m.role} message before call(s) ${[...open].join(", ")} were answered`);
    if (m.role === "assistant" && messages[i - 1]?.role === "assistant") problems.push(`[${i}] two assistant messages in a row`);
    open = m.role === "assistant" && m.tool_calls?.length ? new Set(m.tool_calls.map((c: any) => c.id)) : undefined;
    answered = new Set();
  });
  if (open?.size) problems.push(`end: call(s) ${[...open].join(", ")} never answered`);
  return problems;
}

/**
 * Fake servers and scratch paths opened by the tests of one file, closed and
 * removed after each test whatever happens, so a failing test leaves nothing behind.
 */
export function perTestFixtures() {
  const servers: FakeServer[] = [];
  const paths: string[] = [];
  afterEach(() => {
    for (const s of servers.splice(0)) s.close();
    for (const p of paths.splice(0)) rmSync(p, { recursive: true, force: true });
  });
  return {
    serve(turns: NonNullable<FakeServerOptions["turns"]>, options: Omit<FakeServerOptions, "turns"> = {}): FakeServer {
      const srv = startFakeServer({ ...options, turns });
      servers.push(srv);
      return srv;
    },
    disposable(path: string): string {
      paths.push(path);
      return path;
    },
  };
}

/**
 * The Landlock ABI version of the running kernel (0 when it has none), asked
 * of the kernel directly (landlock_create_ruleset(NULL, 0, VERSION) is
 * syscall 444), independently of aic.
 */
export function kernelLandlockAbi(): number {
  const probe = Bun.spawnSync(["python3", "-c", "import ctypes; print(ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1))"]);
  const out = probe.stdout.toString().trim();
  if (probe.exitCode !== 0 || !/^-?\d+$/.test(out)) throw new Error(`cannot ask the kernel for its Landlock ABI: ${probe.stderr.toString() || out}`);
  return Math.max(0, Number(out));
}
