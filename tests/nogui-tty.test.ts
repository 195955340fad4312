/**
 * --nogui on a real terminal (SPEC §4): what the person types reaches the
 * running command. Driven through tmux so aic's stdin really is a terminal.
 */
import { afterAll, expect, test } from "bun:test";
import { startFakeServer } from "./fake-openai.ts";
import { AIC, bash, scratch } from "./helpers.ts";

const socket = `aic-nogui-${process.pid}-${Math.random().toString(36).slice(2, 8)}`;
const tmux = (...args: string[]) => Bun.spawnSync(["tmux", "-L", socket, ...args], { stdout: "pipe", stderr: "pipe" });
afterAll(() => tmux("kill-server"));

async function screenUntil(pattern: RegExp, ms = 30_000): Promise<string> {
  const deadline = Date.now() + ms;
  let screen = "";
  while (Date.now() < deadline) {
    screen = tmux("capture-pane", "-p", "-t", "n").stdout.toString();
    if (pattern.test(screen)) return screen;
    await Bun.sleep(100);
  }
  throw new Error(`screen never matched ${pattern}:\n${screen}`);
}

test("keystrokes typed in --nogui on a terminal go to the running command", async () => {
  const srv = startFakeServer({ turns: [bash("read answer; echo got-$answer")] });
  try {
    const dir = scratch();
    const cmd = `${AIC} --nogui --auto-approve --api-base ${srv.url} --model m 'ask me'; echo EXIT=$?; sleep 60`;
    expect(tmux("new-session", "-d", "-s", "n", "-x", "120", "-y", "30", "-c", dir, cmd).exitCode).toBe(0);
    await screenUntil(/\$ read answer/);
    tmux("send-keys", "-t", "n", "typed-by-a-person", "Enter");
    const screen = await screenUntil(/EXIT=\d+/);
    expect(screen).toContain("got-typed-by-a-person");
    expect(screen).toContain("EXIT=0");
    const toolMessage = srv.requests[1]!.body.messages.at(-1);
    expect(toolMessage.role).toBe("tool");
    expect(toolMessage.content).toContain("got-typed-by-a-person");
  } finally {
    srv.close();
  }
}, 60_000);
