/*
 * docker-refusals PROGRAM [ARG...]
 *
 * Runs PROGRAM under a seccomp filter that refuses what Docker's default seccomp profile refuses a
 * container without CAP_SYS_ADMIN, as far as namespaces and mounts go:
 *   unshare, setns, mount, umount2, pivot_root          -> EPERM
 *   clone with any CLONE_NEW* namespace flag           -> EPERM
 *   clone3                                              -> ENOSYS (so libc falls back to clone)
 * Everything else is allowed. The filter is x86_64 only: a system call made through another ABI
 * (i386 int 0x80, x32) kills the process rather than slipping past the rules.
 *
 * It sets no_new_privs (so an unprivileged user may install the filter), installs the filter and
 * execvp's the rest of argv. The filter is inherited by every process PROGRAM starts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

/* x86_64 system call numbers, spelled out so the filter does not depend on the headers' ABI. */
#define NR_PIVOT_ROOT 155
#define NR_MOUNT 165
#define NR_UMOUNT2 166
#define NR_CLONE 56
#define NR_UNSHARE 272
#define NR_SETNS 308
#define NR_CLONE3 435
#define X32_SYSCALL_BIT 0x40000000u

/* CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: the mask Docker's profile tests. */
#define CLONE_NAMESPACE_FLAGS 0x7E020000u

#define ERRNO(e) (SECCOMP_RET_ERRNO | ((e) & SECCOMP_RET_DATA))
#define REFUSE(nr, ret) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, (ret))

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s PROGRAM [ARG...]\n", argv[0]);
    return 125;
  }
  struct sock_filter filter[] = {
      /* Only the x86_64 ABI: anything else is killed. */
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
      REFUSE(NR_UNSHARE, ERRNO(EPERM)),
      REFUSE(NR_SETNS, ERRNO(EPERM)),
      REFUSE(NR_MOUNT, ERRNO(EPERM)),
      REFUSE(NR_UMOUNT2, ERRNO(EPERM)),
      REFUSE(NR_PIVOT_ROOT, ERRNO(EPERM)),
      REFUSE(NR_CLONE3, ERRNO(ENOSYS)),
      /* clone: refused when its flags (the low 32 bits of the first argument) ask for a namespace. */
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_CLONE, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NAMESPACE_FLAGS, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, ERRNO(EPERM)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    perror("docker-refusals: prctl(PR_SET_NO_NEW_PRIVS)");
    return 125;
  }
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) {
    perror("docker-refusals: seccomp(SECCOMP_SET_MODE_FILTER)");
    return 125;
  }
  execvp(argv[1], argv + 1);
  fprintf(stderr, "docker-refusals: cannot run %s: %s\n", argv[1], strerror(errno));
  return errno == ENOENT ? 127 : 126;
}
