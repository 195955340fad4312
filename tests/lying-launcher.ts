/**
 * A stand-in for aic's sandbox launcher that lies, for tests/launcher.test.ts: it says ready, then answers
 * the first spawn request the way a launcher taken over by a command might. The lie is argv[2]:
 *   foreign-pid  names a live process that is not its child (the test runner, given as argv[3])
 *   huge-frame   announces a frame far larger than any honest one
 *   bad-kind     sends a frame of a kind that does not exist
 * Frames: [kind u8][id u32 LE][length u32 LE][payload].
 */
export {};

const [, , lie, foreign] = process.argv;

function frame(kind: number, id: number, payload: Uint8Array = new Uint8Array(0)): Uint8Array {
  const out = new Uint8Array(9 + payload.length);
  const view = new DataView(out.buffer);
  view.setUint8(0, kind);
  view.setUint32(1, id, true);
  view.setUint32(5, payload.length, true);
  out.set(payload, 9);
  return out;
}

function int32(value: number): Uint8Array {
  const out = new Uint8Array(4);
  new DataView(out.buffer).setInt32(0, value, true);
  return out;
}

const write = (bytes: Uint8Array) => Bun.write(Bun.stdout, bytes);
await write(frame(10, 0)); // ready
for await (const chunk of Bun.stdin.stream()) {
  const id = new DataView(chunk.buffer, chunk.byteOffset).getUint32(1, true);
  if (lie === "foreign-pid") await write(frame(11, id, int32(Number(foreign))));
  else if (lie === "huge-frame") {
    const header = frame(12, id);
    new DataView(header.buffer).setUint32(5, 0x7fffffff, true);
    await write(header);
  } else await write(frame(99, id));
}
