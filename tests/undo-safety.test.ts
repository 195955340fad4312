/**
 * Undo that cannot be turned against the person, and changes one can see
 * (README: "Checkpoints and undo"). Checkpoints and undo work only on the
 * directory aic started in, held open: a start directory swapped for a link,
 * a session that names another directory, or a moved project are refused
 * with the reason, and nothing outside the project is read, written or
 * removed. Undo puts back empty directories, permission bits and links (as
 * links). Each command's result lists what it changed, and `aic diff N`
 * shows it. Every test drives the compiled binary against the fake server.
 */
import { describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  lstatSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  readlinkSync,
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
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  scratch,
  toolAnswer,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };

/** Every path under `dir` with its type, bytes and mode: a change anywhere in it shows. */
function snapshotOf(dir: string): Record<string, string> {
  const out: Record<string, string> = {};
  const walk = (d: string, rel: string) => {
    for (const name of readdirSync(d).sort()) {
      const abs = join(d, name);
      const r = rel ? `${rel}/${name}` : name;
      const st = lstatSync(abs);
      const mode = (st.mode & 0o7777).toString(8);
      if (st.isSymbolicLink()) out[r] = `link -> ${readlinkSync(abs)}`;
      else if (st.isDirectory()) {
        out[r] = `dir ${mode}`;
        walk(abs, r);
      } else out[r] = `file ${mode} ${readFileSync(abs, "latin1")}`;
    }
  };
  walk(dir, "");
  return out;
}

/** The files (not directories: aic makes the package caches' directories in $HOME at start) under a home directory. */
const filesOf = (home: string) =>
  Object.fromEntries(Object.entries(snapshotOf(home)).filter(([, v]) => !v.startsWith("dir ")));

/** Every object the shadow repositories under `state` hold, as text: what a checkpoint ever stored. */
async function storedObjects(state: string): Promise<string> {
  const root = join(state, "aic", "checkpoints");
  if (!existsSync(root)) return "";
  let all = "";
  for (const repo of readdirSync(root)) {
    const gitDir = join(root, repo, "git");
    const p = Bun.spawn(["git", "--git-dir", gitDir, "cat-file", "--batch-all-objects", "--batch"], {
      stdout: "pipe",
      stderr: "ignore",
    });
    all += await new Response(p.stdout).text();
    await p.exited;
  }
  return all;
}

/** A root holding the project, a home directory with a git repository and a secret, and a state home. */
function world() {
  const root = fixtures.disposable(scratch("aic-undo-safety-"));
  const dir = join(root, "proj");
  const home = join(root, "home");
  mkdirSync(dir);
  mkdirSync(join(home, ".ssh"), { recursive: true });
  writeFileSync(join(home, ".ssh", "id_rsa"), "HOME-SECRET-KEY-7731\n");
  writeFileSync(join(home, "notes.txt"), "HOME-NOTES-4410\n");
  Bun.spawnSync(["git", "init", "-q", home]);
  Bun.spawnSync(["git", "-C", home, "add", "-A"]);
  const env = { XDG_STATE_HOME: join(root, "state"), HOME: home };
  return { root, dir, home, env, state: join(root, "state") };
}

