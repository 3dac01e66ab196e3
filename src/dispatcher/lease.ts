// A claim's lease as the process that holds it knows it. The database ends the lease at
// lease_expires_at, by its clock; this process keeps a deadline of its own, on the monotonic clock, a
// little before that: from the moment it sent the claim, or the last renewal that succeeded, plus the
// TTL (the database's now() for that statement came later). A renewal that fails or hangs never moves
// it. When the deadline passes the call is aborted with CallAbandoned (its outcome is not recorded, its
// lease left to expire), so the process stops before anyone else can claim the operation. Timers fire
// late after the process was stopped (SIGSTOP, a VM paused), so `check()` reads the clock itself: the
// executor calls it right before sending, and a process that wakes past its lease sends nothing.
import type { Logger } from '../telemetry/log.ts';
import { CallAbandoned } from '../engine/executor.ts';

export interface LocalLease {
  /** Aborts the call now if the deadline has passed. */
  check(): void;
  /** Unless a fenced statement (the claim, a renewal) found the lease still this claim's within the last
   * `maxAgeMs`, renews it now: the call is aborted if it was lost (`renew` says false) or, the database
   * not answering, with CallAbandoned, since nobody could say it is still ours. */
  confirm(maxAgeMs: number): Promise<void>;
  /** The call was given up while it may still act (keepUntilReturned): renewed until stop(), past any
   * deadline, a renewal held up (an application's lock on the row, a failover) included; only a lease
   * found lost, or the call's abort by a drain, ends the renewals. */
  keep(): void;
  /** The call is over: no more renewals. */
  stop(): void;
  /** Resolves once no renewal is in flight (one holds the operation's row lock until it ends). */
  idle(): Promise<void>;
}

/** Kept this far before the TTL runs out: for the two clocks' drift and the abort to take effect. */
export const leaseMargin = (ttlMs: number): number => Math.min(1_000, Math.floor(ttlMs / 5));

/**
 * Renews the lease every third of `ttlMs` while the call runs (one renewal at a time) and aborts `call`
 * when it is lost (`renew` says false: another claim took it over) or when its local deadline passes.
 * `claimSentAt`: performance.now() when the claim was sent.
 */
export function keepLease(
  call: AbortController,
  opts: { ttlMs: number; claimSentAt: number; renew: () => Promise<boolean>; log: Logger },
): LocalLease {
  const { ttlMs, log } = opts;
  const margin = leaseMargin(ttlMs);
  let deadline = opts.claimSentAt + ttlMs - margin;
  /** When the last fenced statement that found the lease ours was sent. */
  let confirmedAt = opts.claimSentAt;
  let timer: NodeJS.Timeout | undefined;
  let renewing: Promise<boolean | undefined> | undefined;
  let stopped = false;
  let kept = false;

  const check = () => {
    if (call.signal.aborted || stopped || kept) return;
    const left = deadline - performance.now();
    if (left > 0) return;
    log.warn({ leaseTtlMs: ttlMs, overdueMs: Math.round(-left) }, 'lease deadline passed without a renewal: the call is given up before another claim can take it');
    call.abort(new CallAbandoned(`the lease's deadline passed without a renewal (${ttlMs} ms lease): given up before another claim can take the operation`));
  };
  const arm = () => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      check();
      if (!call.signal.aborted && !stopped) arm(); // a timer that fired early (renewed meanwhile)
    }, Math.max(0, deadline - performance.now()));
  };
  /** One renewal at a time: whether it found the lease ours (undefined: it failed). */
  const renew = (): Promise<boolean | undefined> => {
    const sentAt = performance.now();
    renewing ??= opts
      .renew()
      .then((held) => {
        if (!held) {
          if (!call.signal.aborted) log.warn('lease taken over during the call: its outcome will be fenced out');
          call.abort(new Error('the lease on this operation was lost'));
          return false;
        }
        deadline = Math.max(deadline, sentAt + ttlMs - margin);
        confirmedAt = Math.max(confirmedAt, sentAt);
        return true;
      })
      .catch((err: Error) => (log.warn({ err }, 'lease renewal failed'), undefined))
      .finally(() => (renewing = undefined));
    return renewing;
  };
  const renewal = setInterval(() => {
    check();
    if (!renewing && !stopped && !call.signal.aborted) void renew();
  }, Math.max(250, Math.floor(ttlMs / 3)));
  arm();

  return {
    check,
    keep() {
      kept = true;
      clearTimeout(timer);
    },
    async confirm(maxAgeMs) {
      const asked = performance.now();
      // A renewal that hangs is waited for no longer than the lease's deadline, which aborts the call.
      const aborted = new Promise<void>((resolve) => call.signal.addEventListener('abort', () => resolve(), { once: true }));
      // A renewal already in flight may have been sent too long ago: then another.
      while (!stopped && !call.signal.aborted && asked - confirmedAt > maxAgeMs) {
        const held = await Promise.race([renew(), aborted.then(() => false)]);
        if (held === undefined && !call.signal.aborted) {
          call.abort(new CallAbandoned('the lease could not be confirmed before the call (the database did not answer a renewal)'));
        }
      }
    },
    stop() {
      stopped = true;
      clearInterval(renewal);
      clearTimeout(timer);
    },
    idle: async () => void (await renewing),
  };
}
