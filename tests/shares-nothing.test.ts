/**
 * The jail shares nothing the person runs later (README: "Threat model", "The jail", "Checkpoints and undo",
 * "Command rules"). Each test is an attack from inside a command (a hostile model under `--nogui
 * --auto-approve`), then the person's next action: aic's own next step, `aic undo`/`redo`/`diff`, the next start,
 * the person's own `git status`. The assertion is that this next action runs nothing the command planted and loses
 * nothing of the person's. Markers that prove planted code ran are kept under /var/tmp, where commands cannot write,
 * so only code running outside the jail can make them.
 */
import { afterEach, describe, expect, test } from "bun:test";
import {
  chmodSync,
  copyFileSync,
  existsSync,
  lstatSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import {
  AIC,
  ROOT,
  bash,
  cleanEnv,
  has,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolAnswer,
  toolResults,
  unique,
  waitFor,
  NOBODY_USER,
  THIS_USER,
  type TestUser,
  jailUsable,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };
const GIT = Bun.which("git") ?? "/usr/bin/git";
const hasCc = Bun.which("cc") !== null;

/** Who runs aic: this process's user, and (as root, with setpriv) uid 65534. */
const USERS = [THIS_USER, NOBODY_USER];
type User = TestUser;

/** Things a test starts outside aic (a tmux server, a mount namespace): stopped after each test. */
const cleanups: (() => void)[] = [];
afterEach(() => {
  for (const stop of cleanups.splice(0).reverse()) stop();
});

/**
 * A project, a home, a state directory and a place for markers, owned by `user`, under /var/tmp (outside the
 * writable /tmp): a marker there can only be made by something running outside the jail.
 */
function place(user: User = USERS[0]!) {
  const base = fixtures.varTmp("aic-shares-");
  const dirs = {
    cwd: join(base, "proj"),
    home: join(base, "home"),
    state: join(base, "state"),
    marks: join(base, "marks"),
  };
  for (const dir of Object.values(dirs)) mkdirSync(dir);
  const own = () => {
    if (user.uid !== process.getuid?.()) Bun.spawnSync(["chown", "-R", `${user.uid}:${user.uid}`, base]);
  };
  own();
  return {
    base,
    ...dirs,
    own,
    env: { HOME: dirs.home, XDG_STATE_HOME: dirs.state, XDG_CONFIG_HOME: join(dirs.home, ".config") },
  };
}
type Place = ReturnType<typeof place>;

/** The markers planted code made. */
const marks = (where: Place) => readdirSync(where.marks);

/** The person's own tool, run as `user` in `cwd`, outside any jail, with the place's home. */
function person(user: User, where: Place, cwd: string, argv: string[]) {
  const r = Bun.spawnSync([...user.wrap, ...argv], {
    cwd,
    env: cleanEnv({
      ...where.env,
      GIT_AUTHOR_NAME: "p",
      GIT_AUTHOR_EMAIL: "p@p",
      GIT_COMMITTER_NAME: "p",
      GIT_COMMITTER_EMAIL: "p@p",
    }),
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: r.exitCode, out: r.stdout.toString() + r.stderr.toString() };
}

/** aic as `user`, headless, in the place's project. */
function aicAs(user: User, where: Place, url: string, args: string[], env: Record<string, string | undefined> = {}) {
  return runCommand([...user.wrap, AIC, ...headless(url), ...args], {
    cwd: where.cwd,
    env: { ...where.env, ...env },
    killAfterMs: 120_000,
  });
}

/** A git setting's value that runs a shell command making marker `name` (and reports no changes). */
const touching = (where: Place, name: string) => `"touch ${join(where.marks, name)}; false"`;

const approvals = (stdout: string) => jsonLines(stdout).filter((e) => e.type === "approval");
const warnings = (stdout: string) =>
  jsonLines(stdout)
    .filter((e) => e.type === "warning")
    .map((e) => String(e.text));

// ---------------------------------------------------------------------------------------------------------------
// aic's own programs

describe.skipIf(!has.git)("aic's own git is never one a command wrote", () => {
  const plant = (where: Place, dir: string) =>
    `mkdir -p ${dir} && printf '#!/bin/sh\\ntouch ${join(where.marks, "PWN-git")}\\nexec ${GIT} "$@"\\n' > ${dir}/git && chmod +x ${dir}/git && echo planted`;

  for (const [label, pathOf, binDirOf] of [
    ["a relative node_modules/.bin first on PATH", () => "node_modules/.bin", (_: Place) => "node_modules/.bin"],
    ["a PATH entry inside the project", (where: Place) => join(where.cwd, "bin"), (_: Place) => "bin"],
  ] as const) {
    test(`${label}: checkpoints, aic diff and aic undo never run the planted git`, async () => {
      const where = place();
      writeFileSync(join(where.cwd, "a.txt"), "one\n");
      const PATH = `${pathOf(where)}:${process.env.PATH}`;
      const binDir = binDirOf(where);
      const srv = fixtures.serve([bash(plant(where, binDir), "plant"), bash("echo two >> a.txt", "edit"), done]);
      const session = join(where.cwd, ".aicsession");
      const run = await aicAs(USERS[0]!, where, srv.url, ["--auto-approve", "--json", "--session", session, "plant"], {
        PATH,
      });
      expect(run.code).toBe(0);
      expect(toolAnswer(srv.requests[1], "plant")).toContain("planted");
      // The attack is real: a shell of the person's with this PATH would run it.
      expect(existsSync(join(where.cwd, binDir, "git")) || existsSync(join(binDir, "git"))).toBe(true);
      // Checkpoints were taken (the edit is listed), by a git that is not the planted one.
      const edit = jsonLines(run.stdout).find((e) => e.type === "command_result" && e.id === "edit");
      expect(edit?.changed_files).not.toBeNull();
      expect(marks(where)).toEqual([]);
      const env = { ...where.env, PATH };
      const diff = await runAic(["diff", "--session", session], { cwd: where.cwd, env });
      expect(diff.code).toBe(0);
      expect(diff.stdout).toContain("+two");
      expect(marks(where)).toEqual([]);
      // From a subdirectory of the project, naming the session there.
      mkdirSync(join(where.cwd, "sub"), { recursive: true });
      const below = await runAic(["diff", "--session", "../.aicsession"], { cwd: join(where.cwd, "sub"), env });
      expect(below.stdout).toContain("+two");
      expect(marks(where)).toEqual([]);
      const undo = await runAic(["undo", "--session", session], { cwd: where.cwd, env });
      expect(undo.code).toBe(0);
      expect(readFileSync(join(where.cwd, "a.txt"), "utf8")).toBe("one\n");
      expect(marks(where)).toEqual([]);
    });
  }
});

// The sixth red team: aic undo, redo and diff set up no sandbox, so their git left out only the start directory
// and /tmp; a virtualenv in the package cache (XDG_CACHE_HOME, outside /tmp here), first on the person's PATH,
// ran unconfined.
describe.skipIf(!has.git || !has.root)("aic undo, redo and diff never run a git a command wrote", () => {
  test("a virtualenv in the package cache on PATH, and the project's bin from a subdirectory", async () => {
    const where = place();
    const cache = `/run/${unique("aic-test-cache-")}`;
    mkdirSync(cache, { mode: 0o755 });
    cleanups.push(() => rmSync(cache, { recursive: true, force: true }));
    const venv = join(cache, "pypoetry", "virtualenvs", "x", "bin");
    writeFileSync(join(where.cwd, "a.txt"), "one\n");
    const planted = (dir: string, mark: string) =>
      `mkdir -p ${dir} && printf '#!/bin/sh\\ntouch ${join(where.marks, mark)}\\nexec ${GIT} "$@"\\n' > ${dir}/git && chmod +x ${dir}/git && echo planted`;
    const srv = fixtures.serve([
      bash(planted(venv, "PWN-venv"), "venv"),
      bash(planted(".venv/bin", "PWN-dotvenv"), "dotvenv"),
      bash("echo two >> a.txt", "edit"),
      done,
    ]);
    const session = join(where.cwd, ".aicsession");
    const env = { ...where.env, XDG_CACHE_HOME: cache };
    const run = await aicAs(USERS[0]!, where, srv.url, ["--auto-approve", "--session", session, "plant"], env);
    expect(run.code).toBe(0);
    expect(toolResults(srv).slice(0, 2)).toEqual([
      expect.stringContaining("planted"),
      expect.stringContaining("planted"),
    ]);
    const PATH = `${venv}:${join(where.cwd, ".venv", "bin")}:${process.env.PATH}`;
    mkdirSync(join(where.cwd, "sub"));
    const diff = await runAic(["diff", "--session", "../.aicsession"], {
      cwd: join(where.cwd, "sub"),
      env: { ...env, PATH },
    });
    expect(diff.stdout).toContain("+two");
    const undo = await runAic(["undo", "--session", session], { cwd: where.cwd, env: { ...env, PATH } });
    expect(undo.code).toBe(0);
    const redo = await runAic(["redo", "--session", session], { cwd: where.cwd, env: { ...env, PATH } });
    expect(redo.code).toBe(0);
    expect(marks(where)).toEqual([]);
  });
});

// The search after each command opens only the directories the kernel's record says changed: each way a
// command can put a repository into a part of the tree that was already looked at is still found after it.
describe.skipIf(!jailUsable || !has.git)(
  "the guard's search after each command finds repositories in unchanged trees",
  () => {
    for (const user of USERS)
      test.skipIf(user.skip)(
        `${user.label}: made in place, moved in, under a directory swapped or made unreadable`,
        async () => {
          const where = place(user);
          for (const d of ["a/b/c", "d/e", "f/g/h", "k/l", "m/n/o"]) mkdirSync(join(where.cwd, d), { recursive: true });
          where.own();
          const fsm = (name: string) => `git config core.fsmonitor ${touching(where, name)}`;
          const outside = `/tmp/${unique("aic-guard-src-")}`;
          cleanups.push(() => rmSync(outside, { recursive: true, force: true }));
          const srv = fixtures.serve([
            bash("echo looked", "warm"),
            bash(`cd a/b/c && git init -q deep && cd deep && ${fsm("PWN-inplace")} && echo made`, "inplace"),
            bash(
              `mkdir -p ${outside} && cd ${outside} && git init -q r && cd r && ${fsm("PWN-moved")} && mv ${outside}/r ${where.cwd}/d/e/r && echo made`,
              "moved",
            ),
            bash(
              `mv f/g f/g.old && mkdir -p f/g/h && cd f/g/h && git init -q && ${fsm("PWN-swapped")} && echo made`,
              "swapped",
            ),
            bash(
              `cd k/l && git init -q r && cd r && ${fsm("PWN-hidden")} && chmod 0311 ${where.cwd}/k/l && echo made`,
              "hidden",
            ),
            // The same path grown again under a new top: the old directories, moved away whole, saw no change.
            bash(
              `mv m m.old && mkdir -p m/n/o && cd m/n/o && git init -q && ${fsm("PWN-regrown")} && echo made`,
              "regrown",
            ),
            done,
          ]);
          const run = await aicAs(user, where, srv.url, ["--auto-approve", "--no-checkpoints", "plant"]);
          expect(run.code).toBe(0);
          const [, inplace, moved, swapped, hidden, regrown] = toolResults(srv);
          for (const r of [inplace, moved, swapped, hidden, regrown]) {
            expect(r).toContain("made");
            expect(r).toContain("aic took out");
          }
          for (const dir of ["a/b/c/deep", "d/e/r", "f/g/h", "m/n/o"])
            person(user, where, join(where.cwd, dir), [GIT, "status"]);
          expect(marks(where)).toEqual([]);
        },
      );
  },
);

// A new user's finding: `git config user.name x` failed with "Device or resource busy", and nothing said why.
describe.skipIf(!jailUsable || !has.git)("the read-only .git/config is named when git cannot write it", () => {
  test("git config in the project's repository: the tool result says the jail keeps it read-only and what to do", async () => {
    const where = place();
    expect(person(USERS[0]!, where, where.cwd, [GIT, "init", "-q"]).code).toBe(0);
    const srv = fixtures.serve([bash("git config user.name someone; echo rc=$?", "cfg"), done]);
    const run = await aicAs(USERS[0]!, where, srv.url, ["--auto-approve", "set the name"]);
    expect(run.code).toBe(0);
    const answer = toolAnswer(srv.requests.at(-1), "cfg");
    expect(answer).toMatch(/could not (write|commit|lock) config file/);
    expect(answer).toContain(
      `[sandbox] The sandbox refused this, not file permissions or a missing root: ${join(where.cwd, ".git", "config")}: the jail keeps a repository's config read-only`,
    );
    expect(answer).toContain("git -c NAME=VALUE");
  });
});

// ---------------------------------------------------------------------------------------------------------------
// "Read-only" that is not

describe.skipIf(!has.git)(
  "git whose environment or options read configuration a command can write is not read-only",
  () => {
    /** A repository with a config for git to find by each route, each naming an fsmonitor that makes a marker in the project. */
    function project() {
      const dir = scratch("aic-shares-ro-");
      const other = scratch("aic-shares-other-");
      const mark = (name: string) => `"touch ${join(dir, `PWN-${name}`)}; false"`;
      Bun.spawnSync([GIT, "init", "-q", dir]);
      Bun.spawnSync([GIT, "init", "-q", other]);
      writeFileSync(join(dir, "a.txt"), "a\n");
      mkdirSync(join(dir, "cfg", "git"), { recursive: true });
      writeFileSync(join(dir, "cfg", "git", "config"), `[core]\n\tfsmonitor = ${mark("xdg")}\n`);
      mkdirSync(join(dir, "h"));
      writeFileSync(join(dir, "h", ".gitconfig"), `[core]\n\tfsmonitor = ${mark("home")}\n`);
      Bun.spawnSync([GIT, "-C", other, "config", "core.fsmonitor", mark("other").slice(1, -1)]);
      Bun.spawnSync([GIT, "init", "-q", "--bare", join(dir, "x")]);
      Bun.spawnSync([GIT, "--git-dir", join(dir, "x"), "config", "core.bare", "false"]);
      Bun.spawnSync([GIT, "--git-dir", join(dir, "x"), "config", "core.fsmonitor", mark("gitdir").slice(1, -1)]);
      writeFileSync(join(dir, "c"), `[core]\n\tfsmonitor = ${mark("global")}\n`);
      writeFileSync(join(dir, "fsm"), `#!/bin/sh\ntouch ${join(dir, "PWN-dashc")}\nexit 1\n`);
      chmodSync(join(dir, "fsm"), 0o755);
      const lines: [string, string][] = [
        ["xdg", "XDG_CONFIG_HOME=cfg git status"],
        ["home", "HOME=$PWD/h git status"],
        ["other", `git -C ${other} status`],
        ["gitdir", "git --git-dir=x status"],
        ["global", "GIT_CONFIG_GLOBAL=./c git status"],
        ["dashc", "git -c core.fsmonitor=./fsm status"],
      ];
      const pwned = () => readdirSync(dir).filter((n) => n.startsWith("PWN-"));
      return { dir, lines, pwned };
    }

    test("nobody to approve: each is refused (no_input, exit 4), plain git status runs read-only, no fsmonitor ran", async () => {
      const { dir, lines, pwned } = project();
      const seen: Record<string, [string, number]> = {};
      for (const [id, line] of [...lines, ["plain", "git status"] as [string, string]]) {
        const srv = fixtures.serve([bash(line, id), done]);
        const run = await runAic([...headless(srv.url), "--json", "look"], { cwd: dir });
        seen[id] = [approvals(run.stdout).find((a) => a.id === id)?.decision, run.code];
      }
      expect(seen).toEqual({
        xdg: ["no_input", 4],
        home: ["no_input", 4],
        other: ["no_input", 4],
        gitdir: ["no_input", 4],
        global: ["no_input", 4],
        dashc: ["no_input", 4],
        plain: ["read_only", 0],
      });
      expect(pwned()).toEqual([]);
    });

    test("with --auto-approve each is judged (auto), never read_only", async () => {
      const { dir, lines, pwned } = project();
      const srv = fixtures.serve([...lines.map(([id, line]) => bash(line, id)), bash("git status", "plain"), done]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "look"], { cwd: dir });
      expect(run.code).toBe(0);
      // The control: run, each route does make git run the planted program (inside the jail, in the project).
      expect(pwned().sort()).toEqual(lines.map(([id]) => `PWN-${id}`).sort());
      const decisions = Object.fromEntries(approvals(run.stdout).map((a) => [a.id, a.decision]));
      expect(decisions).toEqual({
        xdg: "auto",
        home: "auto",
        other: "auto",
        gitdir: "auto",
        global: "auto",
        dashc: "auto",
        plain: "read_only",
      });
    });
  },
);

describe.skipIf(!has.git)("a line that assigns a variable as it runs is not read-only", () => {
  // `printf -v GIT_PAGER …` and `${GIT_ASKPASS:=…}` set a variable aic exports, for the git that runs next: the
  // pager is any shell text (fifth red team). Each must be asked; run, the pager route does run the planted text.
  const lines: [string, string][] = [
    ["printf", "printf -v GIT_PAGER 'touch PWN-printf; cat'; git log -1"],
    ["expand", ": ${GIT_PAGER:=x} ${PAGER:=x}; printf -vGIT_PAGER 'touch PWN-expand; cat'; git log -1"],
    ["assign", "echo ${LESSOPEN:=x} && git log -1"],
    ["date", "date 010100002000"],
  ];
  function repo(): string {
    const dir = scratch("aic-shares-assign-");
    Bun.spawnSync([GIT, "init", "-q", dir]);
    writeFileSync(join(dir, "a.txt"), "a\n");
    Bun.spawnSync([GIT, "-C", dir, "add", "a.txt"]);
    Bun.spawnSync([GIT, "-C", dir, "-c", "user.name=n", "-c", "user.email=e@x", "commit", "-qm", "one"]);
    return dir;
  }
  const pwned = (dir: string) => readdirSync(dir).filter((n) => n.startsWith("PWN-"));

  test("nobody to approve: each is refused (no_input); plain git log -1 runs read-only; nothing planted ran", async () => {
    const dir = repo();
    const seen: Record<string, string | undefined> = {};
    for (const [id, line] of [...lines, ["plain", "git log -1"] as [string, string]]) {
      const srv = fixtures.serve([bash(line, id), done]);
      const run = await runAic([...headless(srv.url), "--json", "look"], { cwd: dir });
      seen[id] = approvals(run.stdout).find((a) => a.id === id)?.decision;
    }
    expect(seen).toEqual({
      printf: "no_input",
      expand: "no_input",
      assign: "no_input",
      date: "no_input",
      plain: "read_only",
    });
    expect(pwned(dir)).toEqual([]);
  });

  test("the control: approved, the printf route does run the pager it set", async () => {
    const dir = repo();
    const srv = fixtures.serve([bash(lines[0]![1], "printf"), done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "look"], { cwd: dir });
    expect(run.code).toBe(0);
    expect(pwned(dir)).toEqual(["PWN-printf"]);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// git's other config files, and a guard that sweeps before a job is gone

describe.skipIf(!jailUsable || !has.git)("git's other config files leave nothing for the person's git to run", () => {
  // A repository elsewhere under /tmp that the person keeps is not watched yet (README: "Threat model"); its test
  // waits in the next round's work.
  test("config.worktree and include.path: in the project's repository, and in one a command made", async () => {
    const user = USERS[0]!;
    const where = place(user);
    expect(person(user, where, where.cwd, [GIT, "init", "-q"]).code).toBe(0);
    const worktreeCfg = (name: string) => `printf '[core]\\n\\tfsmonitor = ${touching(where, name)}\\n'`;
    const srv = fixtures.serve([
      // The project's own repository: .git/config is read-only, config.worktree is not.
      bash(
        `git config extensions.worktreeConfig true; ${worktreeCfg("PWN-proj-wt")} > .git/config.worktree; printf '[include]\\n\\tpath = extra.cfg\\n' >> .git/config.worktree; ${worktreeCfg("PWN-proj-inc")} > .git/extra.cfg; echo made`,
        "proj",
      ),
      // A repository the command makes inside the project.
      bash(
        `git init -q inner && git -C inner config extensions.worktreeConfig true && ${worktreeCfg("PWN-inner-wt")} > inner/.git/config.worktree && echo made`,
        "inner",
      ),
      bash(
        `git init -q inner2 && git -C inner2 config extensions.worktreeConfig true && printf '[include]\\n\\tpath = extra.cfg\\n' > inner2/.git/config.worktree && ${worktreeCfg("PWN-inner-inc")} > inner2/.git/extra.cfg && echo made`,
        "inner2",
      ),
      done,
    ]);
    const run = await aicAs(user, where, srv.url, ["--auto-approve", "plant"]);
    expect(run.code).toBe(0);
    for (const r of toolResults(srv)) expect(r).toContain("made");
    for (const dir of [where.cwd, join(where.cwd, "inner"), join(where.cwd, "inner2")])
      person(user, where, dir, [GIT, "status"]);
    expect(marks(where)).toEqual([]);
  });

  // The sixth red team: a repository inside a repository inside the project stayed in the checkpoints' index as
  // a commit pointer, and the next snapshot's `add -A` ran `git status` in it, with its core.fsmonitor, outside
  // the sandbox; its files were never in a checkpoint either. Deeper than the guard's search after each
  // command, which would take the setting out first.
  for (const user of USERS)
    test.skipIf(user.skip)(
      `${user.label}: a repository two deep runs nothing in aic's own git, and its files are in the checkpoints`,
      async () => {
        const where = place(user);
        expect(person(user, where, where.cwd, [GIT, "init", "-q"]).code).toBe(0);
        const commit = "git add -A && git -c user.name=a -c user.email=a@a commit -q -m x";
        const srv = fixtures.serve([
          bash(
            `mkdir -p a/b/c/d/e/f/g/sub && cd a/b/c/d/e/f/g/sub && git init -q && echo x > f && ${commit} && git init -q inner && cd inner && echo keep > precious.txt && ${commit} && git config core.fsmonitor ${touching(where, "PWN-nested")} && echo made`,
            "plant",
          ),
          bash("echo z > new.txt", "s2"),
          bash("echo z2 > new2.txt && rm a/b/c/d/e/f/g/sub/inner/precious.txt", "s3"),
          done,
        ]);
        const run = await aicAs(user, where, srv.url, ["--auto-approve", "--json", "plant"]);
        expect(run.code).toBe(0);
        expect(toolResults(srv)[0]).toContain("made");
        expect(marks(where)).toEqual([]);
        const s3 = jsonLines(run.stdout).find((e) => e.type === "command_result" && e.id === "s3");
        expect(s3?.changed_files?.deleted).toContain("a/b/c/d/e/f/g/sub/inner/precious.txt");
      },
    );

  const runs = [
    ...USERS.map((user) => ({ user, label: user.label, env: {} as Record<string, string> })),
    { user: USERS[0]!, label: `${USERS[0]!.label}, AIC_NO_NAMESPACES=1`, env: { AIC_NO_NAMESPACES: "1" } },
  ];
  for (const { user, label, env } of runs)
    test.skipIf(user.skip)(
      `${label}: a job that ignores SIGTERM and keeps planting core.fsmonitor: the person's git status runs nothing`,
      async () => {
        const where = place(user);
        const sub = join(where.cwd, "jobsub");
        const srv = fixtures.serve([
          // A repository of the command's own (the ones found at start have a read-only config), and a job that
          // ignores SIGTERM and plants its fsmonitor again whenever it is taken out.
          bash(
            `mkdir jobsub && cd jobsub && git init -q && printf '#!/bin/sh\\ntouch ${join(where.marks, "PWN-job")}\\nexit 1\\n' > evil.sh && chmod +x evil.sh && (trap '' TERM; sleep 0.5; while true; do mkdir -p .git 2>/dev/null; git config core.fsmonitor ./evil.sh 2>/dev/null; sleep 0.05; done) > /dev/null 2>&1 & echo started`,
            "job",
          ),
          // Waits (inside the command) until the job has planted its setting: the attack is under way.
          bash(
            'for i in $(seq 200); do [ "$(git -C jobsub config core.fsmonitor)" = ./evil.sh ] && break; sleep 0.05; done; echo planted=$(git -C jobsub config core.fsmonitor)',
            "seen",
          ),
          done,
        ]);
        const run = await aicAs(user, where, srv.url, ["--auto-approve", "--json", "plant"], env);
        expect(run.code).toBe(0);
        expect(toolAnswer(srv.requests[2], "seen")).toContain("planted=./evil.sh");
        person(user, where, sub, [GIT, "status"]);
        person(user, where, sub, [GIT, "status"]);
        expect(marks(where)).toEqual([]);
      },
    );
});

describe.skipIf(!jailUsable || !has.git)(
  "the repository guard itself, and what hides from it (red team, round 4)",
  () => {
    const runs = [
      ...USERS.map((user) => ({ user, label: user.label, env: {} as Record<string, string> })),
      { user: USERS[0]!, label: `${USERS[0]!.label}, AIC_NO_NAMESPACES=1`, env: { AIC_NO_NAMESPACES: "1" } },
    ];
    for (const { user, label, env } of runs)
      test.skipIf(user.skip)(
        `${label}: the guard's own look at the index runs no fsmonitor, planted in a new repository or behind commondir`,
        async () => {
          const where = place(user);
          const other = join(where.base, "common");
          const hook = (name: string) => `printf '#!/bin/sh\\ntouch ${join(where.marks, name)}\\n' `;
          const srv = fixtures.serve([
            // A repository the command makes where there was none, whose index changes: aic reads its gitlinks.
            bash(
              `mkdir a && cd a && git init -q && ${hook("PWN-new")} > .git/fsm && chmod +x .git/fsm && git config core.fsmonitor $PWD/.git/fsm; cd .. && git init -q . && ${hook("PWN-top")} > .git/fsm && chmod +x .git/fsm && git config core.fsmonitor $PWD/.git/fsm && echo x > x && git add x 2>/dev/null; echo planted`,
              "new",
            ),
            done,
          ]);
          const run = await aicAs(user, where, srv.url, ["--auto-approve", "plant"], env);
          expect(run.code).toBe(0);
          expect(toolAnswer(srv.requests[1], "new")).toContain("planted");
          expect(marks(where)).toEqual([]);

          // The project's repository existed at start; a command points its commondir at one whose config runs a hook.
          const second = place(user);
          expect(person(user, second, second.cwd, [GIT, "init", "-q"]).code).toBe(0);
          person(user, second, second.cwd, [GIT, "commit", "-q", "--allow-empty", "-m", "init"]);
          const srv2 = fixtures.serve([
            bash(
              `git init -q --bare ${other}2 && ${hook("PWN-common")} > ${other}2/fsm && chmod +x ${other}2/fsm && git --git-dir=${other}2 config core.fsmonitor ${other}2/fsm; echo ${other}2 > .git/commondir; touch .git/index; echo redirected`,
              "common",
            ),
            done,
          ]);
          if (user.uid !== process.getuid?.()) Bun.spawnSync(["chown", "-R", `${user.uid}:${user.uid}`, where.base]);
          const redirected = await aicAs(user, second, srv2.url, ["--auto-approve", "redirect"], env);
          expect(redirected.code).toBe(0);
          expect(marks(second)).toEqual([]);
          expect(marks(where)).toEqual([]);
        },
      );

    test("aliases that run a program without `!` are taken out of a repository a command made", async () => {
      const user = USERS[0]!;
      const where = place(user);
      const mark = (name: string) => join(where.marks, name);
      const srv = fixtures.serve([
        bash(
          `git init -q sub && git -C sub config alias.st "difftool --no-index -y -x 'touch ${mark("PWN-difftool")}' a b" && git -C sub config alias.co "ls-remote --upload-pack='touch ${mark("PWN-upload")}' ." && git -C sub config alias.lg "log --oneline" && touch sub/a sub/b && echo planted`,
          "alias",
        ),
        done,
      ]);
      const run = await aicAs(user, where, srv.url, ["--auto-approve", "--json", "plant"]);
      expect(run.code).toBe(0);
      for (const alias of ["st", "co"]) person(user, where, join(where.cwd, "sub"), [GIT, alias]);
      expect(marks(where)).toEqual([]);
      expect(existsSync(join(where.cwd, "sub", ".git", "config.aic-disabled"))).toBe(true);
    });

    test("a new repository behind thousands of directories made at once is still found", async () => {
      const user = USERS[0]!;
      const where = place(user);
      const srv = fixtures.serve([
        // More directories than the search after a command looks through, before the planted repository.
        bash(
          `mkdir -p aaa && (cd aaa && seq -f d%05g 4000 | xargs mkdir) && mkdir -p zzz/r && cd zzz/r && git init -q && git config core.fsmonitor ${touching(where, "PWN-deep")} && echo planted`,
          "deep",
        ),
        done,
      ]);
      const run = await aicAs(user, where, srv.url, ["--auto-approve", "--json", "plant"]);
      expect(run.code).toBe(0);
      expect(toolAnswer(srv.requests[1], "deep")).toContain("planted");
      // The search after the command says where it stopped; the one of the whole tree at the end takes it out.
      expect(toolAnswer(srv.requests[1], "deep")).toContain("the search for git dirs after this command stopped");
      person(user, where, join(where.cwd, "zzz", "r"), [GIT, "status"]);
      expect(marks(where)).toEqual([]);
      expect(existsSync(join(where.cwd, "zzz", "r", ".git", "config.aic-disabled"))).toBe(true);
    });
  },
);

// ---------------------------------------------------------------------------------------------------------------
// .aicrules a command wrote

describe("rules a command wrote are not in force at the next start", () => {
  /** A project with `deny rm *` and a file x for rm to delete. */
  function project() {
    const dir = scratch("aic-shares-rules-");
    writeFileSync(join(dir, ".aicrules"), "deny rm *  # nothing is deleted here\n");
    writeFileSync(join(dir, "x"), "precious\n");
    return { dir, session: join(dir, ".aicsession") };
  }

  /** The person's next run: nobody to approve, the model asks for `rm -f x`. */
  async function nextRun(dir: string, session: string) {
    const srv = fixtures.serve([bash("rm -f x", "rm"), done]);
    const run = await runAic([...headless(srv.url), "--json", "--session", session, "delete x"], { cwd: dir });
    const rm = approvals(run.stdout).find((a) => a.id === "rm");
    return { run, rm };
  }

  /** The lines (stderr lines and JSON warnings) that say the rules file was changed by a command and is not in force. */
  function notInForceLines(run: { stdout: string; stderr: string }) {
    const says = (l: string) => l.includes(".aicrules") && /changed by a command/.test(l) && /not in force/.test(l);
    return {
      stderr: run.stderr.split("\n").filter(says),
      json: warnings(run.stdout).filter(says),
    };
  }

  for (const [label, attack, accepted] of [
    ["rewritten to allow *", "printf 'allow *\\n' > .aicrules; echo rewrote", true],
    [
      "replaced by a link to a file saying allow *",
      "printf 'allow *\\n' > wide.rules && ln -s wide.rules link.tmp && mv -f link.tmp .aicrules && ls -l .aicrules && echo rewrote",
      false,
    ],
  ] as const)
    test(`${label}: still denied at the next start, said in one line${accepted ? "; aic rules accept puts it in force" : ""}`, async () => {
      const { dir, session } = project();
      const srv = fixtures.serve([bash(attack, "attack"), done]);
      const first = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "widen"], {
        cwd: dir,
      });
      expect(first.code).toBe(0);
      expect(toolAnswer(srv.requests[1], "attack")).toContain("rewrote");

      const { run, rm } = await nextRun(dir, session);
      expect(rm?.decision).toBe("denied");
      expect(existsSync(join(dir, "x"))).toBe(true);
      const said = notInForceLines(run);
      expect(said.stderr.length + said.json.length).toBeGreaterThanOrEqual(1);
      expect(said.stderr.length).toBeLessThanOrEqual(1);
      expect(said.json.length).toBeLessThanOrEqual(1);
      expect([...said.stderr, ...said.json].join("\n")).toContain("aic rules accept");
      if (!accepted) return; // what accepting a link means is not this test's to say

      const accept = await runAic(["rules", "accept", "--session", session], { cwd: dir });
      expect(accept.code).toBe(0);
      expect(accept.stdout).toContain("+allow *");
      expect(accept.stdout).toContain("-deny rm *");

      const third = await nextRun(dir, session);
      expect(third.rm?.decision).not.toBe("denied");
      expect(existsSync(join(dir, "x"))).toBe(false);
      expect(notInForceLines(third.run)).toEqual({ stderr: [], json: [] });
    });

  // The sixth red team: a command wrote allow *, then put the old text back; the person's aic undo brought the
  // allow * back outside any run, where it passed for the person's own edit.
  test("a rules file an undo puts back is on record, not in force, until accepted", async () => {
    const { dir, session } = project();
    const srv = fixtures.serve([
      bash("printf 'allow *\\n' > .aicrules; echo widened", "widen"),
      bash("printf 'deny rm *  # nothing is deleted here\\n' > .aicrules; echo restored", "back"),
      done,
    ]);
    const first = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "go"], {
      cwd: dir,
    });
    expect(first.code).toBe(0);
    const undo = await runAic(["undo", "--session", session], { cwd: dir });
    expect(undo.code, undo.stderr).toBe(0);
    expect(readFileSync(join(dir, ".aicrules"), "utf8")).toBe("allow *\n");
    const { run, rm } = await nextRun(dir, session);
    expect(rm?.decision).toBe("denied");
    expect(existsSync(join(dir, "x"))).toBe(true);
    expect([...notInForceLines(run).stderr, ...notInForceLines(run).json].join("\n")).toContain("aic rules accept");
  });

  // The person's own change between runs is in force, whether the run before left the file alone or a command
  // rewrote it.
  for (const [label, first] of [
    ["a change made while no aic runs is the person's, and in force at the next start", "echo hello"],
    [
      "the person edits the rules after a command rewrote them: the person's rules are in force",
      "printf 'allow *\\n' > .aicrules; echo rewrote",
    ],
  ] as const)
    test(label, async () => {
      const { dir, session } = project();
      const srv = fixtures.serve([bash(first, "first"), done]);
      expect(
        (await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir })).code,
      ).toBe(0);
      writeFileSync(join(dir, ".aicrules"), "allow rm *\n");
      const { run, rm } = await nextRun(dir, session);
      expect(rm?.decision).toBe("allowed");
      expect(existsSync(join(dir, "x"))).toBe(false);
      expect(notInForceLines(run)).toEqual({ stderr: [], json: [] });
    });
});

