/**
 * The terminal UI end to end (README: "The terminal UI"): the compiled dist/aic in a real
 * terminal (tmux 3.3, 120×40), driven with keystrokes, against the fake model
 * server running in this process.
 *
 * Each tmux server gets its own socket (`tmux -L aic-test-<random>`) and is
 * killed at the end, so tests can run in parallel. Commands the model runs
 * wait on "gate" files that the test creates once it has done what it needs
 * in between, so nothing depends on how fast the machine is.
 */
import { afterEach, expect, test } from "bun:test";
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { AIC, Tmux, bash, cleanEnv, footer, has, perTestFixtures, runAic, scratch, toolAnswer } from "./helpers.ts";

const WIDTH = 120;

/** The right half of the screen (the Console Output / Shell pane), one string per row, borders removed. */
function rightPaneRows(screen: string): string[] {
  return screen.split("\n").map((row) =>
    Array.from(row)
      .slice(WIDTH / 2)
      .join("")
      .replace(/[│┃║]/g, "")
      .trim(),
  );
}

/**
 * Whether the outer shell has printed `EXIT=<code>` after aic and its prompt after that: the
 * whole of aic's exit is on screen, not a frame caught halfway through.
 */
const exitedToPrompt = (screen: string) => /EXIT=\d+\n+outer\$/.test(screen);

/** A tool result's lines, trimmed (to compare a whole line such as `/tmp`, not a prefix of `/tmp/x`). */
function outputLines(toolResult: string): string[] {
  return toolResult.split("\n").map((l) => l.trim());
}

const fixtures = perTestFixtures();
/** The tmux servers of a test, killed after it whatever happens. */
const sessions: Tmux[] = [];
afterEach(() => {
  for (const tmux of sessions.splice(0)) tmux.kill();
});

