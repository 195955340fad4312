/**
 * The model at the keyboard (README: "The model at the keyboard"): a command
 * that waits for input keeps running, the model gets its screen, and
 * `execute_bash {"input": …}` types into it. Each test is a scripted model
 * driving the compiled binary (with the sandbox and the jail, as a user runs
 * it) through a real program: a shell prompt, python3, vim, git rebase -i,
 * less, top, a shell guarded by a deny rule.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { bash, has, headless, jsonLines, perTestFixtures, runAic, scratch, toolResults } from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };
const onPath = (name: string) => Bun.which(name) !== null;

/** A call that types `input` into the command that waits. */
const keys = (input: string, id?: string) => ({ toolCalls: [{ id, arguments: JSON.stringify({ input }) }] });

/** Runs the script in `cwd` unattended (--json); the tool results the model got, and the events. */
async function drive(turns: object[], cwd = scratch(), more: string[] = []) {
  const srv = fixtures.serve([...turns, done] as never);
  const run = await runAic([...headless(srv.url), "--auto-approve", "--json", ...more, "work the program"], { cwd });
  expect(run.code).toBe(0);
  return { results: toolResults(srv), events: jsonLines(run.stdout), cwd };
}

const WAITS = "The command is still running and waits for input";

describe("a prompt and a REPL", () => {
  test("read -p: the prompt comes back on the screen, the answer goes in, the command ends", async () => {
    const { results, events } = await drive([
      bash('read -p "Your name? " n; echo "Hello, $n"', "ask"),
      keys("Ada\n", "answer"),
    ]);
    expect(results[0]).toStartWith(WAITS);
    expect(results[0]).toContain("Your name?");
    expect(results[1]).toStartWith("Command executed with exit code 0.");
    expect(results[1]).toContain("Hello, Ada");
    // The JSON stream: the command's result while it waits, the input, then its end.
    const waiting = events.find((e) => e.type === "command_result" && e.id === "ask");
    expect(waiting).toMatchObject({ status: "waiting_for_input", exit_code: null });
    expect(waiting.output).toContain("Your name?");
    expect(events.find((e) => e.type === "input")).toMatchObject({
      id: "answer",
      input: "Ada\n",
      into: "bash",
      command_id: "ask",
    });
    expect(events.find((e) => e.type === "command_result" && e.id === "answer")).toMatchObject({
      status: "exited",
      exit_code: 0,
    });
  });

  test.skipIf(!onPath("python3"))("python3: computes at the prompt, then leaves it", async () => {
    const { results } = await drive([bash("python3 -q", "repl"), keys("print(2**100)\n"), keys("exit()\n")]);
    expect(results[0]).toStartWith(WAITS);
    expect(results[0]).toContain(">>>");
    expect(results[1]).toContain("1267650600228229401496703205376");
    expect(results[1]).toStartWith(WAITS); // the prompt again
    expect(results[2]).toStartWith("Command executed with exit code 0.");
  });
});

describe("what is typed, and when", () => {
  // A program that empties its input at each prompt (as npm init does) loses lines sent in one write: aic types line
  // by line, each once the program reads again. Then a raw read sees Enter as a terminal sends it: CR, byte 13.
  test.skipIf(!onPath("python3"))(
    "lines typed at once reach a program that flushes its input at each prompt; Enter is CR",
    async () => {
      const cwd = scratch();
      writeFileSync(
        join(cwd, "ask.py"),
        [
          "import os, sys, termios, tty",
          'for q in ("name", "version", "license"):',
          '    sys.stdout.write(q + "? "); sys.stdout.flush()',
          "    termios.tcflush(0, termios.TCIFLUSH)",
          '    print("got", q, "=", input())',
          "tty.setraw(0)",
          'sys.stdout.write("byte=%d\\r\\n" % os.read(0, 1)[0])',
        ].join("\n"),
      );
      const { results } = await drive([bash("python3 ask.py"), keys("pkg\n1.0\nMIT\n"), keys("\n")], cwd);
      expect(results[0]).toStartWith(WAITS);
      for (const line of ["got name = pkg", "got version = 1.0", "got license = MIT"])
        expect(results[1]).toContain(line);
      expect(results[2]).toStartWith("Command executed with exit code 0.");
      expect(results[2]).toContain("byte=13");
    },
  );

  // Output moments ago means the program is busy, whatever it reads between its lines.
  test("a program that prints all the time while it polls the terminal is left to run to its end", async () => {
    const { results, events } = await drive([
      bash("for i in $(seq 25); do echo tick $i; read -t 0.1 x; done; echo finished", "tick"),
    ]);
    expect(results[0]).toStartWith("Command executed with exit code 0.");
    expect(results[0]).toContain("finished");
    const statuses = events.filter((e) => e.type === "command_result" && e.id === "tick").map((e) => e.status);
    expect(statuses).toEqual(["exited"]);
  });
});

