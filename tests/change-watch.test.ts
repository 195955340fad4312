/**
 * The change watch (ChangeWatch in aic.ts): a checkpoint snapshot runs no git
 * at all when inotify, on every directory of the checkpoint index, saw nothing
 * since the last snapshot began. A change it missed would leave a step's
 * checkpoint without it: the step's `changed_files` (in --json's
 * command_result) would be wrong, and undo and redo would lose the change.
 * Each test here tries to make it miss one, through the compiled binary
 * against the fake server: every command_result's `changed_files` must be
 * what the command really changed, and undo and redo must put back exactly
 * the bytes, modes, links and directories that were there. A last test proves
 * the saving itself: quiet steps start no git process at all (strace).
 *
 * Between two steps the person (or a background job) may write: the fake
 * server's next reply is then held at a door (a small proxy in front of it)
 * until the test has seen the previous step's command_result and has made its
 * write, so each test waits on what it can observe, never on a fixed time.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import {
  chmodSync,
  existsSync,
  lstatSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import type { Server } from "bun";
import type { Turn } from "./fake-openai.ts";
import {
  type AicRun,
  bash,
  has,
  headless,
  jsonLines,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  startAic,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };

interface ChangedFiles {
  created: string[];
  modified: string[];
  deleted: string[];
}
/** What a step that changed nothing reports. */
const none: ChangedFiles = { created: [], modified: [], deleted: [] };
/** `changed_files` as aic reports it: each list sorted. */
const changes = (c: Partial<ChangedFiles>): ChangedFiles => ({
  created: [...(c.created ?? [])].sort(),
  modified: [...(c.modified ?? [])].sort(),
  deleted: [...(c.deleted ?? [])].sort(),
});

/** A project directory, a state home for its shadow repository, and the session file's path. */
interface Project {
  root: string;
  dir: string;
  env: Record<string, string>;
  session: string;
}

function project(sub = ""): Project {
  const root = fixtures.disposable(scratch("aic-watch-"));
  const dir = join(root, "proj", sub);
  mkdirSync(dir, { recursive: true });
  return { root, dir, env: { XDG_STATE_HOME: join(root, "state") }, session: join(dir, "s.json") };
}

/** Writes `files` (path → content) under `dir`, making their directories. */
function write(dir: string, files: Record<string, string>): void {
  for (const [rel, content] of Object.entries(files)) {
    mkdirSync(join(dir, rel, ".."), { recursive: true });
    writeFileSync(join(dir, rel), content);
  }
}

/**
 * Every entry under `dir` with its kind, bytes (hashed) and mode: files, links (as links) and directories
 * (so an empty one shows). The session's own files are left out (`skip`).
 */
function tree(dir: string, skip: (rel: string) => boolean = (r) => /^\.?s\.json/.test(r)): Record<string, string> {
  const out: Record<string, string> = {};
  const walk = (d: string, rel: string) => {
    for (const name of readdirSync(d).sort()) {
      const r = rel ? `${rel}/${name}` : name;
      if (skip(r)) continue;
      const abs = join(d, name);
      const st = lstatSync(abs);
      const mode = (st.mode & 0o7777).toString(8);
      if (st.isSymbolicLink()) out[r] = `link -> ${readlinkSync(abs)}`;
      else if (st.isDirectory()) {
        out[`${r}/`] = `dir ${mode}`;
        walk(abs, r);
      } else out[r] = `${createHash("sha256").update(readFileSync(abs)).digest("hex").slice(0, 16)} ${mode}`;
    }
  };
  walk(dir, "");
  return out;
}

/** What `tree` gives for a directory holding just `files`. */
function treeOf(files: Record<string, string>): Record<string, string> {
  const dir = fixtures.disposable(scratch("aic-watch-expected-"));
  write(dir, files);
  return tree(dir);
}

/** The command_result events of a --json run, in order; each must belong to the step of its id. */
function results(stdout: string): any[] {
  return jsonLines(stdout).filter((e) => e.type === "command_result");
}

/** A run that must have ended well, with checkpoints on all along. */
function expectClean(run: AicRun): void {
  const warnings = jsonLines(run.stdout)
    .filter((e) => e.type === "warning")
    .map((e) => e.text);
  expect({ code: run.code, stderr: run.stderr, warnings }).toEqual({ code: 0, stderr: "", warnings: [] });
}

