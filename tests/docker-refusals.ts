/**
 * "The field" without Docker: an argv prefix that runs a program under a seccomp filter refusing
 * what Docker's default profile refuses a container without CAP_SYS_ADMIN — `unshare`, `setns`,
 * `mount`, `umount2` and `pivot_root` (EPERM), `clone` with any CLONE_NEW* flag (EPERM) and
 * `clone3` (ENOSYS). The filter is the C program beside this file (docker-refusals.c), built with
 * the machine's `cc` once per content into the temporary directory and reused by later runs.
 *
 *   const refusals = dockerRefusals();
 *   test.skipIf("skip" in refusals)("…", () => startAic(args, { prefix: refusals.prefix }));
 *
 * Where there is no `cc`, the kernel is not x86_64 Linux, or the build fails, it returns the reason
 * to skip instead.
 */
import { chmodSync, existsSync, mkdirSync, readFileSync, renameSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const SOURCE = join(import.meta.dir, "docker-refusals.c");

export type Refusals = { prefix: string[] } | { skip: string };

let cached: Refusals | undefined;

/** The prefix (`[path-to-helper]`) that runs the rest of an argv under Docker's namespace refusals, or why not. */
export function dockerRefusals(): Refusals {
  cached ??= build();
  return cached;
}

function build(): Refusals {
  if (process.platform !== "linux" || process.arch !== "x64")
    return { skip: `the Docker-refusals filter is written for x86_64 Linux, not ${process.platform}/${process.arch}` };
  const cc = Bun.which("cc") ?? Bun.which("gcc") ?? Bun.which("clang");
  if (!cc) return { skip: "no C compiler (cc) to build the Docker-refusals seccomp filter" };
  const source = readFileSync(SOURCE);
  const hash = new Bun.CryptoHasher("sha256").update(source).update(cc).digest("hex").slice(0, 16);
  const dir = join(tmpdir(), `aic-test-docker-refusals-${process.getuid?.() ?? 0}`);
  const binary = join(dir, `docker-refusals-${hash}`);
  if (existsSync(binary)) return { prefix: [binary] };
  mkdirSync(dir, { recursive: true, mode: 0o755 });
  // Built beside its final name and renamed into place: test files that build it at once never see half a file.
  const partial = `${binary}.${process.pid}.${Math.random().toString(36).slice(2)}`;
  const r = Bun.spawnSync([cc, "-O2", "-Wall", "-o", partial, SOURCE], { stdout: "pipe", stderr: "pipe" });
  if (r.exitCode !== 0) {
    rmSync(partial, { force: true });
    return { skip: `cc could not build the Docker-refusals filter: ${r.stderr.toString().trim().slice(0, 500)}` };
  }
  chmodSync(partial, 0o755); // uid 65534 runs it too
  renameSync(partial, binary);
  return { prefix: [binary] };
}
