/**
 * aic works wherever it is run (README: "Where aic runs, and what confinement it gets there"): the
 * compiled binary, against the fake server, in the places the field puts it.
 * - Under Docker's refusals (tests/docker-refusals.ts: a seccomp filter that refuses `unshare`,
 *   namespace flags of `clone`, `setns` and mounts with EPERM, and `clone3` with ENOSYS), the jail
 *   degrades to Landlock alone, says so and why in one line, names what it no longer holds, and the
 *   command runs.
 * - A run where no command could start ends `failed` (exit 1), never `completed`.
 * - Directories aic cannot search or read, FIFOs and symlink loops, as root and as uid 65534, are
 *   skipped: never an internal error.
 * - `--keep-jobs` leaves a server a command started answering after aic exits; without it nothing
 *   outlives aic.
 * - In a real container of a private dockerd with Docker's default seccomp profile (only with
 *   AIC_TEST_DOCKER=1: it costs a minute the first time, see tests/docker.ts).
 */
import { afterEach, describe, expect, test } from "bun:test";
import {
  chmodSync,
  copyFileSync,
  existsSync,
  mkdirSync,
  readFileSync,
  readdirSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import { dockerRefusals } from "./docker-refusals.ts";
import { dockerSkipReason, startTestDocker } from "./docker.ts";
import { startFakeServer, type Turn } from "./fake-openai.ts";
import {
  AIC,
  alive,
  bash,
  has,
  headless,
  jsonLines,
  kernelLandlockAbi,
  perTestFixtures,
  sandboxLine,
  scratch,
  startAic,
  unique,
  waitFor,
  NOBODY_USER,
  THIS_USER,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };
const refusals = dockerRefusals();
const PREFIX = "prefix" in refusals ? refusals.prefix : [];
/** Why the tests under Docker's refusals cannot run here (no cc, not x86_64), or undefined. */
const NO_REFUSALS = "skip" in refusals ? refusals.skip : undefined;
const LANDLOCK = kernelLandlockAbi() > 0;
const PYTHON = "/usr/bin/python3";

/** Things a test starts outside aic (a socket listener, a kept server): stopped after each test. */
const cleanups: (() => void)[] = [];
afterEach(() => {
  for (const stop of cleanups.splice(0).reverse())
    try {
      stop();
    } catch {
      /* already gone */
    }
});

const events = (stdout: string) => jsonLines(stdout);
const startOf = (stdout: string) => events(stdout).find((e) => e.type === "start");
const endOf = (stdout: string) => events(stdout).find((e) => e.type === "end");
const resultsOf = (stdout: string) => events(stdout).filter((e) => e.type === "command_result");

/** The output of a run, for an assertion's message. */
const shown = (run: { code: number; stdout: string; stderr: string }) =>
  `exit ${run.code}\n--- stdout ---\n${run.stdout.slice(-4000)}\n--- stderr ---\n${run.stderr.slice(-4000)}`;

// ---------------------------------------------------------------------------------------------
// Under Docker's refusals

describe.skipIf(NO_REFUSALS !== undefined)(
  `under Docker's namespace refusals${NO_REFUSALS ? ` (${NO_REFUSALS})` : ""}`,
  () => {
    test("the refusals are real: unshare --user fails with EPERM, bash, git and python3 still run", async () => {
      const refused = Bun.spawnSync([...PREFIX, "/usr/bin/unshare", "--user", "true"], { stderr: "pipe" });
      expect(refused.exitCode).not.toBe(0);
      expect(refused.stderr.toString()).toContain("Operation not permitted");
      const cwd = scratch();
      const ordinary = Bun.spawnSync(
        [...PREFIX, "bash", "-c", "git init -q . && git commit -q --allow-empty -m x && git log --oneline | wc -l"],
        {
          cwd,
          stdout: "pipe",
          stderr: "pipe",
          env: {
            ...process.env,
            GIT_AUTHOR_NAME: "a",
            GIT_AUTHOR_EMAIL: "a@b",
            GIT_COMMITTER_NAME: "a",
            GIT_COMMITTER_EMAIL: "a@b",
          },
        },
      );
      expect(ordinary.stdout.toString().trim()).toBe("1");
      // clone3 answers ENOSYS (libc falls back to clone), clone with CLONE_NEWUSER answers EPERM.
      if (existsSync(PYTHON)) {
        const probe = Bun.spawnSync(
          [
            ...PREFIX,
            PYTHON,
            "-c",
            "import ctypes\nl=ctypes.CDLL(None,use_errno=True)\nr=l.syscall(435,0,0);print('clone3',r,ctypes.get_errno())\nr=l.syscall(56,0x10000000|17,0,0,0,0);print('clone',r,ctypes.get_errno())",
          ],
          { stdout: "pipe" },
        );
        expect(probe.stdout.toString()).toBe("clone3 -1 38\nclone -1 1\n");
        // A server starts and answers under the filter.
        const port = await freePort();
        const server = Bun.spawn([...PREFIX, PYTHON, "-m", "http.server", String(port), "--bind", "127.0.0.1"], {
          cwd,
          stdout: "ignore",
          stderr: "ignore",
        });
        cleanups.push(() => server.kill("SIGKILL"));
        const answer = await waitFor("http.server under the filter", () =>
          fetch(`http://127.0.0.1:${port}/`).then(
            (r) => r.status,
            () => 0,
          ),
        );
        expect(answer).toBe(200);
      }
    });

    test("the jail degrades to Landlock alone, says why and what is missing, and the command runs", async () => {
      // The second command shows that Landlock alone still confines: a write outside the writable set is refused.
      const outside = fixtures.disposable(join("/var/tmp", unique("aic-field-outside-")));
      const srv = fixtures.serve([
        bash("echo hello-from-field", "c1"),
        bash(`(echo x > ${outside}) 2>/dev/null; echo wrote=$?`, "c2"),
        done,
      ]);
      const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "say hello"], { prefix: PREFIX })
        .done;
      expect(run.code, shown(run)).toBe(0);
      const result = resultsOf(run.stdout).find((e) => e.id === "c1");
      expect(result, shown(run)).toMatchObject({ status: "exited", exit_code: 0 });
      expect(result.output).toContain("hello-from-field");
      if (LANDLOCK) {
        expect(resultsOf(run.stdout).find((e) => e.id === "c2")?.output).toMatch(/wrote=[1-9]/);
        expect(existsSync(outside)).toBe(false);
      }
      const sandbox = startOf(run.stdout)?.sandbox;
      if (LANDLOCK) {
        expect(sandbox?.jail, shown(run)).toBe("landlock");
        expect(Array.isArray(sandbox.missing)).toBe(true);
        expect(sandbox.missing).toContain("processes outlive aic");
        expect(sandbox.missing).toContain("sockets");
      } else {
        expect(sandbox?.jail, shown(run)).toBe("off");
      }
      expect(typeof sandbox.reason).toBe("string");
      expect(sandbox.reason).toMatch(/namespace/i);
      expect(sandbox.reason).toMatch(/refused|not permitted|EPERM/i);
      expect(endOf(run.stdout)).toMatchObject({ type: "end", status: "completed", exit_code: 0 });

      // The plain start line says the same in words: one line, Landlock, why, and what it cannot promise.
      const plainSrv = fixtures.serve([bash("echo hello-from-field"), done]);
      const plain = await startAic([...headless(plainSrv.url), "--auto-approve", "say hello"], { prefix: PREFIX }).done;
      expect(plain.code, shown(plain)).toBe(0);
      const line = sandboxLine(plain.stderr);
      expect(line, shown(plain)).not.toContain("own PID, mount and IPC namespaces");
      if (LANDLOCK) {
        expect(line).toContain("Landlock");
        expect(line).toMatch(/namespace/i);
        expect(line).toMatch(/processes running after aic exits/i);
        expect(line).toMatch(/socket/i);
      }
      expect(plain.stdout + plain.stderr).toContain("hello-from-field");
    });
  },
);

