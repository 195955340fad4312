/**
 * A private Docker engine for tests that run aic in a real container, as it runs in the field.
 *
 * `startTestDocker()` starts a `dockerd` of its own — its own data root, exec root, socket and pid
 * file under /var/tmp, no iptables rules, no bridge (containers use `--network host`), its own
 * containerd — so it touches no engine the machine already runs, and `stop()` ends it by its pid.
 * No registry is reachable, so the base image is made here: `debootstrap --variant=minbase` of
 * bookworm (with git, python3 and ca-certificates: aic's checkpoints use git, tests serve HTTP with
 * python3) from the mirror apt uses, cached as a tarball under /var/tmp/aic-test-images/ named by
 * its date and package set and reused by later runs, then `docker import`ed as `aic-test-base`.
 *
 * Running a real engine costs about a minute the first time (debootstrap) and seconds after, so it
 * runs only when AIC_TEST_DOCKER=1 is set; otherwise, and where root, dockerd, the docker client or
 * debootstrap is missing, it returns the reason to skip.
 */
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readdirSync,
  renameSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import { waitFor } from "./helpers.ts";

/** The reason every Docker test gives when it is not asked for. */
export const DOCKER_OPT_IN = "set AIC_TEST_DOCKER=1 to run aic in a real container";

export const BASE_IMAGE = "aic-test-base";
const SUITE = "bookworm";
const INCLUDE = ["git", "python3", "ca-certificates"];
const IMAGE_CACHE = "/var/tmp/aic-test-images";
/** A cached base tarball older than this is made afresh (the mirror moves on). */
const CACHE_DAYS = 30;

export interface DockerRun {
  code: number;
  stdout: string;
  stderr: string;
}

export interface TestDocker {
  /** Runs the docker client against this engine. */
  docker(args: string[], opts?: { stdin?: string | Blob; timeoutMs?: number }): Promise<DockerRun>;
  /** The base image's name (`aic-test-base`). */
  image: string;
  /** The engine's socket, as `-H` takes it. */
  host: string;
  /** How long the pieces took, in ms: measured for the report, never asserted. */
  timings: { debootstrapMs: number | null; importMs: number; daemonMs: number };
  /** Where the base tarball came from: made by this run, or reused from the cache. */
  tarball: { path: string; reused: boolean };
  /** Ends dockerd (and its containerd) by pid and removes its directories. */
  stop(): Promise<void>;
}

/** Whether the Docker tests were asked for, and can run here; the reason to skip when not. */
export function dockerSkipReason(): string | undefined {
  if (process.env.AIC_TEST_DOCKER !== "1") return DOCKER_OPT_IN;
  if (process.platform !== "linux") return "a private dockerd needs Linux";
  if (process.getuid?.() !== 0) return "a private dockerd and debootstrap need root";
  for (const tool of ["dockerd", "debootstrap"])
    if (!Bun.which(tool)) return `no ${tool} (apt-get install docker.io debootstrap)`;
  if (!dockerClient()) return "no docker client (apt-get install docker.io)";
  return undefined;
}

/** The client that matches Debian's dockerd (/usr/bin/docker), else whichever is on PATH. */
function dockerClient(): string | undefined {
  return existsSync("/usr/bin/docker") ? "/usr/bin/docker" : (Bun.which("docker") ?? undefined);
}

/** The Debian mirror apt uses for the main suite (not the security archive), from /etc/apt/sources.list*. */
export function aptMirror(): string {
  const files = ["/etc/apt/sources.list"];
  try {
    for (const f of readdirSync("/etc/apt/sources.list.d").sort()) files.push(join("/etc/apt/sources.list.d", f));
  } catch {
    /* no such directory */
  }
  for (const file of files) {
    let text: string;
    try {
      text = readFileSync(file, "utf8");
    } catch {
      continue;
    }
    // One-line form: deb [options] URI SUITE COMPONENT...
    for (const line of text.split("\n")) {
      const m = /^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)/.exec(line);
      if (m && m[2] === SUITE && !/security/.test(m[1]!)) return m[1]!;
    }
    // deb822 form (*.sources): stanzas of `Field: value` lines.
    for (const stanza of text.split(/\n\s*\n/)) {
      const field = (name: string) =>
        new RegExp(`^${name}:\\s*(.+)$`, "im").exec(stanza)?.[1]?.trim().split(/\s+/) ?? [];
      if (!field("Types").includes("deb") || !field("Suites").includes(SUITE)) continue;
      const uri = field("URIs").find((u) => !/security/.test(u));
      if (uri) return uri;
    }
  }
  return "http://deb.debian.org/debian";
}