describe("undo never reaches outside the project", () => {
  test.skipIf(!has.git)(
    "the start directory swapped for a link to $HOME: checkpoints stop with the reason, home is untouched and not stored, undo refuses",
    async () => {
      const { root, dir, home, env, state } = world();
      writeFileSync(join(dir, "a.txt"), "one\n");
      const homeBefore = filesOf(home);
      const srv = fixtures.serve([
        bash("echo two >> a.txt", "edit"),
        bash(`cd .. && mv proj proj.moved && ln -s ${home} proj`, "swap"),
        bash("ls >/dev/null; echo three", "after"),
        done,
      ]);
      const session = join(dir, "s.json");
      const run = await runAic(
        [...headless(srv.url), "--auto-approve", "--json", "--session", session, "swap the directory"],
        { cwd: dir, env },
      );
      expect(run.code).toBe(0);
      const warnings = jsonLines(run.stdout)
        .filter((e) => e.type === "warning")
        .map((e) => e.text);
      expect(warnings.some((w) => /checkpoints are off: .*proj was replaced by a symbolic link/.test(w))).toBe(true);
      // The swap really happened, and nothing of home changed or reached the store.
      expect(lstatSync(join(root, "proj")).isSymbolicLink()).toBe(true);
      expect(filesOf(home)).toEqual(homeBefore);
      const stored = await storedObjects(state);
      expect(stored).toContain("two"); // the project's own file was stored
      expect(stored).not.toContain("HOME-SECRET-KEY-7731");
      expect(stored).not.toContain("HOME-NOTES-4410");

      // The session followed the project (aic writes it through the directory it holds): undo from there refuses.
      const moved = join(root, "proj.moved");
      for (const n of ["1", "2"]) {
        const undo = await runAic(["undo", n, "--session", join(moved, "s.json")], { cwd: moved, env });
        expect(undo.code).toBe(1);
        expect(undo.stderr).toContain(`says its checkpoints cover ${dir}, but the session file lives in ${moved}`);
        expect(undo.stderr.trim().split("\n")).toHaveLength(1);
      }
      expect(filesOf(home)).toEqual(homeBefore);
      expect(readFileSync(join(moved, "a.txt"), "utf8")).toBe("one\ntwo\n");
    },
  );

  test.skipIf(!has.git)(
    "a session whose checkpoints name another directory: refused, nothing copied or deleted there",
    async () => {
      const { root, dir, env, state } = world();
      const other = join(root, "other");
      mkdirSync(other);
      writeFileSync(join(other, "precious.txt"), "OTHER-PRECIOUS-9182\n");
      writeFileSync(join(dir, "a.txt"), "one\n");
      const srv = fixtures.serve([bash("echo x > b.txt", "b"), done]);
      const session = join(dir, "s.json");
      expect(
        (await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env })).code,
      ).toBe(0);
      const doc = JSON.parse(readFileSync(session, "utf8"));
      expect(doc.checkpoints.directory).toBe(dir);
      doc.checkpoints.directory = other;
      writeFileSync(session, JSON.stringify(doc, null, 2));
      const otherBefore = snapshotOf(other);
      const projectBefore = snapshotOf(dir);
      for (const argv of [["undo"], ["redo"], ["diff"]]) {
        const r = await runAic([...argv, "--session", session], { cwd: dir, env });
        expect(r.code).toBe(1);
        expect(r.stderr).toBe(
          `aic: error: ${session} says its checkpoints cover ${other}, but the session file lives in ${dir}; aic only undoes, redoes or shows changes in the directory that holds the session file (was the project moved, or the session edited?), so nothing was touched\n`,
        );
      }
      expect(snapshotOf(other)).toEqual(otherBefore);
      expect(snapshotOf(dir)).toEqual(projectBefore);
      expect(await storedObjects(state)).not.toContain("OTHER-PRECIOUS-9182");
    },
  );

  // The root lies under /tmp, where commands may write: a `.git` there makes it look like a repository's top. (One a
  // command makes is moved aside by the repository guard; this one appears between runs, as by anyone else.)
  test.skipIf(!has.git)(
    "a .git made above the project does not move the checkpoints: undo still restores",
    async () => {
      const { root, dir, env } = world();
      writeFileSync(join(dir, "a.txt"), "one\n");
      writeFileSync(join(dir, "b.txt"), "kept\n");
      const session = join(dir, "s.json");
      const first = fixtures.serve([bash("echo two > a.txt", "edit"), done]);
      expect(
        (await runAic([...headless(first.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env })).code,
      ).toBe(0);
      mkdirSync(join(root, ".git"));
      const second = fixtures.serve([bash("echo three > a.txt", "edit"), done]);
      expect(
        (await runAic([...headless(second.url), "--auto-approve", "--session", session, "again"], { cwd: dir, env }))
          .code,
      ).toBe(0);
      expect(existsSync(join(root, ".git"))).toBe(true);
      const undo = await runAic(["undo", "2", "--session", session], { cwd: dir, env });
      expect([undo.code, undo.stderr]).toEqual([0, ""]);
      expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("one\n");
      expect(readFileSync(join(dir, "b.txt"), "utf8")).toBe("kept\n");
    },
  );

  test.skipIf(!has.git)("a moved project: undo refuses and changes nothing", async () => {
    const { root, dir, env } = world();
    writeFileSync(join(dir, "a.txt"), "one\n");
    const srv = fixtures.serve([bash("echo two > a.txt", "edit"), done]);
    expect(
      (
        await runAic([...headless(srv.url), "--auto-approve", "--session", join(dir, "s.json"), "go"], {
          cwd: dir,
          env,
        })
      ).code,
    ).toBe(0);
    const moved = join(root, "elsewhere");
    Bun.spawnSync(["mv", dir, moved]);
    const r = await runAic(["undo", "--session", join(moved, "s.json")], { cwd: moved, env });
    expect(r.code).toBe(1);
    expect(r.stderr).toContain("was the project moved, or the session edited?");
    expect(readFileSync(join(moved, "a.txt"), "utf8")).toBe("two\n");
  });

  test.skipIf(!has.git)(
    "a directory of the project replaced by a link to $HOME is put back as a directory; home is untouched",
    async () => {
      const { dir, home, env } = world();
      mkdirSync(join(dir, "sub"));
      writeFileSync(join(dir, "sub", "data.txt"), "sub data\n");
      const homeBefore = filesOf(home);
      const srv = fixtures.serve([bash(`rm -rf sub && ln -s ${home} sub`, "link"), done]);
      const session = join(dir, "s.json");
      expect(
        (await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env })).code,
      ).toBe(0);
      expect(lstatSync(join(dir, "sub")).isSymbolicLink()).toBe(true);
      const undo = await runAic(["undo", "--session", session], { cwd: dir, env });
      expect([undo.code, undo.stderr]).toEqual([0, ""]);
      expect(lstatSync(join(dir, "sub")).isDirectory()).toBe(true);
      expect(readFileSync(join(dir, "sub", "data.txt"), "utf8")).toBe("sub data\n");
      expect(filesOf(home)).toEqual(homeBefore);
      // And redo puts the link back as a link, still without touching home.
      const redo = await runAic(["redo", "--session", session], { cwd: dir, env });
      expect([redo.code, redo.stderr]).toEqual([0, ""]);
      expect(readlinkSync(join(dir, "sub"))).toBe(home);
      expect(filesOf(home)).toEqual(homeBefore);
    },
  );
});

