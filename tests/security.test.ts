/**
 * A command is an adversary. aic itself is not confined, so everything a
 * command can reach (the cwd, /tmp, /dev) is hostile ground for aic's own
 * files. Each test here is a real attack, from inside a sandboxed command or
 * as a planted file, against the compiled binary: the command must not make
 * aic write where the command may not, read the API key, hang, or lose a
 * person's file.
 */
import { describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  lstatSync,
  mkdirSync,
  readFileSync,
  readdirSync,
  realpathSync,
  rmSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import {
  AIC,
  bash,
  has,
  headless,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolResults,
  unique,
} from "./helpers.ts";

const fixtures = perTestFixtures();

/** The files in `dir` whose text contains `marker`. */
function filesContaining(dir: string, marker: string): string[] {
  const found: string[] = [];
  for (const name of readdirSync(dir)) {
    const file = join(dir, name);
    try {
      if (lstatSync(file).isFile() && readFileSync(file, "latin1").includes(marker)) found.push(file);
    } catch {
      /* unreadable or gone */
    }
  }
  return found;
}

/** Runs dist/aic as the unprivileged user `nobody` in `cwd` (which the test makes writable for it). Needs root and setpriv. */
function runAsNobody(args: string[], cwd: string, env: Record<string, string> = {}) {
  return runCommand(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", AIC, ...args], {
    cwd,
    env: { HOME: cwd, ...env },
    killAfterMs: 60_000,
  });
}

