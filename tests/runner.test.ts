/**
 * End-to-end tests of running a command (README: "Running a command") and the signal exit codes: the compiled
 * dist/aic runs the fake model's tool calls in a real PTY, and the tests check the tool message the
 * model receives on its next request, plus the state of the system (processes, files) afterwards.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import type { RecordedRequest, Turn } from "./fake-openai.ts";
import {
  alive,
  bash,
  cleanEnv,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  readPeakRssKb,
  runAic,
  scratch,
  startAic,
  waitFor,
  type AicRun,
  hostPid,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const utf8Length = (text: string) => Buffer.byteLength(text, "utf8");

/** Runs aic headless and auto-approved with scripted turns; returns the run and every request the model got. */
async function runTurns(
  turns: Turn[] | ((req: RecordedRequest, index: number) => Turn),
  flags: string[] = [],
  opts: { cwd?: string; env?: Record<string, string> } = {},
): Promise<{ run: AicRun; requests: RecordedRequest[] }> {
  const srv = fixtures.serve(turns);
  const run = await runAic([...headless(srv.url, "test-model", "--auto-approve", ...flags), "run the command"], opts);
  return { run, requests: srv.requests };
}

/** The tool message answering the n-th command (0-based): the last message of request n+1. */
function toolMessage(requests: RecordedRequest[], n = 0): string {
  const message = messagesOf(requests[n + 1]).at(-1);
  expect(message?.role).toBe("tool");
  return String(message.content);
}

/** Runs one command and returns the tool message the model sees for it. */
async function modelView(
  command: string,
  flags: string[] = [],
  opts: { cwd?: string; env?: Record<string, string> } = {},
) {
  const { run, requests } = await runTurns([bash(command)], flags, opts);
  expect(run.code).toBe(0);
  return toolMessage(requests);
}

/** The command output part of a tool message (what follows the `Output…:` line). */
function outputOf(content: string): string {
  const match = /^Output[^\n]*:\n/m.exec(content);
  expect(match).not.toBeNull();
  return content.slice(match!.index + match![0].length);
}

/** Splits a truncated output into head lines, the notice line (the one naming a file), tail lines and the last line. */
function splitTruncated(output: string) {
  const lines = output.split("\n");
  const noticeAt = lines.findIndex((l) => /(^|\s)\/\S/.test(l));
  expect(noticeAt).toBeGreaterThan(0);
  const path = /(?:^|\s)(\/\S+)/.exec(lines[noticeAt]!)![1]!.replace(/[;,.:)\]]+$/, "");
  return {
    head: lines.slice(0, noticeAt),
    notice: lines[noticeAt]!,
    path,
    tail: lines.slice(noticeAt + 1, -1),
    last: lines.at(-1),
  };
}

/** Waits for every pid to be gone (the kernel and init need a moment to reap); returns those still alive when the wait gave up. */
async function gone(pids: number[]): Promise<number[]> {
  await waitFor(`processes ${pids.join(", ")} to be gone`, () => !pids.some(alive)).catch(() => undefined);
  return pids.filter(alive);
}

/** Waits for `file` to exist with something in it. */
const waitForFile = (file: string) =>
  waitFor(`${file} to be written`, () => existsSync(file) && readFileSync(file, "utf8").trim() !== "");

const readPid = (file: string) => Number(readFileSync(file, "utf8").trim());

/** Per-test limit, only to stop a hung test: bun 1.4.4 ignores `timeout` in bunfig.toml and would cut at 5 s. */
const E2E_MS = 60_000;

/** A command whose shell and background grandchild both live long and record their pids. */
const LONG_COMMAND_WITH_GRANDCHILD = "echo $$ > sh.pid; sleep 300 & echo $! > gc.pid; sleep 300";