// A job that keeps exchanging a directory of the project with a link to $HOME (renameat2 RENAME_EXCHANGE) tries to
// make a snapshot, which aic takes unconfined, read home through the link. Its processes are stopped meanwhile.
test.skipIf(!has.git || !existsSync("/usr/bin/python3"))(
  "a job swapping a directory for a link while snapshots are taken never gets home into the store",
  async () => {
    const { dir, home, env, state } = world();
    mkdirSync(join(dir, "real"));
    writeFileSync(join(dir, "real", "f.txt"), "project file\n");
    symlinkSync(home, join(dir, "swap"));
    const swapper = [
      "import ctypes, os",
      "libc = ctypes.CDLL(None, use_errno=True)",
      "while True: libc.syscall(316, -100, b'real', -100, b'swap', 2)",
    ].join("\n");
    const steps = Array.from({ length: 24 }, (_, i) => bash(`echo ${i} > step-${i}.txt`, `s${i}`));
    const srv = fixtures.serve([
      bash(`/usr/bin/python3 -c "${swapper}" > /dev/null 2>&1 & echo started`, "job"),
      ...steps,
      done,
    ]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--session", join(dir, "s.json"), "swap while snapshots run"],
      { cwd: dir, env },
    );
    expect(run.code).toBe(0);
    const changed = jsonLines(run.stdout).filter((e) => e.type === "command_result" && e.changed_files);
    expect(changed.length).toBeGreaterThanOrEqual(24); // the snapshots were taken
    expect(await storedObjects(state)).not.toContain("HOME-NOTES-4410");
  },
);