// ---------------------------------------------------------------------------------------------
// No false success

describe("a run where no command can start", () => {
  // The start directory vanishes once aic has started (a CI workspace cleaned under it): no shell can start there.
  const vanishing = (turns: Turn[]) => {
    const dir = join(scratch(), "workspace");
    mkdirSync(dir);
    const srv = fixtures.serve((_req, index) => {
      if (index === 0) rmSync(dir, { recursive: true, force: true });
      return turns[index] ?? done;
    });
    return { dir, srv };
  };
  for (const where of [
    { label: "as it starts here", prefix: [] as string[], skip: false },
    { label: "under Docker's refusals", prefix: PREFIX, skip: NO_REFUSALS !== undefined },
  ])
    test.skipIf(where.skip)(`ends failed with the cause, never completed (${where.label})`, async () => {
      const { dir, srv } = vanishing([bash("true", "t1"), bash("true", "t2"), bash("true", "t3"), done]);
      const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "try"], {
        prefix: where.prefix,
        cwd: dir,
      }).done;
      expect(run.code, shown(run)).toBe(1);
      const results = resultsOf(run.stdout);
      expect(results.map((r) => r.id)).toEqual(["t1", "t2", "t3"]);
      for (const r of results) expect(r.status, shown(run)).toBe("not_started");
      expect(endOf(run.stdout)).toMatchObject({ status: "failed", exit_code: 1, reason: "commands_not_started" });

      // Without --json: one line on stderr names the cause.
      const plainRun = vanishing([bash("true"), bash("true"), bash("true"), done]);
      const plain = await startAic([...headless(plainRun.srv.url), "--auto-approve", "try"], {
        prefix: where.prefix,
        cwd: plainRun.dir,
      }).done;
      expect(plain.code, shown(plain)).toBe(1);
      const cause = plain.stderr.split("\n").filter((l) => /no command could be run[^:]*:\s*\S/i.test(l));
      // Exactly one, and it names why after the words that say that nothing ran (the pattern asks for text after them).
      expect(cause, shown(plain)).toHaveLength(1);
    });
});

