/**
 * `bun .ci/release.ts` — builds aic's release artifacts: one single-file executable per platform,
 * their sha256 checksums, smoke tests of each, and the npm packages that install them.
 *
 *   bun .ci/release.ts [--targets linux-x64,linux-arm64,linux-x64-musl] [--no-smoke] [--no-npm] [--strict] [--out DIR]
 *
 * Writes
 *   dist/release/aic-<target>            the executables (Bun `--compile --target`), each with <file>.sha256
 *   dist/release/SHA256SUMS               every artifact, for `sha256sum -c`
 *   dist/release/manifest.json            sizes, checksums, build times, smoke results
 *   dist/release/smoke-<target>.log       what each smoke test ran and printed
 *   dist/npm/<package>/                   the npm package directories (esbuild/biome/opencode layout)
 *   dist/release/npm/*.tgz                `npm pack` of each, installed into a fresh prefix as a test
 *
 * (--out DIR writes DIR/release and DIR/npm instead of dist/release and dist/npm.)
 *
 * Nothing else is written: npm's cache and logs go to node_modules/.cache/aic-release/npm (never
 * ~/.npm), a target whose OpenTUI library must be fetched is built from a staged copy in
 * dist/.stage-<target>/ (node_modules/ is never written to), and the smoke tests run in a scratch
 * directory under $TMPDIR that is removed at the end (on Ctrl-C too).
 *
 * Network: only the npm registry, through `npm pack` (Bun's runtimes for the other platforms and
 * OpenTUI's native libraries). Debian tools the smoke tests use are looked for, never installed:
 *   apt-get install qemu-user-static libc6-arm64-cross   (linux-arm64: qemu-user, no binfmt_misc needed)
 *   apt-get install musl musl-tools                      (linux-x64-musl: musl's loader, musl-gcc)
 * A smoke test whose tools are missing is reported as skipped (a failure with --strict).
 *
 * --strict also fails the release when a target is built without its OpenTUI native library (the
 * registry has no @opentui/core-<platform> at @opentui/core's version): such a binary runs every
 * --nogui task but its TUI stops at start with "cannot start the terminal UI … use --nogui".
 */
import { createHash } from "node:crypto";
import {
  chmodSync,
  closeSync,
  openSync,
  readSync,
  copyFileSync,
  existsSync,
  linkSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readdirSync,
  realpathSync,
  rmSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { basename, delimiter, join, resolve } from "node:path";
import { startFakeServer } from "../tests/fake-openai.ts";

const ROOT = resolve(import.meta.dir, "..");
/** npm tarballs of Bun runtimes and OpenTUI libraries, kept between runs (node_modules/ is not committed). */
const CACHE = join(ROOT, "node_modules/.cache/aic-release");

// ---------------------------------------------------------------------------------------------
// npm names. `aic` is the package users install; the binaries live in one package per platform
// under a scope, as esbuild (@esbuild/linux-x64) and biome (@biomejs/cli-linux-x64) do: only the
// scope's owner can publish under it, so nobody can squat a platform name we add later (unscoped
// opencode-linux-x64-style names must each be claimed, and a look-alike could be published first).
// It needs the npm organisation "aic"; if that is taken, change PLATFORM_SCOPE (e.g. "@aic-cli").

const MAIN_PACKAGE = "aic";
const PLATFORM_SCOPE = "@aic";

interface Target {
  /** Bun's --target. */
  bun: string;
  /** The npm package holding that Bun runtime (the executable --compile copies and appends the bundle to). */
  runtimePackage: string;
  /** OpenTUI's native library for this platform; every other platform's is left out of the bundle. */
  opentui: string;
  os: "linux";
  cpu: "x64" | "arm64";
  libc: "glibc" | "musl";
  /** ELF e_machine of the result (62 x86-64, 183 AArch64), checked before anything runs it. */
  elfMachine: number;
  /** The ELF interpreter the result must ask for. */
  interpreter: string;
}

const TARGETS: Record<string, Target> = {
  "linux-x64": {
    bun: "bun-linux-x64",
    runtimePackage: "@oven/bun-linux-x64",
    opentui: "@opentui/core-linux-x64",
    os: "linux",
    cpu: "x64",
    libc: "glibc",
    elfMachine: 62,
    interpreter: "/lib64/ld-linux-x86-64.so.2",
  },
  "linux-arm64": {
    bun: "bun-linux-arm64",
    runtimePackage: "@oven/bun-linux-aarch64",
    opentui: "@opentui/core-linux-arm64",
    os: "linux",
    cpu: "arm64",
    libc: "glibc",
    elfMachine: 183,
    interpreter: "/lib/ld-linux-aarch64.so.1",
  },
  "linux-x64-musl": {
    bun: "bun-linux-x64-musl",
    runtimePackage: "@oven/bun-linux-x64-musl",
    opentui: "@opentui/core-linux-x64-musl",
    os: "linux",
    cpu: "x64",
    libc: "musl",
    elfMachine: 62,
    interpreter: "/lib/ld-musl-x86_64.so.1",
  },
};

/** Every Linux native package @opentui/core may import; a build keeps at most its own. */
const OPENTUI_LINUX = [
  "@opentui/core-linux-x64",
  "@opentui/core-linux-x64-musl",
  "@opentui/core-linux-arm64",
  "@opentui/core-linux-arm64-musl",
];

// ---------------------------------------------------------------------------------------------
// Small helpers

/** Run as a script (`bun .ci/release.ts`), not imported (tests/release.test.ts imports pathWithoutBun). */
const MAIN = import.meta.main;
const args = MAIN ? process.argv.slice(2) : [];
const flag = (name: string) => args.includes(name);
const option = (name: string) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const USAGE = `usage: bun .ci/release.ts [--targets ${"linux-x64,linux-arm64,linux-x64-musl"}] [--no-smoke] [--no-npm] [--strict] [--out DIR]

Builds dist/release/aic-<target> (+ .sha256, SHA256SUMS, manifest.json), smoke-tests each binary
(arm64 under qemu-user, musl under its loader) against tests/fake-openai.ts, writes the npm packages
to dist/npm/ and tests \`npm install -g\` of them into a fresh prefix without Bun on PATH.

  --targets LIST   comma-separated subset of the targets (default: all)
  --no-smoke       build only, run nothing
  --no-npm         no npm packages, no install test
  --strict         a skipped smoke test or a target without its TUI library fails the release
  --out DIR        write DIR/release and DIR/npm (default: dist/)
  --help, -h       this text`;
{
  const known = new Set(["--no-smoke", "--no-npm", "--strict", "--help", "-h"]);
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === "--help" || a === "-h") {
      console.log(USAGE);
      process.exit(0);
    }
    if (a === "--targets" || a === "--out") {
      if (args[i + 1] === undefined || args[i + 1]!.startsWith("-")) {
        console.error(
          a === "--out"
            ? "release: --out needs a directory"
            : "release: --targets needs a comma-separated list of targets",
        );
        process.exit(2);
      }
      i++;
    } else if (!known.has(a)) {
      console.error(`release: unknown argument ${a} (see --help)`);
      process.exit(2);
    }
  }
}
const STRICT = flag("--strict");
/** Where the artifacts go: dist/ by default; --out DIR for a run that must leave dist/ alone. */
const OUT = resolve(option("--out") ?? join(ROOT, "dist"));
const RELEASE = join(OUT, "release");
const NPM_OUT = join(OUT, "npm");
const problems: string[] = []; // failures: the script exits 1
const warnings: string[] = []; // failures only with --strict