describe("undo puts back what git does not record", () => {
  test.skipIf(!has.git)("empty directories, permission bits and links, exactly as they were", async () => {
    const { dir, env } = world();
    writeFileSync(join(dir, "private.txt"), "keep\n");
    chmodSync(join(dir, "private.txt"), 0o600);
    writeFileSync(join(dir, "tool.sh"), "#!/bin/sh\n", { mode: 0o755 });
    chmodSync(join(dir, "tool.sh"), 0o750);
    mkdirSync(join(dir, "was-empty"));
    mkdirSync(join(dir, "logs", "old"), { recursive: true });
    symlinkSync("private.txt", join(dir, "link"));
    const before = snapshotOf(dir);
    const srv = fixtures.serve([
      bash(
        "chmod 644 private.txt; chmod 755 tool.sh; rmdir was-empty; rm -r logs; mkdir -p new/empty; rm link; echo plain > link",
        "mess",
      ),
      done,
    ]);
    const session = join(dir, "s.json");
    const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env });
    expect(run.code).toBe(0);
    expect(statSync(join(dir, "private.txt")).mode & 0o777).toBe(0o644);
    expect(existsSync(join(dir, "was-empty"))).toBe(false);
    const undo = await runAic(["undo", "--session", session], { cwd: dir, env });
    expect([undo.code, undo.stderr]).toEqual([0, ""]);
    const { ["s.json"]: _s, ["s.json.lock"]: _l, ...after } = snapshotOf(dir);
    const expected = before;
    expect(after).toEqual(expected);
    expect(undo.stdout).toContain("re-created (2): logs/old/, was-empty/");
    expect(undo.stdout).toContain("removed (1): new/empty/");
    expect(undo.stdout).toContain("restored (3): link, private.txt, tool.sh");
  });
});

