/**
 * The person in the loop (README: "The terminal UI" and "Settings kept between runs"): the compiled dist/aic
 * in tmux at 80×24 against the fake model server, for the moments of a working day — a question the model
 * asks, keys typed right after approving, vim in the Console, the dialog at 80 columns, a hand-edited session
 * that does not parse, slash completion, the one transcript, a closed terminal — and, without a terminal, the
 * session kept out of git, the config file and a resume without flags.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { chmodSync, mkdirSync, readFileSync, readdirSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  AIC,
  Tmux,
  bash,
  cleanEnv,
  has,
  headless,
  messagesOf,
  perTestFixtures,
  runAic,
  scratch,
  toolAnswer,
  unique,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const sessions: Tmux[] = [];
afterEach(() => {
  for (const tmux of sessions.splice(0)) tmux.kill();
});

/** aic's TUI in a fresh tmux server of 80×24, in `cwd`, talking to `url`. */
function tui(url: string, cwd: string, request: string, extra: string[] = []): Tmux {
  const home = fixtures.disposable(scratch("aic-person-home-"));
  const env = cleanEnv({ HOME: home, SHELL: "/bin/bash", TERM: "xterm-256color" });
  const argv = [AIC, "--api-base", url, "--model", "test-model", ...extra, ...(request ? [request] : [])];
  const tmux = new Tmux(env, cwd, argv, { width: 80, height: 24 });
  sessions.push(tmux);
  return tmux;
}

/** Live processes whose command line holds `marker`. */
function processesWith(marker: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      const cmdline = readFileSync(`/proc/${entry}/cmdline`, "utf8");
      const state = readFileSync(`/proc/${entry}/stat`, "utf8").split(") ")[1]?.[0];
      if (cmdline.includes(marker) && state !== "Z") found.push(Number(entry));
    } catch {
      /* gone */
    }
  }
  return found;
}

function gitRepo(): string {
  const cwd = scratch("aic-person-repo-");
  for (const args of [
    ["init", "-q"],
    ["config", "user.email", "a@b.c"],
    ["config", "user.name", "A"],
  ])
    expect(Bun.spawnSync(["git", ...args], { cwd }).exitCode).toBe(0);
  writeFileSync(join(cwd, "a.txt"), "one\n");
  return cwd;
}