const log = (line: string) => console.log(line);
const mib = (bytes: number) =>
  bytes < 1024 * 1024 ? `${(bytes / 1024).toFixed(1)} KiB` : `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

function run(argv: string[], opts: { cwd?: string; env?: Record<string, string | undefined> } = {}) {
  const r = Bun.spawnSync(argv, {
    cwd: opts.cwd ?? ROOT,
    env: opts.env ?? process.env,
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: r.exitCode, stdout: r.stdout.toString(), stderr: r.stderr.toString() };
}

function mustRun(argv: string[], opts: { cwd?: string; env?: Record<string, string | undefined> } = {}) {
  const r = run(argv, opts);
  if (r.code !== 0) throw new Error(`${argv.join(" ")} exited ${r.code}\n${r.stderr}${r.stdout}`);
  return r;
}

/** The first of `names` on PATH. */
function which(...names: string[]): string | undefined {
  for (const name of names)
    for (const dir of (process.env.PATH ?? "").split(delimiter)) {
      const p = join(dir, name);
      if (dir && existsSync(p)) return p;
    }
  return undefined;
}

function sha256(file: string): string {
  return createHash("sha256").update(readFileSync(file)).digest("hex");
}

const readJson = (file: string) => JSON.parse(readFileSync(file, "utf8"));

/**
 * The environment every npm this script runs gets: its cache and logs in CACHE/npm (never the
 * developer's ~/.npm), no update check, no audit, no funding notes.
 */
function npmEnv(base: Record<string, string | undefined> = process.env): Record<string, string | undefined> {
  return {
    ...base,
    npm_config_cache: join(CACHE, "npm"),
    npm_config_update_notifier: "false",
    npm_config_audit: "false",
    npm_config_fund: "false",
  };
}

/**
 * `npm pack NAME@VERSION` into the cache and unpacks it; the package directory, or undefined when the
 * registry has no such version (npm's ETARGET / E404). Any other npm failure (network) is thrown.
 */
function fetchPackage(name: string, version: string): string | undefined {
  const dir = join(CACHE, `${name.replace("/", "+")}@${version}`);
  if (existsSync(join(dir, "package/package.json"))) return join(dir, "package");
  mkdirSync(dir, { recursive: true });
  const r = run(["npm", "pack", `${name}@${version}`, "--json", "--pack-destination", dir], {
    cwd: dir,
    env: npmEnv(),
  });
  if (r.code !== 0) {
    rmSync(dir, { recursive: true, force: true });
    if (/ETARGET|E404|No matching version/.test(r.stderr)) return undefined;
    throw new Error(`npm pack ${name}@${version} failed:\n${r.stderr}`);
  }
  const tarball = join(dir, JSON.parse(r.stdout)[0].filename);
  mustRun(["tar", "-xzf", tarball, "-C", dir]);
  rmSync(tarball);
  return join(dir, "package");
}

/** Linux ELF facts read from the header: the machine, and the interpreter named in the first page. */
function elfInfo(file: string): { machine: number; interpreter: string | undefined } {
  const head = Buffer.alloc(8192);
  const fd = openSync(file, "r");
  readSync(fd, head, 0, head.length, 0);
  closeSync(fd);
  if (head.readUInt32BE(0) !== 0x7f454c46) throw new Error(`${file} is not an ELF file`);
  const interp = /\/lib[\w/.-]*\/ld-[\w.-]+\.so\.\d/.exec(head.toString("latin1"))?.[0];
  return { machine: head.readUInt16LE(18), interpreter: interp };
}

// ---------------------------------------------------------------------------------------------
// Build flags: package.json's "build" script is the one source of truth for how aic is bundled
// (minify, bytecode, splitting, no bunfig/.env autoload, the OpenTUI packages of other OSes left
// out); only the target, the runtime, the Linux OpenTUI externals and the output change here.

function buildFlagsFromPackageJson(): { entry: string; flags: string[]; externals: string[] } {
  const script: string = readJson(join(ROOT, "package.json")).scripts.build;
  const command = script.split("&&")[0]!;
  const tokens = [...command.matchAll(/'([^']*)'|"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2] ?? m[3]!);
  if (tokens[0] !== "bun" || tokens[1] !== "build" || !tokens[2]?.endsWith(".ts"))
    throw new Error(`package.json's build script no longer starts with "bun build <entry>.ts": ${script}`);
  const flags: string[] = [];
  const externals: string[] = [];
  for (let i = 3; i < tokens.length; i++) {
    const t = tokens[i]!;
    if (t === "--external") externals.push(tokens[++i]!);
    else if (t.startsWith("--external=")) externals.push(t.slice("--external=".length));
    else if (t === "--outfile") i++;
    else if (t.startsWith("--outfile=") || t.startsWith("--target")) continue;
    else flags.push(t);
  }
  if (!flags.includes("--compile")) throw new Error("package.json's build script has no --compile");
  // The Linux native libraries are chosen per target below.
  return { entry: tokens[2], flags, externals: externals.filter((e) => !e.startsWith("@opentui/core-linux-")) };
}

