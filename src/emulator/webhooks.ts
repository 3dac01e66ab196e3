// Events and their delivery: each event is kept in the state and POSTed, signed as Stripe signs, to the
// webhook target at least once (retried on failure), as Stripe delivers.
import Stripe from 'stripe';
import { clock, trim, type Core } from './core.ts';
import { newId } from './http.ts';
import type { EmulatedEvent, PaymentIntent, Refund, WebhookTarget } from './state.ts';

/** The event a PaymentIntent's new status emits; none for the others. */
export const EVENT_FOR_STATUS: Record<string, string> = {
  succeeded: 'payment_intent.succeeded',
  requires_payment_method: 'payment_intent.payment_failed',
  canceled: 'payment_intent.canceled',
  processing: 'payment_intent.processing',
  requires_capture: 'payment_intent.amount_capturable_updated',
};

/** An event about `object`; one about a connected account's object names the account, as Connect webhooks do. */
export function newEvent(type: string, object: PaymentIntent | Refund, now: number, account: string | null): EmulatedEvent {
  return {
    id: newId('evt'),
    object: 'event',
    type,
    created: Math.floor(now / 1000),
    livemode: false,
    api_version: '2025-01-01',
    ...(account !== null ? { account } : {}),
    data: { object: structuredClone(object) },
  };
}

/** The PaymentIntent's event for its status, if webhooks are on. */
export async function emitIntent(core: Core, pi: PaymentIntent, account: string | null): Promise<void> {
  const type = EVENT_FOR_STATUS[pi.status];
  if (type) await emit(core, type, pi, account);
}

export async function emit(core: Core, type: string, object: PaymentIntent | Refund, account: string | null): Promise<void> {
  const target = await core.state.webhooks();
  if (!target) return;
  const event = newEvent(type, object, await clock(core), account);
  await core.state.addEvent(event);
  scheduleDelivery(core, event, target);
}

export function scheduleDelivery(core: Core, event: EmulatedEvent, target: WebhookTarget): void {
  later(core, () => deliverEvent(core, event, 1, true), target.delayMs ?? 0);
}

/** A delivery to come: forgotten when the server closes, and one that fails on the state (its database
 * gone) is dropped rather than crashing the process. */
function later(core: Core, deliver: () => Promise<unknown>, ms: number): void {
  const timer = setTimeout(() => {
    core.timers.delete(timer);
    deliver().catch(() => {});
  }, ms);
  core.timers.add(timer);
}

/** Sends an event again, as Stripe may: the receiver must acknowledge it without acting twice. */
export async function redeliver(core: Core, eventId: string): Promise<number | 'error'> {
  const event = await core.state.event(eventId);
  if (!event) throw new Error(`no event ${eventId}`);
  return deliverEvent(core, event, 1, false);
}

async function deliverEvent(core: Core, event: EmulatedEvent, attempt: number, retry: boolean): Promise<number | 'error'> {
  const target = await core.state.webhooks();
  if (!target) return 'error';
  const payload = JSON.stringify(event);
  const signature = Stripe.webhooks.generateTestHeaderString({ payload, secret: target.secret });
  let status: number | 'error';
  try {
    const res = await fetch(target.url, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Stripe-Signature': signature }, body: payload });
    status = res.status;
    await res.arrayBuffer();
  } catch {
    status = 'error';
  }
  core.deliveries.push({ eventId: event.id, type: event.type, attempt, status });
  trim(core, core.deliveries);
  const ok = typeof status === 'number' && status >= 200 && status < 300;
  if (!ok && retry && attempt < 3) later(core, () => deliverEvent(core, event, attempt + 1, true), 200 * attempt);
  return status;
}
