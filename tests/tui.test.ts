/**
 * The terminal UI (README: "The terminal UI", with its approval dialog and its default session
 * file ./.aicsession): a real `Tui` from aic.ts built
 * on OpenTUI's in-memory test renderer, driven with mocked keystrokes, talking to the fake OpenAI
 * server over HTTP, running real commands in real PTYs and a real $SHELL for the Shell tab.
 * Assertions read the rendered character frame, the requests the server received, and files on
 * disk (session, prompt history).
 */
import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import * as ot from "@opentui/core";
import { createTestRenderer } from "@opentui/core/testing";
import { existsSync, readFileSync, realpathSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { LogPane, PromptHistory, TokenRate, Tui, keyToBytes, loadXterm, parseArgs } from "../aic.ts";
import { startFakeServer, type FakeServer, type RecordedRequest, type Turn } from "./fake-openai.ts";
import { ROOT, bash, footer, messagesOf, reapAfterAll, scratch, testStateHome, waitFor } from "./helpers.ts";

reapAfterAll();

const Terminal = await loadXterm();

/** Usage the fake server reports for the prompt "usage" (test 8). */
const USAGE = { prompt_tokens: 1500, completion_tokens: 40, cached_tokens: 300 };
/** What the footer's "tokens" must show for it: non-cached input + output. */
const BILLABLE = USAGE.prompt_tokens - USAGE.cached_tokens + USAGE.completion_tokens;

/**
 * One fake server for the whole file. The reply depends only on the newest message, so every test
 * scripts its own runs through what it types: "run: CMD" → a tool call running CMD; "two: A || B" →
 * one turn calling two commands; "say: TEXT" → TEXT as the answer (\n for a newline), streamed in
 * pieces; "slow: TEXT" → TEXT streamed a character at a time; "flaky: NAME" → three 500s, then an
 * answer; "hang" → a request that never
 * answers; "usage" → TASKCOMPLETE with USAGE; anything else → TASKCOMPLETE.
 */
const flakyTries = new Map<string, number>();

function scripted(req: RecordedRequest): Turn {
  const last = req.body?.messages?.at(-1);
  if (last?.role === "user" && typeof last.content === "string") {
    const run = /^run: ([\s\S]*)$/.exec(last.content);
    if (run) return bash(run[1]!);
    const say = /^say: ([\s\S]*)$/.exec(last.content);
    if (say) return { content: say[1]!.replace(/\\n/g, "\n"), contentPieces: 12 };
    const two = /^two: (.*) \|\| (.*)$/.exec(last.content);
    if (two)
      return {
        toolCalls: [
          { arguments: JSON.stringify({ command: two[1] }) },
          { arguments: JSON.stringify({ command: two[2] }) },
        ],
      };
    const slow = /^slow: ([\s\S]*)$/.exec(last.content);
    if (slow) return { content: slow[1]!, contentPieces: slow[1]!.length, delayMs: 20 };
    const flaky = /^flaky: (.*)$/.exec(last.content);
    if (flaky) {
      // The first three attempts of each such task fail with a 500 the server asks to retry at once.
      const tries = (flakyTries.get(flaky[1]!) ?? 0) + 1;
      flakyTries.set(flaky[1]!, tries);
      if (tries <= 3)
        return { type: "http_error", status: 500, body: { error: "busy" }, headers: { "retry-after": "0" } };
      return { content: "TASKCOMPLETE" };
    }
    if (last.content === "hang") return { type: "hang" };
    if (last.content === "usage") return { content: "TASKCOMPLETE", usage: USAGE };
  }
  return { content: "TASKCOMPLETE" };
}

let srv: FakeServer;
/**
 * aic's state (the person's own rules, the prompt history's lock, the native library) goes to the tests' own
 * place; NO_COLOR (which .ci/run sets for its own log) is unset, since these tests read the TUI's colours.
 */
const saved = { XDG_STATE_HOME: process.env.XDG_STATE_HOME, NO_COLOR: process.env.NO_COLOR };
beforeAll(() => {
  srv = startFakeServer({ turns: scripted });
  process.env.XDG_STATE_HOME = testStateHome();
  delete process.env.NO_COLOR;
});
afterAll(() => {
  srv.close();
  for (const [key, value] of Object.entries(saved))
    if (value === undefined) delete process.env[key];
    else process.env[key] = value;
});

type Screen = Awaited<ReturnType<typeof createTestRenderer>>;

interface Harness {
  s: Screen;
  tui: Tui;
  dir: string;
  sessionFile: string;
  historyFile: string;
  /** The code passed to onExit, once the TUI has quit. */
  exitCode: number | undefined;
  /** Requests the fake server received since this TUI started. */
  requests(): RecordedRequest[];
  /** Renders and returns the frame. */
  frame(): Promise<string>;
  /** Renders until the frame satisfies `pred`, and returns it. */
  until(pred: (frame: string) => boolean): Promise<string>;
  /** Types `text` into whatever has focus and presses Enter. */
  type(text: string): Promise<void>;
  /** Waits for the agent to finish a run that sent at least `requests` requests in total. */
  idle(requests: number): Promise<void>;
}

let open: Harness | undefined;

/** The `reason` of the session file on disk now, or undefined while there is none. */
function savedReason(h: Harness): string | undefined {
  try {
    return JSON.parse(readFileSync(h.sessionFile, "utf8")).reason;
  } catch {
    return undefined;
  }
}

/** A frame predicate: every one of `texts` is on it. A wait must hold everything the assertions after it check. */
const showsAll =
  (...texts: string[]) =>
  (frame: string) =>
    texts.every((text) => frame.includes(text));

/**
 * Starts a Tui with its own history file and, unless `defaultSession`, an explicit --session, both
 * in a fresh scratch dir (or `dir`).
 */
async function openTui(
  opts: {
    request?: string;
    width?: number;
    height?: number;
    history?: string[];
    args?: string[];
    dir?: string;
    defaultSession?: boolean;
    /** Take checkpoints (in the process's cwd: the test must chdir to a scratch directory first). */
    checkpoints?: boolean;
  } = {},
): Promise<Harness> {
  const dir = opts.dir ?? scratch("aic-tui-");
  const sessionFile = join(dir, ".aicsession");
  const historyFile = join(dir, "history");
  if (opts.history) writeFileSync(historyFile, opts.history.join("\n") + "\n");
  // The sandbox is off: its start-up probe re-executes Bun.main, which under `bun test` is this file.
  const session = opts.defaultSession ? [] : ["--session", sessionFile];
  // Commands here run in the test runner's own directory: no checkpoint of it is taken unless a test asks for one.
  const checkpoints = opts.checkpoints ? [] : ["--no-checkpoints"];
  const argv = [
    "--api-base",
    srv.url,
    "--model",
    "test-model",
    ...session,
    "--disable-sandbox",
    ...checkpoints,
    // The dialog is what most tests here exercise: even read-only commands (echo, ls) are asked about.
    "--ask-every-command",
    ...(opts.args ?? []),
  ];
  if (opts.request !== undefined) argv.push(opts.request);
  const config = (parseArgs(argv, {}) as any).config;
  const s = await createTestRenderer({ width: opts.width ?? 120, height: opts.height ?? 40, exitOnCtrlC: false });
  const first = srv.requests.length;
  const h: Harness = {
    s,
    tui: undefined as unknown as Tui,
    dir,
    sessionFile,
    historyFile,
    exitCode: undefined,
    requests: () => srv.requests.slice(first),
    async frame() {
      await s.renderOnce();
      return s.captureCharFrame();
    },
    async until(pred) {
      let frame = "";
      try {
        return await waitFor("the frame to match", async () => {
          await s.renderOnce();
          frame = s.captureCharFrame();
          return pred(frame) && frame;
        });
      } catch (error) {
        throw new Error(`${(error as Error).message}; the frame was:\n${frame}`);
      }
    },
    async type(text) {
      await s.mockInput.typeText(text);
      s.mockInput.pressEnter();
      await s.renderOnce();
    },
    async idle(requests) {
      await waitFor(
        `the agent to finish after ${requests} request(s)`,
        () => h.requests().length >= requests && !h.tui.agent.running,
      );
    },
  };
  h.tui = new Tui({
    config,
    renderer: s.renderer,
    ot,
    Terminal,
    onExit: (code) => void (h.exitCode = code),
    historyFile,
  });
  open = h;
  return h;
}

/** Runs `fn` in a fresh directory with its own state home (checkpoints and sessions there), both put back after. */
async function inProjectDirectory(prefix: string, fn: (dir: string) => Promise<void>): Promise<void> {
  const dir = scratch(prefix);
  const home = process.cwd();
  const state = process.env.XDG_STATE_HOME;
  process.env.XDG_STATE_HOME = join(dir, ".state");
  process.chdir(dir);
  try {
    await fn(dir);
  } finally {
    process.chdir(home);
    if (state === undefined) delete process.env.XDG_STATE_HOME;
    else process.env.XDG_STATE_HOME = state;
  }
}

afterEach(async () => {
  const h = open;
  open = undefined;
  if (h && h.exitCode === undefined) await h.tui.quit(0, "process_exit");
});

// ---------------------------------------------------------------------------------------------

describe("layout", () => {
  // Both usual sizes show both panes, the tabs, the prompt and the status footer.
  for (const [width, height] of [
    [120, 40],
    [80, 24],
  ] as const) {
    test(`panes, tabs, prompt and footer at ${width}x${height}`, async () => {
      const h = await openTui({ width, height });
      const texts = ["Agent Output", "Console Output", "Shell", "Type a task, or /help", "Sandbox:", "step 0/500"];
      const frame = await h.until(
        (f) =>
          showsAll(...texts, "run for real")(f) &&
          footer(f).includes("Sandbox: off") &&
          footer(f).includes("step 0/500"),
      );
      for (const text of texts) expect(frame).toContain(text);
      expect(footer(frame)).toContain("Sandbox: off");
      expect(footer(frame)).toContain("step 0/500");
      expect(frame).toContain("run for real"); // the warning banner, since auto-approve is off
    });
  }

  // With auto-approve on from the command line there is no warning banner, and the footer says so.
  test("--auto-approve: no warning banner, footer shows auto-approve ON", async () => {
    const h = await openTui({ args: ["--auto-approve"] });
    const frame = await h.until((f) => f.includes("step 0/500") && footer(f).includes("auto-approve ON"));
    expect(footer(frame)).toContain("auto-approve ON");
    expect(frame).not.toContain("run for real");
  });

  // Below the minimum size the layout gives way to a message, and comes back when the terminal grows.
  test("a too small terminal shows a message instead of the layout", async () => {
    const h = await openTui();
    await h.until((f) => f.includes("Agent Output"));
    h.s.resize(40, 10);
    let frame = await h.until((f) => f.includes("too small") && !f.includes("Agent Output"));
    expect(frame).not.toContain("Agent Output");
    h.s.resize(120, 40);
    frame = await h.until((f) => f.includes("Agent Output") && !f.includes("too small"));
    expect(frame).not.toContain("too small");
  });

  // Started at a small size, the message is there from the first frame.
  test("starting at 40x10 shows the too-small message", async () => {
    const h = await openTui({ width: 40, height: 10 });
    const frame = await h.until((f) => f.includes("too small"));
    expect(frame).not.toContain("Agent Output");
  });
});

describe("approval gate in the TUI", () => {
  // A CLI request starts at launch; the dialog shows the command; Y runs it and the output reaches
  // the console pane and the model; a second command rejected with Escape is reported as skipped.
  test("Y approves and runs the command; Escape rejects it", async () => {
    const h = await openTui({ request: "run: echo hi-$((6*7))" });
    let frame = await h.until(
      (f) =>
        showsAll("Approve command?", "echo hi-$((6*7))", "Approval needed: echo hi-$((6*7))")(f) &&
        footer(f).includes("⚠ approval pending"),
    );
    expect(frame).toContain("echo hi-$((6*7))");
    expect(footer(frame)).toContain("⚠ approval pending");
    expect(frame).toContain("Approval needed: echo hi-$((6*7))"); // the banner names the waiting command
    expect(h.requests()).toHaveLength(1);

    h.s.mockInput.pressKey("y");
    h.s.mockInput.pressEnter(); // a line: y and Enter
    frame = await h.until((f) => f.includes("hi-42") && !f.includes("Approve command?"));
    await h.idle(2);
    const tool = messagesOf(h.requests()[1]).at(-1);
    expect(tool.role).toBe("tool");
    expect(tool.content).toStartWith("Command executed with exit code 0.");
    expect(tool.content).toContain("hi-42");

    await h.type("run: echo never-$((1+1))");
    await h.until((f) => f.includes("Approve command?") && f.includes("echo never-$((1+1))"));
    h.s.mockInput.pressEscape(); // a lone ESC is delivered after the parser's ~20 ms timeout: wait for its effect
    frame = await h.until((f) => !f.includes("Approve command?"));
    await h.idle(4);
    const rejected = messagesOf(h.requests()[3]).at(-1);
    expect(rejected).toMatchObject({ role: "tool", content: "Command execution skipped by user." });
    expect(frame).not.toContain("never-2");
    expect(h.exitCode).toBeUndefined(); // Escape answered the dialog, it did not quit
  });

  // The line n rejects like Escape; /approve and /reject typed in the prompt answer the dialog too.
  test("n and Enter, /reject and /approve answer the dialog", async () => {
    const h = await openTui({ request: "run: echo nope-$((2*2))" });
    await h.until((f) => f.includes("Approve command?"));
    h.s.mockInput.pressKey("n");
    h.s.mockInput.pressEnter();
    await h.idle(2);
    expect(messagesOf(h.requests()[1]).at(-1)).toMatchObject({
      role: "tool",
      content: "Command execution skipped by user.",
    });
    expect(await h.frame()).not.toContain("nope-4");

    await h.type("run: echo slash-no-$((2*3))");
    await h.until((f) => f.includes("Approve command?") && f.includes("slash-no-"));
    await h.type("/reject");
    await h.idle(4);
    expect(messagesOf(h.requests()[3]).at(-1)).toMatchObject({
      role: "tool",
      content: "Command execution skipped by user.",
    });

    await h.type("run: echo slash-yes-$((2*4))");
    await h.until((f) => f.includes("Approve command?") && f.includes("slash-yes-"));
    await h.type("/approve");
    await h.until((f) => f.includes("slash-yes-8"));
    await h.idle(6);
    expect(messagesOf(h.requests()[5]).at(-1).content).toContain("slash-yes-8");
    expect(await h.frame()).not.toContain("slash-no-6");
  });

  // /suggest typed while the dialog is up rejects the command and passes the suggestion on.
  test("/suggest while a command waits sends the skip result and the suggestion", async () => {
    const h = await openTui({ request: "run: echo suggested-$((3*3))" });
    await h.until((f) => f.includes("Approve command?"));
    await h.type("/suggest use ls instead");
    await h.idle(2);
    const tail = messagesOf(h.requests()[1]).slice(-2);
    expect(tail).toMatchObject([
      { role: "tool", content: "Command execution skipped by user." },
      { role: "user", content: "I suggest you use ls instead" },
    ]);
    expect(await h.frame()).not.toContain("suggested-9");
    // The transcript says what the person said instead, under the command it answered (not only "rejected").
    expect(unwrapped(await h.frame(), "left")).toContain("your suggestion instead: use ls instead");
  });

  // /aa turns auto-approve on (shown in the footer): the next command runs without a dialog.
  test("/aa toggles auto-approve and the next command runs without asking", async () => {
    const h = await openTui();
    let frame = await h.until((f) => f.includes("auto-approve off"));
    await h.type("/aa");
    frame = await h.until((f) => footer(f).includes("auto-approve ON"));
    await h.type("run: echo auto-$((5+5))");
    let dialogSeen = false;
    frame = await h.until((f) => {
      if (f.includes("Approve command?")) dialogSeen = true;
      return f.includes("auto-10");
    });
    await h.idle(2);
    expect(dialogSeen).toBe(false);
    expect(messagesOf(h.requests()[1]).at(-1).content).toContain("auto-10");

    await h.type("/aa");
    frame = await h.until((f) => footer(f).includes("auto-approve off"));
    expect(frame).toContain("auto-approve off");
  });
});

describe("prompt history", () => {
  // Up/Down and Ctrl+P/Ctrl+N walk the history and give back the line in progress; the file holds
  // one entry per line, a multi-line prompt (here the CLI request) as one escaped line.
  test("Up/Down and Ctrl+P/Ctrl+N walk the history keeping the draft; the file holds the entries", async () => {
    const h = await openTui({ request: "first line\nsecond line" });
    await h.idle(1);
    let sent = 1;
    for (const prompt of ["alpha", "beta", "gamma"]) {
      await h.type(prompt);
      await h.idle(++sent);
    }
    await h.s.mockInput.typeText("draft");
    expect(h.tui.prompt.value).toBe("draft");

    h.s.mockInput.pressArrow("up");
    h.s.mockInput.pressArrow("up");
    await waitFor("Up Up to reach beta", () => h.tui.prompt.value === "beta");
    expect(await h.frame()).toContain("beta");
    h.s.mockInput.pressArrow("down");
    await waitFor("Down to reach gamma", () => h.tui.prompt.value === "gamma");
    h.s.mockInput.pressArrow("down");
    await waitFor("Down Down to give back the draft", () => h.tui.prompt.value === "draft");

    h.s.mockInput.pressKey("p", { ctrl: true });
    h.s.mockInput.pressKey("p", { ctrl: true });
    await waitFor("Ctrl+P Ctrl+P to reach beta", () => h.tui.prompt.value === "beta");
    h.s.mockInput.pressKey("n", { ctrl: true });
    h.s.mockInput.pressKey("n", { ctrl: true });
    await waitFor("Ctrl+N Ctrl+N to give back the draft", () => h.tui.prompt.value === "draft");

    const expected = ["first line\\nsecond line", "alpha", "beta", "gamma"];
    await waitFor(
      "the history file",
      () =>
        existsSync(h.historyFile) &&
        readFileSync(h.historyFile, "utf8").split("\n").filter(Boolean).length === expected.length,
    );
    expect(readFileSync(h.historyFile, "utf8")).toBe(expected.join("\n") + "\n");
    expect(h.requests()).toHaveLength(4); // walking the history sent nothing
  });

  // Ctrl+R: newest match first, Ctrl+R again for older, Enter accepts, Escape/Ctrl+G restore the line.
  test("Ctrl+R reverse search", async () => {
    const h = await openTui({ history: ["git status", "make test", "git commit -m x", "ls"] });
    await h.until((f) => f.includes("step 0/500"));

    h.s.mockInput.pressKey("r", { ctrl: true });
    await h.s.mockInput.typeText("git");
    let frame = await h.until(showsAll("reverse-i-search", "`git': git commit -m x"));
    expect(frame).toContain("`git': git commit -m x");
    h.s.mockInput.pressKey("r", { ctrl: true });
    frame = await h.until((f) => f.includes("`git': git status"));
    h.s.mockInput.pressEnter();
    await waitFor("Enter to accept the match", () => h.tui.prompt.value === "git status");
    frame = await h.until((f) => !f.includes("reverse-i-search"));
    // Accepting a match does not submit it. A submission would have emptied the prompt, added the
    // entry to the history and started the agent, all before the key handler returned.
    expect(h.tui.prompt.value).toBe("git status");
    expect(h.tui.history.entries).toEqual(["git status", "make test", "git commit -m x", "ls"]);
    expect(h.tui.agent.running).toBe(false);
    expect(h.requests()).toHaveLength(0);

    // Escape cancels: the line that was there comes back.
    h.s.mockInput.pressKey("r", { ctrl: true });
    await h.s.mockInput.typeText("make");
    await h.until((f) => f.includes("`make': make test"));
    h.s.mockInput.pressEscape();
    await waitFor("Escape to restore the line", () => h.tui.prompt.value === "git status");
    await h.until((f) => !f.includes("reverse-i-search"));
    expect(h.exitCode).toBeUndefined(); // Escape in the search cancels it, it does not quit

    // Ctrl+G cancels too; the search is case-insensitive.
    h.s.mockInput.pressKey("r", { ctrl: true });
    await h.s.mockInput.typeText("GIT");
    frame = await h.until(showsAll("`GIT': git commit -m x"));
    expect(frame).toContain("`GIT': git commit -m x");
    h.s.mockInput.pressKey("g", { ctrl: true });
    await h.until((f) => !f.includes("reverse-i-search"));
    expect(h.tui.prompt.value).toBe("git status");
  });

  // Two processes saving prompts at the same time lose none of them (proper-lockfile + atomic write).
  test("concurrent processes adding to one history file lose no entries", async () => {
    const file = join(scratch("aic-tui-"), "history");
    const writer = (prefix: string) =>
      Bun.spawn([process.execPath, join(ROOT, "tests", "history-writer.ts"), file, prefix, "200"], {
        cwd: ROOT,
        stdout: "pipe",
        stderr: "pipe",
      });
    const procs = [writer("A"), writer("B")];
    const results = await Promise.all(
      procs.map(async (p) => ({ code: await p.exited, stderr: await new Response(p.stderr).text() })),
    );
    for (const r of results) expect(r).toEqual({ code: 0, stderr: "" });
    const lines = readFileSync(file, "utf8").split("\n").filter(Boolean);
    const expected = ["A", "B"].flatMap((p) => Array.from({ length: 200 }, (_, i) => `${p}-${i}`));
    expect(lines.length).toBe(400);
    expect([...lines].sort()).toEqual([...expected].sort());
  }, 60_000);

  // At most 1000 entries, the oldest dropped; a prompt repeating the newest entry is folded.
  test("the history keeps the newest 1000 entries and folds consecutive duplicates", async () => {
    const file = join(scratch("aic-tui-"), "history");
    writeFileSync(file, Array.from({ length: 1000 }, (_, i) => `old-${i}`).join("\n") + "\n");
    const history = new PromptHistory(file);
    await history.add("new-1");
    await history.add("new-1");
    await history.add("new-2");
    const lines = readFileSync(file, "utf8").split("\n").filter(Boolean);
    expect(lines.length).toBe(1000);
    expect(lines.slice(0, 2)).toEqual(["old-2", "old-3"]);
    expect(lines.slice(-3)).toEqual(["old-999", "new-1", "new-2"]);
    expect(history.entries.slice(-3)).toEqual(["old-999", "new-1", "new-2"]);
  });

  // Saves begun back to back, none awaited (as the prompt does): the file keeps the order they were typed in.
  test("back-to-back saves, not awaited, land in the order they were typed", async () => {
    for (let run = 0; run < 20; run++) {
      const file = join(scratch("aic-tui-"), "history");
      const history = new PromptHistory(file);
      for (const prompt of ["first", "second", "third"]) void history.add(prompt);
      await history.settled();
      expect([run, readFileSync(file, "utf8").split("\n").filter(Boolean)]).toEqual([
        run,
        ["first", "second", "third"],
      ]);
    }
  });
});

describe("shell tab", () => {
  // Tab shows an interactive $SHELL that gets every key; Tab again shows the console with its
  // contents; a `cd` in the shell moves the agent's working directory.
  test("Tab switches Console/Shell; keys reach the shell; cd is followed", async () => {
    const saved = { cwd: process.cwd(), SHELL: process.env.SHELL, PS1: process.env.PS1 };
    try {
      process.env.SHELL = "/bin/sh";
      process.env.PS1 = "tui-sh> ";
      const h = await openTui({ request: "run: echo console-$((4*4))", args: ["--auto-approve"] });
      process.chdir(h.dir);
      await h.idle(2);
      let frame = await h.until((f) => f.includes("console-16"));

      h.s.mockInput.pressTab();
      frame = await h.until((f) => f.includes("tui-sh> ") && !f.includes("console-16"));
      expect(frame).not.toContain("console-16");
      await h.type("echo sh-$((2+3))");
      frame = await h.until((f) => f.includes("sh-5"));

      h.s.mockInput.pressTab();
      frame = await h.until((f) => f.includes("console-16") && !f.includes("sh-5") && !f.includes("tui-sh> "));
      expect(frame).not.toContain("sh-5");
      expect(frame).not.toContain("tui-sh> ");

      h.s.mockInput.pressTab();
      await h.until((f) => f.includes("sh-5"));
      await h.type("cd /tmp");
      await h.until((f) => f.includes(`the agent now works in ${realpathSync("/tmp")}`));
      h.s.mockInput.pressTab();
      await h.type("run: pwd");
      await h.idle(4);
      expect(messagesOf(h.requests()[3]).at(-1).content).toContain(`Output:\n${realpathSync("/tmp")}`);
    } finally {
      process.chdir(saved.cwd);
      for (const key of ["SHELL", "PS1"] as const) {
        if (saved[key] === undefined) delete process.env[key];
        else process.env[key] = saved[key];
      }
    }
  });
});

describe("status footer and steering", () => {
  // After a step with usage: step 1/max, a context estimate, the billable tokens and the session
  // file#id (on a wide terminal, so that nothing is cut; the next test covers 120 columns).
  test("footer shows step, ctx, tokens and the session", async () => {
    const h = await openTui({ request: "usage", width: 200 });
    await h.idle(1);
    const frame = await h.until((f) =>
      showsAll(`${BILLABLE} tok│`, "step 1/500", `.aicsession#${h.tui.session!.sessionId}`)(footer(f)),
    );
    const line = footer(frame);
    expect(line).toContain("step 1/500");
    const ctx = /ctx (\d+)\/([\d.]+k?)│/.exec(line);
    expect(ctx).not.toBeNull();
    expect(Number(ctx![1])).toBeGreaterThan(0);
    expect(line).toMatch(/\.aicsession#\d{8}_\d{6}/);
    expect(line).toContain(`.aicsession#${h.tui.session!.sessionId}`);
  });

  // At the usual 120 columns the one-line footer still has room for every field, the session last.
  test("at 120 columns the footer shows every field, including the session file and id", async () => {
    const h = await openTui({ request: "usage", width: 120 });
    await h.idle(1);
    const fields = [
      "Sandbox: off",
      "step 1/500",
      "ctx ",
      `${BILLABLE} tok│`,
      "tok/s",
      "idle",
      "auto-approve off",
      "test-model",
      `.aicsession#${h.tui.session!.sessionId}`,
    ];
    const line = footer(await h.until((f) => showsAll(...fields)(footer(f))));
    for (const field of fields) expect(line).toContain(field);
    expect(line).toContain(`.aicsession#${h.tui.session!.sessionId}`);
  });

  // A prompt typed while the agent runs is queued and joins the next request as a suggestion.
  test("a prompt typed while the agent runs becomes a steering suggestion", async () => {
    const dir = scratch("aic-tui-");
    const go = join(dir, "go");
    const h = await openTui({ args: ["--auto-approve"] });
    await h.type(`run: while [ ! -e ${go} ]; do sleep 0.05; done; echo released`);
    await waitFor("the first request", () => h.requests().length === 1);
    await h.until((f) => f.includes("$ while"));
    expect(h.tui.agent.running).toBe(true);
    await h.type("steer-left-please");
    await h.until((f) => f.includes("[queued suggestion] steer-left-please"));
    writeFileSync(go, "");
    await h.idle(2);
    const msgs = messagesOf(h.requests()[1]);
    expect(msgs.at(-2)).toMatchObject({ role: "tool" });
    expect(msgs.at(-2).content).toContain("released");
    expect(msgs.at(-1)).toEqual({ role: "user", content: "[Suggestion from user] steer-left-please" });
  });

  // A suggestion no turn used (the run ended first: interrupted, failed) goes back into the prompt, not into the next task.
  test("a suggestion queued when the run ends unused comes back into the prompt", async () => {
    const h = await openTui({ args: ["--auto-approve"] });
    await h.type("run: sleep 30; echo done-sleeping");
    await h.until((f) => f.includes("$ sleep 30"));
    await h.type("steer-me-back");
    await h.until((f) => f.includes("[queued suggestion] steer-me-back"));
    h.s.mockInput.pressEscape(); // interrupts the run before any step uses the suggestion
    await h.until((f) => f.includes("[suggestion not used: it is back in the prompt]"));
    expect(h.tui.prompt.value).toBe("steer-me-back");
    expect(JSON.stringify(h.requests().map((r) => messagesOf(r)))).not.toContain("steer-me-back");
  });
});

describe("session and quitting", () => {
  // Without --session the TUI keeps the conversation in ./.aicsession (mode 0600) and the next start
  // in that directory resumes it.
  test("the TUI defaults to ./.aicsession and resumes it at the next start", async () => {
    const cwd = process.cwd();
    const dir = scratch("aic-tui-");
    try {
      process.chdir(dir);
      const first = await openTui({ dir, defaultSession: true, request: "remember-this-task" });
      await first.idle(1);
      await first.tui.quit(0, "process_exit");
      expect(first.exitCode).toBe(0);
      const file = join(dir, ".aicsession");
      const doc = JSON.parse(readFileSync(file, "utf8"));
      expect(doc.reason).toBe("process_exit");
      expect(JSON.stringify(doc.messages)).toContain("remember-this-task");
      expect(statSync(file).mode & 0o777).toBe(0o600);

      const second = await openTui({ dir, defaultSession: true });
      await second.until((f) => f.includes("Restored"));
      expect(second.tui.session!.path).toBe(file);
      expect(second.tui.session!.sessionId).toBe(doc.session_id);
      await second.type("and-continue");
      await second.idle(1);
      const sent = messagesOf(second.requests()[0]);
      expect(sent.map((m) => m.content)).toContain("remember-this-task");
      expect(sent.at(-1)).toEqual({ role: "user", content: "and-continue" });
    } finally {
      process.chdir(cwd);
    }
  });

  // Ctrl+C interrupts a running agent and the TUI stays open (the footer says a second one quits);
  // a second Ctrl+C within 2 s quits, having saved the session.
  test("Ctrl+C interrupts the agent; a second Ctrl+C quits and the session is saved", async () => {
    const h = await openTui({ request: "hang" });
    await waitFor("the hanging request", () => h.requests().length === 1);
    await waitFor("the agent to run", () => h.tui.agent.running);
    h.s.mockInput.pressCtrlC();
    await waitFor("the agent to stop", () => !h.tui.agent.running);
    const frame = await h.until((f) => footer(f).includes("Ctrl+C again to quit") && f.includes("[interrupted]"));
    expect(frame).toContain("[interrupted]");
    expect(h.exitCode).toBeUndefined();
    h.s.mockInput.pressCtrlC();
    await waitFor("the TUI to quit", () => h.exitCode !== undefined);
    expect(h.exitCode).toBe(0);
    const doc = JSON.parse(readFileSync(h.sessionFile, "utf8"));
    expect(doc.reason).toBe("process_exit");
    expect(JSON.stringify(doc.messages)).toContain("hang");
  });

  // Escape never quits: with text in the prompt it clears it; with an empty prompt it interrupts the agent.
  test("Escape clears the prompt first, then interrupts the agent; the TUI stays open", async () => {
    const h = await openTui({ request: "hang" });
    await waitFor("the hanging request", () => h.requests().length === 1);
    await h.s.mockInput.typeText("half a thought");
    await waitFor("the typed text", () => h.tui.prompt.value === "half a thought");
    h.s.mockInput.pressEscape();
    await waitFor("the prompt to clear", () => h.tui.prompt.value === "");
    expect(h.tui.agent.running).toBe(true);
    h.s.mockInput.pressEscape();
    await waitFor("the agent to stop", () => !h.tui.agent.running);
    await h.until((f) => f.includes("[interrupted]"));
    await h.type("run: echo still-here");
    await h.until((f) => f.includes("Approve command?"));
    expect(h.exitCode).toBeUndefined();
  });
});

describe("slash commands", () => {
  // /session names the file and the id.
  test("/session prints the file and the id", async () => {
    const h = await openTui({ width: 200 });
    await h.type("/session");
    const frame = await h.until(showsAll(`[SESSION] file ${h.sessionFile}`, `id ${h.tui.session!.sessionId}`));
    expect(frame).toContain(`[SESSION] file ${h.sessionFile}`);
    expect(frame).toContain(`id ${h.tui.session!.sessionId}`);
    expect(h.tui.session!.sessionId).toMatch(/^\d{8}_\d{6}$/);
  });

  // /clear empties the conversation and writes an empty session with reason "cleared".
  test("/clear empties the conversation and the session file", async () => {
    const h = await openTui({ request: "something to forget" });
    await h.idle(1);
    expect(JSON.parse(readFileSync(h.sessionFile, "utf8")).messages.length).toBeGreaterThan(1);
    await h.type("/clear");
    await h.until((f) => f.includes("cleared") && savedReason(h) === "cleared");
    const doc = JSON.parse(readFileSync(h.sessionFile, "utf8"));
    expect(doc.reason).toBe("cleared");
    expect(doc.messages).toEqual([]);
    expect(h.tui.agent.messages).toEqual([]);
    // The next run starts from scratch.
    await h.type("fresh start");
    await h.idle(2);
    expect(messagesOf(h.requests()[1]).map((m) => m.role)).toEqual(["system", "user"]);
    expect(JSON.stringify(h.requests()[1]!.body.messages)).not.toContain("something to forget");
  });

  // /reload re-reads a session file edited by hand while the agent is stopped.
  test("/reload picks up a hand-edited session file", async () => {
    const h = await openTui({ request: "reload-original" });
    await h.idle(1);
    const text = readFileSync(h.sessionFile, "utf8");
    expect(text).toContain("reload-original");
    writeFileSync(h.sessionFile, text.replace("reload-original", "EDITED-CONTENT"));
    await h.type("/reload");
    await h.until((f) => f.includes("Restored"));
    await h.type("after-reload");
    await h.idle(2);
    const sent = JSON.stringify(messagesOf(h.requests()[1]));
    expect(sent).toContain("EDITED-CONTENT");
    expect(sent).not.toContain("reload-original");
    expect(messagesOf(h.requests()[1]).at(-1)).toEqual({ role: "user", content: "after-reload" });
  });

  // An unknown command lists them all, and slash commands are not saved to the history.
  test("an unknown command is one line; typing / lists the commands that match", async () => {
    const h = await openTui({ width: 200, height: 50 });
    await h.type("/foo");
    let frame = await h.until((f) => f.includes("Unknown command /foo; /help lists them all."));
    expect(frame).not.toContain("Commands:");
    await h.type("/rel");
    frame = await h.until((f) => f.includes("Unknown command /rel (did you mean /reload?)"));
    await h.s.mockInput.typeText("/s");
    const names = ["/suggest", "/session", "/stop", "/sandbox"];
    frame = await h.until(showsAll(...names, "(Tab completes)"));
    for (const name of names) expect(frame).toContain(name);
    expect(frame).not.toContain("/undo");
    h.tui.prompt.value = "";
    // A prompt that is saved joins the in-memory history before its file write starts, and a run
    // starts before Enter's handler returns: neither happened for /foo.
    expect(h.tui.history.entries).not.toContain("/foo");
    expect(existsSync(h.historyFile) ? readFileSync(h.historyFile, "utf8") : "").not.toContain("/foo");
    expect(h.tui.agent.running).toBe(false);
    expect(h.requests()).toHaveLength(0);
  });

  // Three failed attempts of one request are one line, updated in place, not three.
  test("retries of a failing request share one updating line", async () => {
    const h = await openTui({ request: "flaky: one" });
    const frame = await h.until((f) => f.includes("[completed]"));
    const retries = frame.split("\n").filter((l) => /model request failed/.test(l));
    expect(retries).toHaveLength(1);
    const text = frame.replace(/[│\s]+/g, " ");
    expect(text).toContain("retry 3 in");
    expect(text).not.toContain("retry 1 in");
    expect(h.requests().filter((r) => JSON.stringify(r.body).includes("flaky: one"))).toHaveLength(4);
  });

  // /stop ends a run whose model call never answers.
  test("/stop stops a running agent; until then the footer counts the seconds of the silent model", async () => {
    const h = await openTui({ request: "hang" });
    await waitFor("the hanging request", () => h.requests().length === 1);
    // While the model is silent the footer says so, with a spinner and the seconds counting up.
    const first = await h.until((f) => /waiting for the model \d+s/.test(footer(f)));
    const seconds = (f: string) => Number(/waiting for the model (\d+)s/.exec(footer(f))?.[1] ?? -1);
    await h.until((f) => seconds(f) > seconds(first));
    expect(h.tui.agent.running).toBe(true);
    await h.type("/stop");
    await waitFor("the agent to stop", () => !h.tui.agent.running);
    const frame = await h.until(
      (f) => f.includes("[interrupted]") && footer(f).includes("idle") && savedReason(h) === "interrupted",
    );
    expect(footer(frame)).toContain("idle");
    expect(h.exitCode).toBeUndefined();
    expect(JSON.parse(readFileSync(h.sessionFile, "utf8")).reason).toBe("interrupted");
  });
});

describe("panes", () => {
  // A pane keeps a bounded number of lines however much is appended.
  test("a LogPane keeps at most 5000 lines", async () => {
    await using s = await createTestRenderer({ width: 60, height: 20, exitOnCtrlC: false });
    const pane = new LogPane(ot, s.renderer, { width: "100%", height: "100%" });
    s.renderer.root.add(pane.box);
    for (let i = 0; i < 6000; i++) pane.append(`line-${i}\n`);
    await s.renderOnce();
    await s.renderOnce();
    expect(pane.lineCount).toBeLessThanOrEqual(5000);
    expect(pane.lineCount).toBeGreaterThan(4000);
    expect(s.captureCharFrame()).toContain("line-5999"); // it followed the newest line
  });

  // Scrolled up, the pane stays on the same lines while more arrive, also when old lines are trimmed.
  test("a scrolled-up LogPane stays put while lines are appended", async () => {
    await using s = await createTestRenderer({ width: 60, height: 20, exitOnCtrlC: false });
    const top = async () => {
      await s.renderOnce();
      await s.renderOnce();
      return s.captureCharFrame().split("\n")[0]!.trim().split(/\s+/)[0]!; // first word: the scrollbar sits at the right edge
    };

    const pane = new LogPane(ot, s.renderer, { width: "100%", height: "100%" });
    s.renderer.root.add(pane.box);
    for (let i = 0; i < 100; i++) pane.append(`a-${i}\n`);
    await top();
    pane.box.scrollTop = 0;
    expect(await top()).toBe("a-0");
    for (let i = 100; i < 150; i++) pane.append(`a-${i}\n`);
    expect(await top()).toBe("a-0");
    expect(pane.box.scrollTop).toBe(0);
    s.renderer.root.remove(pane.box);

    // Full pane: appending trims the oldest lines, and the view is moved to compensate.
    const full = new LogPane(ot, s.renderer, { width: "100%", height: "100%" });
    s.renderer.root.add(full.box);
    for (let i = 0; i < 6000; i++) full.append(`b-${i}\n`);
    await top();
    full.box.scrollTop = 2000;
    const before = await top();
    expect(before).toMatch(/^b-\d+$/);
    const scrollBefore = full.box.scrollTop;
    for (let i = 6000; i < 6300; i++) full.append(`b-${i}\n`);
    expect(await top()).toBe(before);
    expect(full.box.scrollTop).toBeLessThan(scrollBefore);
    expect(s.captureCharFrame()).not.toContain("b-6299");
  });

  // PgUp in the TUI scrolls the agent pane back, and it stays there while new output arrives.
  test("PgUp scrolls the agent pane and it stays put", async () => {
    const h = await openTui();
    for (let i = 0; i < 200; i++) h.tui.emit({ type: "info", text: `older-${i}` });
    await h.until((f) => f.includes("older-199"));
    h.s.mockInput.pressKey("\x1b[5~");
    const scrolled = await h.until((f) => !f.includes("older-199"));
    const visible = scrolled.match(/older-\d+/g)!;
    expect(visible.length).toBeGreaterThan(5);
    for (let i = 0; i < 20; i++) h.tui.emit({ type: "info", text: `newer-${i}` });
    const after = await h.frame();
    expect(after.match(/older-\d+/g)).toEqual(visible);
    expect(after).not.toContain("newer-19");
    h.s.mockInput.pressKey("\x1b[6~");
    h.s.mockInput.pressKey("\x1b[6~");
    h.s.mockInput.pressKey("\x1b[6~");
    await h.until((f) => f.includes("newer-19"));
  });
});

describe("keyToBytes (every key forwarded to the shell)", () => {
  // Keys as OpenTUI parses them from a terminal, in legacy and in kitty keyboard mode (where Ctrl+C
  // arrives as ESC[99;5u), turned into the bytes a shell on a PTY expects.
  for (const kittyKeyboard of [false, true]) {
    test(`control, arrows, Enter, Backspace, Alt and PgUp (${kittyKeyboard ? "kitty" : "legacy"} keyboard)`, async () => {
      await using s = await createTestRenderer({ width: 40, height: 10, exitOnCtrlC: false, kittyKeyboard });
      const keys: ot.KeyEvent[] = [];
      s.renderer.keyInput.on("keypress", (k: ot.KeyEvent) => void keys.push(k));
      const press = async (send: () => void) => {
        const n = keys.length;
        send();
        await waitFor("a key event", () => keys.length > n);
        return keys.at(-1)!;
      };
      expect(keyToBytes(await press(() => s.mockInput.pressCtrlC()))).toBe("\x03");
      const up = await press(() => s.mockInput.pressArrow("up"));
      expect(keyToBytes(up)).toBe("\x1b[A");
      expect(keyToBytes(up, true)).toBe("\x1bOA");
      expect(keyToBytes(await press(() => s.mockInput.pressEnter()))).toBe("\r");
      expect(keyToBytes(await press(() => s.mockInput.pressBackspace()))).toBe("\x7f");
      expect(keyToBytes(await press(() => s.mockInput.pressKey("x", { meta: true })))).toBe("\x1bx");
      expect(keyToBytes(await press(() => s.mockInput.pressEnter({ meta: true })))).toBe("\x1b\r");
      expect(keyToBytes(await press(() => s.mockInput.pressKey("\x1b[5~")))).toBe("\x1b[5~");
      expect(keyToBytes(await press(() => s.mockInput.pressKey("d", { ctrl: true })))).toBe("\x04");
      expect(keyToBytes(await press(() => s.mockInput.pressKey("a")))).toBe("a");
    });
  }
});

describe("TokenRate (the footer's tok/s)", () => {
  // Tokens per second over a 1 s window, 0 once nothing has streamed for 2 s.
  test("1 s window, decays to 0 after 2 s idle", () => {
    const rate = new TokenRate();
    const t0 = 1_000_000;
    expect(rate.rate(t0)).toBe(0);
    rate.add(5, t0);
    rate.add(3, t0 + 500);
    expect(rate.rate(t0 + 600)).toBe(8);
    expect(rate.rate(t0 + 1400)).toBe(3);
    expect(rate.rate(t0 + 1900)).toBe(0);
    expect(rate.rate(t0 + 2600)).toBe(0);
  });
});

describe("keys in awkward states (review findings)", () => {
  // Nothing is visible on a too-small terminal, so nothing typed there may start a run or approve a command.
  test("a too-small terminal swallows typing and approvals", async () => {
    const h = await openTui({ request: "run: echo blind-$((3*3))" });
    await h.until((f) => f.includes("Approve command?"));
    h.s.resize(40, 10);
    await h.until((f) => f.includes("too small"));
    // Every key below reaches the TUI's own handler (registered first) before this counter sees it.
    let keys = 0;
    h.s.renderer.keyInput.on("keypress", () => void keys++);
    h.s.mockInput.pressKey("y");
    await h.type("do a thing");
    await waitFor("the 12 keys (y, the ten characters, Enter) to be handled", () => keys >= 12);
    expect(keys).toBe(12);
    h.s.resize(120, 40);
    const frame = await h.until((f) => f.includes("Approve command?"));
    expect(frame).not.toContain("blind-9");
    expect(h.requests()).toHaveLength(1);
    expect(h.tui.prompt.value).toBe("");
  });

  // Text being typed when the dialog appears stays in the prompt: its `y` approves nothing;
  // Escape then clears the text and does not quit; with the prompt empty, Y approves.
  test("typing into the prompt does not answer the dialog; Escape clears it", async () => {
    const h = await openTui({ request: "run: echo typed-$((4*4))" });
    await h.until((f) => f.includes("Approve command?"));
    await h.s.mockInput.typeText("/sug yes");
    await waitFor("the text to reach the prompt", () => h.tui.prompt.value === "/sug yes");
    expect(h.tui.prompt.value).toBe("/sug yes");
    h.s.mockInput.pressEscape();
    await waitFor("Escape to clear the prompt", () => h.tui.prompt.value === "");
    expect(h.exitCode).toBeUndefined();
    expect(await h.frame()).toContain("Approve command?");
    h.s.mockInput.pressKey("y");
    h.s.mockInput.pressEnter(); // a line: y and Enter
    await h.until((f) => f.includes("typed-16"));
  });

  // A dialog appearing while Ctrl+R search is open closes the search, so Y answers the dialog.
  test("an approval closes an open reverse search", async () => {
    const h = await openTui({ history: ["git status"] });
    h.s.mockInput.pressKey("r", { ctrl: true });
    await h.until((f) => f.includes("reverse-i-search"));
    const tui = h.tui as unknown as { submit(v: string): Promise<void> };
    await tui.submit("run: echo searched-$((5*5))");
    await h.until((f) => f.includes("Approve command?") && !f.includes("reverse-i-search"));
    h.s.mockInput.pressKey("y");
    h.s.mockInput.pressEnter(); // a line: y and Enter
    await h.until((f) => f.includes("searched-25"));
  });

  // /clear starts the footer's step count over.
  test("/clear resets the footer's step", async () => {
    const h = await openTui({ request: "usage" });
    await h.idle(1);
    await h.until((f) => footer(f).includes("step 1/500"));
    await h.type("/clear");
    const frame = await h.until((f) => footer(f).includes("step 0/500"));
    expect(footer(frame)).toContain("step 0/500");
  });
});

describe("resume shows the restored context at once", () => {
  // The footer's context figure is the restored history's estimate before any model call, never 0.
  test("the footer's ctx figure is the restored history's size before the first call", async () => {
    const dir = scratch("aic-tui-");
    const history = Array.from({ length: 30 }, (_, i) => ({
      role: i % 2 ? "assistant" : "user",
      content: `message ${i} `.repeat(40),
    }));
    writeFileSync(
      join(dir, ".aicsession"),
      JSON.stringify({ aic_session_version: 1, messages: [{ role: "system", content: "s" }, ...history] }),
    );
    const h = await openTui({ dir });
    const frame = await h.until((f) => /ctx [1-9][\d.]*k?\//.test(footer(f)));
    expect(h.requests()).toHaveLength(0);
    expect(footer(frame)).toMatch(/ctx [1-9]/);
  });
});

/** The agent pane's column (left half) of a frame, one string per row. */
/** The rows of a frame inside the approval dialog's border. */
const dialogRows = (frame: string) => {
  const rows = frame.split("\n");
  const top = rows.findIndex((r) => r.includes("Approve command"));
  const bottom = rows.findIndex((r, i) => i > top && r.includes("╰"));
  return top < 0 ? [] : rows.slice(top, bottom + 1);
};

/** The agent pane's column (the left half) of a frame, one string per row, borders included. */
const agentColumn = (frame: string) => {
  const rows = frame.split("\n");
  const width = (rows[0] ?? "").indexOf("┐┌") + 1;
  return rows.map((row) => row.slice(0, width > 0 ? width : row.length / 2));
};

/**
 * A pane's text with its wrapping undone: the rows of one column inside its border, joined by single spaces.
 * A line the pane wrapped at a space reads as it was written, wherever the wrap fell (it moves with the width
 * of a figure such as "running for 115 ms").
 */
const unwrapped = (frame: string, column: "left" | "right") => {
  const rows = frame.split("\n");
  const split = (rows[0] ?? "").indexOf("┐┌") + 1;
  return rows
    .map((row) => (split > 0 ? (column === "left" ? row.slice(0, split) : row.slice(split)) : row))
    .map((row) =>
      row
        .replace(/^[│┌└]/, "")
        .replace(/[│┐┘]\s*$/, "")
        .trim(),
    )
    .filter(Boolean)
    .join(" ");
};

describe("a TUI a person can trust (round 2)", () => {
  // 1. With the dialog open and the prompt empty, the first letter of a sentence goes to the prompt; after
  // that Y and N are text. Typing "please modify" must not approve, "do it differently" must not reject.
  for (const sentence of ["please modify the flags", "do it differently, yes"]) {
    test(`typing "${sentence}" while the dialog is open neither approves nor rejects`, async () => {
      const h = await openTui({ request: "run: touch typed-approval.txt" });
      await h.until((f) => f.includes("Approve command?"));
      await h.s.mockInput.typeText(sentence);
      await waitFor("the sentence in the prompt", () => h.tui.prompt.value === sentence);
      const frame = await h.frame();
      expect(frame).toContain("Approve command?");
      expect(h.requests()).toHaveLength(1);
      expect(existsSync(join(h.dir, "typed-approval.txt"))).toBe(false);
      // Enter sends the sentence as a suggestion instead of the command.
      h.s.mockInput.pressEnter();
      await h.idle(2);
      const sent = messagesOf(h.requests()[1]);
      expect(sent.find((m: any) => m.role === "tool")?.content).toBe("Command execution skipped by user.");
      expect(sent.at(-1)).toMatchObject({ role: "user", content: `I suggest you ${sentence}` });
      expect(existsSync(join(h.dir, "typed-approval.txt"))).toBe(false);
    });
  }

  test("Up walks the history while the dialog is open", async () => {
    const h = await openTui({ request: "run: true", history: ["an older task"] });
    await h.until((f) => f.includes("Approve command?"));
    h.s.mockInput.pressArrow("up");
    await waitFor(
      "the history entry",
      () => h.tui.prompt.value === "run: true" || h.tui.prompt.value === "an older task",
    );
    expect(h.requests()).toHaveLength(1);
  });

  // 2. A long command: the dialog says how many lines, shows its end (the part that runs last) with the
  // buttons and hint on screen, and PgUp scrolls back to its start.
  test("a 43-line command: its end, the buttons and the hint are visible; PgUp reaches its start", async () => {
    const body = Array.from({ length: 41 }, (_, i) => `echo line-${String(i + 1).padStart(2, "0")}`).join("\n");
    const command = `cat <<'EOF' > /dev/null\n${body}\nEOF`;
    const h = await openTui({ request: `run: ${command}`, width: 120, height: 40 });
    const end = ["43 lines", "EOF", "line-41", "[Enter] Approve", "[Esc] Reject", "Enter approves"];
    let frame = await h.until(showsAll(...end));
    for (const text of end) expect(frame).toContain(text);
    expect(dialogRows(frame).join("\n")).not.toContain("cat <<'EOF'");
    for (let i = 0; i < 4; i++) h.s.mockInput.pressKey("\x1b[5~");
    frame = await h.until((f) => dialogRows(f).join("\n").includes("cat <<'EOF'") && f.includes("[Enter] Approve"));
    expect(frame).toContain("[Enter] Approve");
  });

  // Only the single keys answer: a typed line that starts with y or n is a suggestion, and reaches the model.
  test("'no need, use printf' and 'yes but quote it' typed at the dialog are suggestions", async () => {
    const h = await openTui({ request: "run: echo sugg-$((3*3))" });
    await h.until((f) => f.includes("Approve command?"));
    await h.type("no need, use printf");
    await h.idle(2);
    const first = messagesOf(h.requests()[1]);
    expect(first.at(-1)).toMatchObject({ role: "user", content: "I suggest you no need, use printf" });
    expect(await h.frame()).not.toContain("sugg-9");
    await h.type("run: echo again-$((4*4))");
    await h.until((f) => f.includes("Approve command?") && f.includes("again-$((4*4))"));
    await h.type("yes but quote it");
    await h.idle(2);
    expect(messagesOf(h.requests().at(-1)).at(-1)).toMatchObject({
      role: "user",
      content: "I suggest you yes but quote it",
    });
    expect(await h.frame()).not.toContain("again-16");
  });

  test("two commands in one turn: the dialog says which one of how many", async () => {
    const h = await openTui({ request: "two: echo first-one || echo second-one" });
    await h.until((f) => f.includes("Approve command 1 of 2?"));
    h.s.mockInput.pressKey("y");
    h.s.mockInput.pressEnter(); // a line: y and Enter
    await h.until((f) => f.includes("Approve command 2 of 2?"));
    h.s.mockInput.pressKey("n");
    h.s.mockInput.pressEnter();
    await h.idle(2);
    const tools = messagesOf(h.requests()[1]).filter((m: any) => m.role === "tool");
    expect(tools).toHaveLength(2);
    expect(tools[0].content).toContain("first-one");
    expect(tools[1].content).toBe("Command execution skipped by user.");
  });

  // 3. An approval arriving while the Shell tab has the keys brings the person back: the dialog shows,
  // and Y answers it instead of reaching the shell.
  test("an approval arriving on the Shell tab shows the dialog and takes Y", async () => {
    const saved = process.env.SHELL;
    process.env.SHELL = "/bin/sh";
    try {
      const h = await openTui();
      h.s.mockInput.pressTab();
      await h.until((f) => f.includes("Your own shell"));
      h.tui.submit("run: echo from-the-dialog");
      await h.until((f) => f.includes("Approve command?") && !f.includes("Your own shell"));
      expect(await h.frame()).not.toContain("Your own shell");
      h.s.mockInput.pressKey("y");
      h.s.mockInput.pressEnter(); // a line: y and Enter
      await h.idle(2);
      expect(messagesOf(h.requests()[1]).at(-1).content).toContain("from-the-dialog");
    } finally {
      if (saved === undefined) delete process.env.SHELL;
      else process.env.SHELL = saved;
    }
  });

  // 5. Multi-line input: a paste keeps its newlines, Ctrl+J and Alt+Enter insert one, and the task
  // reaches the model with them.
  test("a two-line paste, Ctrl+J and Alt+Enter make a multi-line task", async () => {
    const h = await openTui();
    await h.s.mockInput.pasteBracketedText("pasted line one\npasted line two");
    await waitFor("the paste", () => h.tui.prompt.value === "pasted line one\npasted line two");
    h.s.mockInput.pressKey("\n");
    await h.s.mockInput.typeText("third");
    h.s.mockInput.pressEnter({ meta: true });
    await h.s.mockInput.typeText("fourth");
    await waitFor("four lines", () => h.tui.prompt.value.split("\n").length === 4);
    h.s.mockInput.pressEnter();
    await h.idle(1);
    expect(messagesOf(h.requests()[0])[1].content).toBe("pasted line one\npasted line two\nthird\nfourth");
  });

  // 6. A command the person approved that waits for input is not stopped: the person's keys reach it.
  test("a hand-approved command waiting for input gets the person's keys", async () => {
    process.env.AIC_INPUT_WAIT_MS = "700";
    try {
      const h = await openTui({ request: "run: printf 'Name? '; read n; echo hello-$n" });
      await h.until((f) => f.includes("Approve command?"));
      h.s.mockInput.pressKey("y");
      h.s.mockInput.pressEnter(); // a line: y and Enter
      await h.until((f) => footer(f).includes("keys go to the command"));
      await h.s.mockInput.typeText("Ada");
      h.s.mockInput.pressEnter();
      await h.idle(2);
      expect(messagesOf(h.requests()[1]).at(-1).content).toContain("hello-Ada");
      expect(messagesOf(h.requests()[1]).at(-1).content).toContain("exit code 0");
    } finally {
      delete process.env.AIC_INPUT_WAIT_MS;
    }
  });

  // 7. A resume shows the restored conversation, newest turns whole, older ones counted.
  test("after a resume the agent pane shows the restored conversation", async () => {
    const dir = scratch("aic-tui-");
    const history = [{ role: "system", content: "s" }];
    for (let i = 1; i <= 30; i++)
      history.push({ role: "user", content: `task number ${i}` }, { role: "assistant", content: `answer number ${i}` });
    writeFileSync(join(dir, ".aicsession"), JSON.stringify({ aic_session_version: 1, messages: history }));
    const h = await openTui({ dir, height: 60, width: 140 });
    const frame = await h.until(showsAll("restored conversation above", "answer number 30", "> task number 30"));
    expect(frame).toContain("> task number 30");
    expect(frame).not.toContain("task number 1\n");
    const text = agentColumn(await h.frame()).join("\n");
    expect(text).not.toContain("task number 5 ");
  });

  // A resumed conversation shows its commands as commands (and keys as keys), never the call's JSON.
  test("after a resume, restored tool calls read as the commands they ran", async () => {
    const dir = scratch("aic-tui-");
    const call = (id: string, args: object) => ({
      id,
      type: "function",
      function: { name: "execute_bash", arguments: JSON.stringify(args) },
    });
    const history = [
      { role: "system", content: "s" },
      { role: "user", content: "count the files" },
      { role: "assistant", content: null, tool_calls: [call("c1", { command: "ls | wc -l" })] },
      { role: "tool", tool_call_id: "c1", content: "Command executed with exit code 0.\nOutput:\n3" },
      { role: "assistant", content: null, tool_calls: [call("c2", { input: "q\n" })] },
      { role: "tool", tool_call_id: "c2", content: "Command executed with exit code 0." },
      { role: "assistant", content: "There are 3 files." },
    ];
    writeFileSync(join(dir, ".aicsession"), JSON.stringify({ aic_session_version: 1, messages: history }));
    const h = await openTui({ dir });
    const frame = await h.until(showsAll("restored conversation above", "$ ls | wc -l", "⌨ q⏎"));
    expect(frame).not.toContain('{"command"');
    expect(frame).not.toContain('{"input"');
  });

  // The start is one line; /sandbox has the details.
  test("the start is one line naming model, endpoint and confinement", async () => {
    const h = await openTui({ width: 200, height: 40 });
    const frame = await h.until((f) => f.includes("aic ") && f.includes("· test-model @ 127.0.0.1:"));
    const start = agentColumn(frame).filter((row) => row.includes("test-model @"));
    expect(start).toHaveLength(1);
    expect(start[0]).toContain("sandbox: OFF · /sandbox, /help");
    expect(frame).not.toContain("Sandbox: off (");
  });

  // A dialog is about the newest lines: it brings the agent pane back to its end, wherever the person had scrolled.
  test("an approval dialog scrolls the agent pane back to its newest line", async () => {
    const h = await openTui({ width: 120, height: 30 });
    for (let i = 1; i <= 80; i++) h.tui.agentPane.line(`old line ${i}`);
    await h.until((f) => f.includes("old line 80"));
    h.tui.keys.page("agent", -1);
    h.tui.keys.page("agent", -1);
    await h.until((f) => !f.includes("old line 80"));
    await h.type("run: echo newest-$((6*7))");
    const frame = await h.until(
      (f) => f.includes("Approve command?") && agentColumn(f).join("\n").includes("$ echo newest"),
    );
    expect(agentColumn(frame).join("\n")).toContain("$ echo newest");
  });

  // 8. The footer keeps what matters at every width; the start-up warning fits.
  test("at 80 columns the footer keeps auto-approve, step and context whole, and the warning fits", async () => {
    const h = await openTui({ width: 80, height: 24 });
    const banner = (f: string) => f.split("\n").find((row) => row.includes("⚠")) ?? "";
    const frame = await h.until(
      (f) =>
        showsAll("auto-approve off", "step 0/500", "ctx ")(footer(f)) && banner(f).trimEnd().endsWith("auto-approve"),
    );
    for (const field of ["step 0/500", "ctx "]) expect(footer(frame)).toContain(field);
    expect(banner(frame).trimEnd().endsWith("auto-approve")).toBe(true);
  });

  test("at 120 columns with an approval pending, the footer shows it and the session id whole", async () => {
    const h = await openTui({ request: "run: true", width: 120 });
    const frame = await h.until((f) =>
      showsAll("⚠ approval pending", `#${h.tui.session!.sessionId}`, "auto-approve off")(footer(f)),
    );
    expect(footer(frame)).toContain(`#${h.tui.session!.sessionId}`);
    expect(footer(frame)).toContain("auto-approve off");
  });

  // 9. Markdown in the agent pane, word wrap, and colours kept in the console.
  test("the model's Markdown is rendered: no heading marks or asterisks, code without fences", async () => {
    const h = await openTui();
    await h.type("say: ## Result\\n\\nAll **twelve** tests pass.\\n\\n```ts\\nconst answer = 42;\\n```");
    // The person's own prompt is echoed raw ("> say: ## Result…"); the answer's rows are rendered.
    const rowsOf = (f: string) => agentColumn(f).map((r) => r.replace(/^│|│$/g, "").trim());
    const rendered = ["Result", "All twelve tests pass.", "const answer = 42;"];
    const frame = await h.until((f) => rendered.every((row) => rowsOf(f).includes(row)));
    const rows = rowsOf(frame);
    expect(rows).toContain("Result");
    expect(rows).toContain("All twelve tests pass.");
    expect(rows).toContain("const answer = 42;");
    expect(rows.filter((r) => r.startsWith("## ") || r.startsWith("```"))).toEqual([]);
  });

  test("the agent pane wraps at word boundaries", async () => {
    const h = await openTui({ width: 80, height: 30 });
    const text =
      "the project lives in /tmp/aic-wrap-check/a-rather-long/directory-name/of-ours and nowhere else at all";
    await h.type(`say: ${text}`);
    // A reply without a tool call hands the turn back to the person.
    const frame = await h.until((f) => f.includes("[answered]"));
    const rows = agentColumn(frame).map((r) => r.replace(/^│|│$/g, "").trimEnd());
    // The answer's rows are pieces of the text, in order; every break between two of them falls at a space or
    // right after a "/" or "-", never inside a word.
    const pieces = rows.map((r) => r.trim()).filter((r) => r.length > 3 && text.includes(r) && !r.startsWith(">"));
    expect(pieces.length).toBeGreaterThanOrEqual(2);
    let at = 0;
    for (const piece of pieces.slice(0, -1)) {
      at = text.indexOf(piece, at) + piece.length;
      expect(text[at] === " " || "/-".includes(text[at - 1] ?? "")).toBe(true);
    }
  });

  test("the console keeps the colours a command printed", async () => {
    const h = await openTui({ args: ["--auto-approve"] });
    await h.type("run: printf '\\033[31mred-word\\033[0m plain-word\\n'");
    await h.idle(2);
    // The output's own row, not the command line above it (drawn in the command colour, with the escapes as text).
    await h.until((f) => f.split("\n").some((row) => row.includes("red-word plain-word") && !row.includes("printf")));
    const row = h.s.captureSpans().lines.find((l: any) => {
      const text = l.spans.map((s: any) => s.text).join("");
      return text.includes("red-word plain-word") && !text.includes("printf");
    });
    expect(row).toBeDefined();
    const red = row!.spans.find((s: any) => s.text.includes("red-word"))!;
    const plain = row!.spans.find((s: any) => s.text.includes("plain-word"))!;
    expect(red).toBeDefined();
    expect(plain).toBeDefined();
    expect(String(red.fg)).not.toBe(String(plain.fg));
  });

  // 10. /help lists the keys; an unknown command says so; the Shell tab's prompt says where the keys go.
  test("/help lists the keys, /foo is unknown, and the Shell tab changes the prompt's hint", async () => {
    const h = await openTui({ width: 160, height: 60 });
    await h.type("/help");
    const keys = ["Tab", "Shift+Tab", "PgUp/PgDn", "Ctrl+R", "Esc", "Ctrl+C", "Alt+Enter"];
    let frame = await h.until(showsAll("Keys:", ...keys));
    for (const key of keys) expect(frame).toContain(key);
    await h.type("/foo");
    frame = await h.until((f) => f.includes("Unknown command /foo"));
    process.env.SHELL = "/bin/sh";
    h.s.mockInput.pressTab();
    frame = await h.until((f) => f.includes("The Shell tab has your keys") && !f.includes("Type a task"));
    expect(frame).not.toContain("Type a task");
  });

  // 12. The smaller things.
  test("tok/s falls back to 0 once the answer has streamed", async () => {
    const h = await openTui();
    await h.type("slow: streaming a few tokens");
    await h.until((f) => /[1-9]\d* tok\/s/.test(footer(f)));
    await h.idle(1);
    await h.until((f) => footer(f).includes("│0 tok/s"));
  });

  test("/suggest with nothing pending keeps its text; /clear while the agent runs does nothing and says so", async () => {
    const h = await openTui();
    await h.type("/suggest try the other flag");
    await h.until(
      (f) => f.includes("your text is back in the prompt") && h.tui.prompt.value === "/suggest try the other flag",
    );
    expect(h.tui.prompt.value).toBe("/suggest try the other flag");
    h.tui.prompt.value = "";
    await h.type("hang");
    await waitFor("the agent to run", () => h.tui.agent.running);
    const before = h.tui.agent.history.messages.length;
    await h.type("/clear");
    const frame = await h.until((f) => unwrapped(f, "left").includes("/clear does nothing now"));
    // Still running, the conversation whole.
    expect(h.tui.agent.running).toBe(true);
    expect(h.tui.agent.history.messages.length).toBeGreaterThanOrEqual(before);
    expect(unwrapped(frame, "left")).not.toContain("cleared; new session");
  });

  // Background jobs in the TUI: announced in the console, counted in the footer, listed by /jobs and
  // stopped by /jobs kill N (the process is gone from /proc).
  test("/jobs lists what a command left running and /jobs kill stops it", async () => {
    const h = await openTui({ request: "run: sleep 300 & echo started", args: ["--auto-approve"] });
    let frame = await h.until((f) => /\[job 1 started: pid \d+, sleep 300/.test(unwrapped(f, "right")));
    const pid = Number(/\[job 1 started: pid (\d+)/.exec(unwrapped(frame, "right"))![1]);
    expect(readFileSync(`/proc/${pid}/cmdline`, "utf8")).toBe("sleep\x00300\x00");
    await h.idle(2);
    frame = await h.until((f) => footer(f).includes("1 job"));
    await h.type("/jobs");
    await h.until((f) => {
      const agent = unwrapped(f, "left");
      return (
        new RegExp(`\\[job 1\\] running for \\d+ m?s: process group ${pid} \\(sleep 300\\)`).test(agent) &&
        agent.includes(`stop it with: kill -- -${pid}`)
      );
    });
    await h.type("/jobs kill 1");
    frame = await h.until((f) => unwrapped(f, "left").includes("Stopped job 1 (sleep 300)."));
    await waitFor("the job's process to be gone", () => {
      const stat = existsSync(`/proc/${pid}/stat`) ? readFileSync(`/proc/${pid}/stat`, "utf8") : "";
      return !stat || / Z /.test(stat);
    });
    frame = await h.until((f) => !footer(f).includes("job"));
    await h.type("/jobs kill 1");
    await h.until((f) => unwrapped(f, "left").includes("Job 1 is not running (stopped by the person after"));
  });

  // Command rules in the TUI: an allowed command runs without the dialog; for an asked one the dialog offers
  // "Always allow", which (clicked, or /always) runs it and adds the rule, so the next such command is not asked.
  test("rules: allow skips the dialog; Always allow (click or /always) adds the person's own rule and runs it", async () => {
    const dir = scratch("aic-tui-rules-");
    const rulesFile = join(dir, "rules");
    const teamRules = "allow printf *\ndeny git push *  # pushing needs a person\n";
    writeFileSync(rulesFile, teamRules);
    // The person's own rules belong to the project (its directory's device and inode), in the state directory.
    const saved = { cwd: process.cwd(), state: process.env.XDG_STATE_HOME };
    process.env.XDG_STATE_HOME = join(dir, "state");
    process.chdir(dir);
    try {
      const st = statSync(dir);
      const own = join(dir, "state", "aic", "own-rules", `${st.dev}-${st.ino}.aicrules`);
      const ownRules = () => (existsSync(own) ? readFileSync(own, "utf8").replace(/^#.*\n/, "") : "");
      const h = await openTui({ request: "run: printf 'allowed-%s\\n' $((6*7))", args: ["--rules", rulesFile], dir });
      let frame = await h.until(showsAll("allowed-42", "(runs without asking: allow printf *)"));
      expect(frame).not.toContain("Approve command");
      expect(frame).toContain("(runs without asking: allow printf *)");
      await h.idle(2);

      await h.type("run: echo clicked-$((2*3))");
      frame = await h.until((f) => f.includes("Always allow: allow echo *"));
      const rows = frame.split("\n");
      const row = rows.findIndex((r) => r.includes("Always allow: allow echo *"));
      await h.s.mockMouse.click(rows[row]!.indexOf("Always allow") + 2, row);
      await h.until((f) => f.includes("clicked-6") && ownRules() === "allow echo *\n");
      // The team's file is as it was: nothing for a commit to pick up.
      expect(readFileSync(rulesFile, "utf8")).toBe(teamRules);
      await h.idle(4);

      // Now allowed: no dialog.
      await h.type("run: echo no-dialog-$((3*3))");
      frame = await h.until(showsAll("no-dialog-9", "(runs without asking: allow echo *)"));
      expect(frame).toContain("(runs without asking: allow echo *)");
      await h.idle(6);

      // /always from the keyboard, for another program; and /rules shows both files and what is in force.
      await h.type("run: date +%Y-always");
      await h.until((f) => f.includes("Always allow: allow date *"));
      await h.type("/always");
      await h.until((f) => /\d{4}-always/.test(f));
      expect(ownRules()).toBe("allow echo *\nallow date *\n");
      await h.idle(8);
      await h.type("/rules");
      const inForce = ["line 1: allow printf *", "line 1: allow echo *", "line 2: allow date *"];
      frame = await h.until(showsAll(`Rules from ${rulesFile}`, "Your own rules", ...inForce));
      for (const line of inForce) expect(frame).toContain(line);
      expect(frame.replace(/[│\s]+/g, "")).toContain(own.replace(/\s+/g, ""));
      // The model is told the new rules in the system prompt of its next request.
      await h.type("usage");
      await h.idle(9);
      expect(messagesOf(h.requests()[8])[0].content).toContain(
        "these run without asking: `printf *`, `echo *`, `date *`",
      );
    } finally {
      process.chdir(saved.cwd);
      if (saved.state === undefined) delete process.env.XDG_STATE_HOME;
      else process.env.XDG_STATE_HOME = saved.state;
    }
  });

  // /undo and /redo in the TUI: the files go back and forth, the conversation is cut and restored, and the
  // model's next request no longer holds the undone turn.
  test("/undo puts the files back and cuts the conversation; /redo restores both", async () => {
    await inProjectDirectory("aic-tui-undo-", async (dir) => {
      writeFileSync(join(dir, "a.txt"), "original\n");
      const h = await openTui({
        request: "run: echo changed > a.txt; rm -f b.txt; echo new > c.txt",
        args: ["--auto-approve"],
        checkpoints: true,
        dir,
      });
      await h.idle(2);
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("changed\n");
      await h.type("/undo");
      const read = (name: string) => (existsSync(join(dir, name)) ? readFileSync(join(dir, name), "utf8") : undefined);
      let frame = await h.until(
        (f) =>
          showsAll("Undid `echo changed > a.txt", "restored (1): a.txt", "removed (1): c.txt")(f) &&
          read("a.txt") === "original\n" &&
          read("c.txt") === undefined,
      );
      expect(frame).toContain("restored (1): a.txt");
      expect(frame).toContain("removed (1): c.txt");
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("original\n");
      expect(existsSync(join(dir, "c.txt"))).toBe(false);
      await h.type("/redo");
      frame = await h.until((f) => f.includes("Redid 1 command(s)") && read("a.txt") === "changed\n");
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("changed\n");
      await h.type("/undo");
      await h.until((f) => f.split("Undid `echo changed").length === 3);
      await h.type("usage");
      await h.idle(3);
      const sent = messagesOf(h.requests()[2]);
      expect(sent.map((m: any) => m.role)).toEqual(["system", "user", "user"]);
      // The request stays (the person asked it); the turn that ran the command and its result are gone.
      expect(sent.some((m: any) => m.tool_calls || m.role === "tool")).toBe(false);
    });
  });

  // A new user's finding: while a command ran the footer said only "running" (the approval event, which comes
  // after the command's, cleared its counter).
  test("while an approved command runs, the footer counts its seconds", async () => {
    const h = await openTui({ request: "run: sleep 3", args: ["--auto-approve"] });
    const frame = await h.until((f) => /command running [1-9]\d*s/.test(footer(f)));
    expect(footer(frame)).toMatch(/command running [1-9]\d*s/);
  });

  // A new user's finding: /undo after /clear said the turn was "compressed away".
  test("/undo after /clear puts the files back and names /clear as a reason the turn is gone", async () => {
    await inProjectDirectory("aic-tui-undo-clear-", async (dir) => {
      writeFileSync(join(dir, "a.txt"), "original\n");
      const h = await openTui({
        request: "run: echo changed > a.txt",
        args: ["--auto-approve"],
        checkpoints: true,
        dir,
      });
      await h.idle(2);
      await h.type("/clear");
      await h.until((f) => unwrapped(f, "left").includes("cleared; new session"));
      await h.type("/undo");
      const frame = await h.until((f) => unwrapped(f, "left").includes("or cleared with /clear"));
      expect(unwrapped(frame, "left")).toContain("Undid `echo changed > a.txt");
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("original\n");
    });
  });

  // A new user's finding: /diff of a command that changed a whole tree pushed the conversation out of the pane.
  test("/diff shows at most 400 lines and says how to see the rest", async () => {
    await inProjectDirectory("aic-tui-diff-", async (dir) => {
      const h = await openTui({
        request: "run: seq 1 1000 > many.txt",
        args: ["--auto-approve"],
        checkpoints: true,
        dir,
      });
      await h.idle(2);
      await h.type("/diff");
      const frame = await h.until((f) => unwrapped(f, "left").includes("more line(s): `aic diff` in a shell"));
      const more = Number(/… (\d+) more line\(s\)/.exec(unwrapped(frame, "left"))?.[1]);
      // 1,000 added lines and the diff's header: all but the first 400 left out.
      expect(more).toBeGreaterThan(600);
      expect(more).toBeLessThan(610);
    });
  });

  test("the Ctrl+R line sits above the prompt, never over the panes' border", async () => {
    const h = await openTui({ history: ["find me later"] });
    h.s.mockInput.pressKey("\x12");
    const frame = await h.until((f) => f.includes("reverse-i-search"));
    const rows = frame.split("\n");
    const search = rows.findIndex((r) => r.includes("reverse-i-search"));
    expect(rows[search - 1]?.includes("└") || rows[search - 2]?.includes("└")).toBe(true);
    expect(rows[search]!.includes("└")).toBe(false);
  });
});