/** Runs `commands` as one conversation's steps (ids s1, s2, …) and returns each step's `changed_files`. */
async function steps(p: Project, commands: string[], cwd = p.dir): Promise<ChangedFiles[]> {
  const srv = fixtures.serve([...commands.map((c, i) => bash(c, `s${i + 1}`)), done]);
  const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", p.session, "go"], {
    cwd,
    env: p.env,
    killAfterMs: 280_000, // a hang guard only: the 20,000-file steps take minutes on a loaded machine
  });
  expectClean(run);
  const got = results(run.stdout);
  expect(got.map((e) => e.id)).toEqual(commands.map((_, i) => `s${i + 1}`));
  return got.map((e) => e.changed_files);
}

/** `aic undo [N]` or `aic redo` for the project's session; it must succeed. */
async function undo(p: Project, ...args: string[]): Promise<string> {
  // A hang guard only: undoing 20,000 files takes minutes on a loaded machine.
  const r = await runAic([...args, "--session", p.session], { cwd: p.dir, env: p.env, killAfterMs: 280_000 });
  expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: "" });
  return r.stdout;
}

/** `aic undo N` puts the tree back exactly as `before`, and `aic redo` exactly as it was; the tree after the run. */
async function undoneAndRedone(p: Project, before: Record<string, string>, n: number): Promise<Record<string, string>> {
  const after = tree(p.dir);
  await undo(p, "undo", String(n));
  expect(tree(p.dir)).toEqual(before);
  await undo(p, "redo");
  expect(tree(p.dir)).toEqual(after);
  return after;
}

// ─── A door in front of the fake server ──────────────────────────────────────────────────────────

const proxies: Server<undefined>[] = [];
const doors: (() => void)[] = [];
afterEach(() => {
  for (const open of doors.splice(0)) open();
  for (const p of proxies.splice(0)) p.stop(true);
});

/**
 * The fake server serving `turns`, behind a proxy that holds chat request `i` (0-based) once `hold(i)` was
 * called, until `open(i)`: aic is then waiting for the model, between two steps, for as long as the test needs.
 */
function heldServer(turns: Turn[]) {
  const srv = fixtures.serve(turns);
  const upstream = srv.url.replace(/\/v1$/, "");
  const held = new Map<number, { open: () => void; opened: Promise<void> }>();
  let chats = 0;
  const proxy = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    idleTimeout: 0,
    async fetch(req) {
      const url = new URL(req.url);
      const body = req.method === "GET" || req.method === "HEAD" ? undefined : await req.arrayBuffer();
      if (req.method === "POST" && url.pathname === "/v1/chat/completions") await held.get(chats++)?.opened;
      const headers = new Headers(req.headers);
      headers.delete("host");
      headers.delete("content-length");
      return fetch(upstream + url.pathname + url.search, { method: req.method, headers, body });
    },
  });
  proxies.push(proxy);
  return {
    url: `http://127.0.0.1:${proxy.port}/v1`,
    /** How many chat requests aic has sent (held ones included). */
    arrived: () => chats,
    hold(i: number): void {
      let open!: () => void;
      const opened = new Promise<void>((resolve) => (open = resolve));
      held.set(i, { open, opened });
      doors.push(open);
    },
    open(i: number): void {
      held.get(i)?.open();
    },
  };
}

/** The command_result `changed_files` of a run's --json events, by step id. */
function changedById(events: any[]): Record<string, ChangedFiles> {
  return Object.fromEntries(events.filter((e) => e.type === "command_result").map((e) => [e.id, e.changed_files]));
}

// ─── The tests ───────────────────────────────────────────────────────────────────────────────────