// These attacks are stopped by the sandbox, which needs a kernel with Landlock: skipped without it.
describe.skipIf(!has.landlock)("escapes through aic's own files (sandbox on)", () => {
  // 1. The output directory is renamed and replaced by a link to /var/tmp between two cut outputs. It lies in aic's
  // state directory, out of reach in the jail; the tests' state directory is under /tmp, so without the jail a
  // command can reach it.
  test("a swapped output directory never makes aic write outside the sandbox (no jail)", async () => {
    const cwd = scratch();
    const marker = `swap-${unique()}`;
    const outputs = '"$XDG_STATE_HOME"/aic/outputs';
    const srv = fixtures.serve([
      bash("seq 1 20000 | tail -c 20000; echo"),
      bash(`for x in ${outputs}/aic-*; do mv "$x" "$x.moved" && ln -s /var/tmp "$x"; done; ls -l ${outputs}`),
      bash(`seq 1 3000 | sed 's/^/${marker}-/'`),
      bash(`touch /var/tmp/${marker}-direct; echo rc=$?`),
      { content: "TASKCOMPLETE" },
    ]);
    // With a session file the outputs live as long as the session, so the file can be checked after the run.
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "attack"], {
      cwd,
      env: { AIC_NO_NAMESPACES: "1" },
    });
    try {
      expect(run.code).toBe(0);
      const results = toolResults(srv);
      expect(results[1]).toContain("-> /var/tmp");
      expect(results[3]).toContain("Permission denied");
      expect(filesContaining("/var/tmp", marker)).toEqual([]);
      // The third result names a file that really holds the whole output, behind no link.
      const saved = results[2]!.match(/saved in (\S+\.txt)/)?.[1];
      expect(saved).toBeDefined();
      expect(realpathSync(saved!)).toBe(saved!);
      expect(readFileSync(saved!, "utf8")).toContain(`${marker}-3000`);
    } finally {
      for (const f of filesContaining("/var/tmp", marker)) rmSync(f, { force: true });
    }
  });

  // Found while fixing 1: the cwd itself renamed and replaced by a link to / would widen the next command's write rule.
  test("a cwd swapped for a link to / does not widen the sandbox", async () => {
    const parent = scratch();
    const cwd = join(parent, "proj");
    mkdirSync(cwd);
    const target = `/var/tmp/aic-rename-${unique()}`;
    const srv = fixtures.serve([
      bash("cd .. && mv proj proj.moved && ln -s / proj && echo swapped"),
      bash(`echo escaped > ${target}; echo rc=$?`),
      { content: "TASKCOMPLETE" },
    ]);
    try {
      const run = await runAic([...headless(srv.url), "--auto-approve", "attack"], { cwd });
      expect(run.code).toBe(0);
      expect(existsSync(target)).toBe(false);
      expect(toolResults(srv)[1]).toMatch(/no longer the directory|Permission denied/);
    } finally {
      rmSync(target, { force: true });
    }
  });

  // Found by the strace scan: a compiled Bun program reads bunfig.toml and .env from its cwd at start, and the
  // sandbox launcher is aic itself, started in the cwd for every command: a planted preload would run unconfined.
  test("a bunfig.toml preload planted by a command never runs unconfined", async () => {
    const cwd = scratch();
    const target = `/var/tmp/aic-bunfig-${unique()}`;
    const srv = fixtures.serve([
      bash(
        `printf 'preload = ["./x.js"]\\n' > bunfig.toml; echo 'require("fs").writeFileSync("${target}", "x")' > x.js; echo planted`,
      ),
      bash("echo second command"),
      { content: "TASKCOMPLETE" },
    ]);
    try {
      const run = await runAic([...headless(srv.url), "--auto-approve", "attack"], { cwd });
      expect(run.code).toBe(0);
      expect(toolResults(srv)[1]).toContain("second command");
      expect(existsSync(target)).toBe(false);
    } finally {
      rmSync(target, { force: true });
    }
  });

  test("a .env planted by a command does not change the next run's settings", async () => {
    const cwd = scratch();
    const first = fixtures.serve([
      bash("echo 'AIC_API_KEY=sk-planted-by-command' > .env; echo planted"),
      { content: "TASKCOMPLETE" },
    ]);
    expect((await runAic([...headless(first.url), "--auto-approve", "plant"], { cwd })).code).toBe(0);
    const second = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(second.url), "again"], { cwd })).code).toBe(0);
    expect(second.requests[0]!.headers.authorization ?? "").not.toContain("sk-planted");
  });

  // 3. A lock file replaced by a link (by a command of the first run) is never created or locked through in the next
  // run. Without the jail the command can replace it; in the jail it cannot even do that.
  test("a planted .aicsession.lock link is refused; the next run uses another file (no jail)", async () => {
    const cwd = scratch();
    const victim = `/var/tmp/aic-lock-${unique()}`;
    const first = fixtures.serve([
      bash(`rm -f .aicsession.lock && ln -s ${victim} .aicsession.lock && echo planted`),
      { content: "TASKCOMPLETE" },
    ]);
    const env = { AIC_NO_NAMESPACES: "1" };
    const one = await runAic([...headless(first.url), "--auto-approve", "--session", ".aicsession", "plant"], {
      cwd,
      env,
    });
    expect(one.code).toBe(0);
    expect(lstatSync(join(cwd, ".aicsession.lock")).isSymbolicLink()).toBe(true);
    const second = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const two = await runAic([...headless(second.url), "--session", ".aicsession", "again"], { cwd, env });
    try {
      expect(two.code).toBe(0);
      expect(existsSync(victim)).toBe(false);
      expect(two.stderr).toContain("symbolic link");
      expect(two.stderr).toContain(".aicsession2");
    } finally {
      rmSync(victim, { force: true });
    }
  });
});