async function run(
  argv: string[],
  opts: { stdin?: string | Blob; env?: Record<string, string>; timeoutMs?: number } = {},
): Promise<DockerRun> {
  const proc = Bun.spawn(argv, {
    stdin: opts.stdin === undefined ? "ignore" : typeof opts.stdin === "string" ? new Blob([opts.stdin]) : opts.stdin,
    stdout: "pipe",
    stderr: "pipe",
    env: opts.env ?? (process.env as Record<string, string>),
  });
  const guard = setTimeout(() => proc.kill("SIGKILL"), opts.timeoutMs ?? 600_000);
  const [stdout, stderr, code] = await Promise.all([
    new Response(proc.stdout).text(),
    new Response(proc.stderr).text(),
    proc.exited,
  ]);
  clearTimeout(guard);
  return { code, stdout, stderr };
}

/**
 * The base system's tarball: the newest cached one for this suite and package set, if it is less
 * than CACHE_DAYS old, else made now with debootstrap (and the older ones removed).
 */
async function baseTarball(): Promise<{ path: string; reused: boolean; ms: number | null }> {
  mkdirSync(IMAGE_CACHE, { recursive: true });
  const kind = `${SUITE}-minbase-${INCLUDE.join("+")}`;
  const cached = readdirSync(IMAGE_CACHE)
    .filter((n) => n.startsWith(`${kind}-`) && n.endsWith(".tar"))
    .sort()
    .reverse();
  const fresh = cached.find((n) => Date.now() - statSync(join(IMAGE_CACHE, n)).mtimeMs < CACHE_DAYS * 86_400_000);
  if (fresh) return { path: join(IMAGE_CACHE, fresh), reused: true, ms: null };

  const date = new Date().toISOString().slice(0, 10).replaceAll("-", "");
  const path = join(IMAGE_CACHE, `${kind}-${date}.tar`);
  const work = mkdtempSync(join(IMAGE_CACHE, ".build-"));
  const root = join(work, "root");
  try {
    const began = Date.now();
    const boot = await run(
      ["debootstrap", "--variant=minbase", `--include=${INCLUDE.join(",")}`, SUITE, root, aptMirror()],
      { timeoutMs: 900_000 },
    );
    if (boot.code !== 0)
      throw new Error(`debootstrap failed (${boot.code}):\n${(boot.stdout + boot.stderr).slice(-3000)}`);
    // Made beside its final name and renamed into place: a run that looks meanwhile never takes half a tarball.
    const partial = join(work, "root.tar");
    const tar = await run(["tar", "--numeric-owner", "-C", root, "-cf", partial, "."]);
    if (tar.code !== 0) throw new Error(`tar of the base system failed: ${tar.stderr}`);
    renameSync(partial, path);
    const ms = Date.now() - began;
    for (const old of cached) rmSync(join(IMAGE_CACHE, old), { force: true });
    return { path, reused: false, ms };
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
}

/** Whether process `pid` is still there (and not a zombie). */
function running(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2)[0] !== "Z";
  } catch {
    return false;
  }
}

