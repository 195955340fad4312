/**
 * Checkpoint cost (README: "Checkpoints and undo"): what the snapshot aic
 * takes before each command costs, on a project of 5,000 files (100
 * directories of 50, a mix of text and random binary, 20 MB, plus 2,000
 * ignored files in node_modules/), with aic's own checkpoint code (the
 * `Checkpoints` class of aic.ts, which runs the `git` executable on a shadow
 * repository in a scratch $XDG_STATE_HOME):
 *
 * - the first snapshot of the tree (every file written once; over 2 s turns
 *   checkpoints off);
 * - the snapshot of an unchanged tree, median of 20 (target: under 30 ms);
 * - the snapshot after 10 files changed, median of 20;
 * - undo of `rm -rf` of the whole tree's largest directory, and its redo.
 */
import { mkdirSync, renameSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Checkpoints, HeldDirectory, redoCommands, undoCommands } from "../../aic.ts";
import { has, scratch } from "../helpers.ts";
import { type Benchmark, type Metric, median } from "./lib.ts";

const DIRS = 100;
const FILES_PER_DIR = 50;
const RUNS = 20;
const UNCHANGED_TARGET_MS = 30;

function makeTree(dir: string): void {
  let n = 0;
  for (let d = 0; d < DIRS; d++) {
    const sub = join(dir, "src", `m${d}`);
    mkdirSync(sub, { recursive: true });
    for (let f = 0; f < FILES_PER_DIR; f++, n++) {
      const body =
        n % 2 === 0
          ? `// module ${d}/${f}\n${"export const value = 1;\n".repeat(150)}`
          : crypto.getRandomValues(new Uint8Array(4096 + (n % 7) * 512));
      writeFileSync(join(sub, `f${f}.${n % 2 === 0 ? "ts" : "bin"}`), body);
    }
  }
  for (let i = 0; i < 2000; i++) {
    const dep = join(dir, "node_modules", `dep${i % 50}`);
    mkdirSync(dep, { recursive: true });
    writeFileSync(join(dep, `i${i}.js`), "module.exports = 1;\n");
  }
  writeFileSync(join(dir, ".gitignore"), "node_modules/\n");
}

async function timed(action: () => Promise<unknown>): Promise<number> {
  const start = performance.now();
  await action();
  return performance.now() - start;
}

export const checkpoints: Benchmark = {
  name: "checkpoints",
  description: "snapshot cost before each command: a 5,000-file tree unchanged and with 10 changed files",
  async run(ctx) {
    if (!has.git) throw new Error("git is not on PATH");
    const root = scratch("aic-bench-ckpt-");
    const dir = join(root, "proj");
    mkdirSync(dir);
    const state = process.env.XDG_STATE_HOME;
    process.env.XDG_STATE_HOME = join(root, "state");
    let project: HeldDirectory | undefined;
    try {
      ctx.log("checkpoints: writing the 5,000-file tree");
      makeTree(dir);
      const warnings: string[] = [];
      project = HeldDirectory.open(dir);
      const cp = Checkpoints.forDirectory(project, undefined, (w) => warnings.push(w));
      let call = 0;
      const snapshot = () => cp.beforeCommand(`c${call++}`, "true");
      const first = await timed(snapshot);
      if (cp.off) throw new Error(`checkpoints turned off: ${cp.off}`);
      const unchanged: number[] = [];
      for (let i = 0; i < RUNS; i++) unchanged.push(await timed(snapshot));
      const changed: number[] = [];
      for (let i = 0; i < RUNS; i++) {
        for (let f = 0; f < 10; f++) writeFileSync(join(dir, "src", `m${f * 7}`, `f${i}.ts`), `// edit ${i}\n`);
        changed.push(await timed(snapshot));
      }
      // What a command changed: the snapshot after it and the difference, unchanged and with 50 files changed.
      const listUnchanged: number[] = [];
      const list50: number[] = [];
      let listed = 0;
      for (let i = 0; i < RUNS; i++) {
        await snapshot();
        listUnchanged.push(await timed(async () => void (await cp.afterCommand(`c${call - 1}`))));
        await snapshot();
        for (let f = 0; f < 50; f++) writeFileSync(join(dir, "src", `m${f % 100}`, `g${i}-${f}.ts`), `// new ${i}\n`);
        list50.push(
          await timed(async () => {
            listed = (await cp.afterCommand(`c${call - 1}`))?.created.length ?? -1;
          }),
        );
      }
      if (listed !== 50) throw new Error(`the 50-file change was listed as ${listed} created files`);
      // Undo of "rm -rf" of one tenth of the tree, and its redo.
      await snapshot();
      renameSync(join(dir, "src", "m0"), join(root, "aside"));
      rmSync(join(root, "aside"), { recursive: true });
      const conversation = { messages: [] };
      const undoMs = await timed(() => undoCommands(cp, conversation, 1));
      const redoMs = await timed(() => redoCommands(cp, conversation));
      if (warnings.length) throw new Error(warnings.join("; "));
      const metrics: Metric[] = [
        {
          name: "first snapshot (5,000 files, 20 MB)",
          value: first,
          unit: "ms",
          note: "over 2 s turns checkpoints off",
        },
        {
          name: "snapshot, unchanged tree",
          value: median(unchanged),
          unit: "ms",
          target: UNCHANGED_TARGET_MS,
          note: `median of ${RUNS}; worst ${Math.max(...unchanged).toFixed(1)} ms`,
        },
        {
          name: "snapshot, 10 files changed",
          value: median(changed),
          unit: "ms",
          note: `median of ${RUNS}; worst ${Math.max(...changed).toFixed(1)} ms`,
        },
        {
          name: "changed files after a command, unchanged tree",
          value: median(listUnchanged),
          unit: "ms",
          note: `snapshot after the command and its difference; median of ${RUNS}`,
        },
        {
          name: "changed files after a command, 50 files created",
          value: median(list50),
          unit: "ms",
          note: `median of ${RUNS}; worst ${Math.max(...list50).toFixed(1)} ms`,
        },
        {
          name: "undo of rm -rf (50 files)",
          value: undoMs,
          unit: "ms",
          note: "snapshot of now, then the files written through descriptors",
        },
        { name: "redo of it", value: redoMs, unit: "ms" },
      ];
      return metrics;
    } finally {
      if (state === undefined) delete process.env.XDG_STATE_HOME;
      else process.env.XDG_STATE_HOME = state;
      project?.close();
      rmSync(root, { recursive: true, force: true });
    }
  },
};
