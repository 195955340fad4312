/**
 * Checkpoints and undo (README: "Checkpoints and undo"): before each command
 * aic snapshots the start directory into a shadow git repository of its own;
 * `aic undo [N]` and `aic redo` (and /undo, /redo in the TUI, see
 * tui.test.ts) put the files back exactly and cut the conversation back so
 * the model forgets what was undone. Each test drives the compiled binary
 * against the fake server, with XDG_STATE_HOME in a scratch directory, and
 * compares bytes and modes on disk.
 */
import { describe, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import {
  chmodSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  statSync,
  utimesSync,
  writeFileSync,
} from "node:fs";
import { join, relative } from "node:path";
import {
  alive,
  bash,
  has,
  hostPid,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  startAic,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();

/** Every file under `dir` (but the session's own files): path → sha256 and mode, for exact comparisons. */
function tree(dir: string, skip: (rel: string) => boolean = (r) => r.startsWith("s.json")): Record<string, string> {
  const out: Record<string, string> = {};
  const walk = (d: string) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      const abs = join(d, e.name);
      const rel = relative(dir, abs);
      if (skip(rel)) continue;
      if (e.isDirectory()) walk(abs);
      else
        out[rel] =
          `${createHash("sha256").update(readFileSync(abs)).digest("hex").slice(0, 16)} ${(statSync(abs).mode & 0o777).toString(8)}`;
    }
  };
  walk(dir);
  return out;
}

/** A project, a state home for the shadow repositories, and the environment that points aic at it. */
function project(): { dir: string; env: Record<string, string> } {
  const root = fixtures.disposable(scratch("aic-ckpt-"));
  const dir = join(root, "proj");
  mkdirSync(dir);
  return { dir, env: { XDG_STATE_HOME: join(root, "state") } };
}

const done = { content: "TASKCOMPLETE" };