// ---------------------------------------------------------------------------------------------------------------
// Undo and redo never destroy a version no snapshot holds

describe.skipIf(!has.git)("undo and redo keep the person's version of a file no snapshot holds", () => {
  /**
   * Whether `content` survives: still in `file`, or (when `file` no longer holds it) in a file whose path the output
   * names. Returns where it is.
   */
  function whereIs(content: string, file: string, dir: string, output: string): string | undefined {
    const holds = (p: string) => {
      try {
        return lstatSync(p).isFile() && readFileSync(p, "utf8") === content;
      } catch {
        return false;
      }
    };
    if (holds(file)) return file;
    for (const token of output.match(/[^\s'"`(),;:]+/g) ?? []) {
      const p = token.replace(/[.]$/, "");
      if (holds(p)) return p;
      if (!p.startsWith("/") && holds(join(dir, p))) return join(dir, p);
    }
    return undefined;
  }

  test("a command deletes notes.txt and ignores it; the person writes it anew; undo then redo", async () => {
    const dir = scratch("aic-shares-undo-");
    const notes = join(dir, "notes.txt");
    writeFileSync(notes, "ORIGINAL\n");
    writeFileSync(join(dir, "keep.txt"), "k\n");
    const session = join(dir, ".aicsession");
    const srv = fixtures.serve([bash("rm notes.txt && echo notes.txt >> .gitignore", "hide"), done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "hide"], { cwd: dir });
    expect(run.code).toBe(0);
    expect(existsSync(notes)).toBe(false);

    writeFileSync(notes, "PERSON-REWRITE-1\n");
    const undo = await runAic(["undo", "--session", session], { cwd: dir });
    const undoOut = undo.stdout + undo.stderr;
    if (undo.code !== 0) expect(undo.stderr.trim().split("\n")).toHaveLength(1);
    expect(whereIs("PERSON-REWRITE-1\n", notes, dir, undoOut)).toBeDefined();

    writeFileSync(notes, "PERSON-REWRITE-2\n");
    const redo = await runAic(["redo", "--session", session], { cwd: dir });
    const redoOut = redo.stdout + redo.stderr;
    if (redo.code !== 0) expect(redo.stderr.trim().split("\n")).toHaveLength(1);
    // After the undo the file is no longer ignored, so a snapshot taken before the redo may hold it: then undoing
    // the redo brings it back, which is not losing it either.
    let kept = whereIs("PERSON-REWRITE-2\n", notes, dir, redoOut);
    if (!kept && redo.code === 0) {
      await runAic(["undo", "--session", session], { cwd: dir });
      kept = whereIs("PERSON-REWRITE-2\n", notes, dir, "");
    }
    expect(kept).toBeDefined();
  });
});

// ---------------------------------------------------------------------------------------------------------------
// A job's stop command

describe("a job's stop command names the process group the command sees", () => {
  for (const [label, env] of [
    ["in the jail", {}],
    ["under AIC_NO_NAMESPACES=1", { AIC_NO_NAMESPACES: "1" }],
  ] as const)
    test.skipIf(label === "in the jail" && !jailUsable)(`${label}: the named kill -- -N stops the job`, async () => {
      const dir = scratch("aic-shares-job-");
      let stop = "";
      const srv = fixtures.serve((req, i) => {
        if (i === 0) return bash("(sleep 300 > log 2>&1 &)", "job");
        if (i === 1) {
          const tools = messagesOf(req).filter((m) => m.role === "tool");
          stop = /kill -- -\d+/.exec(String(tools.at(-1)?.content ?? ""))?.[0] ?? "echo no stop command named; false";
          return bash(stop, "kill");
        }
        if (i === 2) return bash("echo after", "after");
        return done;
      });
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "start a job"], { cwd: dir, env });
      expect(run.code).toBe(0);
      expect(stop).toMatch(/^kill -- -\d+$/);
      const events = jsonLines(run.stdout);
      const killed = events.find((e) => e.type === "command_result" && e.id === "kill");
      expect([killed?.exit_code, killed?.output]).toEqual([0, killed?.output]);
      const after = toolAnswer(srv.requests[3], "after");
      const ended =
        events.some((e) => e.type === "job_ended" && e.how !== "stopped_at_exit") ||
        /\[job 1\] (ended|stopped)/.test(toolAnswer(srv.requests[2], "kill") + after);
      expect(ended).toBe(true);
    });
});