// ---------------------------------------------------------------------------------------------
// Building one target

interface Built {
  target: string;
  file: string;
  bytes: number;
  sha256: string;
  buildMs: number;
  /** Which OpenTUI native library is inside, or null (TUI unavailable, --nogui only). */
  tui: string | null;
  smoke?: { status: "passed" | "failed" | "skipped"; detail: string };
}

/**
 * Where a target whose OpenTUI library is not in node_modules is built from: dist/.stage-<target>/
 * holds a copy of aic.ts and of node_modules/@opentui/core with the fetched library beside it, so
 * the bundler resolves @opentui/core (and from it the library) there and every other package up in
 * the project's node_modules, which this script never writes to. Removed right after the build.
 */
const stages = new Set<string>();
function removeStages() {
  for (const dir of stages) rmSync(dir, { recursive: true, force: true });
  stages.clear();
}
/** The scratch directory of this run (set in main), removed on Ctrl-C too. */
let scratchDir: string | undefined;
if (MAIN)
  process.on("SIGINT", () => {
    removeStages();
    if (scratchDir) rmSync(scratchDir, { recursive: true, force: true });
    process.exit(130);
  });

function stageFor(name: string, entry: string, nativePackage: string, nativeDir: string): string {
  const stage = join(ROOT, "dist", `.stage-${name}`);
  rmSync(stage, { recursive: true, force: true });
  stages.add(stage);
  mkdirSync(join(stage, "node_modules/@opentui"), { recursive: true });
  copyFileSync(join(ROOT, entry), join(stage, basename(entry)));
  mustRun(["cp", "-a", join(ROOT, "node_modules/@opentui/core"), join(stage, "node_modules/@opentui/core")]);
  mustRun(["cp", "-a", nativeDir, join(stage, "node_modules", nativePackage)]);
  return join(stage, basename(entry));
}

function buildTarget(name: string, t: Target, base: ReturnType<typeof buildFlagsFromPackageJson>): Built {
  const bunVersion = Bun.version;
  const coreVersion: string = readJson(join(ROOT, "node_modules/@opentui/core/package.json")).version;
  const host = process.platform === t.os && process.arch === t.cpu && t.libc === "glibc" && !isMuslHost();

  // 1. The Bun runtime of the target. Without --compile-executable-path Bun downloads it from
  //    GitHub at build time, which fails offline; the same executable is published on npm as
  //    @oven/bun-<os>-<arch>[-musl], at exactly this Bun's version (the bytecode and the bundle are
  //    made by this Bun, so the runtime must match it). The host's own target needs none: Bun
  //    copies itself, as `bun run build` does.
  let runtime: string | undefined;
  if (!host) {
    const pkg = fetchPackage(t.runtimePackage, bunVersion);
    if (!pkg) throw new Error(`the npm registry has no ${t.runtimePackage}@${bunVersion}`);
    runtime = join(pkg, "bin/bun");
    chmodSync(runtime, 0o755);
  }

  // 2. OpenTUI's native library: @opentui/core imports @opentui/core-<platform> at run time, and
  //    bun build embeds the one it finds in node_modules. It must be @opentui/core's own version
  //    (the FFI symbol set changes between releases: 0.5.x lacks ~340 of 0.8.1's symbols).
  let tui: string | null = null;
  let entry = base.entry;
  const installed = join(ROOT, "node_modules", t.opentui);
  if (existsSync(join(installed, "package.json"))) {
    const v = readJson(join(installed, "package.json")).version;
    if (v !== coreVersion) throw new Error(`node_modules/${t.opentui} is ${v}, @opentui/core is ${coreVersion}`);
    tui = `${t.opentui}@${v}`;
  } else {
    const pkg = fetchPackage(t.opentui, coreVersion);
    if (pkg) {
      entry = stageFor(name, base.entry, t.opentui, pkg);
      tui = `${t.opentui}@${coreVersion}`;
    } else {
      warnings.push(
        `${name}: the npm registry has no ${t.opentui}@${coreVersion}; built without the TUI (--nogui works, the TUI says "use --nogui")`,
      );
    }
  }
  const externals = [...base.externals, ...OPENTUI_LINUX.filter((p) => p !== t.opentui || !tui)];

  const file = join(RELEASE, `aic-${name}`);
  const argv = [
    process.execPath,
    "build",
    entry,
    ...base.flags,
    `--target=${t.bun}`,
    ...(runtime ? [`--compile-executable-path=${runtime}`] : []),
    // OpenTUI picks its musl library only when OPENTUI_LIBC=musl at run time; a musl build has no
    // glibc one to fall back to, so the choice is fixed when bundling.
    ...(t.libc === "musl" ? ["--define", 'process.env.OPENTUI_LIBC="musl"'] : []),
    ...externals.flatMap((e) => ["--external", e]),
    "--outfile",
    `${file}.new`,
  ];
  const started = performance.now();
  try {
    mustRun(argv);
  } finally {
    removeStages();
  }
  const buildMs = performance.now() - started;
  mustRun(["mv", `${file}.new`, file]);

  const elf = elfInfo(file);
  if (elf.machine !== t.elfMachine || elf.interpreter !== t.interpreter)
    throw new Error(
      `${file}: ELF machine ${elf.machine}, interpreter ${elf.interpreter}; expected ${t.elfMachine}, ${t.interpreter}`,
    );
  const bytes = statSync(file).size;
  const digest = sha256(file);
  writeFileSync(`${file}.sha256`, `${digest}  ${basename(file)}\n`);
  return { target: name, file, bytes, sha256: digest, buildMs, tui };
}