// ---------------------------------------------------------------------------------------------
// Nothing in the file system stops aic

/**
 * A run as `user` in `where` whose command `c1` must run (exit 0, no internal error) and the run complete;
 * c1's command_result.
 */
async function ranAs(
  user: { wrap: string[] },
  where: { cwd: string; env: Record<string, string> },
  turns: Turn[],
  request: string,
): Promise<any> {
  const srv = fixtures.serve(turns);
  const run = await startAic([...headless(srv.url), "--json", "--auto-approve", request], {
    prefix: user.wrap,
    cwd: where.cwd,
    env: where.env,
  }).done;
  expect(run.stderr, shown(run)).not.toMatch(/internal error/i);
  expect(run.code, shown(run)).toBe(0);
  const result = resultsOf(run.stdout).find((e) => e.id === "c1");
  expect(result, shown(run)).toMatchObject({ status: "exited", exit_code: 0 });
  expect(endOf(run.stdout)).toMatchObject({ status: "completed", exit_code: 0 });
  return result;
}

/** Who runs aic: root, and uid 65534 through setpriv (needs root and setpriv). */
const USERS = [{ ...THIS_USER, label: "as root", skip: !has.root }, NOBODY_USER];

/** A project, home and state directory owned by `uid`, under /var/tmp. */
function placeFor(uid: number) {
  const base = fixtures.varTmp("aic-field-");
  const dirs = { cwd: join(base, "proj"), home: join(base, "home"), state: join(base, "state") };
  for (const dir of Object.values(dirs)) mkdirSync(dir);
  if (uid !== 0) Bun.spawnSync(["chown", "-R", `${uid}:${uid}`, base]);
  return { ...dirs, env: { HOME: dirs.home, XDG_STATE_HOME: dirs.state } };
}

/** A real listening Unix socket at `path`, held by this process until the test ends. */
function listenAt(path: string): void {
  const listener = Bun.listen({ unix: path, socket: { data() {} } });
  cleanups.push(() => listener.stop(true));
}

