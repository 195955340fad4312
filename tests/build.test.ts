/**
 * Tests of the built executable (SPEC §11 build, §1 command line, the `aic search` subcommand):
 * dist/aic is one file that runs with no node_modules anywhere — tiktoken's WASM and
 * @xterm/headless embedded — from any directory, prints its version and help, and fails a web
 * search cleanly when there is no network.
 *
 * node_modules is hidden by mounting an empty tmpfs over it inside a private mount namespace
 * (`unshare --mount`, which needs root here); the fake OpenAI server stays in this process,
 * outside the namespace, and is reached over loopback.
 */
import { describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { countPromptTokens, type FakeServer, type RecordedRequest, type Turn } from "./fake-openai.ts";
import { AIC, ROOT, bash, cleanEnv, headless, perTestFixtures, runAic, scratch, type AicRun } from "./helpers.ts";

const NODE_MODULES = join(ROOT, "node_modules");

const fixtures = perTestFixtures();
// inflation 1: the server reports exactly the tiktoken count, so aic's calibrated estimate must equal it.
const serve = (turns: Turn[]): FakeServer => fixtures.serve(turns, { inflation: 1 });

const messagesOf = (req: RecordedRequest | undefined): any[] => req?.body?.messages ?? [];
const toolAnswer = (srv: FakeServer, id: string): string =>
  messagesOf(srv.requests.at(-1)).find((m) => m.role === "tool" && m.tool_call_id === id)?.content ?? "";

/**
 * Runs `argv` in `cwd` inside a private mount namespace where ROOT/node_modules is an empty
 * tmpfs. The shell checks the directory really is empty before exec'ing, and exits 97 if not.
 */
async function runWithoutNodeModules(argv: string[], cwd: string): Promise<AicRun> {
  const started = performance.now();
  const script = 'mount -t tmpfs none "$1" && [ -z "$(ls -A "$1")" ] || exit 97; cd "$2" && shift 2 && exec "$@"';
  const proc = Bun.spawn(["unshare", "--mount", "sh", "-c", script, "sh", NODE_MODULES, cwd, ...argv], {
    env: cleanEnv(),
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
  });
  const guard = setTimeout(() => proc.kill("SIGKILL"), 100_000);
  const [stdout, stderr, code] = await Promise.all([new Response(proc.stdout).text(), new Response(proc.stderr).text(), proc.exited]);
  clearTimeout(guard);
  return { code, stdout, stderr, ms: performance.now() - started };
}

/** Two steps: a command whose colour codes and carriage return only a terminal emulator renders, then done. */
const colourTask = (): Turn[] => [bash(String.raw`printf '\033[1;31mRED\033[0m-text\rX\n'`, "call_colour"), { content: "TASKCOMPLETE" }];
/** What a person sees on the terminal for that command: X overwrites the R. */
const COLOUR_RENDERED = "XED-text";

describe("standalone executable (SPEC §11)", () => {
  // Precondition of the tests below: a private mount namespace can hide node_modules from aic.
  test("unshare --mount hides node_modules (needs root)", async () => {
    expect(Bun.which("unshare")).not.toBeNull();
    expect(process.getuid?.()).toBe(0);
    const probe = await runWithoutNodeModules(["ls", "-A", NODE_MODULES], "/tmp");
    expect(probe.code).toBe(0);
    expect(probe.stdout).toBe("");
    // ...while outside the namespace it is untouched.
    expect(existsSync(join(NODE_MODULES, "tiktoken"))).toBe(true);
  });

  test("--version runs with node_modules hidden", async () => {
    const run = await runWithoutNodeModules([AIC, "--version"], "/tmp");
    expect(run.stderr).toBe("");
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/^aic \d+\.\d+\.\d+\S*\n$/);
  });

  // tiktoken (counting every step, WASM embedded) and @xterm/headless (rendering output) both load
  // from inside the binary: the estimate equals the server's tiktoken count, and the model gets
  // the rendered screen, not escape codes.
  test("a headless task with node_modules hidden counts tokens with tiktoken and renders output with xterm", async () => {
    const srv = serve(colourTask());
    const cwd = scratch();
    const run = await runWithoutNodeModules([AIC, ...headless(srv.url, "test-model", "--auto-approve", "--debug"), "colour"], cwd);

    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(2);

    const answer = toolAnswer(srv, "call_colour");
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain(COLOUR_RENDERED);
    expect(answer).not.toContain("\x1b");
    expect(answer).not.toContain("\r");

    // §5: the debug dump before the second call holds aic's calibrated tiktoken estimate, which with
    // inflation 1 equals the server's own o200k_base count of the same messages.
    const dump = readFileSync(join(cwd, "commander-debug.txt"), "utf8");
    const estimate = Number(/^estimated_tokens: (\d+)$/m.exec(dump)?.[1]);
    expect(estimate).toBe(countPromptTokens(messagesOf(srv.requests[1])));
  });

  // One file, nothing beside it: a copy elsewhere runs a task from `/` with node_modules hidden.
  test("a copy of the binary in another directory runs a task from cwd /", async () => {
    const dir = scratch("aic-standalone-");
    fixtures.disposable(dir);
    const copy = join(dir, "aic");
    copyFileSync(AIC, copy);
    const srv = serve([bash("echo standalone-$((6*7)) && pwd", "call_echo"), { content: "TASKCOMPLETE" }]);

    const version = await runWithoutNodeModules([copy, "--version"], "/");
    expect(version.code).toBe(0);
    expect(version.stdout).toStartWith("aic ");

    const run = await runWithoutNodeModules([copy, ...headless(srv.url, "test-model", "--auto-approve", "--no-session"), "echo"], "/");
    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    const answer = toolAnswer(srv, "call_echo");
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain("standalone-42");
    expect(answer).toMatch(/^\/$/m);
  });

  test("binary size (reported, not asserted)", () => {
    const bytes = statSync(AIC).size;
    console.log(`dist/aic: ${bytes} bytes (${(bytes / 1024 / 1024).toFixed(1)} MiB)`);
    expect(bytes).toBeGreaterThan(0);
  });
});