function isMuslHost(): boolean {
  // The Bun running this script: its own interpreter tells which libc it was built for.
  return elfInfo(process.execPath).interpreter?.includes("ld-musl") ?? false;
}

// ---------------------------------------------------------------------------------------------
// Smoke tests: `aic --version`, then one short task against tests/fake-openai.ts on 127.0.0.1:
// the model asks for one execute_bash call, then says TASKCOMPLETE. The binary has to bundle,
// start, reach the server, stream, run a command on its PTY and report it back.

/**
 * glibc's C++ runtime standing in for Alpine's libstdc++/libgcc, which Bun's musl build links and
 * Debian does not package for musl (nor can an Alpine root filesystem be had here: only npm and
 * Debian's archive are reachable). musl's loader ignores symbol versions, so glibc's libstdc++.so.6
 * and libgcc_s.so.1 load under it once these few glibc-only symbols exist. The shim is named after
 * glibc's loader, which both of them list as needed, so LD_LIBRARY_PATH alone brings it in; glibc
 * programs the task starts (bash) never load it, as their loader already has that name.
 * Everything else — libc, pthreads, dlopen (Landlock's syscalls through libc.so.6, which musl maps
 * to itself), the PTY — is musl.
 */
const MUSL_SHIM_C = `
#include <locale.h>
#include <fcntl.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
char __libc_single_threaded = 0;
uint32_t arc4random(void) { uint32_t v = 0; int fd = open("/dev/urandom", O_RDONLY); if (fd >= 0) { if (read(fd, &v, 4) != 4) v = 0; close(fd); } return v; }
size_t __strftime_l(char *s, size_t n, const char *f, const struct tm *tm, locale_t l) { return strftime_l(s, n, f, tm, l); }
extern int __cxa_atexit(void (*)(void *), void *, void *);
int __cxa_thread_atexit_impl(void (*fn)(void *), void *obj, void *dso) { return __cxa_atexit(fn, obj, dso); }
int _dl_find_object(void *pc, void *result) { (void)pc; (void)result; return -1; }
struct { unsigned vendor, type, subtype, features[1]; } __cpu_model;
int __cpu_indicator_init(void) { return 0; }
`;

interface Runner {
  prefix: string[];
  env: Record<string, string>;
  note: string;
}

/** How to run a target's binary on this x86-64 Debian machine, or why it cannot be. */
function runnerFor(name: string, t: Target, scratch: string): Runner | string {
  if (process.arch === "x64" && t.cpu === "x64" && t.libc === "glibc") return { prefix: [], env: {}, note: "native" };
  if (t.cpu === "arm64" && t.libc === "glibc") {
    if (process.arch === "arm64") return { prefix: [], env: {}, note: "native" };
    const qemu = which("qemu-aarch64-static", "qemu-aarch64");
    const sysroot = "/usr/aarch64-linux-gnu"; // Debian's libc6-arm64-cross
    if (!qemu || !existsSync(join(sysroot, "lib/ld-linux-aarch64.so.1")))
      return "needs qemu-aarch64 and an arm64 glibc: apt-get install qemu-user-static libc6-arm64-cross";
    // -L: qemu looks up the binary's interpreter and libraries under the sysroot, so no binfmt_misc
    // and no arm64 libc in / are needed. Commands the task runs are this machine's x86-64 bash.
    // qemu-user (7.2) has no Landlock syscalls: aic finds none and runs with "Sandbox: off", by
    // itself (no --disable-sandbox needed); Bun's PTY works under it.
    return { prefix: [qemu, "-L", sysroot], env: {}, note: `${basename(qemu)} -L ${sysroot}` };
  }
  if (t.cpu === "x64" && t.libc === "musl" && process.arch === "x64") {
    const cc = which("musl-gcc");
    if (!existsSync(t.interpreter) || !cc)
      return `needs ${t.interpreter} and musl-gcc: apt-get install musl musl-tools`;
    const cxx = ["/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/lib/x86_64-linux-gnu/libgcc_s.so.1"];
    if (!cxx.every(existsSync)) return "needs glibc's libstdc++6 and libgcc-s1";
    const dir = join(scratch, `musl-cxx-${name}`);
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, "shim.c"), MUSL_SHIM_C);
    const so = join(dir, "ld-linux-x86-64.so.2");
    mustRun([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,ld-linux-x86-64.so.2", "-o", so, join(dir, "shim.c")]);
    for (const lib of cxx) mustRun(["ln", "-sf", lib, join(dir, basename(lib))]);
    return {
      prefix: [],
      env: { LD_LIBRARY_PATH: dir },
      note: `${t.interpreter} (Debian's musl) with glibc's libstdc++ via LD_LIBRARY_PATH=${dir}`,
    };
  }
  return `no way to run ${name} on ${process.platform}-${process.arch}`;
}

/** Environment for a run: none of the developer's model settings, state kept in the scratch dir. */
function cleanEnv(scratch: string, extra: Record<string, string>): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env))
    if (v !== undefined && !/^(AIC_|OPENAI_|LD_|XDG_STATE_HOME$)/.test(k)) env[k] = v;
  return { ...env, XDG_STATE_HOME: join(scratch, "state"), NO_COLOR: "1", ...extra };
}