describe.skipIf(!has.root)("nothing in the file system stops aic", () => {
  for (const user of USERS) {
    test.skipIf(user.skip)(
      `${user.label}: listening sockets below directories it cannot search or read do not stop the run`,
      async () => {
        // /run/aic-test-<unique>/private (root, 0700) and …/noread (root, 0311: search, no readdir), each with a
        // socket something listens on: the kernel lists them, aic cannot look behind them as uid 65534.
        const top = `/run/${unique("aic-test-")}`;
        mkdirSync(top, { mode: 0o755 });
        cleanups.push(() => rmSync(top, { recursive: true, force: true }));
        for (const [name, mode] of [
          ["private", 0o700],
          ["noread", 0o311],
        ] as const) {
          mkdirSync(join(top, name));
          listenAt(join(top, name, "s.sock"));
          chmodSync(join(top, name), mode);
        }
        const where = placeFor(user.uid);
        const result = await ranAs(user, where, [bash("echo ran-below-unsearchable", "c1"), done], "run");
        expect(result.output).toContain("ran-below-unsearchable");
      },
    );

    test.skipIf(user.skip || !has.git)(
      `${user.label}: unreadable directories, FIFOs and symlink loops in the project do not stall or stop checkpoints`,
      async () => {
        const where = placeFor(user.uid);
        // Root's directories the user cannot search (0700) or list (0311), a FIFO and a symlink loop, before the start.
        for (const [name, mode] of [
          ["unsearchable", 0o700],
          ["unlistable", 0o311],
        ] as const) {
          mkdirSync(join(where.cwd, name));
          Bun.spawnSync(["sh", "-c", `echo inside > '${join(where.cwd, name, "f.txt")}'`]);
          chmodSync(join(where.cwd, name), mode);
        }
        Bun.spawnSync(["mkfifo", join(where.cwd, "pipe0")]);
        symlinkSync("loop0", join(where.cwd, "loop0"));
        if (user.uid !== 0)
          Bun.spawnSync(["chown", "-h", `${user.uid}:${user.uid}`, join(where.cwd, "pipe0"), join(where.cwd, "loop0")]);
        const turns = [
          // The command makes more of them while the checkpoints snapshot the project around it.
          bash(
            "mkfifo pipe1 && ln -s loop1 loop1 && ln -s nowhere/at/all dangling && echo made > made.txt && echo ok",
            "c1",
          ),
          done,
        ];
        const result = await ranAs(user, where, turns, "make things");
        expect(result.output).toContain("ok");
        expect(result.changed_files).not.toBeNull();
        expect(result.changed_files.created).toContain("made.txt");
        expect(result.changed_files.created).not.toContain("pipe1"); // a FIFO is skipped, never read
      },
    );
  }
});

// ---------------------------------------------------------------------------------------------
// Servers a grader expects

/** A TCP port nothing listens on now. */
async function freePort(): Promise<number> {
  const probe = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = probe.port;
  probe.stop(true);
  return port;
}

/** Whether something accepts connections on 127.0.0.1:`port` now (one attempt). */
async function listening(port: number): Promise<boolean> {
  try {
    const socket = await Bun.connect({ hostname: "127.0.0.1", port, socket: { data() {} } });
    socket.end();
    return true;
  } catch {
    return false;
  }
}