describe("process lifetime", () => {
  // On time-out, SIGTERM then SIGKILL go to the whole process group, so a background grandchild dies too.
  test(
    "a timed-out command is killed with its whole group and the model is told",
    async () => {
      const cwd = scratch();
      // Outside the jail, so the pids the command records are the ones to check once aic has gone on (in the jail
      // nothing could be left anyway: it ends with aic).
      const { run, requests } = await runTurns([bash(LONG_COMMAND_WITH_GRANDCHILD)], ["--timeout", "2"], {
        cwd,
        env: { AIC_NO_NAMESPACES: "1" },
      });
      expect(run.code).toBe(0);
      expect(toolMessage(requests)).toMatch(/timed out after 2 seconds/);
      const pids = [readPid(join(cwd, "sh.pid")), readPid(join(cwd, "gc.pid"))];
      expect(pids.every((p) => p > 1)).toBe(true);
      expect(await gone(pids)).toEqual([]);
    },
    E2E_MS,
  );

  // Exit codes 143/129/130, and a signal to aic kills the running command's whole process group too.
  test.each([
    ["SIGTERM", 143],
    ["SIGHUP", 129],
    ["SIGINT", 130],
  ] as const)(
    "%s to aic while a command runs: exit %d and the command's group is gone",
    async (signal, expected) => {
      const cwd = scratch();
      const srv = fixtures.serve([bash(LONG_COMMAND_WITH_GRANDCHILD)]);
      const live = startAic([...headless(srv.url, "test-model", "--auto-approve"), "run the command"], {
        cwd,
        killAfterMs: 50_000,
      });
      await waitForFile(join(cwd, "gc.pid"));
      await waitForFile(join(cwd, "sh.pid"));
      // The command records its pids as it sees them (in the jail, the jail's numbering): found as the tests see them.
      const pids = [readPid(join(cwd, "sh.pid")), readPid(join(cwd, "gc.pid"))].map((p) => hostPid(p, cwd) ?? -1);
      expect(pids.filter(alive)).toEqual(pids);
      live.proc.kill(signal);
      const { code } = await live.done;
      expect(code).toBe(expected);
      expect(await gone(pids)).toEqual([]);
    },
    E2E_MS,
  );

  // The tool message carries the child's exit code, or 128 + signal when a signal killed it.
  test(
    "exit codes: a plain exit status and 128 + signal",
    async () => {
      const { run, requests } = await runTurns([bash("exit 3"), bash("kill -KILL $$")]);
      expect(run.code).toBe(0);
      expect(toolMessage(requests, 0)).toStartWith("Command executed with exit code 3.");
      expect(toolMessage(requests, 1)).toStartWith("Command executed with exit code 137.");
    },
    E2E_MS,
  );

  // Runs in aic's cwd, on a terminal, as the leader of its own process group.
  test(
    "the command runs in aic's cwd, on a terminal, leading its own process group",
    async () => {
      const cwd = scratch();
      const { run, requests } = await runTurns(
        [bash("pwd"), bash("test -t 1 && echo tty"), bash("echo $$ $(cut -d' ' -f5 /proc/$$/stat)")],
        [],
        { cwd },
      );
      expect(run.code).toBe(0);
      expect(outputOf(toolMessage(requests, 0))).toBe(cwd);
      expect(outputOf(toolMessage(requests, 1))).toBe("tty");
      const [pid, pgid] = outputOf(toolMessage(requests, 2)).split(" ");
      expect(pgid).toBe(pid!);
    },
    E2E_MS,
  );

  // The environment: pagers and prompts are neutralised even when the user's environment says otherwise;
  // the wrapper exports a browser User-Agent and wraps curl.
  test(
    "the command's environment neutralises pagers and prompts and carries a browser User-Agent",
    async () => {
      const { run, requests } = await runTurns(
        [
          bash("echo $PAGER $GIT_PAGER $TERM $GIT_TERMINAL_PROMPT $DEBIAN_FRONTEND"),
          bash('echo "$MANPAGER $GH_PROMPT_DISABLED $GCM_INTERACTIVE [${GIT_ASKPASS-unset}] [${SSH_ASKPASS-unset}]"'),
          bash("type curl"),
          bash("echo $HTTP_USER_AGENT"),
        ],
        [],
        { env: { PAGER: "less", GIT_PAGER: "less", TERM: "dumb", MANPAGER: "less", GIT_ASKPASS: "/bin/false" } },
      );
      expect(run.code).toBe(0);
      expect(outputOf(toolMessage(requests, 0))).toBe("cat cat xterm-256color 0 noninteractive");
      expect(outputOf(toolMessage(requests, 1))).toBe("cat 1 never [] []");
      expect(outputOf(toolMessage(requests, 2))).toMatch(/function/);
      expect(outputOf(toolMessage(requests, 3))).toContain("Mozilla");
    },
    E2E_MS,
  );
});