describe.skipIf(!has.git)("changes the watch must not miss", () => {
  test("an edit deep in a nested subdirectory after several quiet steps is reported, undone and redone", async () => {
    const p = project();
    write(p.dir, {
      "top.txt": "top\n",
      "a/one.txt": "1\n",
      "a/b/two.txt": "2\n",
      "a/b/c/d/deep.txt": "deep\n",
      "x/y/z.txt": "z\n",
    });
    const before = tree(p.dir);
    const got = await steps(p, ["true", "true", "true", "true", "echo more >> a/b/c/d/deep.txt", "true"]);
    expect(got).toEqual([none, none, none, none, changes({ modified: ["a/b/c/d/deep.txt"] }), none]);
    expect(readFileSync(join(p.dir, "a/b/c/d/deep.txt"), "utf8")).toBe("deep\nmore\n");
    await undoneAndRedone(p, before, 2);
  });

  test("a file in a brand-new directory tree, then writes inside it in the next steps", async () => {
    const p = project();
    write(p.dir, { "keep.txt": "keep\n" });
    const before = tree(p.dir);
    const got = await steps(p, [
      "mkdir -p t/u/v && echo one > t/u/v/new.txt",
      "echo two >> t/u/v/new.txt && echo more > t/u/v/more.txt",
      "true",
      "echo three >> t/u/v/new.txt",
      // Empty directories only: the watch learns of them from the manifest, not from the index.
      "mkdir -p e/f/g",
      "echo in > e/f/g/file.txt",
      "true",
      "echo again >> e/f/g/file.txt",
    ]);
    expect(got).toEqual([
      changes({ created: ["t/u/v/new.txt"] }),
      changes({ created: ["t/u/v/more.txt"], modified: ["t/u/v/new.txt"] }),
      none,
      changes({ modified: ["t/u/v/new.txt"] }),
      changes({ created: ["e/f/g/"] }),
      // The directory is still there, no longer empty: not deleted.
      changes({ created: ["e/f/g/file.txt"] }),
      none,
      changes({ modified: ["e/f/g/file.txt"] }),
    ]);
    await undoneAndRedone(p, before, 8);
  });

  test("deleting a file and a whole directory, between quiet steps", async () => {
    const p = project();
    write(p.dir, {
      "gone.txt": "gone\n",
      "stay.txt": "stay\n",
      "dir/x.txt": "x\n",
      "dir/y.bin": "\u0000\u0001\u00ff",
      "dir/sub/z.txt": "z\n",
    });
    chmodSync(join(p.dir, "dir/x.txt"), 0o755);
    const before = tree(p.dir);
    const got = await steps(p, ["true", "rm gone.txt", "true", "rm -rf dir", "true", "echo back > stay.txt"]);
    expect(got).toEqual([
      none,
      changes({ deleted: ["gone.txt"] }),
      none,
      changes({ deleted: ["dir/sub/z.txt", "dir/x.txt", "dir/y.bin"] }),
      none,
      changes({ modified: ["stay.txt"] }),
    ]);
    await undoneAndRedone(p, before, 6);
  });

  test("a change of mode only (chmod), of the exec bit and of the other bits", async () => {
    const p = project();
    write(p.dir, { "run.sh": "#!/bin/sh\necho hi\n", "nested/data.txt": "data\n", "nested/other.txt": "o\n" });
    const before = tree(p.dir);
    const got = await steps(p, ["true", "chmod +x run.sh", "true", "chmod 600 nested/data.txt", "true"]);
    expect(got).toEqual([
      none,
      changes({ modified: ["run.sh"] }),
      none,
      changes({ modified: ["nested/data.txt"] }),
      none,
    ]);
    const after = await undoneAndRedone(p, before, 5);
    expect(after["run.sh"]).toEndWith(" 755");
    expect(after["nested/data.txt"]).toEndWith(" 600");
  });

  test("a rename across directories, and an edit of the renamed file", async () => {
    const p = project();
    write(p.dir, { "from/a.txt": "a\n", "from/left.txt": "l\n", "to/b.txt": "b\n" });
    const before = tree(p.dir);
    const got = await steps(p, [
      "true",
      "mv from/a.txt to/renamed.txt",
      "true",
      "echo edit >> to/renamed.txt",
      "mv to/renamed.txt from/back.txt",
      "true",
    ]);
    expect(got).toEqual([
      none,
      changes({ created: ["to/renamed.txt"], deleted: ["from/a.txt"] }),
      none,
      changes({ modified: ["to/renamed.txt"] }),
      changes({ created: ["from/back.txt"], deleted: ["to/renamed.txt"] }),
      none,
    ]);
    await undoneAndRedone(p, before, 6);
  });

  // Undo must take a renamed directory's new name away, as it does for a renamed file, though nothing under it changed.
  test("a directory renamed across directories is undone to the exact tree, and redone", async () => {
    const p = project();
    write(p.dir, { "pkg/f.txt": "1\n", "pkg/sub/g.txt": "g\n", "to/keep.txt": "k\n" });
    const before = tree(p.dir);
    const got = await steps(p, ["true", "mv pkg to/pkg-moved", "true"]);
    expect(got).toEqual([
      none,
      changes({ created: ["to/pkg-moved/f.txt", "to/pkg-moved/sub/g.txt"], deleted: ["pkg/f.txt", "pkg/sub/g.txt"] }),
      none,
    ]);
    await undoneAndRedone(p, before, 2);
  });

  test("a symlink replacing a directory, a write through it, and the directory made again", async () => {
    const p = project();
    write(p.dir, { "d/f.txt": "f\n", "d/g/h.txt": "h\n", "other/o.txt": "o\n" });
    const before = tree(p.dir);
    const got = await steps(p, [
      "true",
      "rm -rf d && ln -s other d",
      "true",
      "echo via-link > d/new.txt",
      "true",
      "rm d && mkdir d && echo back > d/f.txt",
      "true",
      "echo again >> d/f.txt",
    ]);
    expect(got).toEqual([
      none,
      changes({ created: ["d"], deleted: ["d/f.txt", "d/g/h.txt"] }),
      none,
      changes({ created: ["other/new.txt"] }),
      none,
      changes({ created: ["d/f.txt"], deleted: ["d"] }),
      none,
      changes({ modified: ["d/f.txt"] }),
    ]);
    await undoneAndRedone(p, before, 8);
  });

  // The person writes while aic waits for the model: the next step's checkpoint before its command holds it, so it
  // is not the command's change, and undoing the command puts the person's version back, not the older one.
  test("the person edits and creates files between two steps", async () => {
    const p = project();
    write(p.dir, { "docs/notes.txt": "original\n", "docs/deep/er/n.txt": "n\n", "code.txt": "c\n" });
    const srv = heldServer([
      bash("true", "s1"),
      bash("true", "s2"),
      bash("echo agent >> docs/notes.txt && echo agent >> docs/deep/er/n.txt", "s3"),
      done,
    ]);
    srv.hold(1); // the reply that brings s2
    const live = startAic([...headless(srv.url), "--auto-approve", "--json", "--session", p.session, "go"], {
      cwd: p.dir,
      env: p.env,
    });
    await live.waitForEvent("s1's result", (e) => e.type === "command_result" && e.id === "s1");
    await waitFor("aic to ask for the next step", () => srv.arrived() === 2);
    writeFileSync(join(p.dir, "docs/notes.txt"), "the person's\n");
    writeFileSync(join(p.dir, "docs/deep/er/n.txt"), "the person's n\n");
    writeFileSync(join(p.dir, "docs/deep/mine.txt"), "mine\n");
    srv.open(1);
    const run = await live.done;
    expectClean(run);
    expect(changedById(jsonLines(run.stdout))).toEqual({
      s1: none,
      s2: none,
      s3: changes({ modified: ["docs/deep/er/n.txt", "docs/notes.txt"] }),
    });
    const after = tree(p.dir);
    await undo(p, "undo");
    expect(readFileSync(join(p.dir, "docs/notes.txt"), "utf8")).toBe("the person's\n");
    expect(readFileSync(join(p.dir, "docs/deep/er/n.txt"), "utf8")).toBe("the person's n\n");
    expect(readFileSync(join(p.dir, "docs/deep/mine.txt"), "utf8")).toBe("mine\n");
    await undo(p, "redo");
    expect(tree(p.dir)).toEqual(after);
  });

  // A job the first step left running writes once the test lets it (a file in an ignored directory, which no
  // checkpoint sees), after that step's checkpoint and before the next step's.
  test("a background job writes a file between steps: the next step's checkpoint holds it", async () => {
    const p = project();
    write(p.dir, { ".gitignore": "ignored/\n", "ignored/.keep": "", "jobdir/keep.txt": "k\n" });
    const job =
      "(while [ ! -e ignored/go ]; do sleep 0.01; done; echo late > jobdir/late.txt; echo late2 >> jobdir/keep.txt) >/dev/null 2>&1 &";
    const srv = heldServer([bash(job, "s1"), bash("true", "s2"), bash("echo more >> jobdir/late.txt", "s3"), done]);
    srv.hold(1);
    const live = startAic([...headless(srv.url), "--auto-approve", "--json", "--session", p.session, "go"], {
      cwd: p.dir,
      env: p.env,
    });
    await live.waitForEvent("s1's result", (e) => e.type === "command_result" && e.id === "s1");
    await waitFor("aic to ask for the next step", () => srv.arrived() === 2);
    writeFileSync(join(p.dir, "ignored/go"), "");
    await waitFor(
      "the job's writes",
      () =>
        existsSync(join(p.dir, "jobdir/late.txt")) &&
        readFileSync(join(p.dir, "jobdir/keep.txt"), "utf8") === "k\nlate2\n",
    );
    srv.open(1);
    const run = await live.done;
    expectClean(run);
    expect(changedById(jsonLines(run.stdout))).toEqual({
      s1: none,
      s2: none,
      s3: changes({ modified: ["jobdir/late.txt"] }),
    });
    await undo(p, "undo");
    expect(readFileSync(join(p.dir, "jobdir/late.txt"), "utf8")).toBe("late\n");
    expect(readFileSync(join(p.dir, "jobdir/keep.txt"), "utf8")).toBe("k\nlate2\n");
    // Undoing the first step too: the job's writes came after it, so they are not its to take back.
    await undo(p, "undo");
    expect(readFileSync(join(p.dir, "jobdir/late.txt"), "utf8")).toBe("late\n");
  });

  test("writes inside an ignored directory are not reported; the watch still sees the next real change", async () => {
    const p = project();
    write(p.dir, { ".gitignore": "build/\n*.log\n", "build/out.txt": "old\n", "src/a.txt": "a\n" });
    const got = await steps(p, [
      "true",
      "echo new > build/out.txt && mkdir -p build/deep && echo x > build/deep/y.txt && echo l > src/run.log",
      "true",
      "echo b > src/b.txt",
    ]);
    expect(got).toEqual([none, none, none, changes({ created: ["src/b.txt"] })]);
    await undo(p, "undo", "4");
    expect(readFileSync(join(p.dir, "build/out.txt"), "utf8")).toBe("new\n");
    expect(readFileSync(join(p.dir, "build/deep/y.txt"), "utf8")).toBe("x\n");
    expect(existsSync(join(p.dir, "src/b.txt"))).toBe(false);
  });

  test("a change to .gitignore that un-ignores an existing file shows it as created (in the step that changed .gitignore)", async () => {
    const p = project();
    write(p.dir, { ".gitignore": "*.gen\n", "keep/x.gen": "generated\n", "keep/t.txt": "t\n" });
    const got = await steps(p, ["true", "printf '' > .gitignore", "true", "echo '*.gen' > .gitignore", "true"]);
    expect(got).toEqual([
      none,
      changes({ created: ["keep/x.gen"], modified: [".gitignore"] }),
      none,
      // Ignored again, the file is neither deleted nor changed: the checkpoints keep what they held.
      changes({ modified: [".gitignore"] }),
      none,
    ]);
  });

  // aic starts in a subdirectory of a repository: every .gitignore from the repository's top applies, and the top's
  // lies outside the start directory, where nothing is watched. The person un-ignores a file while aic waits.
  test("the repository's top .gitignore, above the start directory, un-ignores a file between steps", async () => {
    const p = project("app");
    const top = join(p.root, "proj");
    await runCommand(["git", "init", "-q", top], { env: p.env });
    write(top, { ".gitignore": "*.gen\n" });
    write(p.dir, { "x.gen": "the person's generated file\n", "a.txt": "a\n" });
    const srv = heldServer([bash("true", "s1"), bash("true", "s2"), bash("echo b > b.txt", "s3"), done]);
    srv.hold(1);
    const live = startAic([...headless(srv.url), "--auto-approve", "--json", "--session", p.session, "go"], {
      cwd: p.dir,
      env: p.env,
    });
    await live.waitForEvent("s1's result", (e) => e.type === "command_result" && e.id === "s1");
    await waitFor("aic to ask for the next step", () => srv.arrived() === 2);
    writeFileSync(join(top, ".gitignore"), "");
    srv.open(1);
    const run = await live.done;
    expectClean(run);
    // x.gen was there before s2 and s3 ran, no longer ignored: neither command created it.
    expect(changedById(jsonLines(run.stdout))).toEqual({ s1: none, s2: none, s3: changes({ created: ["b.txt"] }) });
    await undo(p, "undo");
    expect(existsSync(join(p.dir, "b.txt"))).toBe(false);
    expect(readFileSync(join(p.dir, "x.gen"), "utf8")).toBe("the person's generated file\n");
  });

  // Three events a file (create, modify, close) overflow the kernel's queue of 16,384 events many times over.
  test("20,000 files made at once in one directory are all reported, and so is the next edit there", async () => {
    const p = project();
    write(p.dir, { "bulk/seed.txt": "seed\n" });
    const names = Array.from({ length: 20_000 }, (_, i) => `bulk/f${i + 1}.txt`);
    const got = await steps(p, [
      "cd bulk && for i in $(seq 1 20000); do echo $i > f$i.txt; done",
      "true",
      "echo changed > bulk/f7.txt",
      "true",
    ]);
    expect(got[0]!.created.length).toBe(20_000);
    expect(got).toEqual([changes({ created: names }), none, changes({ modified: ["bulk/f7.txt"] }), none]);
    await undo(p, "undo", "2");
    expect(readFileSync(join(p.dir, "bulk/f7.txt"), "utf8")).toBe("7\n");
    await undo(p, "undo", "2");
    expect(readdirSync(join(p.dir, "bulk"))).toEqual(["seed.txt"]);
  }, 300_000); // 20,000 files made by a shell loop, snapshotted and undone twice: minutes on a loaded machine

  // The session file lives in a subdirectory: its writes are aic's own, whatever the directory.
  test("a session file in a subdirectory (--session sub/s.json) never shows in changed_files", async () => {
    const p = project();
    write(p.dir, { "sub/mine.txt": "mine\n", "top.txt": "t\n" });
    p.session = join(p.dir, "sub", "s.json");
    const got = await steps(p, ["true", "echo x > a.txt", "true", "echo y >> sub/mine.txt", "true"]);
    expect(got).toEqual([none, changes({ created: ["a.txt"] }), none, changes({ modified: ["sub/mine.txt"] }), none]);
  });
});