/** Live processes whose command line holds `marker` (`http.server <port>`). */
function processesWith(marker: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`, "utf8").replaceAll("\0", " ").includes(marker) && alive(Number(entry)))
        found.push(Number(entry));
    } catch {
      /* gone */
    }
  }
  return found;
}

/** SIGKILL to `pid`'s process group and to `pid` itself. */
function killWithGroup(pid: number): void {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    const pgid = Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[2]);
    if (pgid > 1) process.kill(-pgid, "SIGKILL");
  } catch {
    /* gone */
  }
  try {
    process.kill(pid, "SIGKILL");
  } catch {
    /* gone */
  }
}

/** The command that starts a server in the background and waits until it answers. */
const serverCommand = (port: number) =>
  `${PYTHON} -m http.server ${port} --bind 127.0.0.1 > server.log 2>&1 & ` +
  `for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:${port}/ && break; sleep 0.1; done; ` +
  `curl -s -o /dev/null -w 'answered=%{http_code}\\n' http://127.0.0.1:${port}/`;

/** The kept jobs of an `end` event: a list of {pid, command, log} (or, in the other shape, its `jobs`). */
const keptJobs = (end: any): any[] | undefined => (Array.isArray(end?.kept) ? end.kept : end?.kept?.jobs);

describe.skipIf(!existsSync(PYTHON) || !Bun.which("curl"))("--keep-jobs", () => {
  test("a server a command started answers after aic exits, and the end event lists it", async () => {
    const port = await freePort();
    cleanups.push(() => processesWith(`http.server ${port}`).forEach(killWithGroup));
    const srv = fixtures.serve([bash(serverCommand(port), "c1"), done]);
    const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "--keep-jobs", "serve"]).done;
    expect(run.code, shown(run)).toBe(0);
    const result = resultsOf(run.stdout).find((e) => e.id === "c1");
    expect(result?.output, shown(run)).toContain("answered=200");
    // aic is gone; the server it started is not.
    const answer = await fetch(`http://127.0.0.1:${port}/`).then(
      (r) => r.status,
      (e) => String(e),
    );
    expect(answer).toBe(200);
    const end = endOf(run.stdout);
    expect(end, shown(run)).toMatchObject({ status: "completed", exit_code: 0 });
    const kept = keptJobs(end);
    expect(kept, JSON.stringify(end)).toHaveLength(1);
    // Read before asserting: Bun's toMatchObject writes its asymmetric matchers into the object it checks.
    const { pid, command, log } = kept![0];
    expect(typeof pid).toBe("number");
    cleanups.push(() => killWithGroup(pid));
    expect(command).toContain("http.server");
    expect(typeof log).toBe("string");
    expect(log.length).toBeGreaterThan(0);
    expect(alive(pid)).toBe(true);
    expect(readFileSync(`/proc/${pid}/cmdline`, "utf8")).toContain("http.server");

    // Without --json the last lines list the kept job too.
    const port2 = await freePort();
    cleanups.push(() => processesWith(`http.server ${port2}`).forEach(killWithGroup));
    const plainSrv = fixtures.serve([bash(serverCommand(port2)), done]);
    const plain = await startAic([...headless(plainSrv.url), "--auto-approve", "--keep-jobs", "serve"]).done;
    expect(plain.code, shown(plain)).toBe(0);
    expect(await listening(port2)).toBe(true);
    const keptLine = plain.stderr.split("\n").filter((l) => l.includes("http.server") && /kept|keep/i.test(l));
    expect(keptLine.length, shown(plain)).toBeGreaterThan(0);
  });

  // A server that logs every request to its terminal: that terminal must outlive aic too, or each request fails.
  for (const mode of [
    { label: "in the jail", args: [] as string[], env: {} },
    { label: "under Landlock alone", args: [] as string[], env: { AIC_NO_NAMESPACES: "1" } },
    { label: "without the sandbox", args: ["--disable-sandbox"], env: {} },
  ])
    test(`a kept server that logs to its terminal keeps answering (${mode.label})`, async () => {
      const port = await freePort();
      cleanups.push(() => processesWith(`http.server ${port}`).forEach(killWithGroup));
      const start =
        `${PYTHON} -m http.server ${port} --bind 127.0.0.1 & ` +
        `for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:${port}/ && break; sleep 0.1; done`;
      const srv = fixtures.serve([bash(start, "c1"), done]);
      const args = [...headless(srv.url), "--json", "--auto-approve", "--keep-jobs", ...mode.args, "serve"];
      const run = await startAic(args, { env: mode.env }).done;
      expect(run.code, shown(run)).toBe(0);
      for (const pid of (keptJobs(endOf(run.stdout)) ?? []).map((j) => j.pid)) cleanups.push(() => killWithGroup(pid));
      // Several requests, each of which the server logs to its terminal after aic has gone.
      for (let i = 0; i < 5; i++) {
        const status = await fetch(`http://127.0.0.1:${port}/`).then(
          (r) => r.status,
          (e) => String(e),
        );
        expect(status, `request ${i} after aic exited`).toBe(200);
      }
    });

  test("without --keep-jobs nothing answers on the port once aic has exited", async () => {
    const port = await freePort();
    cleanups.push(() => processesWith(`http.server ${port}`).forEach(killWithGroup));
    const srv = fixtures.serve([bash(serverCommand(port), "c1"), done]);
    const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "serve"]).done;
    expect(run.code, shown(run)).toBe(0);
    expect(resultsOf(run.stdout).find((e) => e.id === "c1")?.output, shown(run)).toContain("answered=200");
    expect(await listening(port)).toBe(false);
    expect(keptJobs(endOf(run.stdout)) ?? []).toEqual([]);
  });
});

// ---------------------------------------------------------------------------------------------
// The sandbox names its refusals