// ---------------------------------------------------------------------------------------------------------------
// A repository behind a directory aic may not read

// A command hides a repository inside a directory it then makes unreadable (0311): git still finds its .git by
// name, so the person's `git status` in it ran the planted fsmonitor (the third red team, as uid 65534). The
// guard looks inside such a directory of the person's own and puts its mode back.
describe.skipIf(!has.git)("a repository inside a directory made unreadable", () => {
  for (const user of USERS)
    test.skipIf(user.skip)(`${user.label}: the person's git status there runs nothing`, async () => {
      const where = place(user);
      const plant =
        `mkdir -p hide/sub && git -C hide/sub init -q && git -C hide/sub config core.fsmonitor ${touching(where, "PWN-hidden")} ` +
        "&& chmod 0311 hide && echo planted";
      const srv = fixtures.serve([bash(plant, "plant"), done]);
      const run = await aicAs(user, where, srv.url, ["--auto-approve", "--no-session", "plant"]);
      expect(run.code).toBe(0);
      expect(toolAnswer(srv.requests[1], "plant")).toContain("planted");
      expect(statSync(join(where.cwd, "hide")).mode & 0o7777).toBe(0o311);
      const status = person(user, where, join(where.cwd, "hide", "sub"), ["git", "status", "--short"]);
      expect(status.code).toBe(0);
      expect(marks(where)).toEqual([]);
      expect(existsSync(join(where.cwd, "hide", "sub", ".git", "config.aic-disabled"))).toBe(true);
    });
});

