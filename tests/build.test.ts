/**
 * Tests of the built executable (README: "Install and build", "Usage", and the `aic search`
 * subcommand):
 * dist/aic is one file that runs with no node_modules anywhere — tiktoken's WASM and
 * @xterm/headless embedded — from any directory, prints its version and help, and fails a web
 * search cleanly when there is no network.
 *
 * node_modules is hidden by mounting an empty tmpfs over it inside a private mount namespace
 * (`unshare --mount`, which needs root here); the fake OpenAI server stays in this process,
 * outside the namespace, and is reached over loopback.
 */
import { describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { countPromptTokens, type FakeServer, type Turn } from "./fake-openai.ts";
import {
  AIC,
  ROOT,
  bash,
  documentedOptions,
  has,
  headless,
  messagesOf,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolAnswer,
  type AicRun,
} from "./helpers.ts";

const NODE_MODULES = join(ROOT, "node_modules");

const fixtures = perTestFixtures();
// inflation 1: the server reports exactly the tiktoken count, so aic's calibrated estimate must equal it.
const serve = (turns: Turn[]): FakeServer => fixtures.serve(turns, { inflation: 1 });

/**
 * Runs `argv` in `cwd` inside a private mount namespace where ROOT/node_modules is an empty
 * tmpfs. The shell checks the directory really is empty before exec'ing, and exits 97 if not.
 */
function runWithoutNodeModules(argv: string[], cwd: string): Promise<AicRun> {
  const script = 'mount -t tmpfs none "$1" && [ -z "$(ls -A "$1")" ] || exit 97; cd "$2" && shift 2 && exec "$@"';
  return runCommand(["unshare", "--mount", "sh", "-c", script, "sh", NODE_MODULES, cwd, ...argv]);
}

/** Two steps: a command whose colour codes and carriage return only a terminal emulator renders, then done. */
const colourTask = (): Turn[] => [
  bash(String.raw`printf '\033[1;31mRED\033[0m-text\rX\n'`, "call_colour"),
  { content: "TASKCOMPLETE" },
];
/** What a person sees on the terminal for that command: X overwrites the R. */
const COLOUR_RENDERED = "XED-text";

// Hiding node_modules needs a private mount namespace: root and unshare. Without them these tests
// are skipped (the embedded-files test below still checks the binary on any machine).
describe.skipIf(!has.root || !has.unshare)("standalone executable", () => {
  // Precondition of the tests below: a private mount namespace can hide node_modules from aic.
  test("unshare --mount hides node_modules (needs root)", async () => {
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
    const run = await runWithoutNodeModules(
      [AIC, ...headless(srv.url, "test-model", "--auto-approve", "--debug"), "colour"],
      cwd,
    );

    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(2);

    const answer = toolAnswer(srv.requests.at(-1), "call_colour");
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain(COLOUR_RENDERED);
    expect(answer).not.toContain("\x1b");
    expect(answer).not.toContain("\r");

    // The debug dump before the second call holds aic's calibrated tiktoken estimate, which with
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

    const run = await runWithoutNodeModules(
      [copy, ...headless(srv.url, "test-model", "--auto-approve", "--no-session"), "echo"],
      "/",
    );
    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    const answer = toolAnswer(srv.requests.at(-1), "call_echo");
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain("standalone-42");
    expect(answer).toMatch(/^\/$/m);
  });
});

// What makes it standalone, checked on any machine: the files aic loads at run time are inside the
// executable, byte for byte. (The binary's size is a figure, not a fact to assert: the cold-start
// benchmark reports it, `bun run tests/bench/run.ts cold-start`.)
test("dist/aic holds tiktoken's WASM and its o200k_base table byte for byte", () => {
  const binary = readFileSync(AIC);
  for (const file of ["tiktoken/lite/tiktoken_bg.wasm", "tiktoken/encoders/o200k_base.json"]) {
    const bytes = readFileSync(join(NODE_MODULES, file));
    expect(bytes.length).toBeGreaterThan(100_000);
    expect({ file, embedded: binary.indexOf(bytes) >= 0 }).toEqual({ file, embedded: true });
  }
});

describe("--version and --help", () => {
  test("--version prints aic <semver> and exits 0", async () => {
    const run = await runAic(["--version"]);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/^aic \d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?\n$/);
    expect(run.stdout.trim()).toBe(`aic ${JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")).version}`);
  });

  // Every option of the README's options table is listed, and each numeric default sits on its own flag's line.
  test("--help lists every flag and the documented defaults", async () => {
    const run = await runAic(["--help"]);
    expect(run.code).toBe(0);
    const help = run.stdout;
    const flags = documentedOptions();
    expect(flags.length).toBeGreaterThanOrEqual(21);
    for (const flag of flags) expect(help).toMatch(new RegExp(`(^|\\s)${flag}(\\s|=|,|$)`, "m"));

    // A flag's entry: its line and the lines under it that continue its meaning (indented to the second column).
    const lines = help.split("\n");
    const lineOf = (flag: string) => {
      const at = lines.findIndex((l) => new RegExp(`^\\s*${flag}(\\s|=|$)`).test(l));
      if (at < 0) return "";
      const entry = [lines[at]!];
      for (let i = at + 1; i < lines.length && /^ {29}\S/.test(lines[i]!); i++) entry.push(lines[i]!);
      return entry.join(" ");
    };
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

describe("--help in a terminal 80 columns wide", () => {
  // Each line fits, so nothing wraps in the middle of a word; a wrapped meaning stays under its own column.
  test("no line of --help is longer than 80 characters, and every flag still starts a line", async () => {
    const run = await runAic(["--help"]);
    expect(run.code).toBe(0);
    const lines = run.stdout.trimEnd().split("\n");
    expect(lines.filter((l) => [...l].length > 80)).toEqual([]);
    for (const flag of documentedOptions())
      expect(
        lines.some((l) => new RegExp(`^  (-\\w, )?${flag}(\\s|,|$)`).test(l)),
        flag,
      ).toBe(true);
    expect(lines.filter((l) => /^ +\S/.test(l) && !/^  \S/.test(l) && !/^ {29}\S/.test(l))).toEqual([]);
  });
});

describe("aic search without network", () => {
  // No route to DuckDuckGo here: one clear error line, exit 1, no hang (a hang would meet the 60 s
  // guard's SIGKILL, exit 137, instead of aic's own 1).
  test("fails with one 'aic search: error:' line on stderr and exit 1", async () => {
    const run = await runAic(["search", "x"], { killAfterMs: 60_000 });
    expect(run.stderr.trimEnd().split("\n")).toEqual([expect.stringMatching(/^aic search: error: \S/)]);
    expect(run.stdout).toBe("");
    expect(run.code).toBe(1);
  }, 70_000);

  // A missing query is a usage error.
  test("no query exits 2", async () => {
    const run = await runAic(["search"]);
    expect(run.code).toBe(2);
    expect(run.stderr).toMatch(/^aic: error: .*query/);
  });
});

// The program and its tests type-check under `strict` (tsconfig.json), with no unused locals.
// TypeScript's compiler runs under the Bun that runs the tests, so the check needs no Node.js.
test("aic.ts and the tests type-check", () => {
  const tsc = Bun.spawnSync(
    [process.execPath, join(NODE_MODULES, "typescript", "lib", "tsc.js"), "--noEmit", "-p", ROOT],
    {
      stdout: "pipe",
      stderr: "pipe",
    },
  );
  expect(tsc.stdout.toString() + tsc.stderr.toString()).toBe("");
  expect(tsc.exitCode).toBe(0);
}, 120_000);

// The file's header is its map: every section's title, in the order the file holds them (see the header of aic.ts).
test("the header of aic.ts names every section, in order, by its title", () => {
  const source = readFileSync(join(ROOT, "aic.ts"), "utf8");
  const lines = source.split("\n");
  const titles = lines.flatMap((line, i) =>
    line.startsWith("// ════") && /^\/\/ [A-Z]/.test(lines[i + 1] ?? "") ? [lines[i + 1]!.slice(3)] : [],
  );
  expect(titles.length).toBeGreaterThan(40);
  const header = source.slice(0, source.indexOf("*/")).replace(/\n \*\s*/g, " ");
  const named = header
    .slice(header.indexOf(titles[0]!))
    .split(" → ")
    .map((t) => t.trim());
  named[named.length - 1] = named.at(-1)!.split(" ")[0]!; // the map's last entry ends where the next sentence starts
  expect(named.slice(0, titles.length)).toEqual(titles);
});
