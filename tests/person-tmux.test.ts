/**
 * The person at the keyboard, end to end: the compiled dist/aic in a real terminal (tmux 3.3, 80×24), driven
 * with keystrokes against the fake model server running in this process. Each test is one moment of a
 * working day: a Ctrl+C that ends a program, "Always allow" in a git repository, a program left waiting, a
 * command that prints a lot, a model that is slow to answer, a suggestion typed into the dialog, text typed
 * while the agent works, a session file that does not parse, NO_COLOR, Ctrl+Z, a multi-line command, and
 * quitting with a job still running.
 *
 * Every tmux server has a socket of its own (helpers' Tmux), so the tests can run in parallel; every test
 * waits on something it can see (the pane, a file, a request reaching the fake server), never on time.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { Turn } from "./fake-openai.ts";
import {
  AIC,
  Tmux,
  bash,
  cleanEnv,
  footer,
  has,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  scratch,
  toolAnswer,
  waitFor,
} from "./helpers.ts";

// ---------------------------------------------------------------------------------------------
// Shared helpers

const WIDTH = 80;
const HEIGHT = 24;

const fixtures = perTestFixtures();
/** The tmux servers of a test, killed after it whatever happens. */
const sessions: Tmux[] = [];
afterEach(() => {
  for (const tmux of sessions.splice(0)) tmux.kill();
});