describe("what the model sees", () => {
  // `\r` progress output collapses to the final state of the line.
  test(
    "carriage returns collapse to the final text",
    async () => {
      expect(outputOf(await modelView("printf 'a\\rb\\n'"))).toBe("b");
    },
    E2E_MS,
  );

  // Escape sequences are interpreted and removed.
  test(
    "colours are removed",
    async () => {
      const content = await modelView("printf '\\033[31mred\\033[0m \\033[1mbold\\033[0m\\n'");
      expect(content).not.toContain("\x1b");
      expect(outputOf(content)).toBe("red bold");
    },
    E2E_MS,
  );

  // Plain text is cut into lines without the emulator until the first byte a terminal acts on; from there the
  // emulator takes over with the screen as it stands. Each command is compared with itself behind a leading
  // colour reset (which makes the emulator render it all), and with what a person would read.
  test(
    "plain text then escapes renders as the emulator alone renders it",
    async () => {
      const cases: [string, (out: string) => void][] = [
        [
          `printf '%0200d\\n' 7; for i in $(seq 1 30); do echo "line $i é"; done; printf '\\033[2Aover\\n'`,
          (out) => {
            const lines = out.split("\n");
            expect(lines[0]).toBe(`${"0".repeat(199)}7`);
            expect(lines.slice(1, 29)).toEqual(Array.from({ length: 28 }, (_, i) => `line ${i + 1} é`));
            expect(lines.slice(29)).toEqual(["over 29 é", "line 30 é"]);
          },
        ],
        [
          "for i in $(seq 1 500); do printf 'é—%s\\n' $i; done; printf 'done\\rDONE\\n'",
          (out) => {
            const lines = out.split("\n");
            expect(lines).toHaveLength(501);
            expect(lines[499]).toBe("é—500");
            expect(lines[500]).toBe("DONE");
          },
        ],
        ["printf 'a  \\nb\\tc\\n'; printf 'x\\033[Ky\\n'", (out) => expect(out).toBe("a  \nb       c\nxy")],
        // One character's bytes in two reads of the terminal, with and without the emulator.
        ["printf 'é\\342\\200'; sleep 0.3; printf '\\224é\\n'", (out) => expect(out).toBe("é—é")],
      ];
      for (const [command, check] of cases) {
        const plain = outputOf(await modelView(command));
        check(plain);
        expect(plain).toBe(outputOf(await modelView(`printf '\\033[0m'; ${command}`)));
      }
    },
    E2E_MS,
  );

  // Soft-wrapped lines (longer than the PTY width) are joined back into one line.
  test(
    "a line longer than the terminal width arrives as one line",
    async () => {
      expect(outputOf(await modelView("printf '%0300d\\n' 0"))).toBe("0".repeat(300));
    },
    E2E_MS,
  );

  // Truncation: head + notice naming the saved file + tail + sentinel, within the cap; the file holds
  // the whole output while aic runs (the model can read it) and is removed when aic exits normally.
  test(
    "long output is cut to head and tail, and the whole of it is readable from the named file",
    async () => {
      let savedPath: string | undefined;
      const { run, requests } = await runTurns((req, index) => {
        if (index === 0) return bash("seq 1 100000");
        if (index === 1) {
          const lines = String(req.body.messages.at(-1)?.content ?? "").split("\n");
          const notice = lines.find((l) => /(^|\s)\/\S/.test(l));
          savedPath = notice && /(?:^|\s)(\/\S+)/.exec(notice)![1]!.replace(/[;,.:)\]]+$/, "");
          return bash(savedPath ? `wc -l < '${savedPath}'; tail -1 '${savedPath}'` : "echo no file path in the notice");
        }
        return { content: "TASKCOMPLETE" };
      });
      expect(run.code).toBe(0);

      const { head, notice, path, tail, last } = splitTruncated(outputOf(toolMessage(requests, 0)));
      expect(last).toBe("output too long: truncated");
      expect(head.slice(0, 3)).toEqual(["1", "2", "3"]);
      // Whole lines in the head count up from 1 (the last one may be cut mid-line).
      head.slice(0, -1).forEach((line, i) => expect(line).toBe(String(i + 1)));
      expect(tail.at(-1)).toBe("100000");
      // Whole lines in the tail count up to 100000 (the first one may be cut mid-line).
      tail.slice(1).forEach((line, i, rest) => expect(line).toBe(String(100000 - (rest.length - 1 - i))));
      expect(utf8Length(head.join("\n")) + utf8Length(tail.join("\n"))).toBeLessThanOrEqual(10240);
      expect(notice).toContain(path);

      expect(path).toBe(savedPath!);
      const seen = outputOf(toolMessage(requests, 1))
        .split("\n")
        .map((l) => l.trim());
      expect(seen).toEqual(["100000", "100000"]);

      expect(existsSync(path)).toBe(false);
      expect(existsSync(dirname(path))).toBe(false);
    },
    E2E_MS,
  );

  // A single line longer than the cap keeps its end too: the model sees how it finished.
  test("one output line longer than the cap reaches the model with its head and its tail", async () => {
    const content = await modelView("head -c 60000 /dev/zero | tr '\\0' x; printf 'END-OF-THE-LINE\\n'", [
      "--max-output-bytes",
      "2000",
    ]);
    const output = outputOf(content);
    expect(output).toStartWith("xxxx");
    expect(output).toContain("END-OF-THE-LINE");
    expect(output.indexOf("END-OF-THE-LINE")).toBeGreaterThan(output.indexOf("xxxx"));
  });

  // The cut is in UTF-8 bytes and never splits a character.
  test(
    "truncated multibyte output stays valid UTF-8 and within the cap",
    async () => {
      const phrase = "héllo wörld ünïcode €";
      const content = await modelView(`for i in $(seq 1 3000); do echo "${phrase}"; done`, [
        "--max-output-bytes",
        "1000",
      ]);
      expect(content).not.toContain("\uFFFD");
      expect(Buffer.from(content, "utf8").toString("utf8")).toBe(content); // no lone surrogates
      const { head, tail, last } = splitTruncated(outputOf(content));
      expect(last).toBe("output too long: truncated");
      expect(utf8Length(head.join("\n")) + utf8Length(tail.join("\n"))).toBeLessThanOrEqual(1000);
      expect(head.length).toBeGreaterThan(0);
      expect(tail.length).toBeGreaterThan(0);
      // Every kept line is the phrase, except where the cut fell: a prefix at the end of the head, a suffix at the start of the tail.
      head.slice(0, -1).forEach((line) => expect(line).toBe(phrase));
      expect(phrase.startsWith(head.at(-1)!)).toBe(true);
      tail.slice(1).forEach((line) => expect(line).toBe(phrase));
      expect(phrase.endsWith(tail[0]!)).toBe(true);
    },
    E2E_MS,
  );
});

