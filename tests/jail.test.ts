/**
 * The jail (README: "Threat model"): each property is an attack from inside a command, against the compiled
 * binary, run as root and again as an unprivileged user (uid 65534, through setpriv) where this machine allows
 * it. Where the attack would work without the jail, a control run with AIC_NO_NAMESPACES=1 shows that it does,
 * so each test can fail.
 */
import { afterEach, describe, expect, test } from "bun:test";
import {
  chownSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readdirSync,
  readlinkSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import {
  AIC,
  alive,
  bash,
  cleanEnv,
  has,
  headless,
  perTestFixtures,
  runCommand,
  sandboxLine,
  scratch,
  startCommand,
  toolResults,
  unique,
  waitFor,
  NOBODY_USER,
  THIS_USER,
  type TestUser,
  jailUsable,
} from "./helpers.ts";

const fixtures = perTestFixtures();

const PYTHON = "/usr/bin/python3";
const hasPython = existsSync(PYTHON);
const hasSshAgent = Bun.spawnSync(["sh", "-c", "command -v ssh-agent && command -v ssh-add"]).exitCode === 0;
/** Who runs aic: this process's user, and (as root, with setpriv) uid 65534. */
const USERS = [THIS_USER, NOBODY_USER];
type User = TestUser;

/** A project, a home and a state directory owned by `user`, under /var/tmp (outside the writable /tmp). */
function place(user: User) {
  const base = fixtures.varTmp("aic-jail-");
  const dirs = { cwd: join(base, "proj"), home: join(base, "home"), state: join(base, "state") };
  for (const dir of Object.values(dirs)) mkdirSync(dir);
  const own = () => {
    if (user.uid === process.getuid?.()) return;
    Bun.spawnSync(["chown", "-R", `${user.uid}:${user.uid}`, base]);
  };
  own();
  return { base, ...dirs, own, env: { HOME: dirs.home, XDG_STATE_HOME: dirs.state } };
}

/** Runs `argv` as `user` in `cwd` to its end (its output as text). */
function runAs(user: User, argv: string[], cwd: string, env: Record<string, string> = {}) {
  const r = Bun.spawnSync([...user.wrap, ...argv], { cwd, env: cleanEnv(env), stdout: "pipe", stderr: "pipe" });
  return { code: r.exitCode, out: r.stdout.toString() + r.stderr.toString() };
}

/** aic as `user`, headless, auto-approved. */
function aicAs(user: User, url: string, args: string[], where: ReturnType<typeof place>, env = {}) {
  return runCommand([...user.wrap, AIC, ...headless(url), "--auto-approve", ...args], {
    cwd: where.cwd,
    env: { ...where.env, ...env },
  });
}

/** Live processes whose command line holds `marker`. */
function processesWith(marker: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`, "utf8").includes(marker) && alive(Number(entry)))
        found.push(Number(entry));
    } catch {
      /* gone */
    }
  }
  return found;
}

/** Things a test starts outside aic (servers the person would have): stopped after each test. */
const cleanups: (() => void)[] = [];
afterEach(() => {
  for (const stop of cleanups.splice(0).reverse()) stop();
});

/** A tmux server of `user`'s on its own socket name, as a person's would be. */
function personsTmux(user: User, where: ReturnType<typeof place>): string {
  const name = unique("aic-jail-tmux-");
  const r = runAs(
    user,
    ["tmux", "-L", name, "-f", "/dev/null", "new-session", "-d", "cat"],
    where.cwd,
    // tmux runs the session through $SHELL, else the account's shell: nobody's is nologin (CI may not set SHELL).
    { ...where.env, SHELL: "/bin/sh" },
  );
  expect(r.code).toBe(0);
  cleanups.push(() => runAs(user, ["tmux", "-L", name, "kill-server"], "/", where.env));
  return name;
}

/** An ssh-agent of `user`'s with its socket in a directory of its own under /tmp, as ssh-agent makes them. */
function personsAgent(user: User): string {
  const dir = mkdtempSync("/tmp/ssh-aicjail");
  if (user.uid !== process.getuid?.()) chownSync(dir, user.uid, user.uid);
  const sock = join(dir, "agent.1");
  const r = runAs(user, ["ssh-agent", "-a", sock], "/");
  expect(r.code).toBe(0);
  const pid = Number(/SSH_AGENT_PID=(\d+)/.exec(r.out)?.[1]);
  cleanups.push(() => {
    try {
      process.kill(pid, "SIGTERM");
    } catch {
      /* gone */
    }
    Bun.spawnSync(["rm", "-rf", dir]);
  });
  return sock;
}

/** A server of `user`'s listening on an abstract Unix socket (no file anywhere). */
async function personsAbstractServer(user: User): Promise<string> {
  const name = unique("aic-jail-abstract-");
  const server = Bun.spawn(
    [
      ...user.wrap,
      PYTHON,
      "-c",
      `import signal,socket\ns=socket.socket(socket.AF_UNIX)\ns.bind("\\0${name}")\ns.listen(5)\nsignal.pause()`,
    ],
    { stdout: "ignore", stderr: "ignore", env: cleanEnv() },
  );
  cleanups.push(() => server.kill("SIGKILL"));
  await waitFor("the abstract socket", () => readFileSync("/proc/net/unix", "utf8").includes(`@${name}`));
  return name;
}

const SOCKET_PROBE = (tmux: string, agent: string, abstract: string) =>
  [
    `tmux -L ${tmux} ls >/dev/null 2>&1; echo tmux=$?`,
    `SSH_AUTH_SOCK=${agent} ssh-add -l >/dev/null 2>&1; echo agent=$?`,
    `${PYTHON} -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect("\\0${abstract}")' 2>/dev/null; echo abstract=$?`,
    `echo "env=[\${TMUX-}][\${SSH_AUTH_SOCK-}]"`,
    "cat ~/.ssh/known_hosts ~/.ssh/id_jail 2>/dev/null",
  ].join("; ");

describe.skipIf(!jailUsable)("the jail", () => {
  for (const user of USERS) {
    describe(user.label, () => {
      test.skipIf(user.skip || !has.tmux || !hasSshAgent || !hasPython)(
        "the person's tmux, ssh-agent and abstract sockets are out of reach, and their addresses are not passed on",
        async () => {
          const where = place(user);
          mkdirSync(join(where.home, ".ssh"));
          writeFileSync(join(where.home, ".ssh", "known_hosts"), "KNOWN-HOSTS-MARK\n");
          writeFileSync(join(where.home, ".ssh", "id_jail"), "PRIVATE-KEY-MARK\n");
          where.own();
          const tmux = personsTmux(user, where);
          const agent = personsAgent(user);
          const abstract = await personsAbstractServer(user);
          const probe = SOCKET_PROBE(tmux, agent, abstract);
          const env = { TMUX: `/tmp/tmux-${user.uid}/${tmux},1,0`, SSH_AUTH_SOCK: agent };
          const srv = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
          const run = await aicAs(user, srv.url, ["probe"], where, env);
          expect(run.code).toBe(0);
          expect(sandboxLine(run.stderr)).toContain("jail: own PID, mount and IPC namespaces");
          const result = toolResults(srv)[0]!;
          expect(result).toMatch(/tmux=[1-9]/);
          expect(result).toContain("agent=2"); // ssh-add: could not connect
          expect(result).toMatch(/abstract=[1-9]/);
          expect(result).toContain("env=[][]");
          expect(result).not.toMatch(/KNOWN-HOSTS-MARK|PRIVATE-KEY-MARK/);

          // The control: without the jail, the same command reaches both servers.
          const control = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
          const open = await aicAs(user, control.url, ["probe"], where, { ...env, AIC_NO_NAMESPACES: "1" });
          expect(open.code).toBe(0);
          expect(sandboxLine(open.stderr)).toContain("Landlock alone, no jail: AIC_NO_NAMESPACES=1;");
          expect(toolResults(control)[0]).toContain("tmux=0");
          expect(toolResults(control)[0]).toContain("agent=1"); // connected: the agent has no identities

          // --allow-ssh-agent passes the agent (only it) through.
          const passed = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
          const withAgent = await aicAs(user, passed.url, ["--allow-ssh-agent", "probe"], where, env);
          expect(withAgent.code).toBe(0);
          expect(sandboxLine(withAgent.stderr)).toContain("ssh-agent passed through (--allow-ssh-agent)");
          const through = toolResults(passed)[0]!;
          expect(through).toContain("agent=1");
          expect(through).toMatch(/tmux=[1-9]/);
          expect(through).toContain(`env=[][${agent}]`);
          // ssh finds its host keys and settings; the private keys stay unreadable.
          expect(through).toContain("KNOWN-HOSTS-MARK");
          expect(through).not.toContain("PRIVATE-KEY-MARK");
        },
      );

      test.skipIf(user.skip)(
        "aic, its launcher and every process outside are beyond a command's signals and /proc",
        async () => {
          const where = place(user);
          let aicPid = 0;
          // The first step only lets the test learn aic's pid before the probe is written.
          const srv = fixtures.serve((_req, i) =>
            i === 0
              ? bash("echo warm-up")
              : i === 1
                ? bash(
                    [
                      `kill -STOP ${aicPid}; echo stop=$?`,
                      `kill -KILL ${aicPid}; echo kill=$?`,
                      `kill -STOP 1; kill -KILL 1`,
                      `cat /proc/${aicPid}/environ >/dev/null 2>&1; echo environ=$?`,
                      `echo marked=$(grep -l KEYMARK /proc/[0-9]*/environ 2>/dev/null | wc -l)`,
                      `echo procs=$(ls /proc | grep -c '^[0-9]')`,
                      // Taking a descriptor of the jail's init (the launcher's pipe to aic): pidfd_open, pidfd_getfd.
                      hasPython
                        ? `${PYTHON} -c "import ctypes; l=ctypes.CDLL(None); p=l.syscall(434,1,0); print('getfd', l.syscall(438,p,0,0))"`
                        : "echo getfd -1",
                    ].join("; "),
                  )
                : i === 2
                  ? bash("echo still-here")
                  : { content: "TASKCOMPLETE" },
          );
          // aic's parent, a shell as in a CI step, has the key in its environment too.
          const aicArgv = [...user.wrap, AIC, ...headless(srv.url), "--auto-approve", "poke"];
          const live = startCommand(["sh", "-c", '"$@" & echo "aic=$!"; wait $!', "sh", ...aicArgv], {
            cwd: where.cwd,
            env: { ...where.env, OPENAI_API_KEY: "KEYMARK-0123456789" },
          });
          aicPid = Number((await waitFor("aic's pid", () => /aic=(\d+)/.exec(live.stdout())))[1]);
          const run = await live.done;
          expect(run.code).toBe(0);
          const [, first, second] = toolResults(srv);
          expect(aicPid).toBeGreaterThan(1);
          expect(first).toMatch(/stop=[1-9]/);
          expect(first).toMatch(/kill=[1-9]/);
          expect(first).toMatch(/environ=[1-9]/);
          expect(first).toContain("marked=0");
          // The jail's init, the shell, the probe's own processes: nothing of the person's.
          expect(Number(/procs=(\d+)/.exec(first!)?.[1])).toBeLessThan(10);
          expect(first).toContain("getfd -1");
          expect(second).toContain("still-here");
        },
      );

      test.skipIf(user.skip)("nothing a command starts outlives aic, however it detaches", async () => {
        const where = place(user);
        const mark = `${Math.floor(Math.random() * 1e6)}`;
        const detach = [
          `setsid env -i /bin/sleep 4711.${mark} </dev/null >/dev/null 2>&1 &`,
          `(nohup /bin/sleep 4712.${mark} >/dev/null 2>&1 &)`,
          `sh -c '(/bin/sleep 4713.${mark} </dev/null >/dev/null 2>&1 &) &'`,
          "echo started",
        ].join(" ");
        const srv = fixtures.serve([bash(detach), { content: "TASKCOMPLETE" }]);
        const run = await aicAs(user, srv.url, ["detach"], where);
        expect(run.code).toBe(0);
        expect(toolResults(srv)[0]).toContain("started");
        await waitFor("every detached sleep to be gone", () => processesWith(`.${mark}`).length === 0);
      });

      test.skipIf(user.skip)("nothing a command starts outlives aic killed with -9", async () => {
        const where = place(user);
        const mark = `${Math.floor(Math.random() * 1e6)}`;
        const srv = fixtures.serve([
          bash(`setsid env -i /bin/sleep 4721.${mark} </dev/null >/dev/null 2>&1 & echo started`, "call_detach"),
          bash(`/bin/sleep 4722.${mark}`, "call_wait"),
          { content: "TASKCOMPLETE" },
        ]);
        const live = startCommand([...user.wrap, AIC, ...headless(srv.url), "--json", "--auto-approve", "go"], {
          cwd: where.cwd,
          env: where.env,
        });
        await live.waitForEvent("the second command", (e) => e.type === "command" && e.id === "call_wait");
        await waitFor("both sleeps", () => processesWith(`.${mark}`).length === 2);
        live.proc.kill("SIGKILL");
        await live.done;
        await waitFor("every sleep to be gone after kill -9", () => processesWith(`.${mark}`).length === 0);
      });

      test.skipIf(user.skip || !has.git)(
        "git config and hooks cannot be made to run code outside; commits and branches work",
        async () => {
          const where = place(user);
          const git = (...args: string[]) => runAs(user, ["git", ...args], where.cwd, where.env);
          for (const args of [
            ["init", "-q"],
            ["config", "user.email", "a@example.com"],
            ["config", "user.name", "A"],
            ["commit", "-q", "--allow-empty", "-m", "init"],
          ])
            expect(git(...args).code).toBe(0);
          mkdirSync(join(where.cwd, "sub"));
          where.own();
          expect(runAs(user, ["git", "init", "-q"], join(where.cwd, "sub"), where.env).code).toBe(0);
          const config = readFileSync(join(where.cwd, ".git", "config"), "utf8");
          const evil = `/tmp/${unique("aic-jail-evilgit-")}`;
          cleanups.push(() => Bun.spawnSync(["rm", "-rf", evil]));
          const srv = fixtures.serve([
            bash(
              [
                `printf '[core]\\n\\tfsmonitor = "touch ${where.base}/PWN1; false"\\n' >> .git/config; echo cfg=$?`,
                `echo 'touch ${where.base}/PWN2' > .git/hooks/pre-commit; echo hook=$?`,
                "mv .git .git-aside; echo moved=$?",
                "printf '[alias]\\n\\tst = !touch PWN\\n' >> sub/.git/config; echo inner=$?",
              ].join("; "),
            ),
            bash(
              `mkdir new && cd new && git init -q && git config core.fsmonitor 'touch ${where.base}/PWN3; false' && echo 'touch ${where.base}/PWN4' > .git/hooks/post-checkout && chmod +x .git/hooks/post-checkout && echo planted`,
            ),
            bash(
              `mkdir -p ${evil} && cp -r .git/. ${evil}/ && printf '[core]\\n\\tfsmonitor = "touch ${where.base}/PWN5; false"\\n' >> ${evil}/config && echo ${evil} > .git/commondir && mkdir pt && echo 'gitdir: ${evil}' > pt/.git && echo redirected`,
            ),
            bash("echo a > a.txt && git add a.txt && git commit -qm a && git checkout -qb topic && echo committed"),
            { content: "TASKCOMPLETE" },
          ]);
          const run = await aicAs(user, srv.url, ["git"], where);
          expect(run.code).toBe(0);
          const [direct, fresh, redirect, work] = toolResults(srv);
          expect(direct).toContain("cfg=1");
          expect(direct).toContain("hook=1");
          expect(direct).toContain("moved=1");
          expect(direct).toContain("inner=1");
          expect(fresh).toContain("planted");
          expect(fresh).toContain("aic took out");
          expect(redirect).toContain("redirected");
          expect(redirect).toContain("commondir");
          expect(work).toContain("committed");
          expect(readFileSync(join(where.cwd, ".git", "config"), "utf8")).toBe(config);
          // The person's own git, outside, in every repository the commands touched: nothing runs.
          for (const dir of [where.cwd, join(where.cwd, "sub"), join(where.cwd, "new"), join(where.cwd, "pt")])
            runAs(user, ["git", "status"], dir, where.env);
          runAs(user, ["git", "st"], join(where.cwd, "sub"), where.env);
          expect(readdirSync(where.base).filter((n) => n.startsWith("PWN"))).toEqual([]);
          expect(readdirSync(join(where.cwd, "sub")).filter((n) => n.startsWith("PWN"))).toEqual([]);
          expect(git("log", "--oneline", "topic").out.trim().split("\n")).toHaveLength(2);
          expect(existsSync(join(where.cwd, "new", ".git", "config.aic-disabled"))).toBe(true);
          expect(existsSync(join(where.cwd, "new", ".git", "hooks", "post-checkout.aic-disabled"))).toBe(true);
          expect(existsSync(join(where.cwd, ".git", "commondir.aic-disabled"))).toBe(true);
          expect(run.stderr).toContain("aic took out what would have made git run code outside the sandbox");
        },
      );

      test.skipIf(user.skip)(
        "aic's checkpoints, history and other runs' outputs are not there for commands",
        async () => {
          const where = place(user);
          writeFileSync(join(where.home, ".aic_history"), "HISTMARK\n");
          const other = mkdtempSync("/tmp/aic-out-jailtest-");
          cleanups.push(() => Bun.spawnSync(["rm", "-rf", other]));
          writeFileSync(join(other, "out.txt"), "OUTMARK\n");
          // Another run's outputs where aic keeps them now, beside this run's.
          mkdirSync(join(where.state, "aic", "outputs", "aic-out-another-run"), { recursive: true });
          writeFileSync(join(where.state, "aic", "outputs", "aic-out-another-run", "output-1.txt"), "OUTMARK2\n");
          where.own();
          if (user.uid !== process.getuid?.()) Bun.spawnSync(["chown", "-R", `${user.uid}:${user.uid}`, other]);
          const state = '"$XDG_STATE_HOME/aic"';
          const srv = fixtures.serve([
            bash("seq 1 30000"),
            bash(
              [
                `cat ~/.aic_history ${other}/out.txt ${state}/outputs/aic-out-another-run/output-1.txt`,
                `echo state=$(find ${state} -mindepth 1 2>/dev/null | grep -vc '/outputs')`,
                `echo runs=$(ls ${state}/outputs | wc -l)`,
                `echo last=$(tail -1 ${state}/outputs/*/output-*.txt)`,
                "echo done",
              ].join("; "),
            ),
            { content: "TASKCOMPLETE" },
          ]);
          const run = await aicAs(user, srv.url, ["--session", ".aicsession", "look"], where);
          expect(run.code).toBe(0);
          const result = toolResults(srv)[1]!;
          expect(result).toContain("done");
          expect(result).not.toContain("HISTMARK");
          expect(result).not.toContain("OUTMARK");
          expect(result).toContain("state=0");
          // This run's saved output, and only this run's, is there to read.
          expect(toolResults(srv)[0]).toContain("saved in");
          expect(result).toContain("runs=1");
          expect(result).toContain("last=30000");
          // They exist: aic itself has its checkpoints there.
          expect(readdirSync(join(where.state, "aic")).length).toBeGreaterThan(0);
        },
      );

      test.skipIf(user.skip || !has.git)(
        "sessions and their lock files survive git clean -fdx and rm -rf, this run's and another's",
        async () => {
          const where = place(user);
          expect(runAs(user, ["git", "init", "-q"], where.cwd, where.env).code).toBe(0);
          const first = fixtures.serve([{ content: "TASKCOMPLETE" }]);
          expect((await aicAs(user, first.url, ["--session", ".aicsession2", "the other one"], where)).code).toBe(0);
          const other = readFileSync(join(where.cwd, ".aicsession2"), "utf8");
          const second = fixtures.serve([{ content: "TASKCOMPLETE" }]);
          expect((await aicAs(user, second.url, ["--session", ".aicsession", "earlier task"], where)).code).toBe(0);
          const srv = fixtures.serve([
            bash("git clean -fdxq; rm -rf .aicsession* ./* 2>&1 | head -3; ls -a"),
            bash("echo after"),
            { content: "TASKCOMPLETE" },
          ]);
          const run = await aicAs(user, srv.url, ["--session", ".aicsession", "wipe"], where);
          expect(run.code).toBe(0);
          expect(readFileSync(join(where.cwd, ".aicsession2"), "utf8")).toBe(other);
          const session = readFileSync(join(where.cwd, ".aicsession"), "utf8");
          expect(session).toContain("earlier task");
          expect(session).toContain("echo after");
          expect(existsSync(join(where.cwd, ".aicsession.lock"))).toBe(true);
        },
      );
    });
  }

  // Sockets the kernel lists oddly: bound by a relative name, with runs of spaces in the path, in another network
  // namespace (a container's); and, started in the home directory, the person's sockets under it.
  test.skipIf(!has.root || !hasPython)(
    "sockets listed oddly, and those under a home directory aic starts in",
    async () => {
      const where = place(USERS[0]!);
      const listen = (cwd: string, sock: string, wrap: string[] = []) => {
        const server = Bun.spawn(
          [
            ...wrap,
            PYTHON,
            "-c",
            `import signal,socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(5)\nsignal.pause()`,
            sock,
          ],
          { cwd, stdout: "ignore", stderr: "ignore", env: cleanEnv() },
        );
        cleanups.push(() => server.kill("SIGKILL"));
      };
      const rel = join(where.base, "reldir");
      const spaced = join(where.base, "sp  ace");
      const netns = join(where.base, "netns");
      const docker = join(where.home, ".docker", "desktop");
      for (const d of [rel, spaced, netns, docker]) mkdirSync(d, { recursive: true });
      listen(rel, "rel.sock");
      listen(spaced, join(spaced, "s.sock"));
      listen(netns, join(netns, "ns.sock"), ["unshare", "-n"]);
      listen(docker, join(docker, "docker.sock"));
      const socks = [
        join(rel, "rel.sock"),
        join(spaced, "s.sock"),
        join(netns, "ns.sock"),
        join(docker, "docker.sock"),
      ];
      await waitFor("the four sockets", () => socks.every((s) => existsSync(s)));
      const probe = socks
        .map(
          (s, n) =>
            `${PYTHON} -c 'import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])' "${s}" 2>/dev/null; echo s${n}=$?`,
        )
        .join("; ");
      const srv = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
      // Started in the home directory: its sockets are no project's own.
      const run = await runCommand([AIC, ...headless(srv.url), "--auto-approve", "probe"], {
        cwd: where.home,
        env: where.env,
      });
      expect(run.code).toBe(0);
      const result = toolResults(srv)[0]!;
      for (let n = 0; n < socks.length; n++) expect(result).toMatch(new RegExp(`s${n}=[1-9]`));
      // The control: the same probe without the jail reaches every one.
      const open = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
      const control = await runCommand([AIC, ...headless(open.url), "--auto-approve", "probe"], {
        cwd: where.home,
        env: { ...where.env, AIC_NO_NAMESPACES: "1" },
      });
      expect(control.code).toBe(0);
      for (let n = 0; n < socks.length; n++) expect(toolResults(open)[0]).toContain(`s${n}=0`);
    },
  );

  // Where git looks besides the project's own .git: what a command plants there is taken out after it, so the
  // person's git outside finds nothing to run. Each PWN file would be made by the person's git running planted code.
  describe.skipIf(!has.git || !hasPython)("the repository guard", () => {
    const person = (dir: string, ...args: string[]) =>
      Bun.spawnSync(["git", ...args], {
        cwd: dir,
        env: cleanEnv({
          GIT_AUTHOR_NAME: "p",
          GIT_AUTHOR_EMAIL: "p@p",
          GIT_COMMITTER_NAME: "p",
          GIT_COMMITTER_EMAIL: "p@p",
        }),
        stdout: "ignore",
        stderr: "ignore",
      });
    const fsmonitor = (mark: string) => `"sh -c 'touch ${mark}'; false"`;

    test("bare repositories, new settings, hidden gitlinks, git dirs planted in .git, node_modules gitlinks", async () => {
      const where = place(USERS[0]!);
      const pwn = (name: string) => join(where.base, `PWN-${name}`);
      for (const args of [
        ["init", "-q"],
        ["commit", "-q", "--allow-empty", "-m", "init"],
      ])
        expect(person(where.cwd, ...args).exitCode).toBe(0);
      const srv = fixtures.serve([
        bash(
          `git init -q --bare evilbare && git -C evilbare config core.bare false && git -C evilbare config core.worktree .. && git -C evilbare config core.fsmonitor ${fsmonitor(pwn("bare"))}; echo made`,
        ),
        bash(
          `git init -q newrepo && git -C newrepo config gpg.format ssh && git -C newrepo config commit.gpgsign true && git -C newrepo config gpg.ssh.defaultKeyCommand 'touch ${pwn("defkey")}' && git -C newrepo config submodule.x.update '!touch ${pwn("subupd")}'; echo made`,
        ),
        bash(
          `mkdir -p .hidden/h && git init -q .hidden/h && git -C .hidden/h commit -q --allow-empty -m s && git -C .hidden/h config core.fsmonitor ${fsmonitor(pwn("hidden"))} && git update-index --add --cacheinfo 160000,$(git -C .hidden/h rev-parse HEAD),.hidden/h; echo made`,
        ),
        bash(
          `git init -q --separate-git-dir=.git/info/evil x && git -C x config core.fsmonitor ${fsmonitor(pwn("info"))}; echo made`,
        ),
        bash(
          `mkdir -p node_modules/nm && git init -q node_modules/nm && git -C node_modules/nm commit -q --allow-empty -m s && git -C node_modules/nm config core.fsmonitor ${fsmonitor(pwn("nm"))} && git update-index --add --cacheinfo 160000,$(git -C node_modules/nm rev-parse HEAD),node_modules/nm; echo made`,
        ),
        { content: "TASKCOMPLETE" },
      ]);
      const run = await aicAs(USERS[0]!, srv.url, ["plant"], where, {
        GIT_AUTHOR_NAME: "m",
        GIT_AUTHOR_EMAIL: "m@m",
        GIT_COMMITTER_NAME: "m",
        GIT_COMMITTER_EMAIL: "m@m",
      });
      expect(run.code).toBe(0);
      const results = toolResults(srv);
      for (const r of results) expect(r).toContain("made");
      for (const r of results) expect(r).toContain("aic took out");
      for (const dir of ["", "evilbare", "newrepo", ".hidden/h", "x", "node_modules/nm"])
        person(join(where.cwd, dir), "status");
      person(join(where.cwd, "newrepo"), "commit", "-q", "--allow-empty", "-m", "p");
      person(join(where.cwd, "newrepo"), "submodule", "update");
      expect(readdirSync(where.base).filter((n) => n.startsWith("PWN"))).toEqual([]);
    });

    test("a .git made in a writable parent of a project that is no repository", async () => {
      const parent = scratch("aic-jail-parent-");
      const cwd = join(parent, "proj");
      mkdirSync(cwd);
      const mark = join(parent, "..", `${parent.split("/").at(-1)}-PWN`);
      cleanups.push(() => Bun.spawnSync(["rm", "-f", mark]));
      const srv = fixtures.serve([
        bash(`git init -q .. && git -C .. config core.fsmonitor ${fsmonitor(mark)}; echo made`),
        { content: "TASKCOMPLETE" },
      ]);
      const run = await runCommand([AIC, ...headless(srv.url), "--auto-approve", "plant"], { cwd });
      expect(run.code).toBe(0);
      expect(toolResults(srv)[0]).toContain("aic took out");
      person(cwd, "status");
      expect(existsSync(mark)).toBe(false);
      expect(existsSync(join(parent, ".git.aic-disabled"))).toBe(true);
    });

    test("the repository the start directory is in, when it lies above it: read-only in the jail", async () => {
      const top = scratch("aic-jail-mono-");
      const cwd = join(top, "pkg");
      mkdirSync(cwd);
      expect(person(top, "init", "-q").exitCode).toBe(0);
      const config = readFileSync(join(top, ".git", "config"), "utf8");
      const srv = fixtures.serve([
        bash(`git config core.fsmonitor ${fsmonitor(join(top, "PWN"))}; echo cfg=$?`),
        { content: "TASKCOMPLETE" },
      ]);
      const run = await runCommand([AIC, ...headless(srv.url), "--auto-approve", "plant"], { cwd });
      expect(run.code).toBe(0);
      expect(toolResults(srv)[0]).toMatch(/cfg=[1-9]/);
      expect(readFileSync(join(top, ".git", "config"), "utf8")).toBe(config);
      person(cwd, "status");
      expect(existsSync(join(top, "PWN"))).toBe(false);
    });
  });

  test("a session made during the run and deleted by a command is written again", async () => {
    const where = place(USERS[0]!);
    const srv = fixtures.serve([
      bash("rm -f .aicsession3 .aicsession3.lock; ls -a"),
      bash("echo second"),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await aicAs(USERS[0]!, srv.url, ["--session", ".aicsession3", "go"], where);
    expect(run.code).toBe(0);
    const session = readFileSync(join(where.cwd, ".aicsession3"), "utf8");
    expect(session).toContain("echo second");
    expect(session).toContain("rm -f .aicsession3");
  });

  test.skipIf(!hasPython)(
    "--network off: loopback works, nothing beyond it (not even the host's 127.0.0.1)",
    async () => {
      const where = place(USERS[0]!);
      const port = new URL(fixtures.serve([]).url).port;
      const probe = [
        `${PYTHON} -c "import socket; socket.create_connection(('127.0.0.1', ${port}), 2)" 2>/dev/null; echo host=$?`,
        `${PYTHON} -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); socket.create_connection(s.getsockname()); print('lo-ok')"`,
      ].join("; ");
      const srv = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
      const run = await aicAs(USERS[0]!, srv.url, ["--network", "off", "--json", "probe"], where);
      expect(run.code).toBe(0);
      const start = run.stdout.split("\n").map((l) => (l.startsWith("{") ? JSON.parse(l) : {}))[0];
      expect(start.sandbox.network).toBe("loopback");
      expect(toolResults(srv)[0]).toMatch(/host=[1-9]/);
      expect(toolResults(srv)[0]).toContain("lo-ok");
      // The same probe with the network on reaches the host's loopback.
      const open = fixtures.serve([bash(probe), { content: "TASKCOMPLETE" }]);
      expect((await aicAs(USERS[0]!, open.url, ["probe"], where)).code).toBe(0);
      expect(toolResults(open)[0]).toContain("host=0");
    },
  );

  test("--network off where the jail cannot be used is one clear line and exit 2, not a run on the network", async () => {
    const where = place(USERS[0]!);
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    for (const extra of [["--disable-sandbox"], []]) {
      const run = await aicAs(USERS[0]!, srv.url, ["--network", "off", ...extra, "go"], where, {
        AIC_NO_NAMESPACES: "1",
      });
      expect(run.code).toBe(2);
      expect(run.stderr.trim().split("\n")).toHaveLength(1);
      expect(run.stderr).toContain("--network off needs the jail");
    }
    expect(srv.requests).toHaveLength(0);
  });

  test("the JSON start event says which confinement commands get", async () => {
    const where = place(USERS[0]!);
    for (const [env, jail] of [
      [{}, "namespaces"],
      [{ AIC_NO_NAMESPACES: "1" }, "landlock"],
    ] as const) {
      const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
      const run = await aicAs(USERS[0]!, srv.url, ["--json", "go"], where, env);
      expect(run.code).toBe(0);
      expect(JSON.parse(run.stdout.split("\n")[0]!).sandbox.jail).toBe(jail);
    }
  });

  // The attack names aic's own terminal (the test reads it from outside): the control run must not write into
  // terminals of anyone else on this machine.
  test.skipIf(!has.root)("a command writes nothing to aic's terminal", async () => {
    const seen = async (env: Record<string, string>) => {
      const where = place(USERS[0]!);
      let terminal = "/dev/null";
      const attack = () =>
        `t=${terminal}; if [ "$(tty)" != "$t" ] && [ -e "$t" ]; then printf 'PW%sD' NE > "$t"; fi; echo wrote`;
      const srv = fixtures.serve((_req, i) =>
        i === 0 ? bash("echo warm-up") : i === 1 ? bash(attack()) : { content: "TASKCOMPLETE" },
      );
      let screen = "";
      const proc = Bun.spawn([AIC, ...headless(srv.url), "--auto-approve", "attack"], {
        cwd: where.cwd,
        env: cleanEnv({ ...where.env, ...env }),
        terminal: {
          cols: 120,
          rows: 40,
          data: (_t, bytes) => {
            screen += Buffer.from(bytes).toString("utf8");
          },
        },
      });
      cleanups.push(() => proc.kill("SIGKILL"));
      terminal = readlinkSync(`/proc/${proc.pid}/fd/0`);
      expect(await proc.exited).toBe(0);
      await waitFor("the run's last line", () => screen.includes("[completed]"));
      expect(toolResults(srv)[1]).toContain("wrote");
      return screen;
    };
    expect(await seen({})).not.toContain("PWNED");
    // The control: without the jail the same command reaches aic's terminal.
    expect(await seen({ AIC_NO_NAMESPACES: "1" })).toContain("PWNED");
  });
});
