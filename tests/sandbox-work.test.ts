/**
 * A sandbox that lets real work happen and keeps secrets: package managers'
 * caches under $HOME are writable (installing dependencies is most tasks'
 * first step), nothing else there is; the usual secret stores cannot be read;
 * `--allow-write` adds paths and `--allow-read-secrets` lifts the read
 * restriction. Every test runs the compiled binary with a fake $HOME under
 * /var/tmp, outside the writable /tmp, so "writable" is proved by the cache
 * rules alone.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { bash, cleanEnv, has, headless, perTestFixtures, runAic, sandboxLine, toolResults } from "./helpers.ts";

const fixtures = perTestFixtures();

/** A home directory with secrets in the usual places, and ordinary files beside them. */
function fakeHome(): string {
  const home = fixtures.varTmp("aic-home-");
  for (const dir of [".ssh", ".aws", ".config/gcloud", ".docker", ".config/app"])
    mkdirSync(join(home, dir), { recursive: true });
  writeFileSync(join(home, ".ssh", "id_test"), "SSH-PRIVATE-KEY\n");
  writeFileSync(join(home, ".aws", "credentials"), "AWS-SECRET\n");
  writeFileSync(join(home, ".config", "gcloud", "token"), "GCLOUD-TOKEN\n");
  writeFileSync(join(home, ".docker", "config.json"), "DOCKER-AUTH\n");
  writeFileSync(join(home, ".docker", "daemon.json"), "docker-daemon-ok\n");
  writeFileSync(join(home, ".config", "app", "settings"), "app-settings-ok\n");
  writeFileSync(join(home, ".netrc"), "NETRC-PASSWORD\n");
  writeFileSync(join(home, ".bashrc"), "bashrc-ok\n");
  return home;
}