describe.skipIf(!LANDLOCK)("the sandbox names its refusals", () => {
  test("a write outside the writable set is named as the sandbox's refusal, with its path and not the shell's", async () => {
    const outside = fixtures.disposable(join("/var/tmp", unique("aic-field-refused-")));
    const srv = fixtures.serve([bash(`echo hi > ${outside}`, "c1"), bash("echo fine", "c2"), done]);
    const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "write"]).done;
    expect(run.code, shown(run)).toBe(0);
    const answers = srv.requests.at(-1)!.body.messages.filter((m: any) => m.role === "tool");
    const first: string = answers[0].content;
    const notes = first.split("\n").filter((l) => l.startsWith("[sandbox]"));
    expect(notes, first).toHaveLength(1);
    expect(notes[0]).toContain(outside);
    expect(first).not.toMatch(/\[sandbox\][^\n]*\/bin\/bash/);
    // A command that was not refused gets no such line.
    expect(answers[1].content).not.toContain("[sandbox]");
  });
});

describe.skipIf(!has.root || !has.setpriv)("a home aic may not search", () => {
  test("as uid 65534 with HOME=/root, aic starts and runs the command", async () => {
    const dir = fixtures.varTmp("aic-field-home-");
    chmodSync(dir, 0o777);
    const srv = fixtures.serve([bash("echo ran-with-unsearchable-home", "c1"), done]);
    const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "go"], {
      prefix: NOBODY_USER.wrap,
      cwd: dir,
      env: { HOME: "/root", XDG_STATE_HOME: undefined, XDG_CONFIG_HOME: undefined },
    }).done;
    expect(run.stderr, shown(run)).not.toContain("internal error");
    expect(run.code, shown(run)).toBe(0);
    expect(resultsOf(run.stdout).find((e) => e.id === "c1")?.output).toContain("ran-with-unsearchable-home");
  });
});

// ---------------------------------------------------------------------------------------------
// In a real container

describe("in a Docker container with Docker's default seccomp profile", () => {
  // Only with AIC_TEST_DOCKER=1 (a private dockerd and a debootstrapped image: a minute the first time).
  const why = dockerSkipReason();
  test.skipIf(why !== undefined)(
    `the command runs and the start event says which confinement holds ${why ? `(${why})` : ""}`,
    async () => {
      const engine = await startTestDocker();
      if ("skip" in engine) throw new Error(engine.skip);
      try {
        console.log(
          `docker: dockerd up in ${engine.timings.daemonMs} ms; base tarball ${engine.tarball.reused ? "reused" : `made by debootstrap in ${engine.timings.debootstrapMs} ms`} (${engine.tarball.path}); import ${engine.timings.importMs} ms`,
        );
        // The binary as a user would copy it in, never the file another build may replace meanwhile.
        const bin = scratch("aic-field-bin-");
        copyFileSync(AIC, join(bin, "aic"));
        chmodSync(join(bin, "aic"), 0o755);
        const srv = startFakeServer({
          turns: [
            bash("echo hello-from-container; (echo x > /var/tmp/outside) 2>/dev/null; echo wrote=$?", "c1"),
            done,
          ],
        });
        try {
          const base = ["run", "--rm", "--network", "host", "-v", `${bin}:/opt/aic:ro`, "-w", "/proj", engine.image];
          // What the profile does here: namespaces refused, and whether Landlock is offered.
          const probe = await engine.docker([
            ...base,
            "sh",
            "-c",
            `unshare --user true 2>&1; echo unshare=$?; python3 -c "import ctypes;l=ctypes.CDLL(None,use_errno=True);r=l.syscall(444,0,0,1);print('landlock', r, ctypes.get_errno())"`,
          ]);
          console.log(`docker: in the container: ${probe.stdout.trim().replaceAll("\n", " | ")}`);
          expect(probe.stdout).toMatch(/unshare=[1-9]/);
          const began = Date.now();
          const run = await engine.docker([
            ...base,
            "/opt/aic/aic",
            ...headless(srv.url),
            "--json",
            "--auto-approve",
            "hello",
          ]);
          console.log(`docker: aic's run in the container took ${Date.now() - began} ms`);
          expect(run.code, shown(run)).toBe(0);
          const result = resultsOf(run.stdout).find((e) => e.id === "c1");
          expect(result, shown(run)).toMatchObject({ status: "exited", exit_code: 0 });
          expect(result.output).toContain("hello-from-container");
          const sandbox = startOf(run.stdout)?.sandbox;
          console.log(
            `docker: start.sandbox = ${JSON.stringify({ jail: sandbox?.jail, reason: sandbox?.reason, missing: sandbox?.missing })}`,
          );
          expect(["landlock", "off"]).toContain(sandbox?.jail);
          expect(typeof sandbox.reason).toBe("string");
          expect(sandbox.reason.length).toBeGreaterThan(0);
          // Where the profile offers Landlock (the probe above says so), aic uses it.
          if (/landlock [1-9]/.test(probe.stdout)) {
            expect(sandbox.jail).toBe("landlock");
            expect(result.output).toMatch(/wrote=[1-9]/); // and it confines: /var/tmp is outside the writable set
          }
          expect(endOf(run.stdout)).toMatchObject({ status: "completed", exit_code: 0 });

          // A deny rule on arguments is held at exec there too: Docker's profile lets the launcher put its commands
          // under the exec judge's seccomp filter (or, where Landlock is missing, there is no launcher to judge).
          if (sandbox.jail === "landlock") {
            const proj = scratch("aic-field-judged-");
            writeFileSync(join(proj, ".aicrules"), "deny echo forbidden *\n");
            const judged = startFakeServer({
              turns: [bash("w=forbidden; /bin/echo $w word; echo rc=$?; /bin/echo fine", "j1"), done],
            });
            try {
              const inProj = ["run", "--rm", "--network", "host", "-v", `${bin}:/opt/aic:ro`, "-v", `${proj}:/proj`];
              const held = await engine.docker([
                ...inProj,
                "-w",
                "/proj",
                engine.image,
                "/opt/aic/aic",
                ...headless(judged.url),
                "--json",
                "--auto-approve",
                "--no-session",
                "judged",
              ]);
              expect(held.code, shown(held)).toBe(0);
              const out = resultsOf(held.stdout).find((e) => e.id === "j1");
              expect(out?.output, shown(held)).toContain(
                'aic: refused at exec: echo forbidden word — the rule "deny echo forbidden *"',
              );
              expect(out.output).not.toContain("forbidden word\n");
              expect(out.output).toContain("fine");
            } finally {
              judged.close();
            }
          }
        } finally {
          srv.close();
        }
      } finally {
        await engine.stop();
      }
    },
    1_200_000,
  );
});