describe("undo and redo from the command line", () => {
  test.skipIf(!has.git)(
    "edits, creations, deletions, renames and rm -rf are undone to the exact bytes and modes, and redone",
    async () => {
      const { dir, env } = project();
      mkdirSync(join(dir, "src"));
      writeFileSync(join(dir, "src", "main.ts"), "export const x = 1;\n");
      writeFileSync(join(dir, "src", "util.ts"), Buffer.from([0, 1, 2, 255, 10]));
      writeFileSync(join(dir, "run.sh"), "#!/bin/sh\necho hi\n", { mode: 0o755 });
      writeFileSync(join(dir, "secret.txt"), "private\n", { mode: 0o600 });
      writeFileSync(join(dir, "old-name.txt"), "renamed content\n");
      writeFileSync(join(dir, "doomed.txt"), "delete me\n");
      const before = tree(dir);
      const srv = fixtures.serve([
        bash(
          "echo changed >> src/main.ts; echo new > created.txt; mkdir -p deep/er && echo n > deep/er/new.txt; rm doomed.txt; mv old-name.txt new-name.txt; chmod -x run.sh; echo more >> secret.txt",
          "edit",
        ),
        bash("rm -rf src", "nuke"),
        done,
      ]);
      const session = join(dir, "s.json");
      const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "change things"], {
        cwd: dir,
        env,
      });
      expect(run.code).toBe(0);
      expect(existsSync(join(dir, "src"))).toBe(false);
      const after = tree(dir);

      // Undo both commands: every byte and mode as before, created files gone, the session's conversation cut.
      const undo = await runAic(["undo", "2", "--session", session], { cwd: dir, env });
      expect(undo.stderr).toBe("");
      expect(undo.code).toBe(0);
      expect(tree(dir)).toEqual(before);
      expect(existsSync(join(dir, "deep"))).toBe(false);
      expect(undo.stdout).toContain("re-created (4): doomed.txt, old-name.txt, src/main.ts, src/util.ts");
      expect(undo.stdout).toContain("removed (3): created.txt, deep/er/new.txt, new-name.txt");
      expect(undo.stdout).toContain("restored (2): run.sh, secret.txt");
      expect(undo.stdout).toContain(`Not covered: files outside ${dir}`);
      const saved = JSON.parse(readFileSync(session, "utf8"));
      expect(saved.messages.map((m: any) => m.role)).toEqual(["system", "user"]);
      expect(saved.reason).toBe("undo");

      // Redo: the state after the run is back, conversation included.
      const redo = await runAic(["redo", "--session", session], { cwd: dir, env });
      expect(redo.code).toBe(0);
      expect(tree(dir)).toEqual(after);
      const redone = JSON.parse(readFileSync(session, "utf8"));
      expect(redone.messages.filter((m: any) => m.role === "tool").map((m: any) => m.tool_call_id)).toEqual([
        "edit",
        "nuke",
      ]);

      // Undo one command; a resumed run no longer shows the model the undone turn.
      expect((await runAic(["undo", "--session", session], { cwd: dir, env })).code).toBe(0);
      expect(existsSync(join(dir, "src", "main.ts"))).toBe(true);
      const next = fixtures.serve([done]);
      expect((await runAic([...headless(next.url), "--session", session, "what now"], { cwd: dir, env })).code).toBe(0);
      const sent = messagesOf(next.requests[0]);
      expect(sent.filter((m: any) => m.role === "tool").map((m: any) => m.tool_call_id)).toEqual(["edit"]);
      expect(JSON.stringify(sent)).not.toContain("rm -rf src");
    },
  );

  // An empty directory changes no index entry: the checkpoint after the command must still hold it, in this run
  // (a tree seen just before) and in the next one (resumed from the store's saved state).
  test.skipIf(!has.git)(
    "a command that only makes or removes an empty directory is undone, in this run and the next",
    async () => {
      const { dir, env } = project();
      writeFileSync(join(dir, "a.txt"), "a\n");
      mkdirSync(join(dir, "old-empty"));
      // Files written long ago: git's index then settles at once, and nothing but the directory changes.
      const past = new Date(Date.now() - 3_600_000);
      utimesSync(join(dir, "a.txt"), past, past);
      const session = join(dir, "s.json");
      const srv = fixtures.serve([bash("true", "warm"), bash("mkdir made-empty", "mk"), done]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "make a dir"], {
        cwd: dir,
        env,
      });
      expect(run.code).toBe(0);
      expect(existsSync(join(dir, "made-empty"))).toBe(true);
      // The next run starts from what the last one saved; its command removes the older empty directory.
      const again = fixtures.serve([bash("rmdir old-empty", "rm"), done]);
      const second = await runAic([...headless(again.url), "--auto-approve", "--session", session, "remove a dir"], {
        cwd: dir,
        env,
      });
      expect(second.code).toBe(0);
      expect(existsSync(join(dir, "old-empty"))).toBe(false);
      const undoRm = await runAic(["undo", "--session", session], { cwd: dir, env });
      expect(undoRm.code).toBe(0);
      expect(existsSync(join(dir, "old-empty"))).toBe(true);
      const undoMk = await runAic(["undo", "--session", session], { cwd: dir, env });
      expect(undoMk.code).toBe(0);
      expect(existsSync(join(dir, "made-empty"))).toBe(false);
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("a\n");
      // Redo needs the checkpoint after the command: it holds the directory the command made.
      const redo = await runAic(["redo", "--session", session], { cwd: dir, env });
      expect(redo.code).toBe(0);
      expect(existsSync(join(dir, "made-empty"))).toBe(true);
    },
  );

  test.skipIf(!has.git)("undo refuses clearly: nothing to undo, too many, no session, a session in use", async () => {
    const { dir, env } = project();
    const session = join(dir, "s.json");
    const srv = fixtures.serve([bash("echo a > a.txt"), done]);
    expect(
      (await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env })).code,
    ).toBe(0);

    let r = await runAic(["undo", "3", "--session", session], { cwd: dir, env });
    expect([r.code, r.stderr]).toEqual([1, "aic: error: only 1 command(s) can be undone\n"]);
    r = await runAic(["redo", "--session", session], { cwd: dir, env });
    expect([r.code, r.stderr]).toEqual([1, "aic: error: nothing to redo\n"]);
    r = await runAic(["undo", "--session", join(dir, "missing.json")], { cwd: dir, env });
    expect([r.code, r.stderr]).toEqual([
      1,
      `aic: error: there is no session file ${join(dir, "missing.json")} (give --session PATH; a --nogui run keeps one only when given --session)\n`,
    ]);
    r = await runAic(["undo", "x"], { cwd: dir, env });
    expect([r.code, r.stderr]).toEqual([
      2,
      "aic: error: undo takes [N] (how many commands) and [--session PATH], not 'x'\n",
    ]);

    // A running aic holds the session: undo must not edit it under its feet.
    const hang = fixtures.serve([{ type: "hang" }]);
    const live = startAic([...headless(hang.url), "--session", session, "wait"], { cwd: dir, env });
    await waitFor("the running aic's request", () => hang.requests.length >= 1);
    r = await runAic(["undo", "--session", session], { cwd: dir, env });
    expect([r.code, r.stderr]).toEqual([
      1,
      `aic: error: ${session} is in use by a running aic: undo there (/undo in its TUI), or stop it first\n`,
    ]);
    live.proc.kill("SIGTERM");
    await live.done;
    expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("a\n");
  });

  // The checkpoint of a command is saved before it runs: after kill -9 in the middle of it, undo still works.
  test.skipIf(!has.git)("undo works after aic was killed with -9 during a command", async () => {
    const { dir, env } = project();
    writeFileSync(join(dir, "a.txt"), "original\n");
    const session = join(dir, "s.json");
    // The command becomes a sleep (exec keeps the pid) after printing that pid.
    const srv = fixtures.serve([bash("echo clobbered > a.txt; exec sh -c 'echo sleeper-pid=$$; exec sleep 300'")]);
    const live = startAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env });
    const printed = await waitFor(
      "the command's write and its pid",
      () => readFileSync(join(dir, "a.txt"), "utf8") === "clobbered\n" && /sleeper-pid=(\d+)\n/.exec(live.stdout()),
    );
    // The pid it printed is the jail's numbering: the same process as the tests see it.
    const sleeper = await waitFor("the sleep's pid outside the jail", () => hostPid(Number(printed[1]), dir));
    live.proc.kill("SIGKILL");
    await live.done;
    // The sleep was the command's own process: end it as a person would, by its pid (if it is still that sleep),
    // never by name. (In the jail, aic's end already ended it.)
    const isTheSleep = () => {
      try {
        return readFileSync(`/proc/${sleeper}/cmdline`, "utf8") === "sleep\x00300\x00";
      } catch {
        return false;
      }
    };
    if (isTheSleep()) process.kill(sleeper, "SIGKILL");
    await waitFor("the command's sleep to be gone", () => !alive(sleeper));
    const r = await runAic(["undo", "--session", session], { cwd: dir, env });
    expect(r.code).toBe(0);
    expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("original\n");
  });
});