describe("the API key in aic's /proc entries", () => {
  // 2. A command looks for the key in aic's environ and cmdline: it finds asterisks.
  // The grep pattern does not match its own text, so only a real leak is counted.
  const attack = () =>
    `for p in $(pgrep -f -- '--api-base'); do tr '\\0' '\\n' < /proc/$p/environ 2>&1; tr '\\0' ' ' < /proc/$p/cmdline; echo; done | grep -c 'sk-leak-from-[ae]'; echo scanned`;

  test("as root: neither environ nor cmdline shows the key", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([bash(attack()), { content: "TASKCOMPLETE" }]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--api-key", "sk-leak-from-argv", "--session", "s.json", "look"],
      {
        cwd,
        env: { OPENAI_API_KEY: "sk-leak-from-env" },
      },
    );
    expect(run.code).toBe(0);
    const result = toolResults(srv)[0]!;
    expect(result).toContain("scanned");
    expect(result).toMatch(/^0$/m);
    expect(result).not.toContain("sk-leak");
    expect(readFileSync(join(cwd, "s.json"), "utf8")).not.toMatch(/sk-leak-from-(argv|env)/);
  });

  // Needs root and setpriv to run aic as `nobody`; skipped without them.
  test.skipIf(!has.root || !has.setpriv)(
    "as an unprivileged user: neither environ nor cmdline shows the key",
    async () => {
      const cwd = scratch();
      chmodSync(cwd, 0o777);
      const srv = fixtures.serve([bash(attack()), { content: "TASKCOMPLETE" }]);
      const run = await runAsNobody(
        [...headless(srv.url), "--auto-approve", "--api-key", "sk-leak-from-argv", "look"],
        cwd,
        {
          AIC_API_KEY: "sk-leak-from-env",
        },
      );
      expect(run.code).toBe(0);
      const result = toolResults(srv)[0]!;
      expect(result).toContain("scanned");
      expect(result).not.toContain("sk-leak");
    },
  );
});

describe("planted files never hang aic or get read", () => {
  // 4. Links to devices, FIFOs, directories and huge files where aic keeps its files: refused at once, never read.
  const cases: [string, (dir: string) => void, RegExp][] = [
    ["a link to /dev/zero", (d) => symlinkSync("/dev/zero", join(d, ".aicsession")), /symbolic link/],
    ["a FIFO", (d) => Bun.spawnSync(["mkfifo", join(d, ".aicsession")]), /FIFO/],
    ["a directory", (d) => mkdirSync(join(d, ".aicsession")), /directory/],
    [
      "a 300 MB file",
      (d) => Bun.spawnSync(["truncate", "-s", "300M", join(d, ".aicsession")]),
      /more than the \d+ bytes/,
    ],
  ];
  for (const [what, plant, reason] of cases) {
    test(`a session file that is ${what} is left untouched and the next file is used`, async () => {
      const cwd = scratch();
      plant(cwd);
      const before = lstatSync(join(cwd, ".aicsession"));
      const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
      const run = await runAic([...headless(srv.url), "--session", ".aicsession", "hello"], {
        cwd,
        killAfterMs: 60_000,
      });
      expect(run.code).toBe(0);
      expect(run.stderr).toMatch(reason);
      expect(run.stderr).toContain("instance 2");
      expect(existsSync(join(cwd, ".aicsession2"))).toBe(true);
      const after = lstatSync(join(cwd, ".aicsession"));
      expect([after.ino, after.size, after.mtimeMs]).toEqual([before.ino, before.size, before.mtimeMs]);
    });
  }

  test("a FIFO planted as the lock file does not block the start", async () => {
    const cwd = scratch();
    Bun.spawnSync(["mkfifo", join(cwd, ".aicsession.lock")]);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--session", ".aicsession", "hello"], { cwd, killAfterMs: 60_000 });
    expect(run.code).toBe(0);
    expect(run.stderr).toContain("FIFO");
    expect(existsSync(join(cwd, ".aicsession2"))).toBe(true);
  });

  test("a FIFO planted as the debug dump is replaced by a file, not written into", async () => {
    const cwd = scratch();
    Bun.spawnSync(["mkfifo", join(cwd, "commander-debug.txt")]);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--debug", "hello"], { cwd, killAfterMs: 60_000 });
    expect(run.code).toBe(0);
    expect(lstatSync(join(cwd, "commander-debug.txt")).isFile()).toBe(true);
    expect(readFileSync(join(cwd, "commander-debug.txt"), "utf8")).toContain("estimated_tokens");
  });

  test("a FIFO planted as AGENTS.md is skipped, not read", async () => {
    const cwd = scratch();
    Bun.spawnSync(["mkfifo", join(cwd, "AGENTS.md")]);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "hello"], { cwd, killAfterMs: 60_000 });
    expect(run.code).toBe(0);
    expect(srv.requests[0]!.body.messages[0].content).not.toContain("Project instructions");
  });
});

