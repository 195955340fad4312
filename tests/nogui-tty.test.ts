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
    // `sleep 60` keeps the pane (and what aic left on it) on screen after aic exits; "." ends the exit code, so
    // the wait below cannot match a code caught halfway through.
    const cmd = `${AIC} --nogui --auto-approve --api-base ${srv.url} --model m 'ask me'; echo EXIT=$?.; sleep 60`;
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