describe("what checkpoints leave alone", () => {
  // The project's own .git is byte-identical after a run, an undo and a redo; ignored files (node_modules/)
  // are neither snapshotted nor touched by undo.
  test.skipIf(!has.git)("the project's .git and its ignored files are never touched", async () => {
    const { dir, env } = project();
    const git = (...args: string[]) =>
      runCommand(["git", "-C", dir, ...args], {
        env: {
          ...env,
          GIT_AUTHOR_NAME: "t",
          GIT_AUTHOR_EMAIL: "t@t",
          GIT_COMMITTER_NAME: "t",
          GIT_COMMITTER_EMAIL: "t@t",
        },
      });
    await git("init", "-q");
    writeFileSync(join(dir, ".gitignore"), "node_modules/\n");
    writeFileSync(join(dir, "index.js"), "console.log(1)\n");
    mkdirSync(join(dir, "node_modules", "dep"), { recursive: true });
    writeFileSync(join(dir, "node_modules", "dep", "index.js"), "v1\n");
    await git("add", "-A");
    await git("commit", "-qm", "first");
    await git("stash", "list");
    const dotGit = () => tree(join(dir, ".git"), () => false);
    const gitBefore = dotGit();
    const session = join(dir, "s.json");
    const srv = fixtures.serve([bash("echo 2 >> index.js; echo v2 > node_modules/dep/index.js"), done]);
    expect(
      (await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env })).code,
    ).toBe(0);
    expect((await runAic(["undo", "--session", session], { cwd: dir, env })).code).toBe(0);
    expect(readFileSync(join(dir, "index.js"), "utf8")).toBe("console.log(1)\n");
    expect(readFileSync(join(dir, "node_modules", "dep", "index.js"), "utf8")).toBe("v2\n");
    expect((await runAic(["redo", "--session", session], { cwd: dir, env })).code).toBe(0);
    // Untouched but for the one line that keeps the session out of commits (README: "Session files").
    const { "info/exclude": excludeAfter, ...restAfter } = dotGit();
    const { "info/exclude": excludeBefore, ...restBefore } = gitBefore;
    expect(restAfter).toEqual(restBefore);
    expect(excludeAfter).not.toEqual(excludeBefore);
    expect(readFileSync(join(dir, ".git", "info", "exclude"), "utf8")).toEndWith("\n/s.json*\n");
    // The shadow repository holds no path under node_modules.
    const state = join(env.XDG_STATE_HOME!, "aic", "checkpoints");
    const [shadow] = readdirSync(state);
    const listed = await runCommand(["git", "--git-dir", join(state, shadow!, "git"), "ls-files"], { env });
    expect(listed.stdout.split("\n").filter(Boolean).sort()).toEqual([".gitignore", "index.js"]);
  });

  // A git killed mid-pack (a first snapshot past its time limit) leaves a temporary pack: the next snapshot removes it.
  test.skipIf(!has.git)("a half-written pack a killed git left in the shadow repository is removed", async () => {
    const { dir, env } = project();
    writeFileSync(join(dir, "a.txt"), "a\n");
    const session = join(dir, "s.json");
    const run = () => {
      const srv = fixtures.serve([bash("echo b >> a.txt"), done]);
      return runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env });
    };
    expect((await run()).code).toBe(0);
    const state = join(env.XDG_STATE_HOME!, "aic", "checkpoints");
    const [shadow] = readdirSync(state);
    const packs = join(state, shadow!, "git", "objects", "pack");
    writeFileSync(join(packs, "tmp_pack_AbCdEf"), "half a pack");
    writeFileSync(join(packs, "tmp_idx_AbCdEf"), "half an index");
    expect((await run()).code).toBe(0);
    expect(readdirSync(packs).filter((n) => n.startsWith("tmp_"))).toEqual([]);
  });

  // A tree of 60,000 files is not checkpointed: one warning says why, and the run goes on.
  test.skipIf(!has.git)(
    "60,000 files turn checkpoints off with the reason, and the run goes on",
    async () => {
      const { dir, env } = project();
      for (let d = 0; d < 60; d++) {
        mkdirSync(join(dir, `d${d}`));
        for (let f = 0; f < 1000; f++) writeFileSync(join(dir, `d${d}`, `f${f}`), "");
      }
      const session = join(dir, "s.json");
      const srv = fixtures.serve([bash("echo ran > ran.txt", "r"), done]);
      const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "go"], {
        cwd: dir,
        env,
      });
      expect(result.code).toBe(0);
      expect(readFileSync(join(dir, "ran.txt"), "utf8")).toBe("ran\n");
      const warnings = jsonLines(result.stdout)
        .filter((e) => e.type === "warning")
        .map((e) => e.text);
      expect(warnings).toEqual([
        `checkpoints are off: ${dir} holds more than 50000 files that are not ignored; commands still run, but /undo and aic undo cannot put files back`,
      ]);
      const r = await runAic(["undo", "--session", session], { cwd: dir, env });
      expect(r.code).toBe(1);
      expect(r.stderr).toContain("records no checkpoint");
    },
    300_000,
  ); // a hang guard only: making 60,000 files takes minutes on a loaded machine

  // Without git on PATH checkpoints are off with the reason, and the run goes on.
  test("no git on PATH: checkpoints off, said once, the run goes on", async () => {
    const { dir, env } = project();
    const bin = join(dir, "..", "bin");
    mkdirSync(bin);
    for (const tool of ["sh", "echo"]) {
      const found = Bun.which(tool);
      if (found) writeFileSync(join(bin, tool), `#!/bin/sh\nexec ${found} "$@"\n`, { mode: 0o755 });
    }
    chmodSync(bin, 0o755);
    const srv = fixtures.serve([bash("echo one", "a"), bash("echo two", "b"), done]);
    const result = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--session", join(dir, "s.json"), "go"],
      {
        cwd: dir,
        env: { ...env, PATH: bin },
      },
    );
    expect(result.code).toBe(0);
    const warnings = jsonLines(result.stdout)
      .filter((e) => e.type === "warning")
      .map((e) => e.text);
    expect(warnings).toEqual([expect.stringMatching(/^checkpoints are off: git was not found on PATH/)]);
  });
});