describe("what aic must not lose or hide", () => {
  // 5. A session file this user cannot read is never replaced: the next instance number is used, and why is said.
  // Needs root and setpriv to run aic as `nobody` (root reads any file); skipped without them.
  test.skipIf(!has.root || !has.setpriv)(
    "an unreadable session file is left as it is (unprivileged user)",
    async () => {
      const cwd = scratch();
      chmodSync(cwd, 0o777);
      const file = join(cwd, ".aicsession");
      writeFileSync(file, '{"messages": [{"role": "user", "content": "root only"}]}');
      chmodSync(file, 0o000);
      const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
      const run = await runAsNobody([...headless(srv.url), "--session", ".aicsession", "hello"], cwd);
      expect(run.code).toBe(0);
      expect(run.stderr).toContain("permission denied");
      expect(run.stderr).toContain(".aicsession2");
      expect(readFileSync(file, "utf8")).toBe('{"messages": [{"role": "user", "content": "root only"}]}');
      expect(statSync(file).mode & 0o777).toBe(0);
    },
  );

  // 6. Every repair is reported, and the hand-edited original is kept beside the file before it is rewritten.
  test("a repaired session keeps its original as .orig.<time> and reports every change", async () => {
    const cwd = scratch();
    const file = join(cwd, ".aicsession");
    const json = JSON.stringify({
      aic_session_version: 1,
      messages: [
        { role: "system", content: "my own hand-edited system prompt" },
        { role: "user", content: "first task @BAD@" },
        { rol: "user", content: "a mistyped entry" },
      ],
    });
    // An invalid UTF-8 byte inside the first task's text.
    const [before, after] = json.split("@BAD@") as [string, string];
    const bytes = Buffer.concat([Buffer.from(before), Buffer.from([0xff]), Buffer.from(after)]);
    writeFileSync(file, bytes);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--session", ".aicsession", "next"], { cwd });
    expect(run.code).toBe(0);
    expect(run.stderr).toContain("not messages (no role)");
    expect(run.stderr).toContain("system prompt in the file differs");
    expect(run.stderr).toContain("not valid UTF-8");
    const kept = readdirSync(cwd).filter((n) => n.startsWith(".aicsession.orig."));
    expect(kept).toHaveLength(1);
    expect(run.stderr).toContain(kept[0]!);
    expect(readFileSync(join(cwd, kept[0]!))).toEqual(bytes);
    expect(statSync(join(cwd, kept[0]!)).mode & 0o777).toBe(0o600);
    expect(JSON.parse(readFileSync(file, "utf8")).messages[1].content).toBe("first task \ufffd");
  });

  test("a session loaded without any change keeps no backup", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }, { content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(srv.url), "--session", ".aicsession", "one"], { cwd })).code).toBe(0);
    const again = await runAic([...headless(srv.url), "--session", ".aicsession", "two"], { cwd });
    expect(again.code).toBe(0);
    expect(readdirSync(cwd).filter((n) => n.includes(".orig."))).toEqual([]);
    expect(again.stderr).not.toContain("differs");
  });

  // 7. Escape sequences from the model, in a command line, or a command's output never reach a log or pipe raw.
  test("no escape sequence reaches stdout or stderr when they are not terminals", async () => {
    const cwd = scratch();
    const evil = "\x1b]52;c;cGF5bG9hZA==\x07\x1b]0;pwned\x07\x1b[2J";
    const srv = fixtures.serve([
      {
        content: `Working on it ${evil} now`,
        toolCalls: [
          {
            arguments: JSON.stringify({
              command: `printf '\\033]52;c;eA==\\007\\033[31mred\\033[0m done\\n' # ${evil}`,
            }),
          },
        ],
      },
      { content: `${evil} TASKCOMPLETE` },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "go"], { cwd });
    expect(run.code).toBe(0);
    expect(run.stdout).not.toContain("\x1b");
    expect(run.stderr).not.toContain("\x1b");
    expect(run.stdout).not.toContain("\x07");
    expect(run.stdout).toContain("Working on it ␛]52;c;cGF5bG9hZA==␇");
    expect(run.stdout).toContain("red done");
    expect(run.stdout).toMatch(/\$ printf .*# ␛\]52/);
  });

  test("the approval prompt shows a command's control characters instead of obeying them", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([bash("echo harmless\rrm -rf ~ \u202e")]);
    // (echo is read-only: --ask-every-command makes it wait for the answer, so its prompt shows.)
    const run = await runAic([...headless(srv.url), "--ask-every-command", "go"], { cwd, stdin: "n\n" });
    expect(run.stderr).toContain("Approve command? (y/n/suggestion): echo harmlessrm -rf ~ <U+202E>");
    expect(run.stderr).not.toContain("\r");
  });

  // 8. Hostile content of the right JSON type, and a session from a newer aic.
  test("content that is a number or a list of numbers is repaired into text and reported", async () => {
    const cwd = scratch();
    writeFileSync(
      join(cwd, ".aicsession"),
      JSON.stringify({
        messages: [
          { role: "system", content: "s" },
          { role: "user", content: 123 },
          { role: "assistant", content: [1, 2] },
        ],
      }),
    );
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--session", ".aicsession", "next"], { cwd });
    expect(run.code).toBe(0);
    expect(run.stderr).toContain("turned the content of 2 message(s) into text");
    const sent = srv.requests[0]!.body.messages;
    expect(sent[1].content).toBe("123");
    expect(sent[2].content).toBe("[1,2]");
  });

  // A command may rewrite the session while no aic runs (after kill -9): the next start says the file is not what
  // aic last wrote, so a person reads it before trusting it; an untouched file raises nothing.
  test("a session changed since aic last wrote it is pointed out at the next start", async () => {
    const cwd = scratch();
    const file = join(cwd, ".aicsession");
    const first = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(first.url), "--session", ".aicsession", "one"], { cwd })).code).toBe(0);
    const again = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const quiet = await runAic([...headless(again.url), "--session", ".aicsession", "two"], { cwd });
    expect(quiet.code).toBe(0);
    expect(quiet.stderr).not.toContain("changed since aic last wrote it");
    const doc = JSON.parse(readFileSync(file, "utf8"));
    doc.messages.push({ role: "user", content: "planted while aic was not running" });
    writeFileSync(file, JSON.stringify(doc, null, 2));
    const third = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const told = await runAic([...headless(third.url), "--session", ".aicsession", "three"], { cwd });
    expect(told.code).toBe(0);
    expect(told.stderr).toContain(`${file} changed since aic last wrote it`);
  });

  test("a session written by a newer aic is neither read nor rewritten", async () => {
    const cwd = scratch();
    const file = join(cwd, ".aicsession");
    const text = JSON.stringify({ aic_session_version: 2, messages: [{ role: "user", content: "from the future" }] });
    writeFileSync(file, text);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--session", ".aicsession", "now"], { cwd });
    expect(run.code).toBe(0);
    expect(run.stderr).toContain("newer aic");
    expect(readFileSync(file, "utf8")).toBe(text);
    expect(JSON.stringify(srv.requests[0]!.body.messages)).not.toContain("from the future");
  });
});