describe("full-screen programs", () => {
  test.skipIf(!onPath("vim"))("vim -u NONE: the whole screen, a line added, saved with :wq", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, "notes.txt"), "line one\nline two\n");
    const { results } = await drive([bash("vim -u NONE notes.txt"), keys("ggOadded by the model<Esc>:wq\n")], cwd);
    expect(results[0]).toContain("Its whole screen");
    expect(results[0]).toContain("line one");
    expect(results[1]).toStartWith("Command executed with exit code 0.");
    expect(readFileSync(join(cwd, "notes.txt"), "utf8")).toBe("added by the model\nline one\nline two\n");
  });

  test.skipIf(!onPath("less"))("less: searched, then quit", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, "numbers.txt"), Array.from({ length: 300 }, (_, i) => `row ${i + 1}`).join("\n"));
    const { results } = await drive([bash("less numbers.txt"), keys("/row 250\n"), keys("q")], cwd);
    expect(results[0]).toContain("row 1\n");
    expect(results[0]).not.toContain("row 250");
    expect(results[1]).toContain("row 250");
    expect(results[2]).toStartWith("Command executed with exit code 0.");
  });

  test.skipIf(!onPath("top"))("top runs until interrupted: its screen after a moment, then q", async () => {
    const { results, events } = await drive([bash("top", "top"), keys("q")]);
    expect(results[0]).toStartWith("The command is still running: top runs until it is interrupted");
    expect(results[0]).toContain("load average");
    expect(events.find((e) => e.type === "command_result" && e.id === "top")?.status).toBe("waiting_on_time");
    expect(results[1]).toStartWith("Command executed with exit code 0.");
  });

  test.skipIf(!has.git || !onPath("vim"))("git rebase -i: two commits reordered through the editor", async () => {
    const cwd = scratch();
    const git = (...args: string[]) =>
      Bun.spawnSync(["git", "-c", "user.email=a@b", "-c", "user.name=a", ...args], { cwd }).stdout.toString();
    git("init", "-q");
    git("commit", "-q", "--allow-empty", "-m", "base");
    for (const name of ["first", "second"]) {
      writeFileSync(join(cwd, `${name}.txt`), name);
      git("add", `${name}.txt`);
      git("commit", "-q", "-m", name);
    }
    const { results } = await drive(
      [
        bash("git -c user.email=a@b -c user.name=a -c sequence.editor='vim -u NONE' rebase -i HEAD~2", "rebase"),
        keys("ddp:wq\n"),
      ],
      cwd,
    );
    expect(results[0]).toContain("waits for input (vim");
    expect(results[0]).toContain("pick");
    expect(results[1]).toContain("Successfully rebased");
    expect(git("log", "--format=%s").trim().split("\n")).toEqual(["first", "second", "base"]);
  });
});