describe("commands that would never end", () => {
  // Memory stays bounded: a runaway printer is stopped at 100 × --max-output-bytes and aic's memory stays small.
  test(
    "`yes` is stopped by the runaway rule and aic's peak memory stays under 200 MB",
    async () => {
      const srv = fixtures.serve([bash("yes")]);
      const live = startAic(
        [...headless(srv.url, "test-model", "--auto-approve", "--max-output-bytes", "10240"), "run it"],
        {
          killAfterMs: 50_000,
        },
      );
      let peakKb = 0;
      const sampler = setInterval(() => (peakKb = Math.max(peakKb, readPeakRssKb(live.proc.pid) ?? 0)), 50);
      const { code } = await live.done;
      clearInterval(sampler);
      expect(code).toBe(0);
      expect(toolMessage(srv.requests)).toMatch(/more than 1024000 bytes/);
      expect(peakKb).toBeGreaterThan(0);
      expect(peakKb).toBeLessThan(200 * 1024);
    },
    E2E_MS,
  );

  // The environment: GIT_PAGER=cat keeps `git log` from waiting in a pager until the timeout.
  test("git log with many commits returns at once instead of waiting in a pager", async () => {
    const cwd = scratch();
    const gitEnv = {
      ...cleanEnv(),
      GIT_AUTHOR_NAME: "t",
      GIT_AUTHOR_EMAIL: "t@example.com",
      GIT_COMMITTER_NAME: "t",
      GIT_COMMITTER_EMAIL: "t@example.com",
    };
    const setup = Bun.spawnSync(
      [
        "sh",
        "-c",
        'git init -q && git commit -q --allow-empty -m first-commit-marker && for i in $(seq 2 200); do git commit -q --allow-empty -m "commit $i"; done',
      ],
      { cwd, env: gitEnv },
    );
    expect(setup.exitCode).toBe(0);
    const { run, requests } = await runTurns([bash("git log")], ["--timeout", "60"], { cwd });
    expect(run.code).toBe(0);
    // A pager would hold it until the 60 s timeout killed it: the model would be told it timed out,
    // with only the first screen. It ran to its own end instead, down to the oldest commit.
    const content = toolMessage(requests);
    expect(content).toStartWith("Command executed with exit code 0.");
    expect(content).not.toContain("timed out");
    expect(content).toContain("first-commit-marker");
  }, 120_000);

  // Waiting for input: a command blocked reading the terminal is handed to the model after a quiet second,
  // with its screen, and keeps running (the model could type into it); one that merely sleeps runs to its end.
  test("a command waiting for input is handed to the model; a slow one is left alone", async () => {
    const [waiting, slow] = await Promise.all([
      runTurns([bash("read x; echo got $x")], ["--timeout", "60", "--json"]),
      runTurns([bash("sleep 20; echo slept")], ["--timeout", "60"]),
    ]);
    expect(waiting.run.code).toBe(0);
    // Handed over by the waiting-for-input rule, not ended by the 60 s timeout (which would say timed_out).
    expect(jsonLines(waiting.run.stdout).find((e) => e.type === "command_result")).toMatchObject({
      status: "waiting_for_input",
      exit_code: null,
    });
    expect(toolMessage(waiting.requests)).toStartWith("The command is still running and waits for input");
    expect(toolMessage(waiting.requests)).not.toContain("timed out");

    expect(slow.run.code).toBe(0);
    const slowContent = toolMessage(slow.requests);
    expect(slowContent).toStartWith("Command executed with exit code 0.");
    expect(outputOf(slowContent)).toBe("slept");
  }, 120_000);
});