/**
 * Every open aic itself makes under the cwd or /tmp, from a full run under
 * strace: each must carry O_NOFOLLOW or be relative to a descriptor aic
 * holds. Processes are told apart by following clone and execve: aic and
 * its threads, and a child until it executes something other than aic (the
 * sandbox launcher is aic itself), are aic's; everything a command runs is not.
 */
// Needs strace; skipped without it.
describe.skipIf(!has.strace)("strace of a full run", () => {
  test("aic opens nothing in the cwd or /tmp without O_NOFOLLOW", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, "AGENTS.md"), "Be careful.\n");
    const srv = fixtures.serve([
      bash("seq 1 20000; echo > made-by-command.txt"),
      bash("cat made-by-command.txt; ls"),
      { content: "TASKCOMPLETE" },
    ]);
    const trace = join(scratch(), "trace.txt");
    const syscalls =
      "openat,open,creat,rename,renameat,renameat2,link,linkat,symlink,symlinkat,mkdir,mkdirat,execve,clone,clone3,vfork,fork";
    const { stderr, code } = await runCommand(
      [
        "strace",
        "-f",
        "-qq",
        "-s",
        "512",
        "-e",
        `trace=${syscalls}`,
        "-o",
        trace,
        AIC,
        ...headless(srv.url),
        "--auto-approve",
        "--session",
        ".aicsession",
        "--debug",
        "trace me",
      ],
      { cwd },
    );
    expect(stderr).not.toContain("internal error");
    expect(code).toBe(0);
    const violations = unsafeOpens(readFileSync(trace, "utf8"), cwd, ["/tmp", realpathSync("/tmp")]);
    expect(violations).toEqual([]);
  });
});

