/**
 * The slow reader of tests/hardening.test.ts ("output to a slow pipe is complete"), without a fixed
 * sleep: it reads nothing until the pipe on its stdin is full (the kernel has no room left for
 * another write, seen through a write end of the same pipe opened for a moment) or its writer has
 * closed it, so the writer (aic) meets a full pipe; then it reads everything and prints how many
 * lines are whole numbers.
 */
import { dlopen, FFIType, ptr } from "bun:ffi";
import { closeSync, constants, openSync } from "node:fs";

const POLLOUT = 0x4;
const POLLHUP = 0x10;

const libc = dlopen("libc.so.6", {
  poll: { args: [FFIType.ptr, FFIType.u64, FFIType.i32], returns: FFIType.i32 },
});

/** The `revents` that poll(2) reports for `fd` right now, asked with `events`. */
function revents(fd: number, events: number): number {
  const pollfd = new DataView(new ArrayBuffer(8)); // struct pollfd { int fd; short events; short revents; }
  pollfd.setInt32(0, fd, true);
  pollfd.setInt16(4, events, true);
  return libc.symbols.poll(ptr(pollfd.buffer), 1, 0) > 0 ? pollfd.getInt16(6, true) : 0;
}

/** Whether the pipe has no room for another write. The write end is closed again at once, so EOF still comes. */
function full(): boolean {
  const writer = openSync("/proc/self/fd/0", constants.O_WRONLY | constants.O_NONBLOCK);
  try {
    return (revents(writer, POLLOUT) & POLLOUT) === 0;
  } finally {
    closeSync(writer);
  }
}

while (!(revents(0, 0) & POLLHUP) && !full()) await Bun.sleep(5);

const text = await Bun.stdin.text();
console.log(text.split("\n").filter((line) => /^[0-9]+$/.test(line)).length);