/** Starts `argv`; `done` resolves with what it printed once it has exited (killed after `timeoutMs`). */
function start(argv: string[], env: Record<string, string>, cwd: string, timeoutMs: number) {
  const started = performance.now();
  const proc = Bun.spawn(argv, { cwd, env, stdin: "ignore", stdout: "pipe", stderr: "pipe" });
  const timer = setTimeout(() => proc.kill("SIGKILL"), timeoutMs);
  const done = Promise.all([new Response(proc.stdout).text(), new Response(proc.stderr).text(), proc.exited]).then(
    ([stdout, stderr, code]) => {
      clearTimeout(timer);
      return { code, stdout, stderr, ms: performance.now() - started };
    },
  );
  return { pid: proc.pid, done };
}

/** The smoke test proper, for any way of starting aic (`launch`: the argv before aic's own arguments). */
async function smokeTask(
  launch: string[],
  env: Record<string, string>,
  scratch: string,
  version: string,
  /** The libc the aic process must have mapped (a musl build that fell back to glibc fails). */
  libc: "glibc" | "musl",
) {
  const lines: string[] = [];
  const versionRun = await start([...launch, "--version"], env, scratch, 60_000).done;
  lines.push(`$ ${[...launch, "--version"].join(" ")}   # ${Math.round(versionRun.ms)} ms, exit ${versionRun.code}`);
  lines.push(versionRun.stdout.trimEnd(), versionRun.stderr.trimEnd());
  if (versionRun.code !== 0 || versionRun.stdout !== `aic ${version}\n`)
    return { ok: false, lines, why: `--version printed ${JSON.stringify(versionRun.stdout)}, exit ${versionRun.code}` };

  const marker = "smoke-$((6*7))"; // the shell must expand it: proof the command really ran
  let pid = 0;
  let libcSeen = "";
  const srv = startFakeServer({
    turns: [
      { toolCalls: [{ id: "call_smoke", arguments: JSON.stringify({ command: `echo ${marker} && uname -sm` }) }] },
      { content: "The command ran. TASKCOMPLETE" },
    ],
    // While aic waits for the model it is alive: note which libc its process has mapped.
    onRequest: () => {
      try {
        const maps = readFileSync(`/proc/${pid}/maps`, "utf8");
        libcSeen = /ld-musl|linux-musl\/libc\.so/.test(maps) ? "musl" : /libc\.so\.6/.test(maps) ? "glibc" : "?";
      } catch {}
    },
  });
  try {
    const argv = [...launch, "--nogui", "--auto-approve", "--no-session", "--api-base", srv.url, "--model", "smoke"];
    const cwd = mkdtempSync(join(scratch, "task-"));
    const proc = start([...argv, "Print the smoke marker."], env, cwd, 120_000);
    pid = proc.pid;
    const task = await proc.done;
    lines.push(`$ ${argv.join(" ")} "Print the smoke marker."   # ${Math.round(task.ms)} ms, exit ${task.code}`);
    lines.push(task.stdout.trimEnd(), task.stderr.trimEnd());
    const tool = srv.requests.at(-1)?.body?.messages?.find((m: any) => m.role === "tool");
    const answer = String(tool?.content ?? "");
    lines.push(`--- tool result the model got:\n${answer}`);
    if (libcSeen) lines.push(`--- libc mapped by the aic process: ${libcSeen}`);
    const ok = task.code === 0 && srv.requests.length === 2 && answer.includes("smoke-42") && libcSeen === libc;
    const sandbox = /^Sandbox: .*$/m.exec(task.stderr)?.[0] ?? "";
    return {
      ok,
      lines,
      why: ok
        ? `${Math.round(task.ms)} ms; ${sandbox.slice(0, 60)}`
        : `exit ${task.code}, ${srv.requests.length} model requests, libc ${libcSeen || "not seen"} (want ${libc}), tool result ${JSON.stringify(answer.slice(0, 200))}`,
    };
  } finally {
    srv.close();
  }
}

async function smoke(b: Built, t: Target, version: string, scratch: string): Promise<Built["smoke"]> {
  const runner = runnerFor(b.target, t, scratch);
  if (typeof runner === "string") return { status: "skipped", detail: runner };
  const env = cleanEnv(scratch, runner.env);
  const result = await smokeTask([...runner.prefix, b.file], env, scratch, version, t.libc);
  writeFileSync(
    join(RELEASE, `smoke-${b.target}.log`),
    `# ${b.target} via ${runner.note}\n${result.lines.join("\n")}\n`,
  );
  return { status: result.ok ? "passed" : "failed", detail: `${runner.note}: ${result.why}` };
}

// ---------------------------------------------------------------------------------------------
// npm packages. `aic` holds only bin/aic.js and lists every platform package as an optional
// dependency pinned to the same version; each platform package says in "os"/"cpu"/"libc" where
// it fits, so npm (and pnpm, yarn) install the one matching package and skip the rest. The
// launcher then finds that package's binary and runs it: node is all it needs, not Bun.