describe("one waiting command at a time, and the rules", () => {
  test("a new command stops the one that waits, and says so", async () => {
    const { results } = await drive([bash("read -p 'Continue? ' x"), bash("echo next")]);
    expect(results[0]).toStartWith(WAITS);
    expect(results[1]).toStartWith("(The command that was waiting for input, bash, was stopped first");
    expect(results[1]).toContain("next");
  });

  test("input with nothing waiting, and a call with both fields, are answered and run nothing", async () => {
    const cwd = scratch();
    const { results } = await drive(
      [
        keys("touch typed.txt\n"),
        { toolCalls: [{ arguments: JSON.stringify({ command: "touch both.txt", input: "y" }) }] },
      ],
      cwd,
    );
    expect(results[0]).toStartWith("No command is waiting for input, so nothing was typed.");
    expect(results[1]).toStartWith('Give either "command"');
    expect(existsSync(join(cwd, "typed.txt"))).toBe(false);
    expect(existsSync(join(cwd, "both.txt"))).toBe(false);
  });

  test("input typed into a shell is judged as the command it is: a deny rule holds", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, ".aicrules"), "deny rm *\n");
    writeFileSync(join(cwd, "victim.txt"), "precious\n");
    const { results, events } = await drive(
      [bash("bash --norc --noprofile -i", "shell"), keys("rm -f victim.txt\n", "rm"), keys("exit\n")],
      cwd,
    );
    expect(results[0]).toStartWith(WAITS);
    expect(results[1]).toContain('forbidden by the rule "deny rm *"');
    expect(existsSync(join(cwd, "victim.txt"))).toBe(true);
    expect(events.find((e) => e.type === "approval" && e.id === "rm")?.decision).toBe("denied");
    expect(results[2]).toStartWith("Command executed with exit code 0.");
  });

  // Without a person (no --auto-approve, no terminal) only rules let keys through: the rule that let vim start does
  // not let what is typed into it through (vim's :sh would be a shell). How keys into a shell are judged line by
  // line is in rules-hold.test.ts.
  test("a rule that lets a program start does not let keys typed into it through", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, ".aicrules"), "allow vim *\ndeny git push *\n");
    const srv = fixtures.serve([bash("vim -u NONE -n f.txt", "vim"), keys(":sh\n", "escape"), done] as never);
    const run = await runAic([...headless(srv.url), "--json", "edit"], { cwd });
    expect(run.code).toBe(0);
    const decisions = jsonLines(run.stdout).filter((e) => e.type === "approval");
    expect(decisions.map((e) => [e.id, e.decision])).toEqual([
      ["vim", "allowed"],
      ["escape", "no_input"],
    ]);
    expect(toolResults(srv)[1]).toContain("still waits for input");
  });

  // The keys were judged for the program that read the first line: when another program reads the next (the script
  // execs a shell), typing stops there and the model is told, so the rest is judged for the new reader.
  test("typing stops when another program comes to read the terminal", async () => {
    const { results } = await drive([
      bash("read -r a; echo got=$a; exec bash --norc --noprofile -i", "script"),
      keys("first\necho second-$((6*7))\n", "two-lines"),
    ]);
    expect(results[0]).toStartWith(WAITS);
    expect(results[1]).toStartWith(
      "Typing stopped after 1 of 2 lines: another program than bash now reads the terminal",
    );
    expect(results[1]).toContain("got=first");
    expect(results[1]).not.toContain("second-42");
  });

  test("the session records the input as the model sent it", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([bash('read -p "Name? " n; echo "hi $n"'), keys("Lin\n"), done] as never);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "ask"], { cwd });
    expect(run.code).toBe(0);
    const messages = JSON.parse(readFileSync(join(cwd, "s.json"), "utf8")).messages;
    const calls = messages.flatMap((m: { tool_calls?: { function: { arguments: string } }[] }) => m.tool_calls ?? []);
    expect(calls.map((c: { function: { arguments: string } }) => JSON.parse(c.function.arguments))).toEqual([
      { command: 'read -p "Name? " n; echo "hi $n"' },
      { input: "Lin\n" },
    ]);
  });
});