// The approval dialog, approving with Y, live command output in the console pane, /aa
// turning auto-approve on for the next command, the Shell tab's `cd` followed by the agent, Ctrl+C
// twice quitting with the terminal restored and the exit line, and the conversation saved in
// ./.aicsession.
// Needs tmux; skipped without it.
test.skipIf(!has.tmux)(
  "a TUI session in tmux: approve, /aa, Shell tab cd followed by the agent, Ctrl+C twice restores the terminal and saves",
  async () => {
    const [home, cwd, gates] = ["aic-tui-home-", "aic-tui-cwd-", "aic-tui-gates-"].map((prefix) =>
      fixtures.disposable(scratch(prefix)),
    ) as [string, string, string];
    const gate = (name: string) => join(gates, name);
    const waitGate = (name: string) => `until [ -e ${gate(name)} ]; do sleep 0.02; done`;

    // The model's turns: each command holds until the test opens its gate, so the test can act in between.
    const commands = [
      `echo hi-$((6*7)); ${waitGate("after-approval")}`,
      `echo auto-$((5*5)); ${waitGate("after-cd")}`,
      "pwd",
    ];
    const srv = fixtures.serve((_req, index) =>
      index < commands.length ? bash(commands[index]!, `call_${index}`) : { content: "All done.\nTASKCOMPLETE" },
    );

    const env = cleanEnv({ HOME: home, SHELL: "/bin/bash", PS1: "outer$ ", TERM: "xterm-256color" });
    const tmux = new Tmux(env, cwd, ["bash", "--norc", "--noprofile"]);
    sessions.push(tmux);
    await tmux.waitFor("the outer shell's prompt", (s) => s.includes("outer$"));

    // A person types the command in their shell; the wrapper prints aic's exit code afterwards.
    tmux.type(
      `${AIC} --api-base ${srv.url} --model test-model --ask-every-command 'say hi in the terminal'; echo EXIT=$?`,
    );
    tmux.keys("Enter");

    // The first command waits for approval in a dialog that shows it.
    let screen = await tmux.waitFor(
      "the approval dialog",
      (s) => s.includes("Approve command?") && s.includes("echo hi-$((6*7))"),
    );
    expect(tmux.display("#{alternate_on}")).toBe("1");
    expect(screen).not.toContain("hi-42");

    // Y approves: the command runs and its output streams into the console pane.
    tmux.keys("y", "Enter");
    screen = await tmux.waitFor(
      "hi-42 in the console pane and the dialog gone",
      (s) => rightPaneRows(s).some((r) => r.includes("hi-42")) && !s.includes("Approve command?"),
    );
    expect(screen).not.toContain("Approve command?");

    // /aa while the command still runs turns auto-approve on (footer), for the next command.
    tmux.type("/aa");
    tmux.keys("Enter");
    await tmux.waitFor("the footer saying auto-approve ON", (s) => footer(s).includes("auto-approve ON"));
    writeFileSync(gate("after-approval"), "");

    // The next command runs without asking.
    screen = await tmux.waitFor("auto-25 in the console pane", (s) =>
      rightPaneRows(s).some((r) => r.includes("auto-25")),
    );
    expect(screen).not.toContain("Approve command?");
    expect(srv.requests.length).toBe(2);

    // Shell tab: cd /tmp, confirmed by the shell itself, then back to the console.
    tmux.keys("Tab");
    tmux.type("cd /tmp && echo shell-now-in-$PWD");
    tmux.keys("Enter");
    await tmux.waitFor("the Shell tab's cd", (s) => s.includes("shell-now-in-/tmp"));
    tmux.keys("Tab");
    await tmux.waitFor("the console pane again", (s) => rightPaneRows(s).some((r) => r.includes("auto-25")));
    // The agent follows the Shell tab on its own, while a command still runs, and says so in its pane
    // (the next test covers a command that starts right after the cd).
    await tmux.waitFor("the agent pane saying it follows the Shell tab", (s) => s.includes("agent now works in /tmp"));
    writeFileSync(gate("after-cd"), "");

    // The agent's next command runs where the person went.
    screen = await tmux.waitFor("pwd's output (/tmp) in the console pane", (s) => {
      const rows = rightPaneRows(s);
      const at = rows.findIndex((r) => r.includes("$ pwd"));
      return at >= 0 && rows[at + 1] === "/tmp";
    });
    const pwdRows = rightPaneRows(screen);
    expect(pwdRows[pwdRows.findIndex((r) => r.includes("$ pwd")) + 1]).toBe("/tmp");
    await tmux.waitFor("the run to finish", () => srv.requests.length >= 4);
    expect(outputLines(toolAnswer(srv.requests[3], "call_2"))).toContain("/tmp");

    // Ctrl+C twice quits: the outer shell's prompt is back after one line saying where the conversation
    // is and how to continue it, and the terminal left the alternate screen.
    tmux.keys("C-c");
    await tmux.waitFor("the footer saying a second Ctrl+C quits", (s) => footer(s).includes("Ctrl+C again to quit"));
    tmux.keys("C-c");
    screen = await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
    // tmux wraps the long exit line at its width, so it is read with the line breaks taken out.
    const unwrapped = screen.replace(/\n/g, "");
    expect(unwrapped).toContain(`aic: the conversation is saved in ${join(cwd, ".aicsession")}`);
    expect(unwrapped).toContain(`to continue it: cd ${cwd} && aicEXIT=0outer$`);
    expect(tmux.display("#{alternate_on}")).toBe("0");
    expect(tmux.display("#{mouse_any_flag}")).toBe("0");

    // The conversation is in .aicsession in the directory aic started in.
    const sessionFile = join(cwd, ".aicsession");
    expect(existsSync(sessionFile)).toBe(true);
    const session = JSON.parse(readFileSync(sessionFile, "utf8"));
    const messages: any[] = session.messages;
    expect(messages.find((m) => m.role === "user")?.content).toContain("say hi in the terminal");
    const toolResults = messages.filter((m) => m.role === "tool").map((m) => String(m.content));
    expect(toolResults.some((c) => c.includes("hi-42"))).toBe(true);
    expect(toolResults.some((c) => c.includes("auto-25"))).toBe(true);
    expect(toolResults.some((c) => outputLines(c).includes("/tmp"))).toBe(true);
  },
  180_000,
);

// When the Shell tab's shell changes directory, aic follows it, so the agent's next command runs
// there — also when that command starts right after the cd (here the shell's own `touch` releases
// the agent, so the next command starts within milliseconds of the cd). Needs tmux; skipped without it.
test.skipIf(!has.tmux)(
  "the agent's next command runs in the Shell tab's new directory even when it starts right after the cd",
  async () => {
    const [home, cwd, gates] = ["aic-tui-home-", "aic-tui-cwd-", "aic-tui-gates-"].map((prefix) =>
      fixtures.disposable(scratch(prefix)),
    ) as [string, string, string];
    const gate = join(gates, "cd-done");
    const commands = [`until [ -e ${gate} ]; do sleep 0.01; done; echo released`, "pwd"];
    const srv = fixtures.serve((_req, index) =>
      index < commands.length ? bash(commands[index]!, `call_${index}`) : { content: "TASKCOMPLETE" },
    );
    const env = cleanEnv({ HOME: home, SHELL: "/bin/bash", PS1: "outer$ ", TERM: "xterm-256color" });
    const tmux = new Tmux(env, cwd, ["bash", "--norc", "--noprofile"]);
    sessions.push(tmux);
    await tmux.waitFor("the outer shell's prompt", (s) => s.includes("outer$"));
    tmux.type(`${AIC} --auto-approve --api-base ${srv.url} --model test-model 'where am I'; echo EXIT=$?`);
    tmux.keys("Enter");
    await tmux.waitFor("the first command to start", (s) => rightPaneRows(s).some((r) => r.startsWith("$ until")));

    tmux.keys("Tab");
    tmux.type(`cd /tmp && touch ${gate}`);
    tmux.keys("Enter");
    await tmux.waitFor("the run to finish", () => srv.requests.length >= 3);
    expect(outputLines(toolAnswer(srv.requests[1], "call_0"))).toContain("released");
    expect(outputLines(toolAnswer(srv.requests[2], "call_1"))).toContain("/tmp");

    tmux.keys("Tab");
    tmux.keys("C-c");
    tmux.keys("C-c");
    await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
  },
  120_000,
);