/** `text` quoted for bash. */
const q = (text: string) => `'${text.replace(/'/g, `'\\''`)}'`;

/** What a person's fresh terminal holds: their own HOME and config directory, so personal files never leak between tests. */
interface Desk {
  cwd: string;
  home: string;
  config: string;
  env: Record<string, string>;
}

function desk(
  cwd = fixtures.disposable(scratch("aic-person-tmux-cwd-")),
  extra: Record<string, string | undefined> = {},
): Desk {
  const home = fixtures.disposable(scratch("aic-pt-home-"));
  const config = fixtures.disposable(scratch("aic-pt-cfg-"));
  const env = cleanEnv({
    HOME: home,
    XDG_CONFIG_HOME: config,
    SHELL: "/bin/bash",
    PS1: "outer$ ",
    TERM: "xterm-256color",
    ...extra,
  });
  return { cwd, home, config, env };
}

/**
 * aic typed into an interactive `bash --norc` in a fresh 80×24 tmux, as a person starts it; unless `bare`, the
 * wrapper prints aic's exit code afterwards (`EXIT=<code>`), so quitting is visible on the pane. (Bare for job
 * control: bash goes on to the rest of a list whose job was stopped.)
 */
async function startInShell(d: Desk, url: string, args: string[], request?: string, bare = false): Promise<Tmux> {
  const tmux = new Tmux(d.env, d.cwd, ["bash", "--norc", "--noprofile"], { width: WIDTH, height: HEIGHT });
  sessions.push(tmux);
  await tmux.waitFor("the outer shell's prompt", (s) => s.includes("outer$"));
  const argv = [AIC, "--api-base", url, "--model", "test-model", ...args, ...(request ? [request] : [])];
  tmux.type(`${argv.map(q).join(" ")}${bare ? "" : "; echo EXIT=$?"}`);
  tmux.keys("Enter");
  await tmux.waitFor("the TUI", (s) => s.includes("Agent Output"));
  return tmux;
}

/** Whether aic has exited to the outer shell: its exit code is printed and the prompt is back after it. */
const exitedToPrompt = (screen: string) => /EXIT=\d+\n+outer\$/.test(screen);

/** Whether aic is still the pane's foreground program (not exited to the outer shell, which would print EXIT=). */
function aicStillRuns(tmux: Tmux): boolean {
  return tmux.display("#{pane_dead}") === "0" && tmux.display("#{pane_current_command}") !== "bash";
}

/** The left half of the screen (Agent Output), one string per row, its borders removed. */
function leftPane(screen: string): string[] {
  return screen.split("\n").map((row) =>
    Array.from(row)
      .slice(0, WIDTH / 2)
      .join("")
      .replace(/^[│┃║]/, "")
      .replace(/[│┃║]\s*$/, "")
      .trimEnd(),
  );
}

/** Text with every space, line break, border and scroll bar taken out: a wrapped line reads as one. */
const flat = (text: string) => text.replace(/[\s│┃║─┌┐└┘╭╮╰╯█▐▌▀▄░▒▓]/g, "");

/** Whether the screen says `needle`, wrapped or not: in the agent pane, or across the full width (banner, prompt). */
function says(screen: string, needle: string | RegExp): boolean {
  const texts = [flat(leftPane(screen).join("\n")), flat(screen)];
  return texts.some((t) => (typeof needle === "string" ? t.includes(flat(needle)) : needle.test(t)));
}

/** Quits with Ctrl+C twice and waits for the outer shell's prompt; returns the last screen. */
async function quit(tmux: Tmux): Promise<string> {
  tmux.keys("C-c");
  await tmux.waitFor("the footer saying a second Ctrl+C quits", (s) => footer(s).includes("Ctrl+C again to quit"));
  tmux.keys("C-c");
  return tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
}

/** The pane with its attributes as escape sequences (tmux capture-pane -e). */
const screenWithEscapes = (tmux: Tmux) => tmux.run(["capture-pane", "-e", "-p", "-t", tmux.target]);

/**
 * The SGR colour parameters in `text` (foreground 30–37, 90–97, 38;…; background 40–47, 100–107, 48;…), as
 * written; 39 and 49 (the default colours), bold, reverse and the like are not colours.
 */
function sgrColours(text: string): string[] {
  const found: string[] = [];
  for (const m of text.matchAll(/\x1b\[([0-9;:]*)m/g)) {
    // A foreground colour on blank cells alone shows nothing (OpenTUI pads lines with coloured spaces).
    const until = text.indexOf("\x1b", m.index + m[0].length);
    const drawn = text.slice(m.index + m[0].length, until < 0 ? undefined : until);
    const blank = drawn.trim() === "";
    const params = m[1]!.split(";");
    for (let i = 0; i < params.length; i++) {
      const [head] = params[i]!.split(":");
      const n = Number(head);
      if (n === 38 || n === 48) {
        // 38;5;N and 38;2;R;G;B (or the colon forms, one parameter)
        const more = params[i]!.includes(":") ? 0 : params[i + 1] === "5" ? 2 : params[i + 1] === "2" ? 4 : 0;
        if (!(blank && n === 38)) found.push(params.slice(i, i + 1 + more).join(";"));
        i += more;
      } else if ((n >= 40 && n <= 47) || (n >= 100 && n <= 107)) found.push(String(n));
      else if (((n >= 30 && n <= 37) || (n >= 90 && n <= 97)) && !blank) found.push(String(n));
    }
  }
  return found;
}

/** The live processes whose command line (arguments joined by spaces) contains `text`. */
function processesWith(text: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      const cmdline = readFileSync(`/proc/${entry}/cmdline`, "utf8").replace(/\0/g, " ");
      const state = readFileSync(`/proc/${entry}/stat`, "utf8").split(") ")[1]?.[0];
      if (cmdline.includes(text) && state !== "Z") found.push(Number(entry));
    } catch {
      /* gone */
    }
  }
  return found;
}

/** A git repository with one commit and nothing uncommitted. */
function gitRepo(): string {
  const cwd = fixtures.disposable(scratch("aic-pt-repo-"));
  const git = (...args: string[]) => {
    const r = Bun.spawnSync(["git", ...args], { cwd, stdout: "pipe", stderr: "pipe" });
    if (r.exitCode !== 0) throw new Error(`git ${args.join(" ")}: ${r.stderr.toString()}`);
    return r.stdout.toString();
  };
  git("init", "-q");
  git("config", "user.email", "a@b.c");
  git("config", "user.name", "A");
  writeFileSync(join(cwd, "a.txt"), "one\n");
  git("add", "a.txt");
  git("commit", "-qm", "first");
  expect(git("status", "--porcelain")).toBe("");
  return cwd;
}

const gitStatus = (cwd: string) =>
  Bun.spawnSync(["git", "status", "--porcelain", "--untracked-files=all"], { cwd }).stdout.toString();

/** A call that types `input` into the command that waits. */
const keys = (input: string, id?: string) => ({ toolCalls: [{ id, arguments: JSON.stringify({ input }) }] });

const done: Turn = { content: "TASKCOMPLETE" };

// ---------------------------------------------------------------------------------------------

// Needs tmux (and git for the rules test); skipped without them.
describe.skipIf(!has.tmux)("the person at the keyboard, in tmux at 80×24", () => {
  // The first Ctrl+C goes to `read` (a program the person approved, with their keys) and ends it; the second lands
  // on aic while it asks the model again. Only presses aic itself handled count towards "twice quits".
  test("Ctrl+C that ends a waiting program, then Ctrl+C while the model is asked again, leaves aic running", async () => {
    const srv = fixtures.serve([
      bash(`read -p 'name? ' x; echo got=$x`, "call_read"),
      // In flight for a while: the second press lands while aic waits for this answer.
      { content: "The read was cut short. What next?", firstChunkDelayMs: 3000 },
      done,
    ]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, ["--ask-every-command"], "ask my name");
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("Enter");
    await tmux.waitFor(
      "the program's prompt, with the keys going to it",
      (s) => s.includes("name?") && s.includes("keys go to the command"),
    );
    tmux.keys("C-c");
    await waitFor("the next model request", () => srv.requests.length === 2);
    expect(toolAnswer(srv.requests[1], "call_read")).not.toContain("got=");
    tmux.keys("C-c");
    // aic handled this press itself (it interrupted the model's answer), and says a second one would quit.
    await tmux.waitFor("aic's own answer to the press", (s) => footer(s).includes("Ctrl+C again to quit"));
    expect(aicStillRuns(tmux)).toBe(true);
    // It still takes keys: /help answers (its last line is Ctrl+D's).
    tmux.type("/help");
    tmux.keys("Enter");
    const screen = await tmux.waitFor("the help", (s) => says(s, "Ctrl+D quit, on an empty prompt"));
    expect(screen).not.toMatch(/EXIT=\d/);
    expect(screen).toContain("Agent Output");
    expect(aicStillRuns(tmux)).toBe(true);
  });

  // "Always allow" widens the rules for good, but the rule is the person's: nothing a `git add -A && git commit`
  // would pick up appears in the project, and the next run of aic lets the same command through without asking.
  test.skipIf(!has.git)(
    "Always allow leaves the git work tree clean, holds on the next run, and /rules names both rules files",
    async () => {
      const cwd = gitRepo();
      const outside = fixtures.disposable(scratch("aic-pt-stamps-"));
      const command = `touch ${outside}/stamp`;
      const srv = fixtures.serve([bash(command, "call_touch"), { content: "Touched.\nTASKCOMPLETE" }]);
      const d = desk(cwd);
      const tmux = await startInShell(d, srv.url, [], "touch the stamp");
      await tmux.waitFor(
        "the dialog offering Always allow",
        (s) => s.includes("Approve command?") && s.includes("Always allow"),
      );
      expect(existsSync(join(outside, "stamp"))).toBe(false);
      tmux.type("/always");
      tmux.keys("Enter");
      await tmux.waitFor("the task done", (s) => s.includes("[completed]"));
      expect(existsSync(join(outside, "stamp"))).toBe(true);
      // Nothing a `git add -A && git commit` would take: no rules file, no session, nothing new at all.
      expect(gitStatus(cwd)).toBe("");

      tmux.type("/rules");
      tmux.keys("Enter");
      /** The agent pane after the task's end: /rules' answer. */
      const answer = (s: string) => {
        const rows = leftPane(s);
        return rows.slice(rows.findLastIndex((r) => r.includes("[completed]")) + 1).join("\n");
      };
      const screen = await tmux.waitFor("the rules and where they come from", (s) =>
        says(answer(s), join(cwd, ".aicrules")),
      );
      // The personal rules file lives in aic's state directory (out of commands' reach), not in the project.
      const rules = answer(screen);
      const personal = says(rules, `${d.env.XDG_STATE_HOME}/aic/own-rules/`);
      if (!personal) throw new Error(`/rules names no personal rules file; the screen was:\n${screen}`);
      await quit(tmux);
      expect(gitStatus(cwd)).toBe("");

      // The next run, without a terminal: the same command runs without asking (an ask would be refused here).
      rmSync(join(outside, "stamp"));
      const again = fixtures.serve([bash(command, "call_again"), done]);
      const run = await runAic([...headless(again.url), "--json", "touch it again"], { cwd, env: d.env });
      expect(run.code).toBe(0);
      const approval = jsonLines(run.stdout).find((e) => e.type === "approval" && e.id === "call_again");
      expect(approval?.decision).toBe("allowed");
      expect(existsSync(join(outside, "stamp"))).toBe(true);
      expect(gitStatus(cwd)).toBe("");
    },
    120_000,
  );

  // A program the person approved that waits with nobody typing goes to the model (AIC_HANDOVER_IDLE_S=1 keeps it
  // short); while it waits with the person's keys, the footer names the key that hands it over.
  test("a hand-approved program left waiting is answered by the model; the footer names Ctrl+O meanwhile", async () => {
    const srv = fixtures.serve([
      bash(`read -p 'name? ' x; echo got=$x`, "call_read"),
      keys("Model\n", "call_keys"),
      done,
    ]);
    const d = desk(undefined, { AIC_HANDOVER_IDLE_S: "1" });
    const tmux = await startInShell(d, srv.url, ["--ask-every-command"], "ask my name");
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("Enter");
    await tmux.waitFor(
      "the footer naming Ctrl+O while the program waits",
      (s) => s.includes("name?") && footer(s).includes("Ctrl+O"),
    );
    await waitFor("the model's turn at the keyboard", () => srv.requests.length >= 2);
    // The model was shown the program's screen.
    expect(toolAnswer(srv.requests[1], "call_read")).toContain("name?");
    // Its keys are approved like any of its calls (--ask-every-command); the footer no longer says keys go to the
    // program while the dialog has them.
    const asked = await tmux.waitFor("the keys' approval", (s) => s.includes("Approve input?"));
    expect(footer(asked)).not.toContain("keys go to the command");
    tmux.keys("Enter");
    await waitFor("the command's end", () => srv.requests.length >= 3);
    const answer = toolAnswer(srv.requests[2], "call_keys");
    expect(answer).toContain("got=Model");
    expect(answer).toStartWith("Command executed with exit code 0.");
  });

  // The runaway stop protects the model's context from commands nobody approved; one the person approved runs on.
  test("a hand-approved command printing 8 MB runs to its end, not stopped as a runaway", async () => {
    const srv = fixtures.serve([bash("yes | head -c 8000000; echo END-MARK", "call_big"), done]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, ["--ask-every-command"], "print a lot");
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("Enter");
    await waitFor("the tool result", () => srv.requests.length >= 2, 110_000);
    const answer = toolAnswer(srv.requests[1], "call_big");
    expect(answer).not.toMatch(/runaway/i);
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain("END-MARK");
  }, 120_000);

  // A model that reads a long prompt says nothing for a while: the footer shows that aic waits, and for how long.
  test("while the model is silent the footer shows it waits and its seconds count up", async () => {
    const srv = fixtures.serve([{ content: "Here at last.\nTASKCOMPLETE", firstChunkDelayMs: 15_000 }]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, [], "think hard");
    await waitFor("the request", () => srv.requests.length === 1);
    const seconds = (s: string) => {
      const m = /(?:^|[\s│·(])(\d+)(?:\.\d+)?\s?s(?=$|[\s│·)])/.exec(footer(s));
      return m ? Number(m[1]) : undefined;
    };
    const first = await tmux.waitFor("a seconds count in the footer", (s) => seconds(s) !== undefined, 10_000);
    const n = seconds(first)!;
    expect(footer(first)).toMatch(/wait|think|prefill|[⠁-⣿◐◓◑◒]/i);
    const later = await tmux.waitFor("the footer's count to grow", (s) => (seconds(s) ?? -1) > n, 10_000);
    expect(seconds(later)!).toBeGreaterThan(n);
    expect(srv.requests).toHaveLength(1);
  }, 60_000);

  // A line typed at the dialog that is not exactly y/yes/n/no is a suggestion: nothing runs, the model reads it.
  test("'no need, use printf' and 'yes but quote it' typed at the dialog are suggestions: nothing runs, the model gets the words", async () => {
    const srv = fixtures.serve([bash("touch ran-first.txt", "call_1"), bash("touch ran-second.txt", "call_2"), done]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, [], "make the files");
    await tmux.waitFor("the first dialog", (s) => s.includes("Approve command?") && s.includes("ran-first"));
    tmux.type("no need, use printf");
    tmux.keys("Enter");
    await waitFor("the next request", () => srv.requests.length >= 2);
    expect(JSON.stringify(messagesOf(srv.requests[1]))).toContain("no need, use printf");
    expect(toolAnswer(srv.requests[1], "call_1")).not.toStartWith("Command executed");

    await tmux.waitFor("the second dialog", (s) => s.includes("Approve command?") && s.includes("ran-second"));
    tmux.type("yes but quote it");
    tmux.keys("Enter");
    await waitFor("the next request", () => srv.requests.length >= 3);
    expect(JSON.stringify(messagesOf(srv.requests[2]))).toContain("yes but quote it");
    expect(toolAnswer(srv.requests[2], "call_2")).not.toStartWith("Command executed");
    expect(existsSync(join(d.cwd, "ran-first.txt"))).toBe(false);
    expect(existsSync(join(d.cwd, "ran-second.txt"))).toBe(false);
  });

  // Typed while a command runs, the text waits for the next step; the person interrupts first, so no step used
  // it: it comes back into the prompt, and Enter then sends it as the next task.
  test("text typed while the agent works, unused when the run ends, comes back into the prompt", async () => {
    const srv = fixtures.serve([bash("sleep 300", "call_sleep"), done]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, ["--auto-approve"], "wait a lot");
    await tmux.waitFor("the command running", (s) => s.includes("$ sleep 300"));
    const text = "use the other file please";
    tmux.type(text);
    tmux.keys("Enter");
    await tmux.waitFor("the suggestion queued", (s) => says(s, "[queued suggestion]"));
    tmux.keys("Escape");
    await tmux.waitFor("the interruption", (s) => s.includes("[interrupted]"));
    expect(srv.requests).toHaveLength(1);
    // Back in the prompt: the rows below the panes hold it.
    const screen = await tmux.waitFor("the text back in the prompt", (s) => {
      const rows = s.split("\n");
      const below = rows.slice(rows.findLastIndex((r) => /[└╰┘╯]/.test(r)) + 1);
      return flat(below.join("\n")).includes(flat(text));
    });
    expect(footer(screen)).not.toContain(text);
    tmux.keys("Enter");
    await waitFor("the text sent as the next task", () => srv.requests.length >= 2);
    const user = messagesOf(srv.requests[1])
      .filter((m) => m.role === "user")
      .at(-1);
    expect(String(user?.content)).toContain(text);
  });

  // A session file that does not parse is the person's to fix: it stays as it is, where it is, and nothing runs on
  // it until it loads. --nogui says the same in one line and exits 2.
  test("a session file that does not parse at start stays untouched, names PATH:LINE:COL, and /reload loads it once fixed", async () => {
    const lines = (thirdLine: string) =>
      [
        "{",
        '  "aic_session_version": 1,',
        thirdLine,
        '  "messages": [',
        '    {"role": "user", "content": "remembered-hello"},',
        '    {"role": "assistant", "content": "hello back"}',
        "  ]",
        "}",
        "",
      ].join("\n");
    const broken = lines('  "step_count": 0,,');
    const fixed = lines('  "step_count": 0,');
    expect(() => JSON.parse(broken)).toThrow();
    expect(() => JSON.parse(fixed)).not.toThrow();
    const siblings = (dir: string) =>
      readdirSync(dir).filter(
        (n) => n !== ".aicsession" && n !== ".aicsession.lock" && /aicsession|\.aic-|corrupt/.test(n),
      );

    const srv = fixtures.serve([{ content: "Carried on.\nTASKCOMPLETE" }]);
    const d = desk();
    const file = join(d.cwd, ".aicsession");
    writeFileSync(file, broken);
    const tmux = await startInShell(d, srv.url, ["--session", ".aicsession"], "do the task");
    const screen = await tmux.waitFor(
      "where the file breaks",
      (s) => says(s, /\.aicsession:3:\d+/) && says(s, "fix it"),
    );
    expect(says(screen, /\.aicsession:3:\d+/)).toBe(true);
    expect(readFileSync(file, "utf8")).toBe(broken);
    expect(siblings(d.cwd)).toEqual([]);
    expect(srv.requests).toHaveLength(0);

    writeFileSync(file, fixed);
    tmux.keys("C-u"); // the task may be back in the prompt
    tmux.type("/reload");
    tmux.keys("Enter");
    await tmux.waitFor("the session loaded", (s) => says(s, "remembered-hello") || says(s, "Restored"));
    tmux.keys("C-u");
    tmux.type("the next task");
    tmux.keys("Enter");
    await waitFor("the next request", () => srv.requests.length >= 1);
    expect(JSON.stringify(messagesOf(srv.requests[0]))).toContain("remembered-hello");
    await quit(tmux);

    // Without the TUI: exit 2 and one line naming the place, the file as it was.
    const other = fixtures.disposable(scratch("aic-pt-nogui-"));
    const otherFile = join(other, ".aicsession");
    writeFileSync(otherFile, broken);
    const nogui = fixtures.serve([done]);
    const run = await runAic([...headless(nogui.url), "--session", ".aicsession", "do the task"], {
      cwd: other,
      env: d.env,
    });
    expect(run.code).toBe(2);
    const stderrLines = run.stderr.trim().split("\n");
    expect(stderrLines.filter((l) => /\.aicsession:3:\d+/.test(l))).toHaveLength(1);
    expect(stderrLines).toHaveLength(1);
    expect(readFileSync(otherFile, "utf8")).toBe(broken);
    expect(siblings(other)).toEqual([]);
    expect(nogui.requests).toHaveLength(0);
  }, 120_000);

  // NO_COLOR (no-color.org): aic's screen has no colour at all; the same run without it has some (the control).
  test("NO_COLOR=1 leaves no SGR colour on the screen, while the same run without it has colours", async () => {
    const paint = async (noColor: boolean) => {
      const srv = fixtures.serve([bash("echo plain-words", "call_1"), { content: "All **done** here.\nTASKCOMPLETE" }]);
      const d = desk(undefined, noColor ? { NO_COLOR: "1" } : { NO_COLOR: undefined });
      const tmux = await startInShell(d, srv.url, ["--auto-approve"], "say it");
      await tmux.waitFor("the task done", (s) => s.includes("[completed]") && s.includes("plain-words"));
      return sgrColours(screenWithEscapes(tmux));
    };
    const coloured = await paint(false);
    expect(coloured.length).toBeGreaterThan(0);
    const plain = await paint(true);
    expect(plain).toEqual([]);
  }, 90_000);

  // Ctrl+Z is the terminal's suspend key: the shell gets the terminal back, `fg` gives it back to aic.
  test("Ctrl+Z suspends the TUI to the shell's prompt and fg brings it back, taking keys", async () => {
    const srv = fixtures.serve([{ content: "First done.\nTASKCOMPLETE" }, { content: "Second done.\nTASKCOMPLETE" }]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, [], "first task", true);
    await tmux.waitFor("the first task done", (s) => s.includes("[completed]"));
    tmux.keys("C-z");
    await tmux.waitFor("the outer shell's prompt back", (s) => {
      const rows = s.trimEnd().split("\n");
      return /stopped/i.test(s) && rows.at(-1)!.trim() === "outer$" && !s.includes("Agent Output");
    });
    expect(tmux.display("#{alternate_on}")).toBe("0");
    expect(tmux.display("#{pane_current_command}")).toBe("bash");
    tmux.type("fg");
    tmux.keys("Enter");
    await tmux.waitFor(
      "the TUI and its footer again",
      (s) => s.includes("Agent Output") && footer(s).includes("auto-approve"),
    );
    tmux.type("second task");
    tmux.keys("Enter");
    await waitFor("the second task's request", () => srv.requests.length >= 2);
    expect(
      messagesOf(srv.requests[1])
        .filter((m) => m.role === "user")
        .at(-1)?.content,
    ).toBe("second task");
    await tmux.waitFor("the second task done", (s) => s.includes("Second done"));
  });

  // The agent pane shows a command as it will run: a three-line command keeps its three lines.
  test("a three-line command is shown on three lines in the agent pane, not flattened", async () => {
    const srv = fixtures.serve([bash("echo one\necho two\necho three", "call_lines"), done]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, ["--auto-approve"], "count");
    const screen = await tmux.waitFor("the command done", (s) => s.includes("[completed]"));
    const rows = leftPane(screen);
    const first = rows.findIndex((r) => r.includes("echo one"));
    expect(first).toBeGreaterThanOrEqual(0);
    expect(rows[first]).not.toContain("echo two");
    const second = rows.findIndex((r, i) => i > first && r.includes("echo two"));
    const third = rows.findIndex((r, i) => i > second && r.includes("echo three"));
    expect(second).toBe(first + 1);
    expect(third).toBe(second + 1);
    expect(rows[second]).not.toContain("echo three");
  });

  // Quitting stops the background jobs; the person is told which.
  test("quitting with a background job running says which job it stops", async () => {
    const job = "sleep 3171";
    const srv = fixtures.serve([bash(`${job} & echo started-job`, "call_job"), { content: "Started.\nTASKCOMPLETE" }]);
    const d = desk();
    const tmux = await startInShell(d, srv.url, ["--auto-approve"], "start a job");
    await tmux.waitFor("the task done", (s) => s.includes("[completed]"));
    expect(processesWith(job).length).toBeGreaterThan(0);
    await quit(tmux);
    // Joined as written: tmux wraps long lines at its width.
    const words = tmux.run(["capture-pane", "-p", "-J", "-t", tmux.target]).replace(/\s+/g, " ");
    expect(words).toContain(job);
    const at = words.indexOf(job);
    expect(words.slice(Math.max(0, at - 200), at + 200)).toMatch(/stop/i);
    await waitFor("the job gone", () => processesWith(job).length === 0, 10_000);
  });
});
