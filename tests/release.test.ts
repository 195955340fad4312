/**
 * `bun run release` (.ci/release.ts; README: "Running many tasks") where bun sits beside npm and node.
 *
 * The release's npm test installs the packages into a fresh prefix with no bun on PATH. It used to build that PATH
 * by dropping every directory holding bun, which drops npm and node with it wherever they share a directory with
 * bun — as after `npm install -g bun`, which puts bun in npm's own bin directory (/usr/bin on Debian's nodejs) — and
 * the release then failed (exit 1) at `npm install`. Now only bun leaves: such a directory is replaced by links to
 * everything else it holds.
 *
 * The last test runs the real release in exactly that layout: one directory, node_modules/.bin of a scratch
 * project, holding bun, node, npm and every other tool of this machine's PATH, and nothing else on PATH.
 * It builds the host's target only (--targets linux-x64) into a scratch --out, so dist/ is left alone.
 */
import { afterAll, describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  mkdirSync,
  readFileSync,
  readdirSync,
  realpathSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { delimiter, join } from "node:path";
import { launcherSource, pathWithoutBun } from "../.ci/release.ts";
import { ROOT, has, runCommand, scratch } from "./helpers.ts";

/** Whether `name` would be found on `path` (an executable entry in one of its directories). */
function onPath(path: string, name: string): string | undefined {
  for (const dir of path.split(delimiter)) if (dir && existsSync(join(dir, name))) return join(dir, name);
  return undefined;
}

describe("the PATH of the npm install test", () => {
  test("only bun leaves: what sits beside it stays", () => {
    const root = scratch("aic-release-path-");
    const beside = join(root, "usr-bin"); // bun installed with npm -g next to node and npm
    const other = join(root, "other");
    const plain = join(root, "plain");
    for (const dir of [beside, other, plain]) mkdirSync(dir);
    for (const [dir, name] of [
      [beside, "node"],
      [beside, "npm"],
      [beside, "sh"],
      [other, "tool"],
      [plain, "plain-tool"],
    ] as const) {
      writeFileSync(join(dir, name), "#!/bin/sh\n");
      chmodSync(join(dir, name), 0o755);
    }
    symlinkSync(process.execPath, join(beside, "bun"));
    symlinkSync(process.execPath, join(beside, "bunx"));
    symlinkSync(process.execPath, join(other, "node-is-bun")); // anything that resolves to bun is bun
    const path = [beside, "", join(root, "missing"), other, plain].join(delimiter);

    const out = pathWithoutBun(path, scratch("aic-release-shadow-"));
    for (const name of ["node", "npm", "sh", "tool", "plain-tool"]) expect(onPath(out, name)).toBeDefined();
    for (const name of ["bun", "bunx", "node-is-bun"]) expect(onPath(out, name)).toBeUndefined();
    expect(realpathSync(onPath(out, "npm")!)).toBe(realpathSync(join(beside, "npm")));
    // A directory without bun is kept as it is; the old filter's result would have lost node and npm.
    expect(out.split(delimiter)).toContain(plain);
    expect(out.split(delimiter)).toHaveLength(3);
    expect(
      onPath(
        path
          .split(delimiter)
          .filter((d) => d && !existsSync(join(d, "bun")))
          .join(delimiter),
        "npm",
      ),
    ).toBeUndefined();
  });
});

describe.skipIf(!has.node)("the npm launcher (needs node)", () => {
  const servers: { stop(force?: boolean): void }[] = [];
  afterAll(() => servers.forEach((s) => s.stop(true)));

  /** Runs the launcher of a release with no platform package installed, against a registry answering `status`. */
  async function missingPackage(status: number) {
    const seen: string[] = [];
    const registry = Bun.serve({
      port: 0,
      hostname: "127.0.0.1",
      fetch(request) {
        seen.push(new URL(request.url).pathname);
        return new Response(status === 200 ? '{"version":"0.1.0"}' : '{"error":"not found"}', { status });
      },
    });
    servers.push(registry);
    const dir = scratch("aic-launcher-");
    writeFileSync(
      join(dir, "aic.js"),
      launcherSource("0.1.0", { [`linux-${process.arch}-glibc`]: `@aic/linux-${process.arch}` }),
    );
    const run = await runCommand(["node", join(dir, "aic.js"), "--version"], {
      cwd: dir,
      env: { npm_config_registry: `http://127.0.0.1:${registry.port}/` },
    });
    return { run, seen };
  }

  test("an unpublished platform package is named as such", async () => {
    const { run, seen } = await missingPackage(404);
    expect(run.code).toBe(1);
    expect(seen).toEqual([`/@aic%2flinux-${process.arch}/0.1.0`]);
    expect(run.stderr).toContain(`@aic/linux-${process.arch}@0.1.0 is not published on the npm registry`);
    expect(run.stderr).toContain("AIC_BINARY_PATH");
  });

  test("a published one that npm left out is named as that", async () => {
    const { run } = await missingPackage(200);
    expect(run.code).toBe(1);
    expect(run.stderr).toContain("it is published, so npm left it out");
  });
});

describe.skipIf(!has.node || !has.npm || process.platform !== "linux" || process.arch !== "x64")(
  "bun run release (needs node, npm, Linux x64)",
  () => {
    test("passes where bun sits in one directory with npm and node", async () => {
      // The layout: a project's node_modules/.bin holding bun, node, npm and every other tool, the only PATH entry.
      const project = scratch("aic-release-layout-");
      const bin = join(project, "node_modules", ".bin");
      mkdirSync(bin, { recursive: true });
      symlinkSync(process.execPath, join(bin, "bun"));
      for (const dir of (process.env.PATH ?? "").split(delimiter)) {
        let names: string[] = [];
        try {
          names = readdirSync(dir);
        } catch {}
        for (const name of names) if (!existsSync(join(bin, name))) symlinkSync(join(dir, name), join(bin, name));
      }
      for (const name of ["bun", "node", "npm", "sh", "tar"]) expect(existsSync(join(bin, name))).toBe(true);

      const out = scratch("aic-release-out-");
      const manifest = join(ROOT, "dist", "release", "manifest.json");
      const mtime = () => (existsSync(manifest) ? statSync(manifest).mtimeMs : undefined);
      const before = mtime();
      const started = performance.now();
      const run = await runCommand([join(bin, "bun"), "run", "release", "--targets", "linux-x64", "--out", out], {
        cwd: ROOT,
        env: { PATH: bin },
        killAfterMs: 280_000,
      });
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      if (run.code !== 0)
        console.error(`bun run release: exit ${run.code} after ${seconds} s\n${run.stdout}\n${run.stderr}`);
      else console.log(`bun run release --targets linux-x64: ok in ${seconds} s`);
      expect(run.stdout).toContain("npm install -g test: passed");
      expect(run.stdout).toMatch(/^release: ok$/m);
      expect(run.code).toBe(0);
      const install = readFileSync(join(out, "release", "smoke-npm-install.log"), "utf8");
      expect(install).toContain("bun on PATH: none");
      expect(mtime()).toBe(before); // --out left dist/ alone
      expect(readFileSync(join(out, "release", "SHA256SUMS"), "utf8")).toContain("aic-linux-x64");
    }, 300_000);
  },
);