describe("what each command changed is visible", () => {
  test.skipIf(!has.git)(
    "changed_files in --json, one line in the tool result, and aic diff 1 after sed -i",
    async () => {
      const { dir, env } = world();
      writeFileSync(join(dir, "calc.py"), "def add(a, b):\n    return a - b\n");
      writeFileSync(join(dir, "gone.txt"), "bye\n");
      writeFileSync(join(dir, "blob.bin"), Buffer.from([0, 1, 2, 3, 0, 255]));
      const srv = fixtures.serve([
        bash(
          "sed -i 's/a - b/a + b/' calc.py && rm gone.txt && echo hi > new.txt && printf '\\000\\001x' > blob.bin",
          "fix",
        ),
        bash("ls > /dev/null", "look"),
        done,
      ]);
      const session = join(dir, "s.json");
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", session, "fix"], {
        cwd: dir,
        env,
      });
      expect(run.code).toBe(0);
      const results = jsonLines(run.stdout).filter((e) => e.type === "command_result");
      expect(results.map((r) => r.changed_files)).toEqual([
        { created: ["new.txt"], modified: ["blob.bin", "calc.py"], deleted: ["gone.txt"] },
        { created: [], modified: [], deleted: [] },
      ]);
      // The model's tool result ends with one short line; a command that changed nothing has none.
      const fixAnswer = toolAnswer(srv.requests[1], "fix");
      expect(fixAnswer.trim().split("\n").at(-1)).toBe(
        "Files changed: created new.txt; modified blob.bin, calc.py; deleted gone.txt.",
      );
      expect(toolAnswer(srv.requests[2], "look")).not.toContain("Files changed");

      // aic diff 2 is the sed: the - and + lines, the binary file named, not dumped.
      const diff = await runAic(["diff", "2", "--session", session], { cwd: dir, env });
      expect(diff.code).toBe(0);
      expect(diff.stdout).toContain("-    return a - b\n+    return a + b\n");
      expect(diff.stdout).toMatch(/Binary files a\/blob.bin and b\/blob.bin differ/);
      expect(diff.stdout).toContain("deleted file mode");
      expect(diff.stdout).not.toContain("\u0000");
      expect(diff.stdout).not.toContain("(permissions of");
      // On a terminal the diff is coloured, and no file whose content changed is said to have changed its mode.
      if (Bun.which("script")) {
        const cmd = `${AIC} diff 2 --session ${session}`;
        const tty = Bun.spawnSync(["script", "-qec", cmd, "/dev/null"], {
          cwd: dir,
          env: { ...process.env, ...env, NO_COLOR: "" },
        });
        const shown = tty.stdout.toString();
        expect(shown).toContain("\x1b[");
        expect(shown).toContain("a + b");
        expect(shown).not.toContain("(permissions of");
      }
      const last = await runAic(["diff", "--session", session], { cwd: dir, env });
      expect(last.stdout).toBe("# ls > /dev/null\n(no files changed)\n");
      const tooFar = await runAic(["diff", "3", "--session", session], { cwd: dir, env });
      expect([tooFar.code, tooFar.stderr]).toEqual([1, "aic: error: only 2 command(s) have a recorded change\n"]);
    },
  );

  // The red team's: a file a command wrote carries OSC 52 (sets the clipboard: the person's next paste runs it)
  // and a screen clear; aic diff on a terminal sent them raw. Piped, the diff stays the patch it is.
  test.skipIf(!has.git || !Bun.which("script"))(
    "aic diff on a terminal shows the control characters a file holds and sends none; piped, it is the patch",
    async () => {
      const { dir, env } = world();
      const srv = fixtures.serve([
        // And the red team's re-attack: SGR 8 (conceal) hid an added line, since colour codes passed as git's.
        bash("printf 'line\\033]52;c;ZWNobyBwd25lZA==\\007\\033[2J\\n\\033[8mhidden\\n' > notes.txt", "plant"),
        done,
      ]);
      const session = join(dir, "s.json");
      const run = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir, env });
      expect(run.code).toBe(0);
      const tty = Bun.spawnSync(["script", "-qec", `${AIC} diff --session ${session}`, "/dev/null"], {
        cwd: dir,
        env: { ...process.env, ...env, NO_COLOR: "" },
      });
      const shown = tty.stdout.toString();
      expect(shown).toContain("notes.txt");
      expect(shown).toContain("\u241b]52;c;ZWNobyBwd25lZA==");
      expect(shown).not.toContain("\x1b]52");
      expect(shown).not.toContain("\x1b[2J");
      expect(shown).not.toContain("\x1b[8m");
      expect(shown).toContain("\u241b[8mhidden");
      expect(shown).toContain("\x1b[32m+line"); // coloured by aic, by the line's start
      const piped = await runAic(["diff", "--session", session], { cwd: dir, env });
      expect(piped.stdout).toContain("+line\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2J\n+\x1b[8mhidden\n");
    },
  );

  test.skipIf(!has.git)(
    "without a session file, --json still lists changed files (and leaves no store behind)",
    async () => {
      const { dir, env, state } = world();
      const srv = fixtures.serve([bash("echo hi > made.txt", "make"), done]);
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "go"], { cwd: dir, env });
      expect(run.code).toBe(0);
      const result = jsonLines(run.stdout).find((e) => e.type === "command_result");
      expect(result.changed_files).toEqual({ created: ["made.txt"], modified: [], deleted: [] });
      const runs = join(state, "aic", "runs");
      expect(existsSync(runs) ? readdirSync(runs) : []).toEqual([]);
      expect(messagesOf(srv.requests[1]).at(-1).content).toContain("Files changed: created made.txt.");
    },
  );
});
