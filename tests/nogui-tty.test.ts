/**
 * --nogui on a real terminal (README: "Running a command"): what the person types reaches the
 * running command. Driven through tmux so aic's stdin really is a terminal.
 */
import { afterEach, expect, test } from "bun:test";
import { AIC, Tmux, bash, cleanEnv, has, perTestFixtures, scratch } from "./helpers.ts";

const fixtures = perTestFixtures();
let tmux: Tmux | undefined;
afterEach(() => {
  tmux?.kill();
  tmux = undefined;
});

// Needs tmux; skipped without it.
test.skipIf(!has.tmux)(
  "keystrokes typed in --nogui on a terminal go to the running command",
  async () => {
    const srv = fixtures.serve([bash("read answer; echo got-$answer")]);
    const dir = fixtures.disposable(scratch());
    // `read` keeps the pane (and what aic left on it) on screen after aic exits, until the tmux server is killed;
    // "." ends the exit code, so the wait below cannot match a code caught halfway through.
    const cmd = `${AIC} --nogui --auto-approve --api-base ${srv.url} --model m 'ask me'; echo EXIT=$?.; read -r _`;
    tmux = new Tmux(cleanEnv(), dir, [cmd], { width: 120, height: 30 });
    await tmux.waitFor("the command's echo on screen", (s) => /\$ read answer/.test(s));
    tmux.keys("typed-by-a-person", "Enter");
    const screen = await tmux.waitFor("aic's exit", (s) => /EXIT=\d+\./.test(s));
    expect(screen).toContain("got-typed-by-a-person");
    expect(screen).toContain("EXIT=0.");
    const toolMessage = srv.requests[1]!.body.messages.at(-1);
    expect(toolMessage.role).toBe("tool");
    expect(toolMessage.content).toContain("got-typed-by-a-person");
  },
  60_000,
);

// On a terminal Ctrl+D at the start of a line ends aic's standard input; while a command has the keys it was meant
// for the command: python's REPL gets its end of file and exits, and the run goes on. Needs tmux and python3.
test.skipIf(!has.tmux || !Bun.which("python3"))(
  "Ctrl+D typed to a hand-approved REPL in --nogui ends the REPL, not the run",
  async () => {
    const srv = fixtures.serve([bash("python3 -q", "repl"), { content: "Done.\nTASKCOMPLETE" }]);
    const dir = fixtures.disposable(scratch());
    const cmd = `${AIC} --nogui --api-base ${srv.url} --model m 'use python'; echo EXIT=$?.; read -r _`;
    tmux = new Tmux(cleanEnv(), dir, [cmd], { width: 120, height: 30 });
    await tmux.waitFor("the approval prompt", (s) => s.includes("Approve command?"));
    tmux.keys("y", "Enter");
    await tmux.waitFor("python's prompt", (s) => s.includes(">>>"));
    tmux.type("print(6*7)");
    tmux.keys("Enter");
    await tmux.waitFor("python's answer", (s) => /^42$/m.test(s));
    tmux.keys("C-d");
    const screen = await tmux.waitFor("aic's exit", (s) => /EXIT=\d+\./.test(s));
    expect(screen).toContain("EXIT=0.");
    expect(srv.requests[1]!.body.messages.at(-1).content).toContain("exit code 0");
  },
  60_000,
);