// What the sandbox allows and refuses needs a kernel with Landlock: skipped without it.
describe.skipIf(!has.landlock)("the sandbox with a fake $HOME (Landlock)", () => {
  // Needs npm; skipped without it.
  test.skipIf(!has.npm)("npm install of a local package works, and its cache lands in ~/.npm", async () => {
    const home = fakeHome();
    const project = fixtures.varTmp("aic-proj-");
    const pkg = fixtures.varTmp("aic-pkg-");
    writeFileSync(join(pkg, "package.json"), JSON.stringify({ name: "tiny-pkg", version: "1.0.0", main: "index.js" }));
    writeFileSync(join(pkg, "index.js"), "module.exports = 42;\n");
    const pack = Bun.spawnSync(["npm", "pack", "--silent", "--pack-destination", project], {
      cwd: pkg,
      env: cleanEnv({ HOME: fixtures.varTmp("aic-packhome-") }),
    });
    expect(pack.exitCode).toBe(0);
    const srv = fixtures.serve([
      bash(
        "npm init -y > /dev/null && npm install --no-audit --no-fund ./tiny-pkg-1.0.0.tgz && node -e 'console.log(require(\"tiny-pkg\"))'",
      ),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "install it"], {
      cwd: project,
      env: { HOME: home },
    });
    expect(run.code).toBe(0);
    expect(toolResults(srv)[0]).toContain("exit code 0");
    expect(toolResults(srv)[0]).toMatch(/^42$/m);
    expect(existsSync(join(project, "node_modules", "tiny-pkg", "index.js"))).toBe(true);
    expect(existsSync(join(home, ".npm", "_cacache"))).toBe(true);
  });

  test("outside the caches, $HOME stays unwritable; secrets are unreadable; other files are readable", async () => {
    const home = fakeHome();
    const srv = fixtures.serve([
      bash("touch ~/elsewhere; echo rc=$?"),
      bash("touch ~/.cache/made-by-command && echo cache-writable"),
      bash("cat ~/.ssh/id_test ~/.aws/credentials ~/.config/gcloud/token ~/.docker/config.json ~/.netrc; echo rc=$?"),
      bash("cat ~/.bashrc ~/.docker/daemon.json ~/.config/app/settings"),
      bash("ls ~/.ssh"),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "probe"], {
      cwd: fixtures.varTmp("aic-proj-"),
      env: { HOME: home },
    });
    expect(run.code).toBe(0);
    const [touchHome, touchCache, secrets, ordinary, listing] = toolResults(srv) as [
      string,
      string,
      string,
      string,
      string,
    ];
    expect(touchHome).toContain("Permission denied");
    expect(existsSync(join(home, "elsewhere"))).toBe(false);
    expect(touchCache).toContain("cache-writable");
    expect(existsSync(join(home, ".cache", "made-by-command"))).toBe(true);
    // Landlock denies the files; the jail also covers the directories, so their contents are not even there.
    expect(secrets.match(/Permission denied|No such file or directory/g)).toHaveLength(5);
    for (const secret of ["SSH-PRIVATE-KEY", "AWS-SECRET", "GCLOUD-TOKEN", "DOCKER-AUTH", "NETRC-PASSWORD"])
      expect(secrets).not.toContain(secret);
    for (const ok of ["bashrc-ok", "docker-daemon-ok", "app-settings-ok"]) expect(ordinary).toContain(ok);
    // Without the jail names stay visible (listing is not reading); in it, the store is an empty directory.
    if (run.stderr.includes("no jail")) expect(listing).toContain("id_test");
    else expect(listing).not.toContain("id_test");
  });

  test("the caches are created when missing", async () => {
    const home = fakeHome();
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    expect(
      (await runAic([...headless(srv.url), "go"], { cwd: fixtures.varTmp("aic-proj-"), env: { HOME: home } })).code,
    ).toBe(0);
    for (const cache of [
      ".npm",
      ".cache",
      ".bun/install/cache",
      ".cargo/registry",
      "go/pkg/mod",
      ".m2/repository",
      ".gradle/caches",
    ])
      expect(existsSync(join(home, cache))).toBe(true);
  });

  test("a link planted in $HOME that points into a secret store does not make it readable", async () => {
    const home = fakeHome();
    symlinkSync(join(home, ".ssh"), join(home, "innocent"));
    const srv = fixtures.serve([bash("cat ~/innocent/id_test; echo rc=$?"), { content: "TASKCOMPLETE" }]);
    expect(
      (
        await runAic([...headless(srv.url), "--auto-approve", "probe"], {
          cwd: fixtures.varTmp("aic-proj-"),
          env: { HOME: home },
        })
      ).code,
    ).toBe(0);
    expect(toolResults(srv)[0]).toMatch(/Permission denied|No such file or directory/);
    expect(toolResults(srv)[0]).not.toContain("SSH-PRIVATE-KEY");
  });

  // Writable means rewritable: a secret store inside the start directory cannot be kept unreadable (files
  // made there later must be readable), so the start line says it is exposed instead of half-protecting it.
  test("started in $HOME itself, work there is readable and the start line says the secrets are exposed", async () => {
    const home = fakeHome();
    const srv = fixtures.serve([bash("echo made > note.txt && cat note.txt"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "probe"], { cwd: home, env: { HOME: home } });
    expect(run.code).toBe(0);
    expect(toolResults(srv)[0]).toContain("made");
    expect(sandboxLine(run.stderr)).toMatch(
      /~\/\.ssh.* stay readable and writable, since aic started in a directory that holds them/,
    );
  });

  test("--allow-read-secrets lets commands read the secret stores", async () => {
    const home = fakeHome();
    const srv = fixtures.serve([bash("cat ~/.ssh/id_test ~/.aws/credentials"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--allow-read-secrets", "probe"], {
      cwd: fixtures.varTmp("aic-proj-"),
      env: { HOME: home },
    });
    expect(run.code).toBe(0);
    expect(toolResults(srv)[0]).toContain("SSH-PRIVATE-KEY");
    expect(toolResults(srv)[0]).toContain("AWS-SECRET");
    expect(sandboxLine(run.stderr)).toContain("--allow-read-secrets");
  });

  test("--allow-write and AIC_ALLOW_WRITE add writable paths", async () => {
    const home = fakeHome();
    const [one, two, three] = [
      fixtures.varTmp("aic-extra-"),
      fixtures.varTmp("aic-extra-"),
      fixtures.varTmp("aic-extra-"),
    ];
    const srv = fixtures.serve([
      bash(`touch ${one}/a ${two}/b ${three}/c && echo wrote-all`),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--allow-write", one, "write"], {
      cwd: fixtures.varTmp("aic-proj-"),
      env: { HOME: home, AIC_ALLOW_WRITE: `${two}:${three}` },
    });
    expect(run.code).toBe(0);
    expect(toolResults(srv)[0]).toContain("wrote-all");
    for (const file of [join(one, "a"), join(two, "b"), join(three, "c")]) expect(existsSync(file)).toBe(true);
    expect(sandboxLine(run.stderr)).toContain(one);
  });

  test("the start line and the system prompt name the writable set and the unreadable secrets", async () => {
    const home = fakeHome();
    const project = fixtures.varTmp("aic-proj-");
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "go"], { cwd: project, env: { HOME: home } });
    expect(run.code).toBe(0);
    const line = sandboxLine(run.stderr);
    for (const text of [project, "/tmp", "~/.npm", "~/.cache", "~/.ssh", "~/.aws", "unreadable"])
      expect(line).toContain(text);
    const prompt = String(srv.requests[0]!.body.messages[0].content);
    for (const text of [project, join(home, ".npm"), join(home, ".ssh"), "cannot be read"])
      expect(prompt).toContain(text);
  });
});

describe("bad --allow-write values: one line naming the flag, exit 2", () => {
  const base = ["--nogui", "--api-base", "http://127.0.0.1:9/v1", "--model", "m"];
  test("a path that does not exist", async () => {
    const run = await runAic([...base, "--allow-write", "/no/such/path", "task"]);
    expect(run.code).toBe(2);
    expect(run.stderr.trim().split("\n")).toHaveLength(1);
    expect(run.stderr).toContain("--allow-write");
  });
  test("/ itself", async () => {
    const run = await runAic([...base, "--allow-write", "/", "task"]);
    expect(run.code).toBe(2);
    expect(run.stderr).toContain("--allow-write");
  });
  test("$HOME itself, from AIC_ALLOW_WRITE", async () => {
    const home = fakeHome();
    const run = await runAic([...base, "task"], { env: { HOME: home, AIC_ALLOW_WRITE: `/tmp:${home}` } });
    expect(run.code).toBe(2);
    expect(run.stderr).toContain("AIC_ALLOW_WRITE");
    expect(readFileSync(join(home, ".bashrc"), "utf8")).toBe("bashrc-ok\n");
  });
});