describe.skipIf(!LANDLOCK)("what others left in /tmp and the project does not stop a run", () => {
  for (const mode of ["the jail", "Landlock alone"] as const) {
    test(`${mode}: thousands of directories named like saved outputs, and hundreds of repositories, still let commands run`, async () => {
      // Anyone who can write /tmp can make directories named as aic's saved outputs; each one the jail covers
      // was an argument and a mount, and 10,000 of them made the launcher's argument list too long to start.
      const tmp = fixtures.varTmp("aic-field-squat-tmp-");
      for (let i = 0; i < 3000; i++) mkdirSync(join(tmp, `aic-out-squat${i}`));
      // Hundreds of repositories: the guard pins each, and the plan passes what one argument may hold.
      const cwd = fixtures.varTmp("aic-field-squat-");
      for (let i = 0; i < 400; i++) {
        mkdirSync(join(cwd, `r${i}`, ".git", "objects"), { recursive: true });
        mkdirSync(join(cwd, `r${i}`, ".git", "refs"));
        writeFileSync(join(cwd, `r${i}`, ".git", "HEAD"), "ref: refs/heads/main\n");
      }
      const state = fixtures.varTmp("aic-field-squat-state-");
      const srv = fixtures.serve([bash("echo ran-despite-squatters", "c1"), done]);
      const run = await startAic([...headless(srv.url), "--json", "--auto-approve", "run"], {
        cwd,
        env: {
          TMPDIR: tmp,
          XDG_STATE_HOME: state,
          ...(mode === "Landlock alone" ? { AIC_NO_NAMESPACES: "1" } : {}),
        },
      }).done;
      expect(run.code, run.stderr).toBe(0);
      const answer = srv.requests.at(-1)!.body.messages.find((m: any) => m.role === "tool")?.content;
      expect(answer).toContain("ran-despite-squatters");
      // The plan's file is gone with the run.
      const left = readdirSync(join(state, "aic")).filter((n) => n.startsWith("plan-"));
      expect(left).toEqual([]);
    }, 120_000);
  }
});