describe.skipIf(!has.git)("a directory's watch must follow the directory at its path", () => {
  // The watch is the directory's inode, not its path: renamed away, it goes on watching the old directory (now
  // under the new name), while a new directory made at the old path must be watched as well.
  test("a directory renamed away and made again at its old path: a later edit there is reported", async () => {
    const p = project();
    write(p.dir, { "pkg/f.txt": "1\n", "top.txt": "t\n" });
    const got = await steps(p, [
      "true",
      "mv pkg pkg-old && mkdir pkg && echo 2 > pkg/f.txt",
      "true",
      "echo 3 > pkg/f.txt",
      "true",
    ]);
    expect(got).toEqual([
      none,
      changes({ created: ["pkg-old/f.txt"], modified: ["pkg/f.txt"] }),
      none,
      changes({ modified: ["pkg/f.txt"] }),
      none,
    ]);
    // Undoing the edit (and the quiet step after it) puts back the version the command overwrote, and nothing else.
    await undo(p, "undo", "2");
    expect(tree(p.dir)).toEqual(treeOf({ "pkg/f.txt": "2\n", "pkg-old/f.txt": "1\n", "top.txt": "t\n" }));
  });

  // rm -rf of 20,000 files overflows the queue, and the kernel's "watch removed" event for the directory is lost
  // with the rest: the directory made again in its place must still be watched.
  test("a directory of 20,000 files removed and made again: a later edit there is reported", async () => {
    const p = project();
    write(p.dir, { "bulk/seed.txt": "seed\n" });
    const names = Array.from({ length: 20_000 }, (_, i) => `bulk/f${i + 1}.txt`);
    const got = await steps(p, [
      "cd bulk && for i in $(seq 1 20000); do echo $i > f$i.txt; done",
      "rm -rf bulk && mkdir bulk && echo only > bulk/only.txt",
      "true",
      "echo again >> bulk/only.txt",
      "true",
    ]);
    expect(got).toEqual([
      changes({ created: names }),
      changes({ created: ["bulk/only.txt"], deleted: [...names, "bulk/seed.txt"] }),
      none,
      changes({ modified: ["bulk/only.txt"] }),
      none,
    ]);
    await undo(p, "undo", "2");
    expect(tree(p.dir)).toEqual(treeOf({ "bulk/only.txt": "only\n" }));
  }, 300_000); // as above: 20,000 files made by a shell loop

  // A job whose working directory is the directory keeps it alive after rm -rf: the kernel says the watch is gone
  // only when the job lets go of it, long after a new directory was made at the path.
  test("a directory a background job works in, removed and made again: a later edit there is reported", async () => {
    const p = project();
    write(p.dir, { "site/index.html": "1\n", "top.txt": "t\n" });
    const got = await steps(p, [
      "(cd site && exec sleep 600) >/dev/null 2>&1 &",
      "rm -rf site && mkdir site && echo 2 > site/index.html",
      "true",
      "echo 3 > site/index.html",
      "true",
    ]);
    expect(got).toEqual([
      none,
      changes({ modified: ["site/index.html"] }),
      none,
      changes({ modified: ["site/index.html"] }),
      none,
    ]);
    await undo(p, "undo", "2");
    expect(tree(p.dir)).toEqual(treeOf({ "site/index.html": "2\n", "top.txt": "t\n" }));
  });
});

