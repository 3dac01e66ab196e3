// What every part of the emulator shares: its state, options, clock and this process's logs. Routes,
// resources, idempotency, faults, webhooks and control are functions over one Core.
import type { Endpoint, EmulatorState } from './state.ts';

export interface ServerOptions {
  /** How long a key's first result is kept (Stripe: at least 24 h). */
  idempotencyRetentionMs?: number;
  /** pm_card_processing PaymentIntents, and pending refunds, succeed this long after creation; unset:
   * only when settled. */
  processingSettleMs?: number;
  /** How many request log entries are kept (the oldest go first); unset: all. */
  requestLogLimit?: number;
}

export interface WebhookDelivery {
  eventId: string;
  type: string;
  attempt: number;
  status: number | 'error';
}

export interface RequestLogEntry {
  requestId: string;
  method: string;
  path: string;
  endpoint: Endpoint | 'list' | 'other';
  idempotencyKey: string | null;
  /** Its Stripe-Account header: the connected account it acts on; null: the platform. */
  account: string | null;
  operationId: string | null;
  status: number | 'reset' | 'truncated' | 'hung' | 'trickled';
  replayed: boolean;
  at: number;
}

export interface Core {
  readonly state: EmulatorState;
  readonly opts: ServerOptions;
  /** This process's requests and webhook deliveries, oldest first (not part of the shared state). */
  readonly log: RequestLogEntry[];
  readonly deliveries: WebhookDelivery[];
  /** Webhook deliveries waiting for their turn (cleared when the server closes or the emulator resets). */
  readonly timers: Set<NodeJS.Timeout>;
}

const DAY_MS = 24 * 60 * 60 * 1000;

/** How long a key's first result is kept. */
export const retentionMs = (core: Core): number => core.opts.idempotencyRetentionMs ?? DAY_MS;

/** The emulator clock: the wall clock moved by advanceClock. */
export async function clock(core: Core): Promise<number> {
  return Date.now() + (await core.state.clockOffsetMs());
}

/** Keeps a log to requestLogLimit entries, the newest. */
export function trim<T>(core: Core, entries: T[]): void {
  if (core.opts.requestLogLimit !== undefined && entries.length > core.opts.requestLogLimit) entries.shift();
}

/** Forgets every webhook delivery still to come: a closed server sends nothing, and after a reset an
 * earlier event's retry must not reach the endpoint configured since. */
export function cancelDeliveries(core: Core): void {
  for (const t of core.timers) clearTimeout(t);
  core.timers.clear();
}

/** This process's part of a reset: no requests or deliveries logged, none to come. */
export function resetProcess(core: Core): void {
  cancelDeliveries(core);
  core.log.length = 0;
  core.deliveries.length = 0;
}