describe("the checkpoint store has a cap", () => {
  /** Bytes of every file under `dir`. */
  const bytesUnder = (dir: string): number => {
    let total = 0;
    for (const e of readdirSync(dir, { withFileTypes: true })) {
      const abs = join(dir, e.name);
      total += e.isDirectory() ? bytesUnder(abs) : e.isFile() ? statSync(abs).size : 0;
    }
    return total;
  };

  // Big files written and deleted again would stay in the store for good, where no command can delete them.
  test.skipIf(!has.git)("commands that write and delete big files leave it under the cap, and say so", async () => {
    const { dir, env } = project();
    const big = (i: number) => `head -c 12000000 /dev/urandom > big${i}; rm -f big${i - 1}; echo wrote ${i}`;
    const srv = fixtures.serve([bash(big(1), "b1"), bash(big(2), "b2"), bash(big(3), "b3"), bash(big(4), "b4"), done]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--session", join(dir, "s.json"), "fill the store"],
      { cwd: dir, env: { ...env, AIC_CHECKPOINT_STORE_MAX_MB: "30" } },
    );
    expect(run.code).toBe(0);
    const store = join(env.XDG_STATE_HOME!, "aic", "checkpoints");
    // Four random 12 MB files would be 48 MB; the cap keeps it near 30 MB (a store's own files aside).
    expect(bytesUnder(store)).toBeLessThan(32_000_000);
    const warned = jsonLines(run.stdout).filter((e) => e.type === "warning" && /passed its cap of 30 MB/.test(e.text));
    expect(warned.length).toBeGreaterThan(0);
    // The last command can still be undone: its file goes, the one before it comes back.
    const undo = await runAic(["undo", "--session", join(dir, "s.json")], { cwd: dir, env });
    expect(undo.code).toBe(0);
    expect(existsSync(join(dir, "big4"))).toBe(false);
    expect(statSync(join(dir, "big3")).size).toBe(12_000_000);
  });
});