// The TUI needs a terminal; without one aic says to use --nogui and exits 2 (usage error)
// instead of drawing into a pipe or hanging.
test("without a terminal on stdin the TUI refuses with exit 2 and points at --nogui", async () => {
  const srv = fixtures.serve([]);
  const home = fixtures.disposable(scratch("aic-tui-home-"));
  const r = await runAic(["--api-base", srv.url, "--model", "m", "do something"], {
    cwd: home,
    killAfterMs: 30_000,
    env: { HOME: home },
  });
  expect(r.code).toBe(2);
  expect(r.stderr).toContain("--nogui");
  expect(r.stderr.trim().split("\n").length).toBe(1);
  expect(srv.requests.length).toBe(0);
});

/** Starts aic in a fresh tmux shell with the fake model at `url`; returns the tmux session and the directories. */
async function startTui(url: string, extra = "", size = { width: WIDTH, height: 40 }) {
  const [home, cwd] = ["aic-tui-home-", "aic-tui-cwd-"].map((prefix) => fixtures.disposable(scratch(prefix))) as [
    string,
    string,
  ];
  const env = cleanEnv({ HOME: home, SHELL: "/bin/bash", PS1: "outer$ ", TERM: "xterm-256color" });
  const tmux = new Tmux(env, cwd, ["bash", "--norc", "--noprofile"], size);
  sessions.push(tmux);
  await tmux.waitFor("the outer shell's prompt", (s) => s.includes("outer$"));
  tmux.type(`${AIC} --api-base ${url} --model test-model --ask-every-command ${extra} 'do the task'; echo EXIT=$?`);
  tmux.keys("Enter");
  return { tmux, home, cwd };
}

/** The rows of a screen inside the approval dialog's border. */
function dialogRows(screen: string): string[] {
  const rows = screen.split("\n");
  const top = rows.findIndex((r) => r.includes("Approve command"));
  const bottom = rows.findIndex((r, i) => i > top && r.includes("╰"));
  return top < 0 ? [] : rows.slice(top, bottom + 1);
}

// A person types a sentence just as the dialog opens: its y and n are text, nothing is approved or
// rejected, and the sentence is in the prompt. Needs tmux; skipped without it.
test.skipIf(!has.tmux)(
  "typing a sentence with y and n into an open dialog runs nothing; the sentence stays in the prompt",
  async () => {
    const srv = fixtures.serve([bash("touch ran-by-accident.txt")]);
    const { tmux, cwd } = await startTui(srv.url);
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    const sentence = "please modify it, yes only if nothing breaks";
    tmux.type(sentence);
    const screen = await tmux.waitFor(
      "the sentence in the prompt, the dialog still open",
      (s) => s.includes(sentence) && s.includes("Approve command?"),
    );
    expect(screen).toContain("Approve command?");
    expect(srv.requests.length).toBe(1);
    expect(existsSync(join(cwd, "ran-by-accident.txt"))).toBe(false);
    tmux.keys("C-c");
    tmux.keys("C-c");
    await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
    expect(existsSync(join(cwd, "ran-by-accident.txt"))).toBe(false);
  },
);