describe("--version and --help (SPEC §1)", () => {
  test("--version prints aic <semver> and exits 0", async () => {
    const run = await runAic(["--version"]);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/^aic \d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?\n$/);
    expect(run.stdout.trim()).toBe(`aic ${JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")).version}`);
  });

  // Every option of the §1 table is listed, and each numeric default sits on its own flag's line.
  test("--help lists every flag and the documented defaults", async () => {
    const run = await runAic(["--help"]);
    expect(run.code).toBe(0);
    const help = run.stdout;
    const flags = [
      "--api-base", "--model", "--api-key", "--auto-approve", "--no-thinking", "--timeout", "--max-prompt-len",
      "--max-output-bytes", "--max-steps", "--debug", "--nogui", "--session", "--no-session", "--disable-sandbox",
      "--compress-alg", "--compress-target", "--fast", "--reasoning-effort", "--json", "--version", "--help",
    ];
    for (const flag of flags) expect(help).toMatch(new RegExp(`(^|\\s)${flag}(\\s|=|$)`, "m"));

    const lineOf = (flag: string) => help.split("\n").find((l) => new RegExp(`^\\s*${flag}(\\s|=)`).test(l)) ?? "";
    const defaults: Record<string, string> = {
      "--timeout": "120",
      "--max-prompt-len": "80000",
      "--max-output-bytes": "10240",
      "--max-steps": "500",
      "--compress-target": "0.4",
    };
    for (const [flag, value] of Object.entries(defaults)) {
      expect(lineOf(flag)).toMatch(new RegExp(`\\b${value.replace(".", "\\.")}\\b`));
    }
  });
});

describe("aic search without network", () => {
  // No route to DuckDuckGo here: one clear error line, exit 1, no hang.
  test("fails with one 'aic search: error:' line on stderr and exit 1", async () => {
    const run = await runAic(["search", "x"], { killAfterMs: 60_000 });
    expect(run.stderr.trimEnd().split("\n")).toEqual([expect.stringMatching(/^aic search: error: \S/)]);
    expect(run.stdout).toBe("");
    expect(run.code).toBe(1);
    expect(run.ms).toBeLessThan(40_000);
  }, 70_000);

  // §1: a missing query is a usage error.
  test("no query exits 2", async () => {
    const run = await runAic(["search"]);
    expect(run.code).toBe(2);
    expect(run.stderr).toMatch(/^aic: error: .*query/);
  });
});

// The program and its tests type-check under `strict` (tsconfig.json), with no unused locals.
test("aic.ts and the tests type-check", () => {
  const tsc = Bun.spawnSync([join(ROOT, "node_modules", ".bin", "tsc"), "--noEmit", "-p", ROOT], { stdout: "pipe", stderr: "pipe" });
  expect(tsc.stdout.toString() + tsc.stderr.toString()).toBe("");
  expect(tsc.exitCode).toBe(0);
}, 120_000);