/** Pids of live processes whose command line names `needle` (the engine's own directory): its containerd and shims. */
function processesNaming(needle: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`, "utf8").includes(needle) && running(Number(entry)))
        found.push(Number(entry));
    } catch {
      /* gone */
    }
  }
  return found;
}

/** Starts a private dockerd with the base image imported, or says why it cannot. */
export async function startTestDocker(): Promise<TestDocker | { skip: string }> {
  const why = dockerSkipReason();
  if (why) return { skip: why };
  const client = dockerClient()!;

  // Short paths: containerd's sockets live under the exec root and Unix socket paths are capped at 108 bytes.
  const base = mkdtempSync("/var/tmp/aic-dkr-");
  const dirs = {
    data: join(base, "data"),
    exec: join(base, "exec"),
    config: join(base, "client"),
  };
  for (const dir of Object.values(dirs)) mkdirSync(dir);
  const socket = join(base, "docker.sock");
  const pidfile = join(base, "docker.pid");
  const daemonConfig = join(base, "daemon.json");
  writeFileSync(daemonConfig, "{}\n"); // not the machine's /etc/docker/daemon.json
  const host = `unix://${socket}`;
  // The client's own config directory: no credential helper or context of the developer's is used.
  const clientEnv: Record<string, string> = {
    ...(process.env as Record<string, string>),
    DOCKER_CONFIG: dirs.config,
    DOCKER_HOST: host,
  };
  delete clientEnv.DOCKER_CONTEXT;

  const began = Date.now();
  const daemon = Bun.spawn(
    [
      "dockerd",
      "--config-file",
      daemonConfig,
      "--data-root",
      dirs.data,
      "--exec-root",
      dirs.exec,
      "-H",
      host,
      "--pidfile",
      pidfile,
      "--iptables=false",
      "--ip6tables=false",
      "--ip-masq=false",
      "--bridge=none",
      "--userland-proxy=false",
      "--storage-driver=overlay2",
    ],
    { stdin: "ignore", stdout: "ignore", stderr: Bun.file(join(base, "dockerd.log")), env: clientEnv },
  );

  const docker: TestDocker["docker"] = (args, opts = {}) =>
    run([client, "-H", host, ...args], { stdin: opts.stdin, env: clientEnv, timeoutMs: opts.timeoutMs });

  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    try {
      process.kill(daemon.pid, "SIGTERM");
    } catch {
      /* already gone */
    }
    try {
      await waitFor("dockerd to stop", () => !running(daemon.pid), 30_000);
    } catch {
      daemon.kill("SIGKILL");
    }
    await daemon.exited;
    // Its containerd and shims, should any have outlived it: found by the engine's own directory, killed by pid.
    for (const pid of processesNaming(base))
      try {
        process.kill(pid, "SIGKILL");
      } catch {
        /* gone */
      }
    // Mounts it may have left (overlay layers, the exec root's netns files), innermost first.
    const mounts = readFileSync("/proc/self/mountinfo", "utf8")
      .split("\n")
      .map((l) => l.split(" ")[4])
      .filter((m): m is string => !!m && m.startsWith(base + "/"))
      .sort((a, b) => b.length - a.length);
    for (const m of mounts) Bun.spawnSync(["umount", "-l", m]);
    rmSync(base, { recursive: true, force: true });
  };

  try {
    await waitFor(
      "the private dockerd to answer",
      async () => {
        if (daemon.exitCode !== null)
          throw new Error(
            `dockerd exited (${daemon.exitCode}):\n${readFileSync(join(base, "dockerd.log"), "utf8").slice(-3000)}`,
          );
        return existsSync(socket) && (await docker(["info", "--format", "{{.ServerVersion}}"])).code === 0;
      },
      60_000,
    );
    const daemonMs = Date.now() - began;
    const tarball = await baseTarball();
    const importBegan = Date.now();
    const imported = await docker(["import", tarball.path, BASE_IMAGE]);
    if (imported.code !== 0) throw new Error(`docker import failed: ${imported.stderr}`);
    const importMs = Date.now() - importBegan;
    return {
      docker,
      image: BASE_IMAGE,
      host,
      timings: { debootstrapMs: tarball.ms, importMs, daemonMs },
      tarball: { path: tarball.path, reused: tarball.reused },
      stop,
    };
  } catch (error) {
    await stop();
    throw error;
  }
}