export function launcherSource(version: string, platforms: Record<string, string>): string {
  return `#!/usr/bin/env node
// aic ${version}: npm's entry point for the aic executable. npm installed, of the optional
// dependencies in package.json, the one package whose os/cpu/libc fit this machine; this finds its
// binary and runs it in this process's place. It needs node only, not Bun.
"use strict";
const fs = require("fs");
const path = require("path");

const PACKAGES = ${JSON.stringify(platforms, null, 2)};
const VERSION = ${JSON.stringify(version)};

// Which libc this machine's programs use: node's own ELF interpreter tells (ld-musl-* on Alpine and
// other musl systems, ld-linux-* on glibc ones). A static node says nothing there; its report does.
function libc() {
  try {
    const head = Buffer.alloc(8192);
    const fd = fs.openSync(process.execPath, "r");
    fs.readSync(fd, head, 0, head.length, 0);
    fs.closeSync(fd);
    const text = head.toString("latin1");
    if (text.includes("/ld-musl-")) return "musl";
    if (text.includes("/ld-linux")) return "glibc";
  } catch {}
  try {
    return process.report.getReport().header.glibcVersionRuntime ? "glibc" : "musl";
  } catch {}
  return fs.existsSync("/etc/alpine-release") ? "musl" : "glibc";
}

// The binary this machine's platform package holds; or, when that package is not installed, which one it is.
function binary() {
  if (process.env.AIC_BINARY_PATH) return process.env.AIC_BINARY_PATH;
  const key = process.platform + "-" + process.arch + (process.platform === "linux" ? "-" + libc() : "");
  const pkg = PACKAGES[key];
  if (!pkg) {
    console.error("aic: no build for " + key + " (there are: " + Object.keys(PACKAGES).join(", ") + ")");
    process.exit(1);
  }
  try {
    return path.join(path.dirname(require.resolve(pkg + "/package.json")), "bin", "aic");
  } catch {
    return { pkg, key };
  }
}

// npm installs an optional dependency it cannot find on the registry as nothing at all, without a word:
// a platform package that was never published looks just like one left out on purpose. The registry
// tells them apart (a 404 for this version), so ask it, briefly, and say which it is.
function explainMissing(pkg, key) {
  const spec = pkg + "@" + VERSION;
  let registry = process.env.npm_config_registry || "https://registry.npmjs.org/";
  if (!registry.endsWith("/")) registry += "/";
  const url = registry + pkg.replace("/", "%2f") + "/" + VERSION;
  const fallback =
    "Install aic's release binary instead and set AIC_BINARY_PATH to it (a Harbor run: --ak binary_path=...).";
  const say = (why) => {
    console.error("aic: the package " + spec + " that holds aic's binary for " + key + " is not installed: " + why + "\\n" + fallback);
    process.exit(1);
  };
  let client;
  try {
    client = require(url.startsWith("http:") ? "http" : "https");
  } catch {
    say("either it is not published on the npm registry, or npm left optional dependencies out (--omit=optional).");
  }
  const request = client.get(url, { timeout: 5000, headers: { accept: "application/json" } }, (response) => {
    response.resume();
    if (response.statusCode === 404)
      say(spec + " is not published on the npm registry (" + registry + "), so npm skipped it.");
    else if (response.statusCode === 200)
      say("it is published, so npm left it out: reinstall without --omit=optional / --no-optional.");
    else
      say("the registry answered " + response.statusCode + "; either " + spec + " is not published there, or npm left optional dependencies out (--omit=optional).");
  });
  const unsure = () =>
    say("the registry could not be asked; either " + spec + " is not published there, or npm left optional dependencies out (--omit=optional).");
  request.on("timeout", () => request.destroy());
  request.on("error", unsure);
}

function run(bin) {
  const args = process.argv.slice(2);

  // Node 22.15+ / 23.11+: become aic (same pid, signals and exit status straight from it).
  if (typeof process.execve === "function") {
    try {
      process.execve(bin, [bin, ...args], process.env);
    } catch {}
  }

  // Older node: run aic as a child. Ctrl-C, Ctrl-\\ and Ctrl-Z come from the terminal to aic directly
  // (same process group), so this launcher ignores them and waits; signals sent to its pid alone are
  // passed on. aic's exit status, or the signal that ended it, becomes this process's.
  const { spawn } = require("child_process");
  const child = spawn(bin, args, { stdio: "inherit" });
  for (const sig of ["SIGINT", "SIGQUIT"]) process.on(sig, () => {});
  for (const sig of ["SIGTERM", "SIGHUP"]) process.on(sig, () => child.kill(sig));
  child.on("error", (error) => {
    console.error("aic: cannot run " + bin + ": " + error.message);
    process.exit(1);
  });
  child.on("exit", (code, signal) => {
    if (signal) {
      process.removeAllListeners(signal);
      process.kill(process.pid, signal);
      setTimeout(() => process.exit(128 + (require("os").constants.signals[signal] || 0)), 200);
    } else {
      process.exit(code === null ? 1 : code);
    }
  });
}

const found = binary();
if (typeof found === "string") run(found);
else explainMissing(found.pkg, found.key);
`;
}

function platformPackageName(target: string) {
  return `${PLATFORM_SCOPE}/${target}`;
}

/** Hard link when possible: the binaries are ~130 MB each. */
function linkOrCopy(from: string, to: string) {
  try {
    linkSync(from, to);
  } catch {
    copyFileSync(from, to);
  }
  chmodSync(to, 0o755);
}

function writeNpmPackages(built: Built[], version: string): { dir: string; name: string }[] {
  const project = readJson(join(ROOT, "package.json"));
  rmSync(NPM_OUT, { recursive: true, force: true });
  const out: { dir: string; name: string }[] = [];
  const platforms: Record<string, string> = {};
  for (const b of built) {
    const t = TARGETS[b.target]!;
    const name = platformPackageName(b.target);
    platforms[`${t.os}-${t.cpu}-${t.libc}`] = name;
    const dir = join(NPM_OUT, b.target);
    mkdirSync(join(dir, "bin"), { recursive: true });
    linkOrCopy(b.file, join(dir, "bin/aic"));
    copyFileSync(join(ROOT, "LICENSE"), join(dir, "LICENSE"));
    writeFileSync(
      join(dir, "README.md"),
      `# ${name}\n\nThe ${b.target} executable of [aic](https://www.npmjs.com/package/${MAIN_PACKAGE}). ` +
        `Install \`${MAIN_PACKAGE}\`, not this package: it picks the right one for your machine.\n` +
        (t.libc === "musl"
          ? `\nOn Alpine it needs \`apk add libstdc++ libgcc\` (Bun's musl runtime links them).\n`
          : "") +
        (b.tui
          ? ""
          : `\nThis build has no terminal UI (OpenTUI has no ${t.opentui} release to match); run aic with --nogui.\n`),
    );
    writeFileSync(
      join(dir, "package.json"),
      JSON.stringify(
        {
          name,
          version,
          description: `The ${b.target} executable of aic`,
          license: project.license,
          os: [t.os],
          cpu: [t.cpu],
          libc: [t.libc],
          files: ["bin/aic"],
          preferUnplugged: true, // Yarn PnP: keep the executable a real file on disk
          publishConfig: { access: "public" }, // scoped packages are private unless said otherwise
        },
        null,
        2,
      ) + "\n",
    );
    out.push({ dir, name });
  }

  const dir = join(NPM_OUT, MAIN_PACKAGE);
  mkdirSync(join(dir, "bin"), { recursive: true });
  writeFileSync(join(dir, "bin/aic.js"), launcherSource(version, platforms));
  chmodSync(join(dir, "bin/aic.js"), 0o755);
  copyFileSync(join(ROOT, "LICENSE"), join(dir, "LICENSE"));
  copyFileSync(join(ROOT, "README.md"), join(dir, "README.md"));
  writeFileSync(
    join(dir, "package.json"),
    JSON.stringify(
      {
        name: MAIN_PACKAGE,
        version,
        description: project.description,
        license: project.license,
        bin: { aic: "bin/aic.js" },
        files: ["bin/aic.js"],
        os: [...new Set(built.map((b) => TARGETS[b.target]!.os))],
        cpu: [...new Set(built.map((b) => TARGETS[b.target]!.cpu))],
        engines: { node: ">=16" },
        optionalDependencies: Object.fromEntries(built.map((b) => [platformPackageName(b.target), version])),
      },
      null,
      2,
    ) + "\n",
  );
  out.push({ dir, name: MAIN_PACKAGE });
  return out;
}