describe("one file over the per-file cap is left out of checkpoints", () => {
  const warningsOf = (stdout: string) =>
    jsonLines(stdout)
      .filter((e) => e.type === "warning")
      .map((e) => String(e.text));

  // git reads every byte it adds: a 30 GB sparse file held the snapshot past its time limit and turned
  // checkpoints off for the run. Left out and said, every other file keeps its checkpoints.
  test.skipIf(!has.git)("a 30 GB sparse file: named once, checkpoints stay on, undo leaves it alone", async () => {
    const { dir, env } = project();
    const session = join(dir, "s.json");
    const srv = fixtures.serve([
      bash("truncate -s 30000000000 huge.img && echo kept > small.txt", "a"),
      bash("echo two > two.txt", "b"),
      done,
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "go"], {
      cwd: dir,
      env,
    });
    expect(run.code).toBe(0);
    const warnings = warningsOf(run.stdout);
    expect(warnings.filter((w) => w.startsWith("left out of checkpoints"))).toEqual([
      expect.stringContaining(`${join(dir, "huge.img")} (30.0 GB)`),
    ]);
    expect(warnings.filter((w) => w.includes("checkpoints are off"))).toEqual([]);
    for (const expected of [["two.txt"], ["small.txt"]]) {
      const undo = await runAic(["undo", "--session", session], { cwd: dir, env });
      expect(undo.code).toBe(0);
      for (const gone of expected) expect(existsSync(join(dir, gone))).toBe(false);
      // The report names what it left as it is, rather than say every file is as it was.
      expect(undo.stdout).toContain(
        "left as they are, too big for checkpoints (AIC_CHECKPOINT_FILE_MAX_MB) (1): huge.img",
      );
    }
    expect(statSync(join(dir, "huge.img")).size).toBe(30_000_000_000);
  });

  // A tracked file that grows past the cap leaves the checkpoint, so undoing the command that grew it puts the
  // small version back and keeps the big one aside instead of overwriting it.
  test.skipIf(!has.git)(
    "a file that grows past the cap: undo brings back the small one, the big one kept aside",
    async () => {
      const { dir, env } = project();
      const session = join(dir, "s.json");
      const srv = fixtures.serve([
        bash("printf small > data.bin", "a"),
        bash(
          "head -c 3000000 /dev/zero > data.bin && mkdir -p out/deep && head -c 2000000 /dev/zero > out/deep/x.bin && echo y > out/y.txt",
          "b",
        ),
        done,
      ]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "go"], {
        cwd: dir,
        env: { ...env, AIC_CHECKPOINT_FILE_MAX_MB: "1" },
      });
      expect(run.code).toBe(0);
      const left = warningsOf(run.stdout).filter((w) => w.startsWith("left out of checkpoints"));
      expect(left).toEqual([expect.stringContaining("each over 1 MB")]);
      expect(left[0]).toContain(`${join(dir, "data.bin")} (3 MB)`);
      expect(left[0]).toContain(`${join(dir, "out/deep/x.bin")} (2 MB)`);
      const undo = await runAic(["undo", "--session", session], {
        cwd: dir,
        env: { ...env, AIC_CHECKPOINT_FILE_MAX_MB: "1" },
      });
      expect(undo.code).toBe(0);
      expect(readFileSync(join(dir, "data.bin"), "utf8")).toBe("small");
      expect(statSync(join(dir, "data.bin.aic-kept-1")).size).toBe(3_000_000);
      expect(existsSync(join(dir, "out", "y.txt"))).toBe(false);
      expect(statSync(join(dir, "out", "deep", "x.bin")).size).toBe(2_000_000);
    },
  );
});