describe.skipIf(!has.git)("directories the manifest stops looking into", () => {
  // The search for empty directories stops at 1,000 of them: a directory after those (z/, listed after a/) must
  // still be watched.
  test("1,000 empty directories, then a file written into one more empty directory after them", async () => {
    const p = project();
    write(p.dir, { "top.txt": "t\n" });
    const got = await steps(p, [
      "mkdir a && (cd a && mkdir $(seq -f d%04g 1 1000)) && mkdir z",
      "true",
      "echo x > z/f.txt",
      "true",
    ]);
    expect(got[0]!.created).toContain("a/d1000/");
    expect(got.slice(1)).toEqual([none, changes({ created: ["z/f.txt"] }), none]);
    // (The empty directory itself is past what the manifest records: undo may take it too.)
    await undo(p, "undo", "2");
    expect(existsSync(join(p.dir, "z/f.txt"))).toBe(false);
  });

  // The search also stops 32 directories down.
  test("a chain of 40 empty directories, then a file written at its bottom", async () => {
    const p = project();
    write(p.dir, { "top.txt": "t\n" });
    const chain = Array.from({ length: 40 }, (_, i) => `l${i}`).join("/");
    const got = await steps(p, [`mkdir -p ${chain}`, "true", `echo x > ${chain}/f.txt`, "true"]);
    expect(got.slice(1)).toEqual([none, changes({ created: [`${chain}/f.txt`] }), none]);
    await undo(p, "undo", "2");
    expect(existsSync(join(p.dir, chain, "f.txt"))).toBe(false);
  });
});