function npmPack(dirs: { dir: string; name: string }[]): Record<string, string> {
  const dest = join(RELEASE, "npm");
  mkdirSync(dest, { recursive: true });
  const tarballs: Record<string, string> = {};
  for (const { dir, name } of dirs) {
    const r = mustRun(["npm", "pack", "--json", "--pack-destination", dest], { cwd: dir, env: npmEnv() });
    tarballs[name] = join(dest, JSON.parse(r.stdout)[0].filename);
  }
  return tarballs;
}

/**
 * `npm install -g` of the main tarball together with this machine's platform tarball into a fresh
 * prefix, with no Bun on PATH, then `aic --version` and the smoke task through the launcher.
 *
 * How the optional dependency is met: npm reads aic's optionalDependencies and asks the registry
 * for `@aic/linux-x64@<version>`; before publication that is a 404, which npm tolerates for an
 * optional dependency (it skips it). The platform tarball named on the same command line becomes
 * a sibling global package, <prefix>/lib/node_modules/@aic/linux-x64, and the launcher's
 * require.resolve finds it there, since Node looks in <prefix>/lib/node_modules after
 * aic/node_modules. After publication a plain `npm i -g aic` puts it in aic/node_modules instead.
 */
async function npmInstallTest(
  tarballs: Record<string, string>,
  built: Built[],
  version: string,
  scratch: string,
): Promise<{ ok: boolean; skipped?: boolean; detail: string; lines?: string[] }> {
  const hostTarget = built.find((b) => {
    const t = TARGETS[b.target]!;
    return t.cpu === process.arch && t.libc === (isMuslHost() ? "musl" : "glibc");
  });
  if (!hostTarget) return { ok: true, skipped: true, detail: "skipped: no target built for this machine" };
  const prefix = mkdtempSync(join(scratch, "npm-prefix-"));
  // A PATH with node and npm but no bun: the launcher must not need it.
  const path = pathWithoutBun(process.env.PATH ?? "", mkdtempSync(join(scratch, "path-")));
  const env = cleanEnv(scratch, { PATH: `${join(prefix, "bin")}${delimiter}${path}` });
  const started = performance.now();
  // --offline: nothing comes from the registry, so the optional @aic/<platform> dependency is
  // skipped (not cached) even if somebody publishes that name before we do; the binary the launcher
  // runs can only be the tarball's, which is checked below by its sha256.
  const install = run(
    [
      "npm",
      "install",
      "-g",
      "--offline",
      "--prefix",
      prefix,
      tarballs[MAIN_PACKAGE]!,
      tarballs[platformPackageName(hostTarget.target)]!,
    ],
    { env: npmEnv(env) as Record<string, string>, cwd: scratch },
  );
  const installMs = performance.now() - started;
  const lines = [
    `$ npm install -g --prefix ${prefix} <${MAIN_PACKAGE} tgz> <${hostTarget.target} tgz>   # exit ${install.code}, ${seconds(installMs)}`,
  ];
  lines.push(install.stdout.trimEnd(), install.stderr.trimEnd());
  if (install.code !== 0) return { ok: false, detail: `npm install -g failed (exit ${install.code})`, lines };
  const noBun = run(["sh", "-c", "command -v bun || echo none"], { env }).stdout.trim();
  lines.push(`bun on PATH: ${noBun}`);
  // The binary the launcher will pick, found the way it finds it (require.resolve from aic's bin/).
  const launcherDir = join(prefix, "lib/node_modules", MAIN_PACKAGE, "bin");
  const resolved = run(
    [
      "node",
      "-e",
      `const p=require("path");console.log(p.join(p.dirname(require.resolve(${JSON.stringify(platformPackageName(hostTarget.target) + "/package.json")}, {paths:[${JSON.stringify(launcherDir)}]})),"bin","aic"))`,
    ],
    { env, cwd: scratch },
  ).stdout.trim();
  const resolvedSha = resolved && existsSync(resolved) ? sha256(resolved) : "missing";
  lines.push(`launcher runs: ${resolved || "nothing"} (sha256 ${resolvedSha}, built ${hostTarget.sha256})`);
  if (resolvedSha !== hostTarget.sha256)
    return { ok: false, detail: `the installed launcher does not run the built ${hostTarget.target} binary`, lines };
  const aic = join(prefix, "bin/aic");
  const result = await smokeTask([aic], env, scratch, version, TARGETS[hostTarget.target]!.libc);
  lines.push(...result.lines);
  return { ok: result.ok && noBun === "none", detail: `${result.why}; install ${seconds(installMs)}`, lines };
}

