// A claim's local lease (src/dispatcher/lease.ts) as the dispatcher's slot sees it: confirming the lease
// before a call never holds the slot past the lease's own deadline, whatever the database does.
import { expect, it } from 'vitest';
import { keepLease } from '../../src/dispatcher/lease.ts';
import { CallAbandoned } from '../../src/engine/executor.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { newWorkerId } from '../../src/runtime/replica.ts';

it('confirm() waits for a renewal that hangs no longer than the lease’s deadline, which gives the call up', async () => {
  const call = new AbortController();
  let renewals = 0;
  const held = keepLease(call, { ttlMs: 3_000, claimSentAt: performance.now(), renew: () => (renewals++, new Promise<boolean>(() => {})), log: createLogger('silent') });
  try {
    while (renewals === 0) await new Promise((resolve) => setTimeout(resolve, 50)); // a renewal (every second) hangs in flight
    expect(call.signal.aborted).toBe(false);
    await held.confirm(100); // the deadline: 3 s less its margin
    expect(call.signal.reason).toBeInstanceOf(CallAbandoned);
    expect(renewals).toBe(1); // it waited for the one in flight, sent no other
  } finally {
    held.stop();
  }
});

it('worker ids made on one host by one pid (two containers alike: the same host name, pid 1) do not repeat: draining releases every lease of its id', () => {
  const ids = Array.from({ length: 10_000 }, () => newWorkerId());
  expect(new Set(ids).size).toBe(ids.length);
});