describe.skipIf(!has.git)("what the watch saves", () => {
  // strace follows every process aic starts (stopping them at execve only); `true` is bash's builtin, so a quiet step
  // execs only bash.
  test.skipIf(!has.strace)(
    "10 quiet steps in a 2,000-file repository start no git after the second step (needs strace)",
    async () => {
      const p = project();
      await runCommand(["git", "init", "-q", p.dir], { env: p.env });
      const files: Record<string, string> = { ".gitignore": "node_modules/\n" };
      for (let d = 0; d < 40; d++)
        for (let f = 0; f < 50; f++) files[`src/m${d}/f${f}.ts`] = `export const v = ${f};\n`;
      write(p.dir, files);
      // A first run, untraced, makes the store: the traced run's first snapshot is then one `git add`, well inside the
      // first snapshot's time limit even under strace.
      expect(await steps(p, ["true"])).toEqual([none]);
      const commands = Array.from({ length: 10 }, (_, i) => `true step-${i + 1}`);
      const srv = fixtures.serve([...commands.map((c, i) => bash(c, `s${i + 1}`)), done]);
      const trace = join(p.root, "trace.txt");
      const live = startAic([...headless(srv.url), "--auto-approve", "--json", "--session", p.session, "go"], {
        cwd: p.dir,
        env: p.env,
        prefix: ["strace", "-f", "--seccomp-bpf", "-qq", "-s", "65536", "-e", "trace=execve", "-o", trace],
      });
      const run = await live.done;
      expectClean(run);
      expect(results(run.stdout).map((e) => e.changed_files)).toEqual(commands.map(() => none));
      const execs = readFileSync(trace, "utf8")
        .split("\n")
        .filter((l) => /\bexecve\("/.test(l) && !/= -1 /.test(l));
      const stepAt = (n: number) => execs.findIndex((l) => l.includes(`true step-${n}"]`));
      const isGit = (l: string) => /\bexecve\("[^"]*\/git"/.test(l);
      // Sanity: the trace sees the steps and the git of the first snapshots.
      expect(commands.map((_, i) => stepAt(i + 1) >= 0)).toEqual(commands.map(() => true));
      expect(execs.slice(0, stepAt(1)).some(isGit)).toBe(true);
      expect(execs.slice(stepAt(3)).filter(isGit)).toEqual([]);
    },
  );
});