/**
 * `path` less bun, and nothing else: a directory that holds bun (or bunx, or anything that resolves to
 * the bun binary, such as a `node` link to it) is replaced by a directory in `scratch` of links to
 * everything else it holds. Dropping such a directory whole would drop what sits beside bun: after
 * `npm install -g bun` that is npm and node themselves (and in /usr/bin, sh and the rest), and the
 * install test could not run npm at all. The bun running this script counts as bun wherever it is.
 */
export function pathWithoutBun(path: string, scratch: string): string {
  const real = (p: string) => {
    try {
      return realpathSync(p);
    } catch {
      return undefined;
    }
  };
  const dirs = path.split(delimiter);
  const buns = new Set<string>([real(process.execPath)].filter((p): p is string => !!p));
  for (const dir of dirs)
    for (const name of ["bun", "bunx"]) {
      const p = dir && real(join(dir, name));
      if (p) buns.add(p);
    }
  const isBun = (dir: string, name: string) =>
    name === "bun" || name === "bunx" || buns.has(real(join(dir, name)) ?? "");
  const out: string[] = [];
  dirs.forEach((dir, i) => {
    if (!dir) return;
    let names: string[];
    try {
      names = readdirSync(dir);
    } catch {
      return; // a missing directory finds nothing anyway
    }
    if (!names.some((name) => isBun(dir, name))) {
      out.push(dir);
      return;
    }
    const shadow = join(scratch, `${i}-${basename(dir) || "root"}`);
    mkdirSync(shadow, { recursive: true });
    for (const name of names) if (!isBun(dir, name)) symlinkSync(join(dir, name), join(shadow, name));
    out.push(shadow);
  });
  return out.join(delimiter);
}

// ---------------------------------------------------------------------------------------------

async function main() {
  const project = readJson(join(ROOT, "package.json"));
  const version: string = project.version;
  const names = (option("--targets") ?? Object.keys(TARGETS).join(",")).split(",").filter(Boolean);
  for (const n of names)
    if (!TARGETS[n]) throw new Error(`unknown target ${n}; known: ${Object.keys(TARGETS).join(", ")}`);

  rmSync(RELEASE, { recursive: true, force: true });
  mkdirSync(RELEASE, { recursive: true });
  mkdirSync(CACHE, { recursive: true });
  const scratch = (scratchDir = mkdtempSync(join(tmpdir(), "aic-release-")));
  const base = buildFlagsFromPackageJson();
  log(`aic ${version}: bun ${Bun.version}, targets ${names.join(", ")}`);

  const built: Built[] = [];
  try {
    for (const name of names) {
      const t = TARGETS[name]!;
      try {
        const b = buildTarget(name, t, base);
        log(`built ${name}: ${mib(b.bytes)} in ${seconds(b.buildMs)}; TUI ${b.tui ?? "not included"}`);
        built.push(b);
      } catch (error) {
        problems.push(`${name}: build failed: ${(error as Error).message}`);
        log(`build of ${name} FAILED: ${(error as Error).message}`);
      }
    }

    if (!flag("--no-smoke"))
      for (const b of built) {
        b.smoke = await smoke(b, TARGETS[b.target]!, version, scratch);
        log(`smoke ${b.target}: ${b.smoke!.status} (${b.smoke!.detail})`);
        if (b.smoke!.status === "failed")
          problems.push(`${b.target}: smoke test failed, see dist/release/smoke-${b.target}.log`);
        if (b.smoke!.status === "skipped") warnings.push(`${b.target}: smoke test skipped: ${b.smoke!.detail}`);
      }

    let tarballs: Record<string, string> = {};
    if (!flag("--no-npm") && built.length > 0) {
      const started = performance.now();
      tarballs = npmPack(writeNpmPackages(built, version));
      log(`npm pack: ${Object.keys(tarballs).length} tarballs in ${seconds(performance.now() - started)}`);
      const test = await npmInstallTest(tarballs, built, version, scratch);
      if (test.lines) writeFileSync(join(RELEASE, "smoke-npm-install.log"), test.lines.join("\n") + "\n");
      log(`npm install -g test: ${test.skipped ? "skipped" : test.ok ? "passed" : "FAILED"} (${test.detail})`);
      if (!test.ok) problems.push(`npm install -g test failed, see dist/release/smoke-npm-install.log`);
      if (test.skipped) warnings.push(`npm install -g test ${test.detail}`);
    }

    // Checksums of everything that would be uploaded, paths relative to dist/release.
    const artifacts = [
      ...built.map((b) => ({ file: b.file, bytes: b.bytes, sha256: b.sha256 })),
      ...Object.values(tarballs).map((f) => ({ file: f, bytes: statSync(f).size, sha256: sha256(f) })),
    ].map((a) => ({ ...a, file: a.file.slice(RELEASE.length + 1) }));
    writeFileSync(join(RELEASE, "SHA256SUMS"), artifacts.map((a) => `${a.sha256}  ${a.file}\n`).join(""));
    const manifest = {
      version,
      bun: Bun.version,
      targets: built.map((b) => ({ ...b, file: basename(b.file), buildMs: Math.round(b.buildMs) })),
      artifacts,
    };
    writeFileSync(join(RELEASE, "manifest.json"), JSON.stringify(manifest, null, 2) + "\n");

    log("\nartifacts (dist/release):");
    for (const a of artifacts) log(`  ${a.file.padEnd(34)} ${mib(a.bytes).padStart(10)}  sha256 ${a.sha256}`);
  } finally {
    removeStages();
    rmSync(scratch, { recursive: true, force: true });
  }

  for (const w of warnings) log(`warning: ${w}`);
  for (const p of problems) log(`error: ${p}`);
  const failed = problems.length > 0 || (STRICT && warnings.length > 0);
  log(failed ? "release: FAILED" : "release: ok");
  process.exit(failed ? 1 : 0);
}

if (MAIN) await main();