// A 43-line command: the dialog says how long it is, shows its end (the part that runs last) with the
// buttons on screen, and PgUp reaches its start. Needs tmux; skipped without it.
test.skipIf(!has.tmux)("a 43-line command shows its end and its buttons; PgUp reaches its start", async () => {
  const body = Array.from({ length: 41 }, (_, i) => `echo line-${String(i + 1).padStart(2, "0")}`).join("\n");
  const srv = fixtures.serve([bash(`cat <<'EOF' > /dev/null\n${body}\nEOF`)]);
  const { tmux } = await startTui(srv.url);
  const end = ["43 lines", "line-41", "EOF", "[Enter] Approve", "[Esc] Reject"];
  let screen = await tmux.waitFor("the dialog with the command's end and the buttons", (s) => {
    const dialog = dialogRows(s).join("\n");
    return end.every((text) => dialog.includes(text));
  });
  const dialog = dialogRows(screen).join("\n");
  for (const text of end) expect(dialog).toContain(text);
  expect(dialog).not.toContain("cat <<'EOF'");
  for (let i = 0; i < 4; i++) tmux.keys("PPage");
  screen = await tmux.waitFor("the command's start and the buttons", (s) => {
    const dialog = dialogRows(s).join("\n");
    return dialog.includes("cat <<'EOF'") && dialog.includes("[Enter] Approve");
  });
  expect(dialogRows(screen).join("\n")).toContain("[Enter] Approve");
  tmux.keys("n", "Enter");
  tmux.keys("C-c");
  tmux.keys("C-c");
  await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
});

// Escape interrupts a running command and the TUI stays open for the next task; Ctrl+C twice then quits,
// leaving the line that says where the conversation is. Needs tmux; skipped without it.
test.skipIf(!has.tmux)("Escape interrupts a running command and the TUI stays; Ctrl+C twice quits", async () => {
  const srv = fixtures.serve([bash("sleep 300")]);
  const { tmux, cwd } = await startTui(srv.url, "--auto-approve");
  await tmux.waitFor("the command running", (s) => rightPaneRows(s).some((r) => r.includes("$ sleep 300")));
  tmux.keys("Escape");
  let screen = await tmux.waitFor("the interruption", (s) => s.includes("[interrupted]"));
  expect(tmux.display("#{alternate_on}")).toBe("1");
  expect(screen).not.toContain("EXIT=");
  // Interrupted, the agent waits for the person: it asks the model nothing more.
  expect(srv.requests).toHaveLength(1);
  tmux.keys("C-c");
  tmux.keys("C-c");
  screen = await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
  expect(screen).toMatch(/aic: the conversation is saved in .*\.aicsession/);
  expect(screen).toContain("EXIT=0");
  // The saved conversation holds the command's answer, marked as interrupted by the person.
  const saved = readFileSync(join(cwd, ".aicsession"), "utf8");
  expect(saved).toContain("sleep 300");
  expect(saved).toMatch(/interrupted/);
});

// With --no-session, quitting says that nothing was saved, so nobody looks for a file that is not there.
test.skipIf(!has.tmux)("quitting with --no-session says nothing was saved", async () => {
  const srv = fixtures.serve([{ content: "hello\nTASKCOMPLETE" }]);
  const { tmux, cwd } = await startTui(srv.url, "--no-session");
  await tmux.waitFor("the answer", (s) => s.includes("hello"));
  tmux.keys("C-d");
  const screen = await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
  expect(screen).toContain("aic: nothing was saved (--no-session).");
  expect(screen).toContain("EXIT=0");
  expect(existsSync(join(cwd, ".aicsession"))).toBe(false);
});

// The Shell tab is the person's own shell: the sandbox that confines the agent's commands does not
// confine it. Needs tmux and Landlock; skipped without them.
test.skipIf(!has.tmux || !has.landlock)("the Shell tab is not sandboxed; the agent's commands are", async () => {
  const outside = `/var/tmp/aic-shell-${process.pid}-${Date.now()}`;
  const srv = fixtures.serve([bash(`touch ${outside}-agent; echo agent-rc=$?`), { content: "TASKCOMPLETE" }]);
  const { tmux } = await startTui(srv.url, "--auto-approve");
  try {
    // Waits match the commands' output, never the echo of what was typed: agent-rc=$? shows as agent-rc=1,
    // shell-made-$((6*7)) as shell-made-42.
    await tmux.waitFor("the agent's command's exit code", (s) => /agent-rc=\d/.test(s));
    tmux.keys("Tab");
    await tmux.waitFor("the Shell tab", (s) => s.includes("Your own shell, not sandboxed"));
    tmux.type(`touch ${outside}-shell && echo shell-made-$((6*7))`);
    tmux.keys("Enter");
    await tmux.waitFor("the shell's touch", (s) => s.includes("shell-made-42"));
    expect(existsSync(`${outside}-shell`)).toBe(true);
    expect(existsSync(`${outside}-agent`)).toBe(false);
    tmux.keys("Tab");
    tmux.keys("C-c");
    tmux.keys("C-c");
    await tmux.waitFor("aic's exit and the outer prompt", exitedToPrompt);
  } finally {
    rmSync(`${outside}-shell`, { force: true });
    rmSync(`${outside}-agent`, { force: true });
  }
});