/** The aic-side opens of a `strace -f` trace that reach into `roots` by path without O_NOFOLLOW. */
function unsafeOpens(trace: string, cwd: string, roots: string[]): string[] {
  const lines = trace.split("\n").filter(Boolean);
  const first = Number(lines[0]?.split(/\s+/)[0]);
  /** pid → whose it is; a forked child is aic's until it executes something else. */
  const owner = new Map<number, "aic" | "command">([[first, "aic"]]);
  const pendingClone = new Map<number, string>();
  const found: string[] = [];
  const inside = (p: string) => [cwd, ...roots].some((root) => p === root || p.startsWith(root + "/"));
  for (const line of lines) {
    const m = line.match(/^(\d+)\s+(.*)$/);
    if (!m) continue;
    const pid = Number(m[1]);
    const rest = m[2]!;
    const who = owner.get(pid) ?? "aic";
    const clone = rest.match(/^(clone3?|vfork|fork)\((.*?)(?:<unfinished \.\.\.>|\) = (\d+))/);
    const resumed = rest.match(/^<\.\.\. (clone3?|vfork|fork) resumed>.*= (\d+)/);
    if (clone && !clone[3]) pendingClone.set(pid, clone[2]!);
    if (clone?.[3] || resumed) {
      const child = Number(clone?.[3] ?? resumed![2]);
      // With vfork the child's execve can be traced before the parent's "resumed" line: keep what it became.
      if (!owner.has(child)) owner.set(child, who);
      pendingClone.delete(pid);
      continue;
    }
    const exec = rest.match(/^execve\("([^"]*)"/);
    if (exec && who === "aic" && pid !== first && !/\/proc\/self\/exe$|\/dist\/aic$/.test(exec[1]!)) {
      if (!rest.includes("= -1")) owner.set(pid, "command");
      continue;
    }
    if (who !== "aic") continue;
    const open = rest.match(/^(openat|open|creat)\((AT_FDCWD|\d+)?,?\s*"([^"]*)",?\s*([A-Z_|]*)/);
    if (!open) continue;
    const [, , dirfd, file, flags] = open;
    if (dirfd && dirfd !== "AT_FDCWD") continue; // relative to a directory aic holds
    const absolute = file!.startsWith("/") ? file! : join(cwd, file!);
    if (!inside(absolute)) continue;
    if (!flags!.includes("O_NOFOLLOW")) found.push(line);
  }
  return found;
}
