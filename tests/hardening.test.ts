/**
 * Failure modes found in review: each test pins one way aic could hang, lose
 * output or a file, leak the API key, or let a command out of the sandbox.
 */
import { describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, mkdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  AIC,
  bash,
  has,
  headless,
  jsonLines,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  startAic,
  toolAnswer,
  toolResults,
  unique,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();

describe("standard input", () => {
  // A task read with `-` from a file uses stdin up: its lines must not answer approval prompts.
  test("a request read with - never answers an approval; the run exits 4", async () => {
    const dir = scratch();
    writeFileSync(join(dir, "task.md"), "first paragraph\n\nsecond paragraph\ny\n");
    const srv = fixtures.serve([bash("touch ran.txt")]);
    const { stderr, code } = await runCommand(
      ["sh", "-c", `exec ${AIC} --nogui --api-base ${srv.url} --model m - < task.md`],
      {
        cwd: dir,
      },
    );
    expect(code).toBe(4);
    expect(stderr).toContain("--auto-approve");
    expect(existsSync(join(dir, "ran.txt"))).toBe(false);
    expect(srv.requests[0]!.body.messages[1].content).toBe("first paragraph\n\nsecond paragraph\ny");
  });

  // A slow reader of aic's stdout (a CI log pipe) must still get every line, with plain \n endings.
  test("output to a slow pipe is complete", async () => {
    const srv = fixtures.serve([bash("seq 1 100000"), { content: "TASKCOMPLETE" }]);
    // The reader lets the pipe fill up before it reads anything (tests/full-pipe-reader.ts): no fixed sleep.
    const reader = `${process.execPath} ${join(import.meta.dir, "full-pipe-reader.ts")}`;
    const cmd = `${AIC} ${headless(srv.url).join(" ")} --auto-approve count | ${reader}`;
    const { stdout } = await runCommand(["sh", "-c", cmd]);
    expect(Number(stdout.trim())).toBe(100000);
  });
});

describe("secrets and the sandbox", () => {
  // The API key stays out of what commands can see, so it never reaches the model or the session file.
  test("commands do not see the API key in their environment", async () => {
    const dir = scratch();
    const srv = fixtures.serve([bash("env | grep -c API_KEY; echo done"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "look"], {
      cwd: dir,
      env: { AIC_API_KEY: "sk-secret-aic", OPENAI_API_KEY: "sk-secret-openai" },
    });
    expect(run.code).toBe(0);
    expect(toolResults(srv).at(-1)).toContain("\n0\ndone");
    expect(readFileSync(join(dir, "s.json"), "utf8")).not.toContain("sk-secret");
  });

  // A confined command that replaces the aic executable in a writable place cannot run the next command unconfined.
  // Needs a kernel with Landlock (the sandbox); skipped without it.
  test.skipIf(!has.landlock)("replacing the aic binary in the cwd does not unlock the next command", async () => {
    const dir = scratch();
    copyFileSync(AIC, join(dir, "aic"));
    const target = `/var/tmp/${unique("aic-escape-")}`;
    const srv = fixtures.serve([
      bash(`rm -f ./aic && printf '#!/bin/sh\\nshift 3\\nexec "$@"\\n' > ./aic && chmod +x ./aic && echo swapped`),
      bash(`echo escaped > ${target}; echo rc=$?`),
      { content: "TASKCOMPLETE" },
    ]);
    const { stderr, code } = await runCommand([join(dir, "aic"), ...headless(srv.url), "--auto-approve", "try"], {
      cwd: dir,
    });
    try {
      expect(stderr).toContain("Sandbox: on");
      expect(code).toBe(0);
      expect(existsSync(target)).toBe(false);
      expect(toolResults(srv).at(-1)).toContain("Permission denied");
    } finally {
      rmSync(target, { force: true });
    }
  });

  // aic writes its own files unconfined, so it must not follow a symlink a command planted in their place.
  test("a session file replaced by a symlink is not written through", async () => {
    const dir = scratch();
    const victim = join(scratch(), "precious.txt");
    writeFileSync(victim, "keep me\n");
    const srv = fixtures.serve([
      bash(`rm -f s.json && ln -s ${victim} s.json && echo planted`),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "--debug", "plant"], {
      cwd: dir,
    });
    expect(run.code).toBe(0);
    expect(readFileSync(victim, "utf8")).toBe("keep me\n");
    expect(run.stderr).toContain("symbolic link");
  });

  test("a debug dump replaced by a symlink is not written through", async () => {
    const dir = scratch();
    const victim = join(scratch(), "precious.txt");
    writeFileSync(victim, "keep me\n");
    symlinkSync(victim, join(dir, "commander-debug.txt"));
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--debug", "hello"], { cwd: dir });
    expect(run.code).toBe(0);
    expect(readFileSync(victim, "utf8")).toBe("keep me\n");
  });
});

describe("never hangs, never hides", () => {
  // A model stream that goes silent is a failed attempt, retried, not a hang (the idle limit is shortened for the test).
  test("a stream that goes silent between chunks is retried after the idle limit", async () => {
    const srv = fixtures.serve([
      { content: "TASK COMPLETE soon", contentPieces: 3, delayMs: 5000 },
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "hello"], { env: { AIC_STREAM_IDLE_MS: "500" } });
    expect(run.code).toBe(0);
    expect(srv.requests.length).toBe(2);
    expect(run.stderr).toContain("no data from the model for 0.5 s");
  });

  // Before the first chunk only the request's own limit applies (a local server may read a long prompt for minutes).
  test("a server that never answers is retried after the request timeout, not the stream's silence limit", async () => {
    const srv = fixtures.serve([{ type: "hang" }, { content: "TASKCOMPLETE" }]);
    const env = { AIC_STREAM_IDLE_MS: "200", AIC_MODEL_REQUEST_TIMEOUT_MS: "1500" };
    const run = await runAic([...headless(srv.url), "hello"], { env });
    expect(run.code).toBe(0);
    expect(srv.requests.length).toBe(2);
    expect(run.stderr).toContain("no answer from the model within 1.5 s");
    expect(run.stderr).toContain("waiting for the model (prefill)");
  });

  // After SIGTERM the JSON `end` event reports the same exit code the process ends with. The signal
  // comes while the command runs: once its shell has written the file it was asked to.
  test("--json end event carries 143 after SIGTERM", async () => {
    const srv = fixtures.serve([bash("touch running && sleep 300")]);
    const dir = scratch();
    const live = startAic([...headless(srv.url), "--auto-approve", "--json", "wait"], { cwd: dir });
    await waitFor("the command to start", () => existsSync(join(dir, "running")));
    live.proc.kill("SIGTERM");
    const { stdout, code } = await live.done;
    expect(code).toBe(143);
    const end = jsonLines(stdout).find((e) => e.type === "end");
    expect(end.exit_code).toBe(143);
    expect(end.status).toBe("stopped");
  });

  // A timeout too large for a timer is refused up front instead of killing every command at once.
  test("--timeout beyond what a timer can hold is a usage error", async () => {
    const run = await runAic([
      "--nogui",
      "--api-base",
      "http://127.0.0.1:9/v1",
      "--model",
      "m",
      "--timeout",
      "3000000",
      "x",
    ]);
    expect(run.code).toBe(2);
    expect(run.stderr.trim().split("\n")).toHaveLength(1);
    expect(run.stderr).toContain("--timeout");
  });

  // A command that cannot even start is reported to the model, and the run goes on; but a claim of completion right
  // after it is no success (README: "Exit codes").
  test("a command that cannot start becomes a tool result, not the end of the run", async () => {
    const dir = join(scratch(), "doomed");
    mkdirSync(dir);
    const srv = fixtures.serve([bash(`rmdir "${dir}"; echo gone`), bash("echo after"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--disable-sandbox", "--json", "go"], {
      cwd: dir,
    });
    expect(srv.requests.length).toBe(3);
    expect(toolResults(srv).at(-1)).toContain("Command could not be started");
    const end = jsonLines(run.stdout).find((e) => e.type === "end");
    expect(run.code).toBe(1);
    expect(end).toMatchObject({ status: "failed", exit_code: 1, reason: "commands_not_started" });
  });
});

describe("prompts that poll instead of read", () => {
  // node's readline waits in epoll with no timeout on the terminal: handed to the model as waiting for input;
  // a node timer waits with a finite timeout and is merely slow: left alone. Needs node; skipped without it.
  test.skipIf(!has.node)(
    "a node readline prompt is handed to the model; a silent node timer runs to its end",
    async () => {
      const prompt = `node -e "require('readline').createInterface({input: process.stdin, output: process.stdout}).question('name? ', a => { console.log('hi ' + a); process.exit(0) })"`;
      const timer = `node -e "setTimeout(() => console.log('timer done'), 14000)"`;
      const srv = fixtures.serve([bash(prompt, "call_prompt"), bash(timer, "call_timer"), { content: "TASKCOMPLETE" }]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--timeout", "60", "prompts"]);
      expect(run.code).toBe(0);
      const tools = toolResults(srv);
      expect(tools[0]).toStartWith("The command is still running and waits for input (node");
      expect(tools[0]).toContain("name?");
      // The model ran the next command instead of answering: the prompt was stopped first, and it says so.
      expect(tools[1]).toStartWith("(The command that was waiting for input, node, was stopped first");
      expect(tools[1]).toContain("Command executed with exit code 0.");
      expect(tools[1]).toContain("timer done");
    },
    90_000,
  );
});

// The emulator that renders a command's screen takes hostile bytes: a repeat count of 2^31 (REP, `CSI Ps b`) made
// xterm allocate that many cells, and a scroll of 2^31 lines loops as long. Such counts are dropped.
describe("escape sequences that ask the emulator for the impossible", () => {
  test("a 20-byte file read with cat neither crashes aic nor stops the run", async () => {
    const cwd = scratch();
    writeFileSync(
      join(cwd, "evil.txt"),
      "readme\n\x1b[?1049hX\x1b[2147483647b\x1b[999999999S\x1b[999999999L\x1b[?1049l\nafter\n",
    );
    const srv = fixtures.serve([bash("cat evil.txt", "cat"), { content: "Read it.\nTASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "read the file"], { cwd });
    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    const answer = toolAnswer(srv.requests[1], "cat");
    expect(answer).toContain("Command executed with exit code 0.");
    expect(answer).toContain("after");
  });

  // 300 KB of scrolls by 8000 lines once kept the emulator busy for minutes after cat had ended, past --timeout and
  // --max-time: such counts are dropped, and rendering a finished command's output is bounded in time.
  test("a file of huge scroll counts is rendered at once", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, "scrolls.txt"), `${"\x1b[8000S".repeat(40_000)}end-of-scrolls\n`);
    const srv = fixtures.serve([bash("cat scrolls.txt", "cat"), { content: "Read it.\nTASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--max-time", "60", "read the file"], { cwd });
    expect(run.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "cat")).toContain("end-of-scrolls");
  });
});