describe.skipIf(!has.tmux)("the TUI at 80×24", () => {
  test("a question hands the turn back: the person's answer is the next user message, with no nudge", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([
      { content: "Which database should I use?" },
      { content: "Postgres it is.\nTASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "set up the app");
    await tmux.waitFor(
      "the question and the turn handed back",
      (s) => s.includes("Which database") && s.includes("[answered]"),
    );
    expect(srv.requests.length).toBe(1);
    tmux.type("Postgres");
    tmux.keys("Enter");
    await waitFor("the second request", () => srv.requests.length === 2);
    const messages = messagesOf(srv.requests[1]);
    expect(messages.at(-1)).toMatchObject({ role: "user", content: "Postgres" });
    expect(messages.at(-2)).toMatchObject({ role: "assistant", content: "Which database should I use?" });
    expect(JSON.stringify(messages)).not.toContain("without calling a tool");
  });

  test("keys typed right after approving reach read -p; the command and its status line are in the agent pane", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([
      { content: "Asking for a name.", ...bash(`read -p 'Name? ' x; echo "hello $x"`, "call_read") },
      { content: "TASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "greet", ["--ask-every-command"]);
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    // Typed at once, before aic can know that the command reads the terminal.
    tmux.keys("y", "Enter");
    tmux.type("Ana");
    tmux.keys("Enter");
    await waitFor("the tool result", () => srv.requests.length === 2);
    expect(toolAnswer(srv.requests[1], "call_read")).toContain("hello Ana");
    const screen = await tmux.waitFor("the status line", (s) => s.includes("✓ exit 0"));
    const agentPane = screen.split("\n").map((row) => Array.from(row).slice(0, 40).join(""));
    const commandRow = agentPane.findIndex((row) => row.includes("$ read -p"));
    expect(commandRow).toBeGreaterThan(agentPane.findIndex((row) => row.includes("Asking for a name.")));
    expect(agentPane.slice(commandRow).some((row) => row.includes("✓ exit 0"))).toBe(true);
    expect(screen).not.toContain("[queued suggestion]");
  });

  // The first Ctrl+C reaches the program that waits (a [y/N] prompt) and ends it; the second lands on aic while the
  // model is asked again. Only presses aic itself handled count for "twice quits": aic stays.
  test("Ctrl+C that ends a waiting program, then Ctrl+C on aic's prompt: aic keeps running", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([
      bash(`read -p 'Continue? [y/N] ' x; echo "got:$x"`, "call_ask"),
      { content: "Stopped it. What next?", delayMs: 1500 },
      { content: "TASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "ask me", ["--ask-every-command"]);
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("Enter");
    await tmux.waitFor(
      "the program's prompt, with the keys going to it",
      (s) => s.includes("Continue? [y/N]") && s.includes("keys go to the command"),
    );
    tmux.keys("C-c");
    await waitFor("the next model request", () => srv.requests.length === 2);
    tmux.keys("C-c");
    // aic handled this press itself: it interrupts the run (or clears), and says a second would quit; it is alive.
    const screen = await tmux.waitFor("aic's own answer to the press", (s) => s.includes("Ctrl+C again to quit"));
    expect(screen).toContain("Console Output");
    expect(tmux.display("#{pane_dead}")).toBe("0");
    expect(toolAnswer(srv.requests[1], "call_ask")).not.toContain("got:");
  });

  // The runaway stop protects the model's context from a command nobody approved; one the person approved runs to
  // its end (what the model is handed of its output is cut as always).
  test("a command the person approved that prints 8 MB runs to its end", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([
      bash("head -c 8000000 /dev/zero | tr '\\0' a | fold -w 100; echo printed-to-the-end", "call_big"),
      { content: "TASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "print a lot", ["--ask-every-command", "--max-output-bytes", "20000"]);
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("Enter");
    await waitFor("the tool result", () => srv.requests.length === 2, 100_000);
    const answer = toolAnswer(srv.requests[1], "call_big");
    expect(answer).toStartWith("Command executed with exit code 0.");
    expect(answer).toContain("printed-to-the-end");
    expect(answer).not.toContain("runaway");
  }, 120_000);

  // A program the person approved and then left alone, or handed over with the footer's key, goes to the model.
  for (const how of ["left alone", "handed over with Ctrl+O"] as const)
    test(`a hand-approved program that waits, ${how}, is answered by the model`, async () => {
      const cwd = scratch("aic-person-");
      const srv = fixtures.serve([
        bash(`read -p 'Name? ' x; echo "hello $x"`, "call_read"),
        { toolCalls: [{ id: "call_keys", arguments: JSON.stringify({ input: "Model\n" }) }] },
        { content: "TASKCOMPLETE" },
      ]);
      const idle = how === "left alone" ? "2" : "600";
      const home = fixtures.disposable(scratch("aic-person-home-"));
      const env = cleanEnv({ HOME: home, SHELL: "/bin/bash", TERM: "xterm-256color", AIC_HANDOVER_IDLE_S: idle });
      const argv = [AIC, "--api-base", srv.url, "--model", "test-model", "--ask-every-command", "greet"];
      const tmux = new Tmux(env, cwd, argv, { width: 80, height: 24 });
      sessions.push(tmux);
      await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
      tmux.keys("Enter");
      await tmux.waitFor(
        "the keys with the person",
        (s) => s.includes("Name?") && s.includes("keys go to the command"),
      );
      if (how !== "left alone") tmux.keys("C-o");
      await waitFor("the model's turn at the keyboard", () => srv.requests.length >= 2);
      expect(toolAnswer(srv.requests[1], "call_read")).toContain("waits for input");
      // The model's keys are approved like any of its calls (--ask-every-command).
      await tmux.waitFor("the keys' approval", (s) => s.includes("Approve input?"));
      tmux.keys("Enter");
      try {
        await waitFor("the model's keys answered", () => srv.requests.length >= 3);
      } catch (e) {
        throw new Error(`${(e as Error).message}\n${tmux.screen()}`);
      }
      expect(toolAnswer(srv.requests[2], "call_keys")).toContain("hello Model");
    });

  test("vim is drawn in the Console; Escape goes to it and :wq saves", async () => {
    const cwd = scratch("aic-person-");
    writeFileSync(join(cwd, "notes.txt"), "first-line-of-notes\n");
    const srv = fixtures.serve([bash("vim -u NONE -n notes.txt", "call_vim"), { content: "TASKCOMPLETE" }]);
    const tmux = tui(srv.url, cwd, "edit", ["--ask-every-command"]);
    await tmux.waitFor("the approval dialog", (s) => s.includes("Approve command?"));
    tmux.keys("y", "Enter");
    await tmux.waitFor("vim's screen in the Console", (s) => s.includes("first-line-of-notes") && s.includes("~"));
    tmux.keys("i");
    tmux.type("typed-in-vim ");
    tmux.keys("Escape");
    await tmux.waitFor("the insertion drawn", (s) => s.includes("typed-in-vim first-line"));
    tmux.type(":wq");
    tmux.keys("Enter");
    await waitFor("the tool result", () => srv.requests.length === 2);
    expect(toolAnswer(srv.requests[1], "call_vim")).toContain("exit code 0");
    expect(readFileSync(join(cwd, "notes.txt"), "utf8")).toBe("typed-in-vim first-line-of-notes\n");
  });

  test("the approval dialog's rows stay inside its border at 80×24 with a long command", async () => {
    const cwd = scratch("aic-person-");
    // cargo build is offered an "always allow" rule: the dialog's longest row. (It is never approved here.)
    const long = `cargo build --manifest-path ${"very-long-directory-name/".repeat(8)}Cargo.toml ${"--features some-feature ".repeat(6)}`;
    const srv = fixtures.serve([bash(long), { content: "TASKCOMPLETE" }]);
    const tmux = tui(srv.url, cwd, "make it");
    const screen = await tmux.waitFor("the dialog", (s) => s.includes("[Enter] Approve") && s.includes("Always allow"));
    const rows = screen.split("\n").map((row) => Array.from(row));
    const top = rows.findIndex((row) => row.join("").includes("╭"));
    const bottom = rows.findIndex((row) => row.join("").includes("╰"));
    const left = rows[top]!.indexOf("╭");
    const right = rows[top]!.indexOf("╮");
    expect(top).toBeGreaterThanOrEqual(0);
    expect(bottom).toBeGreaterThan(top);
    for (const row of rows.slice(top + 1, bottom)) {
      expect(row[left]).toBe("│");
      expect(row[right]).toBe("│");
    }
    for (const label of ["[Enter] Approve", "[Esc] Reject", "Always allow"]) {
      const y = rows.findIndex((row) => row.join("").includes(label));
      expect(y).toBeGreaterThan(top);
      expect(y).toBeLessThan(bottom);
    }
  });

  test("a hand-edited session that does not parse: /reload names line and column, keeps the conversation and the file", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([
      bash("echo remembered-output", "call_1"),
      { content: "First task done.\nTASKCOMPLETE" },
      { content: "Second task done.\nTASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "first task", ["--auto-approve"]);
    await tmux.waitFor("the first task done", (s) => s.includes("[completed]"));
    const file = join(cwd, ".aicsession");
    // A trailing comma, the classic slip of a hand edit.
    const broken = readFileSync(file, "utf8").replace(/("billable_tokens": \d+)/, "$1,");
    expect(() => JSON.parse(broken)).toThrow();
    writeFileSync(file, broken);
    tmux.type("/reload");
    tmux.keys("Enter");
    const screen = await tmux.waitFor("the warning", (s) => /line \d+,\s*column\s*\d+/.test(s.replace(/│/g, " ")));
    expect(screen).toContain("could not be loaded");
    expect(readFileSync(file, "utf8")).toBe(broken);
    expect(readdirSync(cwd).some((name) => name.includes(".corrupt."))).toBe(false);
    tmux.type("second task");
    tmux.keys("Enter");
    await waitFor("the next request", () => srv.requests.length === 3);
    expect(JSON.stringify(messagesOf(srv.requests[2]))).toContain("remembered-output");
    // aic does not write over the file until it loads.
    await tmux.waitFor("the second task done", (s) => s.includes("Second task done"));
    expect(readFileSync(file, "utf8")).toBe(broken);
  });

  test("typing / lists the matching commands, Tab completes, an unknown one is one line", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const tmux = tui(srv.url, cwd, "");
    await tmux.waitFor("the TUI", (s) => s.includes("Agent Output"));
    tmux.type("/re");
    let screen = await tmux.waitFor("the matching commands", (s) => s.includes("/reload") && s.includes("/redo"));
    expect(screen).toContain("/reject");
    tmux.keys("C-u");
    tmux.type("/sand");
    tmux.keys("Tab");
    // Completed with a space after it (the screen's rows lose trailing spaces): the hint is gone.
    screen = await tmux.waitFor("the completed command", (s) => s.split("\n").some((row) => row.trim() === "/sandbox"));
    tmux.keys("Enter");
    screen = await tmux.waitFor("the sandbox details", (s) => s.includes("writable:"));
    tmux.type("/foo");
    tmux.keys("Enter");
    screen = await tmux.waitFor("the unknown command", (s) => s.includes("Unknown command /foo"));
    expect(screen).not.toContain("Commands:");
  });

  test("closing the terminal ends aic, its launcher and its jobs, the session saved", async () => {
    const cwd = scratch("aic-person-");
    const marker = unique("hangup-job-");
    const srv = fixtures.serve([
      bash(`(exec -a ${marker} sleep infinity) & echo started`, "call_job"),
      { content: "Started it.\nTASKCOMPLETE" },
    ]);
    const tmux = tui(srv.url, cwd, "start a job", ["--auto-approve"]);
    await tmux.waitFor("the task done", (s) => s.includes("[completed]"));
    expect(processesWith(srv.url).length).toBeGreaterThan(0);
    expect(processesWith(marker).length).toBe(1);
    const killedAt = Date.now();
    tmux.kill();
    await waitFor(
      "aic and everything it started gone",
      () => processesWith(srv.url).length === 0 && processesWith(marker).length === 0,
    );
    console.log(`hang-up: aic gone ${Date.now() - killedAt} ms after the tmux server was killed`);
    const saved = JSON.parse(readFileSync(join(cwd, ".aicsession"), "utf8"));
    expect(saved.reason).toBe("signal_1");
  });
});

describe("without a terminal", () => {
  test("the session stays out of git: a model's git add -A commits the work, not the conversation", async () => {
    const cwd = gitRepo();
    const srv = fixtures.serve([
      bash("git add -A && git commit -qm work && git show --stat --format= HEAD"),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", ".aicsession", "commit"], { cwd });
    expect(run.code).toBe(0);
    expect(run.stderr).toContain("added .aicsession* to");
    const tracked = Bun.spawnSync(["git", "ls-files"], { cwd }).stdout.toString();
    expect(tracked).toContain("a.txt");
    expect(tracked).not.toContain(".aicsession");
    expect(Bun.spawnSync(["git", "status", "--porcelain"], { cwd }).stdout.toString()).toBe("");
    // Once: a second run adds nothing more.
    const again = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(again.url), "--session", ".aicsession", "again"], { cwd })).code).toBe(0);
    expect(readFileSync(join(cwd, ".git/info/exclude"), "utf8").match(/^\.aicsession\*$/gm)?.length).toBe(1);
  });

  test("the config file gives defaults for long flags; flags and environment win; bad files are one line", async () => {
    const cwd = scratch("aic-person-");
    const config = scratch("aic-person-config-");
    mkdirSync(join(config, "aic"));
    const file = join(config, "aic", "config.toml");
    const srv = fixtures.serve([bash("echo from-config", "call_1"), { content: "TASKCOMPLETE" }]);
    writeFileSync(file, `api-base = "${srv.url}"\nmodel = "model-from-file"\nauto-approve = true\nmax-steps = 9\n`);
    const env = { XDG_CONFIG_HOME: config };
    const run = await runAic(["--nogui", "do it"], { cwd, env });
    expect(run.code).toBe(0);
    // Where auto-approve came from is said, since nobody typed it.
    expect(run.stderr).toContain(`settings from ${file}: api-base, model, auto-approve, max-steps`);
    expect(srv.requests[0]!.body.model).toBe("model-from-file");
    expect(toolAnswer(srv.requests[1], "call_1")).toContain("from-config");

    const other = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const flagged = await runAic(["--nogui", "--model", "flag-model", "hi"], {
      cwd,
      env: { ...env, AIC_API_BASE: other.url },
    });
    expect(flagged.code).toBe(0);
    expect(other.requests[0]!.body.model).toBe("flag-model");

    const bad: [string, RegExp][] = [
      [`model = "m"\napi-base = "${srv.url}"\nmax-steps = = 3\n`, /config\.toml, line 3: /],
      [`modle = "m"\n`, /unknown setting 'modle'/],
      [`auto-approve = "yes"\n`, /auto-approve takes true or false/],
      [`api-base = "${srv.url}"\nmodel = "m\nmax-steps = 3\n`, /config\.toml, line 2: /],
      [`api-base = "${srv.url}"\nmodel = "m"\ntimeout = 0\n`, /config\.toml: timeout .*positive whole number, got '0'/],
    ];
    for (const [text, message] of bad) {
      writeFileSync(file, text);
      const r = await runAic(["--nogui", "hi"], { cwd, env });
      expect(r.code).toBe(2);
      expect(r.stderr.trim().split("\n")).toHaveLength(1);
      expect(r.stderr).toMatch(message);
    }
    writeFileSync(file, `api-base = "${srv.url}"\nmodel = "m"\napi-key = "sk-in-file"\n`);
    chmodSync(file, 0o644);
    const open = await runAic(["--nogui", "hi"], { cwd, env });
    expect(open.code).toBe(2);
    expect(open.stderr).toContain("holds an API key and others may read it");
    expect(open.stderr).not.toContain("sk-in-file");

    // no-session in the file, --session on the command line: the command line wins.
    const third = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    writeFileSync(file, `api-base = "${third.url}"\nmodel = "m"\nno-session = true\n`);
    chmodSync(file, 0o600);
    const kept = await runAic(["--nogui", "--session", "kept.json", "hi"], { cwd, env });
    expect(kept.code).toBe(0);
    expect(statSync(join(cwd, "kept.json")).isFile()).toBe(true);
  });

  test("a resume without --model or --api-base uses what the session recorded, unless the file changed since", async () => {
    const cwd = scratch("aic-person-");
    const srv = fixtures.serve([{ content: "One.\nTASKCOMPLETE" }, { content: "Two.\nTASKCOMPLETE" }]);
    const first = await runAic([...headless(srv.url, "recorded-model"), "--session", "s.json", "first"], { cwd });
    expect(first.code).toBe(0);
    const resumed = await runAic(["--nogui", "--session", "s.json", "second"], { cwd });
    expect(resumed.code).toBe(0);
    expect(srv.requests).toHaveLength(2);
    expect(srv.requests[1]!.body.model).toBe("recorded-model");
    expect(JSON.stringify(messagesOf(srv.requests[1]))).toContain("first");

    // A file edited since aic wrote it could point the key elsewhere: the endpoint must be given again.
    const file = join(cwd, "s.json");
    writeFileSync(file, readFileSync(file, "utf8").replace(srv.url, "http://127.0.0.1:9/v1"));
    const refused = await runAic(["--nogui", "--session", "s.json", "third"], { cwd });
    expect(refused.code).toBe(2);
    expect(refused.stderr).toContain("cannot tell the file is as it wrote it");
    expect(srv.requests).toHaveLength(2);
    expect(statSync(file).size).toBeGreaterThan(0);
  });

  test("a session with a trailing comma stays where it is: one PATH:LINE:COL line, exit 2, no model call", async () => {
    const cwd = scratch("aic-person-");
    const text = '{\n  "messages": [\n    {"role": "user", "content": "hi"},\n  ]\n}\n';
    writeFileSync(join(cwd, "s.json"), text);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--session", "s.json", "go"], { cwd });
    expect(run.code).toBe(2);
    expect(run.stderr.trim().split("\n")).toEqual([
      expect.stringMatching(
        /^\/.*s\.json:4:3: it is not valid JSON \(.*\) — fix it and run aic again \(or --no-session\)$/,
      ),
    ]);
    expect(srv.requests).toHaveLength(0);
    expect(readFileSync(join(cwd, "s.json"), "utf8")).toBe(text);
    expect(readdirSync(cwd).filter((n) => !n.endsWith(".lock"))).toEqual(["s.json"]);

    // Resuming without --model and --api-base (they would come from the file): the same place is named first.
    const bare = await runAic(["--nogui", "--session", "s.json", "go"], { cwd });
    expect(bare.code).toBe(2);
    expect(bare.stderr.trim().split("\n")).toHaveLength(1);
    expect(bare.stderr).toMatch(/s\.json:4:3: it is not valid JSON .* — fix it and run aic again/);
    expect(readFileSync(join(cwd, "s.json"), "utf8")).toBe(text);
  });
});