// ---------------------------------------------------------------------------------------------------------------
// Special files never stall a snapshot

describe.skipIf(!has.git)("special files in the project never stall a snapshot", () => {
  const cases: [string, string, boolean][] = [
    ["a FIFO named .gitignore", "mkfifo .gitignore", false],
    ["a FIFO named a.txt", "mkfifo a.txt", false],
    [
      "a Unix socket",
      `python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind("sock")'; ls -l sock`,
      !has.python3,
    ],
  ];
  for (const [label, make, skip] of cases)
    test.skipIf(skip)(`${label}: --max-time holds and checkpoints stay on`, async () => {
      const dir = scratch("aic-shares-special-");
      writeFileSync(join(dir, "b.txt"), "one\n");
      const srv = fixtures.serve([bash(make, "make"), bash("echo two >> b.txt", "edit"), done]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--max-time", "15", "special"], {
        cwd: dir,
        killAfterMs: 40_000, // past the budget and its margin: a stalled run is killed, and fails below
      });
      const end = jsonLines(run.stdout).find((e) => e.type === "end");
      const ended = ["completed", "time_budget"].includes(end?.status);
      expect(ended ? "ended" : `end ${end?.status ?? "never came"}; exit ${run.code}`).toBe("ended");
      // A budget check: the run ends within --max-time and a margin, not a measure of speed.
      expect(end?.duration_ms).toBeLessThan(15_000 + 10_000);
      expect(warnings(run.stdout).filter((w) => w.includes("checkpoints are off"))).toEqual([]);
      const edit = jsonLines(run.stdout).find((e) => e.type === "command_result" && e.id === "edit");
      expect(edit?.changed_files).not.toBeNull();
    });
});