describe("big files the kernel's record lost track of are still left out", () => {
  const warningsOf = (stdout: string) =>
    jsonLines(stdout)
      .filter((e) => e.type === "warning")
      .map((e) => String(e.text));
  const runOne = async (command: string, extraEnv: Record<string, string> = {}) => {
    const { dir, env } = project();
    writeFileSync(join(dir, "keep.txt"), "keep\n");
    const srv = fixtures.serve([bash("true", "warm"), bash(command, "c"), bash("echo two > two.txt", "after"), done]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--session", join(dir, "s.json"), "go"],
      { cwd: dir, env: { ...env, ...extraEnv } },
    );
    return { dir, run, warnings: warningsOf(run.stdout) };
  };

  // The fifth red team: an inotify overflow (thousands of files made and removed) hid a 60 GB sparse file from the
  // look at sizes; the snapshot then read it for 60 s and turned checkpoints off. More entries than a look covers (a
  // directory of 5,001 files made beside the big one) did the same: git lists the rest.
  const lostTrack: [label: string, command: string, where: string][] = [
    [
      "after an overflow of the record",
      "for i in $(seq 7000); do : > t$i; done; rm -f t*; truncate -s 30000000000 big.bin; echo made",
      "big.bin",
    ],
    [
      "past the look's budget, in another new directory",
      "mkdir a b && (cd a && seq -f 'f%g' 5001 | xargs touch) && truncate -s 30000000000 b/big.bin && echo made",
      "b/big.bin",
    ],
  ];
  for (const [label, command, where] of lostTrack)
    test.skipIf(!has.git)(`${label}: the sparse file is named, checkpoints stay on`, async () => {
      const { dir, run, warnings } = await runOne(command);
      expect(run.code).toBe(0);
      expect(warnings.filter((w) => w.startsWith("left out of checkpoints"))).toEqual([
        expect.stringContaining(`${join(dir, where)} (30.0 GB)`),
      ]);
      expect(warnings.filter((w) => w.includes("checkpoints are off"))).toEqual([]);
    });

  // Left-out files without end would make a list without end: past 10,000 checkpoints go off, said at once.
  test.skipIf(!has.git)("more than 10,000 files over the cap: checkpoints go off with the reason", async () => {
    const { run, warnings } = await runOne("seq -f 'f%g' 10001 | xargs truncate -s 2000000 && echo made", {
      AIC_CHECKPOINT_FILE_MAX_MB: "1",
    });
    expect(run.code).toBe(0);
    expect(warnings.filter((w) => w.includes("checkpoints are off"))).toEqual([
      expect.stringContaining("more than 10,000 files are over the per-file cap of 1 MB"),
    ]);
  });
});