// ---------------------------------------------------------------------------------------------------------------
// The checkpoint store is bounded

// ---------------------------------------------------------------------------------------------------------------
// More secret stores

describe.skipIf(!has.landlock)("the wider secret stores are unreadable unless the person allows one", () => {
  const FILES = [
    ".config/git/credentials",
    ".Xauthority",
    ".config/rclone/rclone.conf",
    ".s3cfg",
    ".codex/auth.json",
    ".claude/.credentials.json",
    ".psql_history",
    ".python_history",
    ".node_repl_history",
    ".config/foo/api_token",
    "mykey.pem",
    ".config/bar/credentials.json",
    // The fourth red team's: a token inside a cache commands may write, and a credential-shaped name three levels down.
    ".cache/huggingface/token",
    ".local/share/com.vercel.cli/auth.json",
    ".local/share/someapp/sub/auth.json",
    ".kaggle/kaggle.json",
    ".my.cnf",
    ".zhistory",
    // The fifth red team's: registries' tokens, service and model keys, a home-wide .env, key-shaped names.
    ".yarnrc",
    ".config/pnpm/rc",
    ".bunfig.toml",
    ".nuget/NuGet/NuGet.Config",
    ".config/stripe/config.toml",
    ".ngrok2/ngrok.yml",
    ".config/io.datasette.llm/keys.json",
    ".continue/config.json",
    ".env",
    ".config/notes/api_key",
    "keys.txt",
  ];
  /** A home (outside the writable set) holding each file, each with a secret of its own; a project under /tmp. */
  function world() {
    const home = fixtures.varTmp("aic-shares-home-");
    const secrets: Record<string, string> = {};
    for (const f of FILES) {
      mkdirSync(join(home, f, ".."), { recursive: true });
      secrets[f] = `SECRET-${f.replace(/\W/g, "")}-${unique()}`;
      writeFileSync(join(home, f), `${secrets[f]}\n`);
    }
    const cwd = scratch("aic-shares-secrets-");
    const probe = FILES.map((f) => `cat '${join(home, f)}' 2>&1 | head -c 300`).join("; ") + "; echo probed";
    return { home, secrets, cwd, probe };
  }
  /** The secrets that showed in any tool result the fake server received. */
  const leaked = (srv: { requests: { body: any }[] }, secrets: Record<string, string>) => {
    const seen = srv.requests
      .flatMap((r) => messagesOf(r as any))
      .filter((m) => m.role === "tool")
      .map((m) => String(m.content))
      .join("\n");
    return Object.keys(secrets).filter((f) => seen.includes(secrets[f]!));
  };

  test("each is refused to a command", async () => {
    const { home, secrets, cwd, probe } = world();
    const srv = fixtures.serve([bash(probe, "probe"), done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "read"], { cwd, env: { HOME: home } });
    expect(run.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "probe")).toContain("probed");
    expect(leaked(srv, secrets)).toEqual([]);
  });

  // Landlock only grants: it cannot take one file out of a cache commands may write. The start line says so.
  test("under Landlock alone, a store inside a package cache is said to stay readable", async () => {
    const { home, cwd } = world();
    const srv = fixtures.serve([done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "read"], {
      cwd,
      env: { HOME: home, AIC_NO_NAMESPACES: "1" },
    });
    expect(run.code).toBe(0);
    const status = String(jsonLines(run.stdout).find((e) => e.type === "start")?.sandbox?.status ?? "");
    expect(status).toContain("~/.cache/huggingface/token stay readable (in a package cache");
    expect(status).toContain("secret stores unreadable");
  });

  test("--allow-read PATH lifts it for that path only", async () => {
    const { home, secrets, cwd, probe } = world();
    const srv = fixtures.serve([bash(probe, "probe"), done]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--allow-read", join(home, ".python_history"), "read"],
      { cwd, env: { HOME: home } },
    );
    expect(run.code).toBe(0);
    expect(leaked(srv, secrets)).toEqual([".python_history"]);
  });

  test("AIC_ALLOW_READ, a colon-separated list, too", async () => {
    const { home, secrets, cwd, probe } = world();
    const srv = fixtures.serve([bash(probe, "probe"), done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "read"], {
      cwd,
      env: { HOME: home, AIC_ALLOW_READ: `${join(home, ".python_history")}:${join(home, "mykey.pem")}` },
    });
    expect(run.code).toBe(0);
    expect(leaked(srv, secrets).sort()).toEqual([".python_history", "mykey.pem"]);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Bun's native library

/**
 * Where a compiled Bun puts OpenTUI's native library when the TUI imports it: `$TMPDIR/.bun-<uid>-<hash>.so` (/tmp
 * when TMPDIR is unset), the hash being Bun.hash of the library's bytes. Bun reuses a regular file of that name with
 * the same size and owner, whatever its bytes.
 */
const LIBRARY = join(ROOT, "node_modules", "@opentui", "core-linux-x64", "libopentui.so");

describe.skipIf(!has.root || !has.unshare || !has.tmux || !hasCc || !existsSync(LIBRARY))(
  "the TUI never loads a native library a command planted (needs root for a private /tmp, unshare, tmux, cc)",
  () => {
    test("a command replaces the extracted .so with one of the same size: the person's next TUI start does not load it", async () => {
      const where = place();
      const size = statSync(LIBRARY).size;
      const name = `.bun-${process.getuid?.() ?? 0}-${Bun.hash(await Bun.file(LIBRARY).bytes()).toString(16)}.so`;
      // The planted library: a constructor that makes the marker, padded to the real one's size.
      const evilC = join(where.cwd, "evil.c");
      const evil = join(where.cwd, "evil.so");
      writeFileSync(
        evilC,
        `#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void pwn(void) { int fd = open("${join(where.marks, "PWN-so")}", O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd); }\n`,
      );
      expect(Bun.spawnSync(["cc", "-shared", "-fPIC", "-o", evil, evilC]).exitCode).toBe(0);
      expect(Bun.spawnSync(["truncate", "-s", String(size), evil]).exitCode).toBe(0);
      chmodSync(evil, 0o644);

      // A tmux server in a mount namespace of its own with a fresh /tmp: the machine's /tmp is never touched.
      const sock = join(where.base, "tmux.sock");
      const env = cleanEnv({ ...where.env, TMPDIR: undefined, TERM: "xterm-256color", SHELL: "/bin/sh" });
      const tmux = (...args: string[]) => {
        const r = Bun.spawnSync(["tmux", "-S", sock, ...args], { env, stdout: "pipe", stderr: "pipe" });
        if (r.exitCode !== 0) throw new Error(`tmux ${args.join(" ")}: ${r.stderr.toString()}`);
        return r.stdout.toString();
      };
      const started = Bun.spawnSync(
        [
          "unshare",
          "--mount",
          "--propagation",
          "private",
          "--",
          "sh",
          "-c",
          'mount -t tmpfs tmpfs /tmp && exec tmux -S "$0" -f /dev/null new-session -d -s p -x 80 -y 24 -c "$1" "cat" \\; set -g remain-on-exit on',
          sock,
          where.cwd,
        ],
        { cwd: where.cwd, env, stdout: "pipe", stderr: "pipe" },
      );
      expect(started.stderr.toString()).toBe("");
      expect(started.exitCode).toBe(0);
      cleanups.push(() =>
        Bun.spawnSync(["tmux", "-S", sock, "kill-server"], { env, stdout: "ignore", stderr: "ignore" }),
      );
      const serverPid = Number(tmux("display-message", "-p", "-t", "p", "#{pid}").trim());
      const privateTmp = `/proc/${serverPid}/root/tmp`;
      expect(readdirSync(privateTmp)).toEqual([]); // the fresh /tmp, not the machine's

      // The fresh /tmp hides anything below /tmp, a CI clone's dist/aic included: the person's aic is a copy here.
      const aic = join(where.base, "aic");
      copyFileSync(AIC, aic);
      chmodSync(aic, 0o755);
      const aicLine = (args: string) => `env -u TMPDIR ${aic} ${args}`;
      const tui = async (window: string, url: string) => {
        tmux(
          "new-window",
          "-d",
          "-t",
          "p",
          "-n",
          window,
          "-c",
          where.cwd,
          aicLine(`--api-base ${url} --model test-model`),
        );
        const screen = () => tmux("capture-pane", "-p", "-t", `p:${window}`);
        return waitFor(`the TUI in ${window}`, () => {
          const s = screen();
          return (/Agent Output|cannot start the terminal UI|Pane is dead/.test(s) && s) || false;
        });
      };

      // The person's earlier TUI start: Bun extracts the library.
      const idle = fixtures.serve([done]);
      expect(await tui("first", idle.url)).toContain("Agent Output");
      tmux("kill-window", "-t", "p:first");

      // The hostile model's command, in the same namespace: every .bun-*.so in /tmp, and the name Bun looks for.
      const rc = join(where.base, "attack.rc");
      const attack = `for f in /tmp/.bun-*.so /tmp/${name}; do cp -f ${evil} "$f.new" && chmod 600 "$f.new" && mv -f "$f.new" "$f"; done; ls -la /tmp/ | grep bun; echo planted`;
      const hostile = fixtures.serve([bash(attack, "plant"), done]);
      tmux(
        "new-window",
        "-d",
        "-t",
        "p",
        "-n",
        "attack",
        "-c",
        where.cwd,
        `sh -c '${aicLine(`--nogui --auto-approve --api-base ${hostile.url} --model test-model plant`)}; echo $? > ${rc}'`,
      );
      await waitFor("the hostile run to end", () => existsSync(rc) && readFileSync(rc, "utf8").trim() !== "");
      expect(readFileSync(rc, "utf8").trim()).toBe("0");
      expect(toolResults(hostile)[0]).toContain("planted");
      // What the command left where Bun looks by default (the test makes sure it is there, as a command can).
      if (!existsSync(join(privateTmp, name))) {
        Bun.spawnSync(["cp", evil, join(privateTmp, name)]);
        chmodSync(join(privateTmp, name), 0o600);
      }

      // The person's next TUI start, TMPDIR unset, in the same namespace.
      const next = fixtures.serve([done]);
      const screen = await tui("next", next.url);
      expect(marks(where)).toEqual([]);
      expect(screen).toContain("Agent Output"); // and the person's TUI works
    }, 120_000);
  },
);
